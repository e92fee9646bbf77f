"""Subagents through the real web chat: ``run_subagent`` child sessions streaming into the parent's SSE
stream with their origin, their results in the parent's next request in call order, the parent's trace
keeping pointers only, child history, child approvals decided from the parent's chat, /stop, limits and
failures. The model is the fake OpenAI server, answering each session from what its request carries."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from core.settings import SubagentProfile, SubagentSettings
from core.tools.base import ToolRegistry
from core.tools.builtin import CurrentTime
from tests.browser.server import RecordingTool, new_session, open_stream, registry, start_web_chat
from tests.fakes.openai_server import Function, HttpError, Text, ToolCalls
from tests.support.db import traces


def first_user_text(body: dict[str, Any]) -> str:
    for m in body["messages"]:
        if m["role"] == "user":
            return m["content"] if isinstance(m["content"], str) else ""
    return ""


def tool_results(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m["tool_call_id"], m["content"]) for m in body["messages"] if m["role"] == "tool"]


def is_child(body: dict[str, Any]) -> bool:
    return first_user_text(body).startswith("TASK")


def subagent(task: str, profile: str | None = None) -> tuple[str, str]:
    args: dict[str, str] = {"task": task}
    if profile is not None:
        args["profile"] = profile
    return ("run_subagent", json.dumps(args))


def enabled(**kw: Any) -> SubagentSettings:
    return SubagentSettings(enabled=True, **kw)


async def say(http, base, sid, text):
    async with http.post(f"{base}/api/sessions/{sid}/messages", json={"text": text}) as resp:
        assert resp.status == 202


async def history(http, base, sid) -> list[dict[str, Any]]:
    async with http.get(f"{base}/api/sessions/{sid}/history") as resp:
        assert resp.status == 200
        return (await resp.json())["messages"]


def terminal(ev) -> bool:
    return ev.name == "turn" and ev.data["state"] != "running"


def child_ev(ev, kind: str | None = None) -> bool:
    return ev.name == "subagent" and bool(ev.data["origin"]) and (kind is None or ev.data["event"]["kind"] == kind)


async def test_two_subagents_run_concurrently_stream_with_origins_and_answer_in_call_order(
        tmp_path, fake_openai, http):
    release_b = asyncio.Event()  # B starts answering only once A's first words reached the page
    release_a = asyncio.Event()  # A finishes only once B's whole answer reached the page

    async def route(body):
        if not is_child(body):
            if not tool_results(body):
                return ToolCalls([subagent("TASK apples: count them"), subagent("TASK pears: count them")],
                                 ids=["call_A", "call_B"])
            return Text("Apples 3, pears 5.")
        if "apples" in first_user_text(body):
            return Text("There are 3 apples.", chunk_size=4, hold=release_a, hold_after=8)
        await release_b.wait()
        return Text("There are 5 pears.", chunk_size=4)

    fake_openai.default = Function(route)
    chat = await start_web_chat(tmp_path, fake_openai, subagents=enabled())
    try:
        base = chat.base_url
        sid = await new_session(http, base)
        sse = await open_stream(http, base, sid)
        await say(http, base, sid, "count the fruit")

        meta = [await sse.until(lambda e: child_ev(e, "session_meta")) for _ in range(2)]
        ids = {m.data["event"]["task"].split()[1].rstrip(":"): m.data["event"]["session_id"] for m in meta}
        for m in meta:  # a child's stream begins with its session_meta, naming its parent
            assert m.data["origin"] == [m.data["event"]["session_id"]]
            assert m.data["event"]["parent_id"] == sid
            assert m.data["event"]["session_id"].startswith(f"{sid}-sub-")
        a, b = ids["apples"], ids["pears"]
        await sse.until(lambda e: child_ev(e, "partial_text") and e.data["origin"] == [a]
                        and e.data["event"]["phase"] == "delta")
        release_b.set()
        await sse.until(lambda e: child_ev(e, "text") and e.data["origin"] == [b])
        release_a.set()
        await sse.until(terminal)

        # interleaved by arrival: A wrote, then B wrote all of its answer, then A finished
        deltas = [e.data["origin"][0] for e in sse.events
                  if child_ev(e, "partial_text") and e.data["event"]["phase"] == "delta"]
        first_b, last_b = deltas.index(b), len(deltas) - 1 - deltas[::-1].index(b)
        assert a in deltas[:first_b] and a in deltas[last_b:]
        texts = {e.data["origin"][0]: e.data["event"]["text"] for e in sse.events if child_ev(e, "text")}
        assert texts == {a: "There are 3 apples.", b: "There are 5 pears."}
        # each child's own events: first its session_meta, then its stream (no parent events in it)
        for child in (a, b):
            kinds = [e.data["event"]["kind"] for e in sse.events if child_ev(e) and e.data["origin"] == [child]]
            assert kinds[0] == "session_meta" and "request_begin" in kinds and kinds[-1] == "request_end"
        # the parent's pointers, and the parent's own text is not the children's
        ends = [e.data["event"] for e in sse.events if e.name == "subagent" and not e.data["origin"]]
        assert [(x["session_id"], x["outcome"]) for x in ends] == [(b, "completed"), (a, "completed")]

        # the parent's next request has both outputs, in call order
        parent_requests = [r for r in fake_openai.requests if not is_child(r)]
        assert tool_results(parent_requests[1]) == [("call_A", "There are 3 apples."),
                                                    ("call_B", "There are 5 pears.")]
        # each child was asked its task with the parent's system prompt and no other conversation
        child_requests = [r for r in fake_openai.requests if is_child(r)]
        assert sorted(first_user_text(r).split("\n")[0] for r in child_requests) == \
            ["TASK apples: count them", "TASK pears: count them"]

        # traces: the parent keeps two pointers and none of the children's messages
        db = tmp_path / "chat.db"
        parent = traces(db, f"web:{sid}")
        pointers = [t.payload for t in parent if t.kind == "subagent"]
        assert [(p["session_key"], p["task"], p["outcome"]) for p in pointers] == [
            (f"web:{b}", "TASK pears: count them", "completed"), (f"web:{a}", "TASK apples: count them", "completed")]
        assert not [t for t in parent if t.kind in ("session_meta", "forwarded")]
        assert [t.payload["text"] for t in parent if t.kind == "text"] == ["Apples 3, pears 5."]
        for child, answer in ((a, "There are 3 apples."), (b, "There are 5 pears.")):
            own = traces(db, f"web:{child}")
            assert own[0].kind == "session_meta"
            assert own[0].payload["parent_key"] == f"web:{sid}"
            assert [t.payload["text"] for t in own if t.kind == "text"] == [answer]

        # histories: the parent's shows the calls and their outputs (naming the child); the child's its own
        parent_history = await history(http, base, sid)
        tools = [m for m in parent_history if m["role"] == "tool"]
        assert [(m["tool_call_id"], m["content"], m["subagent"]["session_id"]) for m in tools] == [
            ("call_A", "There are 3 apples.", a), ("call_B", "There are 5 pears.", b)]
        child_history = await history(http, base, a)
        assert [(m["role"], m["kind"]) for m in child_history] == [("user", "user_input"), ("assistant", "assistant")]
        assert child_history[0]["content"] == "TASK apples: count them"
        assert child_history[1]["content"] == "There are 3 apples."
        # a child's conversation is read-only: it belongs to its parent's reply
        async with http.post(f"{base}/api/sessions/{a}/messages", json={"text": "hi"}) as resp:
            assert resp.status == 409
        # a child's turn answered its parent: a restart has nothing of it to deliver to a chat
        assert [t.turn.session_key for t in await chat.core.store.undelivered_turns(0)] == []
        # children are shown inside their parent, not listed as conversations
        async with http.get(f"{base}/api/sessions") as resp:
            assert [s["id"] for s in (await resp.json())["sessions"]] == [sid]
    finally:
        await chat.close()


async def test_a_childs_approval_is_decided_from_the_parents_web_chat(tmp_path, fake_openai, http):
    tool = RecordingTool("lookup", result="42 apples")

    def route(body):
        if not is_child(body):
            return Text("The child says 42.") if tool_results(body) else \
                ToolCalls([subagent("TASK look it up", "researcher")], ids=["call_S"])
        if not tool_results(body):
            return ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_L"])
        return Text("Found 42 apples.")

    fake_openai.default = Function(route)
    profile = SubagentProfile("researcher", system_prompt="You research.", tools=("lookup",), model="small-model")
    chat = await start_web_chat(tmp_path, fake_openai, tools=registry(tool),
                                subagents=enabled(profiles=(profile,)))
    try:
        base = chat.base_url
        sid = await new_session(http, base)
        sse = await open_stream(http, base, sid)
        await say(http, base, sid, "how many apples?")
        request = await sse.until(lambda e: e.name == "approval_request")
        child = request.data["origin"][0]
        assert child.startswith(f"{sid}-sub-")
        assert request.data["call_id"] == "call_L" and request.data["tool_name"] == "lookup"
        assert request.data["label"] == "researcher: TASK look it up"
        assert tool.calls == []
        # a fresh page gets it in task_state, with the child's card
        late = await open_stream(http, base, sid)
        state = await late.next()
        assert [(a["call_id"], a["origin"]) for a in state.data["approvals"]] == [("call_L", [child])]
        assert [(c["session_id"], c["profile"], c["state"]) for c in state.data["children"]] == \
            [(child, "researcher", "running")]

        url = f"{base}/api/sessions/{sid}/approvals/call_L"
        async with http.post(url, json={"decision": "allow"}) as resp:  # without its origin: not the parent's
            assert resp.status == 404
        other = await new_session(http, base)
        async with http.post(f"{base}/api/sessions/{other}/approvals/call_L",
                             json={"decision": "allow", "origin": [child]}) as resp:
            assert resp.status == 404  # only in the conversation the child belongs to
        async with http.post(url, json={"decision": "allow", "origin": [child]}) as resp:
            assert resp.status == 200
        await sse.until(terminal)
        assert tool.calls == [{"query": "apples"}]
        decided = [e.data["event"] for e in sse.events if child_ev(e, "approval_decision")]
        assert [(d["call_id"], d["decision"]) for d in decided] == [("call_L", "allow")]
        child_requests = [r for r in fake_openai.requests if is_child(r)]
        assert child_requests[0]["messages"][0] == {"role": "system", "content": "You research."}
        assert [t["function"]["name"] for t in child_requests[0]["tools"]] == ["lookup"]
        assert {r["model"] for r in child_requests} == {"small-model"}  # the profile's model, for the child only
        assert {r["model"] for r in fake_openai.requests if not is_child(r)} == {"fake-model"}
        parent_history = await history(http, base, sid)
        assert [m["content"] for m in parent_history if m["role"] == "tool"] == ["Found 42 apples."]
    finally:
        await chat.close()


async def test_stop_during_a_childs_approval_stops_parent_and_child_and_nothing_runs(tmp_path, fake_openai, http):
    tool = RecordingTool("lookup")

    def route(body):
        if not is_child(body):
            return ToolCalls([subagent("TASK look it up")], ids=["call_S"])
        return ToolCalls([("lookup", '{"query": "x"}')], ids=["call_L"])

    fake_openai.default = Function(route)
    chat = await start_web_chat(tmp_path, fake_openai, tools=registry(tool), subagents=enabled())
    try:
        base = chat.base_url
        sid = await new_session(http, base)
        sse = await open_stream(http, base, sid)
        await say(http, base, sid, "go")
        request = await sse.until(lambda e: e.name == "approval_request")
        child = request.data["origin"][0]
        started = time.monotonic()
        async with http.post(f"{base}/api/sessions/{sid}/stop", json={}) as resp:
            assert (await resp.json()) == {"stopped": True}
        end = await sse.until(terminal, timeout=5)
        assert time.monotonic() - started < 5
        assert end.data["state"] == "cancelled"
        assert end.data.get("approvals", []) == []
        # the approval is gone: deciding it now finds nothing, and the tool never ran
        async with http.post(f"{base}/api/sessions/{sid}/approvals/call_L",
                             json={"decision": "allow", "origin": [child]}) as resp:
            assert resp.status == 404
        await asyncio.sleep(0.2)
        assert tool.calls == []
        assert chat.core.approvals.pending(f"web:{child}") == []
        # the child's history ends with its own stop, the parent's with its
        child_history = await history(http, base, child)
        assert child_history[-1]["kind"] == "notice" and "Stopped" in child_history[-1]["content"]
        parent_history = await history(http, base, sid)
        assert parent_history[-1]["kind"] == "notice" and "Stopped" in parent_history[-1]["content"]
        # the stopped call still names its child, so the page can show what the child did
        [call] = [m for m in parent_history if m["role"] == "tool"]
        assert call["subagent"]["session_id"] == child and call["subagent"]["outcome"] == "cancelled"
        assert chat.core.sessions.idle()
    finally:
        await chat.close()


async def test_depth_and_concurrency_limits_and_the_allow_list_are_clear_tool_errors(tmp_path, fake_openai, http):
    tool = RecordingTool("lookup", approval="auto")
    hold_first = asyncio.Event()

    def route(body):
        task = first_user_text(body)
        if not is_child(body):
            if not tool_results(body):
                return ToolCalls([subagent("TASK nest"), subagent("TASK second"), subagent("TASK limited", "narrow")],
                                 ids=["call_1", "call_2", "call_3"])
            return Text("done")
        if task.startswith("TASK nest"):
            if not tool_results(body):
                return ToolCalls([subagent("TASK deeper")], ids=["call_N"])
            return Text("nesting refused", hold=hold_first)
        if task.startswith("TASK limited"):
            if not tool_results(body):
                return ToolCalls([("lookup", '{"query": "q"}')], ids=["call_X"])
            return Text("lookup refused")
        return Text("unexpected")

    fake_openai.default = Function(route)
    narrow = SubagentProfile("narrow", tools=("current_time",))
    chat = await start_web_chat(tmp_path, fake_openai, tools=registry(tool),
                                subagents=enabled(max_concurrent=2, profiles=(narrow,)))
    try:
        base = chat.base_url
        sid = await new_session(http, base)
        sse = await open_stream(http, base, sid)
        await say(http, base, sid, "go")
        # two run; the third is refused at once, as the limit says
        await sse.until(lambda e: e.name == "turn" and any(t["call_id"] == "call_3" and t["status"] == "failed"
                                                            for t in e.data.get("tools", [])))
        hold_first.set()
        await sse.until(terminal)
        parent_requests = [r for r in fake_openai.requests if not is_child(r)]
        results = dict(tool_results(parent_requests[1]))
        assert results["call_1"] == "nesting refused"
        assert "max_concurrent = 2" in results["call_3"]
        # depth: the child was not even offered run_subagent, and its call was refused with the reason
        nest = [r for r in fake_openai.requests if first_user_text(r).startswith("TASK nest")]
        assert "run_subagent" not in [t["function"]["name"] for t in nest[0].get("tools", [])]
        assert "max_depth = 1" in dict(tool_results(nest[1]))["call_N"]
        assert not [r for r in fake_openai.requests if first_user_text(r).startswith("TASK deeper")]
        # no third child session was made for the refused call
        assert len({first_user_text(r).split("\n")[0] for r in fake_openai.requests if is_child(r)}) == 2

        # the allow-list, in a conversation of its own (the limit above is per turn)
        fake_openai.default = Function(lambda body: route(body) if is_child(body) else (
            Text("ok") if tool_results(body) else ToolCalls([subagent("TASK limited", "narrow")], ids=["call_9"])))
        other = await new_session(http, base)
        sse2 = await open_stream(http, base, other)
        await say(http, base, other, "again")
        await sse2.until(terminal)
        limited = [r for r in fake_openai.requests if first_user_text(r).startswith("TASK limited")]
        assert [t["function"]["name"] for t in limited[0].get("tools", [])] == []  # lookup is not offered
        refusal = dict(tool_results(limited[1]))["call_X"]
        assert "not allowed for subagent profile 'narrow'" in refusal
        assert tool.calls == []
    finally:
        await chat.close()


async def test_a_failing_child_gives_the_parent_a_clear_error_and_the_parent_carries_on(
        tmp_path, fake_openai, http):
    def route(body):
        if not is_child(body):
            return Text("I will do it myself.") if tool_results(body) else \
                ToolCalls([subagent("TASK fail")], ids=["call_F"])
        return HttpError.server(503)

    fake_openai.default = Function(route)
    chat = await start_web_chat(tmp_path, fake_openai, subagents=enabled())
    try:
        base = chat.base_url
        sid = await new_session(http, base)
        sse = await open_stream(http, base, sid)
        await say(http, base, sid, "go")
        end = await sse.until(terminal)
        assert end.data["state"] == "completed"
        parent_requests = [r for r in fake_openai.requests if not is_child(r)]
        (call_id, output), = tool_results(parent_requests[1])
        assert call_id == "call_F"
        assert output.startswith("Tool failed: SubagentError: The subagent (TASK fail) failed:")
        pointer = [e.data["event"] for e in sse.events if e.name == "subagent" and not e.data["origin"]]
        assert [p["outcome"] for p in pointer] == ["failed"]
        child = pointer[0]["session_id"]
        assert (await history(http, base, child))[-1]["kind"] == "notice"
    finally:
        await chat.close()


async def test_a_child_that_reaches_its_max_turns_is_a_failure_for_the_parent(tmp_path, fake_openai, http):
    def route(body):
        if not is_child(body):
            return Text("ok") if tool_results(body) else ToolCalls([subagent("TASK loop", "short")], ids=["call_T"])
        return ToolCalls([("current_time", "{}")])

    tools = ToolRegistry(default_policy="ask")
    tools.add(CurrentTime())
    fake_openai.default = Function(route)
    chat = await start_web_chat(tmp_path, fake_openai, tools=tools,
                                subagents=enabled(profiles=(SubagentProfile("short", max_turns=2),)))
    try:
        base = chat.base_url
        sid = await new_session(http, base)
        sse = await open_stream(http, base, sid)
        await say(http, base, sid, "go")
        await sse.until(terminal)
        assert len([r for r in fake_openai.requests if is_child(r)]) == 2
        (_, output), = tool_results([r for r in fake_openai.requests if not is_child(r)][1])
        assert "max_turns = 2" in output and output.startswith("Tool failed:")
    finally:
        await chat.close()


async def test_a_childs_answer_cut_at_its_output_limit_reaches_the_parent_saying_so(tmp_path, fake_openai, http):
    def route(body):
        if not is_child(body):
            return Text("ok") if tool_results(body) else ToolCalls([subagent("TASK list")], ids=["call_T"])
        return Text("One, two, thr", finish_reason="length")

    fake_openai.default = Function(route)
    chat = await start_web_chat(tmp_path, fake_openai, subagents=enabled())
    try:
        base = chat.base_url
        sid = await new_session(http, base)
        sse = await open_stream(http, base, sid)
        await say(http, base, sid, "go")
        await sse.until(terminal)
        (_, output), = tool_results([r for r in fake_openai.requests if not is_child(r)][1])
        assert output == ("One, two, thr\n\n[The subagent's answer was cut off here: it reached the model's "
                          "output limit.]")
    finally:
        await chat.close()


async def test_shutting_down_while_a_child_runs_ends_both_turns_and_hangs_nothing(tmp_path, fake_openai, http):
    held = asyncio.Event()

    def route(body):
        if is_child(body):
            return Text("The child works slowly", hold=held, hold_after=9)
        return ToolCalls([subagent("TASK slow")], ids=["call_S"])

    fake_openai.default = Function(route)
    chat = await start_web_chat(tmp_path, fake_openai, subagents=enabled())
    closed = False
    try:
        base = chat.base_url
        sid = await new_session(http, base)
        sse = await open_stream(http, base, sid)
        await say(http, base, sid, "go")
        await sse.until(lambda e: child_ev(e, "partial_text"))
        started = time.monotonic()
        await chat.close()
        closed = True
        assert time.monotonic() - started < 4.0  # within shutdown_timeout: no turn left hanging
    finally:
        held.set()
        if not closed:
            await chat.close()
    from tests.support.db import rows
    db = tmp_path / "chat.db"
    states = rows(db, "SELECT session_key, state FROM turns ORDER BY started_at")
    assert [state for _, state in states] == ["cancelled", "cancelled"]
    for key, _ in states:
        last = rows(db, "SELECT content FROM messages WHERE session_key = ? ORDER BY seq DESC LIMIT 1", (key,))
        assert "Stopped" in last[0][0]


async def test_a_profiles_model_reaches_the_anthropic_api(fake_anthropic):
    """The request's model (a profile's ``model``) overrides the provider's, on the Messages API too."""
    from core.llm.anthropic_provider import AnthropicProvider
    from core.llm.provider import LLMMessage, LLMRequest
    from tests.fakes.anthropic_server import Text as AnthropicText

    provider = AnthropicProvider("claude-test", fake_anthropic.base_url, "sk-ant-test-0123456789abcdef",
                                 request_timeout=2.0)
    try:
        fake_anthropic.script(AnthropicText("a"), AnthropicText("b"))
        messages = (LLMMessage("user", "hello"),)
        [_ async for _ in provider.stream(LLMRequest(messages, model="claude-small"))]
        [_ async for _ in provider.stream(LLMRequest(messages))]
        assert [r.body["model"] for r in fake_anthropic.received] == ["claude-small", "claude-test"]
    finally:
        await provider.aclose()


