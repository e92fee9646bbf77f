"""SqliteStore against real database files under tmp_path."""

from __future__ import annotations

import asyncio
import pathlib
import sqlite3
from collections.abc import AsyncIterator

import aiosqlite
import pytest

from core.messages import MessageSource, NewMessage, ToolCall
from core.sqlite.schema import MIGRATIONS, migrate, schema_version
from core.sqlite_store import SqliteStore
from core.store import StaleStateError, StoreError, UnknownMessageError
from tests.support import db

KEY = "telegram:chat:1"


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def user(text: str) -> NewMessage:
    return NewMessage(role="user", content=text, source=MessageSource(kind="user_input"))


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


async def test_get_or_create_session_defaults_and_is_idempotent(store: SqliteStore) -> None:
    created = await store.get_or_create_session(KEY, default_title="Hello")
    assert (created.title, created.title_is_default) == ("Hello", True)
    assert (created.generation, created.state_version, created.history_revision) == (0, 0, 0)
    assert (created.revision_seq, created.context_start_seq) == (0, 0)
    again = await store.get_or_create_session(KEY, default_title="Other")
    assert again == created
    assert await store.get_session("missing") is None


async def test_list_sessions_prefix_is_literal(store: SqliteStore) -> None:
    for key in ("web:a_1", "web:ab1", "web%x", "slack:1"):
        await store.get_or_create_session(key)
    assert {s.key for s in await store.list_sessions(prefix="web:a_")} == {"web:a_1"}
    assert {s.key for s in await store.list_sessions(prefix="web%")} == {"web%x"}
    assert len(await store.list_sessions()) == 4
    assert len(await store.list_sessions(limit=2)) == 2


async def test_bump_generation_creates_and_increments(store: SqliteStore) -> None:
    assert await store.bump_generation(KEY) == 1
    assert await store.bump_generation(KEY) == 2
    session = await store.get_session(KEY)
    assert session is not None and session.generation == 2


# --------------------------------------------------------------------------------------------- revisions


async def test_commits_form_contiguous_deltas_covering_every_message_once(store: SqliteStore) -> None:
    first_user, record = await store.append_message(KEY, user("hi"))
    assert (first_user.seq, record.state_version) == (1, 1)
    first = await store.commit_turn(KEY, [assistant("hello")], expect_generation=0, expect_state_version=1)
    assert first.history_revision == 1
    assert [(m.seq, m.role, m.content) for m in first.messages] == [
        (1, "user", "hi"),
        (2, "assistant", "hello"),
    ]

    await store.append_message(KEY, user("weather?"))
    turn = [
        NewMessage(
            role="assistant",
            content="",
            source=MessageSource(kind="assistant"),
            tool_calls=(ToolCall(id="c1", name="weather", arguments='{"city": "Oslo"}'),),
        ),
        NewMessage(role="tool", content="rain", source=MessageSource(kind="tool"), tool_call_id="c1"),
        assistant("It rains."),
    ]
    second = await store.commit_turn(KEY, turn, expect_generation=0, expect_state_version=3)
    assert second.history_revision == 2
    assert [m.seq for m in second.messages] == [3, 4, 5, 6]
    assert second.messages[0].content == "weather?"

    empty = await store.commit_turn(KEY, [], expect_generation=None, expect_state_version=None)
    assert (empty.history_revision, empty.messages) == (3, ())

    revision, history = await store.history(KEY)
    assert revision == 3
    covered = [m for result in (first, second, empty) for m in result.messages]
    assert covered == history
    assert len({m.id for m in history}) == len(history) == 6

    session = await store.get_session(KEY)
    assert session is not None
    assert (session.state_version, session.history_revision, session.revision_seq) == (4, 3, 6)


async def test_append_message_bumps_state_version_but_not_revision(store: SqliteStore) -> None:
    _, r1 = await store.append_message(KEY, user("a"))
    _, r2 = await store.append_message(KEY, user("b"))
    sv1, sv2 = r1.state_version, r2.state_version
    assert (sv1, sv2) == (1, 2)
    session = await store.get_session(KEY)
    assert session is not None and session.history_revision == 0


