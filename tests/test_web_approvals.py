"""Tool approvals in the web channel over real HTTP: the approvals endpoint (allow, deny, 400/401/404), the
``approval_request`` SSE event, and ``task_state`` carrying the pending approvals to a fresh connection."""

from __future__ import annotations

import pytest

from tests.browser.server import RecordingTool, new_session, open_stream, registry, start_web_chat
from tests.fakes.openai_server import Text, ToolCalls

ASK = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_A1"])


@pytest.fixture
def tool():
    return RecordingTool("lookup", result="42 apples")


@pytest.fixture
async def chat(tmp_path, fake_openai, tool):
    wc = await start_web_chat(tmp_path, fake_openai, tools=registry(tool))
    try:
        yield wc
    finally:
        await wc.close()


async def say(http, base, sid, text):
    async with http.post(f"{base}/api/sessions/{sid}/messages", json={"text": text}) as resp:
        assert resp.status == 202


async def decide(http, base, sid, call_id, body, headers=None):
    async with http.post(f"{base}/api/sessions/{sid}/approvals/{call_id}", json=body, headers=headers) as resp:
        return resp.status, await resp.json()


def terminal_turn(ev) -> bool:
    return ev.name == "turn" and ev.data["state"] != "running"


async def test_allow_runs_the_tool_and_the_answer_streams_in(chat, http, fake_openai, tool):
    fake_openai.script(ASK, Text("You have 42 apples."))
    base = chat.base_url
    sid = await new_session(http, base)
    sse = await open_stream(http, base, sid)
    await say(http, base, sid, "how many apples?")

    request = await sse.until(lambda e: e.name == "approval_request")
    assert request.data == {"session_id": sid, "turn_id": request.data["turn_id"], "call_id": "call_A1",
                            "tool_name": "lookup", "arguments": 'query="apples"'}
    # the turn event before it lists the approval and the tool awaiting it
    turn = [e for e in sse.events if e.name == "turn"][-1]
    assert [a["call_id"] for a in turn.data["approvals"]] == ["call_A1"]
    tools = [e.data["tools"] for e in sse.events if e.name == "turn" and "tools" in e.data][-1]
    assert [(t["name"], t["status"]) for t in tools] == [("lookup", "awaiting_approval")]
    assert tool.calls == []

    # a fresh connection opens with task_state: the live turn and its pending approval
    late = await open_stream(http, base, sid)
    state = await late.next()
    assert state.name == "task_state"
    assert [a["call_id"] for a in state.data["approvals"]] == ["call_A1"]
    assert state.data["turn"]["approvals"] == state.data["approvals"]
    assert "requested_by" not in state.data["approvals"][0]  # internal sender ids stay out of the page

    assert await decide(http, base, sid, "call_A1", {"decision": "allow"}) == (
        200, {"call_id": "call_A1", "decision": "allow"})
    end = await sse.until(terminal_turn)
    assert end.data["state"] == "completed"
    assert tool.calls == [{"query": "apples"}]
    done = [e.data["tools"] for e in sse.events if e.name == "turn" and "tools" in e.data][-1]
    assert [(t["name"], t["status"], t["summary"]) for t in done] == [("lookup", "done", "42 apples")]
    text = "".join(e.data.get("replace", "") + e.data.get("append", "") for e in sse.events if e.name == "turn")
    assert text.endswith("You have 42 apples.")
    # the second model request carries the tool's output
    last = fake_openai.requests[1]["messages"][-1]
    assert (last["role"], last["tool_call_id"], last["content"]) == ("tool", "call_A1", "42 apples")
    # one approval_request in all: later turn events do not announce it again
    assert [e.name for e in sse.events].count("approval_request") == 1
    # deciding again: nothing pending any more
    assert (await decide(http, base, sid, "call_A1", {"decision": "deny"}))[0] == 404
    async with http.get(f"{base}/api/sessions/{sid}/history") as resp:
        roles = [(m["role"], m["content"]) for m in (await resp.json())["messages"]]
    assert roles[-2:] == [("tool", "42 apples"), ("assistant", "You have 42 apples.")]


async def test_deny_never_runs_the_tool_and_the_model_hears_the_denial(chat, http, fake_openai, tool):
    fake_openai.script(ASK, Text("Alright, I will not look it up."))
    base = chat.base_url
    sid = await new_session(http, base)
    sse = await open_stream(http, base, sid)
    await say(http, base, sid, "how many apples?")
    await sse.until(lambda e: e.name == "approval_request")
    assert await decide(http, base, sid, "call_A1", {"decision": "deny"}) == (
        200, {"call_id": "call_A1", "decision": "deny"})
    denied = await sse.until(lambda e: e.name == "turn" and any(
        t["status"] == "denied" for t in e.data.get("tools", [])))
    assert denied.data["approvals"] == []
    await sse.until(terminal_turn)
    assert tool.calls == []
    assert fake_openai.requests[1]["messages"][-1]["content"] == "Tool call denied by user."
    # a fresh connection after the turn has nothing pending
    late = await open_stream(http, base, sid)
    state = await late.next()
    assert state.name == "task_state" and state.data["approvals"] == [] and state.data["turn"] is None


