"""Deterministic virtual clocks for the throttle: time moves only when the test (or a sleeper) moves it."""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Coroutine
from typing import Any

from channels.common.throttle import Clock


class ManualClock(Clock):
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)
        await asyncio.sleep(0)


class GatedClock(ManualClock):
    """Virtual time that stands still until the test opens ``gate``: a caller whose slot is not free yet (a send
    behind another in the bot's budget of new messages) waits until then, as long as the test needs; ``waiting``
    counts the callers held. Once the gate is open, sleeps pass at once, moving time on (``ManualClock``)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.waiting = 0

    async def sleep(self, seconds: float) -> None:
        if seconds > 0 and not self.gate.is_set():
            self.waiting += 1
            try:
                await self.gate.wait()
            finally:
                self.waiting -= 1
        await super().sleep(seconds)


class HeldUpClock(Clock):
    """Virtual time for many callers at once, with one stretch in which the event loop is held up.

    ``run`` advances time from one sleeper's wake-up to the next while every caller waits on the clock; once
    time reaches ``held_from``, it jumps to ``held_from + held_for`` and every sleeper due in between wakes
    then, together, as timers do when a saturated host holds up the loop that runs them."""

    def __init__(self, *, held_from: float, held_for: float) -> None:
        self.t = 0.0
        self.held_from = held_from
        self.held_for = held_for
        self._sleepers: list[tuple[float, int, asyncio.Future[None]]] = []
        self._seq = itertools.count()

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        woken = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.t + max(0.0, seconds), next(self._seq), woken))
        await woken

    async def run(self, callers: list[Coroutine[Any, Any, None]], *, steps: int = 100_000) -> None:
        tasks = [asyncio.ensure_future(c) for c in callers]
        held = False
        for _ in range(steps):
            for _ in range(10):  # let every woken caller run until it waits on the clock again (or is done)
                await asyncio.sleep(0)
            if not self._sleepers:
                break
            when = self._sleepers[0][0]
            if not held and when >= self.held_from:
                held = True
                when = max(when, self.held_from + self.held_for)
            self.t = when
            while self._sleepers and self._sleepers[0][0] <= when:
                heapq.heappop(self._sleepers)[2].set_result(None)
        stuck = [t for t in tasks if not t.done()]
        for task in stuck:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=bool(stuck))
        assert not stuck, f"{len(stuck)} callers never got through"
