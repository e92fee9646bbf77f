"""The PostgreSQL Store: the same ``Store`` protocol as SQLite, on a server several processes can share.

An asyncpg connection pool; every public method is one transaction on one pooled connection (or, where
each statement stands alone, one statement), so each write is atomic and a failed one leaves nothing behind.
A session write (``append_message``, ``commit_turn``, ``new_context``) first locks the session's row,
creating it when missing (``core.postgresql.writes``), checks the generation and state_version expectations
against the locked row, and only then writes, in one statement: concurrent writes to one session run one
after the other, and a stale one raises ``StaleStateError`` and rolls back, having written nothing. Reads
that return two related things (a revision and its messages) run in one REPEATABLE READ snapshot. Every
operation runs in a task of its own (``core.postgresql.landing``): once called, it lands (or fails) even if
its caller is cancelled, and ``close`` waits for it.

``open`` migrates forward under an advisory lock (``core.postgresql.schema``), on a connection of its own,
then opens the pool. Every pooled connection is bounded at both ends (``core.postgresql.bounds``, derived from
the session lease TTL): the server ends a transaction whose client fell silent and stops a lock wait, so a
process cut off mid-transaction cannot freeze a conversation for the others; here, every statement, every
wait for a pooled connection and ``close`` have a deadline, so a connection that died silently costs a
StoreError, never a hang. Every failure leaving a public method is a ``StoreError``
(``core.postgresql.errors``) that names the operation, never message content and never the connection
string.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

import asyncpg

from core.messages import ChatMessage, NewMessage
from core.postgresql import rows
from core.postgresql.bounds import CONNECT_TIMEOUT, StoreBounds
from core.postgresql.errors import store_errors
from core.postgresql.glob import glob_to_regex
from core.postgresql.landing import InFlight, lands
from core.postgresql.rows import ATTACHMENT_SELECT, MESSAGE_SELECT, SESSION_SELECT, TURN_SELECT
from core.postgresql.schema import migrate, schema_version
from core.postgresql.writes import LOCK_SESSION, LOCK_TRACES, TRACE_LOCK, TRACES, SessionWrite
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

log = logging.getLogger(__name__)

DEFAULT_LEASE_SECONDS = 10.0
"""The session lease TTL the bounds derive from when none is given (``[store] lease_seconds``' default)."""

_STILL_WAITING = "SELECT 1 FROM inbound WHERE seq = $1 AND envelope IS NOT NULL FOR UPDATE"


async def database_schema_version(dsn: str) -> int:
    """The schema version of the database at ``dsn``, read without changing anything (``chatbridge check``);
    0 for a database chatbridge never opened. Raises StoreError when it cannot be reached."""
    with store_errors("check"):
        try:
            conn = await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT, command_timeout=CONNECT_TIMEOUT)
        except ValueError as exc:
            raise StoreError(f"postgresql store: check failed (the connection string is not usable: "
                             f"{type(exc).__name__})") from None
        try:
            return await schema_version(conn)
        finally:
            await conn.close()


