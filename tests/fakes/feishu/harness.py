"""A real ChatCore (SQLite, OpenAI SDK against the fake LLM) with the real FeishuChannel, talking through the
real lark-oapi client to ``FakeFeishu``, and receiving over the long connection (``FakeLongConnection``
through the real ``lark.ws.Client``) or the webhook (``WebhookSender`` posting to the channel's route on a
127.0.0.1 server). Short intervals, same code paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from channels.common.calls import CallPolicy, Calls
from channels.common.throttle import Clock, Throttle
from channels.feishu.channel import FeishuChannel, FeishuSettings
from tests.fakes.feishu import events
from tests.fakes.feishu.longconn import FakeLongConnection
from tests.fakes.feishu.openapi import FakeFeishu, Message
from tests.fakes.feishu.webhook import Sent, WebhookSender
from tests.fakes.openai_server import FakeOpenAI
from tests.support.harness import Harness, make_harness

TOKEN = "vt_feishu_test_token_0001"
KEY = "ek_feishu_test_encrypt_key"
CHAT = "oc_group0001"
P2P = "oc_p2p0001"
ALICE = events.DEFAULT_USER
TEST_SETTINGS = FeishuSettings(stream_interval=0.1, first_chars=24, first_delay=0.2, press_wait=2.5,
                               setup_backoff=(0.05, 0.1), request_timeout=5.0)


class FeishuHarness:
    def __init__(self, h: Harness, channel: FeishuChannel, fake: FakeFeishu, mode: str,
                 conn: FakeLongConnection | None, sender: WebhookSender | None,
                 runner: web.AppRunner | None) -> None:
        self.h = h
        self.core = h.core
        self.channel = channel
        self.fake = fake
        self.mode = mode
        self.conn = conn
        self.sender = sender
        self._runner = runner
        self._closed = False

    async def wait_for(self, cond: Callable[[], Any], timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if cond():
                return
            await asyncio.sleep(0.005)
        raise AssertionError("condition not reached in time")

    def event(self, text: str, *, chat: str = CHAT, chat_type: str = "group", mention: bool = True,
              message: Message | None = None, sender: str = ALICE, event_id: str | None = None,
              thread: bool = False, parent: Message | None = None,
              mentions: list[events.Mention] | None = None, **kw: Any) -> tuple[Message, dict[str, Any]]:
        """A user's message as the fake records it, and the ``im.message.receive_v1`` body Feishu pushes."""
        msg = message or self.fake.user_message(chat, text, chat_type=chat_type, open_id=sender, thread=thread,
                                                parent_id=parent.message_id if parent else None)
        found = list(mentions or [])
        body = text
        if mention and chat_type == "group":
            found.insert(0, events.Mention(self.fake.bot_name, self.fake.bot_open_id))
            body = f"@_user_1 {text}"
        payload = events.message_event(
            body, token=TOKEN, app_id=self.fake.app_id, chat_id=msg.chat_id, chat_type=chat_type,
            message_id=msg.message_id, event_id=event_id, sender_open_id=sender, mentions=found or None,
            root_id=msg.root_id, parent_id=msg.parent_id, thread_id=msg.thread_id, **kw)
        return msg, payload

    async def deliver(self, payload: dict[str, Any]) -> Any:
        """Push the body the way this mode receives it; returns the ack (long connection) or the answer."""
        if self.conn is not None:
            frame = self.conn.push(payload)
            return await self.conn.wait_ack(frame)
        assert self.sender is not None
        return await self.sender.send(payload)

    async def say(self, text: str, **kw: Any) -> Message:
        msg, payload = self.event(text, **kw)
        await self.deliver(payload)
        return msg

    async def press(self, value: Any, *, message_id: str, chat: str = CHAT, operator: str = ALICE,
                    operator_user_id: str | None = "u_alice", event_id: str | None = None) -> dict[str, Any]:
        """Press a card button; returns the callback's answer (toast, card)."""
        payload = events.card_action_event(value, token=TOKEN, app_id=self.fake.app_id, message_id=message_id,
                                           chat_id=chat, operator_open_id=operator,
                                           operator_user_id=operator_user_id, event_id=event_id)
        answer = await self.deliver(payload)
        if isinstance(answer, Sent):
            assert answer.status == 200, answer
            return dict(answer.json())
        return dict(answer.data or {})

    async def settle(self, timeout: float = 10.0) -> None:
        """Every handed-over event taken by core (or its sender told it cannot be read), and the chain idle."""
        await self.wait_for(lambda: not any(t.get_name() in ("feishu:event", "feishu:unreadable")
                                            for t in asyncio.all_tasks()), timeout)
        await asyncio.sleep(0.05)
        await self.h.settle(timeout)

    def texts(self, chat: str = CHAT) -> list[str]:
        return self.fake.texts(chat)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self.channel.stop()
        await self.core.shutdown()
        await self.channel.close()
        if self._runner is not None:
            await self._runner.cleanup()


