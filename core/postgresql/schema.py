"""The durable schema on PostgreSQL: tables and indexes, versioned by forward migrations.

``MIGRATIONS`` is an ordered list of steps (statements, or a function where rows must be read to be
changed); the one-row table ``chatbridge_schema`` records how many have
been applied. ``migrate`` takes a transaction-scoped advisory lock (``MIGRATION_LOCK``) before it even
looks, so processes that start together against one database queue up: the first applies the missing steps,
the others then find nothing left to do. Each step commits with the version it reached. A database newer
than this code is refused rather than guessed at.

The tables hold what the SQLite schema (``core.sqlite.schema``) holds, in PostgreSQL's types: message text
is ``bytea`` (UTF-8), because PostgreSQL's ``text`` cannot hold the NUL character and a message may; the
JSON columns are ``text`` holding JSON as written (escaped, so NUL-free). ``messages.turn_id`` copies the
source's turn id, for finding a turn's answer without parsing JSON.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import cast

import asyncpg

from core.envelope import InboundEnvelope
from core.store import StoreError

log = logging.getLogger(__name__)

Step = str | Callable[[asyncpg.Connection], Awaitable[None]]
"""A statement, or a function that works on the rows (in the step's transaction)."""
Migration = tuple[Step, ...]


async def _fill_inbound_session_keys(conn: asyncpg.Connection) -> None:
    """Name the session of every waiting inbound message stored before step 2 (its key is its envelope's,
    as ``IngressRouter`` computes it on admission), so the holder of that session (or the sweeper) finds it.
    An envelope that cannot be read is dropped, with a warning, as resuming it would (``core.failover``)."""
    seqs: list[int] = []
    keys: list[str] = []
    unreadable: list[int] = []
    for seq, envelope in await conn.fetch(
            "SELECT seq, envelope FROM inbound WHERE envelope IS NOT NULL AND session_key IS NULL ORDER BY seq"):
        try:
            keys.append(InboundEnvelope.model_validate_json(envelope).key())
        except ValueError:
            unreadable.append(int(seq))
            continue
        seqs.append(int(seq))
    if seqs:
        log.info("migration: %d waiting message(s) stored before sessions had leases now name their session",
                 len(seqs))
        await conn.execute("UPDATE inbound SET session_key = k.key"
                           " FROM unnest($1::bigint[], $2::text[]) AS k (seq, key) WHERE inbound.seq = k.seq",
                           seqs, keys)
    if unreadable:
        log.warning("migration: %d waiting inbound message(s) are unreadable and are dropped", len(unreadable))
        await conn.execute("UPDATE inbound SET envelope = NULL WHERE seq = ANY($1::bigint[])", unreadable)

MIGRATION_LOCK = 0x63627267  # "cbrg": the advisory lock key every chatbridge process migrates under

MIGRATIONS: tuple[Migration, ...] = (
    # 1: everything the SQLite schema reached in its sixth step
    (
        """
        CREATE TABLE sessions (
            key               TEXT PRIMARY KEY,
            title             TEXT NOT NULL,
            title_is_default  BOOLEAN NOT NULL DEFAULT TRUE,
            generation        BIGINT NOT NULL DEFAULT 0,
            state_version     BIGINT NOT NULL DEFAULT 0,
            history_revision  BIGINT NOT NULL DEFAULT 0,
            revision_seq      BIGINT NOT NULL DEFAULT 0,
            context_start_seq BIGINT NOT NULL DEFAULT 0,
            next_seq          BIGINT NOT NULL DEFAULT 1,
            created_at        DOUBLE PRECISION NOT NULL,
            updated_at        DOUBLE PRECISION NOT NULL
        )
        """,
        'CREATE INDEX sessions_updated_at ON sessions (updated_at DESC, key COLLATE "C")',
        """
        CREATE TABLE messages (
            id           TEXT PRIMARY KEY,
            session_key  TEXT NOT NULL REFERENCES sessions (key) ON DELETE CASCADE,
            seq          BIGINT NOT NULL,
            role         TEXT NOT NULL,
            content      BYTEA NOT NULL,
            tool_calls   TEXT NOT NULL DEFAULT '[]',
            tool_call_id BYTEA,
            source       TEXT NOT NULL,
            turn_id      TEXT,
            received_at  DOUBLE PRECISION NOT NULL,
            created_at   DOUBLE PRECISION NOT NULL,
            UNIQUE (session_key, seq)
        )
        """,
        "CREATE INDEX messages_turn ON messages (session_key, turn_id) WHERE turn_id IS NOT NULL",
        """
        CREATE TABLE turns (
            turn_id     TEXT PRIMARY KEY,
            session_key TEXT NOT NULL,
            state       TEXT NOT NULL,
            target_json TEXT NOT NULL,
            started_at  DOUBLE PRECISION NOT NULL,
            ended_at    DOUBLE PRECISION
        )
        """,
        "CREATE INDEX turns_running ON turns (started_at) WHERE state = 'running'",
        "CREATE INDEX turns_ended_at ON turns (ended_at)",
        """
        CREATE TABLE deliveries (
            turn_id      TEXT PRIMARY KEY,
            delivered_at DOUBLE PRECISION NOT NULL
        )
        """,
        """
        CREATE TABLE traces (
            session_key TEXT NOT NULL,
            turn_id     TEXT NOT NULL,
            seq         BIGINT NOT NULL,
            kind        TEXT NOT NULL,
            payload     TEXT NOT NULL,
            created_at  DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (session_key, seq)
        )
        """,
        """
        CREATE TABLE channel_state (
            channel    TEXT NOT NULL,
            name       TEXT NOT NULL,
            value      TEXT NOT NULL,
            updated_at DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (channel, name)
        )
        """,
        # an accepted inbound message waits here from admission until its turn starts; once served the row
        # keeps only its dedupe mark (channel, event_id) until expires_at (see core.sqlite.schema, step 4)
        """
        CREATE TABLE inbound (
            seq         BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            channel     TEXT NOT NULL,
            event_id    TEXT,
            envelope    TEXT,
            admitted_at DOUBLE PRECISION NOT NULL,
            expires_at  DOUBLE PRECISION NOT NULL,
            UNIQUE (channel, event_id)
        )
        """,
        "CREATE INDEX inbound_waiting ON inbound (seq) WHERE envelope IS NOT NULL",
        "CREATE INDEX inbound_expiry ON inbound (expires_at) WHERE envelope IS NULL",
        """
        CREATE TABLE attachments (
            id           TEXT PRIMARY KEY,
            session_key  TEXT NOT NULL,
            kind         TEXT NOT NULL,
            name         TEXT NOT NULL,
            content_type TEXT NOT NULL,
            size         BIGINT NOT NULL,
            created_at   DOUBLE PRECISION NOT NULL,
            claimed      BOOLEAN NOT NULL DEFAULT TRUE
        )
        """,
        "CREATE INDEX attachments_created_at ON attachments (created_at)",
        "CREATE INDEX attachments_unclaimed ON attachments (session_key, created_at) WHERE NOT claimed",
    ),
    # 2: several processes on one database. An inbound message names the session it waits for (the lease
    # holder of that session reads them); a session's worker runs in the process holding its lease
    # (core.postgresql.leases), until expires_at (the server's clock) unless renewed.
    (
        "ALTER TABLE inbound ADD COLUMN session_key TEXT",
        "CREATE INDEX inbound_session ON inbound (session_key, seq) WHERE envelope IS NOT NULL",
        "CREATE INDEX turns_session ON turns (session_key) WHERE state = 'running'",
        """
        CREATE TABLE leases (
            name       TEXT PRIMARY KEY,
            owner      TEXT NOT NULL,
            expires_at TIMESTAMPTZ NOT NULL
        )
        """,
        "CREATE INDEX leases_owner ON leases (owner)",
    ),
    # 3: the messages that waited when step 2 ran were stored without their session's key: nobody would
    # serve them with several processes. Their envelopes name it.
    (_fill_inbound_session_keys,),
)

_VERSION_TABLE = "CREATE TABLE IF NOT EXISTS chatbridge_schema (version INTEGER NOT NULL)"


async def schema_version(conn: asyncpg.Connection) -> int:
    """How many ``MIGRATIONS`` steps the database has (0 for an empty database); reads only."""
    exists = await conn.fetchval("SELECT to_regclass('chatbridge_schema') IS NOT NULL")
    if not exists:
        return 0
    version = await conn.fetchval("SELECT max(version) FROM chatbridge_schema")
    return int(cast(int, version or 0))


async def migrate(conn: asyncpg.Connection, *, target: int | None = None) -> int:
    """Apply the missing ``MIGRATIONS`` steps up to ``target`` (default: all) under the advisory lock;
    returns the schema version."""
    goal = len(MIGRATIONS) if target is None else target
    while True:
        async with conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock($1)", MIGRATION_LOCK)
            await conn.execute(_VERSION_TABLE)
            version = await schema_version(conn)
            if version > len(MIGRATIONS):
                raise StoreError(f"database schema version {version} is newer than this code ({len(MIGRATIONS)})")
            if version >= goal:
                return version
            for step in MIGRATIONS[version]:
                if isinstance(step, str):
                    await conn.execute(step)
                else:
                    await step(conn)
            await conn.execute("DELETE FROM chatbridge_schema")
            await conn.execute("INSERT INTO chatbridge_schema (version) VALUES ($1)", version + 1)
