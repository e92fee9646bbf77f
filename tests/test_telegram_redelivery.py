"""A reply is never lost: when Telegram refuses every send and edit for longer than the call policy tries,
the turn is not counted as delivered; its answer is sent again later, in the running process or after a
restart, and the chat shows it exactly once.

The real chain (SQLite, the OpenAI SDK against the fake LLM) and the real Telegram channel (aiogram)
against the fake Bot API; the assertions are what the chat shows."""

from __future__ import annotations

import asyncio

import pytest

from tests.fakes.openai_server import Text
from tests.fakes.telegram import FakeTelegram, Fault
from tests.fakes.telegram.harness import TelegramHarness, telegram_harness

CHAT = 555
ANSWER = "The capital of France is **Paris**, a city on the Seine."
SHOWN = "The capital of France is Paris, a city on the Seine."
BOLD = [{"type": "bold", "offset": 25, "length": 5}]


@pytest.fixture
async def tg():
    async with FakeTelegram() as fake:
        yield fake


def outage(tg: FakeTelegram) -> list[Fault]:
    """Telegram answers 502 to every send and edit until the faults are lifted."""
    return [tg.fail(method, status=502, description="Bad Gateway", times=1_000_000)
            for method in ("sendMessage", "editMessageText")]


def recover(faults: list[Fault]) -> None:
    for fault in faults:
        fault.times = 0


def refused_sends(tg: FakeTelegram) -> int:
    return sum(1 for c in tg.calls if c.method == "sendMessage" and c.status == 502)


def retrying() -> bool:
    return any(t.get_name().startswith("redeliver:") for t in asyncio.all_tasks())


async def undelivered(t: TelegramHarness) -> list[str]:
    return [u.turn.turn_id for u in await t.core.store.undelivered_turns(0)]


async def test_an_answer_telegram_refused_for_a_while_is_shown_once_when_it_recovers(tmp_path, fake_openai, tg):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"redelivery_delays": (0.2, 0.4, 0.8, 1.6)})
    try:
        faults = outage(tg)
        tg.user_message("capital of France?")
        await t.settle()  # the turn ended: its final update and its one fallback were both refused
        assert tg.visible(CHAT) == []
        assert len(await undelivered(t)) == 1
        refused = refused_sends(tg)
        await t.wait_for(lambda: refused_sends(tg) > refused, timeout=10)  # a later try, refused as well
        recover(faults)
        await t.wait_for(lambda: tg.visible(CHAT), timeout=10)
        await t.wait_for(lambda: not retrying(), timeout=10)  # the retries ended with the delivery
        [msg] = tg.messages(CHAT)
        assert (msg.text, msg.entities) == (SHOWN, BOLD)
        assert await undelivered(t) == []
    finally:
        await t.close()


async def test_an_answer_refused_until_a_restart_is_shown_once_after_it(tmp_path, fake_openai, tg):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"redelivery_delays": (60.0,)})
    try:
        faults = outage(tg)
        tg.user_message("capital of France?")
        await t.settle()
        assert tg.visible(CHAT) == [] and retrying()
    finally:
        await t.close()  # the bridge stops while the answer waits for its next try
    recover(faults)

    t = await telegram_harness(tmp_path, fake_openai, tg)  # the start sends what was not delivered
    try:
        [msg] = tg.messages(CHAT)
        assert (msg.text, msg.entities) == (SHOWN, BOLD)
        assert await undelivered(t) == []
    finally:
        await t.close()

    sends = tg.count("sendMessage")
    t = await telegram_harness(tmp_path, fake_openai, tg)  # a delivered answer is never sent again
    try:
        await t.settle()
        assert tg.visible(CHAT) == [SHOWN]
        assert tg.count("sendMessage") == sends
        assert len(fake_openai.requests) == 1
    finally:
        await t.close()
