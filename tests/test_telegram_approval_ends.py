"""How a Telegram approval request ends when a press and the end cross, when many newer requests were posted
while it waited, and when a press cannot be decided: the message shows the real end, an old open request still
decides, and every press is answered. The real channel (aiogram) against the fake Bot API."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from channels.common.open_approvals import state_name
from channels.telegram import approvals
from channels.telegram.approvals import GONE
from channels.telegram.sink import TelegramPrompts
from tests.browser.server import RecordingTool, registry
from tests.fakes.openai_server import Text, ToolCalls
from tests.fakes.telegram.harness import TelegramHarness, telegram_harness
from tests.support.telegram_approvals import ALLOW, ASK, DENY, REQUEST, approval_message, lookup_tool

TIMED_OUT = "⌛ Denied: nobody decided in time."
PRESS_AGAIN = "Your press could not be taken just now; please press again."


@pytest.fixture
def tool() -> RecordingTool:
    return lookup_tool()


async def open_records(t: TelegramHarness) -> list[dict[str, Any]]:
    """This process's open-requests record: what a restart would close."""
    records: list[dict[str, Any]] = json.loads(
        await t.channel.host.get_state(state_name(t.channel.host.processes.id)) or "[]")
    return records


def late_sink(monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """The sink marks an ended request only when the test says so (its follow-up held by a slow edit of the
    reply, a 429 pause): (the sink is about to mark it, let it)."""
    reached, release = asyncio.Event(), asyncio.Event()
    real = TelegramPrompts.ended

    async def ended(self: TelegramPrompts, handle: Any, line: str) -> None:
        reached.set()
        await release.wait()
        await real(self, handle, line)

    monkeypatch.setattr(TelegramPrompts, "ended", ended)
    return reached, release


async def test_a_press_as_the_approval_times_out_leaves_the_timeout_shown(tmp_path, fake_openai, tg, tool,
                                                                          monkeypatch):
    """Alice presses Allow just after nobody decided in time, before the sink marked it: she is told it is no
    longer pending, the buttons go at once, and the message ends saying it timed out (not "no longer
    pending" for good)."""
    reached, release = late_sink(monkeypatch)
    fake_openai.script(ASK, Text("Nobody answered, so I did not look."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool), "approval_timeout": 0.3})
    try:
        tg.user_message("how many apples?")
        msg = await approval_message(t, 555)
        await asyncio.wait_for(reached.wait(), 5)  # timed out; the sink has yet to mark it
        press = tg.press(555, msg.message_id, ALLOW)
        await t.wait_for(lambda: tg.answers(press))
        assert [a.get("text") for a in tg.answers(press)] == [GONE]
        await t.wait_for(lambda: not tg.chats[555][msg.message_id].buttons)  # no live button meanwhile

        release.set()
        await t.wait_for(lambda: tg.chats[555][msg.message_id].text == f"{REQUEST}\n\n{TIMED_OUT}")
        await t.settle()
        shown = tg.chats[555][msg.message_id]
        assert shown.text == f"{REQUEST}\n\n{TIMED_OUT}" and shown.buttons == []
        assert tool.calls == []
        assert tg.visible(555)[-1] == "Nobody answered, so I did not look."
    finally:
        release.set()
        await t.close()


async def test_the_sinks_end_shown_while_the_press_is_answered_stays(tmp_path, fake_openai, tg, tool, monkeypatch):
    """The press found the request ended; while Telegram takes its time answering the callback query, the sink
    shows the timeout: the press, going on, does not put "no longer pending" over it."""
    reached, release = late_sink(monkeypatch)
    fake_openai.script(ASK, Text("Nobody answered."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool), "approval_timeout": 0.3})
    answering = tg.hold("answerCallbackQuery")
    try:
        tg.user_message("how many apples?")
        msg = await approval_message(t, 555)
        await asyncio.wait_for(reached.wait(), 5)
        press = tg.press(555, msg.message_id, ALLOW)
        await t.wait_for(lambda: tg.count("answerCallbackQuery") == 1)  # decided "not pending", answer on its way

        release.set()
        await t.wait_for(lambda: tg.chats[555][msg.message_id].text == f"{REQUEST}\n\n{TIMED_OUT}")
        answering.set()
        await t.wait_for(lambda: tg.answers(press))
        await t.settle()
        assert [a.get("text") for a in tg.answers(press)] == [GONE]
        shown = tg.chats[555][msg.message_id]
        assert shown.text == f"{REQUEST}\n\n{TIMED_OUT}" and shown.buttons == []
        assert tool.calls == []
    finally:
        release.set()
        answering.set()
        await t.close()


