from __future__ import annotations

import asyncio
import itertools

from channels.common.throttle import Scope, Throttle
from tests.support.clock import ManualClock

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


async def test_concurrent_callers_never_share_a_slot():
    th = Throttle()
    scope = Scope("chat:c", 0.05)
    stamps: list[float] = []

    async def one() -> None:
        await th.reserve([scope])
        stamps.append(th.clock.now())

    await asyncio.gather(*(one() for _ in range(6)))
    stamps.sort()
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    assert all(g >= 0.045 for g in gaps), gaps


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


async def test_paused_total_counts_overlapping_pauses_once():
    clock = ManualClock()
    th = Throttle(clock=clock)
    th.pause(A.key, 10.0)
    th.pause(A.key, 4.0)  # inside the first: adds nothing
    th.pause(A.key, 12.0)  # extends it by 2 s
    assert th.paused_total([A]) == 12.0
    assert th.paused_total([B]) == 0.0