class PostgresqlStore:
    """``Store`` on a PostgreSQL database (see the module docstring)."""

    def __init__(self, dsn: str, *, pool_size: int = 10, clock: Callable[[], float] = time.time,
                 lease_seconds: float = DEFAULT_LEASE_SECONDS, bounds: StoreBounds | None = None) -> None:
        """``lease_seconds`` is the session lease TTL the connections' bounds derive from
        (``core.postgresql.bounds``); ``bounds`` sets them outright instead (tests use small ones)."""
        self._dsn = dsn
        self._pool_size = pool_size
        self._clock = clock
        self._bounds = bounds if bounds is not None else StoreBounds.for_lease(lease_seconds)
        self._pool: asyncpg.Pool | None = None
        self._closing = False
        self._in_flight = InFlight()

    def __repr__(self) -> str:  # the connection string may hold a password
        return "PostgresqlStore(dsn=***)"

    # -- lifecycle

    async def open(self) -> None:
        """Connect and migrate the schema forward (once, however many processes open it at the same time)."""
        if self._pool is not None:
            return
        bounds = self._bounds
        with store_errors("open"):
            try:
                # a step may take long, and the processes starting meanwhile wait for it: not the pool's bounds
                conn = await asyncpg.connect(self._dsn, timeout=CONNECT_TIMEOUT,
                                             server_settings=bounds.migration_settings())
            except ValueError as exc:  # asyncpg's own checks of the connection string
                raise StoreError(f"postgresql store: open failed (the connection string is not usable: "
                                 f"{type(exc).__name__})") from None
            try:
                await migrate(conn)
            finally:
                await _close_within(conn, bounds.command)
            self._pool = await asyncpg.create_pool(
                self._dsn, min_size=1, max_size=self._pool_size, timeout=CONNECT_TIMEOUT,
                command_timeout=bounds.command, server_settings=bounds.server_settings("chatbridge store"))

    async def close(self) -> None:
        """Operations under way complete first (also those whose caller was cancelled); any started after this
        began fail as closed. Within the ``close`` bound: past it, the pool is terminated, and the operations
        still under way fail with StoreError (each is bounded too; this is the bound of them all)."""
        if self._pool is None or self._closing:
            return
        self._closing = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._bounds.close
        try:
            drained = await self._in_flight.drain(timeout=self._bounds.close)
            pool, self._pool = self._pool, None
            if not drained:
                log.warning("postgresql store: operations still under way after %.3gs; closing without them",
                            self._bounds.close)
                pool.terminate()
                return
            try:
                async with asyncio.timeout_at(deadline):
                    with store_errors("close"):
                        await pool.close()
            except TimeoutError:  # Pool.close terminates the pool when it is interrupted
                log.warning("postgresql store: the connections did not close within %.3gs; dropped them",
                            self._bounds.close)
        finally:
            self._closing = False

    @property
    def in_flight(self) -> InFlight:
        return self._in_flight

    def check_open(self, op: str) -> None:
        if self._pool is None or self._closing:
            raise StoreError(f"postgresql store: {op} called while the store is closed")

    @contextlib.asynccontextmanager
    async def _connection(self, op: str) -> AsyncIterator[asyncpg.Connection]:
        pool = self._pool
        if pool is None:
            raise StoreError(f"postgresql store: {op} called while the store is closed")
        acquired = False
        with store_errors(op):
            try:
                async with pool.acquire(timeout=self._bounds.acquire) as conn:
                    acquired = True
                    yield conn
            except TimeoutError:
                if acquired:
                    raise  # a statement's (store_errors says so)
                raise StoreError(f"postgresql store: {op} failed (no connection to the server within "
                                 f"{self._bounds.acquire:.3g}s)") from None

    @contextlib.asynccontextmanager
    async def _transaction(self, op: str, *, snapshot: bool = False) -> AsyncIterator[asyncpg.Connection]:
        async with self._connection(op) as conn:
            isolation = "repeatable_read" if snapshot else "read_committed"
            async with conn.transaction(isolation=isolation, readonly=snapshot):
                yield conn

    @contextlib.asynccontextmanager
    async def _writing(self, op: str, key: str, ids: Sequence[str]) -> AsyncIterator[asyncpg.Connection]:
        """A write transaction that inserts the messages ``ids`` into session ``key``. When it fails after its
        last statement (its COMMIT unanswered: the connection lost, or silent past its bound), the server may
        have committed it all the same, which asyncpg cannot tell: it is read back (``_landed``), and a write
        that landed is a success (its caller's values, computed in the transaction, are the committed ones)
        instead of a StoreError that would have the turn fail, or the user asked to send again, with the
        answer or the message stored."""
        written = False
        try:
            async with self._transaction(op) as conn:
                yield conn
                written = True
        except StoreError:
            if not written or not ids or not await self._landed(op, key, ids):
                raise
            log.warning("postgresql store: %s was not answered at its commit, which had landed", op)

    async def _landed(self, op: str, key: str, ids: Sequence[str]) -> bool:
        """Whether the messages ``ids`` are in the database. The session's row is locked first: a transaction
        that wrote them holds it until it has ended on the server (committed, or rolled back once the server
        let it go: ``idle_in_transaction_session_timeout``, within the lock wait), so what is read is final.
        False also when the database cannot be read (the outcome stays unknown: the caller's StoreError)."""
        try:
            async with self._transaction(f"{op} (read back)") as conn:
                await conn.execute("SELECT 1 FROM sessions WHERE key = $1 FOR UPDATE", key)
                found = await conn.fetchval("SELECT count(*) FROM messages WHERE id = ANY($1::text[])", list(ids))
        except StoreError as exc:
            log.warning("postgresql store: could not read back whether %s landed: %s", op, exc)
            return False
        return bool(found == len(ids))

    async def _fetch(self, op: str, sql: str, *args: Any) -> list[asyncpg.Record]:
        async with self._connection(op) as conn:
            return cast(list[asyncpg.Record], await conn.fetch(sql, *args))

    # -- sessions

    @lands
    async def get_or_create_session(self, key: str, *, default_title: str = DEFAULT_TITLE) -> SessionRecord:
        existing = await self.get_session(key)
        if existing is not None:
            return existing
        now = self._clock()
        [row] = await self._fetch(
            "get_or_create_session",
            "INSERT INTO sessions (key, title, created_at, updated_at) VALUES ($1, $2, $3, $3)"
            f" ON CONFLICT (key) DO UPDATE SET key = EXCLUDED.key RETURNING {SESSION_SELECT}",
            key, default_title, now)
        return rows.session_from_row(row)

    @lands
    async def get_session(self, key: str) -> SessionRecord | None:
        found = await self._fetch("get_session", f"SELECT {SESSION_SELECT} FROM sessions WHERE key = $1", key)
        return rows.session_from_row(found[0]) if found else None

    @lands
    async def list_sessions(self, *, prefix: str | None = None, limit: int = 200,
                            exclude_glob: str | None = None) -> list[SessionRecord]:
        """Sessions by most recent update first (then by key, byte order), optionally only keys starting with
        ``prefix`` and none matching ``exclude_glob``."""
        found = await self._fetch(
            "list_sessions",
            f"SELECT {SESSION_SELECT} FROM sessions WHERE ($1::text IS NULL OR starts_with(key, $1))"
            ' AND ($2::text IS NULL OR key !~ $2) ORDER BY updated_at DESC, key COLLATE "C" LIMIT $3',
            prefix, glob_to_regex(exclude_glob) if exclude_glob is not None else None, max(limit, 0))
        return [rows.session_from_row(r) for r in found]

    @lands
    async def bump_generation(self, key: str) -> int:
        found = await self._fetch(
            "bump_generation",
            "INSERT INTO sessions (key, title, generation, created_at, updated_at) VALUES ($1, $2, 1, $3, $3)"
            " ON CONFLICT (key) DO UPDATE SET generation = sessions.generation + 1, updated_at = EXCLUDED.updated_at"
            " RETURNING generation", key, DEFAULT_TITLE, self._clock())
        return int(found[0][0])

    @lands
    async def new_context(self, key: str, *, drop_inbound: Sequence[int] = (),
                          serves: int | None = None) -> SessionRecord:
        """Start a fresh model context: older messages stay in history; generation and state_version bump.
        Inbound messages in ``drop_inbound`` and ``serves`` are marked served in the same transaction;
        InboundServedError when ``serves`` is no longer waiting."""
        now = self._clock()
        async with self._transaction("new_context") as conn:
            current = await _locked_session(conn, key, now)
            if serves is not None and await conn.fetchval(_STILL_WAITING, serves) is None:
                raise InboundServedError(f"inbound command {serves} of {key} is no longer waiting")
            after = await SessionWrite(add_version=1, add_generation=1, context_start_seq=current.next_seq - 1,
                                       serves=[*drop_inbound, *([serves] if serves is not None else [])]
                                       ).run(conn, key, now)
        return rows.session_from_row(after)

    @lands
    async def rename(self, key: str, title: str) -> None:
        """A user rename: sets the title and clears title_is_default, so a late automatic title loses."""
        await self._fetch(
            "rename",
            "INSERT INTO sessions (key, title, title_is_default, created_at, updated_at)"
            " VALUES ($1, $2, FALSE, $3, $3) ON CONFLICT (key) DO UPDATE SET title = EXCLUDED.title,"
            " title_is_default = FALSE, updated_at = EXCLUDED.updated_at", key, title, self._clock())

    @lands
    async def set_title_if_default(self, key: str, title: str, *, expect_generation: int) -> bool:
        """An automatic title: written only while no user rename happened and the generation still matches."""
        return bool(await self._fetch(
            "set_title_if_default",
            "UPDATE sessions SET title = $2, updated_at = $3"
            " WHERE key = $1 AND title_is_default AND generation = $4 RETURNING 1",
            key, title, self._clock(), expect_generation))

    # -- messages

    @lands
    async def append_message(self, key: str, message: NewMessage, *, begin_turn: tuple[str, str] | None = None,
                             serves: int | None = None) -> tuple[ChatMessage, SessionRecord]:
        """Persist one message (state_version +1, no revision bump); returns it and the session after it.

        ``begin_turn=(turn_id, target_json)`` records a running turn and ``serves`` marks that inbound
        message served, in the same transaction; InboundServedError when it is no longer waiting."""
        now = self._clock()
        ids = (uuid.uuid4().hex,)
        async with self._writing("append_message", key, ids) as conn:
            current = await _locked_session(conn, key, now)
            # locked, and read again once a write serving it first has committed: served once, by one process
            if serves is not None and await conn.fetchval(_STILL_WAITING, serves) is None:
                raise InboundServedError(f"inbound message {serves} of {key} is no longer waiting")
            after = await SessionWrite(
                add_version=1, messages=rows.message_values(key, current.next_seq, (message,), ids, now),
                begin_turn=begin_turn, serves=(serves,) if serves is not None else ()).run(conn, key, now)
        [persisted] = rows.new_messages(key, current.next_seq, (message,), ids, now)
        return persisted, rows.session_from_row(after)

    @lands
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
        previous revision, so consecutive revisions are contiguous deltas.
        """
        now = self._clock()
        ids = [uuid.uuid4().hex for _ in messages]
        async with self._writing("commit_turn", key, ids) as conn:
            # a session this creates goes again with the rollback when the expectations fail
            current = await _locked_session(conn, key, now)
            if ((expect_generation is not None and current.record.generation != expect_generation)
                    or (expect_state_version is not None and current.record.state_version != expect_state_version)):
                raise StaleStateError(f"session {key} moved on (expected generation {expect_generation}, "
                                      f"state_version {expect_state_version})")
            if end_turn is not None:  # locked: a takeover closing it waits, or is waited for
                state = await conn.fetchval("SELECT state FROM turns WHERE turn_id = $1 FOR UPDATE", end_turn[0])
                if state is not None and state != "running":
                    raise TurnEndedError(f"turn {end_turn[0]} of {key} was closed already ({state})")
            after = await SessionWrite(
                add_version=1 if messages else 0, add_revision=1, revision_seq=current.next_seq + len(messages) - 1,
                messages=rows.message_values(key, current.next_seq, messages, ids, now), end_turn=end_turn,
                trace=(trace[0], rows.trace_values(trace[1])) if trace is not None and trace[1] else None,
                appended_after=current.record.revision_seq).run(conn, key, now)
            earlier = [rows.message_from_row(r) for r in after["appended"] or ()]
        session = rows.session_from_row(after)
        inserted = rows.new_messages(key, current.next_seq, messages, ids, now)
        return CommitResult.model_construct(session_key=key, history_revision=session.history_revision,
                                            messages=(*earlier, *inserted), state_version=session.state_version,
                                            inserted=len(inserted))

    @lands
    async def history(self, key: str, *, limit: int = 1000,
                      before: str | None = None) -> tuple[int, list[ChatMessage]]:
        """(history_revision, the newest ``limit`` messages in seq order — older than message ``before``
        when given), read in one snapshot. Raises UnknownMessageError when ``before`` is not a message of
        this session."""
        async with self._transaction("history", snapshot=True) as conn:
            below: int | None = None
            if before is not None:
                below = await conn.fetchval("SELECT seq FROM messages WHERE id = $1 AND session_key = $2",
                                            before, key)
                if below is None:
                    raise UnknownMessageError("no such message in this conversation")
            revision = await conn.fetchval("SELECT history_revision FROM sessions WHERE key = $1", key)
            if revision is None:
                return 0, []
            found = await conn.fetch(
                f"SELECT {MESSAGE_SELECT} FROM messages WHERE session_key = $1 AND ($2::bigint IS NULL OR seq < $2)"
                " ORDER BY seq DESC LIMIT $3", key, below, max(limit, 0))
            return int(revision), [rows.message_from_row(r) for r in reversed(found)]

    @lands
    async def context_messages(self, key: str, *, limit: int) -> tuple[int, list[ChatMessage]]:
        """(state_version, the newest ``limit`` messages after the session's context start, in seq order),
        read in one snapshot."""
        async with self._transaction("context_messages", snapshot=True) as conn:
            session = await conn.fetchrow("SELECT state_version, context_start_seq FROM sessions WHERE key = $1",
                                          key)
            if session is None:
                return 0, []
            found = await conn.fetch(
                f"SELECT {MESSAGE_SELECT} FROM messages WHERE session_key = $1 AND seq > $2"
                " ORDER BY seq DESC LIMIT $3", key, session[1], max(limit, 0))
            return int(session[0]), [rows.message_from_row(r) for r in reversed(found)]

    # -- inbound messages and dedupe

    @lands
    async def admit_inbound(self, channel: str, event_id: str | None, payload: str, *,
                            ttl_seconds: float, key: str | None = None) -> int | None:
        """Keep an accepted inbound message until it is served; None when its event was seen within its TTL.

        A message without an event id has no dedupe mark to keep: its row goes once it is served."""
        now = self._clock()
        return await self._admit("admit_inbound", channel, event_id, payload, now,
                                 now + ttl_seconds if event_id is not None else now, key)

    @lands
    async def mark_event_processed(self, channel: str, event_id: str, *, ttl_seconds: float) -> bool:
        """True if this event is new (and is now recorded); False if it was seen within its TTL."""
        now = self._clock()
        return await self._admit("mark_event_processed", channel, event_id, None, now, now + ttl_seconds) is not None

    async def _admit(self, op: str, channel: str, event_id: str | None, payload: str | None, now: float,
                     expires_at: float, key: str | None = None) -> int | None:
        async with self._connection(op) as conn:  # two statements, each atomic: the purge is housekeeping
            # served rows whose mark ran out go first, so an expired event counts as new
            await conn.execute("DELETE FROM inbound WHERE envelope IS NULL AND expires_at <= $1", now)
            seq = await conn.fetchval(
                "INSERT INTO inbound (channel, event_id, envelope, admitted_at, expires_at, session_key)"
                " VALUES ($1, $2, $3, $4, $5, $6) ON CONFLICT (channel, event_id) DO NOTHING RETURNING seq",
                channel, event_id, payload, now, expires_at, key)
        return int(seq) if seq is not None else None

    @lands
    async def event_seen(self, channel: str, event_id: str) -> bool:
        return bool(await self._fetch(
            "event_seen", "SELECT 1 FROM inbound WHERE channel = $1 AND event_id = $2"
            " AND (envelope IS NOT NULL OR expires_at > $3)", channel, event_id, self._clock()))

    @lands
    async def waiting_inbound(self, *, key: str | None = None, after_seq: int = 0) -> list[InboundRecord]:
        found = await self._fetch("waiting_inbound", "SELECT seq, envelope, admitted_at FROM inbound"
                                  " WHERE envelope IS NOT NULL AND seq > $2 AND ($1::text IS NULL OR session_key = $1)"
                                  " ORDER BY seq", key, after_seq)
        return [InboundRecord(seq=r[0], payload=r[1], admitted_at=r[2]) for r in found]

    @lands
    async def finish_inbound(self, seqs: Sequence[int]) -> list[int]:
        if not seqs:
            return []
        async with self._transaction("finish_inbound") as conn:
            gone = await conn.fetch("DELETE FROM inbound WHERE seq = ANY($1::bigint[]) AND event_id IS NULL"
                                    " AND envelope IS NOT NULL RETURNING seq", list(seqs))
            kept = await conn.fetch("UPDATE inbound SET envelope = NULL WHERE seq = ANY($1::bigint[])"
                                    " AND envelope IS NOT NULL RETURNING seq", list(seqs))
        return sorted(int(r[0]) for r in (*gone, *kept))

    @lands
    async def forget_inbound(self, seq: int) -> None:
        await self._fetch("forget_inbound", "DELETE FROM inbound WHERE seq = $1", seq)

    # -- turns

    @lands
    async def end_turn(self, turn_id: str, state: TurnState) -> None:
        """Record a running turn's final state; a turn that already ended keeps its first final state."""
        await self._fetch("end_turn", "UPDATE turns SET state = $2, ended_at = $3 WHERE turn_id = $1"
                          " AND state = 'running'", turn_id, state, self._clock())

    @lands
    async def mark_delivered(self, turn_id: str) -> None:
        await self._fetch("mark_delivered", "INSERT INTO deliveries (turn_id, delivered_at) VALUES ($1, $2)"
                          " ON CONFLICT (turn_id) DO NOTHING", turn_id, self._clock())

    @lands
    async def undelivered_turns(self, since: float, *, key: str | None = None,
                                ended_before: float | None = None) -> list[UndeliveredTurn]:
        found = await self._fetch(
            "undelivered_turns",
            "SELECT t.turn_id, t.session_key, t.state, t.target_json, t.started_at, t.ended_at,"
            " (SELECT m.content FROM messages m WHERE m.session_key = t.session_key AND m.turn_id = t.turn_id"
            "   AND m.role = 'assistant' AND m.content <> ''::bytea ORDER BY m.seq DESC LIMIT 1)"
            " FROM turns t WHERE t.ended_at > $1 AND t.state IN ('completed', 'failed', 'cancelled')"
            " AND ($2::text IS NULL OR t.session_key = $2) AND ($3::float8 IS NULL OR t.ended_at < $3)"
            " AND NOT EXISTS (SELECT 1 FROM deliveries d WHERE d.turn_id = t.turn_id) ORDER BY t.ended_at",
            since, key, ended_before)
        with store_errors("undelivered_turns"):
            return [UndeliveredTurn(turn=rows.turn_from_row(r), text=bytes(r[6]).decode() if r[6] is not None
                                    else None) for r in found]

    @lands
    async def close_interrupted_turns(self, *, key: str | None = None,
                                      prefix: str | None = None) -> list[TurnRecord]:
        """Mark every turn still 'running' as 'interrupted' (with ``key``, only ``key``'s and those of the
        sessions whose key starts with ``prefix``) and return them."""
        found = await self._fetch("close_interrupted_turns", "UPDATE turns SET state = 'interrupted', ended_at = $1"
                                  " WHERE state = 'running' AND ($2::text IS NULL OR session_key = $2"
                                  " OR ($3::text IS NOT NULL AND starts_with(session_key, $3)))"
                                  f" RETURNING {TURN_SELECT}", self._clock(), key,
                                  prefix if key is not None else None)
        return sorted((rows.turn_from_row(r) for r in found), key=lambda t: (t.started_at, t.turn_id))

    # -- attachments

    @lands
    async def add_attachment(self, record: AttachmentRecord) -> None:
        await self._fetch("add_attachment", f"INSERT INTO attachments ({ATTACHMENT_SELECT})"
                          " VALUES ($1, $2, $3, $4, $5, $6, $7, $8)", *rows.attachment_values(record))

    @lands
    async def get_attachment(self, attachment_id: str) -> AttachmentRecord | None:
        found = await self._fetch("get_attachment", f"SELECT {ATTACHMENT_SELECT} FROM attachments WHERE id = $1",
                                  attachment_id)
        return rows.attachment_from_row(found[0]) if found else None

    @lands
    async def claim_attachments(self, ids: Sequence[str]) -> None:
        if ids:
            await self._fetch("claim_attachments", "UPDATE attachments SET claimed = TRUE WHERE id = ANY($1::text[])",
                              list(ids))

    @lands
    async def drop_unclaimed_attachments(self, key: str, *, before: float) -> list[str]:
        found = await self._fetch("drop_unclaimed_attachments", "DELETE FROM attachments WHERE session_key = $1"
                                  " AND NOT claimed AND created_at < $2 RETURNING id", key, before)
        return [str(r[0]) for r in found]

    @lands
    async def drop_expired_attachments(self, before: float) -> list[str]:
        found = await self._fetch("drop_expired_attachments",
                                  "DELETE FROM attachments WHERE created_at < $1 RETURNING id", before)
        return [str(r[0]) for r in found]

    # -- channel state

    @lands
    async def get_channel_state(self, channel: str, name: str) -> str | None:
        found = await self._fetch("get_channel_state",
                                  "SELECT value FROM channel_state WHERE channel = $1 AND name = $2", channel, name)
        return str(found[0][0]) if found else None

    @lands
    async def set_channel_state(self, channel: str, name: str, value: str) -> None:
        await self._fetch("set_channel_state",
                          "INSERT INTO channel_state (channel, name, value, updated_at) VALUES ($1, $2, $3, $4)"
                          " ON CONFLICT (channel, name) DO UPDATE SET value = EXCLUDED.value,"
                          " updated_at = EXCLUDED.updated_at", channel, name, value, self._clock())

    @lands
    async def channel_state_names(self, channel: str, prefix: str) -> list[str]:
        found = await self._fetch("channel_state_names",
                                  "SELECT name FROM channel_state WHERE channel = $1 AND starts_with(name, $2)"
                                  " ORDER BY name COLLATE \"C\"", channel, prefix)
        return [str(r[0]) for r in found]

    @lands
    async def delete_channel_state(self, channel: str, name: str) -> None:
        await self._fetch("delete_channel_state", "DELETE FROM channel_state WHERE channel = $1 AND name = $2",
                          channel, name)

    # -- traces

    @lands
    async def append_traces(self, key: str, turn_id: str, records: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Append several trace records in one transaction, in order; values JSON cannot encode are stored
        as their ``str()``."""
        if records:
            values = rows.trace_values(records)
            async with self._transaction("append_traces") as conn:
                await conn.execute(LOCK_TRACES, TRACE_LOCK, key)
                await conn.execute(TRACES, key, turn_id, self._clock(), [k for k, _ in values], [p for _, p in values])


# --------------------------------------------------------------------------------------------- in a transaction


class _Session:
    """A session row as read under its lock, with the counter the record does not carry."""

    __slots__ = ("next_seq", "record")

    def __init__(self, row: asyncpg.Record) -> None:
        self.record = rows.session_from_row(row)
        self.next_seq = int(row[8])


async def _locked_session(conn: asyncpg.Connection, key: str, now: float) -> _Session:
    """The session row (created when missing), locked until the transaction ends."""
    return _Session(await conn.fetchrow(LOCK_SESSION, key, DEFAULT_TITLE, now))


async def _close_within(conn: asyncpg.Connection, timeout: float) -> None:
    """Close ``conn`` politely, or drop it when the server does not answer within ``timeout``."""
    try:
        await conn.close(timeout=timeout)
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError):
        conn.terminate()
