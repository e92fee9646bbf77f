from __future__ import annotations

import asyncio
import itertools

from channels.common.throttle import ChatThrottle, Clock


class ManualClock(Clock):
    """Time moves only when a sleeper asks it to (a deterministic virtual clock)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)
        await asyncio.sleep(0)


async def test_slots_are_one_interval_apart_per_chat():
    clock = ManualClock()
    th = ChatThrottle(1.0, clock=clock)
    times = []
    for _ in range(5):
        await th.reserve("a")
        times.append(clock.t)
    assert times == [0.0, 1.0, 2.0, 3.0, 4.0]
    await th.reserve("b")  # another chat has its own budget
    assert clock.t == 4.0


async def test_concurrent_callers_never_share_a_slot():
    th = ChatThrottle(0.05)
    stamps: list[float] = []

    async def one() -> None:
        await th.reserve("c")
        stamps.append(th.clock.now())

    await asyncio.gather(*(one() for _ in range(6)))
    stamps.sort()
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert all(g >= 0.045 for g in gaps), gaps


async def test_a_429_pause_blocks_the_chat_until_retry_after_however_long():
    clock = ManualClock()
    th = ChatThrottle(1.0, clock=clock)
    await th.reserve("a")
    th.pause("a", 30.0)
    assert th.paused_for("a") == 30.0
    assert th.paused_for("b") == 0.0
    await th.reserve("a")
    assert clock.t >= 30.0
    th.pause("a", 300.0)
    await th.wait_unpaused("a")
    assert clock.t >= 330.0 and th.paused_for("a") == 0.0
