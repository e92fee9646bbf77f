"""Edge cases of the agent loop through the fake OpenAI server: abort, retries, auth, max_turns,
approval timeout, compaction, overflow recovery, and the bridge's tool wiring."""

from __future__ import annotations

import asyncio
from typing import Any

from bridge.app import build_tools
from bridge.config import load_config
from core.agent.deciders import DecideResult
from core.events import TurnStarted
from core.tools.base import ToolRegistry
from tests.fakes.openai_server import HttpError, StreamError, Text, ToolCalls, Unreadable
from tests.support.harness import make_harness
from tests.test_agent_loop import KEY, ScriptTool, record_turn_events, request_messages


async def test_abort_during_a_running_tool_cancels_it_and_abort_is_last(tmp_path, fake_openai):
    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def slow(args: dict[str, Any]) -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            cancelled.set()
        return "never"

    tools = ToolRegistry(default_policy="auto")
    tools.add(ScriptTool("slow", slow))
    fake_openai.script(ToolCalls([("slow", "{}")], text="Working on it.", ids=["call_S"]), Text("next turn"))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    events = record_turn_events(h)
    await h.say("go")
    await asyncio.wait_for(started.wait(), 5)
    await h.say("/stop")
    await h.settle()
    assert cancelled.is_set()
    assert events[-1].kind == "abort"
    assert not any(e.kind == "tool_call_output" for e in events)  # no orphan output on the stream
    assert len(fake_openai.requests) == 1
    [shown] = h.platform.visible("c1")  # one terminal message
    assert shown.startswith("Working on it.")
    # the unfinished call enters the next context as a note
    await h.say("and now?")
    await h.settle()
    nxt = request_messages(fake_openai.requests[1])
    tool_msgs = [m for m in nxt if m["role"] == "tool"]
    assert tool_msgs and tool_msgs[0]["tool_call_id"] == "call_S" and "aborted" in tool_msgs[0]["content"]
    await h.core.shutdown()


async def test_abort_during_a_pending_approval_denies_it(tmp_path, fake_openai):
    async def never(args: dict[str, Any]) -> str:
        raise AssertionError("must not run")

    tools = ToolRegistry(default_policy="ask")
    tools.add(ScriptTool("danger", never))
    fake_openai.script(ToolCalls([("danger", "{}")], ids=["call_D"]))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    events = record_turn_events(h)
    await h.say("go")
    await h.wait_for(lambda: any(e.kind == "approval_request" for e in events))
    await h.say("/stop")
    await h.settle()
    tail = [(e.kind, getattr(e, "reason", None)) for e in events[-2:]]
    assert tail == [("approval_decision", "abort"), ("abort", "stop")]
    assert h.core.decide(KEY, "call_D", "allow", "u1") is DecideResult.NOT_PENDING  # nothing pending any more
    snap = next(e for e in h.events if isinstance(e, TurnStarted)).controller.snapshot
    assert snap.approvals == () and snap.state == "cancelled"
    await h.core.shutdown()


async def test_the_approval_timeout_denies(tmp_path, fake_openai):
    async def never(args: dict[str, Any]) -> str:
        raise AssertionError("must not run")

    tools = ToolRegistry(default_policy="ask")
    tools.add(ScriptTool("danger", never))
    fake_openai.script(ToolCalls([("danger", "{}")]), Text("Not approved, so I did nothing."))
    h = await make_harness(tmp_path, fake_openai, tools=tools, approval_timeout=0.2)
    events = record_turn_events(h)
    await h.say("go")
    await h.settle()
    decision = next(e for e in events if e.kind == "approval_decision")
    assert (decision.decision, decision.reason) == ("deny", "timeout")
    assert "denied" in request_messages(fake_openai.requests[1])[-1]["content"]
    assert h.platform.visible("c1") == ["Not approved, so I did nothing."]
    await h.core.shutdown()


async def test_503_then_success_follows_the_ladder_per_request(tmp_path, fake_openai):
    async def clock(args: dict[str, Any]) -> str:
        return "noon"

    tools = ToolRegistry(default_policy="auto")
    tools.add(ScriptTool("clock", clock))
    fake_openai.script(ToolCalls([("clock", "{}")]), HttpError.server(503), Text("It is noon."))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    events = record_turn_events(h)
    await h.say("time?")
    await h.settle()
    ends = [(e.status, e.attempt, e.retry_in is not None) for e in events if e.kind == "request_end"]
    assert ends == [("completed", 1, False), ("failed", 1, True), ("completed", 2, False)]
    assert len(fake_openai.requests) == 3
    assert h.platform.visible("c1") == ["It is noon."]
    await h.core.shutdown()


async def test_an_unreadable_answer_is_retried_and_the_turn_answers(tmp_path, fake_openai):
    fake_openai.script(Unreadable(), Text("fine"))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("hi")
    await h.settle()
    assert len(fake_openai.requests) == 2
    assert h.platform.visible("c1") == ["fine"]
    await h.core.shutdown()


