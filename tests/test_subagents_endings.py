"""How a turn with subagents ends when something other than a press ends it, through the real Telegram client
and the fake Bot API (the web chat for shutdown): a failure of the turn's or the child's model stream marks the
child's approval prompt as failed (not as timed out or stopped) and never tells the model that the user stopped
anything; a /stop while the child's first write is being saved still closes the child's turn; a stop keeps one
``subagent`` pointer per child in the turn's trace; a shutdown stops the child saying so.

The model's stream is held where the test needs it (at its end, until the test lets it fail), and the store's
first child write is held until the stop reached the call, so each case happens in the same order every run."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from channels.common.live_sink import ended_line
from core.agent.events import Abort, ApprovalRequested, CompleteToolCall, Forwarded, SessionMeta
from core.controller import TurnController
from core.llm.provider import LLMRequest, ProviderError, ProviderErrorKind, ProviderEvent, StreamEnd
from core.settings import SubagentSettings
from tests.browser.server import RecordingTool, new_session, open_stream, registry, start_web_chat
from tests.fakes.openai_server import Function, Text, ToolCalls
from tests.fakes.telegram.harness import TelegramHarness, telegram_harness
from tests.support.db import rows, traces
from tests.support.subagents import first_user_text

FAILED_LINE = "⚠️ The reply failed before a decision."
CHAT = 555
SUBAGENTS = SubagentSettings(enabled=True)


def is_child(request: LLMRequest) -> bool:
    return any(m.role == "user" and str(m.content).startswith("TASK") for m in request.messages)


def tool_results(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m["tool_call_id"], m["content"]) for m in body["messages"] if m["role"] == "tool"]


def fail_at_end(t: TelegramHarness, which: Any, release: asyncio.Event) -> None:
    """The first stream ``which`` picks (the parent's or a child's) is held at its end until ``release``, then
    fails for good (a 400-like error: not retried)."""
    provider = t.core.provider
    real = provider.stream
    failed = False

    async def stream(request: LLMRequest) -> AsyncIterator[ProviderEvent]:
        nonlocal failed
        picked = not failed and which(request)
        async for ev in real(request):
            if picked and isinstance(ev, StreamEnd):
                failed = True
                await release.wait()
                raise ProviderError(ProviderErrorKind.BAD_REQUEST, "error event mid-stream")
            yield ev

    provider.stream = stream  # type: ignore[method-assign]


def prompt(tg: Any) -> Any:
    [shown] = [m for m in tg.messages(CHAT) if "Approval needed" in m.text]
    return shown


def turn_states(tmp_path: Any) -> list[tuple[str, str]]:
    return rows(tmp_path / "chat.db", "SELECT session_key, state FROM turns ORDER BY started_at")


def test_a_failed_turns_abort_records_its_pending_approvals_and_ends_its_children_as_failed():
    """The abort of a failed turn, in one change: its own waiting call and its child's are recorded as ended,
    the child as failed, and each prompt says the reply failed (a stop's abort keeps saying it was stopped)."""
    child = "web:p-sub-aaaaaaaaaaaa"

    def waiting() -> TurnController:
        ctl = TurnController("t1", "web:p")
        ctl.apply(Forwarded((child,), SessionMeta(child, "web:p", None, "find it", "call_1")))
        ctl.apply(Forwarded((child,), ApprovalRequested("call_3", "lookup", "", "alice")))
        ctl.apply(CompleteToolCall("call_4", "lookup", "{}"))
        ctl.apply(ApprovalRequested("call_4", "lookup", "", "alice"))
        return ctl

    failed = waiting()
    failed.apply(Abort("failed"))
    snap = failed.snapshot
    assert snap.approvals == ()
    assert [(o.call_id, o.origin, o.decision) for o in snap.decided] == [("call_3", (child,), "deny"),
                                                                         ("call_4", (), "deny")]
    assert [c.state for c in snap.children] == ["failed"]
    assert ended_line(snap, "call_3", (child,)) == FAILED_LINE
    assert ended_line(snap, "call_4") == FAILED_LINE

    stopped = waiting()
    stopped.apply(Abort("stop"))
    snap = stopped.snapshot
    assert [c.state for c in snap.children] == ["cancelled"]
    assert ended_line(snap, "call_3", (child,)) == ended_line(snap, "call_4") == \
        "⏹ The reply was stopped before a decision."


async def test_the_turns_failure_marks_the_childs_prompt_failed_and_tells_the_model_no_user_stopped_it(
        tmp_path, fake_openai, tg):
    tool = RecordingTool("lookup", result="42")

    def route(body):
        if first_user_text(body).startswith("TASK"):
            return ToolCalls([("lookup", '{"query": "x"}')], ids=["cl"])
        if tool_results(body):
            return Text("Answered again.")
        return ToolCalls([("run_subagent", json.dumps({"task": "TASK x"}))], ids=["p1"], text="Delegating.")

    fake_openai.default = Function(route)
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool), "subagents": SUBAGENTS})
    release = asyncio.Event()
    fail_at_end(t, lambda r: not is_child(r), release)
    try:
        tg.user_message("go")
        await t.wait_for(lambda: [m for m in tg.messages(CHAT) if m.buttons])
        release.set()  # the child waits for its approval: now the turn's own stream fails
        await t.wait_for(lambda: not prompt(tg).buttons and "Approval needed" in prompt(tg).text)
        await t.wait_for(lambda: all(s != "running" for _, s in turn_states(tmp_path)) and
                         len(turn_states(tmp_path)) == 2)
        assert prompt(tg).text.endswith(FAILED_LINE)
        assert tool.calls == []
        assert [s for _, s in turn_states(tmp_path)] == ["failed", "cancelled"]

        # the next request carries the cut call's output: a failure, not the user, ended it
        tg.user_message("again")
        await t.wait_for(lambda: any("Answered again." in x for x in tg.visible(CHAT)))
        last = fake_openai.requests[-1]
        assert not first_user_text(last).startswith("TASK")
        assert tool_results(last) == [
            ("p1", "Tool call aborted: the turn failed (an error, not the user) before it finished.")]
    finally:
        release.set()
        await t.close()


