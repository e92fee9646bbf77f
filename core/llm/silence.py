"""SilenceWatch: bounds every wait for a stream's next item, with one timer per stream.

``asyncio.timeout`` around each ``anext`` creates, schedules and cancels a timer per item; a turn streams
dozens of items through two such bounds (the provider's and the agent loop's), which showed up in the
per-turn CPU cost (tests/bench/core_overhead.py). Here a wait only records when it began; one timer per
stream wakes up at the earliest possible deadline and either re-arms or cancels the waiting task, and the
wait turns that cancellation into ``TimeoutError`` with the same cancel/uncancel accounting as
``asyncio.timeout`` (a cancellation from anyone else stays a cancellation). No library offers this.

Time spent between waits (the consumer handling an item) is never counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class SilenceWatch:
    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None
        """When the current wait began; None between waits."""
        self._task: asyncio.Task[object] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._fired = False

    async def wait(self, awaitable: Awaitable[T]) -> T:
        """``await awaitable``, raising TimeoutError if it takes ``seconds`` or longer."""
        task = asyncio.current_task()
        assert task is not None, "SilenceWatch.wait runs inside a task"
        self._task = task
        self._since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._since + self._seconds, self._check)
        try:
            result = await awaitable
        except asyncio.CancelledError:
            if self._fired:
                self._fired = False
                if task.uncancel() == 0:  # only our cancellation: it is a timeout
                    raise TimeoutError from None
            raise
        else:
            if self._fired:  # the awaitable swallowed our cancellation and finished anyway
                self._fired = False
                task.uncancel()
            return result
        finally:
            self._since = None

    def _check(self) -> None:
        self._timer = None
        if self._since is None or self._task is None:
            return  # not waiting now: the next wait arms a new timer
        due = self._since + self._seconds
        if self._loop.time() >= due:
            self._fired = True
            self._task.cancel()
        else:
            self._timer = self._loop.call_at(due, self._check)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._task = None
