"""The SQLite Store: the default durable backend of chatbridge.

One database file in WAL mode, two aiosqlite connections, each with its own thread:

* the *writer* (``core.sqlite.writer``): every write is one SQL statement (``core.sqlite.writes``) in
  autocommit mode, so each is atomic on its own; writes made while one is under way are merged into one
  statement (group commit), so a busy store pays a round trip to the thread and a WAL commit per batch;
* the *reader*: every read is one statement too, which SQLite runs against one consistent snapshot, so a
  read needs no transaction, never blocks a write and never waits for one.

Schema and migrations: ``core.sqlite.schema``; rows to records: ``core.sqlite.rows``. Every sqlite failure
leaving a public method is a ``StoreError`` whose message names the operation and the sqlite error, never
message content; ``StaleStateError`` and ``TurnEndedError`` from ``commit_turn`` pass through unchanged.
"""

from __future__ import annotations

import json
import math
import pathlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, cast

import aiosqlite

from core.messages import ChatMessage, NewMessage
from core.sqlite import rows, writes
from core.sqlite.errors import store_errors
from core.sqlite.rows import MESSAGE_SELECT, SESSION_SELECT
from core.sqlite.schema import check_sqlite_version, migrate
from core.sqlite.writer import Params, Row, Writer
from core.sqlite.writes import Admission, SessionWrite
from core.store import (
    DEFAULT_TITLE,
    AttachmentRecord,
    CommitResult,
    InboundRecord,
    InboundServedError,
    SessionRecord,
    StaleStateError,
    StoreError,
    TurnEndedError,
    TurnRecord,
    TurnState,
    UndeliveredTurn,
    UnknownMessageError,
)
from core.store_rows import MESSAGE_COLUMNS, SESSION_COLUMNS

BUSY_TIMEOUT_MS = 5000


