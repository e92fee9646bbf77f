"""An approval request whose post Telegram carried out but answered too late (its outcome unknown), and a press
that reaches a process before the request's record says where it is shown: the request shows once, a press
on it decides, and no copy keeps live buttons. The real channel (aiogram) against the fake Bot API."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from channels.common.open_approvals import OPEN_APPROVALS
from channels.telegram.approvals import GONE
from tests.browser.server import RecordingTool, registry
from tests.fakes.openai_server import Text
from tests.fakes.telegram import FakeTelegram, Shown
from tests.fakes.telegram.harness import TelegramHarness, telegram_harness
from tests.support.telegram_approvals import ALLOW, ASK, REQUEST, lookup_tool, with_keyboard

CHAT = 555
UNSURE = "no answer to the approval request"
GAVE_UP = "could not post the approval request"


@pytest.fixture
def tool() -> RecordingTool:
    return lookup_tool()


def requests(tg: FakeTelegram) -> list[Shown]:
    return [m for m in tg.messages(CHAT) if m.text.startswith("🔧 Approval needed")]


def has_keyboard(params: dict[str, Any]) -> bool:
    return bool(params.get("reply_markup"))


async def given_up(t: TelegramHarness, caplog: pytest.LogCaptureFixture) -> None:
    """Until the post of the request gave up waiting for its answer (or, as before, showed it again)."""
    await t.wait_for(lambda: UNSURE in caplog.text or len(with_keyboard(t.tg, CHAT)) >= 2, timeout=8)


async def test_a_post_answered_too_late_shows_once_and_the_press_decides_it(
        tmp_path, fake_openai, tg, tool, caplog):
    """Telegram shows the request but its answer comes after the call's bound: it is not sent again (a second
    copy would keep live buttons after the decision); a press on it decides and replaces its keyboard."""
    caplog.set_level(logging.INFO, logger="channels.telegram.sink")
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool)}, call_timeout=0.5)
    late = asyncio.Event()
    tg.fail("sendMessage", when=has_keyboard, apply_first=True, until=late)
    try:
        tg.user_message("how many apples?")
        await given_up(t, caplog)
        assert [m.text for m in requests(tg)] == [REQUEST]  # shown once
        [msg] = with_keyboard(tg, CHAT)
        press = tg.press(CHAT, msg.message_id, ALLOW)
        await t.settle()
        assert [a.get("text") for a in tg.answers(press)] == ["Allowed"]
        assert tool.calls == [{"query": "apples"}]
        assert with_keyboard(tg, CHAT) == []  # no copy keeps live buttons
        assert [m.text for m in requests(tg)] == [f"{REQUEST}\n\n✅ Allowed by Alice"]
        assert tg.visible(CHAT)[-1] == "You have 42 apples."
    finally:
        late.set()
        await t.close()


async def test_a_post_whose_tries_all_timed_out_is_still_decided_by_a_press(tmp_path, fake_openai, tg, tool, caplog):
    """No answer to any try of the request's post: the request stays pending (it may well be shown), so a press
    on it decides, rather than being told "no longer pending" while the turn waits for the approval timeout.
    Its record learns the message from the press, so a restart could close it."""
    caplog.set_level(logging.INFO, logger="channels.telegram.sink")
    caplog.set_level(logging.INFO, logger="channels.common.live_sink")
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool), "approval_timeout": 60},
                               call_timeout=0.5)
    late = asyncio.Event()
    tg.fail("sendMessage", when=has_keyboard, apply_first=True, until=late, times=2)
    saves: list[str] = []
    real_save = t.channel.approval_buttons._save

    async def save() -> None:
        await real_save()
        saves.append(await t.channel.host.get_state(OPEN_APPROVALS) or "")

    t.channel.approval_buttons._save = save  # type: ignore[method-assign]
    try:
        tg.user_message("how many apples?")
        # until the post stopped trying (before this fix: it tried twice, then gave the request up)
        await t.wait_for(lambda: UNSURE in caplog.text or GAVE_UP in caplog.text, timeout=8)
        msg = with_keyboard(tg, CHAT)[-1]
        press = tg.press(CHAT, msg.message_id, ALLOW)
        await t.wait_for(lambda: tg.answers(press))
        assert [a.get("text") for a in tg.answers(press)] != [GONE]
        await t.settle()
        assert [a.get("text") for a in tg.answers(press)] == ["Allowed"]
        assert tool.calls == [{"query": "apples"}]
        assert [m.text for m in requests(tg)] == [f"{REQUEST}\n\n✅ Allowed by Alice"]
        assert with_keyboard(tg, CHAT) == []
        assert tg.visible(CHAT)[-1] == "You have 42 apples."
        assert any(r.get("message_id") == msg.message_id for s in saves for r in json.loads(s))
    finally:
        late.set()
        await t.close()


async def test_a_press_on_a_second_copy_of_the_request_shows_the_decision_on_both(tmp_path, fake_openai, tg, tool):
    """However a second copy of the request came to be shown (e.g. a send repeated before this fix), a press on
    it decides, and neither copy keeps its buttons."""
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool)})
    try:
        tg.user_message("how many apples?")
        await t.wait_for(lambda: with_keyboard(tg, CHAT))
        [first] = with_keyboard(tg, CHAT)
        await tg._m_sendMessage({"chat_id": CHAT, "text": first.text, "reply_markup": first.reply_markup})
        second = with_keyboard(tg, CHAT)[-1]
        assert second.message_id != first.message_id
        press = tg.press(CHAT, second.message_id, ALLOW)
        await t.settle()
        assert [a.get("text") for a in tg.answers(press)] == ["Allowed"]
        assert tool.calls == [{"query": "apples"}]
        assert with_keyboard(tg, CHAT) == []
        assert [m.text for m in requests(tg)] == [f"{REQUEST}\n\n✅ Allowed by Alice"] * 2
    finally:
        await t.close()


async def test_a_press_elsewhere_before_the_record_has_the_message_id_decides(tmp_path, fake_openai, tg, tool):
    """Several processes: the press reaches one that did not post the request while the poster has shown it but
    not yet saved where (its record has no message id). The press decides through the host; the keyboard is
    never removed while the approval is pending, and the message shows the decision once it is made."""
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool), "approval_timeout": 60})
    buttons = t.channel.approval_buttons
    real_save = buttons._save
    second_save = asyncio.Event()
    saves = 0

    async def save() -> None:  # the poster's save with the message id lands only when the test says so
        nonlocal saves
        saves += 1
        if saves == 2:
            await second_save.wait()
        await real_save()

    buttons._save = save  # type: ignore[method-assign]
    pending_at_removal: list[bool] = []
    real_drop = buttons._drop_keyboard

    async def drop(chat_id: int, message_id: int) -> bool:
        pending_at_removal.append(bool(t.core.approvals._pending))
        return await real_drop(chat_id, message_id)

    buttons._drop_keyboard = drop  # type: ignore[method-assign]
    try:
        tg.user_message("how many apples?")
        await t.wait_for(lambda: with_keyboard(tg, CHAT) and saves >= 2)
        [msg] = with_keyboard(tg, CHAT)
        record = json.loads(await t.channel.host.get_state(OPEN_APPROVALS) or "[]")
        assert [r.get("message_id") for r in record] == [None]  # not saved yet where it is shown
        # the receiving process knows the request only from the record: it did not post it
        ref = next(iter(buttons._by_ref))
        entry = buttons._by_ref.pop(ref)
        press = tg.press(CHAT, msg.message_id, ALLOW)
        await t.wait_for(lambda: tg.answers(press))
        buttons._by_ref[ref] = entry
        assert [a.get("text") for a in tg.answers(press)] == ["Allowed"]
        second_save.set()
        await t.settle()
        assert True not in pending_at_removal  # never lost its keyboard while pending
        assert tool.calls == [{"query": "apples"}]
        assert with_keyboard(tg, CHAT) == []
        assert [m.text for m in requests(tg)] == [f"{REQUEST}\n\n✅ Allowed by Alice"]
        assert tg.visible(CHAT)[-1] == "You have 42 apples."
    finally:
        second_save.set()
        await t.close()
