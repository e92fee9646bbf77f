"""Records to bound values, and the reads of ``core.store_rows``, for the SQLite store."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from core.messages import ChatMessage, NewMessage
from core.store import AttachmentRecord
from core.store_rows import (
    ATTACHMENT_COLUMNS,
    MESSAGE_COLUMNS,
    SESSION_COLUMNS,
    attachment_from_row,
    new_messages,
    session_from_row,
    tool_calls_json,
    trace_payload,
    turn_from_row,
)
from core.store_rows import message_from_row as _message_from_row

__all__ = ["ATTACHMENT_SELECT", "MESSAGE_SELECT", "SESSION_SELECT", "attachment_from_row", "attachment_values",
           "message_from_row", "message_values", "new_messages", "session_from_row", "traces_json",
           "turn_from_row"]

SESSION_SELECT = ", ".join(SESSION_COLUMNS)
MESSAGE_SELECT = ", ".join(MESSAGE_COLUMNS)
ATTACHMENT_SELECT = ", ".join(ATTACHMENT_COLUMNS)


def message_from_row(row: Sequence[Any]) -> ChatMessage:
    """A message from its columns in ``MESSAGE_COLUMNS`` order."""
    return _message_from_row(row, store="sqlite")


def attachment_values(record: AttachmentRecord) -> tuple[Any, ...]:
    """The values ``core.sqlite.writes.ADD_ATTACHMENT`` binds (``ATTACHMENT_COLUMNS`` order)."""
    return (record.id, record.session_key, record.kind, record.name, record.content_type, record.size,
            record.created_at, int(record.claimed))


def message_values(messages: Sequence[NewMessage], ids: Sequence[str]) -> list[tuple[Any, ...]]:
    """The values ``core.sqlite.writes`` binds for new messages (``MESSAGE_FIELDS`` order)."""
    return [(message_id, m.role, m.content, tool_calls_json(m), m.tool_call_id, m.source.model_dump_json(),
             m.received_at)
            for m, message_id in zip(messages, ids, strict=True)]


_JSON = json.JSONEncoder(ensure_ascii=False).encode


def traces_json(records: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """Trace records as the JSON array the trace insert reads: ``[[kind, payload as JSON text], ...]``
    (``core.store_rows.trace_payload``)."""
    return _JSON([[kind, trace_payload(payload)] for kind, payload in records])
