"""Records to bound values, and the reads of ``core.store_rows``, for the PostgreSQL store.

Message text and tool call ids are ``bytea`` (``core.postgresql.schema``): they are encoded to UTF-8 on the
way in (an unpaired surrogate fails there, as it does in SQLite) and decoded on the way out.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.messages import ChatMessage, NewMessage
from core.store import AttachmentRecord
from core.store_rows import (
    ATTACHMENT_COLUMNS,
    MESSAGE_COLUMNS,
    SESSION_COLUMNS,
    TURN_COLUMNS,
    attachment_from_row,
    new_messages,
    session_from_row,
    tool_calls_json,
    trace_payload,
    turn_from_row,
)
from core.store_rows import message_from_row as _message_from_row

__all__ = ["ATTACHMENT_SELECT", "MESSAGE_SELECT", "SESSION_COLUMNS", "SESSION_SELECT", "TURN_SELECT",
           "attachment_from_row", "attachment_values", "message_from_row", "message_values", "new_messages",
           "session_from_row", "trace_values", "turn_from_row"]

SESSION_SELECT = ", ".join(SESSION_COLUMNS)
MESSAGE_SELECT = ", ".join(MESSAGE_COLUMNS)
ATTACHMENT_SELECT = ", ".join(ATTACHMENT_COLUMNS)
TURN_SELECT = ", ".join(TURN_COLUMNS)


def _decoded(value: Any) -> str:
    return bytes(value).decode()


def message_from_row(row: Sequence[Any]) -> ChatMessage:
    """A message from its columns in ``MESSAGE_COLUMNS`` order."""
    return _message_from_row(row, store="postgresql", text=_decoded)


def message_values(key: str, first_seq: int, messages: Sequence[NewMessage], ids: Sequence[str],
                   now: float) -> list[tuple[Any, ...]]:
    """The rows to insert into ``messages`` (``MESSAGE_COLUMNS`` order, then ``turn_id``)."""
    return [(message_id, key, first_seq + offset, m.role, m.content.encode(), tool_calls_json(m),
             m.tool_call_id.encode() if m.tool_call_id is not None else None, m.source.model_dump_json(),
             m.received_at, now, m.source.turn_id)
            for offset, (m, message_id) in enumerate(zip(messages, ids, strict=True))]


def attachment_values(record: AttachmentRecord) -> tuple[Any, ...]:
    return (record.id, record.session_key, record.kind, record.name, record.content_type, record.size,
            record.created_at, record.claimed)


def trace_values(records: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[str, str]]:
    """(kind, payload as JSON text) per trace record (``core.store_rows.trace_payload``)."""
    return [(kind, trace_payload(payload)) for kind, payload in records]