async def test_stale_generation_writes_nothing(store: SqliteStore) -> None:
    await store.append_message(KEY, user("hi"))
    await store.bump_generation(KEY)
    before = await store.get_session(KEY)
    with pytest.raises(StaleStateError):
        await store.commit_turn(KEY, [assistant("late")], expect_generation=0, expect_state_version=None)
    assert await store.get_session(KEY) == before
    _, history = await store.history(KEY)
    assert [m.content for m in history] == ["hi"]
    nxt, _ = await store.append_message(KEY, user("next"))
    assert nxt.seq == 2


async def test_stale_state_version_writes_nothing(store: SqliteStore) -> None:
    _, rec = await store.append_message(KEY, user("one"))
    sv = rec.state_version
    await store.append_message(KEY, user("two"))  # a second message moved the state on
    before = await store.get_session(KEY)
    with pytest.raises(StaleStateError):
        await store.commit_turn(KEY, [assistant("late")], expect_generation=0, expect_state_version=sv)
    assert await store.get_session(KEY) == before
    _, history = await store.history(KEY)
    assert [m.content for m in history] == ["one", "two"]


async def test_stale_commit_on_missing_session_creates_nothing(store: SqliteStore) -> None:
    with pytest.raises(StaleStateError):
        await store.commit_turn("fresh", [assistant("x")], expect_generation=5, expect_state_version=None)
    assert await store.get_session("fresh") is None


async def test_history_revision_is_consistent_with_messages(store: SqliteStore) -> None:
    assert await store.history(KEY) == (0, [])
    await store.append_message(KEY, user("q1"))
    await store.commit_turn(KEY, [assistant("a1")], expect_generation=None, expect_state_version=None)
    await store.append_message(KEY, user("q2"))  # not committed yet: included, revision unchanged
    revision, messages = await store.history(KEY)
    session = await store.get_session(KEY)
    assert session is not None
    assert revision == session.history_revision == 1
    assert [m.content for m in messages] == ["q1", "a1", "q2"]
    revision, newest = await store.history(KEY, limit=2)
    assert (revision, [m.seq for m in newest]) == (1, [2, 3])


async def test_history_pages_backwards_from_a_message_id(store: SqliteStore) -> None:
    for i in range(7):
        await store.append_message(KEY, user(f"q{i}"))
        await store.commit_turn(KEY, [assistant(f"a{i}")], expect_generation=None, expect_state_version=None)
    revision, newest = await store.history(KEY, limit=5)
    assert revision == 7 and [m.content for m in newest] == ["a4", "q5", "a5", "q6", "a6"]
    pages, page = [newest], newest
    while page:
        _, page = await store.history(KEY, limit=5, before=page[0].id)
        pages.insert(0, page)
    everything = [m for p in pages for m in p]
    assert [m.content for m in everything] == [x for i in range(7) for x in (f"q{i}", f"a{i}")]
    assert [len(p) for p in pages] == [0, 4, 5, 5]
    # an id from another session, or none at all, is bad input, not an empty page
    other, _ = await store.append_message("other", user("elsewhere"))
    for foreign in (other.id, "no-such-id"):
        with pytest.raises(UnknownMessageError):
            await store.history(KEY, before=foreign)
    with pytest.raises(UnknownMessageError):
        await store.history("never-created", before=newest[0].id)


async def test_new_context_excludes_old_messages_but_history_keeps_them(store: SqliteStore) -> None:
    await store.append_message(KEY, user("old question"))
    await store.commit_turn(KEY, [assistant("old answer")], expect_generation=0, expect_state_version=1)
    before = await store.get_session(KEY)
    assert before is not None

    fresh = await store.new_context(KEY)
    assert fresh.context_start_seq == 2
    assert (fresh.generation, fresh.state_version) == (before.generation + 1, before.state_version + 1)
    assert await store.context_messages(KEY, limit=50) == (fresh.state_version, [])

    await store.append_message(KEY, user("new 1"))
    await store.append_message(KEY, user("new 2"))
    _, last = await store.append_message(KEY, user("new 3"))
    version, context = await store.context_messages(KEY, limit=2)
    assert [m.content for m in context] == ["new 2", "new 3"]
    assert version == last.state_version == fresh.state_version + 3
    _, history = await store.history(KEY)
    assert [m.content for m in history] == ["old question", "old answer", "new 1", "new 2", "new 3"]


# --------------------------------------------------------------------------------------------- titles


