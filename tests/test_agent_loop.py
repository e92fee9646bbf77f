"""The agent loop inside one turn, end to end through the fake OpenAI server and the real SDK:
the seed-000 timeline, approvals (ChatCore.decide), tool outputs in call order, and the persisted turn."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from core.agent.deciders import DecideResult
from core.agent.events import TurnEvent
from core.events import CoreEvent, TurnCommitted, TurnStarted
from core.llm.provider import LLMToolSpec
from core.tools.base import ApprovalPolicy, ToolContext, ToolRegistry
from tests.fakes.openai_server import Text, ToolCalls
from tests.support import db
from tests.support.harness import Harness, make_harness
from tests.support.tools import SpecTool

KEY = "test:c1"


class ScriptTool(SpecTool):
    """A test tool: records its calls and answers through ``fn``."""

    def __init__(self, name: str, fn: Callable[[dict[str, Any]], Awaitable[str]],
                 approval: ApprovalPolicy | None = None) -> None:
        super().__init__(LLMToolSpec(name, f"the {name} tool", {"type": "object", "properties": {}}), approval)
        self._fn = fn
        self.calls: list[dict[str, Any]] = []

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        self.calls.append(arguments)
        return await self._fn(arguments)


def record_turn_events(h: Harness, on_event: Callable[[TurnEvent], None] | None = None) -> list[TurnEvent]:
    """Every turn event of every turn, in stream order (subscribed when the turn starts)."""
    seen: list[TurnEvent] = []

    def listener(event: TurnEvent) -> None:
        seen.append(event)
        if on_event is not None:
            on_event(event)

    def on_core(event: CoreEvent) -> None:
        if isinstance(event, TurnStarted):
            event.controller.subscribe(listener)

    h.core.events.subscribe(on_core)
    return seen


def steps(events: list[TurnEvent], names: dict[str, str]) -> list[str]:
    """The visible order as labels; a run of partials of one message collapses into one step."""
    out: list[str] = []
    for e in events:
        call = getattr(e, "call_id", None)
        label = e.kind + (f" {names[call]}" if call in names else "")
        if e.kind == "approval_decision":
            label += f" {e.decision}"
        if e.partial and out and out[-1] == label:
            continue
        out.append(label)
    return out


def request_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    return list(body["messages"])


async def test_the_seed_timeline_two_tools_b_finishes_first(tmp_path, fake_openai):
    release_a = asyncio.Event()
    hold_stream = asyncio.Event()

    async def slow(args: dict[str, Any]) -> str:
        await release_a.wait()
        return "A result"

    async def fast(args: dict[str, Any]) -> str:
        return "B result"

    tools = ToolRegistry(default_policy="ask")
    tools.extend([ScriptTool("slow", slow, "auto"), ScriptTool("fast", fast, "auto")])
    fake_openai.script(
        ToolCalls([("slow", '{"x": 1}'), ("fast", '{"y": 2}')], text="Let me check.", reasoning="Thinking it over",
                  ids=["call_A", "call_B"], hold=hold_stream, usage=(10, 5)),
        Text("Both done."))
    h = await make_harness(tmp_path, fake_openai, tools=tools)

    def drive(event: TurnEvent) -> None:
        if event.kind == "tool_call_output" and event.call_id == "call_B":
            hold_stream.set()  # the stream finishes only after B's output is on the stream
        if event.kind == "request_end" and event.status == "completed":
            release_a.set()  # A finishes only after the LLM stream ended

    events = record_turn_events(h, drive)
    await h.say("check both")
    await h.settle()

    names = {"call_A": "A", "call_B": "B"}
    first_request = steps(events, names)
    assert first_request[:17] == [
        "request_begin",
        "partial_reasoning", "reasoning",
        "partial_text", "text",
        "partial_tool_call A", "tool_call A",
        "approval_decision A allow",
        "partial_tool_call B", "tool_call B",
        "approval_decision B allow",
        "partial_tool_call_output B", "tool_call_output B",
        "token_usage",
        "request_end",
        "partial_tool_call_output A", "tool_call_output A",
    ]
    assert first_request[17:] == ["request_begin", "partial_text", "text", "token_usage", "request_end"]
    # fragment discipline: every segment is start → delta* → stop, and the deltas make the whole
    args_a = "".join(e.arguments for e in events
                     if e.kind == "partial_tool_call" and e.call_id == "call_A")
    assert args_a == '{"x": 1}'
    phases = [e.phase for e in events if e.kind == "partial_reasoning"]
    assert phases[0] == "start" and phases[-1] == "stop" and set(phases[1:-1]) == {"delta"}

    # the next request carries the outputs in call order (A before B), though B finished first
    second = request_messages(fake_openai.requests[1])
    assert [m["role"] for m in second[-3:]] == ["assistant", "tool", "tool"]
    assert [tc["id"] for tc in second[-3]["tool_calls"]] == ["call_A", "call_B"]
    assert [(m["tool_call_id"], m["content"]) for m in second[-2:]] == [("call_A", "A result"), ("call_B", "B result")]
    assert fake_openai.requests[0]["tools"][0]["function"]["name"] in ("fast", "slow")

    # the visible answer keeps the text written before the tool round
    assert h.platform.visible("c1") == ["Let me check.\n\nBoth done."]
    await h.core.shutdown()


async def test_the_turn_is_persisted_with_its_tool_round_and_the_next_turn_sees_it(tmp_path, fake_openai):
    async def clock(args: dict[str, Any]) -> str:
        return "10:00"

    tools = ToolRegistry()
    tools.add(ScriptTool("clock", clock, "auto"))
    fake_openai.script(ToolCalls([("clock", "{}"), ("clock", '{"tz": "UTC"}')]), Text("It is 10:00."), Text("ok"))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    await h.say("time?")
    await h.settle()
    [delta] = h.commits(KEY)
    assert isinstance(delta, TurnCommitted)
    shape = [(m.role, m.source.kind, len(m.tool_calls), m.tool_call_id) for m in delta.messages]
    assert shape == [("user", "user_input", 0, None), ("assistant", "assistant", 2, None),
                     ("tool", "tool", 0, "call_1_0"), ("tool", "tool", 0, "call_1_1"),
                     ("assistant", "assistant", 0, None)]
    assert delta.messages[-1].content == "It is 10:00."

    await h.say("thanks")
    await h.settle()
    third = request_messages(fake_openai.requests[2])
    assert [m["role"] for m in third] == ["system", "user", "assistant", "tool", "tool", "assistant", "user"]
    assert [m["tool_call_id"] for m in third[3:5]] == ["call_1_0", "call_1_1"]
    # the trace keeps complete messages in stream order, partials skipped
    assert h.db_path is not None
    traces = db.traces(h.db_path, KEY)
    kinds = [t.kind for t in traces]
    assert "partial_text" not in kinds and kinds[0] == "request_begin"
    assert kinds.index("tool_call") < kinds.index("approval_decision") < kinds.index("tool_call_output")
    await h.core.shutdown()


async def test_ask_puts_an_approval_in_the_snapshot_and_decide_allows_it(tmp_path, fake_openai):
    async def write(args: dict[str, Any]) -> str:
        return f"wrote {args['path']}"

    tool = ScriptTool("write_file", write)  # the default policy: ask
    tools = ToolRegistry(default_policy="ask")
    tools.add(tool)
    fake_openai.script(ToolCalls([("write_file", '{"path": "a.txt"}')], ids=["call_W"]), Text("Written."))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    events = record_turn_events(h)
    await h.say("write it", sender_id="alice")
    await h.wait_for(lambda: any(e.kind == "approval_request" for e in events))
    started = next(e for e in h.events if isinstance(e, TurnStarted))
    [pending] = started.controller.snapshot.approvals
    assert (pending.call_id, pending.tool_name, pending.requested_by) == ("call_W", "write_file", "alice")
    assert 'path="a.txt"' in pending.arguments_summary
    assert [t.status for t in started.controller.snapshot.tools] == ["awaiting_approval"]
    assert tool.calls == []

    assert h.core.decide(KEY, "call_UNKNOWN", "allow", "alice") is DecideResult.NOT_PENDING
    assert h.core.decide(KEY, "call_W", "allow", decided_by="mallory") is DecideResult.REFUSED  # not the asker
    assert tool.calls == []
    assert h.core.decide(KEY, "call_W", "allow", decided_by="alice") is DecideResult.DECIDED
    assert h.core.decide(KEY, "call_W", "deny", "alice") is DecideResult.NOT_PENDING  # already decided
    await h.settle()
    assert tool.calls == [{"path": "a.txt"}]
    order = [e.kind for e in events if not e.partial]
    assert order.index("approval_request") < order.index("approval_decision") < order.index("tool_call_output")
    decision = next(e for e in events if e.kind == "approval_decision")
    assert (decision.decision, decision.decided_by) == ("allow", "alice")
    assert h.platform.visible("c1") == ["Written."]
    await h.core.shutdown()


async def test_a_denied_call_gets_the_synthetic_output_and_never_runs(tmp_path, fake_openai):
    async def rm(args: dict[str, Any]) -> str:
        return "deleted"

    tool = ScriptTool("rm", rm, "ask")
    blocked = ScriptTool("shutdown", rm, "deny")
    tools = ToolRegistry()
    tools.extend([tool, blocked])
    fake_openai.script(ToolCalls([("rm", '{"path": "/"}'), ("shutdown", "{}")], ids=["call_R", "call_S"]),
                       Text("I could not."))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    events = record_turn_events(h)
    await h.say("clean up")
    await h.wait_for(lambda: any(e.kind == "approval_request" for e in events))
    assert h.core.decide(KEY, "call_R", "deny", decided_by="u1")
    await h.settle()
    assert tool.calls == [] and blocked.calls == []
    outputs = {e.call_id: e.output for e in events if e.kind == "tool_call_output"}
    assert outputs == {"call_R": "Tool call denied by user.", "call_S": "Tool call denied by policy."}
    second = request_messages(fake_openai.requests[1])
    assert [(m["tool_call_id"], m["content"]) for m in second[-2:]] == [
        ("call_R", "Tool call denied by user."), ("call_S", "Tool call denied by policy.")]
    # approvals one at a time in call order: the policy block of S waits behind the user's decision on R
    decisions = [(e.call_id, e.reason) for e in events if e.kind == "approval_decision"]
    assert decisions == [("call_R", "user"), ("call_S", "policy")]
    # the deny-policy tool is not offered to the model at all
    assert [t["function"]["name"] for t in fake_openai.requests[0]["tools"]] == ["rm"]
    await h.core.shutdown()


async def test_a_tool_that_raises_is_a_failed_output_and_big_or_empty_outputs_are_shaped(tmp_path, fake_openai):
    async def boom(args: dict[str, Any]) -> str:
        raise OSError("disk on fire")

    async def big(args: dict[str, Any]) -> str:
        return "x" * 20_000

    async def empty(args: dict[str, Any]) -> str:
        return ""

    tools = ToolRegistry(default_policy="auto")
    tools.extend([ScriptTool("boom", boom), ScriptTool("big", big), ScriptTool("empty", empty)])
    fake_openai.script(ToolCalls([("boom", "{}"), ("big", "{}"), ("empty", "{}")]), Text("done"))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    await h.say("go")
    await h.settle()
    tool_msgs = [m for m in request_messages(fake_openai.requests[1]) if m["role"] == "tool"]
    assert "OSError" in tool_msgs[0]["content"] and "disk on fire" in tool_msgs[0]["content"]
    assert tool_msgs[1]["content"].startswith("x" * 16_000) and "truncated" in tool_msgs[1]["content"]
    assert len(tool_msgs[1]["content"]) < 16_100
    assert tool_msgs[2]["content"] == "[no output]"
    started = next(e for e in h.events if isinstance(e, TurnStarted))
    assert [t.status for t in started.controller.snapshot.tools] == ["failed", "done", "done"]
    await h.core.shutdown()


async def test_interleaved_fragments_are_assembled_per_call(tmp_path, fake_openai):
    async def echo(args: dict[str, Any]) -> str:
        return json.dumps(args, sort_keys=True)

    tools = ToolRegistry(default_policy="auto")
    tools.add(ScriptTool("echo", echo))
    fake_openai.script(ToolCalls([("echo", '{"a": "first value"}'), ("echo", '{"b": "second value"}')],
                                 interleave=True, fragment_size=3), Text("done"))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    await h.say("go")
    await h.settle()
    tool_msgs = [m["content"] for m in request_messages(fake_openai.requests[1]) if m["role"] == "tool"]
    assert tool_msgs == ['{"a": "first value"}', '{"b": "second value"}']
    await h.core.shutdown()


async def test_parallel_calls_are_told_apart_by_their_ids_whatever_their_index_says(tmp_path, fake_openai):
    """Gemini's OpenAI-compatible endpoint sends no ``index``; other servers send 0 for every call. A new id
    is a new call: each of the model's calls runs once and gets its own output."""
    async def echo(args: dict[str, Any]) -> str:
        return json.dumps(args, sort_keys=True)

    for index in ("none", "zero"):
        tools = ToolRegistry(default_policy="auto")
        tool = ScriptTool("echo", echo)
        tools.add(tool)
        fake_openai.requests.clear()
        fake_openai.script(ToolCalls([("echo", '{"a": "first"}'), ("echo", '{"b": "second"}')], index=index,
                                     ids=["function-call-1", "function-call-2"], fragment_size=4), Text("done"))
        h = await make_harness(tmp_path / index, fake_openai, tools=tools)
        await h.say("go")
        await h.settle()
        assert tool.calls == [{"a": "first"}, {"b": "second"}], index
        sent = request_messages(fake_openai.requests[1])
        assert [c["id"] for c in sent[-3]["tool_calls"]] == ["function-call-1", "function-call-2"]
        assert [(m["tool_call_id"], m["content"]) for m in sent[-2:]] == [
            ("function-call-1", '{"a": "first"}'), ("function-call-2", '{"b": "second"}')]
        await h.core.shutdown()


