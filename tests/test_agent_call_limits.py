"""One model reply with very many tool calls, end to end through the fake OpenAI server and the real SDK: only
the first ``MAX_CALLS_PER_REPLY`` are taken (asked, run), each one beyond gets one output saying so, and the
allowed tools run at most ``MAX_TOOLS_AT_ONCE`` at a time."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from core.agent.approvals import MAX_CALLS_PER_REPLY, MAX_TOOLS_AT_ONCE
from core.agent.events import TurnEvent
from core.llm.provider import LLMToolSpec
from core.tools.base import ApprovalPolicy, ToolContext, ToolRegistry
from tests.fakes.openai_server import FakeOpenAI, Text, ToolCalls
from tests.support.harness import make_harness
from tests.support.tools import QUERY, SpecTool
from tests.test_agent_loop import KEY, record_turn_events

CALLS = MAX_CALLS_PER_REPLY + 8
TOO_MANY = (f"Tool call not run: more than {MAX_CALLS_PER_REPLY} tool calls in one reply; call fewer at a "
            "time.")


class HeldTool(SpecTool):
    """Counts how many of its runs are going at once; each run waits for ``release``."""

    def __init__(self, name: str, approval: ApprovalPolicy) -> None:
        super().__init__(LLMToolSpec(name, f"the {name} tool", QUERY), approval)
        self.release = asyncio.Event()
        self.running = 0
        self.peak = 0
        self.runs = 0

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        self.runs += 1
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await self.release.wait()
        finally:
            self.running -= 1
        return f"result {arguments['query']}"


def many(name: str) -> ToolCalls:
    return ToolCalls([(name, json.dumps({"query": f"q{i}"})) for i in range(CALLS)],
                     ids=[f"call_{i}" for i in range(CALLS)], fragment_size=50)


def outputs(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m["tool_call_id"], m["content"]) for m in body["messages"] if m["role"] == "tool"]


async def test_calls_beyond_the_cap_are_not_asked_for_and_each_gets_one_output(
        tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    tool = HeldTool("danger", "ask")
    tool.release.set()
    tools = ToolRegistry(default_policy="ask")
    tools.add(tool)
    fake_openai.script(many("danger"), Text("Done."))
    h = await make_harness(tmp_path, fake_openai, tools=tools)

    def deny_each(event: TurnEvent) -> None:
        if event.kind == "approval_request":  # the user denies every request shown (once it is open)
            call_id = event.call_id
            asyncio.get_running_loop().call_soon(lambda: h.core.decide(KEY, call_id, "deny", "u1"))

    events = record_turn_events(h, deny_each)
    try:
        await h.say("go")
        await h.settle()
        asked = [e.call_id for e in events if e.kind == "approval_request"]
        assert asked == [f"call_{i}" for i in range(MAX_CALLS_PER_REPLY)]
        assert tool.runs == 0
        assert outputs(fake_openai.requests[1]) == [
            *((f"call_{i}", "Tool call denied by user.") for i in range(MAX_CALLS_PER_REPLY)),
            *((f"call_{i}", TOO_MANY) for i in range(MAX_CALLS_PER_REPLY, CALLS))]
        assert h.platform.visible("c1") == ["Done."]
    finally:
        await h.core.shutdown()


async def test_auto_tools_of_one_reply_run_a_few_at_a_time(tmp_path: Path, fake_openai: FakeOpenAI) -> None:
    tool = HeldTool("fetch", "auto")
    tools = ToolRegistry(default_policy="auto")
    tools.add(tool)
    hold_stream = asyncio.Event()
    calls = many("fetch")
    calls.hold = hold_stream  # the reply stays open after its last call, the tools already started
    fake_openai.script(calls, Text("Done."))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    events = record_turn_events(h)
    try:
        await h.say("go")
        # every call taken has been allowed, and the model's stream waits: all that may run has started
        await h.wait_for(lambda: sum(1 for e in events if e.kind == "approval_decision") == MAX_CALLS_PER_REPLY
                         and tool.running >= MAX_TOOLS_AT_ONCE)
        assert tool.running == MAX_TOOLS_AT_ONCE
        hold_stream.set()
        tool.release.set()
        await h.settle()
        assert tool.runs == MAX_CALLS_PER_REPLY and tool.peak == MAX_TOOLS_AT_ONCE
        assert outputs(fake_openai.requests[1]) == [
            *((f"call_{i}", f"result q{i}") for i in range(MAX_CALLS_PER_REPLY)),
            *((f"call_{i}", TOO_MANY) for i in range(MAX_CALLS_PER_REPLY, CALLS))]
        assert h.platform.visible("c1") == ["Done."]
    finally:
        await h.core.shutdown()
