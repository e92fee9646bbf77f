"""MergeQueue: one total order of a round's producers, handed to the consumer from inside ``push``."""

from __future__ import annotations

import asyncio

import pytest

from core.agent.merge_queue import MergeQueue
from core.supervisor import TaskSupervisor

SPAWN = TaskSupervisor("test").spawn


async def test_items_of_one_producer_keep_their_order_and_producers_interleave_by_arrival():
    seen: list[str] = []
    queue: MergeQueue[str] = MergeQueue(seen.append, SPAWN)
    gates = {name: [asyncio.Event() for _ in range(3)] for name in "ab"}

    async def producer(name: str) -> None:
        for i, gate in enumerate(gates[name]):
            await gate.wait()  # the test decides when each item arrives (no timing involved)
            queue.push(f"{name}{i}")

    queue.add_producer("a", producer("a"))
    queue.add_producer("b", producer("b"))
    arrivals = ["a0", "b0", "b1", "a1", "a2", "b2"]
    for n, item in enumerate(arrivals, 1):
        gates[item[0]][int(item[1])].set()
        for _ in range(100):  # let the producer's task push it
            if len(seen) == n:
                break
            await asyncio.sleep(0)
    await queue.join()
    assert seen == arrivals


async def test_a_push_made_while_an_item_is_handled_waits_behind_it():
    seen: list[str] = []
    queue: MergeQueue[str]

    def handle(item: str) -> None:
        seen.append(f"start {item}")
        if item == "first":
            queue.push("nested")  # e.g. a listener reacting to an event
        seen.append(f"end {item}")

    queue = MergeQueue(handle, SPAWN)
    queue.push("first")
    queue.push("second")
    assert seen == ["start first", "end first", "start nested", "end nested", "start second", "end second"]


async def test_a_failing_producer_ends_the_round_with_its_error_and_later_pushes_are_dropped():
    seen: list[str] = []
    queue: MergeQueue[str] = MergeQueue(seen.append, SPAWN)
    release = asyncio.Event()

    async def failing() -> None:
        queue.push("before")
        raise ValueError("stream broke")

    async def slow() -> None:
        await release.wait()
        queue.push("too late")

    queue.add_producer("slow", slow())
    queue.add_producer("failing", failing())
    with pytest.raises(ValueError, match="stream broke"):
        await queue.join()
    release.set()
    await queue.cancel()
    assert seen == ["before"]