async def test_rename_beats_automatic_title(store: SqliteStore) -> None:
    session = await store.get_or_create_session(KEY)
    assert await store.set_title_if_default(KEY, "Auto 1", expect_generation=session.generation)
    assert await store.set_title_if_default(KEY, "Auto 2", expect_generation=session.generation)
    await store.rename(KEY, "Mine")
    assert not await store.set_title_if_default(KEY, "Auto 3", expect_generation=session.generation)
    renamed = await store.get_session(KEY)
    assert renamed is not None
    assert (renamed.title, renamed.title_is_default) == ("Mine", False)


async def test_automatic_title_with_moved_generation_is_refused(store: SqliteStore) -> None:
    session = await store.get_or_create_session(KEY)
    await store.bump_generation(KEY)
    assert not await store.set_title_if_default(KEY, "Late", expect_generation=session.generation)
    current = await store.get_session(KEY)
    assert current is not None and current.title == "New chat"
    assert not await store.set_title_if_default("missing", "x", expect_generation=0)


# --------------------------------------------------------------------------------------------- dedupe


async def test_dedupe_survives_reopen_and_ttl_expiry_readmits(db_path: pathlib.Path) -> None:
    clock = FakeClock()
    store = SqliteStore(db_path, clock=clock)
    await store.open()
    try:
        assert await store.mark_event_processed("telegram", "e1", ttl_seconds=100)
        assert not await store.mark_event_processed("telegram", "e1", ttl_seconds=100)
        assert await store.mark_event_processed("slack", "e1", ttl_seconds=100)
    finally:
        await store.close()

    reopened = SqliteStore(db_path, clock=clock)
    await reopened.open()
    try:
        clock.now += 99
        assert not await reopened.mark_event_processed("telegram", "e1", ttl_seconds=100)
        clock.now += 2  # TTL ran out
        assert await reopened.mark_event_processed("telegram", "e1", ttl_seconds=100)
        assert not await reopened.mark_event_processed("telegram", "e1", ttl_seconds=100)
    finally:
        await reopened.close()


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


async def test_close_interrupted_turns_returns_running_turns_once(store: SqliteStore) -> None:
    await store.append_message(KEY, user("1"), begin_turn=("t1", '{"chat": 1}'))
    await store.append_message(KEY, user("2"), begin_turn=("t2", '{"chat": 2}'))
    await store.append_message("other", user("3"), begin_turn=("t3", "{}"))
    await store.end_turn("t2", "completed")

    interrupted = await store.close_interrupted_turns()
    assert [(t.turn_id, t.state, t.target_json) for t in interrupted] == [
        ("t1", "interrupted", '{"chat": 1}'),
        ("t3", "interrupted", "{}"),
    ]
    assert all(t.ended_at is not None for t in interrupted)
    assert await store.close_interrupted_turns() == []


async def test_traces_are_numbered_per_session_in_order(db_path: pathlib.Path, store: SqliteStore) -> None:
    for i in range(3):
        await store.append_traces(KEY, "t1", [("step", {"i": i})])
    await store.append_traces("other", "t9", [("step", {"i": 99})])
    await store.append_traces(KEY, "t2", [("step", {"i": 3}), ("step", {"i": 4})])
    assert [(t.seq, t.turn_id, t.payload["i"]) for t in db.traces(db_path, KEY)] == [
        (1, "t1", 0), (2, "t1", 1), (3, "t1", 2), (4, "t2", 3), (5, "t2", 4)]
    assert [(t.seq, t.turn_id) for t in db.traces(db_path, "other")] == [(1, "t9")]


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


async def test_concurrent_appends_get_distinct_seqs(store: SqliteStore) -> None:
    results = await asyncio.gather(*(store.append_message(KEY, user(f"m{i}")) for i in range(20)))
    assert sorted(m.seq for m, _ in results) == list(range(1, 21))
    assert sorted(r.state_version for _, r in results) == list(range(1, 21))


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
        await other.execute("COMMIT")
    await first
    for task in rest:
        await task
    with pytest.raises(StoreError):
        await dup
    assert [await t for t in seen][1] is None
    assert db.rows(db_path, "SELECT count(*) FROM messages") == [(6,)]
    assert {t.turn_id for t in await store.close_interrupted_turns()} == {f"t{i}" for i in range(1, 6)}


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


async def test_closed_store_raises_store_error(db_path: pathlib.Path) -> None:
    store = SqliteStore(db_path)
    await store.open()
    await store.close()
    with pytest.raises(StoreError):
        await store.append_message(KEY, user("SECRET"))
    with pytest.raises(StoreError):
        await store.history(KEY)