async def feishu_harness(tmp_path: Path, fake_openai: FakeOpenAI, fake: FakeFeishu, *, mode: str = "websocket",
                         conn: FakeLongConnection | None = None, clock: Clock | None = None,
                         core: dict[str, Any] | None = None, call_timeout: float | None = 5.0,
                         **settings: Any) -> FeishuHarness:
    h = await make_harness(tmp_path, fake_openai, start=False, **(core or {}))
    s = dataclasses.replace(TEST_SETTINGS, app_id=fake.app_id, app_secret=fake.app_secret, domain=fake.base_url,
                            mode=mode, verification_token=TOKEN, encrypt_key=KEY if mode == "webhook" else "",
                            connection_domain=conn.base_url if conn is not None else "", **settings)
    calls = Calls(Throttle(clock=clock), CallPolicy(initial_wait=0.01, max_wait=0.05, timeout=call_timeout))
    channel = FeishuChannel(h.core.host_for("feishu"), s, calls=calls)
    h.core.add_channel(channel)
    await h.core.start()
    runner = sender = None
    if mode == "webhook":
        app = web.Application()
        channel.routes(app)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = int(runner.addresses[0][1])
        sender = WebhookSender(f"http://127.0.0.1:{port}/feishu/events", TOKEN, fake.app_id, KEY)
    await channel.start()
    await asyncio.wait_for(channel.ready.wait(), 5)
    if conn is not None:
        await conn.wait_connected()
    return FeishuHarness(h, channel, fake, mode, conn, sender, runner)


MODES = ["websocket", "webhook"]


def every_mode(metafunc: Any) -> None:
    """A test module's ``pytest_generate_tests`` (assign it there): every test of the module that uses the
    ``feishu_bridge`` fixture runs once in each of MODES."""
    if "feishu_bridge" in metafunc.fixturenames:
        metafunc.parametrize("feishu_bridge", MODES, indirect=True)


@contextlib.asynccontextmanager
async def harnesses(mode: str, tmp_path: Path, fake_openai: FakeOpenAI,
                    fake: FakeFeishu) -> AsyncIterator[Callable[..., Awaitable[FeishuHarness]]]:
    """A factory of harnesses receiving in ``mode`` (one of MODES); every harness it made is closed, and
    every long connection it opened stopped, on the way out."""
    made: list[FeishuHarness] = []
    conns: list[FakeLongConnection] = []

    async def make(**kw: Any) -> FeishuHarness:
        conn = None
        if mode == "websocket":
            conn = FakeLongConnection(fake.app_id, fake.app_secret)
            await asyncio.to_thread(conn.start)
            conns.append(conn)
        t = await feishu_harness(tmp_path, fake_openai, fake, mode=mode, conn=conn, **kw)
        made.append(t)
        return t

    try:
        yield make
    finally:
        for t in made:
            await t.close()
        for c in conns:
            await asyncio.to_thread(c.stop)
