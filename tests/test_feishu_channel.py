"""The Feishu channel end to end: the real chain (SQLite, the OpenAI SDK against the fake LLM) and the real
FeishuChannel (lark-oapi) against the fake Open API, receiving over the long connection (the real
``lark.ws.Client`` against the fake) and over the webhook (signed, encrypted requests). Each test asserts
what the chat shows."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.fakes.feishu import FakeFeishu, FakeLongConnection
from tests.fakes.feishu.harness import CHAT, FeishuHarness, feishu_harness
from tests.fakes.openai_server import FakeOpenAI, Text

ANSWER = "The capital of France is **Paris**, a city on the Seine."

MODES = ["websocket", "webhook"]


@pytest.fixture
async def fake() -> AsyncIterator[FakeFeishu]:
    async with FakeFeishu() as f:
        f.chat(CHAT)
        yield f


@pytest.fixture(params=MODES)
async def bridge(request: Any, tmp_path: Any, fake_openai: FakeOpenAI, fake: FakeFeishu) -> AsyncIterator[Any]:
    """A factory of harnesses in the parametrised mode (one at a time; the last one is closed at the end)."""
    made: list[FeishuHarness] = []
    conns: list[FakeLongConnection] = []

    async def make(**kw: Any) -> FeishuHarness:
        conn = None
        if request.param == "websocket":
            conn = FakeLongConnection(fake.app_id, fake.app_secret)
            await asyncio.to_thread(conn.start)
            conns.append(conn)
        t = await feishu_harness(tmp_path, fake_openai, fake, mode=request.param, conn=conn, **kw)
        made.append(t)
        return t

    yield make
    for t in made:
        await t.close()
    for c in conns:
        await asyncio.to_thread(c.stop)


async def test_a_reply_streams_into_one_card_and_ends_closed(bridge, fake_openai, fake):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.02))
    t = await bridge()
    asked = await t.say("capital of France?")
    await t.settle()
    [msg] = fake.shown(CHAT)
    assert msg.parent_id == asked.message_id  # a reply to the user's message
    card = fake.card_of(msg)
    assert card is not None and card.text == ANSWER and not card.streaming
    assert card.sequences == sorted(set(card.sequences))
    assert fake.count("message.reply") == 1 and fake.count("message.create") == 0
    assert not fake.messages[asked.message_id].reactions  # the working reaction is gone
    assert fake.count("reaction.create") == 1