async def test_turn_record_opens_with_the_message_and_closes_with_the_commit(store: SqliteStore) -> None:
    await store.append_message(KEY, user("hi"), begin_turn=("t1", '{"channel": "x"}'))
    await store.commit_turn(KEY, [], expect_generation=None, expect_state_version=None,
                            end_turn=("t1", "completed"))
    await store.append_message(KEY, user("again"), begin_turn=("t2", '{"channel": "x"}'))
    [left_running] = await store.close_interrupted_turns()
    assert left_running.turn_id == "t2" and left_running.target_json == '{"channel": "x"}'


async def test_channel_state_is_durable_and_overwritable(tmp_path) -> None:
    store = SqliteStore(tmp_path / "state.db")
    await store.open()
    assert await store.get_channel_state("telegram", "offset") is None
    await store.set_channel_state("telegram", "offset", "41")
    await store.set_channel_state("telegram", "offset", "42")
    await store.close()
    reopened = SqliteStore(tmp_path / "state.db")
    await reopened.open()
    assert await reopened.get_channel_state("telegram", "offset") == "42"
    assert await reopened.get_channel_state("slack", "offset") is None
    await reopened.close()


async def test_a_batch_of_traces_lands_in_order_after_earlier_ones(db_path: pathlib.Path,
                                                                    store: SqliteStore) -> None:
    await store.append_traces(KEY, "t1", [("request_begin", {})])
    await store.append_traces(KEY, "t2", [("text", {"n": 1}), ("request_end", {"status": "completed"})])
    records = db.traces(db_path, KEY)
    assert [(r.seq, r.turn_id, r.kind) for r in records] == [
        (1, "t1", "request_begin"), (2, "t2", "text"), (3, "t2", "request_end")]
    assert records[2].payload == {"status": "completed"}


async def test_a_commit_carries_its_turn_trace_and_a_stale_one_writes_none(db_path: pathlib.Path,
                                                                             store: SqliteStore) -> None:
    await store.append_message(KEY, user("q"))
    with pytest.raises(StaleStateError):
        await store.commit_turn(KEY, [assistant("a")], expect_generation=0, expect_state_version=99,
                                trace=("t1", [("request_begin", {})]))
    assert db.traces(db_path, KEY) == []
    await store.commit_turn(KEY, [assistant("a")], expect_generation=0, expect_state_version=1,
                            trace=("t1", [("request_begin", {"n": 1}), ("request_end", {"status": "completed"})]))
    assert [(t.turn_id, t.kind, t.payload) for t in db.traces(db_path, KEY)] == [
        ("t1", "request_begin", {"n": 1}), ("t1", "request_end", {"status": "completed"})]


async def test_an_idle_store_keeps_nothing_of_its_last_write(store: SqliteStore) -> None:
    import gc
    import weakref

    await store.append_message(KEY, user("q"))
    result = await store.commit_turn(KEY, [assistant("a")], expect_generation=0, expect_state_version=1)
    gone = weakref.ref(result)
    del result
    gc.collect()
    assert gone() is None


async def test_a_trace_payload_json_cannot_hold_never_fails_the_commit(db_path: pathlib.Path,
                                                                        store: SqliteStore) -> None:
    circular: dict[str, object] = {}
    circular["self"] = circular
    await store.append_message(KEY, user("q"))
    result = await store.commit_turn(KEY, [assistant("a")], expect_generation=0, expect_state_version=1,
                                     trace=("t1", [("odd", circular), ("fine", {"when": object})]))
    assert [m.content for m in result.messages] == ["q", "a"]
    records = db.traces(db_path, KEY)
    assert records[0].payload == {"unencodable_payload": True}
    assert records[1].payload["when"].startswith("<class")  # stored as its str()


# --------------------------------------------------------------------------------------------- inbound