async def test_a_childs_failure_marks_its_prompt_failed_and_the_turn_carries_on(tmp_path, fake_openai, tg):
    tool = RecordingTool("lookup", result="42")

    def route(body):
        if first_user_text(body).startswith("TASK"):
            return ToolCalls([("lookup", '{"query": "x"}')], ids=["cl"])
        if tool_results(body):
            return Text("I will do it myself.")
        return ToolCalls([("run_subagent", json.dumps({"task": "TASK x"}))], ids=["p1"], text="Delegating.")

    fake_openai.default = Function(route)
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool), "subagents": SUBAGENTS})
    release = asyncio.Event()
    fail_at_end(t, is_child, release)
    try:
        tg.user_message("go")
        await t.wait_for(lambda: [m for m in tg.messages(CHAT) if m.buttons])
        release.set()  # the child's own stream fails while its approval waits
        await t.wait_for(lambda: any("I will do it myself." in x for x in tg.visible(CHAT)))
        assert not prompt(tg).buttons
        assert prompt(tg).text.endswith(FAILED_LINE)
        assert tool.calls == []

        (call_id, output), = tool_results(fake_openai.requests[-1])
        assert call_id == "p1"
        assert output.startswith("Tool failed: SubagentError: The subagent (TASK x) failed: ")
        assert ".." not in output and output.endswith(". You may try again or do the task yourself.")
        await t.wait_for(lambda: all(s != "running" for _, s in turn_states(tmp_path)))
        assert [s for _, s in turn_states(tmp_path)] == ["completed", "failed"]
        # the child's own history: its waiting call was not run, and not because a user stopped it
        [(child, _)] = [(k, s) for k, s in turn_states(tmp_path) if "-sub-" in k]
        assert rows(tmp_path / "chat.db", "SELECT content FROM messages WHERE session_key = ? AND role = 'tool'",
                    (child,)) == [("Tool call not run: the turn failed (an error, not the user) before it ran.",)]
    finally:
        release.set()
        await t.close()


