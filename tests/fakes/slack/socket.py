"""A fake of Slack's Socket Mode websocket, served by ``FakeSlack`` and driven by slack_sdk's Socket Mode client.

How the real thing goes, and what this fake does the same way:
- ``apps.connections.open`` (app-level token) hands out a ``ws://.../link/?ticket=...`` URL; a ticket opens
  one connection (a reused or unknown ticket is refused with 401);
- on connect the server sends ``{"type": "hello", "num_connections": n, ...}``;
- events arrive as envelopes ``{"envelope_id", "type": "events_api" | "interactive" | "slash_commands",
  "payload", "accepts_response_payload", "retry_attempt", "retry_reason"}``; the app acks with
  ``{"envelope_id": ..., "payload"?: ...}`` on the same socket (``acks`` records each, with its payload);
- an envelope not acked in time is delivered again with ``retry_attempt`` + 1 and a ``retry_reason``
  (``redeliver``; the test decides when, so nothing depends on a timer);
- ``{"type": "disconnect", "reason": "refresh_requested" | "warning" | "link_disabled"}`` asks the client to
  reconnect (it opens a new URL, then closes the old socket); ``drop`` closes the socket from the server side.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from aiohttp import WSMsgType, web

if TYPE_CHECKING:
    from tests.fakes.slack.server import FakeSlack


@dataclass
class Envelope:
    envelope_id: str
    type: str
    payload: dict[str, Any]
    accepts_response_payload: bool = False
    retry_attempt: int = 0
    retry_reason: str = ""
    deliveries: int = 0

    def frame(self) -> dict[str, Any]:
        out: dict[str, Any] = {"envelope_id": self.envelope_id, "type": self.type, "payload": self.payload,
                               "accepts_response_payload": self.accepts_response_payload}
        if self.type == "events_api":
            out["retry_attempt"] = self.retry_attempt
            out["retry_reason"] = self.retry_reason
        return out


@dataclass
class Ack:
    envelope_id: str
    payload: dict[str, Any] | None
    at: float
    connection: int


@dataclass
class Connection:
    number: int
    ws: web.WebSocketResponse
    opened_at: float
    closed: bool = False
    received: list[dict[str, Any]] = field(default_factory=list)


class FakeSocketMode:
    def __init__(self, slack: FakeSlack) -> None:
        self._slack = slack
        self._tickets: dict[str, bool] = {}
        self._ticket_seq = itertools.count(1)
        self._envelope_seq = itertools.count(1)
        self.connections: list[Connection] = []
        self.envelopes: dict[str, Envelope] = {}
        self.acks: dict[str, list[Ack]] = {}
        """Every ack per envelope id (more than one when a redelivered envelope is acked again)."""
        self.unknown_acks: list[dict[str, Any]] = []
        self.issued = 0
        self._changed = asyncio.Condition()
        self.on_frame: Callable[[Connection, dict[str, Any]], Awaitable[None]] | None = None

    # ---- server side -------------------------------------------------------------------------------

    def mount(self, app: web.Application) -> None:
        app.router.add_get("/link/", self._ws)

    def issue_url(self) -> str:
        ticket = f"tk{next(self._ticket_seq)}"
        self._tickets[ticket] = False
        self.issued += 1
        return f"{self._slack.base.replace('http://', 'ws://')}/link/?ticket={ticket}&app_id={self._slack.app_id}"

    async def _ws(self, request: web.Request) -> web.StreamResponse:
        ticket = request.query.get("ticket", "")
        if self._tickets.get(ticket, True):  # unknown or already used
            return web.Response(status=401, text="invalid ticket")
        self._tickets[ticket] = True
        ws = web.WebSocketResponse(autoping=True)
        await ws.prepare(request)
        conn = Connection(len(self.connections) + 1, ws, time.monotonic())
        self.connections.append(conn)
        await ws.send_json({"type": "hello", "num_connections": len(self.open_connections()),
                            "debug_info": {"host": "fake-slack", "build_number": 1,
                                           "approximate_connection_time": 18060},
                            "connection_info": {"app_id": self._slack.app_id}})
        await self._notify()
        try:
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                try:
                    frame = json.loads(msg.data)
                except json.JSONDecodeError:
                    continue
                conn.received.append(frame)
                envelope_id = frame.get("envelope_id")
                if envelope_id in self.envelopes:
                    self.acks.setdefault(envelope_id, []).append(
                        Ack(envelope_id, frame.get("payload"), time.monotonic(), conn.number))
                else:
                    self.unknown_acks.append(frame)
                if self.on_frame is not None:
                    await self.on_frame(conn, frame)
                await self._notify()
        finally:
            conn.closed = True
            await self._notify()
        return ws

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def _wait(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        async def waiting() -> None:
            async with self._changed:
                await self._changed.wait_for(predicate)
        try:
            await asyncio.wait_for(waiting(), timeout)
        except TimeoutError:
            raise AssertionError(f"Socket Mode fake: {what} not reached within {timeout}s") from None

    async def close(self) -> None:
        for conn in self.connections:
            if not conn.closed:
                await conn.ws.close()

    # ---- driving it from a test --------------------------------------------------------------------

    def open_connections(self) -> list[Connection]:
        return [c for c in self.connections if not c.closed and not c.ws.closed]

    @property
    def current(self) -> Connection | None:
        """The newest open connection (where Slack sends envelopes)."""
        open_ = self.open_connections()
        return open_[-1] if open_ else None

    async def wait_connected(self, count: int = 1, timeout: float = 5.0) -> Connection:
        """Wait until ``count`` connections were opened in total, and one is open; returns the newest."""
        await self._wait(lambda: len(self.connections) >= count and self.current is not None, timeout,
                         f"{count} connection(s)")
        conn = self.current
        assert conn is not None
        return conn

    def envelope(self, payload: dict[str, Any], type: str = "events_api") -> Envelope:
        envelope_id = f"env-{next(self._envelope_seq):06d}"
        env = Envelope(envelope_id, type, payload, accepts_response_payload=type == "slash_commands")
        self.envelopes[envelope_id] = env
        return env

    async def deliver(self, payload: dict[str, Any], type: str = "events_api", *, timeout: float = 5.0) -> Envelope:
        """Send ``payload`` to the app in a new envelope (waits for an open connection)."""
        env = self.envelope(payload, type)
        await self.send(env, timeout=timeout)
        return env

    async def send(self, env: Envelope, *, timeout: float = 5.0) -> None:
        conn = await self.wait_connected(timeout=timeout)
        env.deliveries += 1
        await conn.ws.send_json(env.frame())

    async def redeliver(self, env: Envelope, reason: str = "timeout", *, timeout: float = 5.0) -> None:
        """Deliver ``env`` again, as Slack does when it got no ack in time."""
        env.retry_attempt += 1
        env.retry_reason = reason
        await self.send(env, timeout=timeout)

    async def wait_acked(self, env: Envelope, timeout: float = 5.0, count: int = 1) -> Ack:
        await self._wait(lambda: len(self.acks.get(env.envelope_id, [])) >= count, timeout,
                         f"ack of {env.envelope_id}")
        return self.acks[env.envelope_id][count - 1]

    def acked(self, env: Envelope) -> bool:
        return bool(self.acks.get(env.envelope_id))

    async def disconnect(self, reason: str = "refresh_requested") -> None:
        """Ask the client to reconnect, as Slack does before it recycles a connection."""
        conn = self.current
        if conn is None:
            raise AssertionError("no open Socket Mode connection")
        await conn.ws.send_json({"type": "disconnect", "reason": reason, "debug_info": {"host": "fake-slack"}})

    async def drop(self) -> None:
        """Close the newest connection from the server side (a network drop or server restart)."""
        conn = self.current
        if conn is None:
            raise AssertionError("no open Socket Mode connection")
        await conn.ws.close(code=1001, message=b"going away")
