"""MergeQueue: the single point where a turn's concurrent producers meet.

The LLM-stream driver, the approval worker and every running tool are producers; each pushes items as
they happen. One consumer sees a total order: items of one producer keep their order, items of different
producers interleave by arrival. ``join`` returns when every producer has finished; a producer that raises
ends the round with its exception (after the items it pushed before failing; later pushes are dropped).

The consumer is a plain function (``handle``), called in arrival order from inside ``push``: a streamed
token reaches the turn in the task that received it, instead of waking a consumer task per item (one task
switch per token less). The order is the same as a queue's: every push is handled before the next one
starts (a push made while an item is being handled waits behind it), and nothing awaits in between. The
handler must not block.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")

Spawn = Callable[[str, Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class MergeQueue(Generic[T]):
    def __init__(self, handle: Callable[[T], None], spawn: Spawn) -> None:
        """``handle`` consumes each item; ``spawn`` starts each producer (the turn's supervisor: every task
        has a bounded shutdown)."""
        self._handle = handle
        self._spawn = spawn
        self._backlog: deque[T] = deque()
        self._handling = False
        self._closed = False
        self._live = 0
        self._tasks: set[asyncio.Task[None]] = set()
        self._error: BaseException | None = None
        self._finished: asyncio.Future[None] | None = None

    def push(self, item: T) -> None:
        """Hand one item to the consumer, after every item pushed before it."""
        if self._closed:
            return
        if self._handling:
            self._backlog.append(item)
            return
        self._handling = True
        try:
            self._handle(item)
            while self._backlog and not self._closed:
                self._handle(self._backlog.popleft())
        finally:
            self._handling = False

    def add_producer(self, name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        """Run ``coro`` as a producer; the round stays open until it returns (or raises, or is cancelled).

        Once the queue is closed, ``coro`` is not run (it is closed) and None is returned: a producer added
        then (a tool allowed in the instant of an abort) would be in no set ``cancel`` waits on, and would run
        to completion after the round was given up, its output thrown away."""
        if self._closed:
            coro.close()
            return None
        self._live += 1

        async def run() -> None:
            error: BaseException | None = None
            try:
                await coro
            except asyncio.CancelledError:
                pass  # a cancelled producer simply ends; cancellation is the consumer's decision
            except Exception as exc:
                error = exc
            finally:
                self._producer_done(error)

        task = self._spawn(name, run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _producer_done(self, error: BaseException | None) -> None:
        self._live -= 1
        if error is not None and self._error is None:
            self._error = error
            self._closed = True  # the round ends with this error: what others push later is not part of it
        if (self._live == 0 or self._error is not None) and self._finished is not None \
                and not self._finished.done():
            self._finished.set_result(None)

    async def join(self) -> None:
        """Wait until every producer has finished; raise the first producer's error, if any."""
        if self._live > 0 and self._error is None:
            self._finished = asyncio.get_running_loop().create_future()
            await self._finished
        if self._error is not None:
            raise self._error

    async def cancel(self) -> None:
        """Drop further pushes, cancel every producer still running and wait until they are gone."""
        self._closed = True
        self._backlog.clear()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
