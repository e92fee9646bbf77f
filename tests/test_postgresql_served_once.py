"""A message is served once when a holder's lease runs out while its turn's first write is on its way: two
cores (each a process in production) on the test cluster, the database made slow by row locks the test
holds, so each step happens in the order that makes the race.

The old holder's write lands after the new holder's takeover looked for turns left running, and before the
new holder's own write for the same message: the store refuses the second (``InboundServedError``), and the
new holder closes the old holder's turn with its notice at once, in the message's place — before the answer
to the message sent after it, not whenever the conversation next changes hands."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import pytest

from core.failures import TurnFailurePresenter
from core.postgresql.bounds import StoreBounds
from core.postgresql.leases import PostgresqlLeases
from core.postgresql.store import PostgresqlStore
from tests.fakes.openai_server import FakeOpenAI, Function, Reply, Text
from tests.support.channel import FakePlatform
from tests.support.cluster import asked
from tests.support.harness import make_harness
from tests.support.postgres import PostgresCluster
from tests.support.process import wait_for

NOTICE = TurnFailurePresenter().interrupted_by_restart()
TTL = 3.0
LONG_WAITS = StoreBounds.for_lease(600.0)
"""Seconds a lease lasts unrenewed: the old holder loses it this long after its renewals stop reaching the
database. Long enough that a loaded host never loses one by accident during the test."""

WAITING_WRITES = ("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                  " AND query LIKE 'INSERT INTO sessions%'")


async def until(check: Callable[[], Awaitable[bool]], what: str) -> None:
    await wait_for(check, [], timeout=30, what=what)  # (no process of its own: no log to show)


async def test_a_message_both_holders_read_as_waiting_is_served_once_and_its_notice_comes_in_its_place(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster,
        caplog: pytest.LogCaptureFixture) -> None:
    async def answer(body: dict) -> Reply:
        return Text(f"answer to {asked(body)}")

    fake_openai.default = Function(answer)
    caplog.set_level(logging.WARNING, logger="core.session")
    dsn = postgres.fresh_dsn()
    platform = FakePlatform()
    # the test holds row locks for as long as its steps take (seconds, on a loaded machine): the stores' lock
    # waits outlast that (the longest bounds there are), where a store's lock wait would otherwise end first
    old, new = [await make_harness(tmp_path / name, fake_openai, store=PostgresqlStore(dsn, bounds=LONG_WAITS),
                                   platform=platform, leases=PostgresqlLeases(dsn, ttl=TTL)) for name in ("old", "new")]
    first = old.channel.envelope("first")
    key = first.key()
    await old.store.get_or_create_session(key)  # the row the slow database holds up
    # the two locks, and a connection outside them that watches (one in a transaction sees one snapshot)
    sessions, leases, watch = [await asyncpg.connect(dsn) for _ in range(3)]
    try:
        session_lock = sessions.transaction()
        await session_lock.start()
        await sessions.execute("SELECT 1 FROM sessions WHERE key = $1 FOR UPDATE", key)
        await old.core.submit(first)  # the old holder takes the lease, reads the message, and writes ...
        await until(lambda: _count(watch, 1), "the old holder's write waits")
        lease_lock = leases.transaction()  # ... while its renewals stop reaching the database
        await lease_lock.start()
        await leases.execute("SELECT 1 FROM leases WHERE name = $1 FOR UPDATE", key)

        async def lost() -> bool:  # (its turn is abandoned then: it will ask the model nothing)
            return f"lost the lease of {key}" in caplog.text
        await until(lost, "the old holder learns it lost the lease")
        await lease_lock.commit()

        async def taken() -> bool:  # the sweeper would, within TTL / 2; this is sooner
            new.core.sessions.wake(key)
            return new.core.leases.holds(key)
        await until(taken, "the new holder takes the session over")
        await until(lambda: _count(watch, 2), "the new holder's write for the same message waits")
        await new.core.submit(new.channel.envelope("second"))
        await session_lock.commit()  # the old holder's write lands first, then the new holder's

        async def answered() -> bool:  # (stored, then shown)
            return "answer to second" in [m.content for m in (await new.store.history(key))[1]]
        await until(answered, "the next message is answered")
        await new.settle()
        shown = [text for text in platform.visible("c1") if text != "…"]
        assert shown == [NOTICE, "answer to second"]
        _, history = await new.store.history(key)
        assert [(m.role, m.content) for m in history] == [
            ("user", "first"), ("assistant", NOTICE), ("user", "second"), ("assistant", "answer to second")]
        assert [asked(r) for r in fake_openai.requests] == ["second"]
    finally:
        for conn in (sessions, leases, watch):
            await conn.close()


async def _count(conn: asyncpg.Connection, n: int) -> bool:
    return bool(await conn.fetchval(WAITING_WRITES) >= n)