async def test_a_conversation_list_leaves_subagents_out_before_its_limit(tmp_path):
    from core.agent.subagents import CHILD_GLOB, new_child_key
    from core.sqlite_store import SqliteStore

    store = SqliteStore(tmp_path / "s.db")
    await store.open()
    try:
        await store.get_or_create_session("web:parent")
        children = [new_child_key("web:parent") for _ in range(3)]
        for key in children:  # newer than the parent: they would fill a list of the newest
            await store.get_or_create_session(key)
        await store.get_or_create_session(new_child_key(children[0]))  # a grandchild
        newest = await store.list_sessions(prefix="web:", limit=1, exclude_glob=CHILD_GLOB)
        assert [r.key for r in newest] == ["web:parent"]
        assert len(await store.list_sessions(prefix="web:")) == 5
    finally:
        await store.close()


async def test_nested_subagents_prepend_one_origin_hop_per_level(tmp_path, fake_openai, http):
    tool = RecordingTool("lookup", result="7")

    def route(body):
        task = first_user_text(body)
        results = tool_results(body)
        if not is_child(body):
            return Text("Top: 7.") if results else ToolCalls([subagent("TASK outer")], ids=["call_O"])
        if task.startswith("TASK outer"):
            return Text("Outer: 7.") if results else ToolCalls([subagent("TASK inner")], ids=["call_I"])
        return Text("Inner: 7.") if results else ToolCalls([("lookup", '{"query": "n"}')], ids=["call_L"])

    fake_openai.default = Function(route)
    chat = await start_web_chat(tmp_path, fake_openai, tools=registry(tool), subagents=enabled(max_depth=2))
    try:
        base = chat.base_url
        sid = await new_session(http, base)
        sse = await open_stream(http, base, sid)
        await say(http, base, sid, "go")
        request = await sse.until(lambda e: e.name == "approval_request")
        outer, inner = request.data["origin"]
        assert outer.startswith(f"{sid}-sub-") and inner.startswith(f"{outer}-sub-")
        metas = [(e.data["origin"], e.data["event"]["task"]) for e in sse.events if child_ev(e, "session_meta")]
        assert metas == [([outer], "TASK outer"), ([outer, inner], "TASK inner")]
        # only the full chain from this conversation decides it
        url = f"{base}/api/sessions/{sid}/approvals/call_L"
        for wrong in ([inner], [outer], [inner, outer]):
            async with http.post(url, json={"decision": "allow", "origin": wrong}) as resp:
                assert resp.status == 404, wrong
        async with http.post(url, json={"decision": "allow", "origin": [outer, inner]}) as resp:
            assert resp.status == 200
        await sse.until(terminal)
        assert tool.calls == [{"query": "n"}]
        # the inner child's pointer reached the parent's stream through the outer child
        inner_end = [e.data for e in sse.events if e.name == "subagent" and e.data["event"]["kind"] == "subagent"
                     and e.data["origin"] == [outer]]
        assert [d["event"]["session_id"] for d in inner_end] == [inner]
        # each trace: the outer child's holds the inner one's pointer and none of its messages
        db = tmp_path / "chat.db"
        outer_trace = traces(db, f"web:{outer}")
        assert outer_trace[0].kind == "session_meta"
        assert [t.payload["session_key"] for t in outer_trace if t.kind == "subagent"] == [f"web:{inner}"]
        assert [t.payload["text"] for t in outer_trace if t.kind == "text"] == ["Outer: 7."]
        assert [t.payload["text"] for t in traces(db, f"web:{inner}") if t.kind == "text"] == ["Inner: 7."]
        assert [t.kind for t in traces(db, f"web:{sid}")].count("subagent") == 1
        assert [m["content"] for m in await history(http, base, outer) if m["role"] == "tool"] == ["Inner: 7."]
    finally:
        await chat.close()


async def test_a_profile_naming_a_tool_that_does_not_exist_is_logged_at_start(tmp_path, fake_openai, caplog):
    profile = SubagentProfile("narrow", tools=("lookup", "lokup"))
    with caplog.at_level("WARNING", logger="core.agent.subagents"):
        chat = await start_web_chat(tmp_path, fake_openai, tools=registry(RecordingTool("lookup")),
                                    subagents=enabled(profiles=(profile,)))
        await chat.close()
    assert [r.getMessage() for r in caplog.records if r.name == "core.agent.subagents"] == [
        "subagent profile narrow lists tools that do not exist: lokup"]
