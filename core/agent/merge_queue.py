"""MergeQueue: the single point where a turn's concurrent producers meet.

The LLM-stream driver, the approval worker and every running tool are producers; each pushes items as
they happen. One consumer iterates the queue and sees a total order: items of one producer keep their
order, items of different producers interleave by arrival. Iteration ends when every producer has
finished and the queue is drained. A producer that raises ends the iteration with its exception (after
the items it pushed before failing).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Generic, TypeVar

T = TypeVar("T")

Spawn = Callable[[str, Coroutine[Any, Any, None]], "asyncio.Task[None]"]


class _Done:
    __slots__ = ("error",)

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class MergeQueue(Generic[T]):
    def __init__(self, spawn: Spawn) -> None:
        """``spawn`` starts each producer (the turn's supervisor: every task has a bounded shutdown)."""
        self._queue: asyncio.Queue[T | _Done] = asyncio.Queue()
        self._spawn = spawn
        self._live = 0
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def producers(self) -> int:
        """Producers started and not finished yet (as seen by the consumer)."""
        return self._live

    def push(self, item: T) -> None:
        """Put one item on the queue (from a producer, or from the consumer's own task)."""
        self._queue.put_nowait(item)

    def add_producer(self, name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``coro`` as a producer; the queue stays open until it returns (or raises, or is cancelled)."""
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
                self._queue.put_nowait(_Done(error))

        task = self._spawn(name, run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def __aiter__(self) -> AsyncIterator[T]:
        while self._live > 0 or not self._queue.empty():
            item = await self._queue.get()
            if isinstance(item, _Done):
                self._live -= 1
                if item.error is not None:
                    raise item.error
                continue
            yield item

    async def cancel(self) -> None:
        """Cancel every producer still running and wait until they are gone; queued items are dropped."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        while not self._queue.empty():
            self._queue.get_nowait()
        self._live = 0
