"""A deterministic virtual clock for the throttle: time moves only when a sleeper asks it to."""

from __future__ import annotations

import asyncio

from channels.common.throttle import Clock


class ManualClock(Clock):
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        self.t += max(0.0, seconds)
        await asyncio.sleep(0)