async def test_auth_stops_at_once_with_one_failure_reply(tmp_path, fake_openai):
    fake_openai.script(HttpError.auth())
    h = await make_harness(tmp_path, fake_openai)
    events = record_turn_events(h)
    await h.say("hi")
    await h.settle()
    assert len(fake_openai.requests) == 1
    assert [(e.kind, getattr(e, "status", None)) for e in events if e.kind.startswith("request")] == [
        ("request_begin", None), ("request_end", "auth")]
    assert len(h.platform.visible("c1")) == 1
    await h.core.shutdown()


async def test_max_turns_ends_a_runaway_loop_with_a_notice(tmp_path, fake_openai):
    async def again(args: dict[str, Any]) -> str:
        return "try again"

    tools = ToolRegistry(default_policy="auto")
    tools.add(ScriptTool("again", again))
    fake_openai.default = ToolCalls([("again", "{}")])
    h = await make_harness(tmp_path, fake_openai, tools=tools, max_turns=3)
    events = record_turn_events(h)
    await h.say("loop")
    await h.settle()
    assert len(fake_openai.requests) == 3
    assert events[-1].kind == "notice" and "max_turns = 3" in events[-1].text
    [shown] = h.platform.visible("c1")
    assert "max_turns" in shown
    [delta] = h.commits(KEY)
    assert [m.role for m in delta.messages].count("tool") == 3
    await h.core.shutdown()


async def test_compaction_summarizes_once_and_keeps_the_system_prompt_once(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai, context_window=400, compaction_threshold=0.5)
    for i in range(2):  # about 166 estimated tokens: under half the window; the next turn passes it
        fake_openai.script(Text(f"answer {i} " + "x" * 200))
        await h.say(f"question {i} " + "y" * 200)
        await h.settle()
    n = len(fake_openai.requests)
    fake_openai.script(Text("SUMMARY: questions 0-1 answered."), Text("final"))
    events = record_turn_events(h)
    await h.say("question 3")
    await h.settle()
    summary_req, answer_req = fake_openai.requests[n], fake_openai.requests[n + 1]
    assert "Summarize" in summary_req["messages"][0]["content"]
    kinds = [e.kind for e in events if not e.partial]
    assert kinds[:3] == ["compaction_begin", "token_usage", "compaction_end"]
    assert kinds[3] == "request_begin"
    msgs = request_messages(answer_req)
    assert [m["role"] for m in msgs].count("system") == 1 and msgs[0]["role"] == "system"
    assert "SUMMARY: questions 0-1" in msgs[1]["content"]
    assert msgs[-1]["content"].startswith("question 3") and msgs[-1]["content"].count("[Runtime context]") == 1
    assert "SUMMARY" not in h.platform.visible("c1")[-1]  # never streamed to the user
    # the next turn starts from the stored summary
    fake_openai.script(Text("ok"))
    await h.say("q4")
    await h.settle()
    nxt = request_messages(fake_openai.requests[-1])
    assert "SUMMARY: questions 0-1" in nxt[1]["content"] and "question 0" not in str(nxt)
    await h.core.shutdown()


async def test_overflow_recovery_happens_at_most_once(tmp_path, fake_openai):
    fake_openai.script(HttpError.context_overflow(), HttpError.context_overflow(), Text("never"))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("hi")
    await h.settle()
    assert len(fake_openai.requests) == 2
    for body in fake_openai.requests:
        assert [m["role"] for m in body["messages"]].count("system") == 1
    await h.core.shutdown()


async def test_an_overflow_after_some_text_takes_the_text_back_before_asking_again(tmp_path, fake_openai):
    """Some servers (llama.cpp's) report a full context mid-answer: the request is made again on a rebuilt
    input, and the chat shows its answer once, as history keeps it."""
    fake_openai.script(
        StreamError(message="This model's maximum context length is 8192 tokens.", code="context_length_exceeded",
                    type="invalid_request_error", after_text="The capital of France"),
        Text("The capital of France is Paris."))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("capital of france?")
    await h.settle()
    assert len(fake_openai.requests) == 2
    assert h.platform.visible("c1") == ["The capital of France is Paris."]
    _, history = await h.core.history(KEY)
    assert history[-1].content == "The capital of France is Paris."
    await h.core.shutdown()


async def test_compact_command_stores_a_summary_the_next_turn_starts_from(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai)
    fake_openai.script(Text("first answer"))
    await h.say("first question")
    await h.settle()
    fake_openai.script(Text("SUMMARY-OF-IT"))
    await h.say("/compact")
    await h.settle()
    assert "Compacted" in h.platform.plain("c1")[-1]
    fake_openai.script(Text("ok"))
    await h.say("next")
    await h.settle()
    msgs = request_messages(fake_openai.requests[-1])
    assert [m["role"] for m in msgs] == ["system", "user", "user"]
    assert "SUMMARY-OF-IT" in msgs[1]["content"] and "first question" not in str(msgs)
    await h.core.shutdown()


def test_the_bridge_registers_the_builtins_with_the_operator_policy(tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text('[agent]\napproval = "ask"\n[agent.tool_approval]\ncurrent_time = "deny"\n'
                   '[agent.fetch_url]\nenabled = true\n')
    registry = build_tools(load_config(cfg, env={}))
    assert registry.names() == ["current_time", "fetch_url"]
    assert (registry.policy("current_time"), registry.policy("fetch_url")) == ("deny", "ask")
    assert build_tools(load_config(None, env={})).names() == ["current_time"]
