"""TaskSupervisor: spawn failure is an error to the caller; shutdown is bounded."""

import asyncio
import time

import pytest

from core.supervisor import SupervisorClosedError, TaskSupervisor


async def test_spawn_after_shutdown_is_an_error_and_the_coroutine_is_closed():
    sup = TaskSupervisor()
    await sup.shutdown(1)

    async def work():
        return 1

    coro = work()
    with pytest.raises(SupervisorClosedError):
        sup.spawn("late", coro)
    assert coro.cr_frame is None  # closed, so no "never awaited" warning


async def test_shutdown_cancels_tasks_and_reports_those_that_refuse_in_time():
    sup = TaskSupervisor()

    async def polite():
        await asyncio.sleep(3600)

    async def stubborn():
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                await asyncio.sleep(5)  # ignores the first cancel for a while
                return

    sup.spawn("polite", polite())
    late = sup.spawn("stubborn", stubborn())
    await asyncio.sleep(0)  # both are running
    started = time.monotonic()
    stragglers = await sup.shutdown(0.1)
    assert time.monotonic() - started < 4  # bounded: did not wait the stubborn task's 5 s
    assert stragglers == ["stubborn"]
    late.cancel()


async def test_finished_tasks_leave_the_supervisor():
    sup = TaskSupervisor()

    async def quick():
        return 42

    task = sup.spawn("quick", quick())
    assert await task == 42
    await asyncio.sleep(0)
    assert len(sup) == 0