async def test_stop_while_the_childs_first_write_is_saved_still_closes_the_childs_turn(tmp_path, fake_openai, tg):
    def route(body):
        if first_user_text(body).startswith("TASK"):
            return Text("child answer")
        return ToolCalls([("run_subagent", json.dumps({"task": "TASK x"}))], ids=["p1"], text="Delegating.")

    fake_openai.default = Function(route)
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"subagents": SUBAGENTS})
    store = t.core.store
    real = store.append_message
    writing, release = asyncio.Event(), asyncio.Event()
    pending: list[asyncio.Task[Any]] = []

    async def append_message(key, *a, **kw):
        if "-sub-" not in key:
            return await real(key, *a, **kw)

        async def queued():  # waits behind other writes; once issued, it lands whatever its caller does
            await release.wait()
            return await real(key, *a, **kw)

        pending.append(asyncio.ensure_future(queued()))
        writing.set()
        return await asyncio.shield(pending[0])

    store.append_message = append_message  # type: ignore[method-assign]
    try:
        tg.user_message("go")
        await asyncio.wait_for(writing.wait(), 5)
        [call] = [task for task in asyncio.all_tasks() if task.get_name().endswith(":tool:p1")]
        tg.user_message("/stop")
        await t.wait_for(lambda: call.cancelling() or call.done())
        release.set()
        await asyncio.wait_for(asyncio.gather(*pending), 5)
        await t.wait_for(lambda: len(turn_states(tmp_path)) == 2 and
                         all(s != "running" for _, s in turn_states(tmp_path)))
        assert [s for _, s in turn_states(tmp_path)] == ["cancelled", "cancelled"]
        [(child, _)] = [(k, s) for k, s in turn_states(tmp_path) if "-sub-" in k]
        last = rows(tmp_path / "chat.db", "SELECT content FROM messages WHERE session_key = ? ORDER BY seq DESC "
                    "LIMIT 1", (child,))
        assert last == [("⏹ Stopped.",)]
    finally:
        release.set()
        await t.close()


async def test_a_stop_keeps_one_subagent_pointer_per_child_in_the_turns_trace(tmp_path, fake_openai, tg):
    tool = RecordingTool("lookup", result="42")
    held = asyncio.Event()

    def route(body):
        task = first_user_text(body)
        if task.startswith("TASK a"):
            return ToolCalls([("lookup", '{"query": "x"}')], ids=["cl"])
        if task.startswith("TASK b"):
            return Text("child b writes a long answer", hold=held, hold_after=8)
        return ToolCalls([("run_subagent", json.dumps({"task": x})) for x in ("TASK a", "TASK b")],
                         ids=["c1", "c2"], text="Delegating.")

    fake_openai.default = Function(route)
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool), "subagents": SUBAGENTS})
    try:
        tg.user_message("go")
        await t.wait_for(lambda: [m for m in tg.messages(CHAT) if m.buttons])
        await t.wait_for(lambda: any("TASK b · writing" in x for x in tg.visible(CHAT)))
        tg.user_message("/stop")
        await t.wait_for(lambda: len(turn_states(tmp_path)) == 3 and
                         all(s != "running" for _, s in turn_states(tmp_path)))
        await t.wait_for(lambda: traces(tmp_path / "chat.db", f"telegram:{CHAT}"))
        await t.wait_for(lambda: not prompt(tg).buttons)
        assert prompt(tg).text.endswith("⏹ The reply was stopped before a decision.")
        trace = traces(tmp_path / "chat.db", f"telegram:{CHAT}")
        pointers = [x.payload for x in trace if x.kind == "subagent"]
        children = sorted(k for k, _ in turn_states(tmp_path) if "-sub-" in k)
        assert sorted(p["session_key"] for p in pointers) == children
        assert sorted((p["call_id"], p["outcome"]) for p in pointers) == [("c1", "cancelled"), ("c2", "cancelled")]
        assert [x.kind for x in trace[-3:]] == ["subagent", "subagent", "abort"]  # the abort event stays last
    finally:
        held.set()
        await t.close()


async def test_shutdown_stops_the_child_saying_the_bridge_is_shutting_down(tmp_path, fake_openai, http):
    held = asyncio.Event()

    def route(body):
        if first_user_text(body).startswith("TASK"):
            return Text("The child works slowly", hold=held, hold_after=9)
        return ToolCalls([("run_subagent", json.dumps({"task": "TASK slow"}))], ids=["call_S"])

    fake_openai.default = Function(route)
    chat = await start_web_chat(tmp_path, fake_openai, subagents=SUBAGENTS)
    closed = False
    try:
        base = chat.base_url
        sid = await new_session(http, base)
        sse = await open_stream(http, base, sid)
        async with http.post(f"{base}/api/sessions/{sid}/messages", json={"text": "go"}) as resp:
            assert resp.status == 202
        await sse.until(lambda e: e.name == "subagent" and bool(e.data["origin"])
                        and e.data["event"]["kind"] == "partial_text")
        await chat.close()
        closed = True
    finally:
        held.set()
        if not closed:
            await chat.close()
    db = tmp_path / "chat.db"
    states = rows(db, "SELECT session_key, state FROM turns ORDER BY started_at")
    assert [state for _, state in states] == ["cancelled", "cancelled"]
    for key, _ in states:
        last = rows(db, "SELECT content FROM messages WHERE session_key = ? ORDER BY seq DESC LIMIT 1", (key,))
        assert last == [("⏹ Stopped: the bridge is shutting down. Send your message again once it is back.",)], key
