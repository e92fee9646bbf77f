"""A protocol-level fake of Feishu's long connection, driven by the real ``lark.ws.Client``.

The SDK first POSTs ``{"AppID", "AppSecret"}`` to ``<domain>/callback/ws/endpoint`` (with blocking
``requests``) and gets ``{"code": 0, "data": {"URL": "wss://…?device_id=…&service_id=…", "ClientConfig":
{"ReconnectCount", "ReconnectInterval", "ReconnectNonce", "PingInterval"}}}``; then it opens the WebSocket
and speaks protobuf ``pbbp2.Frame``s (the classes ship inside lark-oapi: ``lark_oapi.ws.pb.pbbp2_pb2``):

- control frames (``method`` 0) with header ``type`` = ``ping`` from the client every ``PingInterval``
  seconds, answered with ``pong`` (whose payload may carry a new ClientConfig);
- data frames (``method`` 1) from the server with headers ``type`` (``event``), ``message_id``, ``trace_id``,
  ``sum``/``seq`` (a payload split over several frames) and the event JSON as payload. Card callbacks
  (``card.action.trigger``) come the same way, as ``event`` frames;
- the client's ack: the same frame sent back with ``payload`` = ``{"code": 200|500, "data":
  base64(handler result JSON)}`` and a ``biz_rt`` header (handler time in ms). The ack is written after the
  handler returned; a handler that raises acks 500, and Feishu pushes the event again.

The fake records every ack, can redeliver an event (same ``message_id``, as Feishu does when no 200 ack came
in time), split payloads, answer pings, drop every connection (the client reconnects through the endpoint
again), and refuse new connections. It runs in its own thread (see ``server_thread``).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web
from lark_oapi.ws.const import (
    GEN_ENDPOINT_URI,
    HEADER_BIZ_RT,
    HEADER_MESSAGE_ID,
    HEADER_SEQ,
    HEADER_SUM,
    HEADER_TRACE_ID,
    HEADER_TYPE,
)
from lark_oapi.ws.enum import FrameType, MessageType
from lark_oapi.ws.pb.pbbp2_pb2 import Frame

from tests.fakes.feishu.server_thread import ServerThread


@dataclass
class Ack:
    message_id: str
    code: int
    data: Any
    """The handler's result (decoded JSON) — for a card callback, the toast/card response."""
    biz_rt: str | None
    at: float


@dataclass
class Pushed:
    message_id: str
    payload: bytes
    message_type: str
    deliveries: int = 0


@dataclass
class _Conn:
    ws: web.WebSocketResponse
    device_id: str
    pings: int = 0


