"""DESIGN.md §2 delivery rules and the seed 001 §15 fallback matrix, on Telegram.

Each test drives the real chain (SQLite, the OpenAI SDK against the fake LLM) and the real Telegram
channel (aiogram) against the fake Bot API, and asserts what the chat shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable

from telegramify_markdown import convert

from channels.common.splitter import open_fence, utf16_len
from core.events import TurnStarted
from tests.fakes.openai_server import Hang, HttpError, Text
from tests.fakes.telegram import FakeTelegram
from tests.fakes.telegram.harness import telegram_harness
from tests.support.clock import GatedClock

CHAT = 555
ANSWER = "The capital of France is **Paris**, a city on the Seine."
SHOWN = "The capital of France is Paris, a city on the Seine."



def final_edits(tg: FakeTelegram) -> list:
    return [c for c in tg.calls if c.method == "editMessageText" and c.params.get("entities")]


async def test_success_shows_the_answer_once_formatted_and_sends_no_fallback(tmp_path, fake_openai, tg):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    # "typing…" waits longer than a quarter of a second here: the answer shows sooner even on a loaded host
    t = await telegram_harness(tmp_path, fake_openai, tg, typing_delay=2.0)
    try:
        tg.user_message("capital of France?")
        await t.settle()
        [msg] = tg.messages(CHAT)
        assert msg.text == SHOWN
        assert msg.entities == [{"type": "bold", "offset": 25, "length": 5}]
        assert tg.count("sendMessage") == 1  # one live message, no plain fallback
        assert tg.count("sendChatAction") == 0  # shown at once: "typing…" would be replaced as it appeared
    finally:
        await t.close()


async def test_typing_shows_while_the_model_is_slow_to_write_its_first_words(tmp_path, fake_openai, tg):
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01, hold=hold))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message("capital of France?")
        await t.wait_for(lambda: tg.count("sendChatAction") == 1)
        asked = next(c for c in tg.calls if c.method == "sendChatAction")
        assert asked.params["action"] == "typing"
        await asyncio.sleep(0.3)
        assert tg.messages(CHAT) == [] and tg.count("sendChatAction") == 1  # once, until there is text
        hold.set()
        await t.settle()
        assert tg.visible(CHAT) == [SHOWN]
        assert tg.count("sendChatAction") == 1
    finally:
        await t.close()


async def test_typing_shows_while_the_first_message_waits_for_the_bots_budget(tmp_path, fake_openai, tg):
    # In a burst, a chat's first words come at once but its first message waits for a slot in the bot's budget
    # of new messages (seconds, behind hundreds of chats): the chat shows "typing…" meanwhile, and the
    # message, once its slot comes, after that call.
    clock = GatedClock()
    fake_openai.script(Text("Hello."), Text(ANSWER))
    t = await telegram_harness(tmp_path, fake_openai, tg, clock=clock)
    try:
        await _first_send_waits_for_its_slot(t, tg, clock, CHAT)
        await t.wait_for(lambda: tg.count("sendChatAction") == 1)
        [asked] = [c for c in tg.calls if c.method == "sendChatAction"]
        assert asked.params["chat_id"] == CHAT and asked.params["action"] == "typing"
        assert tg.messages(CHAT) == []
        clock.gate.set()
        await t.settle()
        assert tg.visible(CHAT) == [SHOWN]
        sent = [(c.method, c.params.get("chat_id")) for c in tg.calls if c.method in ("sendChatAction", "sendMessage")]
        assert sent.index(("sendChatAction", CHAT)) < sent.index(("sendMessage", CHAT))
        assert tg.count("sendChatAction") == 1  # the first chat's message left at once: no indicator there
    finally:
        clock.gate.set()
        await t.close()


async def test_an_answer_without_a_word_shows_its_notice_once(tmp_path, fake_openai, tg):
    fake_openai.script(Text(""))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message("say nothing")
        await t.settle()
        [shown] = tg.visible(CHAT)
        assert shown.startswith("⚠️ The model finished without writing an answer.")
        assert tg.count("sendMessage") == 1
    finally:
        await t.close()


async def test_a_refused_typing_indicator_leaves_one_reply_without_live_updates(tmp_path, fake_openai, tg):
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, hold=hold))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.fail("sendChatAction", status=403, description="Forbidden: bot was blocked by the user")
        tg.user_message("capital of France?")
        await t.release_after_typing(hold)
        await t.settle()
        assert tg.visible(CHAT) == [SHOWN]
        assert tg.count("sendMessage") == 1 and tg.count("editMessageText") == 0
    finally:
        await t.close()


async def test_final_edit_not_found_falls_back_exactly_once(tmp_path, fake_openai, tg):
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, hold=hold, hold_after=30))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message("capital of France?")
        await t.wait_for(lambda: tg.messages(CHAT))
        tg.messages(CHAT)[0].deleted = True  # the user deletes the preview
        hold.set()
        await t.settle()
        assert tg.visible(CHAT) == [SHOWN]  # the fallback, once
        assert tg.count("sendMessage") == 2
    finally:
        await t.close()


async def test_final_edit_failing_permanently_falls_back_once(tmp_path, fake_openai, tg):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.fail("editMessageText", description="Bad Request: message to edit not found",
                when=lambda p: bool(p.get("entities")))
        tg.user_message("capital of France?")
        await t.settle()
        texts = tg.visible(CHAT)
        assert texts.count(SHOWN) == 1 and len(final_edits(tg)) == 1  # permanent: not retried
        assert sum(1 for c in tg.calls if c.method == "sendMessage") == 2
    finally:
        await t.close()


async def test_transient_final_failures_then_success_send_no_fallback(tmp_path, fake_openai, tg):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.fail("editMessageText", status=502, description="Bad Gateway", times=2,
                when=lambda p: bool(p.get("entities")))
        tg.user_message("capital of France?")
        await t.settle()
        assert tg.visible(CHAT) == [SHOWN]
        assert tg.count("sendMessage") == 1
        assert [c.status for c in final_edits(tg)] == [502, 502, 200]
    finally:
        await t.close()


async def test_a_final_edit_that_keeps_failing_is_tried_three_times_then_replaced_by_one_fallback(
        tmp_path, fake_openai, tg):
    # one retry policy owns the final edit: three tries in all (not three per layer), then the stale
    # preview goes and the single fallback shows the formatted answer
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.fail("editMessageText", status=502, description="Bad Gateway", times=100,
                when=lambda p: bool(p.get("entities")))
        tg.user_message("capital of France?")
        await t.settle()
        assert len(final_edits(tg)) == 3
        [msg] = tg.messages(CHAT)
        assert (msg.text, msg.entities) == (SHOWN, [{"type": "bold", "offset": 25, "length": 5}])
        assert tg.count("deleteMessage") == 1 and tg.count("sendMessage") == 2
    finally:
        await t.close()


async def test_a_retried_final_edit_waits_for_the_chats_next_slot(tmp_path, fake_openai, tg):
    # a retry is a call like any other: the end's one call ahead of the chat's pace went to the failed
    # attempt, so the retry waits for the pace, edit_interval after the last live call
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg, edit_interval=0.5)
    try:
        tg.fail("editMessageText", status=502, description="Bad Gateway", when=lambda p: bool(p.get("entities")))
        tg.user_message("capital of France?")
        await t.settle()
        assert tg.visible(CHAT) == [SHOWN]
        failed, retried = final_edits(tg)
        assert failed.status == 502 and retried.status == 200
        live = [c for c in tg.calls_to(CHAT, "sendMessage", "editMessageText") if c.at < failed.at]
        assert retried.at - live[-1].at >= 0.45
    finally:
        await t.close()


async def test_message_is_not_modified_counts_as_success(tmp_path, fake_openai, tg):
    # The final edit lands but its answer is lost (a 502 after Telegram did the work): the repeated edit gets
    # Telegram's own "message is not modified", which means the chat already shows the target state.
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.fail("editMessageText", status=502, description="Bad Gateway", apply_first=True,
                when=lambda p: bool(p.get("entities")))
        tg.user_message("capital of France?")
        await t.settle()
        [msg] = tg.messages(CHAT)
        assert msg.text == SHOWN
        assert msg.entities == [{"type": "bold", "offset": 25, "length": 5}]
        assert [c.status for c in final_edits(tg)] == [502, 400]  # the repeat: "message is not modified"
        assert tg.count("sendMessage") == 1  # success: no fallback
    finally:
        await t.close()


async def test_stop_produces_exactly_one_terminal_message(tmp_path, fake_openai, tg):
    hold = asyncio.Event()
    fake_openai.script(Text("Partial answer that goes on and on", hold=hold, hold_after=30))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message("tell me a story")
        await t.wait_for(lambda: tg.messages(CHAT))
        tg.user_message("/stop")
        await t.settle()
        hold.set()
        assert tg.visible(CHAT) == ["Partial answer that goes on an\n\n⏹ Stopped."]
        assert tg.count("sendMessage") == 1
    finally:
        await t.close()


async def test_a_failed_turn_shows_its_notice_once_although_history_keeps_it(tmp_path, fake_openai, tg):
    fake_openai.script(HttpError.auth())
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message("hi")
        await t.settle()
        [shown] = tg.visible(CHAT)
        assert "rejected the bridge's credentials" in shown
        assert tg.count("sendMessage") == 1  # the live message carries the failure; nothing else is sent
        [session] = await t.core.list_sessions()
        _, history = await t.core.history(session.key)
        assert [m.source.kind for m in history] == ["user_input", "notice"]
        assert "rejected the bridge's credentials" in history[1].content
    finally:
        await t.close()


async def test_rate_limit_on_the_final_edit_pauses_the_chat_then_shows_the_answer_once(
        tmp_path, fake_openai, tg):
    # retry_after is scaled down from 30 s to 1 s (Telegram's unit is whole seconds); the code path is the
    # same: the call policy pauses the chat and repeats the edit once the pause is over.
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.fail("editMessageText", status=429, description="Too Many Requests: retry after 1", retry_after=1,
                when=lambda p: bool(p.get("entities")))
        tg.user_message("capital of France?")
        await t.settle()
        assert tg.visible(CHAT) == [SHOWN]
        assert tg.count("sendMessage") == 1
        limited = next(c for c in tg.calls if c.status == 429)
        after = [c for c in tg.calls_to(CHAT) if c.at > limited.at]
        assert after and all(c.at - limited.at >= 1.0 for c in after)
    finally:
        await t.close()


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


async def test_a_10000_character_reply_with_code_arrives_complete_across_messages(tmp_path, fake_openai, tg):
    blocks = []
    i = 0
    while sum(len(b) for b in blocks) < 10_000:
        blocks.append(f"Section {i}: " + "Some explanatory prose about the code. " * 6)
        blocks.append("```python\n" + "\n".join(f"value_{i}_{j} = compute({j}, 'é😀')" for j in range(40)) + "\n```")
        i += 1
    answer = "\n\n".join(blocks)
    assert len(answer) >= 10_000
    fake_openai.script(Text(answer, chunk_size=400, delay=0.005))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message("write a lot")
        await t.settle()
        shown = tg.messages(CHAT)
        assert len(shown) >= 3
        for msg in shown:
            assert utf16_len(msg.text) <= 4096
            assert open_fence(msg.text) is None
        # every word of the answer is visible exactly once, in order (the fake validated every entity)
        assert _squash("".join(m.text for m in shown)) == _squash(convert(answer)[0])
        assert all(any(e["type"] == "pre" for e in m.entities) for m in shown)
    finally:
        await t.close()


async def test_streamed_text_that_outgrows_a_message_freezes_it_and_continues_in_a_new_one(
        tmp_path, fake_openai, tg):
    # plain words: the final rendering equals the streamed text, so a frozen message needs no final edit
    paragraphs = [f"Paragraph {i} " + " ".join(["word"] * 60) for i in range(8)]
    answer = "\n\n".join(paragraphs)
    fake_openai.script(Text(answer, chunk_size=40, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg, limit=1000)
    try:
        tg.user_message("go")
        await t.settle()
        shown = tg.messages(CHAT)
        assert len(shown) >= 3 and all(len(m.text) <= 1000 for m in shown)
        assert _squash("".join(m.text for m in shown)) == _squash(answer)
        # a frozen message was never edited after its successor appeared
        first_send_of_second = next(c for c in tg.calls if c.method == "sendMessage"
                                    and c.params["text"].startswith(shown[1].text[:20]))
        later_edits_of_first = [c for c in tg.calls if c.method == "editMessageText" and c.at > first_send_of_second.at
                                and c.params["message_id"] == shown[0].message_id]
        assert later_edits_of_first == []
    finally:
        await t.close()


async def test_split_reply_fallback_resends_only_the_missing_part(tmp_path, fake_openai, tg):
    answer = "\n\n".join(f"Part {i} " + "text " * 150 for i in range(3))
    fake_openai.script(Text(answer, chunk_size=60, delay=0.005))
    t = await telegram_harness(tmp_path, fake_openai, tg, limit=1000)
    try:
        tg.fail("sendMessage", description="Bad Request: message thread not found",
                when=lambda p: p["text"].startswith("Part 2") and len(p["text"]) > 700)
        tg.user_message("go")
        await t.settle()
        texts = tg.visible(CHAT)
        assert _squash("".join(texts)) == _squash(answer)
        for i in range(3):  # every part visible exactly once: finished parts were not resent
            assert sum(x.startswith(f"Part {i}") and len(x) > 700 for x in texts) == 1, texts
    finally:
        await t.close()


async def test_a_429_pause_longer_than_the_delivery_wait_is_waited_out_not_given_up(tmp_path, fake_openai, tg):
    # The pause (1 s) outlasts the core's delivery wait (0.3 s): the wait stretches with the pause, so the
    # final edit lands and no plain fallback is sent.
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"delivery_wait_timeout": 0.3})
    try:
        tg.fail("editMessageText", status=429, description="Too Many Requests: retry after 1", retry_after=1,
                when=lambda p: bool(p.get("entities")))
        tg.user_message("capital of France?")
        await t.settle()
        assert tg.visible(CHAT) == [SHOWN]
        assert tg.count("sendMessage") == 1
    finally:
        await t.close()


async def test_the_plain_fallback_waits_out_a_429_pause_longer_than_one_send_may_take(tmp_path, fake_openai, tg):
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg, call_timeout=0.3)  # one try may take 0.3 s
    try:
        tg.fail("editMessageText", status=400, description="Bad Request: message to edit not found",
                when=lambda p: bool(p.get("entities")), times=10)
        tg.fail("sendMessage", status=429, description="Too Many Requests: retry after 1", retry_after=1,
                when=lambda p: bool(p.get("entities")))
        tg.user_message("capital of France?")
        await t.settle(timeout=15)
        assert tg.visible(CHAT).count(SHOWN) == 1
        limited = next(c for c in tg.calls if c.status == 429)
        delivered = [c for c in tg.calls_to(CHAT) if c.at > limited.at and c.status == 200]
        assert delivered and all(c.at - limited.at >= 1.0 for c in delivered)
    finally:
        await t.close()


async def test_a_preview_that_can_no_longer_be_edited_is_replaced_not_left_beside_the_fallback(
        tmp_path, fake_openai, tg):
    # The model is held after its last character until the preview shows the whole answer as raw Markdown:
    # a preview is "shown" only in its final, formatted form, so it is deleted and the fallback shows the
    # formatted answer once.
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, delay=0.01, hold=hold, hold_after=len(ANSWER)))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.fail("editMessageText", status=400, description="Bad Request: message can't be edited",
                when=lambda p: bool(p.get("entities")), times=10)
        tg.user_message("capital of France?")
        await t.wait_for(lambda: tg.visible(CHAT) == [ANSWER])
        hold.set()
        await t.settle()
        assert tg.count("deleteMessage") == 1
        [msg] = tg.messages(CHAT)  # the fallback alone: no stale preview above it
        assert msg.text == SHOWN
        assert msg.entities == [{"type": "bold", "offset": 25, "length": 5}]
    finally:
        await t.close()


async def test_in_a_group_the_answer_that_replaces_a_stale_preview_still_quotes_the_users_message(
        tmp_path, fake_openai, tg):
    # the model goes silent after a word and is asked again: the preview of the first attempt goes, and the
    # answer sent in its place must still say which message it answers (in a busy group, nothing else does)
    group = -100101
    fake_openai.script(Hang(5, after_text="Answ"), Text(ANSWER, chunk_size=4, delay=0.01))
    t = await telegram_harness(tmp_path, fake_openai, tg, group_policy="all", core={"request_timeout": 1.0})
    try:
        asked = tg.user_message("capital of France?", chat_id=group, chat_type="group")
        await t.settle()
        [msg] = tg.messages(group)
        assert msg.text == SHOWN
        assert msg.reply_to == asked["message"]["message_id"]
        assert tg.count("deleteMessage") == 1  # the first attempt's preview was replaced
    finally:
        await t.close()


async def test_the_model_is_asked_while_a_slow_typing_indicator_is_still_on_its_way(tmp_path, fake_openai, tg):
    # the typing call runs beside the turn instead of in front of it; the answer waits for it to land, so
    # the chat never shows "typing…" after the answer
    release = tg.hold("sendChatAction")
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, hold=hold))  # slow to start: "typing…" is asked for
    # opening the live reply may take as long as it likes: the answer must not be a plain one sent because
    # the opening gave up
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"sink_open_timeout": 60.0})
    try:
        tg.user_message("capital of France?")
        await t.release_after_typing(hold)
        await t.wait_for(lambda: t.h.commits())  # the whole answer was written while the typing call hung
        assert len(fake_openai.requests) == 1 and tg.count("sendChatAction") == 1
        assert tg.messages(CHAT) == []
        release.set()
        await t.settle()
        assert tg.visible(CHAT) == [SHOWN]
        methods = [c.method for c in tg.calls_to(CHAT)]
        assert methods.index("sendChatAction") < methods.index("sendMessage")
        assert "sendChatAction" not in methods[methods.index("sendMessage"):]
    finally:
        await t.close()


async def test_the_end_of_a_reply_shows_at_once_not_at_the_chats_next_slot(tmp_path, fake_openai, tg):
    # live edits keep the chat's pace (one call per edit_interval, 30 s here); the end takes one call of the
    # burst Telegram allows in a chat, so the whole answer shows as soon as it is written, not an interval
    # later. The fake allows a burst of two calls in the chat and nothing more for a minute: a third 429s.
    rest = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, hold=rest, hold_after=28))
    tg.enforce_limits(per_chat=2, window=60.0, overall=100)
    t = await telegram_harness(tmp_path, fake_openai, tg, edit_interval=30.0, core={"request_timeout": 30.0})
    try:
        tg.user_message("capital of France?")
        await t.wait_for(lambda: tg.count("sendMessage") == 1)  # the first message shows the beginning
        rest.set()
        await t.wait_for(lambda: [m.text for m in tg.messages(CHAT)] == [SHOWN] and final_edits(tg), timeout=10)
        await t.settle()
        assert [c.method for c in tg.calls_to(CHAT, "sendMessage", "editMessageText")] == \
            ["sendMessage", "editMessageText"]
        assert tg.limited == 0
    finally:
        await t.close()


async def test_a_burst_of_chats_gets_no_429_from_the_bots_limit_of_new_messages(tmp_path, fake_openai, tg):
    # Telegram refuses more than about 30 new messages a second over all of a bot's chats (edits are not
    # counted); the fake enforces that, scaled down to 3 a second, and the channel paces its new messages
    # under the bot's budget (1 a second here, so scheduling delays cannot crowd them into one second)
    answer = "Hello there, this is the whole answer."
    fake_openai.default = Text(answer)
    tg.enforce_limits(per_chat=100, window=1.0, overall=3)
    t = await telegram_harness(tmp_path, fake_openai, tg, bot_sends_per_second=1.0)
    chats = [9001 + i for i in range(6)]
    try:
        for chat in chats:
            tg.user_message("hi", chat_id=chat)
        try:
            await t.wait_for(lambda: all(tg.visible(chat) == [answer] for chat in chats), timeout=30)
        except AssertionError:  # what each chat shows and what was asked of the fake, to see where it stopped
            calls = [(c.method, c.params.get("chat_id"), c.status) for c in tg.calls if c.method != "getUpdates"]
            raise AssertionError(f"shown: {[tg.visible(chat) for chat in chats]}; limited: {tg.limited}; "
                                 f"model requests: {len(fake_openai.requests)}; calls: {calls}") from None
        await t.settle()
    finally:
        await t.close()
    assert tg.limited == 0
    assert all(tg.visible(chat) == [answer] for chat in chats)


async def test_a_new_message_leaves_at_its_slot_while_edits_hold_every_connection(tmp_path, fake_openai, tg):
    # The bot's budget of new messages is counted where Telegram receives them, so a send must leave when its
    # slot comes. Here the bot's pool of two connections is taken by the long poll and an edit the fake holds
    # (as a thousand chats streaming at once take all of them): a send that queued behind them would arrive
    # late, together with the sends after it, past the budget. The other chat's reply is shown all the same.
    later = asyncio.Event()
    long = " ".join(f"word{i}" for i in range(60))
    fake_openai.script(Text("Short answer.", hold=later, hold_after=0), Text(long, chunk_size=4, delay=0.05))
    t = await telegram_harness(tmp_path, fake_openai, tg, connections=2, core={"request_timeout": 30.0})
    edits = tg.hold("editMessageText")
    try:
        tg.user_message("first", chat_id=701, user_id=701)
        await t.wait_for(lambda: len(fake_openai.requests) == 1)
        tg.user_message("second", chat_id=702, user_id=702)
        await t.wait_for(lambda: tg.count("editMessageText") >= 1)  # the pool's last connection is held
        later.set()
        await t.wait_for(lambda: tg.visible(701) == ["Short answer."])
        edits.set()
        await t.wait_for(lambda: tg.visible(702) == [long], timeout=15)
    finally:
        edits.set()
        await t.close()
    assert tg.visible(701) == ["Short answer."]
    assert tg.visible(702) == [long]
    assert tg.limited == 0  # no send arrived past the bot's budget


async def _first_send_waits_for_its_slot(t, tg: FakeTelegram, clock: GatedClock, chat: int) -> None:
    """Chat 801 gets a short answer, whose message takes the bot's next slot for a new message (the throttle's
    time stands still: ``clock``); then ``chat``'s first message, due while its turn streams, waits for its slot
    in that budget, as it does behind hundreds of chats streaming at once."""
    tg.user_message("hello", chat_id=801, user_id=801)
    await t.wait_for(lambda: tg.visible(801) == ["Hello."])
    tg.user_message("capital of France?", chat_id=chat, user_id=chat)
    await t.wait_for(lambda: clock.waiting == 1)


@contextlib.asynccontextmanager
async def _ended_while_its_first_send_waits(tmp_path, fake_openai, tg: FakeTelegram,
                                            before_the_end: Callable[[], object] = lambda: None):
    """A turn (the answer ``ANSWER``) that ends while its first message waits for its slot; yields the harness
    once everything is shown."""
    clock = GatedClock()
    rest = asyncio.Event()
    fake_openai.script(Text("Hello."), Text(ANSWER, chunk_size=4, hold=rest, hold_after=28))
    t = await telegram_harness(tmp_path, fake_openai, tg, clock=clock)
    try:
        await _first_send_waits_for_its_slot(t, tg, clock, CHAT)
        before_the_end()
        rest.set()
        await t.wait_for(lambda: len(t.h.commits()) == 2)  # the turn is over (committed, then shown)
        clock.gate.set()
        await t.settle()
        yield t
    finally:
        clock.gate.set()
        await t.close()


async def test_a_first_message_whose_slot_comes_after_the_turn_ended_shows_the_final_answer_in_one_call(
        tmp_path, fake_openai, tg):
    # what a new message carries is decided when its slot comes, not when it was booked: the turn has ended
    # by then, so the one message shows the formatted answer and no edit follows
    async with _ended_while_its_first_send_waits(tmp_path, fake_openai, tg):
        [msg] = tg.messages(CHAT)
        assert (msg.text, msg.entities) == (SHOWN, [{"type": "bold", "offset": 25, "length": 5}])
        assert [c.method for c in tg.calls_to(CHAT, "sendMessage", "editMessageText")] == ["sendMessage"]


async def test_a_first_message_whose_slot_comes_while_the_turn_streams_shows_the_newer_text(
        tmp_path, fake_openai, tg):
    clock = GatedClock()
    rest = asyncio.Event()
    long = " ".join(f"word{i}" for i in range(80))
    fake_openai.script(Text("Hello."), Text(long, chunk_size=4, delay=0.05, hold=rest, hold_after=28))
    t = await telegram_harness(tmp_path, fake_openai, tg, clock=clock)
    try:
        await _first_send_waits_for_its_slot(t, tg, clock, CHAT)
        rest.set()
        turn = [e for e in t.h.events if isinstance(e, TurnStarted)][-1].controller
        await t.wait_for(lambda: len(turn.snapshot.text) >= 100)  # much more than when the send was booked
        clock.gate.set()
        await t.wait_for(lambda: tg.calls_to(CHAT, "sendMessage"))
        first = tg.calls_to(CHAT, "sendMessage")[0].params["text"]
        assert len(first) >= 100 and long.startswith(first)
        await t.settle()
        assert tg.visible(CHAT) == [long]
    finally:
        clock.gate.set()
        await t.close()


async def test_a_first_message_carrying_the_final_that_telegram_rejects_ends_as_the_plain_answer(
        tmp_path, fake_openai, tg):
    # the send that carries the formatted final (the turn ended while it waited) is refused for its
    # formatting: the chat ends with the answer once, as plain text
    def refuse_formatting() -> None:
        tg.fail("sendMessage", description="Bad Request: can't parse entities: unsupported", times=100,
                when=lambda p: bool(p.get("entities")))

    async with _ended_while_its_first_send_waits(tmp_path, fake_openai, tg, refuse_formatting):
        [msg] = tg.messages(CHAT)
        assert msg.text == ANSWER and not msg.entities
        assert tg.count("editMessageText") == 0
