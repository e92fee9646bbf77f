"""ArrivalBudget: a request leaves only while fewer than ``limit`` others are in flight or were answered within the
window. Time here is virtual (``ManualClock``)."""

from __future__ import annotations

import asyncio

from channels.common.arrivals import ArrivalBudget
from tests.support.clock import ManualClock


async def test_a_request_waits_until_the_answers_of_the_last_window_have_left_it():
    clock = ManualClock()
    budget = ArrivalBudget(3, 1.0, clock=clock)
    assert budget.try_enter() and budget.try_enter() and budget.try_enter()
    assert not budget.try_enter()  # three in flight: they may all still arrive in the same second as a fourth
    fourth = asyncio.create_task(budget.enter())
    await asyncio.sleep(0)
    assert not fourth.done()
    clock.t = 0.5
    budget.leave()  # answered at 0.5: it may have arrived as late as that, so it counts until 1.5
    for _ in range(5):
        await asyncio.sleep(0)
    assert clock.t == 1.5 and fourth.done()
    assert budget.counted == 3


async def test_callers_take_the_room_in_the_order_they_came_and_a_cancelled_one_takes_none():
    clock = ManualClock()
    budget = ArrivalBudget(1, 1.0, clock=clock)
    assert budget.try_enter()
    order: list[int] = []

    async def wait(i: int) -> None:
        await budget.enter()
        order.append(i)

    first, gone, second = (asyncio.create_task(wait(i)) for i in (1, 2, 3))
    await asyncio.sleep(0)
    gone.cancel()
    assert not budget.try_enter()  # others queue ahead of a newcomer
    budget.leave()
    await asyncio.wait_for(first, 1)
    assert order == [1] and clock.t == 1.0
    budget.leave()
    await asyncio.wait_for(second, 1)
    assert order == [1, 3] and clock.t == 2.0
