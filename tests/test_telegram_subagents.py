"""Subagents on Telegram through the real aiogram client and the fake Bot API: the live message shows one
compact status line per running child (never the child's text), a child's approval is posted with its
label and decided from the inline keyboard, and the chat ends with exactly one final answer."""

from __future__ import annotations

import json

from core.settings import SubagentProfile, SubagentSettings
from tests.browser.server import RecordingTool, registry
from tests.fakes.openai_server import Function, Text, ToolCalls
from tests.fakes.telegram.harness import telegram_harness
from tests.support.subagents import CHILD_WORDS, COUNTER, FINAL, counter_route, first_user_text

ALLOW = "✅ Allow"



async def test_status_line_child_approval_from_the_keyboard_and_one_final_answer(tmp_path, fake_openai, tg):
    tool = RecordingTool("lookup", result="42")
    fake_openai.default = Function(counter_route)
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool), "subagents": COUNTER})
    try:
        tg.user_message("how many apples?")
        status = "⏳ counter: TASK count apples · waiting for approval: lookup"
        await t.wait_for(lambda: any(status in text for text in tg.visible(555)))
        [prompt] = [m for m in tg.messages(555) if m.buttons]
        assert prompt.text == ('🔧 Approval needed: lookup\n🤖 asked by subagent counter: TASK count apples\n'
                               'query="apples"')
        assert tool.calls == []

        press = tg.press(555, prompt.message_id, ALLOW)
        await t.settle()
        assert tool.calls == [{"query": "apples"}]
        assert [a.get("text") for a in tg.answers(press)] == ["Allowed"]
        assert tg.chats[555][prompt.message_id].text.endswith("✅ Allowed by Alice")

        # the chat: the decided request and the one final answer; no status line left, no child text
        assert tg.visible(555) == [tg.chats[555][prompt.message_id].text, FINAL]
        sent = [c.params.get("text", "") for c in tg.calls_to(555, "sendMessage", "editMessageText")]
        assert not [text for text in sent if CHILD_WORDS in text]
        assert sum(1 for c in tg.calls_to(555, "sendMessage") if c.params.get("text") == FINAL) <= 1
        assert FINAL in [c.params.get("text") for c in tg.calls_to(555, "sendMessage", "editMessageText")]
    finally:
        await t.close()


async def test_one_status_line_per_running_child_while_the_reply_streams(tmp_path, fake_openai, tg):
    import asyncio

    release = asyncio.Event()

    def two(body):
        tool_results = [m for m in body["messages"] if m["role"] == "tool"]
        task = first_user_text(body)
        if not task.startswith("TASK"):
            if tool_results:
                return Text(FINAL)
            return ToolCalls([("run_subagent", json.dumps({"task": "TASK apples"})),
                              ("run_subagent", json.dumps({"task": "TASK pears"}))],
                             text="Asking two helpers.", ids=["call_1", "call_2"])
        return Text(f"{task.split()[1]} counted, a long enough child answer", hold=release, hold_after=5)

    fake_openai.default = Function(two)
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"subagents": SubagentSettings(enabled=True)})
    try:
        tg.user_message("count the fruit")
        lines = ("⏳ TASK apples · writing", "⏳ TASK pears · writing")
        await t.wait_for(lambda: any(all(line in text for line in lines) for text in tg.visible(555)))
        [live] = tg.visible(555)
        assert live == "Asking two helpers.\n\n" + "\n".join(lines)
        release.set()
        await t.settle()
        assert tg.visible(555) == [f"Asking two helpers.\n\n{FINAL}"]
        sent = [c.params.get("text", "") for c in tg.calls_to(555, "sendMessage", "editMessageText")]
        assert not [text for text in sent if "counted" in text]
    finally:
        await t.close()


async def test_status_lines_in_a_private_chats_draft_preview(tmp_path, fake_openai, tg):
    import asyncio

    release = asyncio.Event()

    def one(body):
        tool_results = [m for m in body["messages"] if m["role"] == "tool"]
        if not first_user_text(body).startswith("TASK"):
            if tool_results:
                return Text(FINAL)
            return ToolCalls([("run_subagent", json.dumps({"task": "TASK apples", "profile": "counter"}))],
                             text="Asking a helper.", ids=["call_1"])
        return Text("apples counted by the helper", hold=release, hold_after=5)

    fake_openai.default = Function(one)
    subagents = SubagentSettings(enabled=True, profiles=(SubagentProfile("counter"),))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"subagents": subagents}, stream_transport="auto")
    try:
        tg.user_message("count the apples")
        line = "⏳ counter: TASK apples · writing"
        await t.wait_for(lambda: tg.drafts.get(555, (0, ""))[1] == f"Asking a helper.\n\n{line}")
        release.set()
        await t.settle()
        assert tg.visible(555) == [f"Asking a helper.\n\n{FINAL}"]
        drafts = [c.params.get("text", "") for c in tg.calls_to(555, "sendMessageDraft")]
        assert drafts and not [d for d in drafts if "counted" in d or "apples c" in d]
    finally:
        await t.close()


async def test_stop_while_a_child_waits_for_approval_stops_both_and_nothing_runs(tmp_path, fake_openai, tg):
    import time

    tool = RecordingTool("lookup", result="42")
    fake_openai.default = Function(counter_route)
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool), "subagents": COUNTER})
    try:
        tg.user_message("how many apples?")
        await t.wait_for(lambda: [m for m in tg.messages(555) if m.buttons])
        [prompt] = [m for m in tg.messages(555) if m.buttons]
        allow_data = dict(prompt.buttons)[ALLOW]
        started = time.monotonic()
        tg.user_message("/stop")
        await t.wait_for(lambda: not tg.chats[555][prompt.message_id].buttons, timeout=5)
        await t.settle()
        assert time.monotonic() - started < 5
        assert tg.chats[555][prompt.message_id].text.endswith("\n\n⏹ The reply was stopped before a decision.")
        press = tg.press(555, prompt.message_id, ALLOW, data=allow_data)  # a late press: nothing to decide
        await t.wait_for(lambda: tg.answers(press))
        assert tool.calls == []
        assert any("Stopped" in text for text in tg.visible(555))
        assert not [text for text in tg.visible(555) if "⏳" in text]  # no status line left behind
        assert len(fake_openai.requests) == 2  # the parent's and the child's first: nothing ran after
    finally:
        await t.close()
