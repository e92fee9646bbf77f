"""The silence bound of a model stream: no event within ``request_timeout`` is a TIMEOUT.

Every model stream is bounded here, once, whoever asks (the agent loop, titles, compaction), so every
provider gets the same bound, including one that stops producing without closing its socket (a wedged
local model, a server sending only keep-alives). Providers keep only their transport's own timeouts.

``SilenceWatch`` bounds every wait for a stream's next item with one timer per stream: ``asyncio.timeout``
around each ``anext`` would create, schedule and cancel a timer per item, which showed up in the per-turn
CPU cost (tests/bench/core_overhead.py). A wait only records when it began (``begin``) and that it ended
(``end``); the one timer wakes up at the earliest possible deadline and either re-arms or cancels the
waiting task, and the wait turns that cancellation into ``TimeoutError`` with the same cancel/uncancel
accounting as ``asyncio.timeout`` (a cancellation from anyone else stays a cancellation). No library offers
this. ``bounded`` iterates the stream itself between ``begin`` and ``end`` rather than awaiting each item
through ``wait``: a streamed token then passes through one layer fewer (at 1,000 chats streaming, each
layer a token passes through is a measurable part of the bridge's CPU).

Time spent between waits (the consumer handling an item) is never counted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from core.llm.provider import ProviderError, ProviderErrorKind, ProviderEvent

T = TypeVar("T")


async def bounded(stream: AsyncIterator[ProviderEvent], timeout: float) -> AsyncIterator[ProviderEvent]:
    """``stream``'s events; no event within ``timeout`` seconds raises ProviderError(TIMEOUT) (then the ladder
    decides). The stream is closed however this ends."""
    watch = SilenceWatch(timeout)
    try:
        watch.begin()
        try:
            async for event in stream:
                watch.end()
                yield event
                watch.begin()
        except asyncio.CancelledError:
            if watch.expired():
                raise ProviderError(ProviderErrorKind.TIMEOUT, f"no model output within {timeout:g}s") from None
            raise
        finally:
            watch.end()
    finally:
        watch.close()
        close = getattr(stream, "aclose", None)
        if close is not None:
            await close()


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
        self.begin()
        try:
            result = await awaitable
        except asyncio.CancelledError:
            if self.expired():
                raise TimeoutError from None
            raise
        finally:
            self.end()
        return result

    def begin(self) -> None:
        """A wait begins, in the task that waits: every wait of a watch is in the task of its first one."""
        if self._task is None:
            self._task = asyncio.current_task()
            assert self._task is not None, "SilenceWatch waits run inside a task"
        self._since = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(self._since + self._seconds, self._check)

    def end(self) -> None:
        """The wait is over (it got its item, or failed)."""
        self._since = None
        if self._fired and self._task is not None:  # the awaited swallowed our cancellation and finished anyway
            self._fired = False
            self._task.uncancel()

    def expired(self) -> bool:
        """After a wait ended in CancelledError: whether that was this watch's timeout alone (the task's
        cancellation is then taken back), not a cancellation from anyone else."""
        self._since = None
        if not self._fired or self._task is None:
            return False
        self._fired = False
        return self._task.uncancel() == 0

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
