"""SqliteStore: what only the SQLite backend has (its file, schema upgrades, the writer thread, group commit,
cancellation and error translation). What every backend promises is in tests/test_store_contract.py."""

from __future__ import annotations

import asyncio
import pathlib
import sqlite3
from collections.abc import AsyncIterator

import aiosqlite
import pytest

from core.messages import MessageSource, NewMessage
from core.sqlite.schema import MIGRATIONS, migrate, schema_version
from core.sqlite_store import SqliteStore
from core.store import StaleStateError, StoreError
from tests.support import db
from tests.support.store import FakeClock, user

KEY = "telegram:chat:1"


def assistant(text: str) -> NewMessage:
    return NewMessage(role="assistant", content=text, source=MessageSource(kind="assistant"))


@pytest.fixture
def db_path(tmp_path: pathlib.Path) -> pathlib.Path:
    return tmp_path / "data" / "chatbridge.sqlite3"


@pytest.fixture
async def store(db_path: pathlib.Path) -> AsyncIterator[SqliteStore]:
    s = SqliteStore(db_path)
    await s.open()
    yield s
    await s.close()


# --------------------------------------------------------------------------------------------- sessions


async def test_open_creates_directory_and_wal_database(db_path: pathlib.Path, store: SqliteStore) -> None:
    assert await asyncio.to_thread(db_path.is_file)
    with sqlite3.connect(db_path) as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert raw.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)


# --------------------------------------------------------------------------------------------- revisions


async def test_append_message_bumps_state_version_but_not_revision(store: SqliteStore) -> None:
    _, r1 = await store.append_message(KEY, user("a"))
    _, r2 = await store.append_message(KEY, user("b"))
    sv1, sv2 = r1.state_version, r2.state_version
    assert (sv1, sv2) == (1, 2)
    session = await store.get_session(KEY)
    assert session is not None and session.history_revision == 0


# --------------------------------------------------------------------------------------------- titles


# --------------------------------------------------------------------------------------------- dedupe


async def test_expired_dedupe_rows_are_purged(db_path: pathlib.Path) -> None:
    clock = FakeClock()
    store = SqliteStore(db_path, clock=clock)
    await store.open()
    try:
        for i in range(5):
            await store.mark_event_processed("web", f"old{i}", ttl_seconds=10)
        clock.now += 120
        await store.mark_event_processed("web", "new", ttl_seconds=10)
    finally:
        await store.close()
    assert db.rows(db_path, "SELECT event_id FROM inbound") == [("new",)]


# --------------------------------------------------------------------------------------------- migrations


async def test_reopen_keeps_data_and_schema(db_path: pathlib.Path) -> None:
    store = SqliteStore(db_path)
    await store.open()
    await store.append_message(KEY, user("kept"))
    await store.rename(KEY, "Title")
    await store.close()
    await store.close()  # idempotent

    again = SqliteStore(db_path)
    await again.open()
    try:
        _, history = await again.history(KEY)
        assert [m.content for m in history] == ["kept"]
        session = await again.get_session(KEY)
        assert session is not None and session.title == "Title"
    finally:
        await again.close()


async def test_older_schema_is_upgraded(db_path: pathlib.Path) -> None:
    assert len(MIGRATIONS) >= 2
    db_path.parent.mkdir(parents=True)
    async with aiosqlite.connect(db_path, isolation_level=None) as conn:
        assert await migrate(conn, target=1) == 1
        await conn.execute(
            "INSERT INTO sessions (key, title, created_at, updated_at) VALUES (?, 'From v1', 1.0, 1.0)",
            (KEY,),
        )
        tables = {r[0] for r in await conn.execute_fetchall("SELECT name FROM sqlite_master")}
        assert "turns" not in tables

    store = SqliteStore(db_path)
    await store.open()
    try:
        session = await store.get_session(KEY)
        assert session is not None and session.title == "From v1"
        await store.append_message(KEY, user("hi"), begin_turn=("t1", "{}"))
        await store.append_traces(KEY, "t1", [("start", {})])
    finally:
        await store.close()
    assert [t.kind for t in db.traces(db_path, KEY)] == ["start"]
    async with aiosqlite.connect(db_path) as conn:
        assert await schema_version(conn) == len(MIGRATIONS)


