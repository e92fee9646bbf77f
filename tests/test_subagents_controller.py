"""Pure logic of a turn's child sessions: what the TurnController makes of forwarded events (status,
approvals with their origin, the trace) and the status lines a live message shows for them."""

from __future__ import annotations

from channels.common.live_sink import ended_line
from channels.common.status import status_lines
from core.agent.events import (
    Abort,
    ApprovalDecided,
    ApprovalRequested,
    CompleteToolCall,
    Forwarded,
    PartialText,
    SessionMeta,
    SubagentEnded,
)
from core.controller import TurnController

C, G = "web:p-sub-aaaaaaaaaaaa", "web:p-sub-aaaaaaaaaaaa-sub-bbbbbbbbbbbb"


def started() -> TurnController:
    ctl = TurnController("t1", "web:p")
    ctl.apply(Forwarded((C,), SessionMeta(C, "web:p", "researcher", "find the answer", "call_1")))
    ctl.apply(Forwarded((C, G), SessionMeta(G, C, None, "look deeper", "call_9")))
    return ctl


def test_children_their_steps_and_approvals_keep_their_origin_and_stay_out_of_the_trace():
    ctl = started()
    ctl.apply(Forwarded((C,), CompleteToolCall("call_2", "fetch_url", "{}")))
    ctl.apply(Forwarded((C, G), PartialText("delta", "deep text")))
    ctl.apply(Forwarded((C, G), ApprovalRequested("call_3", "lookup", 'q="x"', "alice")))
    snap = ctl.snapshot
    assert [(c.origin, c.step, c.state) for c in snap.children] == [
        ((C,), "fetch_url", "running"), ((C, G), "waiting for approval: lookup", "running")]
    [approval] = snap.approvals
    assert (approval.origin, approval.call_id, approval.label, approval.requested_by) == (
        (C, G), "call_3", "look deeper", "alice")
    assert snap.text == ""  # a child's text is never the turn's
    ctl.apply(Forwarded((C, G), ApprovalDecided("call_3", "allow", "user", "alice")))
    assert ctl.snapshot.approvals == ()
    ctl.apply(SubagentEnded("call_1", C, "researcher", "find the answer", "completed"))
    assert [t.kind for t in ctl.trace] == ["subagent"]  # the pointer only
    assert ctl.snapshot.children[0].state == "completed"


def test_how_an_approval_ended_is_told_by_who_decided_it_for_the_turn_and_its_children():
    """A prompt whose press came to another process learns the outcome from the snapshot: allowed by whom,
    denied by whom, or nobody in time — for a child's call as for the turn's own."""
    ctl = started()
    ctl.apply(CompleteToolCall("call_4", "lookup", "{}"))
    ctl.apply(ApprovalRequested("call_4", "lookup", "", "alice"))
    ctl.apply(Forwarded((C, G), ApprovalRequested("call_3", "lookup", "", "alice")))
    ctl.apply(Forwarded((C,), ApprovalRequested("call_4", "lookup", "", "alice")))  # the same id in a child
    ctl.apply(Forwarded((C, G), ApprovalDecided("call_3", "allow", "user", "u1", "Alice")))
    ctl.apply(ApprovalDecided("call_4", "deny", "user", "u2", "Bob"))
    ctl.apply(Forwarded((C,), ApprovalDecided("call_4", "deny", "timeout")))
    snap = ctl.snapshot
    assert ended_line(snap, "call_3", (C, G)) == "✅ Allowed by Alice"
    assert ended_line(snap, "call_4") == "❌ Denied by Bob"
    assert ended_line(snap, "call_4", (C,)) == "⌛ Denied: nobody decided in time."


def test_a_stopped_child_stops_its_children_and_their_approvals():
    ctl = started()
    ctl.apply(Forwarded((C, G), ApprovalRequested("call_3", "lookup", "", None)))
    ctl.apply(Forwarded((C,), Abort()))
    snap = ctl.snapshot
    assert [c.state for c in snap.children] == ["cancelled", "cancelled"]
    assert snap.approvals == ()


def test_status_lines_one_per_running_child_and_a_count_beyond_eight():
    ctl = started()
    ctl.apply(Forwarded((C,), PartialText("delta", "x")))
    assert status_lines(ctl.snapshot) == "⏳ researcher: find the answer · writing\n⏳ look deeper · starting"
    ctl.apply(Forwarded((C,), SubagentEnded("call_9", G, None, "look deeper", "failed", "boom")))
    assert status_lines(ctl.snapshot) == "⏳ researcher: find the answer · writing"
    ctl.apply(SubagentEnded("call_1", C, "researcher", "find the answer", "completed"))
    assert status_lines(ctl.snapshot) == ""
    many = TurnController("t2", "web:q")
    for i in range(10):
        key = f"web:q-sub-{i:012x}"
        many.apply(Forwarded((key,), SessionMeta(key, "web:q", None, f"task {i}", f"c{i}")))
    lines = status_lines(many.snapshot).split("\n")
    assert len(lines) == 9 and lines[-1] == "⏳ … and 2 more subagents"
