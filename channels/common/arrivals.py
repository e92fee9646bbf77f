"""A platform's limit of requests in any window of time, kept however late the requests reach it.

A platform that allows ``limit`` requests in any ``window`` seconds counts them as they arrive. A request
arrives some time after it leaves the bridge and before its answer comes back: in between are the SDK building
its request (lark-oapi builds a new HTTP client for each, tens of milliseconds of CPU), a busy event loop and
the network. Pacing when requests leave (``channels.common.throttle``) cannot see that delay; under load it
varies by hundreds of milliseconds, so requests that left at the pace arrive in bunches over the limit.

``ArrivalBudget`` lets a request leave only while fewer than ``limit`` others are in flight or were answered
within the last ``window`` seconds. Then no window of the platform's sees more than ``limit``: take the last
request to leave among those arriving in one window; every other of them left before it and was answered no
earlier than the window began, which is no earlier than ``window`` seconds before that last one left, so each
was counted when it left (in flight, or answered within ``window``) and it left only with room for itself.

A request that leaves counts until ``window`` seconds after its answer, so the budget passes at most
``limit`` requests per ``window`` plus their round trip: the pace stays the throttle's, this is the bound.
Callers wait in the order they came. No library keeps a window over answers rather than over departures.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator

from channels.common.calls import outside_bound
from channels.common.throttle import Clock


class ArrivalBudget:
    def __init__(self, limit: int, window: float = 1.0, *, clock: Clock | None = None) -> None:
        self.limit = limit
        self.window = window
        self._clock = clock or Clock()
        self._in_flight = 0
        self._answered: deque[float] = deque()
        """When each request of the last ``window`` seconds was answered, oldest first."""
        self._queue = asyncio.Lock()
        self._left = asyncio.Event()

    def _room(self) -> bool:
        horizon = self._clock.now() - self.window
        answered = self._answered
        while answered and answered[0] <= horizon:
            answered.popleft()
        return self._in_flight + len(answered) < self.limit

    def try_enter(self) -> bool:
        """Take room for one request if there is some now and nobody waits for it; False (nothing taken)
        otherwise."""
        if self._queue.locked() or not self._room():
            return False
        self._in_flight += 1
        return True

    async def enter(self) -> None:
        """Wait for room for one request and take it (callers in the order they came)."""
        async with self._queue:
            while not self._room():
                if self._answered:  # room comes back when the oldest answer leaves the window
                    await self._clock.sleep(max(1e-6, self._answered[0] + self.window - self._clock.now()))
                else:  # every one is in flight: an answer first
                    self._left.clear()
                    await self._left.wait()
            self._in_flight += 1

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Room for one request while it runs: taken at once if there is some, else waited for (the bridge's own
        queue, outside the bound of the call attempt it runs in), and given back when the request is over."""
        if not self.try_enter():
            async with outside_bound():
                await self.enter()
        try:
            yield
        finally:
            self.leave()

    def leave(self) -> None:
        """The request taken with ``enter`` was answered (or failed, or was given up)."""
        self._in_flight -= 1
        self._answered.append(self._clock.now())
        self._left.set()

    @property
    def counted(self) -> int:
        """Requests in flight or answered within the window."""
        self._room()
        return self._in_flight + len(self._answered)
