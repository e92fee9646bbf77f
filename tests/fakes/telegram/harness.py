"""A real ChatCore (SQLite, OpenAI SDK against the fake LLM) with the real TelegramChannel, talking
through the real aiogram client to ``FakeTelegram``. Short intervals, same code paths."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from channels.common.calls import CallPolicy, Calls
from channels.common.throttle import Clock, Throttle
from channels.telegram.channel import WEBHOOK_PATH, TelegramChannel, TelegramSettings
from channels.telegram.factory import make_bot
from core.media.transcribe import Transcriber
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.telegram.server import FakeTelegram
from tests.support.harness import Harness, make_harness

TEST_SETTINGS = TelegramSettings(edit_interval=0.1, first_chars=24, first_delay=0.2, poll_timeout=1,
                                 poll_backoff=(0.05, 0.1), stream_transport="edit", album_window=0.2,
                                 album_max_wait=2.0)


class TelegramHarness:
    def __init__(self, core_harness: Harness, channel: TelegramChannel, tg: FakeTelegram) -> None:
        self.h = core_harness
        self.core = core_harness.core
        self.channel = channel
        self.tg = tg
        self._closed = False
        self._runner: web.AppRunner | None = None

    async def serve_webhook(self) -> str:
        """Serve the channel's webhook route on 127.0.0.1 (until ``close``); its address."""
        app = web.Application()
        self.channel.routes(app)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return f"http://127.0.0.1:{self._runner.addresses[0][1]}{WEBHOOK_PATH}"

    async def wait_for(self, cond: Callable[[], Any], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("condition not reached in time")

    async def release_after_typing(self, hold: asyncio.Event) -> None:
        """Set ``hold`` (the model's reply held before its first words) once "typing…" was asked for: a
        turn shows it only when its first words take longer than ``typing_delay``."""
        await self.wait_for(lambda: self.tg.count("sendChatAction") > 0)
        hold.set()

    async def settle(self, timeout: float = 10.0) -> None:
        """Every queued update fetched and handed over (albums collected ones too), and the chain idle."""
        await self.wait_for(lambda: self.consumed() and not self.channel.albums.pending, timeout)
        await asyncio.sleep(0.05)  # let a just-submitted message reach its session
        await self.h.settle(timeout)

    def consumed(self) -> bool:
        """The poller has asked past every queued update (it was handed to core)."""
        if not self.tg.updates:
            return True
        last = max(u["update_id"] for u in self.tg.updates)
        return any(c.method == "getUpdates" and int(c.params.get("offset") or 0) > last for c in self.tg.calls)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.channel.stop()
        await self.core.shutdown()
        await self.channel.close()
        if self._runner is not None:
            await self._runner.cleanup()


async def telegram_harness(tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram, *,
                           clock: Clock | None = None, core: dict[str, Any] | None = None,
                           start: bool = True, limit: int = 4096, call_timeout: float | None = 5.0,
                           transcriber: Transcriber | None = None, connections: int = 100,
                           album_clock: Clock | None = None, **settings: Any) -> TelegramHarness:
    h = await make_harness(tmp_path, fake_openai, start=False, transcriber=transcriber, **(core or {}))
    s = dataclasses.replace(TEST_SETTINGS, **settings)
    bot = make_bot(tg.token, tg.base_url, connections=connections)
    calls = Calls(Throttle(clock=clock), CallPolicy(initial_wait=0.01, max_wait=0.05, timeout=call_timeout))
    channel = TelegramChannel(h.core.host_for("telegram"), bot, s, calls=calls, limit=limit,
                              album_clock=album_clock)
    h.core.add_channel(channel)
    await h.core.start()  # after the channel is registered: it tells chats about turns a crash interrupted
    th = TelegramHarness(h, channel, tg)
    if start:
        await channel.start()
        await asyncio.wait_for(channel.ready.wait(), 5)
    return th
