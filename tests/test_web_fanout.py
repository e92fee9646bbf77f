"""The web chat's session streams across processes, without a server: what a stream relays (``share``),
how a stream follows a turn another process runs (``apply_remote``), and ``resync`` after a gap."""

from __future__ import annotations

import json
from typing import Any

from channels.web.sse import SessionStream, StreamHub
from core.snapshot import ApprovalRequest, TurnSnapshot


def snap(version: int, text: str, state: str = "running", approvals: tuple[ApprovalRequest, ...] = ()) -> Any:
    return TurnSnapshot(turn_id="t1", session_key="web:s1", version=version, state=state, text=text,
                        approvals=approvals)  # type: ignore[arg-type]


def events(stream: SessionStream, since: int = 0) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for payload in stream.replay_since(f"{stream.epoch}-{since}") or []:
        lines = payload.decode().split("\n")
        name = next(line[7:] for line in lines if line.startswith("event: "))
        out.append((name, json.loads(next(line[6:] for line in lines if line.startswith("data: ")))))
    return out


def holder_and_viewer() -> tuple[SessionStream, SessionStream, list[tuple[str, str, dict[str, Any]]]]:
    relayed: list[tuple[str, str, dict[str, Any]]] = []
    here, there = StreamHub(), StreamHub()
    here.share = lambda sid, name, data: relayed.append((sid, name, data))
    return here.stream("s1"), there.stream("s1"), relayed


def test_a_stream_relays_what_it_shows_and_another_shows_the_same() -> None:
    holder, viewer, relayed = holder_and_viewer()
    ask = ApprovalRequest(call_id="c1", tool_name="lookup", arguments_summary="q=1")
    holder.turn_update(snap(1, "Hel"), "client-1")
    holder.turn_update(snap(2, "Hello"), "client-1")
    holder.turn_update(snap(3, "Hello", approvals=(ask,)), "client-1")
    holder.turn_update(snap(4, "Hello, world", state="completed"), "client-1")
    holder.append("turn_committed", {"session_id": "s1", "history_revision": 1, "messages": []})
    assert [name for _, name, _ in relayed] == ["turn", "turn", "turn", "turn", "turn_committed"]  # no approval_request
    for sid, name, data in relayed:
        assert sid == "s1" and viewer.apply_remote(name, data)
    assert events(viewer) == events(holder)  # approval_request derived there, in the same place
    assert [n for n, _ in events(viewer)].count("approval_request") == 1
    assert viewer.live is not None and not viewer.live.held_here and viewer.live.text == "Hello, world"


def test_a_viewer_does_not_relay_again_nor_apply_twice() -> None:
    holder, viewer, relayed = holder_and_viewer()
    echoed: list[str] = []
    viewer_hub = StreamHub()
    viewer_hub.share = lambda sid, name, data: echoed.append(name)
    viewer = viewer_hub.stream("s1")
    holder.turn_update(snap(1, "Hi"), None)
    holder.turn_update(snap(2, "Hi there"), None)
    for _, name, data in relayed + relayed:  # each relayed twice
        viewer.apply_remote(name, data)
    assert echoed == []
    assert [d.get("append", d.get("replace")) for n, d in events(viewer) if n == "turn"] == ["Hi", " there"]


def test_an_increment_of_an_unknown_turn_asks_for_the_whole_turn() -> None:
    holder, viewer, relayed = holder_and_viewer()
    holder.turn_update(snap(1, "Hi"), None)
    holder.turn_update(snap(2, "Hi there"), None)
    assert viewer.apply_remote("turn", relayed[1][2]) is False and viewer.seq == 0
    assert holder.live is not None
    whole = holder.live.full_event()
    assert viewer.apply_remote("turn", whole) and viewer.live is not None and viewer.live.text == "Hi there"
    holder.turn_update(snap(3, "Hi there!"), None)
    assert viewer.apply_remote("turn", relayed[-1][2]) and viewer.live.text == "Hi there!"


def test_a_gap_forgets_the_turns_of_others_and_tells_the_browsers_to_resync() -> None:
    holder, viewer, relayed = holder_and_viewer()
    viewer.subscribe(100)
    holder.turn_update(snap(1, "Hi"), None)
    viewer.apply_remote("turn", relayed[0][2])
    seen = viewer.seq
    viewer.resync()
    assert [(n, d.get("turn")) for n, d in events(viewer, seen)] == [("resync_required", None), ("task_state", None)]
    assert viewer.live is None and relayed[1:] == []  # nothing of it relayed
    holder_own = holder.seq
    holder.subscribe(100)
    holder.resync()  # a turn this process runs is kept
    assert holder.live is not None and events(holder, holder_own)[1][1]["turn"]["text"] == "Hi"


def test_a_commit_ends_a_turn_another_process_showed_even_when_its_end_never_comes() -> None:
    holder, viewer, relayed = holder_and_viewer()
    holder.turn_update(snap(1, "Hi"), None)
    viewer.apply_remote("turn", relayed[0][2])
    assert viewer.idle_since() is None and json.loads(viewer.task_state().split(b"data: ")[1])["turn"] is not None
    viewer.apply_remote("turn_committed", {"session_id": "s1", "history_revision": 1, "messages": []})
    assert viewer.idle_since() is not None  # reclaimable
    assert json.loads(viewer.task_state().split(b"data: ")[1])["turn"] is None
