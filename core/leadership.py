"""Leadership: which one of several chatbridge processes on one database receives through a connection the
platform allows only once.

Some inbound transports tolerate exactly one consumer per credential: Telegram long polling answers a
second ``getUpdates`` of the same bot with 409 Conflict and ends the first, so two processes polling one
bot would take turns failing. Such a transport runs only in the process that *leads* it; the others stand
by and take over when the leader goes away. Sending never needs the lead: any process may call a
platform's API for the turns it serves.

- :class:`Leadership` hands out leads by name; ``acquire`` waits until this process holds the name.
- :class:`Lead` is one held name: ``watch`` returns as soon as the lead is lost (its holder must then stop
  receiving at once, since another process may already be leading), ``release`` gives it up.
- :class:`LocalLeadership` is the single-process implementation (SQLite): every name is led at once, by
  the only process there is; within the process a name still has one holder at a time.
  ``core.postgresql.leader`` leads across processes on one PostgreSQL database.
- :func:`run_as_leader` is the loop a channel runs: wait for the lead, receive while holding it, stand by
  again when it is lost.

Names are chosen by whoever receives (the channel and, e.g., its bot id) and may be logged; they must
never hold a secret.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

log = logging.getLogger(__name__)


class Lead(Protocol):
    """One name this process leads, until ``release`` or until it is lost."""

    @property
    def name(self) -> str: ...

    async def watch(self) -> None:
        """Return when the lead is lost (never while it holds). Cancel to stop watching."""
        ...

    async def release(self) -> None:
        """Give the lead up (another process may take it at once); idempotent, never raises."""
        ...


class Leadership(Protocol):
    @property
    def shared(self) -> bool:
        """Whether other processes may receive for the same names (and outlive this one)."""
        ...

    async def acquire(self, name: str) -> Lead:
        """Wait until this process leads ``name`` (however long another holds it); cancel to give up."""
        ...


class _LocalLead:
    def __init__(self, name: str, lock: asyncio.Lock) -> None:
        self._name = name
        self._lock: asyncio.Lock | None = lock

    @property
    def name(self) -> str:
        return self._name

    async def watch(self) -> None:
        await asyncio.Event().wait()  # a lead within one process is never lost

    async def release(self) -> None:
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()


class LocalLeadership:
    """One process, so it leads everything; a name has one holder at a time within the process."""

    shared = False

    def __init__(self) -> None:
        self._locks: dict[str, asyncio.Lock] = {}

    async def acquire(self, name: str) -> Lead:
        lock = self._locks.setdefault(name, asyncio.Lock())
        await lock.acquire()
        return _LocalLead(name, lock)


async def run_as_leader(acquire: Callable[[], Awaitable[Lead]], work: Callable[[], Awaitable[None]], *,
                        on_change: Callable[[bool], None]) -> None:
    """Run ``work`` only while holding the lead ``acquire`` waits for, until it returns by itself.

    ``on_change(True)`` once the lead is held (just before ``work`` starts), ``on_change(False)`` once it is
    no longer held. When the lead is lost, ``work`` is cancelled at once and this waits for the lead again;
    when ``work`` returns (or raises), the lead is released and this returns (or raises) likewise.
    Cancelling this cancels ``work`` and releases the lead.
    """
    while True:
        lead = await acquire()
        try:
            on_change(True)
            if await _work_while_held(lead, work):
                return
            log.warning("lost the lead of %s: stopped receiving, standing by", lead.name)
        finally:
            on_change(False)
            await lead.release()


async def _work_while_held(lead: Lead, work: Callable[[], Awaitable[None]]) -> bool:
    """True when ``work`` ended by itself (its exception propagates), False when the lead was lost first."""
    working = asyncio.ensure_future(work())
    watching = asyncio.ensure_future(lead.watch())
    try:
        done, _ = await asyncio.wait({working, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        working.cancel()
        watching.cancel()
        await asyncio.gather(working, watching, return_exceptions=True)
    if working in done:
        working.result()  # work's own failure propagates
        return True
    return False
