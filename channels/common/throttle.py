"""Pacing of platform calls in scopes, and 429 pauses: the one pause mechanism of a channel.

A scope is a budget a platform enforces: one chat (Telegram: about one message per second per chat),
one workspace or app, or one method tier of a workspace (Slack). A call names every scope it counts
against; ``reserve`` books the earliest slot free in all of them at once and waits for it, so concurrent
callers never exceed any scope's pace and queue in order. ``pause`` (a 429's retry_after) blocks every
slot of a scope until it has passed, however long. ``take_now`` takes a slot only if one is free at once,
for a call worth making then or not at all (a cosmetic indicator when the budget is spent). ``waiting`` counts
the callers that wait for a free slot without booking one (live updates, which show the newest text when a
slot comes, and give way to the ends of turns that book theirs), so each can spread its next look over the
time those already waiting would take.

Slots are kept by when callers actually leave, not only by when they booked: a saturated host holds its event
loop up for seconds at a time, and every caller whose slot passed meanwhile would wake at once and reach the
platform together, past a budget that refills at that pace (a bot's 30 new messages a second over a thousand
chats). So a caller that leaves more than ``catch_up`` seconds (0.25) after its slot moves its scopes'
schedules by the excess: the slots that passed while the loop was held up are lost, not spent at once, and
the callers booked after it wait as much longer (at most ``catch_up`` seconds' worth leave together).

One ``Throttle`` per channel instance is shared by every sink and send of that channel, so two turns in
the same chat (two forum topics of one group) share that chat's budget. ``paused_total`` is the pause a
scope has been under since the throttle first saw it, which lets a waiting caller stretch its own bound.
The clock is injectable so tests can run long pauses on a virtual clock through the same code.

The end of a turn does not wait for the next slot: a platform that allows short bursts (Telegram's "about
one message a second" per chat) takes a call or two sooner than the pace, so calls made inside ``ending()``
(the live sink's finish) may leave up to ``burst - 1`` intervals ahead of a scope's schedule, as a token
bucket of ``burst`` calls refilled at the pace would allow, and push the schedule on by their interval like
any call. Live updates never do: they keep the pace, so the bucket is full when the answer ends and the
whole reply shows at once instead of up to an interval later.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass


class Clock:
    """Monotonic seconds and a sleep that matches them."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


@dataclass(frozen=True, slots=True)
class Scope:
    """One budget of a platform: ``key`` names it ("chat:555", "app", "tier3:T0123"), ``interval`` is the
    least time between two calls in it (0: only its 429 pauses count)."""

    key: str
    interval: float = 0.0
    burst: int = 1
    """Calls the platform takes at once after a quiet spell; only calls inside ``ending()`` use more than one."""


_ending: ContextVar[bool] = ContextVar("throttle_ending", default=False)


@contextlib.contextmanager
def ending() -> Iterator[None]:
    """Calls made inside (in this task, and tasks it starts) show the end of a turn: they may use the
    scopes' bursts."""
    token = _ending.set(True)
    try:
        yield
    finally:
        _ending.reset(token)


@dataclass(slots=True)
class _Pace:
    next_slot: float = 0.0
    paused_until: float = 0.0
    paused_total: float = 0.0
    moved: float = 0.0
    """How far the scope's schedule has moved for callers that left late (every booked slot moves with it)."""


