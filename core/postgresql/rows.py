"""Rows to records and records to bound values, for the PostgreSQL store.

Message text and tool call ids are ``bytea`` (``core.postgresql.schema``): they are encoded to UTF-8 on the
way in (an unpaired surrogate fails there, as it does in SQLite) and decoded on the way out. Everything
stored was validated on the way in, so records are rebuilt without validating again; a row that is not what
was written fails as a ``StoreError`` that never quotes the row.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, get_args

from pydantic import TypeAdapter

from core.messages import AttachmentRef, ChatMessage, MessageSource, NewMessage, Role, SourceKind, ToolCall
from core.store import AttachmentRecord, SessionRecord, StoreError, TurnRecord

SESSION_COLUMNS = (
    "key", "title", "title_is_default", "generation", "state_version", "history_revision", "revision_seq",
    "context_start_seq", "next_seq", "created_at", "updated_at",
)
SESSION_SELECT = ", ".join(SESSION_COLUMNS)
MESSAGE_COLUMNS = ("id", "session_key", "seq", "role", "content", "tool_calls", "tool_call_id", "source",
                   "received_at", "created_at")
MESSAGE_SELECT = ", ".join(MESSAGE_COLUMNS)
ATTACHMENT_COLUMNS = ("id", "session_key", "kind", "name", "content_type", "size", "created_at", "claimed")
ATTACHMENT_SELECT = ", ".join(ATTACHMENT_COLUMNS)
TURN_SELECT = "turn_id, session_key, state, target_json, started_at, ended_at"

_TOOL_CALLS: TypeAdapter[tuple[ToolCall, ...]] = TypeAdapter(tuple[ToolCall, ...])
_ATTACHMENTS: TypeAdapter[tuple[AttachmentRef, ...]] = TypeAdapter(tuple[AttachmentRef, ...])
_SOURCE_KINDS = frozenset(get_args(SourceKind))
_ROLES = frozenset(get_args(Role))


def session_from_row(row: Sequence[Any]) -> SessionRecord:
    """A session from its columns in ``SESSION_COLUMNS`` order."""
    return SessionRecord.model_construct(
        key=row[0], title=row[1], title_is_default=bool(row[2]), generation=row[3], state_version=row[4],
        history_revision=row[5], revision_seq=row[6], context_start_seq=row[7], created_at=row[9],
        updated_at=row[10])


def message_from_row(row: Sequence[Any]) -> ChatMessage:
    """A message from its columns in ``MESSAGE_COLUMNS`` order."""
    try:
        source = json.loads(row[7])
        if source["kind"] not in _SOURCE_KINDS or row[3] not in _ROLES:
            raise ValueError("unknown kind or role")
        calls = json.loads(row[5]) if row[5] not in (None, "[]") else ()
        return ChatMessage.model_construct(
            id=row[0], session_key=row[1], seq=row[2], role=row[3], content=bytes(row[4]).decode(),
            tool_calls=tuple(ToolCall.model_construct(**c) for c in calls),
            tool_call_id=bytes(row[6]).decode() if row[6] is not None else None,
            source=_source(source), received_at=row[8], created_at=row[9])
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise StoreError(f"postgresql store: read a malformed message row ({type(exc).__name__})") from None


def _source(fields: dict[str, Any]) -> MessageSource:
    """A stored source; its attachment references are rebuilt as models (``model_construct`` would leave
    them plain dicts)."""
    refs = fields.get("attachments")
    if refs:
        fields["attachments"] = _ATTACHMENTS.validate_python(refs)
    elif refs is not None:
        fields["attachments"] = ()
    return MessageSource.model_construct(**fields)


def message_values(key: str, first_seq: int, messages: Sequence[NewMessage], ids: Sequence[str],
                   now: float) -> list[tuple[Any, ...]]:
    """The rows to insert into ``messages`` (``MESSAGE_COLUMNS`` order, then ``turn_id``)."""
    return [(message_id, key, first_seq + offset, m.role, m.content.encode(),
             _TOOL_CALLS.dump_json(m.tool_calls).decode() if m.tool_calls else "[]",
             m.tool_call_id.encode() if m.tool_call_id is not None else None, m.source.model_dump_json(),
             m.received_at, now, m.source.turn_id)
            for offset, (m, message_id) in enumerate(zip(messages, ids, strict=True))]


def new_messages(key: str, first_seq: int, messages: Sequence[NewMessage], ids: Sequence[str],
                 now: float) -> list[ChatMessage]:
    """The records of messages a write just stored (no read back)."""
    return [
        ChatMessage.model_construct(
            id=message_id, session_key=key, seq=first_seq + offset, role=m.role, content=m.content,
            source=m.source, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id, received_at=m.received_at,
            created_at=now)
        for offset, (m, message_id) in enumerate(zip(messages, ids, strict=True))
    ]


def turn_from_row(row: Sequence[Any]) -> TurnRecord:
    """A turn from ``TURN_SELECT``'s columns."""
    return TurnRecord(turn_id=row[0], session_key=row[1], state=row[2], target_json=row[3], started_at=row[4],
                      ended_at=row[5])


def attachment_from_row(row: Sequence[Any]) -> AttachmentRecord:
    """An attachment from its columns in ``ATTACHMENT_COLUMNS`` order."""
    return AttachmentRecord(id=row[0], session_key=row[1], kind=row[2], name=row[3], content_type=row[4],
                            size=row[5], created_at=row[6], claimed=bool(row[7]))


def attachment_values(record: AttachmentRecord) -> tuple[Any, ...]:
    return (record.id, record.session_key, record.kind, record.name, record.content_type, record.size,
            record.created_at, record.claimed)


_TRACE_JSON = json.JSONEncoder(default=str, ensure_ascii=False).encode


def trace_values(records: Sequence[tuple[str, dict[str, Any]]]) -> list[tuple[str, str]]:
    """(kind, payload as JSON text) per trace record; values JSON cannot encode are stored as their
    ``str()``, and a payload that still fails is marked."""
    return [(kind, _trace_payload(payload)) for kind, payload in records]


def _trace_payload(payload: dict[str, Any]) -> str:
    try:
        return _TRACE_JSON(payload)
    except (TypeError, ValueError, RecursionError):  # e.g. a circular structure: the record stays, marked
        return _TRACE_JSON({"unencodable_payload": True})
