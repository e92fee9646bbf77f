"""A real web chat for tests: ChatCore (SQLite, OpenAI provider against the fake server) + the web channel
on an aiohttp server at 127.0.0.1 (ephemeral port), and a small SSE client that keeps the raw bytes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from channels.web.channel import WebChannel
from channels.web.factory import build
from channels.web.server import WebAccess
from channels.web.sse import StreamHub
from core.bus import ClusterBus
from core.llm.openai_provider import OpenAIProvider
from core.llm.provider import LLMToolSpec
from core.runtime import ChatCore
from core.sqlite_store import SqliteStore
from core.store import Store
from core.tools.base import ApprovalPolicy, ToolContext, ToolRegistry
from tests.fakes.openai_server import FakeOpenAI
from tests.support.harness import FAST
from tests.support.tools import QUERY, SpecTool


class RecordingTool(SpecTool):
    """A small test tool: returns ``result`` and records every call's arguments (ask by default)."""

    def __init__(self, name: str = "lookup", result: str = "42 apples",
                 approval: ApprovalPolicy | None = "ask") -> None:
        super().__init__(LLMToolSpec(name, f"the {name} test tool", QUERY), approval)
        self.result = result
        self.calls: list[dict[str, Any]] = []

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        self.calls.append(arguments)
        return self.result


def registry(*tools: RecordingTool) -> ToolRegistry:
    reg = ToolRegistry(default_policy="ask")
    reg.extend(tools)
    return reg


class WebChat:
    def __init__(self, core: ChatCore, channel: WebChannel, runner: web.AppRunner, base_url: str) -> None:
        self.core = core
        self.channel = channel
        self.runner = runner
        self.base_url = base_url

    @property
    def hub(self) -> StreamHub:
        return self.channel.hub

    async def close(self) -> None:
        await self.channel.stop()
        await self.core.shutdown()
        await self.channel.close()
        await self.runner.cleanup()


async def start_web_chat(tmp_path: Path, fake: FakeOpenAI, *, auth_token: str = "", hub: StreamHub | None = None,
                         update_interval: float = 0.05, tools: ToolRegistry | None = None,
                         access: WebAccess | None = None, reap_interval: float = 1.0,
                         store: Store | None = None, bus: ClusterBus | None = None, **settings: Any) -> WebChat:
    # A browser test holds a reply mid-stream across page steps (clicks, reloads) that take seconds on a loaded
    # machine; the harness's 1 s bound on the model's silence would time such a reply out and retry it (the
    # silence bound has its own tests), so the page's tests get a bound no page step comes near.
    s = dataclasses.replace(FAST, **{"request_timeout": 60.0, **settings})
    provider = OpenAIProvider(model="fake-model", base_url=fake.base_url, api_key="sk-test",
                              request_timeout=s.request_timeout)
    core = ChatCore(store=store or SqliteStore(tmp_path / "chat.db"), provider=provider, settings=s, tools=tools,
                    media_dir=tmp_path / "media", bus=bus)
    if access is None:
        access = WebAccess(auth_token=auth_token)
    return await serve_web_chat(core, access=access, hub=hub, update_interval=update_interval,
                                reap_interval=reap_interval)


async def serve_web_chat(core: ChatCore, **channel_options: Any) -> WebChat:
    """``core``'s web chat served on 127.0.0.1 (an ephemeral port), the core started; ``channel_options`` go to
    the channel's ``build``."""
    app = web.Application()
    channel = build(core.host_for("web"), app, **channel_options)
    core.add_channel(channel)
    await core.start()
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=2)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    await channel.start()
    return WebChat(core, channel, runner, f"http://127.0.0.1:{runner.addresses[0][1]}")


@dataclass
class Event:
    name: str
    data: Any
    id: str | None
    raw: bytes


@dataclass
class SSEClient:
    """Reads one SSE response; ``nbytes`` counts every byte received on the wire body."""

    resp: aiohttp.ClientResponse
    events: list[Event] = field(default_factory=list)
    nbytes: int = 0
    comments: int = 0
    _buf: bytes = b""

    async def next(self, timeout: float = 10.0) -> Event:
        async with asyncio.timeout(timeout):
            while True:
                sep = self._buf.find(b"\n\n")
                if sep >= 0:
                    block, self._buf = self._buf[:sep + 2], self._buf[sep + 2:]
                    ev = _parse(block)
                    if ev is None:
                        self.comments += block.startswith(b":")
                        continue
                    self.events.append(ev)
                    return ev
                chunk = await self.resp.content.readany()
                if not chunk:
                    raise EOFError("stream ended")
                self.nbytes += len(chunk)
                self._buf += chunk

    async def until(self, pred: Any, timeout: float = 10.0) -> Event:
        while True:
            ev = await self.next(timeout)
            if pred(ev):
                return ev


def _parse(block: bytes) -> Event | None:
    name, data, eid = "message", [], None
    for line in block.decode().split("\n"):
        if not line or line.startswith(":"):
            continue
        key, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if key == "event":
            name = value
        elif key == "data":
            data.append(value)
        elif key == "id":
            eid = value
    if not data:
        return None
    return Event(name, json.loads("\n".join(data)), eid, block)


async def new_session(http: aiohttp.ClientSession, base: str) -> str:
    """A new web chat session's id (``POST /api/sessions``)."""
    async with http.post(f"{base}/api/sessions") as resp:
        assert resp.status == 201
        return str((await resp.json())["id"])


async def open_stream(http: aiohttp.ClientSession, base: str, sid: str, last_event_id: str | None = None,
                      headers: dict[str, str] | None = None) -> SSEClient:
    h = dict(headers or {})
    if last_event_id is not None:
        h["Last-Event-ID"] = last_event_id
    resp = await http.get(f"{base}/api/sessions/{sid}/stream", headers=h)
    assert resp.status == 200, resp.status
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return SSEClient(resp)


def seq_of(event_id: str) -> tuple[str, int]:
    epoch, _, seq = event_id.rpartition("-")
    return epoch, int(seq)
