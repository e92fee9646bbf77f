"""SilenceWatch: a bound on each wait for the next item, not on the whole stream."""

from __future__ import annotations

import asyncio

import pytest

from core.llm.silence import SilenceWatch


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
