"""Approval requests a crash leaves with live buttons on Telegram (``channels.common.open_approvals``): the
next start edits each one to say the restart denied it, skips a record it cannot read, and a late press on
an old button is answered "no longer pending". The real channel (aiogram) against the fake Bot API."""

from __future__ import annotations

import asyncio
import json

from channels.common import open_approvals
from channels.common.open_approvals import OPEN_APPROVALS, RESTARTED
from channels.telegram.approvals import GONE
from tests.browser.server import RecordingTool, registry
from tests.fakes.openai_server import Text, ToolCalls
from tests.fakes.telegram.harness import telegram_harness

CHAT = 555
ASK = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_T1"])


def shown_ids(records: str) -> list[int]:
    """The message ids of the shown requests in a saved record (one saved before the post has none)."""
    return [r["message_id"] for r in json.loads(records) if "message_id" in r]



async def test_requests_a_crash_left_open_say_the_restart_denied_them_and_late_presses_are_gone(
        tmp_path, fake_openai, tg):
    tool = RecordingTool("lookup", result="42 apples")
    hold = asyncio.Event()
    fake_openai.script(ASK, Text("unused", hold=hold))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool)})
    try:
        tg.user_message("how many apples?")
        await t.wait_for(lambda: any(m.buttons for m in tg.messages(CHAT)))
        [msg] = [m for m in tg.messages(CHAT) if m.buttons]
        text, markup, allow = msg.text, msg.reply_markup, msg.buttons[0][1]
        left_open = None
        for _ in range(250):  # the record is written once Telegram answered the post
            left_open = await t.channel.host.get_state(OPEN_APPROVALS)
            if left_open and shown_ids(left_open) == [msg.message_id]:
                break
            await asyncio.sleep(0.02)
        assert left_open and shown_ids(left_open) == [msg.message_id]  # remembered durably while it is open
    finally:
        hold.set()
        await t.close()

    # a crash leaves the buttons and the record (a clean stop closes them), and a record no build can read
    msg.text, msg.reply_markup = text, markup
    records = [{"chat_id": CHAT, "tool": "lookup"}, *json.loads(left_open)]
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool)}, start=False)
    try:
        await t.channel.host.set_state(OPEN_APPROVALS, json.dumps(records))
        await t.channel.start()
        await asyncio.wait_for(t.channel.ready.wait(), 5)
        shown = tg.chats[CHAT][msg.message_id]
        assert shown.buttons == [] and shown.text == f"{text}\n\n{RESTARTED}"
        assert await t.channel.host.get_state(OPEN_APPROVALS) == "[]"
        late = tg.press(CHAT, msg.message_id, "", data=allow)  # from a client that had not refreshed yet
        await t.settle()
        assert [a.get("text") for a in tg.answers(late)] == [GONE]
        assert tool.calls == []
    finally:
        await t.close()


async def left_open_by_a_crash(tmp_path, fake_openai, tg, tool):
    """Run a turn to its approval request, then stop the way a crash does: the request keeps its buttons and
    its record. The request's message and the record."""
    hold = asyncio.Event()
    fake_openai.script(ASK, Text("unused", hold=hold))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool)})
    try:
        tg.user_message("how many apples?")
        await t.wait_for(lambda: any(m.buttons for m in tg.messages(CHAT)))
        [msg] = [m for m in tg.messages(CHAT) if m.buttons]
        text, markup = msg.text, msg.reply_markup
        left_open = None
        for _ in range(250):  # the record is written once Telegram answered the post
            left_open = await t.channel.host.get_state(OPEN_APPROVALS)
            if left_open and shown_ids(left_open) == [msg.message_id]:
                break
            await asyncio.sleep(0.02)
        assert left_open and shown_ids(left_open) == [msg.message_id]
    finally:
        hold.set()
        await t.close()
    msg.text, msg.reply_markup = text, markup  # as a crash leaves it
    return msg, left_open


async def test_a_restart_whose_close_fails_keeps_the_record_and_closes_the_request_later(tmp_path, fake_openai, tg):
    """Telegram answers 502 to the start's edits: the request is not forgotten; once Telegram is back, it says
    the restart denied it, and only then is its record gone."""
    tool = RecordingTool("lookup", result="42 apples")
    msg, left_open = await left_open_by_a_crash(tmp_path, fake_openai, tg, tool)
    text = msg.text
    down = True
    for method in ("editMessageText", "editMessageReplyMarkup"):
        tg.fail(method, status=502, description="Bad Gateway", times=10**6, when=lambda p: down)
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool)}, start=False)
    try:
        await t.channel.host.set_state(OPEN_APPROVALS, left_open)
        await t.channel.start()
        await asyncio.wait_for(t.channel.ready.wait(), 5)
        assert tg.count("editMessageText") > 0  # it tried
        assert tg.chats[CHAT][msg.message_id].buttons  # Telegram refused: still shown with its buttons...
        assert shown_ids(await t.channel.host.get_state(OPEN_APPROVALS) or "[]") == [msg.message_id]  # ...and kept
        down = False  # Telegram is back: the close is tried again
        await t.wait_for(lambda: not tg.chats[CHAT][msg.message_id].buttons, timeout=10)
        assert tg.chats[CHAT][msg.message_id].text == f"{text}\n\n{RESTARTED}"
        for _ in range(250):
            if await t.channel.host.get_state(OPEN_APPROVALS) == "[]":
                break
            await asyncio.sleep(0.02)
        assert await t.channel.host.get_state(OPEN_APPROVALS) == "[]"
        assert tool.calls == []
    finally:
        await t.close()


async def test_a_press_on_a_request_whose_restart_close_failed_closes_it(tmp_path, fake_openai, tg, monkeypatch):
    """Before the failed close is tried again, a press on the request's live button is answered "no longer
    pending" and the request says the restart denied it."""
    monkeypatch.setattr(open_approvals, "RETRY", (3600.0,))  # the background try does not come in this test
    tool = RecordingTool("lookup", result="42 apples")
    msg, left_open = await left_open_by_a_crash(tmp_path, fake_openai, tg, tool)
    text, allow = msg.text, msg.buttons[0][1]
    down = True
    for method in ("editMessageText", "editMessageReplyMarkup"):
        tg.fail(method, status=502, description="Bad Gateway", times=10**6, when=lambda p: down)
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool)}, start=False)
    try:
        await t.channel.host.set_state(OPEN_APPROVALS, left_open)
        await t.channel.start()
        await asyncio.wait_for(t.channel.ready.wait(), 5)
        assert tg.chats[CHAT][msg.message_id].buttons
        down = False
        press = tg.press(CHAT, msg.message_id, "", data=allow)
        await t.settle()
        assert [a.get("text") for a in tg.answers(press)] == [GONE]
        shown = tg.chats[CHAT][msg.message_id]
        assert shown.buttons == [] and shown.text == f"{text}\n\n{RESTARTED}"
        assert tool.calls == []
    finally:
        await t.close()