async def test_dedupe_marks_of_schema_3_carry_over(db_path: pathlib.Path) -> None:
    db_path.parent.mkdir(parents=True)
    clock = FakeClock()
    async with aiosqlite.connect(db_path, isolation_level=None) as conn:
        assert await migrate(conn, target=3) == 3
        await conn.execute("INSERT INTO processed_events VALUES ('telegram', 'e1', ?)", (clock.now + 100,))
    store = SqliteStore(db_path, clock=clock)
    await store.open()
    try:
        assert await store.event_seen("telegram", "e1")
        assert not await store.mark_event_processed("telegram", "e1", ttl_seconds=100)
        clock.now += 101
        assert await store.mark_event_processed("telegram", "e1", ttl_seconds=100)
    finally:
        await store.close()


async def test_newer_schema_is_refused(db_path: pathlib.Path) -> None:
    db_path.parent.mkdir(parents=True)
    with sqlite3.connect(db_path) as raw:
        raw.execute(f"PRAGMA user_version = {len(MIGRATIONS) + 1}")
    store = SqliteStore(db_path)
    with pytest.raises(StoreError, match="newer"):
        await store.open()
    await store.close()


# --------------------------------------------------------------------------------------------- turns, traces


# --------------------------------------------------------------------------------------------- concurrency


async def test_a_long_read_elsewhere_neither_blocks_a_write_nor_sees_it(db_path: pathlib.Path,
                                                                         store: SqliteStore) -> None:
    await store.append_message(KEY, user("before"))
    async with aiosqlite.connect(db_path, isolation_level=None) as reader:
        await reader.execute("BEGIN")
        rows = list(await reader.execute_fetchall("SELECT count(*) FROM messages"))
        assert rows[0][0] == 1
        result = await asyncio.wait_for(
            store.commit_turn(KEY, [assistant("during")], expect_generation=0, expect_state_version=1),
            timeout=2.0,
        )
        assert result.history_revision == 1
        _, history = await store.history(KEY)  # the store's own reads see it at once
        assert [m.content for m in history] == ["before", "during"]
        rows = list(await reader.execute_fetchall("SELECT count(*) FROM messages"))
        assert rows[0][0] == 1  # the held read transaction still sees its snapshot
        await reader.execute("ROLLBACK")


async def test_concurrent_writes_fail_alone_and_whole(store: SqliteStore) -> None:
    """Writes made at once run one after the other; one that fails (a stale commit, a duplicate turn id)
    leaves nothing behind, and the others land."""
    await store.append_message(KEY, user("q"))  # state_version 1
    writes = [
        store.commit_turn(KEY, [assistant("kept")], expect_generation=0, expect_state_version=1),
        store.commit_turn(KEY, [assistant("dropped")], expect_generation=0, expect_state_version=1),
        store.append_message(KEY, user("second"), begin_turn=("t1", "{}")),
        # fails at its turn record, after its message row was written: that row must go too
        store.append_message(KEY, user("half-written"), begin_turn=("t1", "{}")),
        store.append_message("other:chat", user("elsewhere")),
    ]
    good, stale, first_t1, dup_t1, other = await asyncio.gather(*writes, return_exceptions=True)
    assert not isinstance(good, BaseException) and good.history_revision == 1
    assert isinstance(stale, StaleStateError)  # the first commit moved state_version on
    assert not isinstance(first_t1, BaseException)
    assert isinstance(dup_t1, StoreError) and not isinstance(dup_t1, StaleStateError)
    assert not isinstance(other, BaseException)
    _, history = await store.history(KEY)
    assert [m.content for m in history] == ["q", "kept", "second"]
    session = await store.get_session(KEY)
    assert session is not None and (session.state_version, session.history_revision) == (3, 1)
    _, elsewhere = await store.history("other:chat")
    assert [m.content for m in elsewhere] == ["elsewhere"]
    [running] = await store.close_interrupted_turns()
    assert running.turn_id == "t1"


async def test_a_write_cancelled_before_it_started_never_happens(db_path: pathlib.Path, store: SqliteStore) -> None:
    async with aiosqlite.connect(db_path, isolation_level=None) as other:
        await other.execute("BEGIN IMMEDIATE")  # the store's first write waits for this lock
        first = asyncio.create_task(store.append_message(KEY, user("first")))
        await asyncio.sleep(0.05)
        cancelled = asyncio.create_task(store.append_message(KEY, user("never"), begin_turn=("t1", "{}")))
        await asyncio.sleep(0.05)  # queued behind the first
        cancelled.cancel()
        await other.execute("COMMIT")
    await first
    await store.append_message(KEY, user("next"))
    assert cancelled.cancelled()
    _, history = await store.history(KEY)
    assert [m.content for m in history] == ["first", "next"]
    assert await store.close_interrupted_turns() == []


