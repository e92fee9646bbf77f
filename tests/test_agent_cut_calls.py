"""Tool calls in a reply the output limit cut off, end to end through the fake servers and the real SDKs: a
call still incomplete when the reply stopped (even one cut before its first argument, which would read as
"no arguments") is neither offered for approval nor run, gets one output saying why, and the turn ends with
the cut-off notice instead of asking the model again for the same call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.llm.provider import LLMToolSpec
from core.tools.base import ApprovalPolicy, ToolContext, ToolRegistry
from tests.fakes.anthropic_server import FakeAnthropic, ToolUses
from tests.fakes.anthropic_server import Text as AnthropicText
from tests.fakes.openai_server import FakeOpenAI, Text, ToolCalls
from tests.support.harness import anthropic_harness, make_harness
from tests.support.tools import QUERY, SpecTool
from tests.test_agent_loop import record_turn_events

NOTICE = ("The answer was cut off: it reached the model's output limit (max_output_tokens = 64). "
          "Send another message to continue.")
CUT_OUTPUT = ("Tool call not run: the reply was cut off before this call was complete; it reached the model's "
              "output limit (max_output_tokens = 64).")


class QueryTool(SpecTool):
    """A tool with one optional argument: called with none, it would just run with its default."""

    def __init__(self, name: str, approval: ApprovalPolicy) -> None:
        super().__init__(LLMToolSpec(name, f"the {name} tool", QUERY), approval)
        self.calls: list[dict[str, Any]] = []

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        self.calls.append(arguments)
        return f"{self.spec.name} ran"


def registry(*tools: QueryTool) -> ToolRegistry:
    reg = ToolRegistry(default_policy="ask")
    reg.extend(list(tools))
    return reg


@pytest.mark.parametrize("policy", ["ask", "auto"])
@pytest.mark.parametrize("arguments", ["", '{"query": "rm -r'], ids=["before-any-argument", "mid-argument"])
async def test_openai_a_call_cut_by_the_output_limit_is_not_run_and_the_turn_ends_with_the_notice(
        tmp_path: Path, fake_openai: FakeOpenAI, policy: ApprovalPolicy, arguments: str) -> None:
    tool = QueryTool("danger", policy)
    fake_openai.script(ToolCalls([("danger", arguments)], text="Running it.", ids=["call_cut"],
                                 finish_reason="length"),
                       Text("asked again for the same call"), Text("ok, continuing"))
    h = await make_harness(tmp_path, fake_openai, tools=registry(tool), max_output_tokens=64,
                           approval_timeout=1.0)
    events = record_turn_events(h)
    try:
        await h.say("delete the build folder")
        await h.settle()
        assert not [e for e in events if e.kind == "approval_request"]  # nobody was asked
        assert tool.calls == []  # and nothing ran
        assert len(fake_openai.requests) == 1  # the model was not asked again for the same cut call
        assert h.platform.visible("c1") == [f"Running it.\n\n{NOTICE}"]

        # the model learns, with its next request, that the call was cut off and not run
        await h.say("go on")
        await h.settle()
        sent = fake_openai.requests[1]["messages"]
        assert [tc["id"] for tc in sent[-3]["tool_calls"]] == ["call_cut"]
        assert (sent[-2]["role"], sent[-2]["tool_call_id"], sent[-2]["content"]) == ("tool", "call_cut", CUT_OUTPUT)
        assert sent[-1]["role"] == "user" and sent[-1]["content"].startswith("go on")
        assert tool.calls == []
    finally:
        await h.core.shutdown()


async def test_openai_calls_whole_before_the_cut_run_and_only_the_cut_one_is_refused(
        tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    first, cut = QueryTool("lookup", "auto"), QueryTool("danger", "auto")
    fake_openai.script(ToolCalls([("lookup", '{"query": "a"}'), ("danger", '{"query": "b')], ids=["call_1", "call_2"],
                                 finish_reason="length"),
                       Text("asked again"), Text("fine"))
    h = await make_harness(tmp_path, fake_openai, tools=registry(first, cut), max_output_tokens=64)
    try:
        await h.say("look it up")
        await h.settle()
        assert (first.calls, cut.calls) == ([{"query": "a"}], [])
        assert len(fake_openai.requests) == 1
        assert h.platform.visible("c1") == [NOTICE]
        await h.say("go on")
        await h.settle()
        sent = fake_openai.requests[1]["messages"]
        assert [(m["tool_call_id"], m["content"]) for m in sent[-3:-1]] == [
            ("call_1", "lookup ran"), ("call_2", CUT_OUTPUT)]  # every call: exactly one output, in call order
    finally:
        await h.core.shutdown()


@pytest.mark.parametrize("policy", ["ask", "auto"])
@pytest.mark.parametrize("arguments", ["", '{"query": "rm -r'], ids=["before-any-input", "mid-input"])
async def test_anthropic_a_tool_use_cut_at_max_tokens_is_not_run_and_the_turn_ends_with_the_notice(
        tmp_path: Path, fake_anthropic: FakeAnthropic, policy: ApprovalPolicy, arguments: str) -> None:
    tool = QueryTool("danger", policy)
    fake_anthropic.script(ToolUses([("danger", arguments)], text="Running it.", ids=["toolu_cut"],
                                   stop_reason="max_tokens"),
                          AnthropicText("asked again for the same call"), AnthropicText("ok, continuing"))
    h = await anthropic_harness(tmp_path, fake_anthropic, tools=registry(tool), max_output_tokens=64,
                                approval_timeout=1.0)
    events = record_turn_events(h)
    try:
        await h.say("delete the build folder")
        await h.settle()
        assert not [e for e in events if e.kind == "approval_request"]
        assert tool.calls == []
        assert len(fake_anthropic.requests) == 1
        assert h.platform.visible("c1") == [f"Running it.\n\n{NOTICE}"]

        await h.say("go on")
        await h.settle()
        turns = fake_anthropic.requests[1]["messages"]
        uses = [b for b in turns[-2]["content"] if b["type"] == "tool_use"]
        assert [b["id"] for b in uses] == ["toolu_cut"]
        results = [b for b in turns[-1]["content"] if b["type"] == "tool_result"]
        assert [(b["tool_use_id"], b["content"]) for b in results] == [("toolu_cut", CUT_OUTPUT)]
        assert tool.calls == []
    finally:
        await h.core.shutdown()


async def test_anthropic_a_call_without_arguments_still_runs_when_the_reply_is_whole(
        tmp_path: Path, fake_anthropic: FakeAnthropic) -> None:
    """The other side of the cut: a whole call without arguments (no input streamed) runs as ``{}``, also when
    another call follows it."""
    bare, other = QueryTool("bare", "auto"), QueryTool("other", "auto")
    fake_anthropic.script(ToolUses([("bare", ""), ("other", '{"query": "x"}')]), AnthropicText("done"))
    h = await anthropic_harness(tmp_path, fake_anthropic, tools=registry(bare, other), max_output_tokens=64)
    try:
        await h.say("go")
        await h.settle()
        assert (bare.calls, other.calls) == ([{}], [{"query": "x"}])
        assert h.platform.visible("c1") == ["done"]
    finally:
        await h.core.shutdown()
