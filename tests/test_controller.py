"""TurnController: immutable, versioned snapshots pulled on demand; latest wins; the terminal snapshot is
final; urgent changes (approvals, the end) wake a waiting sink at once."""

import asyncio

import pytest

from core.agent.events import Abort, ApprovalRequested, CompleteText, PartialText, RequestBegin, RequestEnd
from core.controller import TurnController


def text(c: TurnController, piece: str) -> None:
    c.apply(PartialText("delta", piece))


async def test_versions_rise_and_snapshots_are_immutable():
    c = TurnController("t1", "s1")
    first = c.snapshot
    text(c, "Hel")
    text(c, "lo")
    assert first.text == "" and first.version == 1
    assert (c.snapshot.text, c.snapshot.version) == ("Hello", 3)
    assert c.snapshot is c.snapshot  # nothing changed: the same snapshot, not a new one
    with pytest.raises(AttributeError):
        c.snapshot.text = "x"  # type: ignore[misc]


async def test_a_slow_puller_sees_the_newest_snapshot_not_a_backlog():
    c = TurnController("t1", "s1")
    seen = []

    async def slow_sink():
        while True:
            snap = c.snapshot
            if not seen or snap.version != seen[-1]:
                seen.append(snap.version)
            if snap.terminal:
                return
            await c.changed()
            await asyncio.sleep(0.05)

    task = asyncio.create_task(slow_sink())
    await asyncio.sleep(0)
    for i in range(50):
        text(c, str(i))
    await asyncio.sleep(0.01)
    c.finish("completed")
    await asyncio.wait_for(task, 2)
    assert seen[0] == 1 and seen[-1] == c.snapshot.version
    assert len(seen) <= 4  # not 52
    assert seen == sorted(set(seen))


async def test_text_does_not_wake_an_urgent_waiter_but_an_approval_and_the_end_do():
    c = TurnController("t1", "s1")
    urgent = c.changed(urgent_only=True)
    text(c, "streaming")
    await asyncio.sleep(0)
    assert not urgent.done()
    c.apply(ApprovalRequested("call_1", "shell", "ls", None))
    assert urgent.done()
    urgent = c.changed(urgent_only=True)
    c.finish("completed")
    assert urgent.done() and c.changed(urgent_only=True).done()  # over: nothing more to wait for


async def test_terminal_snapshot_is_final_and_late_events_are_ignored():
    c = TurnController("t1", "s1")
    text(c, "answer")
    final = c.finish("completed")
    text(c, " more")
    assert c.snapshot is final and final.terminal and final.text == "answer"
    assert c.finish("failed") is final


async def test_nothing_follows_an_abort_or_the_end_for_the_snapshot_the_trace_or_a_listener():
    for end in ("abort", "finish"):
        c = TurnController("t1", "s1")
        heard: list[object] = []
        c.subscribe(heard.append)
        text(c, "partial answer")
        c.apply(CompleteText("partial answer"))
        if end == "abort":
            c.apply(Abort("stop"))
        else:
            c.finish("completed")
        before = c.snapshot
        text(c, " late")
        c.apply(CompleteText(" late"))
        assert c.snapshot is before and c.text == "partial answer", end
        assert [type(e).__name__ for e in c.trace] == ["CompleteText"] + (["Abort"] if end == "abort" else [])
        assert [type(e).__name__ for e in heard] == ["PartialText", "CompleteText"] + (
            ["Abort"] if end == "abort" else [])


async def test_a_retried_request_rewinds_the_text_and_raises_the_epoch():
    c = TurnController("t1", "s1")
    c.apply(RequestBegin(1, 1))
    text(c, "garbled")
    before = c.snapshot
    c.apply(RequestEnd("malformed", 1, retry_in=0.01))
    c.apply(RequestBegin(1, 2))
    text(c, "clean")
    after = c.snapshot
    assert after.text == "clean"
    assert after.text_epoch == before.text_epoch + 1
    text(c, " and more")
    assert c.snapshot.text_epoch == after.text_epoch  # an extension keeps the epoch


async def test_a_second_request_starts_after_a_blank_line():
    c = TurnController("t1", "s1")
    c.apply(RequestBegin(1, 1))
    text(c, "Let me check.")
    c.apply(RequestBegin(2, 1))
    text(c, "Done.")
    assert c.snapshot.text == "Let me check.\n\nDone."
