"""TurnController: immutable, versioned snapshots; latest wins; the terminal snapshot is final."""

import asyncio

import pytest

from core.controller import TurnController


async def test_versions_rise_and_snapshots_are_immutable():
    c = TurnController("t1", "s1")
    first = c.snapshot
    c.append_text("Hel")
    c.append_text("lo")
    assert first.text == "" and first.version == 1
    assert (c.snapshot.text, c.snapshot.version) == ("Hello", 3)
    with pytest.raises(AttributeError):
        c.snapshot.text = "x"  # type: ignore[misc]


async def test_a_slow_watcher_sees_the_newest_snapshot_not_a_backlog():
    c = TurnController("t1", "s1")
    seen = []

    async def slow_watch():
        async for snap in c.watch():
            seen.append(snap.version)
            await asyncio.sleep(0.05)

    task = asyncio.create_task(slow_watch())
    await asyncio.sleep(0)
    for i in range(50):
        c.append_text(str(i))
    await asyncio.sleep(0.01)
    c.finish("completed")
    await asyncio.wait_for(task, 2)
    assert seen[0] == 1 and seen[-1] == c.snapshot.version
    assert len(seen) <= 4  # not 52
    assert seen == sorted(set(seen))


async def test_terminal_snapshot_is_final_and_late_events_are_ignored():
    c = TurnController("t1", "s1")
    c.append_text("answer")
    final = c.finish("completed")
    c.append_text(" more")
    c.reset_text("")
    assert c.snapshot is final and final.terminal and final.text == "answer"


async def test_reset_text_starts_a_retried_request_over():
    c = TurnController("t1", "s1")
    c.append_text("garbled")
    c.reset_text("")
    c.append_text("clean")
    assert c.snapshot.text == "clean"