class SqliteStore:
    """``Store`` on one SQLite file (see the module docstring for the connection model)."""

    def __init__(self, path: str | pathlib.Path, *, clock: Callable[[], float] = time.time) -> None:
        self._path = pathlib.Path(path)
        self._clock = clock
        self._writer: Writer | None = None
        self._reader: aiosqlite.Connection | None = None

    # -- lifecycle

    async def open(self) -> None:
        if self._writer is not None:
            return
        with store_errors("open"):
            check_sqlite_version()
            self._path.parent.mkdir(parents=True, exist_ok=True)
            writer: aiosqlite.Connection | None = None
            reader: aiosqlite.Connection | None = None
            try:
                writer = await self._connect()
                await writer.execute("PRAGMA journal_mode = WAL")
                await writer.execute("PRAGMA synchronous = NORMAL")
                await migrate(writer)
                await writer.executescript(writes.INSTALL)
                reader = await self._connect()
                await reader.execute("PRAGMA query_only = ON")
            except BaseException:
                for conn in (reader, writer):
                    if conn is not None:
                        await conn.close()
                raise
            self._writer, self._reader = Writer(writer), reader

    async def close(self) -> None:
        """Writes and reads already made complete first; any made after this began fail as closed."""
        writer, reader, self._writer, self._reader = self._writer, self._reader, None, None
        with store_errors("close"):
            if reader is not None:
                await reader.close()
            if writer is not None:
                await writer.close()

    async def _connect(self) -> aiosqlite.Connection:
        # a merged write has one statement shape per batch size (core.sqlite.writes): room for all of them
        conn = await aiosqlite.connect(self._path, isolation_level=None, cached_statements=256)
        await conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        await conn.execute("PRAGMA foreign_keys = ON")
        return conn

    def _writing(self, op: str) -> Writer:
        if self._writer is None:
            raise StoreError(f"sqlite store: {op} called while the store is closed")
        return self._writer

    async def _write(self, op: str, sql: str, params: Params = ()) -> list[Row]:
        return await self._writing(op).write(op, sql, params)

    async def _session_write(self, op: str, write: SessionWrite) -> list[Row]:
        return await self._writing(op).session_write(op, write)

    async def _read(self, op: str, sql: str, params: Params = ()) -> list[Row]:
        reader = self._reader
        if reader is None:
            raise StoreError(f"sqlite store: {op} called while the store is closed")
        with store_errors(op):
            return cast(list[Row], await reader.execute_fetchall(sql, params))

    # -- sessions

    async def get_or_create_session(self, key: str, *, default_title: str = DEFAULT_TITLE) -> SessionRecord:
        existing = await self.get_session(key)
        if existing is not None:
            return existing
        [row] = await self._write("get_or_create_session", writes.CREATE_SESSION,
                                  {"key": key, "default_title": default_title, "now": self._clock()})
        return rows.session_from_row(row)

    async def get_session(self, key: str) -> SessionRecord | None:
        found = await self._read("get_session", f"SELECT {SESSION_SELECT} FROM sessions WHERE key = ?", (key,))
        return rows.session_from_row(found[0]) if found else None

    async def list_sessions(self, *, prefix: str | None = None, limit: int = 200,
                            exclude_glob: str | None = None) -> list[SessionRecord]:
        """Sessions by most recent update first, optionally only keys starting with ``prefix`` and none
        matching ``exclude_glob``."""
        where: list[str] = []
        params: list[object] = []
        if prefix is not None:
            where.append("substr(key, 1, ?) = ?")
            params += [len(prefix), prefix]
        if exclude_glob is not None:
            where.append("key NOT GLOB ?")
            params.append(exclude_glob)
        clause = f" WHERE {' AND '.join(where)}" if where else ""
        found = await self._read("list_sessions", f"SELECT {SESSION_SELECT} FROM sessions{clause}"
                                 " ORDER BY updated_at DESC, key LIMIT ?", (*params, max(limit, 0)))
        return [rows.session_from_row(r) for r in found]

    async def bump_generation(self, key: str) -> int:
        [row] = await self._write("bump_generation", writes.BUMP_GENERATION,
                                  {"key": key, "default_title": DEFAULT_TITLE, "now": self._clock()})
        return int(row[0])

    async def new_context(self, key: str, *, drop_inbound: Sequence[int] = (),
                          serves: int | None = None) -> SessionRecord:
        """Start a fresh model context: older messages stay in history; generation and state_version bump.
        Inbound messages in ``drop_inbound`` and ``serves`` are marked served in the same statement;
        InboundServedError when ``serves`` is no longer waiting."""
        done = [*drop_inbound, *([serves] if serves is not None else [])]
        found = await self._session_write("new_context", SessionWrite(
            key, self._clock(), DEFAULT_TITLE, add_version=1, add_generation=1, fresh_context=True,
            inbound_done=json.dumps(done) if done else None, expect_waiting=serves))
        if not found:  # its only expectation: the command it carries out still waits
            raise InboundServedError(f"inbound command {serves} of {key} is no longer waiting")
        return rows.session_from_row(_header(found)[SESSION_AT:MESSAGE_AT])

    async def rename(self, key: str, title: str) -> None:
        """A user rename: sets the title and clears title_is_default, so a late automatic title loses."""
        await self._write("rename", writes.RENAME, {"key": key, "title": title, "now": self._clock()})

    async def set_title_if_default(self, key: str, title: str, *, expect_generation: int) -> bool:
        """An automatic title: written only while no user rename happened and the generation still matches.

        ``title_is_default`` stays set, so a later automatic title may replace this one; a rename clears it.
        """
        return bool(await self._write("set_title_if_default", writes.SET_TITLE_IF_DEFAULT, {
            "key": key, "title": title, "now": self._clock(), "expect_generation": expect_generation}))

    # -- messages

    async def append_message(self, key: str, message: NewMessage, *, begin_turn: tuple[str, str] | None = None,
                             serves: int | None = None) -> tuple[ChatMessage, SessionRecord]:
        """Persist one message (state_version +1, no revision bump); returns it and the session after it.

        ``begin_turn=(turn_id, target_json)`` records a running turn and ``serves`` marks that inbound
        message served, in the same statement; InboundServedError when it is no longer waiting."""
        now = self._clock()
        ids = (uuid.uuid4().hex,)
        found = await self._session_write("append_message", SessionWrite(
            key, now, DEFAULT_TITLE, rows.message_values((message,), ids), add_version=1, begin_turn=begin_turn,
            inbound_done=f"[{int(serves)}]" if serves is not None else None, expect_waiting=serves))
        if not found:  # its only expectation: the message it serves still waits
            raise InboundServedError(f"inbound message {serves} of {key} is no longer waiting")
        header = _header(found)
        session = rows.session_from_row(header[SESSION_AT:MESSAGE_AT])
        [persisted] = rows.new_messages(key, header[NEXT_SEQ] - 1, (message,), ids, now)
        return persisted, session

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

        Raises StaleStateError (and writes nothing) when an expectation fails, TurnEndedError when
        ``end_turn``'s record was closed already. The result carries every message with seq above the
        previous revision (including messages appended since), so consecutive revisions are contiguous deltas
        covering each message exactly once.
        """
        now = self._clock()
        ids = [uuid.uuid4().hex for _ in messages]
        found = await self._session_write("commit_turn", SessionWrite(
            key, now, DEFAULT_TITLE, rows.message_values(messages, ids), add_version=1 if messages else 0,
            add_revision=1, expect_generation=expect_generation, expect_state_version=expect_state_version,
            end_turn=end_turn, trace=(trace[0], rows.traces_json(trace[1])) if trace and trace[1] else None,
            appended=True))
        if not found:
            if end_turn is not None and await self._read(
                    "commit_turn", "SELECT 1 FROM turns WHERE turn_id = ? AND state <> 'running'", (end_turn[0],)):
                raise TurnEndedError(f"turn {end_turn[0]} of {key} was closed already")
            raise StaleStateError(f"session {key} moved on (expected generation {expect_generation}, "
                                  f"state_version {expect_state_version})")
        header = _header(found)
        appended = sorted((rows.message_from_row(r[MESSAGE_AT:]) for r in found if r[1] == -2), key=lambda m: m.seq)
        inserted = rows.new_messages(key, header[NEXT_SEQ] - len(messages), messages, ids, now)
        return CommitResult.model_construct(session_key=key, history_revision=header[HISTORY_REVISION],
                                            messages=(*appended, *inserted), state_version=header[STATE_VERSION],
                                            inserted=len(inserted))

    async def history(self, key: str, *, limit: int = 1000,
                      before: str | None = None) -> tuple[int, list[ChatMessage]]:
        """(history_revision, the newest ``limit`` messages in seq order — older than message ``before``
        when given), read by one statement, so they are consistent with each other.

        Messages appended after the last commit may be included; the revision counts commits only. Raises
        UnknownMessageError when ``before`` is not a message of this session.
        """
        below = "(SELECT seq FROM messages WHERE id = :before AND session_key = :key)"
        found = await self._read(
            "history",
            f"SELECT s.history_revision, {below} IS NOT NULL,"
            f" {', '.join(f'm.{c}' for c in MESSAGE_COLUMNS)} FROM sessions AS s"
            f" LEFT JOIN (SELECT {MESSAGE_SELECT} FROM messages WHERE session_key = :key"
            f" AND (:before IS NULL OR seq < {below}) ORDER BY seq DESC LIMIT :limit) AS m ON 1"
            " WHERE s.key = :key ORDER BY m.seq",
            {"key": key, "limit": max(limit, 0), "before": before})
        if before is not None and not (found and found[0][1]):
            raise UnknownMessageError("no such message in this conversation")
        if not found:
            return 0, []
        return int(found[0][0]), [rows.message_from_row(r[2:]) for r in found if r[2] is not None]

    async def context_messages(self, key: str, *, limit: int) -> tuple[int, list[ChatMessage]]:
        """(state_version, the newest ``limit`` messages after the session's context start, in seq order),
        read by one statement, so the two are consistent."""
        found = await self._read(
            "context_messages",
            f"SELECT s.state_version, {', '.join(f'm.{c}' for c in MESSAGE_COLUMNS)} FROM sessions AS s"
            f" LEFT JOIN (SELECT {MESSAGE_SELECT} FROM messages WHERE session_key = :key"
            " AND seq > (SELECT context_start_seq FROM sessions WHERE key = :key)"
            " ORDER BY seq DESC LIMIT :limit) AS m ON 1 WHERE s.key = :key ORDER BY m.seq",
            {"key": key, "limit": max(limit, 0)})
        if not found:
            return 0, []
        return int(found[0][0]), [rows.message_from_row(r[1:]) for r in found if r[1] is not None]

    # -- inbound messages and dedupe

    async def admit_inbound(self, channel: str, event_id: str | None, payload: str, *,
                            ttl_seconds: float, key: str | None = None) -> int | None:
        """Keep an accepted inbound message until it is served; None when its event was seen within its TTL.

        A message without an event id has no dedupe mark to keep: its row goes once it is served."""
        now = self._clock()
        return await self._admit("admit_inbound", Admission(
            channel, event_id, payload, now, now + ttl_seconds if event_id is not None else now, key))

    async def mark_event_processed(self, channel: str, event_id: str, *, ttl_seconds: float) -> bool:
        """True if this event is new (and is now recorded); False if it was seen within its TTL.

        A mark whose TTL has run out counts as new and is replaced."""
        now = self._clock()
        return await self._admit("mark_event_processed", Admission(channel, event_id, None, now,
                                                                  now + ttl_seconds)) is not None

    async def _admit(self, op: str, admission: Admission) -> int | None:
        return await self._writing(op).admit(op, admission)

    async def event_seen(self, channel: str, event_id: str) -> bool:
        return bool(await self._read(
            "event_seen", "SELECT 1 FROM inbound WHERE channel = ? AND event_id = ?"
            " AND (envelope IS NOT NULL OR expires_at > ?)", (channel, event_id, self._clock())))

    async def waiting_inbound(self, *, key: str | None = None, after_seq: int = 0) -> list[InboundRecord]:
        found = await self._read("waiting_inbound", "SELECT seq, envelope, admitted_at FROM inbound"
                                 " WHERE envelope IS NOT NULL AND seq > :after AND (:key IS NULL OR session_key = :key)"
                                 " ORDER BY seq", {"key": key, "after": after_seq})
        return [InboundRecord(seq=r[0], payload=r[1], admitted_at=r[2]) for r in found]

    async def finish_inbound(self, seqs: Sequence[int]) -> list[int]:
        if not seqs:
            return []
        finished = await self._write("finish_inbound", writes.FINISH_INBOUND, (json.dumps(list(seqs)),))
        return sorted(int(r[0]) for r in finished)

    async def forget_inbound(self, seq: int) -> None:
        await self._write("forget_inbound", writes.FORGET_INBOUND, (seq,))

    # -- turns

    async def end_turn(self, turn_id: str, state: TurnState) -> None:
        """Record a running turn's final state; a turn that already ended keeps its first final state."""
        await self._write("end_turn", writes.END_TURN, (state, self._clock(), turn_id))

    async def mark_delivered(self, turn_id: str) -> None:
        await self._writing("mark_delivered").mark_delivered("mark_delivered", turn_id, self._clock())

    async def undelivered_turns(self, since: float, *, key: str | None = None,
                                ended_before: float | None = None) -> list[UndeliveredTurn]:
        found = await self._read("undelivered_turns", writes.UNDELIVERED_TURNS, {
            "since": since, "key": key, "before": ended_before if ended_before is not None else math.inf})
        return [UndeliveredTurn(turn=rows.turn_from_row(r), text=r[6]) for r in found]

    async def close_interrupted_turns(self, *, key: str | None = None,
                                      prefix: str | None = None) -> list[TurnRecord]:
        """Mark every turn still 'running' as 'interrupted' (with ``key``, only ``key``'s and those of the
        sessions whose key starts with ``prefix``) and return them."""
        found = await self._write("close_interrupted_turns", writes.CLOSE_INTERRUPTED_TURNS,
                                  {"now": self._clock(), "key": key, "prefix": prefix if key is not None else None})
        return sorted((rows.turn_from_row(r) for r in found), key=lambda t: (t.started_at, t.turn_id))

    # -- attachments

    async def add_attachment(self, record: AttachmentRecord) -> None:
        await self._write("add_attachment", writes.ADD_ATTACHMENT, rows.attachment_values(record))

    async def get_attachment(self, attachment_id: str) -> AttachmentRecord | None:
        found = await self._read("get_attachment",
                                 f"SELECT {rows.ATTACHMENT_SELECT} FROM attachments WHERE id = ?", (attachment_id,))
        return rows.attachment_from_row(found[0]) if found else None

    async def claim_attachments(self, ids: Sequence[str]) -> None:
        if ids:
            await self._write("claim_attachments", writes.CLAIM_ATTACHMENTS, (json.dumps(list(ids)),))

    async def drop_unclaimed_attachments(self, key: str, *, before: float) -> list[str]:
        found = await self._write("drop_unclaimed_attachments", writes.DROP_UNCLAIMED_ATTACHMENTS, (key, before))
        return [str(r[0]) for r in found]

    async def drop_expired_attachments(self, before: float) -> list[str]:
        found = await self._write("drop_expired_attachments", writes.DROP_EXPIRED_ATTACHMENTS, (before,))
        return [str(r[0]) for r in found]

    # -- channel state

    async def get_channel_state(self, channel: str, name: str) -> str | None:
        found = await self._read("get_channel_state",
                                 "SELECT value FROM channel_state WHERE channel = ? AND name = ?", (channel, name))
        return str(found[0][0]) if found else None

    async def set_channel_state(self, channel: str, name: str, value: str) -> None:
        await self._write("set_channel_state", writes.SET_CHANNEL_STATE, (channel, name, value, self._clock()))

    async def channel_state_names(self, channel: str, prefix: str) -> list[str]:
        found = await self._read("channel_state_names",
                                 "SELECT name FROM channel_state WHERE channel = ? AND substr(name, 1, length(?)) = ?"
                                 " ORDER BY name", (channel, prefix, prefix))
        return [str(r[0]) for r in found]

    async def delete_channel_state(self, channel: str, name: str) -> None:
        await self._write("delete_channel_state", "DELETE FROM channel_state WHERE channel = ? AND name = ?",
                          (channel, name))

    # -- traces

    async def append_traces(self, key: str, turn_id: str, records: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Append several trace records in one statement, in order; values JSON cannot encode are stored as
        their ``str()``."""
        if records:
            await self._write("append_traces", writes.APPEND_TRACES, {
                "key": key, "turn_id": turn_id, "traces": rows.traces_json(records), "now": self._clock()})


SESSION_AT, MESSAGE_AT = writes.SESSION_AT, writes.MESSAGE_AT
NEXT_SEQ, STATE_VERSION, HISTORY_REVISION = (SESSION_AT + SESSION_COLUMNS.index(c)
                                             for c in ("next_seq", "state_version", "history_revision"))


def _header(found: list[Row]) -> Row:
    """The header row of a session write (RETURNING reports rows in no set order)."""
    return next(r for r in found if r[1] == -1)
