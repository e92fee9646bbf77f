"""Builds a real ChatCore (SQLite store, OpenAI provider against the fake server, test channel)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path
from typing import Any

from core.events import CoreEvent, TurnCommitted
from core.leadership import Leadership
from core.leases import SessionLeases
from core.llm.anthropic_provider import AnthropicProvider
from core.llm.openai_provider import OpenAIProvider
from core.media.transcribe import Transcriber
from core.runtime import ChatCore
from core.settings import CoreSettings
from core.sqlite_store import SqliteStore
from core.store import Store
from core.tools.base import ToolRegistry
from tests.fakes.anthropic_server import FakeAnthropic
from tests.fakes.openai_server import FakeOpenAI
from tests.support.channel import FakePlatform, TestChannel

API_KEY = "sk-test-SECRET-0123456789"

FAST = CoreSettings(
    retry_delays=(0.01, 0.02),
    request_timeout=10.0,  # a held model request outlasts a loaded host; a test of the silence bound sets its own
    sink_open_timeout=0.3,
    delivery_wait_timeout=3.0,
    shutdown_timeout=4.0,
    titles=False,
    session_idle_seconds=30.0,
)


class Harness:
    def __init__(self, core: ChatCore, channel: TestChannel, fake: FakeOpenAI, store: Store,
                 db_path: Path | None = None) -> None:
        self.core = core
        self.channel = channel
        self.fake = fake
        self.store = store
        self.db_path = db_path
        """The database file, when the harness made the store."""
        self.events: list[CoreEvent] = []
        core.events.subscribe(self.events.append)

    @property
    def platform(self):  # type: ignore[no-untyped-def]
        return self.channel.platform

    async def say(self, text: str, **kw: Any):  # type: ignore[no-untyped-def]
        return await self.core.submit(self.channel.envelope(text, **kw))

    def commits(self, key: str | None = None) -> list[TurnCommitted]:
        return [e for e in self.events if isinstance(e, TurnCommitted) and (key is None or e.session_key == key)]

    async def settle(self, timeout: float = 10.0) -> None:
        """Wait until no session has a running turn or queued message (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            if self.core.sessions.idle() and not any(
                    t.get_name().startswith(("command:", "busy:", "sink:")) for t in asyncio.all_tasks()):
                return
        raise AssertionError("chat did not settle in time")

    async def wait_for(self, cond, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("condition not reached in time")


async def make_harness(tmp_path: Path, fake: FakeOpenAI, *, store: Store | None = None,
                       tools: ToolRegistry | None = None, start: bool = True,
                       platform: FakePlatform | None = None, transcriber: Transcriber | None = None,
                       leadership: Leadership | None = None, leases: SessionLeases | None = None,
                       **settings: Any) -> Harness:
    """``start=False``: the caller registers more channels, then starts the core (which reports turns a
    previous process left running through them). ``platform``: the chats of an earlier harness, for a
    restart on the same database. Attachments are stored in ``tmp_path / "media"``. ``leases``: shared ones,
    for several cores on one PostgreSQL database (each its own process in production)."""
    s = dataclasses.replace(FAST, **settings)
    db_path = None if store is not None else tmp_path / "chat.db"
    store = store or SqliteStore(tmp_path / "chat.db")
    provider = OpenAIProvider(model="fake-model", base_url=fake.base_url, api_key=API_KEY,
                              request_timeout=s.request_timeout)
    core = ChatCore(store=store, provider=provider, settings=s, tools=tools, media_dir=tmp_path / "media",
                    transcriber=transcriber, leadership=leadership, leases=leases)
    channel = TestChannel(platform=platform)
    core.add_channel(channel)
    if start:
        await core.start()
    harness = Harness(core, channel, fake, store, db_path)
    LIVE.append(harness)
    return harness


async def anthropic_harness(tmp_path: Path, fake: FakeAnthropic, *, tools: ToolRegistry | None = None,
                            api_key: str = "sk-ant-test", **settings: Any) -> Harness:
    """``make_harness`` with the Anthropic provider against the fake Anthropic API."""
    s = dataclasses.replace(FAST, **settings)
    provider = AnthropicProvider("claude-test", fake.base_url, api_key, request_timeout=s.request_timeout)
    core = ChatCore(store=SqliteStore(tmp_path / "chat.db"), provider=provider, settings=s, tools=tools,
                    media_dir=tmp_path / "media")
    channel = TestChannel()
    core.add_channel(channel)
    await core.start()
    harness = Harness(core, channel, fake, core.store)  # type: ignore[arg-type]
    LIVE.append(harness)
    return harness


LIVE: list[Harness] = []
"""Harnesses made by the running test; conftest shuts down what a failing test left running (otherwise
the store's database threads would keep the test process from exiting)."""


async def shutdown_leftovers() -> None:
    while LIVE:
        harness = LIVE.pop()
        if not harness.core.router.closed:
            await harness.core.shutdown()
