"""A send Telegram may have carried out is never sent again and again; one it refused is never lost.

Telegram has no idempotency key: a ``sendMessage`` that failed in a way that may have happened after the
message was posted (a 500, a 504, an answer that cannot be read) is repeated at most once, and no fallback or
background try follows it. A gateway answering that Telegram's servers are unreachable (502, 503, as JSON or as
an HTML page) took nothing: the answer is sent again later and shown once. A group upgraded to a supergroup
gets its reply in the new chat.

The real chain (SQLite, the OpenAI SDK against the fake LLM) and the real Telegram channel (aiogram) against the
fake Bot API; the assertions are what the chat shows."""

from __future__ import annotations

import asyncio

import pytest

from tests.fakes.openai_server import Text
from tests.fakes.telegram.harness import TelegramHarness, telegram_harness

CHAT = 555
ANSWER = "The capital of France is **Paris**, a city on the Seine."
SHOWN = "The capital of France is Paris, a city on the Seine."

GATEWAY_PAGE = "<html><head><title>{0}</title></head><body><center><h1>{0}</h1></center></body></html>"


def retrying() -> bool:
    return any(t.get_name().startswith("redeliver:") for t in asyncio.all_tasks())


async def undelivered(t: TelegramHarness) -> list[str]:
    return [u.turn.turn_id for u in await t.core.store.undelivered_turns(0)]


MAYBE_POSTED = {
    "504 Gateway Timeout": {"status": 504, "description": "Gateway Timeout"},
    "500 Internal Server Error": {"status": 500, "description": "Internal Server Error"},
    "a gateway's 504 page": {"status": 504, "body": GATEWAY_PAGE.format("504 Gateway Time-out")},
    "an unreadable answer to an error": {"status": 500, "body": '{"ok": false, "error_code": 5',
                                         "content_type": "application/json"},
}


@pytest.mark.parametrize("answer", list(MAYBE_POSTED))
async def test_a_send_answered_by_a_server_error_is_repeated_once_and_never_again(tmp_path, fake_openai, tg, answer):
    # Telegram posts every message and then answers with an error: each try may have been shown. The call
    # policy repeats the send once; nothing sends it again (not the fallback, not a background try), or the
    # chat would show the answer once per try for as long as the fault lasts.
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01, hold=hold))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"redelivery_delays": (0.05, 0.05, 0.05)})
    try:
        tg.fail("sendChatAction", status=403, description="Forbidden: bot was blocked by the user")  # no preview
        tg.fail("sendMessage", apply_first=True, times=1_000_000, **MAYBE_POSTED[answer])
        tg.user_message("capital of France?")
        await t.release_after_typing(hold)
        await t.settle()
        await t.wait_for(lambda: not retrying(), timeout=10)
        assert tg.visible(CHAT) == [SHOWN, SHOWN]  # the one repeat; never more
        assert tg.count("sendMessage") == 2
        assert len(await undelivered(t)) == 1  # the next start sends it
    finally:
        await t.close()


async def test_a_send_whose_answer_says_it_was_done_but_cannot_be_read_is_not_repeated(tmp_path, fake_openai, tg):
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01, hold=hold))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"redelivery_delays": (0.05, 0.05, 0.05)})
    try:
        tg.fail("sendChatAction", status=403, description="Forbidden: bot was blocked by the user")  # no preview
        tg.fail("sendMessage", status=200, body='{"ok": true, "result": {"message_id": 1, "da',
                content_type="application/json", apply_first=True)
        tg.user_message("capital of France?")
        await t.release_after_typing(hold)
        await t.settle()
        await t.wait_for(lambda: not retrying(), timeout=10)
        assert tg.visible(CHAT) == [SHOWN]
        assert tg.count("sendMessage") == 1
    finally:
        await t.close()


@pytest.mark.parametrize("page", [True, False], ids=["a gateway's page", "Telegram's JSON"])
@pytest.mark.parametrize("status", [502, 503])
async def test_an_answer_refused_while_telegram_is_unreachable_is_shown_once_when_it_is_back(
        tmp_path, fake_openai, tg, status, page):
    # a gateway in front of Telegram's servers answers 502/503 when they are down: nothing was posted, so the
    # answer is sent again in the background until it lands
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"redelivery_delays": (0.2, 0.4, 0.8, 1.6)})
    try:
        title = f"{status} {'Bad Gateway' if status == 502 else 'Service Unavailable'}"
        fault = {"body": GATEWAY_PAGE.format(title)} if page else {"description": title[4:]}
        faults = [tg.fail(method, status=status, times=1_000_000, **fault)  # type: ignore[arg-type]
                  for method in ("sendMessage", "editMessageText")]
        tg.user_message("capital of France?")
        await t.settle()
        assert tg.visible(CHAT) == []
        refused = tg.count("sendMessage")
        await t.wait_for(lambda: tg.count("sendMessage") > refused, timeout=10)  # a background try
        for f in faults:
            f.times = 0
        await t.wait_for(lambda: tg.visible(CHAT), timeout=10)
        await t.wait_for(lambda: not retrying(), timeout=10)
        assert tg.visible(CHAT) == [SHOWN]
        assert await undelivered(t) == []
    finally:
        await t.close()


async def test_a_group_upgraded_to_a_supergroup_gets_its_reply_in_the_new_chat(tmp_path, fake_openai, tg):
    group, supergroup = -4242, -1004242
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01, hold=hold), Text("Lyon is second.", chunk_size=4))
    t = await telegram_harness(tmp_path, fake_openai, tg, group_policy="all")
    try:
        tg.user_message("capital of France?", chat_id=group, chat_type="group")
        await t.release_after_typing(hold)
        tg.migrate(group, supergroup)  # while the model answers
        await t.settle()
        assert tg.visible(supergroup) == [SHOWN]
        assert tg.visible(group) == []
        # the old chat's later turns (an update fetched before the upgrade) are answered in the new chat too
        tg.user_message("and the second city?", chat_id=group, chat_type="group")
        await t.settle()
        assert tg.visible(supergroup) == [SHOWN, "Lyon is second."]
    finally:
        await t.close()


async def test_a_live_message_whose_send_timed_out_is_not_sent_again_at_every_update(tmp_path, fake_openai, tg):
    # the first live message is posted but its answer comes too late, twice: sending it again at each next
    # update would leave one stale copy per update; the turn's end repeats it once, with the whole answer
    long_answer = " ".join(f"word{i}" for i in range(80)) + "."
    fake_openai.script(Text(long_answer, chunk_size=4, delay=0.025))
    t = await telegram_harness(tmp_path, fake_openai, tg, call_timeout=0.3)
    try:
        tg.fail("sendMessage", status=502, description="Bad Gateway", apply_first=True, hang=1.0, times=2)
        tg.user_message("count to eighty")
        await t.settle()
        shown = tg.visible(CHAT)
        assert len(shown) == 2, shown  # the preview whose send timed out, and the answer's one repeat
        assert long_answer.startswith(shown[0]) and shown[0] != long_answer
        assert shown[1] == long_answer
        assert tg.count("sendMessage") == 2
    finally:
        await t.close()
