"""A session write on PostgreSQL in two statements: lock the session's row, then write everything at once.

``lock_session`` creates the row when it is missing and locks it (``INSERT … ON CONFLICT DO UPDATE``, one
round trip), returning it as it is now; the caller checks its expectations against that row (a stale write
raises and its transaction rolls back, taking a row it created along). ``SessionWrite.run`` is then one
statement of data-modifying CTEs: the session's counters, its new messages (``unnest`` of arrays), the turn
record it opens or closes, its trace records, and the inbound messages it serves; for a commit the same
statement returns the messages appended since the previous revision. Fewer round trips is the point: each
one costs a send and a wake-up on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import asyncpg

from core.postgresql.rows import MESSAGE_SELECT, SESSION_SELECT

TRACE_LOCK = 0x74726163  # "trac": with a session key's hash, serialises the numbering of its trace records

LOCK_SESSION = (
    "INSERT INTO sessions (key, title, created_at, updated_at) VALUES ($1, $2, $3, $3)"
    f" ON CONFLICT (key) DO UPDATE SET key = EXCLUDED.key RETURNING {SESSION_SELECT}")

LOCK_TRACES = "SELECT pg_advisory_xact_lock($1, hashtext($2))"

TRACES = (
    "INSERT INTO traces (session_key, turn_id, seq, kind, payload, created_at)"
    " SELECT $1, $2, base.seq + t.ord, t.kind, t.payload, $3"
    " FROM unnest($4::text[], $5::text[]) WITH ORDINALITY AS t (kind, payload, ord),"
    " (SELECT COALESCE(MAX(seq), 0) AS seq FROM traces WHERE session_key = $1) AS base")

_WRITE = f"""
WITH s AS (
    UPDATE sessions SET state_version = state_version + $3, history_revision = history_revision + $4,
        generation = generation + $5, next_seq = next_seq + $6, revision_seq = COALESCE($7, revision_seq),
        context_start_seq = COALESCE($8, context_start_seq), updated_at = $2
    WHERE key = $1 RETURNING {SESSION_SELECT}
), m AS (
    INSERT INTO messages (id, session_key, seq, role, content, tool_calls, tool_call_id, source, received_at,
                          created_at, turn_id)
    SELECT n.id, $1, n.seq, n.role, n.content, n.tool_calls, n.tool_call_id, n.source, n.received_at, $2, n.turn_id
    FROM unnest($9::text[], $10::bigint[], $11::text[], $12::bytea[], $13::text[], $14::bytea[], $15::text[],
                $16::float8[], $17::text[])
        AS n (id, seq, role, content, tool_calls, tool_call_id, source, received_at, turn_id)
), b AS (
    INSERT INTO turns (turn_id, session_key, state, target_json, started_at)
    SELECT $18, $1, 'running', $19, $2 WHERE $18::text IS NOT NULL
), e AS (
    UPDATE turns SET state = $21, ended_at = $2 WHERE turn_id = $20 AND state = 'running'
), t AS (
    INSERT INTO traces (session_key, turn_id, seq, kind, payload, created_at)
    SELECT $1, $22, base.seq + x.ord, x.kind, x.payload, $2
    FROM unnest($23::text[], $24::text[]) WITH ORDINALITY AS x (kind, payload, ord),
        (SELECT COALESCE(MAX(seq), 0) AS seq FROM traces WHERE session_key = $1) AS base
), gone AS (
    DELETE FROM inbound WHERE seq = ANY($25::bigint[]) AND event_id IS NULL
), served AS (
    UPDATE inbound SET envelope = NULL WHERE seq = ANY($25::bigint[]) AND event_id IS NOT NULL
)
SELECT s.*, CASE WHEN $26::bigint IS NOT NULL THEN
    (SELECT array_agg(ROW({MESSAGE_SELECT}) ORDER BY seq) FROM messages WHERE session_key = $1 AND seq > $26)
    END AS appended
FROM s"""


@dataclass(slots=True, eq=False)
class SessionWrite:
    """What one write does to a locked session: counter deltas, new rows, and what it closes or serves."""

    add_version: int = 0
    add_revision: int = 0
    add_generation: int = 0
    revision_seq: int | None = None
    context_start_seq: int | None = None
    messages: Sequence[tuple[Any, ...]] = ()
    """``core.postgresql.rows.message_values`` rows."""
    begin_turn: tuple[str, str] | None = None
    end_turn: tuple[str, str] | None = None
    trace: tuple[str, Sequence[tuple[str, str]]] | None = None
    """(turn_id, [(kind, payload JSON), ...])."""
    serves: Sequence[int] = ()
    appended_after: int | None = None
    """Return the messages with seq above this one (a commit: those appended since the last revision)."""
    columns: list[list[Any]] = field(init=False)

    def __post_init__(self) -> None:
        # message_values order: id, key, seq, role, content, tool_calls, tool_call_id, source, received_at,
        # created_at, turn_id; key and created_at are the write's own
        picked = (0, 2, 3, 4, 5, 6, 7, 8, 10)
        self.columns = [[m[i] for m in self.messages] for i in picked]

    async def run(self, conn: asyncpg.Connection, key: str, now: float) -> asyncpg.Record:
        """The session row after the write, then ``appended`` (records of ``MESSAGE_SELECT``, or None)."""
        begin, end, trace = self.begin_turn, self.end_turn, self.trace
        if trace is not None and trace[1]:
            await conn.execute(LOCK_TRACES, TRACE_LOCK, key)
        return cast(asyncpg.Record, await conn.fetchrow(
            _WRITE, key, now, self.add_version, self.add_revision, self.add_generation, len(self.messages),
            self.revision_seq, self.context_start_seq, *self.columns,
            begin[0] if begin else None, begin[1] if begin else None, end[0] if end else None,
            end[1] if end else None, trace[0] if trace else None, [k for k, _ in trace[1]] if trace else [],
            [p for _, p in trace[1]] if trace else [], list(self.serves), self.appended_after))
