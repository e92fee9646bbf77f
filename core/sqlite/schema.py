"""The durable schema: tables and indexes, versioned by forward migrations.

``MIGRATIONS`` is an ordered list of steps; ``PRAGMA user_version`` records how many have been applied.
Opening a database applies only the missing steps, each in its own ``BEGIN IMMEDIATE`` transaction that
re-checks the version, so two processes opening the same file at once are safe. A database newer than this
code is refused rather than guessed at.

Only data lives here. The write statements and the temporary views and triggers they use belong to the
code that runs them (``core.sqlite.procedures``) and are installed per connection, so changing how a write
works never needs a migration.
"""

from __future__ import annotations

import contextlib
import sqlite3

import aiosqlite

from core.store import StoreError

Migration = tuple[str, ...]

MIN_SQLITE = (3, 35, 0)
"""RETURNING (3.35) carries every write's result back in the statement that made it."""

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
    # 4: every accepted inbound message is kept from admission until its turn starts (a crash in between
    # loses nothing), in one row with its dedupe mark. A row is *waiting* while it holds its envelope; once
    # served it keeps only the mark (channel, event_id) until expires_at. Rows without an event id have no
    # mark to keep and go when served. The dedupe marks of processed_events move over.
    (
        """
        CREATE TABLE inbound (
            seq         INTEGER PRIMARY KEY,
            channel     TEXT NOT NULL,
            event_id    TEXT,
            envelope    TEXT,
            admitted_at REAL NOT NULL,
            expires_at  REAL NOT NULL,
            UNIQUE (channel, event_id)
        )
        """,
        "CREATE INDEX inbound_waiting ON inbound (seq) WHERE envelope IS NOT NULL",
        "CREATE INDEX inbound_expiry ON inbound (expires_at) WHERE envelope IS NULL",
        """
        INSERT INTO inbound (channel, event_id, envelope, admitted_at, expires_at)
        SELECT channel, event_id, NULL, expires_at, expires_at FROM processed_events
        """,
        "DROP TABLE processed_events",
    ),
    # 5: stored attachment files (core.media): the file is <data_dir>/media/<id>; messages keep references.
    # ``claimed`` is 0 for a web upload until a message refers to it.
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
        "CREATE INDEX attachments_unclaimed ON attachments (session_key, created_at) WHERE claimed = 0",
    ),
    # 6: turns whose terminal state reached their chat (or its one fallback was tried). A turn that ended
    # (committed) without a row here was cut off by a crash between its commit and its delivery; the turns
    # that ended before this table existed count as delivered.
    (
        """
        CREATE TABLE deliveries (
            turn_id      TEXT PRIMARY KEY,
            delivered_at REAL NOT NULL
        ) WITHOUT ROWID
        """,
        """
        INSERT INTO deliveries (turn_id, delivered_at)
        SELECT turn_id, COALESCE(ended_at, started_at) FROM turns WHERE state != 'running'
        """,
        "CREATE INDEX turns_ended_at ON turns (ended_at)",
    ),
    # 7: an inbound message names the session it waits for, so one session's waiting messages are found
    # without reading every envelope (rows admitted before this step have none: only the unscoped read
    # returns them)
    (
        "ALTER TABLE inbound ADD COLUMN session_key TEXT",
        "CREATE INDEX inbound_session ON inbound (session_key, seq) WHERE envelope IS NOT NULL",
        "CREATE INDEX turns_session ON turns (session_key) WHERE state = 'running'",
    ),
)


def check_sqlite_version() -> None:
    if sqlite3.sqlite_version_info < MIN_SQLITE:
        raise StoreError(f"sqlite store: SQLite {sqlite3.sqlite_version} is too old; chatbridge needs "
                         f"{'.'.join(map(str, MIN_SQLITE))} or newer (Python's sqlite3 module links it)")


async def schema_version(conn: aiosqlite.Connection) -> int:
    rows = list(await conn.execute_fetchall("PRAGMA user_version"))
    return int(rows[0][0])


async def migrate(conn: aiosqlite.Connection, *, target: int | None = None) -> int:
    """Apply the missing ``MIGRATIONS`` steps up to ``target`` (default: all); returns the schema version.

    ``conn`` must be in autocommit mode (``isolation_level=None``)."""
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
            with contextlib.suppress(sqlite3.Error, ValueError):
                if conn.in_transaction:
                    await conn.execute("ROLLBACK")
            raise
    return version