async def test_bad_decisions_and_unknown_calls(chat, http, fake_openai, tool):
    fake_openai.script(ASK, Text("done"))
    base = chat.base_url
    sid = await new_session(http, base)
    # nothing pending at all
    assert (await decide(http, base, sid, "call_A1", {"decision": "allow"}))[0] == 404
    sse = await open_stream(http, base, sid)
    await say(http, base, sid, "go")
    await sse.until(lambda e: e.name == "approval_request")
    for body in ({"decision": "maybe"}, {"decision": None}, {}, {"decision": ["allow"]}):
        status, data = await decide(http, base, sid, "call_A1", body)
        assert status == 400 and "decision" in data["error"]
    async with http.post(f"{base}/api/sessions/{sid}/approvals/call_A1", data="allow") as resp:
        assert resp.status == 415  # not sent as JSON (what a foreign page's form or no-cors fetch would send)
    async with http.post(f"{base}/api/sessions/{sid}/approvals/call_A1", data='"allow"',
                         headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400  # not a JSON object
    assert (await decide(http, base, sid, "call_OTHER", {"decision": "allow"}))[0] == 404
    other = await new_session(http, base)
    assert (await decide(http, base, other, "call_A1", {"decision": "allow"}))[0] == 404  # another session's
    assert (await decide(http, base, "bad id!", "call_A1", {"decision": "allow"}))[0] == 400
    assert tool.calls == []  # none of that decided anything
    assert (await decide(http, base, sid, "call_A1", {"decision": "allow"}))[0] == 200
    await sse.until(terminal_turn)
    assert tool.calls == [{"query": "apples"}]


async def test_with_a_token_the_approvals_endpoint_needs_it(tmp_path, fake_openai, http, tool):
    fake_openai.script(ASK, Text("done"))
    wc = await start_web_chat(tmp_path, fake_openai, auth_token="tok-123", tools=registry(tool))
    base = wc.base_url
    auth = {"Authorization": "Bearer tok-123"}
    try:
        async with http.post(f"{base}/api/sessions", headers=auth) as resp:
            sid = (await resp.json())["id"]
        sse = await open_stream(http, base, sid, headers=auth)
        async with http.post(f"{base}/api/sessions/{sid}/messages", json={"text": "go"}, headers=auth) as resp:
            assert resp.status == 202
        await sse.until(lambda e: e.name == "approval_request")
        assert (await decide(http, base, sid, "call_A1", {"decision": "allow"}))[0] == 401
        assert (await decide(http, base, sid, "call_A1", {"decision": "allow"},
                             {"Authorization": "Bearer wrong"}))[0] == 401
        assert tool.calls == []
        assert (await decide(http, base, sid, "call_A1", {"decision": "allow"}, auth))[0] == 200
        await sse.until(terminal_turn)
        assert tool.calls == [{"query": "apples"}]
    finally:
        await wc.close()


async def test_the_approval_request_carries_every_argument_in_full_key_ones_first(tmp_path, fake_openai, http):
    import json

    from tests.test_tool_arguments import StrictTool

    fetch = StrictTool("fetch_url", approval="ask",
                       schema={"type": "object", "properties": {"note": {"type": "string"}, "url": {"type": "string"}},
                               "required": ["url"]})
    decoy = "a harmless weather lookup " * 50
    url = "http://169.254.169.254/latest/meta-data/?" + "x" * 300
    fake_openai.script(ToolCalls([("fetch_url", json.dumps({"note": decoy, "url": url}))], ids=["call_W"]),
                       Text("ok"))
    wc = await start_web_chat(tmp_path, fake_openai, tools=registry(fetch))  # type: ignore[arg-type]
    try:
        base = wc.base_url
        sid = await new_session(http, base)
        sse = await open_stream(http, base, sid)
        await say(http, base, sid, "weather?")
        request = await sse.until(lambda e: e.name == "approval_request")
        assert request.data["arguments"] == f"url={json.dumps(url)}\nnote={json.dumps(decoy)}"
        assert await decide(http, base, sid, "call_W", {"decision": "deny"}) == (
            200, {"call_id": "call_W", "decision": "deny"})
        await sse.until(terminal_turn)
    finally:
        await wc.close()
