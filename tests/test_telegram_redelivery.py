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


async def test_a_long_answer_taken_in_part_is_completed_later_without_repeating_the_part_shown(
        tmp_path, fake_openai, tg):
    answer = "\n\n".join(f"Part {i} " + "text " * 150 for i in range(3))
    hold = asyncio.Event()
    fake_openai.script(Text(answer, chunk_size=60, delay=0.005, hold=hold))
    t = await telegram_harness(tmp_path, fake_openai, tg, limit=1000,
                               core={"redelivery_delays": (0.2, 0.4, 0.8, 1.6)})
    try:
        tg.fail("sendChatAction", status=403, description="Forbidden: bot was blocked by the user")  # plain only
        faults = [tg.fail("sendMessage", status=502, description="Bad Gateway", times=1_000_000,
                          when=lambda p: not p["text"].startswith("Part 0"))]
        tg.user_message("go")
        await t.release_after_typing(hold)
        await t.settle()  # the answer's first message was taken, the rest refused
        assert [x[:6] for x in tg.visible(CHAT)] == ["Part 0"]
        refused = refused_sends(tg)
        await t.wait_for(lambda: refused_sends(tg) > refused, timeout=10)  # a later try, refused as well
        recover(faults)
        await t.wait_for(lambda: len(tg.visible(CHAT)) >= 3, timeout=10)
        await t.wait_for(lambda: not retrying(), timeout=10)
        texts = tg.visible(CHAT)
        assert [x[:6] for x in texts] == ["Part 0", "Part 1", "Part 2"]  # each part once, in order
        assert "".join(texts).replace(" ", "").replace("\n", "") == answer.replace(" ", "").replace("\n", "")
        assert await undelivered(t) == []
    finally:
        await t.close()


@pytest.mark.parametrize("timed_out", ["fallback", "live_final"])
async def test_a_send_that_timed_out_is_repeated_once_never_again_by_a_fallback_or_a_background_try(
        tmp_path, fake_openai, tg, timed_out):
    # Telegram carries every send out but answers too late: the client times out, so each may have been
    # shown (there is no idempotency key). The call policy repeats the send once; nothing sends it again —
    # not the background tries, not a plain fallback after a live final whose send timed out — or the chat
    # would show the answer once per try for as long as the outage lasts.
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01, hold=hold))
    t = await telegram_harness(tmp_path, fake_openai, tg, call_timeout=0.3,
                               core={"redelivery_delays": (0.05, 0.05, 0.05)})
    try:
        tg.fail("sendChatAction", status=403, description="Forbidden: bot was blocked by the user")  # no preview
        if timed_out == "fallback":  # the live final is refused: the plain fallback is the first send that lands
            tg.fail("sendMessage", status=403, description="Forbidden: bot was blocked by the user")
        tg.fail("sendMessage", status=502, description="Bad Gateway", apply_first=True, hang=30.0,
                times=1_000_000)
        tg.user_message("capital of France?")
        await t.release_after_typing(hold)
        await t.settle()
        await t.wait_for(lambda: not retrying(), timeout=10)
        assert tg.visible(CHAT) == [SHOWN, SHOWN]  # the one repeat of a send that timed out; never more
        assert tg.count("sendMessage") == (3 if timed_out == "fallback" else 2)  # (a refused live final first)
        assert len(await undelivered(t)) == 1  # the next start sends it
    finally:
        await t.close()
