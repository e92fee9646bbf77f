"""What the store tests build their records from: a clock the test sets and moves, and a user's message; a
store whose answers come late (and a sender that gives up waiting for them), and one whose writes fail or wait
when told to."""

from __future__ import annotations

import asyncio
import pathlib
from typing import TYPE_CHECKING

import pytest

from core.messages import MessageSource, NewMessage
from core.sqlite_store import SqliteStore
from core.store import StoreError

if TYPE_CHECKING:
    from tests.support.harness import Harness


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


class SlowMarkAnswers(SqliteStore):
    """Recording a command's event lands at once; its answer is held at ``gate`` (a slow fsync). As with the
    SQLite writer, a write on its way lands even when its caller stops waiting for the answer. A channel's own
    keys (``mark_seen``) are not held."""

    gate: asyncio.Event | None = None
    held = 0

    async def mark_event_processed(self, channel, event_id, *, ttl_seconds):  # type: ignore[override]
        write = asyncio.ensure_future(super().mark_event_processed(channel, event_id, ttl_seconds=ttl_seconds))
        if self.gate is not None and not channel.endswith("channel-keys"):
            self.held += 1
            await self.gate.wait()
        return await asyncio.shield(write)


async def given_up_while_held(h: Harness, store: SlowAnswerStore | SlowMarkAnswers, text: str,
                              event_id: str) -> None:
    """``text`` is submitted; its sender stops waiting once its write has landed, before the store answers it
    (as a channel bound to answer its platform in time would). Then the store answers at once again."""
    store.gate = asyncio.Event()
    submitting = asyncio.create_task(h.say(text, event_id=event_id))
    await h.wait_for(lambda: store.held == 1)
    submitting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await submitting
    store.gate.set()
    store.gate = None


class FlakyStore(SqliteStore):
    """Admissions and user-message writes fail while told to; an admission may be held at a gate."""

    def __init__(self, path: str | pathlib.Path) -> None:
        super().__init__(path)
        self.fail_admissions = 0
        self.fail_appends = 0
        self.admission_gate: asyncio.Event | None = None
        self.at_gate = 0
        """Admissions that reached the gate."""

    async def admit_inbound(self, channel, event_id, payload, *, ttl_seconds, key=None):  # type: ignore[override]
        if self.admission_gate is not None:
            self.at_gate += 1
            await self.admission_gate.wait()
        if self.fail_admissions:
            self.fail_admissions -= 1
            raise StoreError("sqlite store: admit_inbound failed (OperationalError: disk I/O error)")
        return await super().admit_inbound(channel, event_id, payload, ttl_seconds=ttl_seconds, key=key)

    async def append_message(self, key, message, **kw):  # type: ignore[override]
        if self.fail_appends:
            self.fail_appends -= 1
            raise StoreError("sqlite store: append_message failed (OperationalError: disk I/O error)")
        return await super().append_message(key, message, **kw)
