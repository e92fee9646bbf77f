"""What the store tests build their records from: a clock the test sets and moves, and a user's message; and a
store whose answers come late."""

from __future__ import annotations

import asyncio

from core.messages import MessageSource, NewMessage
from core.sqlite_store import SqliteStore


class FakeClock:
    """The store's clock: ``now`` stands still until the test moves it."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def user(text: str) -> NewMessage:
    return NewMessage(role="user", content=text, source=MessageSource(kind="user_input"))


class SlowAnswerStore(SqliteStore):
    """Storing a message lands at once; its answer is held at ``gate`` (a slow fsync). As with the SQLite writer,
    a write on its way lands even when its caller stops waiting for the answer."""

    gate: asyncio.Event | None = None
    held = 0

    async def admit_inbound(self, channel, event_id, payload, *, ttl_seconds, key=None):  # type: ignore[override]
        write = asyncio.ensure_future(super().admit_inbound(channel, event_id, payload, ttl_seconds=ttl_seconds,
                                                            key=key))
        if self.gate is not None:
            self.held += 1
            await self.gate.wait()
        return await asyncio.shield(write)
