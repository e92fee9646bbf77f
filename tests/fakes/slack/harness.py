"""A real ChatCore (SQLite, OpenAI SDK against the fake LLM) with the real SlackChannel, talking through the
real slack-bolt / slack_sdk to ``FakeSlack``, in Socket Mode or in HTTP mode (an aiohttp server on 127.0.0.1
serving ``/slack/events``). Short intervals, same code paths.

``deliver(body)`` hands an Events API body to the app the way the mode does (a Socket Mode envelope, or a
signed POST) and returns once the app acknowledged it (``Delivery.acked``)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from aiohttp import web

from channels.common.calls import CallPolicy, Calls
from channels.common.throttle import Clock, Throttle
from channels.slack.channel import SlackChannel, SlackSettings
from channels.slack.factory import make_client
from tests.fakes.openai_server import FakeOpenAI
from tests.fakes.slack.sender import EventSender, Sent
from tests.fakes.slack.server import FakeSlack
from tests.fakes.slack.socket import Envelope
from tests.support.harness import Harness, make_harness

Mode = Literal["socket", "http"]
TEST_SETTINGS = SlackSettings(chat_interval=0.1, workspace_interval=0.0, first_chars=24, first_delay=0.2,
                              connect_timeout=3.0, ping_interval=10.0, health_every=0.1, backoff=(0.05, 0.1),
                              stream_transport="update", thinking_delay=0.0, thinking_interval=0.0,
                              workspace_updates=None)
"""The thinking indicator at once and without a workspace budget, no budget of updates as Slack counts them
(tests of these pass them explicitly)."""


@dataclass
class Delivery:
    acked: bool
    envelope: Envelope | None = None
    sent: Sent | None = None


class SlackHarness:
    def __init__(self, core_harness: Harness, channel: SlackChannel, slack: FakeSlack, mode: Mode,
                 runner: web.AppRunner | None, url: str) -> None:
        self.h = core_harness
        self.core = core_harness.core
        self.channel = channel
        self.slack = slack
        self.mode = mode
        self.runner = runner
        self.url = url
        self.sender = EventSender(url, slack.signing_secret) if url else None
        self._closed = False

    async def deliver(self, body: dict[str, Any], *, retry_num: int | None = None,
                      kind: str = "events_api", ack_timeout: float = 3.0) -> Delivery:
        """Deliver ``body`` and wait for the app's answer. Socket Mode: ``acked`` is whether the envelope was
        acknowledged within 3 s; HTTP: whether the answer was 200."""
        if self.mode == "socket":
            env = await self.slack.socket.deliver(body, kind)
            try:
                await self.slack.socket.wait_acked(env, timeout=ack_timeout)
            except (AssertionError, TimeoutError):
                return Delivery(False, envelope=env)
            return Delivery(True, envelope=env)
        assert self.sender is not None
        if kind == "interactive":
            sent = await self.sender.interaction(body)
        elif kind == "slash_commands":
            sent = await self.sender.command(body)
        else:
            sent = await self.sender.event(body, retry_num=retry_num)
        return Delivery(sent.status == 200, sent=sent)

    async def redeliver(self, first: Delivery, body: dict[str, Any]) -> Delivery:
        """Slack delivers the same event again: the same envelope (Socket Mode), or a retry with the same
        event_id and ``X-Slack-Retry-Num: 1`` (HTTP)."""
        if self.mode == "socket":
            assert first.envelope is not None
            acks = len(self.slack.socket.acks.get(first.envelope.envelope_id, []))
            await self.slack.socket.redeliver(first.envelope)
            try:
                await self.slack.socket.wait_acked(first.envelope, timeout=3.0, count=acks + 1)
            except (AssertionError, TimeoutError):
                return Delivery(False, envelope=first.envelope)
            return Delivery(True, envelope=first.envelope)
        return await self.deliver(body, retry_num=1)

    async def press(self, payload: dict[str, Any]) -> Delivery:
        return await self.deliver(payload, kind="interactive")

    async def wait_for(self, cond: Callable[[], Any], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("condition not reached in time")

    async def settle(self, timeout: float = 10.0) -> None:
        await asyncio.sleep(0.05)
        await self.h.settle(timeout)
        await asyncio.sleep(0.05)  # supervised follow-ups of a press (the message update)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.channel.stop()
        await self.core.shutdown()
        await self.channel.close()
        if self.runner is not None:
            await self.runner.cleanup()


async def slack_harness(tmp_path: Path, fake_openai: FakeOpenAI, slack: FakeSlack, mode: Mode = "socket", *,
                        clock: Clock | None = None, core: dict[str, Any] | None = None, start: bool = True,
                        call_timeout: float | None = 5.0, platform: Any = None,
                        **settings: Any) -> SlackHarness:
    h = await make_harness(tmp_path, fake_openai, start=False, platform=platform, **(core or {}))
    s = dataclasses.replace(TEST_SETTINGS, mode=mode, **settings)
    calls = Calls(Throttle(clock=clock), CallPolicy(initial_wait=0.01, max_wait=0.05, timeout=call_timeout))
    channel = SlackChannel(h.core.host_for("slack"), make_client(slack.bot_token, slack.base_url), s,
                           app_token=slack.app_token, signing_secret=slack.signing_secret, calls=calls)
    h.core.add_channel(channel)
    runner: web.AppRunner | None = None
    url = ""
    if mode == "http":
        app = web.Application()
        channel.routes(app)
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/slack/events"
    await h.core.start()
    sh = SlackHarness(h, channel, slack, mode, runner, url)
    if start:
        await channel.start()
        await asyncio.wait_for(channel.ready.wait(), 5)
    return sh