async def test_an_admitted_message_waits_until_served_and_keeps_its_mark(db_path: pathlib.Path) -> None:
    clock = FakeClock()
    store = SqliteStore(db_path, clock=clock)
    await store.open()
    try:
        first = await store.admit_inbound("telegram", "555:1", '{"n": 1}', ttl_seconds=100)
        second = await store.admit_inbound("web", None, '{"n": 2}', ttl_seconds=100)
        assert first is not None and second is not None and first < second
        assert await store.admit_inbound("telegram", "555:1", '{"n": 1}', ttl_seconds=100) is None
        assert await store.event_seen("telegram", "555:1") and not await store.event_seen("telegram", "555:2")
        assert [(r.seq, r.payload) for r in await store.waiting_inbound()] == [(first, '{"n": 1}'),
                                                                               (second, '{"n": 2}')]
        await store.append_message(KEY, user("one"), begin_turn=("t1", "{}"), serves=first)
    finally:
        await store.close()
    reopened = SqliteStore(db_path, clock=clock)
    await reopened.open()
    try:
        assert [r.seq for r in await reopened.waiting_inbound()] == [second]
        clock.now += 99
        assert await reopened.event_seen("telegram", "555:1")  # served, the mark stays for its TTL
        assert await reopened.admit_inbound("telegram", "555:1", "{}", ttl_seconds=100) is None
        clock.now += 2
        assert not await reopened.event_seen("telegram", "555:1")
        assert await reopened.admit_inbound("telegram", "555:1", "{}", ttl_seconds=100) is not None
    finally:
        await reopened.close()


async def test_a_waiting_message_keeps_its_mark_past_its_ttl(db_path: pathlib.Path) -> None:
    clock = FakeClock()
    store = SqliteStore(db_path, clock=clock)
    await store.open()
    try:
        seq = await store.admit_inbound("telegram", "e1", "{}", ttl_seconds=10)
        clock.now += 60
        assert await store.admit_inbound("telegram", "e2", "{}", ttl_seconds=10) is not None  # purges
        assert await store.admit_inbound("telegram", "e1", "{}", ttl_seconds=10) is None
        assert seq in [r.seq for r in await store.waiting_inbound()]
    finally:
        await store.close()


async def test_finished_inbound_keeps_its_mark_and_forgotten_inbound_frees_its_event(store: SqliteStore) -> None:
    done = await store.admit_inbound("web", "c-1", "{}", ttl_seconds=100)
    gone = await store.admit_inbound("web", "c-2", "{}", ttl_seconds=100)
    assert done is not None and gone is not None
    await store.finish_inbound([done])
    await store.forget_inbound(gone)
    assert await store.waiting_inbound() == []
    assert await store.admit_inbound("web", "c-1", "{}", ttl_seconds=100) is None
    assert await store.admit_inbound("web", "c-2", "{}", ttl_seconds=100) is not None


async def test_rows_without_an_event_id_go_once_served(db_path: pathlib.Path, store: SqliteStore) -> None:
    for i in range(3):
        seq = await store.admit_inbound("web", None, "{}", ttl_seconds=100)
        assert seq is not None
        await store.append_message(KEY, user(f"m{i}"), serves=seq)
    assert db.rows(db_path, "SELECT count(*) FROM inbound") == [(1,)]  # the last one, until the next admission


async def test_new_context_drops_the_waiting_messages_it_is_given(store: SqliteStore) -> None:
    dropped = await store.admit_inbound("web", "c-1", "{}", ttl_seconds=100)
    kept = await store.admit_inbound("web", "c-2", "{}", ttl_seconds=100)
    assert dropped is not None and kept is not None
    await store.new_context(KEY, drop_inbound=[dropped])
    assert [r.seq for r in await store.waiting_inbound()] == [kept]
    assert await store.admit_inbound("web", "c-1", "{}", ttl_seconds=100) is None


async def test_a_failed_write_serves_nothing(store: SqliteStore) -> None:
    seq = await store.admit_inbound("web", "c-1", "{}", ttl_seconds=100)
    await store.append_message(KEY, user("first"), begin_turn=("t1", "{}"))
    with pytest.raises(StoreError):
        await store.append_message(KEY, user("second"), begin_turn=("t1", "{}"), serves=seq)
    assert [r.seq for r in await store.waiting_inbound()] == [seq]


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


async def test_a_commit_of_many_messages_lands_whole(store: SqliteStore) -> None:
    await store.append_message(KEY, user("q"))
    many = [assistant(f"part {i}") for i in range(500)]
    result = await store.commit_turn(KEY, many, expect_generation=0, expect_state_version=1)
    assert [m.seq for m in result.messages] == list(range(1, 502))
    _, history = await store.history(KEY)
    assert [m.content for m in history] == ["q", *(f"part {i}" for i in range(500))]