async def test_a_write_whose_caller_is_cancelled_once_it_runs_lands_whole(db_path: pathlib.Path,
                                                                         store: SqliteStore) -> None:
    async with aiosqlite.connect(db_path, isolation_level=None) as other:
        await other.execute("BEGIN IMMEDIATE")  # the store's next write waits for this lock
        running = asyncio.create_task(store.append_message(KEY, user("sent"), begin_turn=("t1", "{}")))
        await asyncio.sleep(0.2)
        running.cancel()
        await other.execute("COMMIT")
    await store.append_message(KEY, user("next"))
    assert running.cancelled()
    _, history = await store.history(KEY)
    assert [m.content for m in history] == ["sent", "next"]
    [turn] = await store.close_interrupted_turns()
    assert turn.turn_id == "t1"


async def test_concurrent_writes_share_statements_and_still_fail_alone(db_path: pathlib.Path,
                                                                       store: SqliteStore) -> None:
    """Writes queued while the writer is busy are merged; one that fails is retried alone and fails alone."""
    async with aiosqlite.connect(db_path, isolation_level=None) as other:
        await other.execute("BEGIN IMMEDIATE")
        first = asyncio.create_task(store.append_message("s0", user("first")))
        await asyncio.sleep(0.05)  # the first write waits for the lock; the next ones queue behind it
        rest = [asyncio.create_task(store.append_message(f"s{i}", user(f"m{i}"), begin_turn=(f"t{i}", "{}")))
                for i in range(1, 6)]
        dup = asyncio.create_task(store.append_message("s9", user("dup"), begin_turn=("t3", "{}")))
        seen = [asyncio.create_task(store.admit_inbound("web", "c-1", "{}", ttl_seconds=100)) for _ in range(2)]
        marks = [asyncio.create_task(store.mark_delivered(turn)) for turn in ("d1", "d2", "d1", "d3")]
        await other.execute("COMMIT")
    await first
    for task in rest:
        await task
    with pytest.raises(StoreError):
        await dup
    assert [await t for t in seen][1] is None
    await asyncio.gather(*marks)  # marked twice in one statement: one mark
    assert db.rows(db_path, "SELECT turn_id FROM deliveries ORDER BY turn_id") == [("d1",), ("d2",), ("d3",)]
    assert db.rows(db_path, "SELECT count(*) FROM messages") == [(6,)]
    assert {t.turn_id for t in await store.close_interrupted_turns()} == {f"t{i}" for i in range(1, 6)}


