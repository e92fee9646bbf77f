"""What only the PostgreSQL store needs testing for, beyond the shared contract (tests/test_store_contract.py):
a write whose caller is cancelled while it waits on the server still lands, and closing waits for it, as
the SQLite store's writes do (core ends its tasks before it closes the store); and two processes that both
read a message as waiting serve it once."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from core.store import InboundServedError, StoreError
from tests.support.postgres import PostgresCluster
from tests.support.store import user

KEY = "web:s1"


async def waiting_for_a_lock(conn: Any) -> bool:
    return bool(await conn.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted"))


async def test_a_write_whose_caller_is_cancelled_while_it_waits_lands_and_close_waits_for_it(
        postgres: PostgresCluster) -> None:
    import asyncpg

    from core.postgresql.store import PostgresqlStore

    dsn = postgres.fresh_dsn()
    store = PostgresqlStore(dsn, pool_size=2)
    await store.open()
    await store.get_or_create_session(KEY)
    other = await asyncpg.connect(dsn)
    try:
        async with other.transaction():
            await other.execute("LOCK TABLE sessions IN EXCLUSIVE MODE")  # the store's next write waits for this
            running = asyncio.create_task(store.append_message(KEY, user("sent"), begin_turn=("t1", "{}")))
            deadline = time.monotonic() + 10
            while not await waiting_for_a_lock(other):
                assert time.monotonic() < deadline, "the write never reached the server"
                await asyncio.sleep(0.02)
            running.cancel()
            closing = asyncio.create_task(store.close())  # waits for the write under way
            with pytest.raises(asyncio.CancelledError):
                await running
            with pytest.raises(StoreError, match="closed"):
                await store.append_message(KEY, user("after close began"))
            assert not closing.done()
        await closing
    finally:
        await other.close()
    again = PostgresqlStore(dsn)
    await again.open()
    try:
        _, history = await again.history(KEY)
        assert [m.content for m in history] == ["sent"]
        [turn] = await again.close_interrupted_turns()
        assert turn.turn_id == "t1"
    finally:
        await again.close()


async def test_a_write_called_just_before_close_lands(postgres: PostgresCluster) -> None:
    from core.postgresql.store import PostgresqlStore

    dsn = postgres.fresh_dsn()
    store = PostgresqlStore(dsn)
    await store.open()
    write = asyncio.create_task(store.append_message(KEY, user("just in time")))
    await asyncio.sleep(0)  # the call is made; its operation has not reached the server yet
    await store.close()
    message, _ = await write
    again = PostgresqlStore(dsn)
    await again.open()
    try:
        assert (await again.history(KEY))[1] == [message]
    finally:
        await again.close()


async def test_a_database_newer_than_this_code_is_refused(postgres: PostgresCluster) -> None:
    import asyncpg

    from core.postgresql.schema import MIGRATIONS
    from core.postgresql.store import PostgresqlStore, database_schema_version

    dsn = postgres.fresh_dsn()
    store = PostgresqlStore(dsn)
    await store.open()
    await store.close()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("UPDATE chatbridge_schema SET version = $1", len(MIGRATIONS) + 1)
    finally:
        await conn.close()
    assert await database_schema_version(dsn) == len(MIGRATIONS) + 1
    with pytest.raises(StoreError, match="newer than this code"):
        await PostgresqlStore(dsn).open()


async def test_messages_waiting_from_before_the_leases_migration_name_their_session_after_it(
        postgres: PostgresCluster) -> None:
    """Step 3 fills in the session of the messages that waited when step 2 added the column: the holder of
    that session finds them; an envelope that cannot be read is dropped."""
    import asyncpg

    from core.envelope import InboundEnvelope
    from core.postgresql.schema import migrate
    from core.postgresql.store import PostgresqlStore

    dsn = postgres.fresh_dsn()
    envelope = InboundEnvelope(channel="telegram", chat_id="42", sender_id="7", content="still waiting")
    conn = await asyncpg.connect(dsn)
    try:
        assert await migrate(conn, target=1) == 1
        for payload in (envelope.model_dump_json(), "{not an envelope"):
            await conn.execute("INSERT INTO inbound (channel, envelope, admitted_at, expires_at) VALUES"
                               " ('telegram', $1, $2, $2)", payload, time.time())
        assert await migrate(conn, target=2) == 2  # the column arrives empty
    finally:
        await conn.close()
    store = PostgresqlStore(dsn)
    await store.open()
    try:
        assert [r.payload for r in await store.waiting_inbound(key="telegram:42")] == [envelope.model_dump_json()]
        assert [r.payload for r in await store.waiting_inbound()] == [envelope.model_dump_json()]
    finally:
        await store.close()


async def test_two_processes_that_both_read_a_message_as_waiting_serve_it_once(postgres: PostgresCluster) -> None:
    """A holder whose lease ran out while its first write of a turn was on its way (held up here by a lock on
    the session's row, as a slow server would), and the process that took the session over meanwhile and read
    the message as still waiting: the write that lands first serves it, the other writes nothing."""
    import asyncpg

    from core.postgresql.store import PostgresqlStore

    dsn = postgres.fresh_dsn()
    stores = [PostgresqlStore(dsn, pool_size=2), PostgresqlStore(dsn, pool_size=2)]
    for store in stores:
        await store.open()
    other = await asyncpg.connect(dsn)
    try:
        await stores[0].get_or_create_session(KEY)
        seq = await stores[0].admit_inbound("web", "c-1", "{}", ttl_seconds=100, key=KEY)
        assert seq is not None
        async with other.transaction():
            # the session's row: its waiters go on in the order they came (a table lock would let them race)
            await other.execute("SELECT 1 FROM sessions WHERE key = $1 FOR UPDATE", KEY)
            writes = []
            for n, store in enumerate(stores):
                assert [r.seq for r in await store.waiting_inbound(key=KEY)] == [seq]  # both see it waiting
                writes.append(asyncio.create_task(
                    store.append_message(KEY, user("hello"), begin_turn=(f"t{n}", "{}"), serves=seq)))
                deadline = time.monotonic() + 10
                while await other.fetchval("SELECT count(*) FROM pg_locks WHERE NOT granted") < n + 1:
                    assert time.monotonic() < deadline, "the write never reached the server"
                    await asyncio.sleep(0.02)
        results = await asyncio.gather(*writes, return_exceptions=True)
        assert not isinstance(results[0], BaseException), results[0]  # the first in line served it
        assert isinstance(results[1], InboundServedError), results[1]
        _, history = await stores[1].history(KEY)
        assert [m.content for m in history] == ["hello"]
        assert [t.turn_id for t in await stores[1].close_interrupted_turns()] == ["t0"]
        assert await stores[1].waiting_inbound(key=KEY) == []
    finally:
        await other.close()
        for store in stores:
            await store.close()
