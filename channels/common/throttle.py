"""Per-chat pacing of platform calls: a minimum interval between live edits, and 429 pauses.

One ``ChatThrottle`` per channel instance is shared by every sink of that channel, so two turns in the
same chat (two forum topics of one group) share that chat's budget. ``reserve`` hands out successive
time slots, so concurrent callers never exceed one call per interval; ``pause`` (a 429's retry_after)
blocks every slot of the chat until it has passed, however long.

The clock is injectable so tests and benchmarks can run long pauses on a fast clock through the same code.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass


class Clock:
    """Monotonic seconds and a sleep that matches them."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds))


class ScaledClock(Clock):
    """A clock running ``scale`` times faster than real time (for tests and time-scaled benchmarks)."""

    def __init__(self, scale: float) -> None:
        self.scale = scale
        self._origin = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._origin) * self.scale

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(max(0.0, seconds) / self.scale)


@dataclass
class _ChatPace:
    next_slot: float = 0.0
    paused_until: float = 0.0
    last_used: float = 0.0


class ChatThrottle:
    def __init__(self, interval: float, *, clock: Clock | None = None, max_chats: int = 10_000) -> None:
        self.interval = interval
        self.clock = clock or Clock()
        self._chats: dict[str, _ChatPace] = {}
        self._max_chats = max_chats

    def _pace(self, chat: str) -> _ChatPace:
        pace = self._chats.get(chat)
        if pace is None:
            if len(self._chats) >= self._max_chats:
                self._forget_idle()
            pace = self._chats[chat] = _ChatPace()
        return pace

    def _forget_idle(self) -> None:
        now = self.clock.now()
        for chat in [c for c, p in self._chats.items() if p.next_slot < now and p.paused_until < now]:
            del self._chats[chat]

    def pause(self, chat: str, seconds: float) -> None:
        """A 429: no call may reach ``chat`` for ``seconds`` from now."""
        pace = self._pace(chat)
        pace.paused_until = max(pace.paused_until, self.clock.now() + max(0.0, seconds))

    def paused_for(self, chat: str) -> float:
        """Seconds left of the chat's 429 pause (0 when not paused)."""
        pace = self._chats.get(chat)
        return max(0.0, pace.paused_until - self.clock.now()) if pace else 0.0

    def delay(self, chat: str) -> float:
        """Seconds until the chat's next free slot (pause included)."""
        pace = self._chats.get(chat)
        if pace is None:
            return 0.0
        return max(0.0, max(pace.next_slot, pace.paused_until) - self.clock.now())

    async def reserve(self, chat: str) -> None:
        """Wait for the chat's next slot and take it (the next caller waits one interval more)."""
        pace = self._pace(chat)
        while True:
            now = self.clock.now()
            slot = max(now, pace.next_slot, pace.paused_until)
            if slot <= now:
                pace.next_slot = now + self.interval
                pace.last_used = now
                return
            # re-check after sleeping: another caller may have taken the slot, or a 429 extended the pause
            await self.clock.sleep(slot - now)

    async def wait_for_slot(self, chat: str) -> None:
        """Wait until the chat's next slot is free, without taking it."""
        while (left := self.delay(chat)) > 0:
            await self.clock.sleep(left)

    async def wait_unpaused(self, chat: str) -> None:
        """Wait out a 429 pause only (plain sends are not paced by the edit interval)."""
        while (left := self.paused_for(chat)) > 0:
            await self.clock.sleep(left)
