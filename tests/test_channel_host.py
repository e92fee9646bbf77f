"""The host a channel is handed: durable dedupe and state on its own keys, only its own sessions, and core's
rule of who may decide a pending approval (the asker, or a user the channel's allow list names)."""

from __future__ import annotations

from typing import Any

import pytest

from core.agent.deciders import Decider, DecideResult, Deciders
from core.router import SubmitResult
from core.tools.base import ToolRegistry
from tests.fakes.openai_server import Text, ToolCalls
from tests.support.harness import make_harness
from tests.test_agent_loop import KEY, ScriptTool, record_turn_events


async def test_mark_seen_is_durable_and_apart_from_the_envelopes_event_ids(tmp_path, fake_openai):
    fake_openai.script(Text("answered"))
    h = await make_harness(tmp_path, fake_openai)
    host = h.core.host_for("test")
    assert await host.mark_seen("evt-1") is True
    assert await host.mark_seen("evt-1") is False
    # a channel key is not an envelope event id: the message with that id is still answered
    assert await h.say("hello", event_id="evt-1") is SubmitResult.QUEUED
    await h.settle()
    assert h.platform.visible("c1") == ["answered"]
    await host.set_state("cursor", "42")
    await h.core.shutdown()

    again = await make_harness(tmp_path, fake_openai)
    host = again.core.host_for("test")
    assert await host.mark_seen("evt-1") is False  # across a restart
    assert await host.mark_seen("evt-2") is True
    assert await host.get_state("cursor") == "42"
    assert await again.core.host_for("other").get_state("cursor") is None  # state is per channel
    await again.core.shutdown()


async def test_a_channel_acts_only_on_its_own_messages_and_sessions(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai)
    host = h.core.host_for("web")
    with pytest.raises(ValueError):
        await host.submit(h.channel.envelope("hi"))  # an envelope of channel "test"
    with pytest.raises(ValueError):
        await host.decide("test:c1", "call_1", "allow", "u1")
    with pytest.raises(ValueError):
        await host.history("test:c1")
    await host.create_session("web:abc")
    await h.core.host_for("test").submit(h.channel.envelope("hi"))
    await h.settle()
    assert [r.key for r in await host.list_sessions()] == ["web:abc"]
    await h.core.shutdown()


async def _pending_approval(tmp_path, fake_openai, sender: str = "alice", allow_from: tuple[str, ...] | None = None):
    async def lookup(args: dict[str, Any]) -> str:
        return "found"

    tool = ScriptTool("lookup", lookup, "ask")
    tools = ToolRegistry()
    tools.add(tool)
    fake_openai.script(ToolCalls([("lookup", "{}")], ids=["call_L"]), Text("Looked it up."))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    host = h.core.host_for("test")
    if allow_from is not None:
        host.set_deciders(allow_from)
    events = record_turn_events(h)
    await h.say("look it up", sender_id=sender)
    await h.wait_for(lambda: any(e.kind == "approval_request" for e in events))
    return h, host, tool, events


async def test_core_refuses_a_decision_from_anyone_but_the_asker(tmp_path, fake_openai):
    h, host, tool, events = await _pending_approval(tmp_path, fake_openai)
    assert await host.decide(KEY, "call_L", "allow", decided_by="mallory") is DecideResult.REFUSED
    assert await host.decide(KEY, "call_L", "allow", decided_by=Decider("mallory", ("alice",))) is DecideResult.REFUSED
    assert await host.decide(KEY, "call_L", "allow", decided_by=None) is DecideResult.REFUSED
    assert not any(e.kind == "approval_decision" for e in events) and tool.calls == []  # still pending
    assert await host.decide(KEY, "call_L", "allow", decided_by="alice") is DecideResult.DECIDED
    await h.settle()
    assert tool.calls == [{}] and h.platform.visible("c1") == ["Looked it up."]
    decision = next(e for e in events if e.kind == "approval_decision")
    assert decision.decided_by == "alice"
    await h.core.shutdown()


async def test_a_user_the_allow_list_names_may_decide_by_id_or_by_name(tmp_path, fake_openai):
    h, host, tool, events = await _pending_approval(tmp_path, fake_openai, allow_from=("4242", "@Bob"))
    assert await host.decide(KEY, "call_L", "deny", decided_by=Decider("7", ("carol",))) is DecideResult.REFUSED
    assert await host.decide(KEY, "call_L", "deny", decided_by=Decider("99", ("bob",))) is DecideResult.DECIDED
    await h.settle()
    assert tool.calls == []
    decision = next(e for e in events if e.kind == "approval_decision")
    assert (decision.decision, decision.decided_by) == ("deny", "99")
    await h.core.shutdown()


async def test_everyone_may_use_the_bot_but_only_the_asker_decides(tmp_path, fake_openai):
    h, host, tool, _ = await _pending_approval(tmp_path, fake_openai, allow_from=("*",))
    assert await host.decide(KEY, "call_L", "allow", decided_by="somebody") is DecideResult.REFUSED
    # another channel's allow list does not count here
    h.core.host_for("web").set_deciders(["somebody"])
    assert await host.decide(KEY, "call_L", "allow", decided_by="somebody") is DecideResult.REFUSED
    assert await host.decide(KEY, "call_L", "allow", decided_by="alice")
    await h.settle()
    assert tool.calls == [{}]
    await h.core.shutdown()


def test_allow_list_entries_match_ids_and_names_without_case_or_at_sign() -> None:
    deciders = Deciders(["12345", "@Alice", " bob ", "*"])
    assert deciders.names(Decider("12345"))
    assert deciders.names(Decider("1", ("alice",))) and deciders.names(Decider("1", ("ALICE",)))
    assert deciders.names(Decider("2", ("@bob",)))
    assert not deciders.names(Decider("123456")) and not deciders.names(Decider("*"))
    assert not Deciders(["*"]).may_decide(Decider("anyone"), "asker")
    assert Deciders().may_decide(Decider("asker"), "asker")
    assert not Deciders().may_decide(Decider("asker"), None)  # a message without a known sender
