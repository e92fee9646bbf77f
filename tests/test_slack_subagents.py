"""Subagents on Slack through the real slack-bolt / slack_sdk and the fake Slack: the live reply shows a status
line per running child (never the child's text), a child's approval is posted with its label and decided
with its Block Kit button, and the thread ends with exactly one final answer."""

from __future__ import annotations

import pytest

from tests.browser.server import RecordingTool, registry
from tests.fakes.openai_server import Function
from tests.fakes.slack.harness import slack_harness
from tests.support.subagents import CHILD_WORDS, COUNTER, FINAL, counter_route


@pytest.mark.parametrize("mode", ["socket", "http"])
async def test_status_line_child_approval_from_the_button_and_one_final_answer(tmp_path, fake_openai, fake_slack, mode):
    tool = RecordingTool("lookup", result="42")
    fake_openai.default = Function(counter_route)
    t = await slack_harness(tmp_path, fake_openai, fake_slack, mode,
                            core={"tools": registry(tool), "subagents": COUNTER})
    try:
        mention, _ = fake_slack.mention("how many apples?")
        root = mention["event"]["ts"]
        await t.deliver(mention)
        status = "counter: TASK count apples · waiting for approval: lookup"
        await t.wait_for(lambda: any(status in m.text for m in fake_slack.messages("C0GENERAL")))
        [prompt] = [m for m in fake_slack.messages("C0GENERAL") if any(b.get("type") == "actions" for b in m.blocks)]
        assert prompt.thread_ts == root
        assert "asked by subagent counter: TASK count apples" in prompt.shown
        assert tool.calls == []

        assert (await t.press(fake_slack.press(prompt, "Allow"))).acked
        await t.settle()
        assert tool.calls == [{"query": "apples"}]
        assert "Allowed by <@U0ALICE>" in fake_slack.message("C0GENERAL", prompt.ts).shown
        replies = [m.shown for m in fake_slack.messages("C0GENERAL", thread_ts=root) if m.ts != prompt.ts]
        assert replies == [FINAL]  # one final answer, no status line left, no child text
        assert not any(CHILD_WORDS in m.shown for m in fake_slack.messages("C0GENERAL"))
    finally:
        await t.close()
