from __future__ import annotations

import asyncio
import contextlib

import pytest

from channels.common.throttle import Clock, Scope, Throttle, ending
from tests.support.clock import HeldUpClock, ManualClock

A, B = Scope("chat:a", 1.0), Scope("chat:b", 1.0)


async def test_slots_are_one_interval_apart_per_chat():
    clock = ManualClock()
    th = Throttle(clock=clock)
    times = []
    for _ in range(5):
        await th.reserve([A])
        times.append(clock.t)
    assert times == [0.0, 1.0, 2.0, 3.0, 4.0]
    await th.reserve([B])  # another chat has its own budget
    assert clock.t == 4.0


async def test_a_call_in_two_scopes_waits_for_both_and_takes_both():
    clock = ManualClock()
    th = Throttle(clock=clock)
    app = Scope("app", 0.25)  # e.g. a workspace-wide method tier
    stamps = []
    for scope in (A, B, A, B):
        await th.reserve([scope, app])
        stamps.append(clock.t)
    # each chat at most once a second, and the app at most once every 0.25 s across chats
    assert stamps == [0.0, 0.25, 1.0, 1.25]
    assert th.ready_in([app]) == 0.25


async def test_the_end_of_a_turn_takes_the_scopes_burst_and_live_calls_keep_the_pace():
    clock = ManualClock()
    th = Throttle(clock=clock)
    chat = Scope("chat:d", 1.0, burst=2)  # a bucket of two calls, refilled at one a second
    await th.reserve([chat])  # a live update at 0: the next live one waits for 1.0
    clock.t = 0.3
    assert th.ready_in([chat]) == pytest.approx(0.7)
    with ending():
        assert th.ready_in([chat]) == 0.0
        await th.reserve([chat])  # the end leaves at once, one call ahead of the pace
        assert clock.t == 0.3
        await th.reserve([chat])  # a second call of the end: the burst is spent, it waits for the pace
        assert clock.t == pytest.approx(1.0)
    await th.reserve([chat])  # live calls go on once the bucket is full again: 0, 0.3, 1, then 3
    assert clock.t == pytest.approx(3.0)


async def test_the_end_of_a_turn_waits_for_the_pace_where_a_scope_has_no_burst_and_for_a_429_pause():
    clock = ManualClock()
    th = Throttle(clock=clock)
    chat, app = Scope("chat:e", 1.0, burst=2), Scope("app", 0.5)
    await th.reserve([chat, app])
    with ending():
        await th.reserve([chat, app])  # the app allows no burst: its slot comes at 0.5
        assert clock.t == pytest.approx(0.5)
        th.pause(chat.key, 3.0)
        await th.reserve([chat])  # a 429 pause is waited out all the same
        assert clock.t == pytest.approx(3.5)


class StillClock(Clock):
    """Time stands still; a sleep ends at once and records how long it was asked to last."""

    def __init__(self) -> None:
        self.asked: list[float] = []

    def now(self) -> float:
        return 0.0

    async def sleep(self, seconds: float) -> None:
        self.asked.append(seconds)
        await asyncio.sleep(0)


async def test_concurrent_callers_never_share_a_slot():
    clock = StillClock()
    th = Throttle(clock=clock)
    scope = Scope("chat:c", 0.05)
    await asyncio.gather(*(th.reserve([scope]) for _ in range(6)))
    # the first goes at once; each of the others is given its own slot, one interval after the one before
    assert sorted(clock.asked) == pytest.approx([0.05, 0.10, 0.15, 0.20, 0.25])


async def test_a_429_pause_blocks_the_scope_until_retry_after_however_long():
    clock = ManualClock()
    th = Throttle(clock=clock)
    await th.reserve([A])
    th.pause(A.key, 30.0)
    assert th.paused_for([A]) == 30.0
    assert th.paused_for([B]) == 0.0
    await th.reserve([A])
    assert clock.t >= 30.0
    th.pause(A.key, 300.0)
    await th.wait_unpaused([A])
    assert clock.t >= 330.0 and th.paused_for([A]) == 0.0


async def test_take_now_takes_a_free_slot_or_nothing():
    clock = ManualClock()
    th = Throttle(clock=clock)
    tier = Scope("thinking", 3.0)
    assert th.take_now([tier, A])
    assert not th.take_now([tier])  # the next slot is 3 s away: nothing taken, nothing waited
    assert th.ready_in([tier]) == 3.0 and th.ready_in([B]) == 0.0
    clock.t = 3.0
    assert th.take_now([tier])
    await th.reserve([tier])  # a caller that queues comes after the slot taken
    assert clock.t == 6.0
    clock.t = 20.0
    th.pause(A.key, 30.0)
    assert not th.take_now([tier, A])  # a 429 pause on any of the scopes: nothing taken in the others either
    assert th.take_now([tier])


async def test_paused_total_counts_overlapping_pauses_once():
    clock = ManualClock()
    th = Throttle(clock=clock)
    th.pause(A.key, 10.0)
    th.pause(A.key, 4.0)  # inside the first: adds nothing
    th.pause(A.key, 12.0)  # extends it by 2 s
    assert th.paused_total([A]) == 12.0
    assert th.paused_total([B]) == 0.0


class CountingClock(HeldUpClock):
    """Virtual time for many callers at once (never held up), counting the sleeps. Real time would let a loaded
    host hold the loop up for longer than the throttle's ``catch_up`` and move the schedule mid-test."""

    def __init__(self) -> None:
        super().__init__(held_from=float("inf"), held_for=0.0)
        self.sleeps = 0

    async def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        await super().sleep(seconds)


async def test_callers_sharing_a_scope_queue_in_order_and_each_sleeps_once():
    # a bot's budget of new messages is shared by every chat: hundreds of callers may wait on it at once,
    # and each must sleep once for its own slot rather than all wake for every slot
    clock = CountingClock()
    th = Throttle(clock=clock)
    shared = Scope("bot:sends", 0.01)
    order: list[int] = []

    async def one(i: int) -> None:
        await th.reserve([Scope(f"chat:{i}", 1.0), shared])
        order.append(i)

    await clock.run([one(i) for i in range(20)])
    assert order == list(range(20))
    assert clock.sleeps == 19  # the first went at once


class HeldClock(Clock):
    """Time stands still and a sleep never ends (until cancelled)."""

    def now(self) -> float:
        return 0.0

    async def sleep(self, seconds: float) -> None:
        await asyncio.Event().wait()


async def test_a_caller_that_gives_up_waiting_gives_its_slot_back():
    th = Throttle(clock=HeldClock())
    await th.reserve([A])  # takes the slot at 0; the next is at 1
    waiting = asyncio.ensure_future(th.reserve([A]))  # books the slot at 1 and waits for it
    await asyncio.sleep(0)
    assert th.ready_in([A]) == 2.0
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting
    assert th.ready_in([A]) == 1.0


def test_callers_waiting_without_a_booking_learn_how_long_those_ahead_of_them_would_take():
    throttle = Throttle()
    workspace, chat = Scope("workspace", 0.01), Scope("chat:1", 1.0)
    with throttle.waiting((chat, workspace)) as first:
        assert first == 0.0  # nobody ahead
        with throttle.waiting((Scope("chat:2", 1.0), workspace)) as second:
            assert second == 0.01  # one caller ahead in the workspace's budget, none in its own chat
            with throttle.waiting((chat, workspace)) as third:
                assert third == 1.0  # the chat's own slot for the one ahead in that chat: the longest
    with throttle.waiting((chat, workspace)) as again:
        assert again == 0.0  # every caller that left is no longer counted