@dataclass
class FakeLongConnection:
    app_id: str
    app_secret: str
    ping_interval: float = 120.0
    reconnect_interval: float = 0.05
    reconnect_count: int = -1
    reconnect_nonce: float = 0
    """Seconds of random delay before the first reconnect attempt (Feishu sends 30)."""
    service_id: int = 7
    pong_config: dict[str, Any] | None = None
    """A ClientConfig to send with every pong (the server may change the client's settings this way)."""
    acks: list[Ack] = field(default_factory=list)
    pushed: dict[str, Pushed] = field(default_factory=dict)
    endpoint_requests: int = 0
    connections_opened: int = 0
    refuse: int = 0
    """Endpoint answer code while refusing new connections: 0 accepts. 1 ("system busy") makes the SDK retry;
    any other code makes it give up (a client error)."""
    base_url: str = ""

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._conns: list[_Conn] = []
        self._server = ServerThread(self._app, name="fake-feishu-longconn")
        self._seq = itertools.count(1)

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> FakeLongConnection:
        self.base_url = self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(before=self._close_all)

    async def __aenter__(self) -> FakeLongConnection:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    # ---- driving it from a test --------------------------------------------------------------------

    @property
    def connected(self) -> int:
        with self._lock:
            return sum(1 for c in self._conns if not c.ws.closed)

    @property
    def pings(self) -> int:
        with self._lock:
            return sum(c.pings for c in self._conns)

    def push(self, payload: dict[str, Any] | bytes, *, message_type: str = MessageType.EVENT.value,
             parts: int = 1, message_id: str | None = None) -> str:
        """Send an event (or a card callback) to the connected client; returns the frame's message_id."""
        raw = payload if isinstance(payload, bytes) else json.dumps(payload, ensure_ascii=False).encode("utf-8")
        pushed = Pushed(message_id or secrets.token_hex(8), raw, message_type)
        with self._lock:
            self.pushed[pushed.message_id] = pushed
        self._server.call(lambda: self._deliver(pushed, parts))
        return pushed.message_id

    def redeliver(self, message_id: str, *, parts: int = 1) -> None:
        """Push the same frame again, as Feishu does when it got no successful ack in time."""
        with self._lock:
            pushed = self.pushed[message_id]
        self._server.call(lambda: self._deliver(pushed, parts))

    def acks_for(self, message_id: str) -> list[Ack]:
        with self._lock:
            return [a for a in self.acks if a.message_id == message_id]

    async def wait_ack(self, message_id: str, *, count: int = 1, timeout: float = 5.0) -> Ack:
        await self.wait_for(lambda: len(self.acks_for(message_id)) >= count, timeout, f"ack for {message_id}")
        return self.acks_for(message_id)[count - 1]

    async def wait_connected(self, count: int = 1, *, opened: int | None = None, timeout: float = 5.0) -> None:
        """Wait for ``count`` open connections (and, with ``opened``, that many ever opened)."""
        def ready() -> bool:
            return self.connected >= count and (opened is None or self.connections_opened >= opened)
        await self.wait_for(ready, timeout, f"{count} connection(s)")

    async def wait_pings(self, count: int, *, timeout: float = 5.0) -> None:
        await self.wait_for(lambda: self.pings >= count, timeout, f"{count} ping(s)")

    def disconnect(self) -> None:
        """Close every connection from the server side (a deploy, a network cut): the client reconnects."""
        self._server.call(self._close_all)

    @staticmethod
    async def wait_for(cond: Any, timeout: float = 5.0, what: str = "a condition") -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}")
            await asyncio.sleep(0.01)

    # ---- the protocol ------------------------------------------------------------------------------

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_post(GEN_ENDPOINT_URI, self._endpoint)
        app.router.add_get("/ws", self._ws)
        return app

    def _client_config(self) -> dict[str, Any]:
        return {"ReconnectCount": self.reconnect_count, "ReconnectInterval": self.reconnect_interval,
                "ReconnectNonce": self.reconnect_nonce, "PingInterval": self.ping_interval}

    async def _endpoint(self, request: web.Request) -> web.Response:
        body = json.loads(await request.read() or b"{}")
        with self._lock:
            self.endpoint_requests += 1
        if body.get("AppID") != self.app_id or body.get("AppSecret") != self.app_secret:
            return web.json_response({"code": 10014, "msg": "app secret invalid", "data": None})
        if self.refuse:
            return web.json_response({"code": self.refuse, "msg": "refused by the test", "data": None})
        device_id = secrets.token_hex(6)
        url = f"ws://127.0.0.1:{self._server.port}/ws?device_id={device_id}&service_id={self.service_id}"
        return web.json_response({"code": 0, "msg": "ok",
                                  "data": {"URL": url, "ClientConfig": self._client_config()}})

    async def _ws(self, request: web.Request) -> web.StreamResponse:
        # a stopped client never answers the close handshake: do not wait long for it
        ws = web.WebSocketResponse(timeout=0.2)
        await ws.prepare(request)
        conn = _Conn(ws, request.query.get("device_id", ""))
        with self._lock:
            self._conns.append(conn)
            self.connections_opened += 1
        async for msg in ws:
            if msg.type != WSMsgType.BINARY:
                continue
            frame = Frame()
            frame.ParseFromString(msg.data)
            headers = {h.key: h.value for h in frame.headers}
            if frame.method == FrameType.CONTROL.value and headers.get(HEADER_TYPE) == MessageType.PING.value:
                with self._lock:
                    conn.pings += 1
                await ws.send_bytes(self._pong(frame).SerializeToString())
            elif frame.method == FrameType.DATA.value:
                self._record_ack(headers, frame.payload)
        return ws

    def _pong(self, ping: Frame) -> Frame:
        pong = Frame()
        pong.SeqID, pong.LogID, pong.service, pong.method = 0, 0, ping.service, FrameType.CONTROL.value
        header = pong.headers.add()
        header.key, header.value = HEADER_TYPE, MessageType.PONG.value
        if self.pong_config is not None:
            pong.payload = json.dumps(self.pong_config).encode()
        return pong

    def _record_ack(self, headers: dict[str, str], payload: bytes) -> None:
        body = json.loads(payload or b"{}")
        data = body.get("data")
        decoded = json.loads(base64.b64decode(data)) if data else None
        ack = Ack(headers.get(HEADER_MESSAGE_ID, ""), int(body.get("code", 0)), decoded,
                  headers.get(HEADER_BIZ_RT), time.monotonic())
        with self._lock:
            self.acks.append(ack)

    async def _deliver(self, pushed: Pushed, parts: int) -> None:
        with self._lock:
            conns = [c for c in self._conns if not c.ws.closed]
            pushed.deliveries += 1
        if not conns:
            raise AssertionError("no client is connected")
        conn = conns[-1]  # cluster mode: one connection of the app gets each event
        size = max(1, -(-len(pushed.payload) // parts))
        chunks = [pushed.payload[i:i + size] for i in range(0, len(pushed.payload), size)] or [b""]
        trace_id = secrets.token_hex(8)
        for seq, chunk in enumerate(chunks):
            frame = Frame()
            frame.SeqID, frame.LogID = next(self._seq), 0
            frame.service, frame.method = self.service_id, FrameType.DATA.value
            for key, value in ((HEADER_TYPE, pushed.message_type), (HEADER_MESSAGE_ID, pushed.message_id),
                               (HEADER_TRACE_ID, trace_id), (HEADER_SUM, str(len(chunks))), (HEADER_SEQ, str(seq))):
                header = frame.headers.add()
                header.key, header.value = key, value
            frame.payload = chunk
            await conn.ws.send_bytes(frame.SerializeToString())

    async def _close_all(self) -> None:
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            if not conn.ws.closed:
                await conn.ws.close()