class Throttle:
    def __init__(self, *, clock: Clock | None = None, max_scopes: int = 10_000, catch_up: float = 0.25) -> None:
        self.clock = clock or Clock()
        self.catch_up = catch_up
        self._paces: dict[str, _Pace] = {}
        self._max_scopes = max_scopes
        self._waiting: dict[str, int] = {}
        """Callers inside ``waiting``, by scope."""

    def _pace(self, key: str) -> _Pace:
        pace = self._paces.get(key)
        if pace is None:
            if len(self._paces) >= self._max_scopes:
                self._forget_idle()
            pace = self._paces[key] = _Pace()
        return pace

    def _forget_idle(self) -> None:
        now = self.clock.now()
        for key in [k for k, p in self._paces.items() if p.next_slot < now and p.paused_until < now]:
            del self._paces[key]

    def pause(self, key: str, seconds: float) -> None:
        """A 429: no call may reach scope ``key`` for ``seconds`` from now."""
        pace = self._pace(key)
        now = self.clock.now()
        until = now + max(0.0, seconds)
        if until > pace.paused_until:
            pace.paused_total += until - max(now, pace.paused_until)
            pace.paused_until = until

    def paused_for(self, scopes: Sequence[Scope]) -> float:
        """Seconds left of the longest 429 pause among ``scopes`` (0 when none is paused)."""
        now = self.clock.now()
        left = 0.0
        for scope in scopes:
            pace = self._paces.get(scope.key)
            if pace is not None:
                left = max(left, pace.paused_until - now)
        return left

    def paused_total(self, scopes: Sequence[Scope]) -> float:
        """Seconds of 429 pause imposed on ``scopes`` so far (rises with every new pause)."""
        return sum(p.paused_total for s in scopes if (p := self._paces.get(s.key)) is not None)

    def ready_in(self, scopes: Sequence[Scope]) -> float:
        """Seconds until every scope has a free slot (pauses included); 0 when a call could go now."""
        now = self.clock.now()
        ready = now
        early = _ending.get()
        for scope in scopes:
            pace = self._paces.get(scope.key)
            if pace is not None:
                ahead = (scope.burst - 1) * scope.interval if early else 0.0
                ready = max(ready, pace.next_slot - ahead, pace.paused_until)
        return ready - now

    async def reserve(self, scopes: Sequence[Scope]) -> None:
        """Take the earliest slot free in every scope, then wait for it. The slot is booked before the wait
        (the next caller is given the one after it), so callers queue in the order they came and each sleeps
        once, however many share a scope (a bot's budget of new messages over all its chats), unless the
        schedule moved meanwhile; a 429 pause that begins while one waits is waited out as well."""
        while True:
            now = self.clock.now()
            start = now + self.ready_in(scopes)
            booked: list[tuple[_Pace, float, float, float]] = []
            for scope in scopes:
                pace = self._pace(scope.key)
                mine = max(pace.next_slot, start) + scope.interval
                booked.append((pace, pace.next_slot, mine, pace.moved))
                pace.next_slot = mine
            try:
                late = await self._until(start, booked)
            except asyncio.CancelledError:
                for pace, before, mine, _ in booked:  # give the slot back unless someone booked after it
                    if pace.next_slot == mine:
                        pace.next_slot = before
                raise
            if late > self.catch_up:  # the loop was held up: the slots that passed meanwhile are lost
                for pace, *_ in booked:
                    pace.moved += late - self.catch_up
                    pace.next_slot += late - self.catch_up
            if self.paused_for(scopes) <= 0:
                return

    @contextlib.contextmanager
    def waiting(self, scopes: Sequence[Scope]) -> Iterator[float]:
        """Count a caller among those waiting for a free slot in ``scopes`` without booking one (a live update)
        while inside. Yields how long the callers already waiting would take to be served one a slot, the longest
        over ``scopes``: a caller that spreads its next look at random over that span after the next slot finds,
        on average, one free slot a look, where every waiting caller would otherwise wake for every slot and all
        but one find it taken (a thousand chats sharing a Slack workspace's budget)."""
        ahead = max((self._waiting.get(s.key, 0) * s.interval for s in scopes), default=0.0)
        for scope in scopes:
            self._waiting[scope.key] = self._waiting.get(scope.key, 0) + 1
        try:
            yield ahead
        finally:
            for scope in scopes:
                left = self._waiting[scope.key] - 1
                if left:
                    self._waiting[scope.key] = left
                else:
                    del self._waiting[scope.key]

    def take_now(self, scopes: Sequence[Scope]) -> bool:
        """Take a slot in every scope if one is free now (no pause, nobody booked ahead) and say so; take
        nothing and say False otherwise."""
        if self.ready_in(scopes) > 0:
            return False
        now = self.clock.now()
        for scope in scopes:
            pace = self._pace(scope.key)
            pace.next_slot = max(pace.next_slot, now) + scope.interval
        return True

    async def _until(self, start: float, booked: Sequence[tuple[_Pace, float, float, float]]) -> float:
        """Wait for the slot booked at ``start``, later by as much as its scopes' schedules have moved since it
        was booked (each wait ends at most once more per move). Returns how late the caller leaves."""
        due = start
        while True:
            now = self.clock.now()
            if now < due:
                await self.clock.sleep(due - now)
            moved = start + max((pace.moved - was for pace, _, _, was in booked), default=0.0)
            if moved <= due:
                return self.clock.now() - due
            due = moved

    async def wait_unpaused(self, scopes: Sequence[Scope]) -> None:
        """Wait out 429 pauses only (for calls that are not paced, such as a typing indicator)."""
        while (left := self.paused_for(scopes)) > 0:
            await self.clock.sleep(left)