async def test_a_late_press_with_no_sink_to_mark_the_end_closes_the_request(tmp_path, fake_openai, tg, tool,
                                                                           monkeypatch):
    """The sink never marks the ended request (aborted, say): the press found it no longer pending, so the
    message says so and keeps no button."""
    reached, _never = late_sink(monkeypatch)
    fake_openai.script(ASK, Text("Nobody answered."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool), "approval_timeout": 0.3})
    try:
        tg.user_message("how many apples?")
        msg = await approval_message(t, 555)
        await asyncio.wait_for(reached.wait(), 5)
        press = tg.press(555, msg.message_id, ALLOW)
        await t.wait_for(lambda: tg.answers(press))
        await t.wait_for(lambda: not tg.chats[555][msg.message_id].buttons)
        assert [a.get("text") for a in tg.answers(press)] == [GONE]
        assert tg.chats[555][msg.message_id].text == f"{REQUEST}\n\n⌛ No longer pending."
        assert await open_records(t) == []  # nothing left for a restart to close
        assert tool.calls == []
    finally:
        _never.set()
        await t.close()


def ask(call_id: str, query: str) -> ToolCalls:
    return ToolCalls([("lookup", json.dumps({"query": query}))], ids=[call_id])


async def test_an_old_open_request_still_decides_after_many_newer_ones(tmp_path, fake_openai, tg, tool,
                                                                       monkeypatch):
    """More requests were posted in this process than it remembers (here 2) while the first still waits: a
    request that was decided is forgotten, the open one is not. Alice's press on the first still runs the tool,
    and a restart could still close it meanwhile (its record kept it)."""
    monkeypatch.setattr(approvals, "MAX_REMEMBERED", 2)
    fake_openai.script(ask("call_A", "apples"), ask("call_B", "pears"), Text("3 pears."), ask("call_C", "plums"),
                       Text("42 apples."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool), "approval_timeout": 60})
    try:
        tg.user_message("how many apples?", chat_id=555)
        first = await approval_message(t, 555)
        tg.user_message("how many pears?", chat_id=556)
        second = await approval_message(t, 556)
        decided = tg.press(556, second.message_id, ALLOW)
        await t.wait_for(lambda: tg.answers(decided) and tg.visible(556)[-1] == "3 pears.")
        tg.user_message("how many plums?", chat_id=557)
        third = await approval_message(t, 557)

        # the record learns a request's message id once Telegram's answer to the post is in: wait for that
        for _ in range(500):  # at most 5 s
            records = await open_records(t)
            if all(r.get("message_id") for r in records):
                break
            await asyncio.sleep(0.01)
        assert sorted((r["chat_id"], r.get("message_id")) for r in records) == [
            (555, first.message_id), (557, third.message_id)]

        press = tg.press(555, first.message_id, ALLOW)
        await t.wait_for(lambda: tg.answers(press))
        assert [a.get("text") for a in tg.answers(press)] == ["Allowed"]
        await t.wait_for(lambda: tg.visible(555)[-1] == "42 apples.")
        assert tool.calls == [{"query": "pears"}, {"query": "apples"}]
        shown = tg.chats[555][first.message_id]
        assert shown.text == f"{REQUEST}\n\n✅ Allowed by Alice" and shown.buttons == []
    finally:
        await t.close()


async def test_a_press_core_could_not_decide_is_answered_and_can_be_made_again(tmp_path, fake_openai, tg, tool,
                                                                               monkeypatch):
    """Deciding fails (core, or the relay to the process holding the approval): the press is answered "please
    press again" rather than left spinning, nothing changes, and the next press decides."""
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool), "approval_timeout": 60})
    host = t.channel.host
    real = host.decide

    async def failing(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the relay broke")

    try:
        tg.user_message("how many apples?")
        msg = await approval_message(t, 555)
        monkeypatch.setattr(host, "decide", failing)
        press = tg.press(555, msg.message_id, ALLOW)
        await t.wait_for(lambda: tg.answers(press))
        assert [a.get("text") for a in tg.answers(press)] == [PRESS_AGAIN]
        shown = tg.chats[555][msg.message_id]
        assert shown.text == REQUEST and [label for label, _ in shown.buttons] == [ALLOW, DENY]
        assert tool.calls == []

        monkeypatch.setattr(host, "decide", real)
        again = tg.press(555, msg.message_id, ALLOW)
        await t.settle()
        assert [a.get("text") for a in tg.answers(again)] == ["Allowed"]
        assert tool.calls == [{"query": "apples"}]
        assert tg.chats[555][msg.message_id].text == f"{REQUEST}\n\n✅ Allowed by Alice"
        assert tg.visible(555)[-1] == "You have 42 apples."
    finally:
        await t.close()