async def test_a_burst_of_new_conversations_is_stored_in_one_statement(
        db_path: pathlib.Path, store: SqliteStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two hundred messages arriving at once (a burst of chats) queue behind a busy writer and land together:
    one statement, one commit, so their turns start together instead of in waves."""
    statements: list[str] = []
    execute_fetchall = aiosqlite.Connection.execute_fetchall

    async def counted(self: aiosqlite.Connection, sql: str, parameters: object = None) -> object:
        statements.append(sql)
        return await execute_fetchall(self, sql, parameters)  # type: ignore[arg-type]

    async with aiosqlite.connect(db_path, isolation_level=None) as other:
        await other.execute("BEGIN IMMEDIATE")
        first = asyncio.create_task(store.append_message("s0", user("first")))
        await asyncio.sleep(0.05)  # the first write waits for the lock; the burst queues behind it
        monkeypatch.setattr(aiosqlite.Connection, "execute_fetchall", counted)
        burst = [asyncio.create_task(store.append_message(f"s{i}", user(f"m{i}"), begin_turn=(f"t{i}", "{}")))
                 for i in range(1, 201)]
        await asyncio.sleep(0)
        await other.execute("COMMIT")
    await first
    await asyncio.gather(*burst)
    assert len(statements) == 1
    assert db.rows(db_path, "SELECT count(*) FROM messages") == [(201,)]


async def test_writes_queued_when_the_store_closes_get_a_store_error(db_path: pathlib.Path) -> None:
    store = SqliteStore(db_path)
    await store.open()
    closing = asyncio.create_task(store.close())
    await asyncio.sleep(0)  # close() holds the writer lock now
    queued = asyncio.create_task(store.append_message(KEY, user("late")))
    await closing
    with pytest.raises(StoreError, match="closed"):
        await queued


# --------------------------------------------------------------------------------------------- round trip


async def test_source_and_received_at_round_trip_exactly(db_path: pathlib.Path) -> None:
    source = MessageSource(
        kind="user_input",
        from_channel="telegram",
        from_user_id="u-42",
        reply_to="msg-7",
        turn_id="turn-1",
        extra={"nested": [1, "x", None], "flag": True},
    )
    received_at = 1_712_345_678.123_456_7
    message = NewMessage(role="user", content="héllo 👋", source=source, received_at=received_at)
    store = SqliteStore(db_path)
    await store.open()
    stored, _ = await store.append_message(KEY, message)
    await store.close()

    reopened = SqliteStore(db_path)
    await reopened.open()
    try:
        _, (loaded,) = await reopened.history(KEY)
    finally:
        await reopened.close()
    assert loaded == stored
    assert loaded.source == source
    assert loaded.received_at == received_at
    assert loaded.content == "héllo 👋"
    assert len(loaded.id) == 32


# --------------------------------------------------------------------------------------------- errors


async def test_sqlite_errors_become_store_errors_without_content(
    db_path: pathlib.Path, store: SqliteStore
) -> None:
    await store.append_message(KEY, user("MSG-SECRET"), begin_turn=("t1", '{"secret": "TARGET-SECRET"}'))
    with pytest.raises(StoreError) as duplicate:
        await store.append_message(KEY, user("MSG-SECRET"), begin_turn=("t1", '{"secret": "TARGET-SECRET"}'))
    assert not isinstance(duplicate.value, StaleStateError)
    assert "TARGET-SECRET" not in str(duplicate.value) and "MSG-SECRET" not in str(duplicate.value)
    await store.append_message(KEY, user("fine"), begin_turn=("t2", "{}"))  # the writer is usable

    with sqlite3.connect(db_path) as raw:
        raw.execute("UPDATE messages SET content = 'ROW-SECRET', source = '{\"kind\": \"ROW-SECRET\"}'")
    with pytest.raises(StoreError) as malformed:
        await store.history(KEY)
    assert "ROW-SECRET" not in str(malformed.value)
    assert malformed.value.__cause__ is None


async def test_a_batch_of_traces_lands_in_order_after_earlier_ones(db_path: pathlib.Path,
                                                                    store: SqliteStore) -> None:
    await store.append_traces(KEY, "t1", [("request_begin", {})])
    await store.append_traces(KEY, "t2", [("text", {"n": 1}), ("request_end", {"status": "completed"})])
    records = db.traces(db_path, KEY)
    assert [(r.seq, r.turn_id, r.kind) for r in records] == [
        (1, "t1", "request_begin"), (2, "t2", "text"), (3, "t2", "request_end")]
    assert records[2].payload == {"status": "completed"}


async def test_an_idle_store_keeps_nothing_of_its_last_write(store: SqliteStore) -> None:
    import gc
    import weakref

    await store.append_message(KEY, user("q"))
    result = await store.commit_turn(KEY, [assistant("a")], expect_generation=0, expect_state_version=1)
    gone = weakref.ref(result)
    del result
    gc.collect()
    assert gone() is None


# --------------------------------------------------------------------------------------------- inbound


async def test_rows_without_an_event_id_go_once_served(db_path: pathlib.Path, store: SqliteStore) -> None:
    for i in range(3):
        seq = await store.admit_inbound("web", None, "{}", ttl_seconds=100)
        assert seq is not None
        await store.append_message(KEY, user(f"m{i}"), serves=seq)
    assert db.rows(db_path, "SELECT count(*) FROM inbound") == [(1,)]  # the last one, until the next admission


async def test_every_character_and_timestamp_of_a_commit_round_trips(store: SqliteStore) -> None:
    await store.append_message(KEY, NewMessage(role="user", content="nul \x00 inside", received_at=1 / 3,
                                               source=MessageSource(kind="user_input")))
    odd = NewMessage(role="tool", content="a\x00b 👋 \u2028 \"q\" \\", tool_call_id="call\x00x",
                     received_at=1_712_345_678.123_456_7, source=MessageSource(kind="tool", extra={"z": "\x00"}))
    result = await store.commit_turn(KEY, [odd, assistant("end")], expect_generation=0, expect_state_version=1)
    _, history = await store.history(KEY)
    assert list(result.messages) == history
    assert history[0].content == "nul \x00 inside" and history[0].received_at == 1 / 3
    assert (history[1].content, history[1].tool_call_id) == (odd.content, odd.tool_call_id)
    assert history[1].received_at == odd.received_at and history[1].source == odd.source

