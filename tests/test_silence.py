"""SilenceWatch and ``bounded``: a bound on each wait for the next item, not on the whole stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from core.llm.provider import ProviderError, ProviderErrorKind, ProviderEvent, TextDelta
from core.llm.silence import SilenceWatch, bounded


async def test_a_wait_that_takes_too_long_is_a_timeout():
    watch = SilenceWatch(0.05)
    with pytest.raises(TimeoutError):
        await watch.wait(asyncio.sleep(5))
    watch.close()
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0  # the task is not left half-cancelled


async def test_steady_items_never_time_out_however_long_the_stream_runs():
    watch = SilenceWatch(0.05)
    loop = asyncio.get_running_loop()
    start = loop.time()
    # each gap well inside the bound, the whole stream far beyond it
    got = [await watch.wait(asyncio.sleep(0.02, result=i)) for i in range(12)]
    watch.close()
    assert got == list(range(12))
    assert loop.time() - start > 3 * 0.05


async def test_time_between_waits_is_not_counted():
    watch = SilenceWatch(0.05)
    await watch.wait(asyncio.sleep(0))
    await asyncio.sleep(0.12)  # the consumer is busy with the item: not the stream's silence
    assert await watch.wait(asyncio.sleep(0.01, result="next")) == "next"
    watch.close()


async def test_a_timeout_after_a_long_gap_still_fires_on_the_next_slow_wait():
    watch = SilenceWatch(0.05)
    await watch.wait(asyncio.sleep(0))
    await asyncio.sleep(0.12)
    with pytest.raises(TimeoutError):
        await watch.wait(asyncio.sleep(5))
    watch.close()


async def test_someone_elses_cancellation_stays_a_cancellation():
    watch = SilenceWatch(10)

    async def waiter() -> None:
        await watch.wait(asyncio.sleep(5))

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    watch.close()


async def test_a_cancellation_racing_the_timeout_is_not_swallowed():
    watch = SilenceWatch(0.05)

    async def waiter() -> None:
        await watch.wait(asyncio.sleep(5))

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)  # the wait has begun and armed its timer
    assert watch._timer is not None
    # someone else cancels at the very moment the watch does, before the task runs again
    asyncio.get_running_loop().call_at(watch._timer.when(), task.cancel)
    with pytest.raises(asyncio.CancelledError):
        await task
    watch.close()


async def test_errors_of_the_awaited_pass_through():
    watch = SilenceWatch(1)

    async def fails() -> None:
        raise StopAsyncIteration

    with pytest.raises(StopAsyncIteration):
        await watch.wait(fails())
    watch.close()


# ---- bounded: a model stream under the bound ---------------------------------------------------------


class Stream:
    """Text events with a pause before each (``gaps``), then silence for ``hang`` seconds (if given); records
    whether its generator was closed."""

    def __init__(self, gaps: list[float], hang: float | None = None) -> None:
        self.gaps = gaps
        self.hang = hang
        self.closed = False

    async def events(self) -> AsyncIterator[ProviderEvent]:
        try:
            for i, gap in enumerate(self.gaps):
                await asyncio.sleep(gap)
                yield TextDelta(f"t{i}")
            if self.hang is not None:
                await asyncio.sleep(self.hang)
        finally:
            self.closed = True


async def test_bounded_ends_a_silent_stream_with_a_timeout_and_closes_it():
    stream = Stream([0, 0], hang=5)
    seen: list[ProviderEvent] = []
    with pytest.raises(ProviderError) as info:
        async for event in bounded(stream.events(), 0.05):
            seen.append(event)
    assert info.value.kind is ProviderErrorKind.TIMEOUT
    assert seen == [TextDelta("t0"), TextDelta("t1")]
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0  # the task is not left half-cancelled
    assert stream.closed


async def test_bounded_counts_only_the_stream_s_silence_not_the_consumer_s_work():
    seen = []
    async for event in bounded(Stream([0.01, 0.01, 0.01]).events(), 0.05):
        seen.append(event)
        await asyncio.sleep(0.12)  # the consumer is busy with the item: not the stream's silence
    assert seen == [TextDelta("t0"), TextDelta("t1"), TextDelta("t2")]


async def test_bounded_leaves_someone_else_s_cancellation_a_cancellation():
    async def consume() -> None:
        async for _ in bounded(Stream([0], hang=5).events(), 10):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