async def test_two_calls_of_one_reply_with_the_same_id_both_run_and_both_get_an_output(tmp_path, fake_openai):
    """A model that gives two calls of one reply the same id (at different indices): the second is a call of
    its own, renamed so that each call and its output agree, not fragments of the first."""
    async def echo(args: dict[str, Any]) -> str:
        return json.dumps(args, sort_keys=True)

    tools = ToolRegistry(default_policy="auto")
    tool = ScriptTool("echo", echo)
    tools.add(tool)
    fake_openai.script(ToolCalls([("echo", '{"a": 1}'), ("echo", '{"b": 2}')], ids=["dup", "dup"]), Text("done"))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    try:
        await h.say("go")
        await h.settle()
        assert tool.calls == [{"a": 1}, {"b": 2}]
        sent = request_messages(fake_openai.requests[1])
        ids = [c["id"] for c in sent[-3]["tool_calls"]]
        assert ids[0] == "dup" and ids[1].startswith("dup_") and len(set(ids)) == 2
        assert [(m["tool_call_id"], m["content"]) for m in sent[-2:]] == [
            (ids[0], '{"a": 1}'), (ids[1], '{"b": 2}')]
    finally:
        await h.core.shutdown()


async def test_an_answer_cut_at_the_output_limit_says_so_in_the_chat_and_in_history(tmp_path, fake_openai):
    fake_openai.script(Text("Step 1: open the lid. Step 2: remove the", finish_reason="length"))
    h = await make_harness(tmp_path, fake_openai, max_output_tokens=200)
    await h.say("how do I fix it?")
    await h.settle()
    notice = ("The answer was cut off: it reached the model's output limit (max_output_tokens = 200). "
              "Send another message to continue.")
    assert h.platform.visible("c1") == [f"Step 1: open the lid. Step 2: remove the\n\n{notice}"]
    _, history = await h.core.history(KEY)
    assert [(m.source.kind, m.content) for m in history] == [
        ("user_input", "how do I fix it?"), ("assistant", "Step 1: open the lid. Step 2: remove the"),
        ("notice", notice)]
    await h.core.shutdown()


async def test_an_answer_the_content_filter_stopped_says_so(tmp_path, fake_openai):
    fake_openai.script(Text("Here is how", finish_reason="content_filter"), Text("A whole answer."))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("one")
    await h.say("two")
    await h.settle()
    assert h.platform.visible("c1") == [
        "Here is how\n\nThe answer was cut off: the provider's content filter stopped it. Send another message "
        "to continue.", "A whole answer."]  # a whole answer gets no notice
    await h.core.shutdown()
