"""The SQLite Store: the default durable backend of chatbridge.

Concurrency model (WAL mode):

* one *writer* connection; every write is a short synchronous body that runs on the writer's thread
  inside ``BEGIN IMMEDIATE ... COMMIT``. Writes that arrive while the writer is busy are committed
  together (group commit): each in its own SAVEPOINT, so one that fails is rolled back alone, and the
  batch costs one round trip to the thread and one WAL commit instead of one per write;
* one separate *reader* connection for session, history, context and trace reads; each read runs in its own
  read transaction, so it sees one consistent snapshot and never blocks (or waits for) a write.

The schema is versioned: ``MIGRATIONS`` is an ordered list of forward steps and ``PRAGMA user_version``
records how many have been applied. Opening a database applies only the missing steps, each in its own
transaction.

Every sqlite failure leaving a public method is a ``StoreError`` whose message names the operation and the
sqlite error, never message content. ``StaleStateError`` from ``commit_turn`` passes through unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import pathlib
import sqlite3
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast, get_args

import aiosqlite
from pydantic import TypeAdapter, ValidationError

from core.messages import AttachmentRef, ChatMessage, MessageSource, NewMessage, Role, SourceKind, ToolCall
from core.store import (
    DEFAULT_TITLE,
    AttachmentRecord,
    CommitResult,
    SessionRecord,
    StaleStateError,
    StoreError,
    TraceRecord,
    TurnRecord,
    TurnState,
    UnknownMessageError,
)

T = TypeVar("T")
BUSY_TIMEOUT_MS = 5000
PURGE_INTERVAL_SECONDS = 60.0
"""Expired dedupe rows are deleted at most this often (expired rows are re-admitted regardless)."""

# --------------------------------------------------------------------------------------------- schema

Migration = tuple[str, ...]

MIGRATIONS: tuple[Migration, ...] = (
    # 1: sessions, messages, inbound dedupe
    (
        """
        CREATE TABLE sessions (
            key               TEXT PRIMARY KEY,
            title             TEXT NOT NULL,
            title_is_default  INTEGER NOT NULL DEFAULT 1,
            generation        INTEGER NOT NULL DEFAULT 0,
            state_version     INTEGER NOT NULL DEFAULT 0,
            history_revision  INTEGER NOT NULL DEFAULT 0,
            revision_seq      INTEGER NOT NULL DEFAULT 0,
            context_start_seq INTEGER NOT NULL DEFAULT 0,
            next_seq          INTEGER NOT NULL DEFAULT 1,
            created_at        REAL NOT NULL,
            updated_at        REAL NOT NULL
        )
        """,
        """
        CREATE TABLE messages (
            id           TEXT PRIMARY KEY,
            session_key  TEXT NOT NULL REFERENCES sessions (key) ON DELETE CASCADE,
            seq          INTEGER NOT NULL,
            role         TEXT NOT NULL,
            content      TEXT NOT NULL,
            tool_calls   TEXT NOT NULL DEFAULT '[]',
            tool_call_id TEXT,
            source       TEXT NOT NULL,
            received_at  REAL NOT NULL,
            created_at   REAL NOT NULL,
            UNIQUE (session_key, seq)
        )
        """,
        """
        CREATE TABLE processed_events (
            channel    TEXT NOT NULL,
            event_id   TEXT NOT NULL,
            expires_at REAL NOT NULL,
            PRIMARY KEY (channel, event_id)
        ) WITHOUT ROWID
        """,
        "CREATE INDEX processed_events_expires_at ON processed_events (expires_at)",
    ),
    # 2: turn ledger and traces
    (
        """
        CREATE TABLE turns (
            turn_id     TEXT PRIMARY KEY,
            session_key TEXT NOT NULL,
            state       TEXT NOT NULL,
            target_json TEXT NOT NULL,
            started_at  REAL NOT NULL,
            ended_at    REAL
        )
        """,
        "CREATE INDEX turns_running ON turns (started_at) WHERE state = 'running'",
        """
        CREATE TABLE traces (
            session_key TEXT NOT NULL,
            turn_id     TEXT NOT NULL,
            seq         INTEGER NOT NULL,
            kind        TEXT NOT NULL,
            payload     TEXT NOT NULL,
            created_at  REAL NOT NULL,
            PRIMARY KEY (session_key, seq)
        )
        """,
    ),
    # 3: small durable values a channel keeps across restarts (e.g. a long-polling offset)
    (
        """
        CREATE TABLE channel_state (
            channel    TEXT NOT NULL,
            name       TEXT NOT NULL,
            value      TEXT NOT NULL,
            updated_at REAL NOT NULL,
            PRIMARY KEY (channel, name)
        ) WITHOUT ROWID
        """,
    ),
    # 4: stored attachment files (core.media): the file is <data_dir>/media/<id>; messages keep references
    (
        """
        CREATE TABLE attachments (
            id           TEXT PRIMARY KEY,
            session_key  TEXT NOT NULL,
            kind         TEXT NOT NULL,
            name         TEXT NOT NULL,
            content_type TEXT NOT NULL,
            size         INTEGER NOT NULL,
            created_at   REAL NOT NULL,
            claimed      INTEGER NOT NULL DEFAULT 1
        )
        """,
        "CREATE INDEX attachments_created_at ON attachments (created_at)",
        "CREATE INDEX attachments_unclaimed ON attachments (session_key) WHERE claimed = 0",
    ),
)


async def schema_version(conn: aiosqlite.Connection) -> int:
    rows = list(await conn.execute_fetchall("PRAGMA user_version"))
    return int(rows[0][0])


async def migrate(conn: aiosqlite.Connection, *, target: int | None = None) -> int:
    """Apply the missing ``MIGRATIONS`` steps up to ``target`` (default: all); returns the schema version.

    ``conn`` must be in autocommit mode (``isolation_level=None``). Each step runs in its own
    ``BEGIN IMMEDIATE`` transaction and re-checks the version inside it, so concurrent openers are safe.
    """
    goal = len(MIGRATIONS) if target is None else target
    version = await schema_version(conn)
    if version > len(MIGRATIONS):
        raise StoreError(f"database schema version {version} is newer than this code ({len(MIGRATIONS)})")
    while version < goal:
        await conn.execute("BEGIN IMMEDIATE")
        try:
            version = await schema_version(conn)
            if version < goal:
                for statement in MIGRATIONS[version]:
                    await conn.execute(statement)
                version += 1
                await conn.execute(f"PRAGMA user_version = {version}")
            await conn.execute("COMMIT")
        except BaseException:
            await _rollback_quietly(conn)
            raise
    return version


# --------------------------------------------------------------------------------------------- rows

_TOOL_CALLS: TypeAdapter[tuple[ToolCall, ...]] = TypeAdapter(tuple[ToolCall, ...])

_SESSION_COLUMNS = (
    "key, title, title_is_default, generation, state_version, history_revision, revision_seq,"
    " context_start_seq, next_seq, created_at, updated_at"
)
_MESSAGE_COLUMNS = (
    "id, session_key, seq, role, content, tool_calls, tool_call_id, source, received_at, created_at"
)
_M_MESSAGE_COLUMNS = ", ".join(f"m.{c.strip()}" for c in _MESSAGE_COLUMNS.split(","))
_ATTACHMENT_COLUMNS = "id, session_key, kind, name, content_type, size, created_at, claimed"
_TURN_COLUMNS = "turn_id, session_key, state, target_json, started_at, ended_at"
_TRACE_COLUMNS = "session_key, turn_id, seq, kind, payload, created_at"


def _session_from_row(row: sqlite3.Row, **changes: Any) -> SessionRecord:
    # Rows were validated on the way in (see _message_from_row); ``changes`` are values the caller just wrote.
    fields = dict(
        key=row["key"],
        title=row["title"],
        title_is_default=bool(row["title_is_default"]),
        generation=row["generation"],
        state_version=row["state_version"],
        history_revision=row["history_revision"],
        revision_seq=row["revision_seq"],
        context_start_seq=row["context_start_seq"],
        created_at=row["created_at"],
        updated_at=row["updated_at"],
    )
    fields.update(changes)
    return SessionRecord.model_construct(**fields)


_SOURCE_KINDS = frozenset(get_args(SourceKind))
_ROLES = frozenset(get_args(Role))


def _message_from_row(row: sqlite3.Row) -> ChatMessage:
    # Rows were validated on the way in; rebuilding them without re-validation keeps context loads cheap
    # (a turn reads up to history_limit rows). A row that is not what we wrote fails loudly below.
    try:
        source = json.loads(row["source"])
        if source["kind"] not in _SOURCE_KINDS or row["role"] not in _ROLES:
            raise ValueError("unknown kind or role")
        calls = json.loads(row["tool_calls"]) if row["tool_calls"] not in (None, "[]") else ()
        return ChatMessage.model_construct(
            id=row["id"],
            session_key=row["session_key"],
            seq=row["seq"],
            role=row["role"],
            content=row["content"],
            tool_calls=tuple(ToolCall.model_construct(**c) for c in calls),
            tool_call_id=row["tool_call_id"],
            source=_source(source),
            received_at=row["received_at"],
            created_at=row["created_at"],
        )
    except (TypeError, ValueError, KeyError) as exc:
        raise StoreError(f"sqlite store: read a malformed message row ({type(exc).__name__})") from None


_ATTACHMENTS: TypeAdapter[tuple[AttachmentRef, ...]] = TypeAdapter(tuple[AttachmentRef, ...])


def _source(fields: dict[str, Any]) -> MessageSource:
    """A stored source; its attachment references (few messages have any) are rebuilt as models."""
    refs = fields.get("attachments")
    if refs:
        fields["attachments"] = _ATTACHMENTS.validate_python(refs)
    elif refs is not None:
        fields["attachments"] = ()
    return MessageSource.model_construct(**fields)


def _message_params(message: ChatMessage) -> tuple[Any, ...]:
    return (
        message.id,
        message.session_key,
        message.seq,
        message.role,
        message.content,
        _TOOL_CALLS.dump_json(message.tool_calls).decode(),
        message.tool_call_id,
        message.source.model_dump_json(),
        message.received_at,
        message.created_at,
    )


def _turn_from_row(row: sqlite3.Row) -> TurnRecord:
    return TurnRecord(
        turn_id=row["turn_id"],
        session_key=row["session_key"],
        state=row["state"],
        target_json=row["target_json"],
        started_at=row["started_at"],
        ended_at=row["ended_at"],
    )


def _trace_from_row(row: sqlite3.Row) -> TraceRecord:
    return TraceRecord(
        session_key=row["session_key"],
        turn_id=row["turn_id"],
        seq=row["seq"],
        kind=row["kind"],
        payload=json.loads(row["payload"]),
        created_at=row["created_at"],
    )


# --------------------------------------------------------------------------------------------- errors


@contextlib.contextmanager
def _store_errors(op: str) -> Iterator[None]:
    """Translate sqlite/aiosqlite failures into StoreError; messages never carry stored content."""
    try:
        yield
    except StoreError:
        raise
    except sqlite3.Error as exc:  # aiosqlite re-exports sqlite3's exception classes
        raise StoreError(f"sqlite store: {op} failed ({type(exc).__name__}: {exc})") from exc
    except ValidationError:
        # The validation error would quote the offending row; keep it out of the message and the chain.
        raise StoreError(f"sqlite store: {op} read a malformed row") from None
    except OSError as exc:  # creating the database directory
        raise StoreError(f"sqlite store: {op} failed ({type(exc).__name__}: {exc})") from exc
    except (UnicodeEncodeError, UnicodeDecodeError) as exc:
        # A ValueError too, but not a connection problem: text that cannot be encoded (an unpaired
        # surrogate). Only the reason is kept: the error's own text quotes the offending character.
        raise StoreError(f"sqlite store: {op} failed (text that cannot be encoded: {exc.reason})") from None
    except ValueError as exc:  # aiosqlite: "Connection closed" / "no active connection"
        raise StoreError(f"sqlite store: {op} failed (connection unavailable)") from exc


@dataclass(slots=True, eq=False)
class _Write(Generic[T]):
    body: Callable[[sqlite3.Connection], T]
    future: asyncio.Future[T]


def _run_batch(conn: sqlite3.Connection, batch: list[_Write[Any]]) -> None:
    """Runs on aiosqlite's thread: one BEGIN IMMEDIATE ... COMMIT around every write of ``batch``, each in
    its own SAVEPOINT (a failing write is rolled back alone). Results are released only after COMMIT; if
    BEGIN or COMMIT fails, every write of the batch gets that error. Never raises."""
    # aiosqlite's thread keeps its last call (and so this list) until the next one: empty the list, so an
    # idle store does not keep the last batch's writes and results alive
    batch, handed_over = list(batch), batch
    handed_over.clear()
    outcomes: list[tuple[bool, Any]] = []
    try:
        if conn.in_transaction:  # left open by an earlier failure: heal it
            conn.execute("ROLLBACK")
        conn.execute("BEGIN IMMEDIATE")
        try:
            for item in batch:
                conn.execute("SAVEPOINT write")
                try:
                    outcomes.append((True, item.body(conn)))
                except Exception as exc:
                    conn.execute("ROLLBACK TO write")
                    outcomes.append((False, exc))
                conn.execute("RELEASE write")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
    except Exception as exc:
        outcomes = [(False, exc)] * len(batch)
    if batch:
        batch[0].future.get_loop().call_soon_threadsafe(_settle, batch, outcomes)


def _settle(batch: list[_Write[Any]], outcomes: list[tuple[bool, Any]]) -> None:
    for item, (ok, value) in zip(batch, outcomes, strict=True):
        if item.future.done():  # its caller was cancelled
            continue
        if ok:
            item.future.set_result(value)
        else:
            item.future.set_exception(value)


def _discard_outcome(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()  # retrieved, so asyncio does not report it as lost


def _settle_all(batch: list[_Write[Any]], exc: Exception) -> None:
    _settle(batch, [(False, exc)] * len(batch))


async def _rollback_quietly(conn: aiosqlite.Connection) -> None:
    with contextlib.suppress(sqlite3.Error, ValueError):
        if conn.in_transaction:
            await conn.execute("ROLLBACK")


# --------------------------------------------------------------------------------------------- store


class SqliteStore:
    """``Store`` on one SQLite file (see the module docstring for the connection model)."""

    def __init__(self, path: str | pathlib.Path, *, clock: Callable[[], float] = time.time) -> None:
        self._path = pathlib.Path(path)
        self._clock = clock
        self._writer: aiosqlite.Connection | None = None
        self._reader: aiosqlite.Connection | None = None
        self._write_lock = asyncio.Lock()
        self._queued: list[_Write[Any]] = []
        self._read_lock = asyncio.Lock()
        self._next_purge_at = 0.0

    # -- lifecycle

    async def open(self) -> None:
        if self._writer is not None:
            return
        with _store_errors("open"):
            self._path.parent.mkdir(parents=True, exist_ok=True)
            try:
                writer = self._writer = await self._connect()
                await writer.execute("PRAGMA journal_mode = WAL")
                await writer.execute("PRAGMA synchronous = NORMAL")
                await migrate(writer)
                reader = self._reader = await self._connect()
                await reader.execute("PRAGMA query_only = ON")
            except BaseException:
                await self._close_connections()
                raise

    async def close(self) -> None:
        async with self._write_lock, self._read_lock:
            await self._close_connections()

    async def _connect(self) -> aiosqlite.Connection:
        conn = await aiosqlite.connect(self._path, isolation_level=None)
        conn.row_factory = sqlite3.Row
        await conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        await conn.execute("PRAGMA foreign_keys = ON")
        return conn

    async def _close_connections(self) -> None:
        for conn in (self._reader, self._writer):
            if conn is not None:
                with contextlib.suppress(sqlite3.Error, ValueError):
                    await conn.close()
        self._reader = self._writer = None

    async def _transaction(self, op: str, body: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``body`` as one write (its own SAVEPOINT) in the next group commit on the writer's thread.

        aiosqlite runs every statement as its own round trip to its thread, and those round trips were
        most of a turn's CPU cost (tests/bench/core_overhead.py). aiosqlite has no public way to run a
        callable on its thread, so this uses its internal ``_execute`` (pinned in pyproject.toml); the
        statements are plain sqlite3. Whoever holds the writer lock commits everything queued by then."""
        loop = asyncio.get_running_loop()
        item: _Write[Any] = _Write(body, loop.create_future())
        self._queued.append(item)
        try:
            with _store_errors(op):
                async with self._write_lock:
                    if not item.future.done():
                        batch, self._queued = self._queued, []
                        await self._commit_batch(batch)
                return cast(T, await item.future)
        except asyncio.CancelledError:
            if item in self._queued:  # not started: it never happens
                self._queued.remove(item)
            elif not item.future.done():  # already on the thread: it lands; nobody reads the outcome
                item.future.add_done_callback(_discard_outcome)
            raise

    async def _commit_batch(self, batch: list[_Write[Any]]) -> None:
        """Hands ``batch`` to the writer's thread, which settles every future itself: a waiter gets its
        result even if this (leading) caller is cancelled meanwhile."""
        conn = self._writer
        if conn is None:
            _settle_all(batch, StoreError("sqlite store: write called while the store is closed"))
            return
        try:
            await conn._execute(_run_batch, conn._conn, batch)  # type: ignore[no-untyped-call]
        except ValueError as exc:  # aiosqlite: the connection closed under us
            _settle_all(batch, exc)

    @contextlib.asynccontextmanager
    async def _read(self, op: str, *, snapshot: bool = True) -> AsyncIterator[aiosqlite.Connection]:
        """One read transaction (a consistent snapshot) on the reader connection; never blocks writes.

        ``snapshot=False`` is for a single statement, which SQLite already runs as one consistent read;
        it saves the BEGIN/ROLLBACK round trips on the hot path."""
        with _store_errors(op):
            async with self._read_lock:
                conn = self._reader
                if conn is None:
                    raise StoreError(f"sqlite store: {op} called while the store is closed")
                await _rollback_quietly(conn)
                if not snapshot:
                    yield conn
                    return
                await conn.execute("BEGIN")
                try:
                    yield conn
                finally:
                    await _rollback_quietly(conn)  # a read transaction has nothing to commit

    # -- sessions

    async def get_or_create_session(self, key: str, *, default_title: str = DEFAULT_TITLE) -> SessionRecord:
        existing = await self.get_session(key)
        if existing is not None:
            return existing
        def body(conn: sqlite3.Connection) -> SessionRecord:
            return _session_from_row(self._ensure_session_sync(conn, key, default_title=default_title))

        return await self._transaction("get_or_create_session", body)

    async def get_session(self, key: str) -> SessionRecord | None:
        async with self._read("get_session") as conn:
            row = await _session_row(conn, key)
        return None if row is None else _session_from_row(row)

    async def list_sessions(self, *, prefix: str | None = None, limit: int = 200) -> list[SessionRecord]:
        """Sessions by most recent update first, optionally only keys starting with ``prefix``."""
        async with self._read("list_sessions") as conn:
            if prefix is None:
                rows = await conn.execute_fetchall(
                    f"SELECT {_SESSION_COLUMNS} FROM sessions ORDER BY updated_at DESC, key LIMIT ?",
                    (max(limit, 0),),
                )
            else:
                rows = await conn.execute_fetchall(
                    f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE substr(key, 1, ?) = ?"
                    " ORDER BY updated_at DESC, key LIMIT ?",
                    (len(prefix), prefix, max(limit, 0)),
                )
            return [_session_from_row(row) for row in rows]

    async def bump_generation(self, key: str) -> int:
        def body(conn: sqlite3.Connection) -> int:
            generation = int(self._ensure_session_sync(conn, key)["generation"]) + 1
            conn.execute(
                "UPDATE sessions SET generation = ?, updated_at = ? WHERE key = ?",
                (generation, self._clock(), key),
            )
            return generation

        return await self._transaction("bump_generation", body)

    async def new_context(self, key: str) -> SessionRecord:
        """Start a fresh model context: older messages stay in history; generation and state_version bump."""
        def body(conn: sqlite3.Connection) -> SessionRecord:
            self._ensure_session_sync(conn, key)
            conn.execute(
                "UPDATE sessions SET context_start_seq = next_seq - 1, generation = generation + 1,"
                " state_version = state_version + 1, updated_at = ? WHERE key = ?",
                (self._clock(), key),
            )
            return _session_from_row(self._ensure_session_sync(conn, key))

        return await self._transaction("new_context", body)

    async def rename(self, key: str, title: str) -> None:
        """A user rename: sets the title and clears title_is_default, so a late automatic title loses."""
        def body(conn: sqlite3.Connection) -> None:
            self._ensure_session_sync(conn, key)
            conn.execute(
                "UPDATE sessions SET title = ?, title_is_default = 0, updated_at = ? WHERE key = ?",
                (title, self._clock(), key),
            )

        await self._transaction("rename", body)

    async def set_title_if_default(self, key: str, title: str, *, expect_generation: int) -> bool:
        """An automatic title: written only while no user rename happened and the generation still matches.

        ``title_is_default`` stays set, so a later automatic title may replace this one; a rename clears it.
        """
        def body(conn: sqlite3.Connection) -> bool:
            cursor = conn.execute(
                "UPDATE sessions SET title = ?, updated_at = ?"
                " WHERE key = ? AND title_is_default = 1 AND generation = ?",
                (title, self._clock(), key, expect_generation),
            )
            return cursor.rowcount == 1

        return await self._transaction("set_title_if_default", body)

    # -- messages

    async def append_message(
        self, key: str, message: NewMessage, *, begin_turn: tuple[str, str] | None = None
    ) -> tuple[ChatMessage, SessionRecord]:
        """Persist one message (state_version +1, no revision bump); returns it and the session after it.

        ``begin_turn=(turn_id, target_json)`` records a running turn in the same transaction."""

        def body(conn: sqlite3.Connection) -> tuple[ChatMessage, SessionRecord]:
            row = self._ensure_session_sync(conn, key)
            (persisted,) = self._insert_messages_sync(conn, row, [message])
            state_version = int(row["state_version"]) + 1
            conn.execute(
                "UPDATE sessions SET next_seq = ?, state_version = ?, updated_at = ? WHERE key = ?",
                (persisted.seq + 1, state_version, persisted.created_at, key),
            )
            if begin_turn is not None:
                conn.execute(
                    f"INSERT INTO turns ({_TURN_COLUMNS}) VALUES (?, ?, 'running', ?, ?, NULL)",
                    (begin_turn[0], key, begin_turn[1], self._clock()),
                )
            record = _session_from_row(row, state_version=state_version, updated_at=persisted.created_at)
            return persisted, record

        return await self._transaction("append_message", body)

    async def commit_turn(
        self,
        key: str,
        messages: Sequence[NewMessage],
        *,
        expect_generation: int | None,
        expect_state_version: int | None,
        end_turn: tuple[str, TurnState] | None = None,
        trace: tuple[str, Sequence[tuple[str, dict[str, Any]]]] | None = None,
    ) -> CommitResult:
        """Atomically check the expectations, insert ``messages`` and raise history_revision by one
        (with ``end_turn`` and ``trace``, see ``Store.commit_turn``).

        Raises StaleStateError (and writes nothing) when an expectation fails. The result carries every
        message with seq above the previous revision (including messages appended since), so consecutive
        revisions are contiguous deltas covering each message exactly once.
        """

        trace_rows = _trace_rows(key, trace[0], trace[1], self._clock()) if trace is not None else []

        def body(conn: sqlite3.Connection) -> CommitResult:
            row = self._ensure_session_sync(conn, key)
            if expect_generation is not None and expect_generation != row["generation"]:
                raise StaleStateError(f"session generation is {row['generation']}, expected {expect_generation}")
            if expect_state_version is not None and expect_state_version != row["state_version"]:
                raise StaleStateError(
                    f"session state_version is {row['state_version']}, expected {expect_state_version}"
                )
            inserted = self._insert_messages_sync(conn, row, messages)
            next_seq = int(row["next_seq"]) + len(inserted)
            revision = int(row["history_revision"]) + 1
            conn.execute(
                "UPDATE sessions SET next_seq = ?, state_version = state_version + ?, history_revision = ?,"
                " revision_seq = ?, updated_at = ? WHERE key = ?",
                (next_seq, 1 if inserted else 0, revision, next_seq - 1, self._clock(), key),
            )
            # the delta: messages appended since the last revision (read back), then the ones inserted here
            rows = conn.execute(
                f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE session_key = ? AND seq > ? AND seq < ?"
                " ORDER BY seq",
                (key, row["revision_seq"], row["next_seq"]),
            ).fetchall()
            if end_turn is not None:
                ended_at = None if end_turn[1] == "running" else self._clock()
                conn.execute(
                    "UPDATE turns SET state = ?, ended_at = ? WHERE turn_id = ? AND state = 'running'",
                    (end_turn[1], ended_at, end_turn[0]),
                )
            _insert_traces_sync(conn, trace_rows)
            delta = (*(_message_from_row(r) for r in rows), *inserted)
            state_version = int(row["state_version"]) + (1 if inserted else 0)
            return CommitResult.model_construct(session_key=key, history_revision=revision, messages=delta,
                                                state_version=state_version, inserted=len(inserted))

        return await self._transaction("commit_turn", body)

    def _ensure_session_sync(self, conn: sqlite3.Connection, key: str, *,
                             default_title: str = DEFAULT_TITLE) -> sqlite3.Row:
        sql = f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE key = ?"
        row: sqlite3.Row | None = conn.execute(sql, (key,)).fetchone()
        if row is None:
            now = self._clock()
            conn.execute(
                "INSERT INTO sessions (key, title, title_is_default, created_at, updated_at) VALUES (?, ?, 1, ?, ?)",
                (key, default_title, now, now),
            )
            row = conn.execute(sql, (key,)).fetchone()
            assert row is not None  # inserted above, inside the same write transaction
        return row

    def _insert_messages_sync(
        self, conn: sqlite3.Connection, session: sqlite3.Row, messages: Sequence[NewMessage]
    ) -> list[ChatMessage]:
        persisted = self._new_rows(session, messages)
        if persisted:
            conn.executemany(
                f"INSERT INTO messages ({_MESSAGE_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [_message_params(m) for m in persisted],
            )
        return persisted

    def _new_rows(self, session: sqlite3.Row, messages: Sequence[NewMessage]) -> list[ChatMessage]:
        now = self._clock()
        first_seq = int(session["next_seq"])
        # the NewMessages are validated already; the rest is generated here
        return [
            ChatMessage.model_construct(
                id=uuid.uuid4().hex,
                session_key=session["key"],
                seq=first_seq + offset,
                role=message.role,
                content=message.content,
                source=message.source,
                tool_calls=message.tool_calls,
                tool_call_id=message.tool_call_id,
                received_at=message.received_at,
                created_at=now,
            )
            for offset, message in enumerate(messages)
        ]

    async def history(self, key: str, *, limit: int = 1000,
                      before: str | None = None) -> tuple[int, list[ChatMessage]]:
        """(history_revision, the newest ``limit`` messages in seq order — older than message ``before``
        when given), consistent with each other.

        Messages appended after the last commit may be included; the revision counts commits only. Raises
        UnknownMessageError when ``before`` is not a message of this session.
        """
        async with self._read("history") as conn:
            session = await _session_row(conn, key)
            below: int | None = None
            if before is not None:
                found = list(await conn.execute_fetchall(
                    "SELECT seq FROM messages WHERE id = ? AND session_key = ?", (before, key)))
                if not found:
                    raise UnknownMessageError("no such message in this conversation")
                below = int(found[0][0])
            if session is None:
                return 0, []
            if below is None:
                rows = await conn.execute_fetchall(
                    f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE session_key = ? ORDER BY seq DESC LIMIT ?",
                    (key, max(limit, 0)),
                )
            else:
                rows = await conn.execute_fetchall(
                    f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE session_key = ? AND seq < ?"
                    " ORDER BY seq DESC LIMIT ?",
                    (key, below, max(limit, 0)),
                )
            messages = [_message_from_row(r) for r in reversed(list(rows))]
            return int(session["history_revision"]), messages

    async def context_messages(self, key: str, *, limit: int) -> tuple[int, list[ChatMessage]]:
        """(state_version, the newest ``limit`` messages after the session's context start, in seq order),
        read by one statement, so the two are consistent."""
        async with self._read("context_messages", snapshot=False) as conn:
            rows = list(await conn.execute_fetchall(
                f"SELECT s.state_version AS state_version, {_M_MESSAGE_COLUMNS} FROM sessions AS s"
                " LEFT JOIN (SELECT * FROM messages WHERE session_key = ?"
                " AND seq > (SELECT context_start_seq FROM sessions WHERE key = ?)"
                " ORDER BY seq DESC LIMIT ?) AS m ON m.session_key = s.key"
                " WHERE s.key = ? ORDER BY m.seq",
                (key, key, max(limit, 0), key),
            ))
            if not rows:
                return 0, []
            version = int(rows[0]["state_version"])
            return version, [_message_from_row(r) for r in rows if r["id"] is not None]

    # -- inbound dedupe

    async def mark_event_processed(self, channel: str, event_id: str, *, ttl_seconds: float) -> bool:
        """True if this event is new (and is now recorded); False if it was seen within its TTL.

        An existing row whose TTL has run out counts as new and is refreshed.
        """
        now = self._clock()
        purge = now >= self._next_purge_at
        if purge:
            self._next_purge_at = now + PURGE_INTERVAL_SECONDS

        def body(conn: sqlite3.Connection) -> bool:
            if purge:
                conn.execute("DELETE FROM processed_events WHERE expires_at <= ?", (now,))
            cursor = conn.execute(
                "INSERT INTO processed_events (channel, event_id, expires_at) VALUES (?, ?, ?)"
                " ON CONFLICT (channel, event_id) DO UPDATE SET expires_at = excluded.expires_at"
                " WHERE processed_events.expires_at <= ?",
                (channel, event_id, now + ttl_seconds, now),
            )
            return cursor.rowcount == 1

        return await self._transaction("mark_event_processed", body)

    # -- turns

    async def begin_turn(self, turn_id: str, key: str, target_json: str) -> None:
        await self._transaction("begin_turn", lambda conn: self._insert_turn(conn, turn_id, key, target_json))

    async def end_turn(self, turn_id: str, state: TurnState) -> None:
        """Record a running turn's final state; a turn that already ended keeps its first final state."""
        await self._transaction("end_turn", lambda conn: self._update_turn(conn, turn_id, state))

    def _insert_turn(self, conn: sqlite3.Connection, turn_id: str, key: str, target_json: str) -> None:
        conn.execute(
            f"INSERT INTO turns ({_TURN_COLUMNS}) VALUES (?, ?, 'running', ?, ?, NULL)",
            (turn_id, key, target_json, self._clock()),
        )

    def _update_turn(self, conn: sqlite3.Connection, turn_id: str, state: TurnState) -> None:
        ended_at = None if state == "running" else self._clock()
        conn.execute(
            "UPDATE turns SET state = ?, ended_at = ? WHERE turn_id = ? AND state = 'running'",
            (state, ended_at, turn_id),
        )

    async def close_interrupted_turns(self) -> list[TurnRecord]:
        """Mark every turn still 'running' as 'interrupted' and return them (called once at start-up)."""
        now = self._clock()

        def body(conn: sqlite3.Connection) -> list[TurnRecord]:
            rows = conn.execute(
                f"SELECT {_TURN_COLUMNS} FROM turns WHERE state = 'running' ORDER BY started_at, turn_id"
            ).fetchall()
            conn.execute("UPDATE turns SET state = 'interrupted', ended_at = ? WHERE state = 'running'", (now,))
            return [_turn_from_row(r) for r in rows]

        running = await self._transaction("close_interrupted_turns", body)
        return [turn.model_copy(update={"state": "interrupted", "ended_at": now}) for turn in running]

    # -- attachments

    async def add_attachment(self, record: AttachmentRecord) -> None:
        def body(conn: sqlite3.Connection) -> None:
            conn.execute(
                f"INSERT INTO attachments ({_ATTACHMENT_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (record.id, record.session_key, record.kind, record.name, record.content_type, record.size,
                 record.created_at, int(record.claimed)))

        await self._transaction("add_attachment", body)

    async def get_attachment(self, attachment_id: str) -> AttachmentRecord | None:
        async with self._read("get_attachment") as conn:
            rows = list(await conn.execute_fetchall(
                f"SELECT {_ATTACHMENT_COLUMNS} FROM attachments WHERE id = ?", (attachment_id,)))
        if not rows:
            return None
        row = rows[0]
        return AttachmentRecord(id=row["id"], session_key=row["session_key"], kind=row["kind"], name=row["name"],
                                content_type=row["content_type"], size=row["size"], created_at=row["created_at"],
                                claimed=bool(row["claimed"]))

    async def claim_attachments(self, ids: Sequence[str]) -> None:
        if not ids:
            return

        def body(conn: sqlite3.Connection) -> None:
            conn.executemany("UPDATE attachments SET claimed = 1 WHERE id = ?", [(i,) for i in ids])

        await self._transaction("claim_attachments", body)

    async def drop_unclaimed_attachments(self, key: str) -> list[str]:
        def body(conn: sqlite3.Connection) -> list[str]:
            rows = conn.execute("DELETE FROM attachments WHERE session_key = ? AND claimed = 0 RETURNING id",
                                (key,)).fetchall()
            return [str(r[0]) for r in rows]

        return await self._transaction("drop_unclaimed_attachments", body)

    async def drop_expired_attachments(self, before: float) -> list[str]:
        def body(conn: sqlite3.Connection) -> list[str]:
            rows = conn.execute("DELETE FROM attachments WHERE created_at < ? RETURNING id", (before,)).fetchall()
            return [str(r[0]) for r in rows]

        return await self._transaction("drop_expired_attachments", body)

    # -- channel state

    async def get_channel_state(self, channel: str, name: str) -> str | None:
        async with self._read("get_channel_state", snapshot=False) as conn:
            rows = list(
                await conn.execute_fetchall(
                    "SELECT value FROM channel_state WHERE channel = ? AND name = ?", (channel, name)
                )
            )
        return str(rows[0][0]) if rows else None

    async def set_channel_state(self, channel: str, name: str, value: str) -> None:
        def body(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO channel_state (channel, name, value, updated_at) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (channel, name) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
                (channel, name, value, self._clock()),
            )

        await self._transaction("set_channel_state", body)

    # -- traces

    async def append_trace(self, key: str, turn_id: str, kind: str, payload: dict[str, Any]) -> None:
        """Append one trace record; values JSON cannot encode are stored as their ``str()``."""
        await self.append_traces(key, turn_id, [(kind, payload)])

    async def append_traces(self, key: str, turn_id: str, records: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Append several trace records in one transaction, in order."""
        if not records:
            return
        rows = _trace_rows(key, turn_id, records, self._clock())
        await self._transaction("append_traces", lambda conn: _insert_traces_sync(conn, rows))

    async def traces(self, key: str, *, limit: int = 1000) -> list[TraceRecord]:
        """The newest ``limit`` trace records of a session, oldest first."""
        async with self._read("traces") as conn:
            rows = await conn.execute_fetchall(
                f"SELECT {_TRACE_COLUMNS} FROM traces WHERE session_key = ? ORDER BY seq DESC LIMIT ?",
                (key, max(limit, 0)),
            )
            return [_trace_from_row(r) for r in reversed(list(rows))]


_TRACE_JSON = json.JSONEncoder(default=str, ensure_ascii=False).encode
"""One encoder for every trace payload (``json.dumps`` with options builds a new encoder per call)."""


def _trace_rows(key: str, turn_id: str, records: Sequence[tuple[str, dict[str, Any]]],
                now: float) -> list[tuple[Any, ...]]:
    """Trace rows, serialised on the caller's side; values JSON cannot encode are stored as ``str()``."""
    return [(key, turn_id, kind, _trace_json(payload), now, key) for kind, payload in records]


def _trace_json(payload: dict[str, Any]) -> str:
    try:
        return _TRACE_JSON(payload)
    except (TypeError, ValueError, RecursionError):  # e.g. a circular structure: the record stays, marked
        return _TRACE_JSON({"unencodable_payload": True})


def _insert_traces_sync(conn: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
    # each row takes the next seq of its session (the rows before it in this batch included)
    if rows:
        conn.executemany(
            f"INSERT INTO traces ({_TRACE_COLUMNS})"
            " SELECT ?, ?, COALESCE(MAX(seq), 0) + 1, ?, ?, ? FROM traces WHERE session_key = ?",
            rows,
        )


async def _session_row(conn: aiosqlite.Connection, key: str) -> sqlite3.Row | None:
    rows = list(await conn.execute_fetchall(f"SELECT {_SESSION_COLUMNS} FROM sessions WHERE key = ?", (key,)))
    return rows[0] if rows else None
