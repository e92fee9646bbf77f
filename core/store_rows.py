"""Rows to records, shared by the store backends (``core.sqlite.rows``, ``core.postgresql.rows``).

Both backends keep the same columns in the same order and the same JSON in them; they differ only in how a
text column comes back (PostgreSQL keeps message text as ``bytea``) and in how an error names them. Everything
stored was validated on the way in (pydantic models, or values the store generated), so reading rebuilds
records without validating them again: a turn reads up to ``history_limit`` messages and that cost adds up. A
row that is not what was written (an unknown role or source kind, broken JSON) fails loudly as a
``StoreError`` that never quotes the row.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any, get_args

from pydantic import TypeAdapter

from core.messages import AttachmentRef, ChatMessage, MessageSource, NewMessage, Role, SourceKind, ToolCall
from core.store import AttachmentRecord, SessionRecord, StoreError, TurnRecord

SESSION_COLUMNS = (
    "key", "title", "title_is_default", "generation", "state_version", "history_revision", "revision_seq",
    "context_start_seq", "next_seq", "created_at", "updated_at",
)
MESSAGE_COLUMNS = ("id", "session_key", "seq", "role", "content", "tool_calls", "tool_call_id", "source",
                   "received_at", "created_at")
ATTACHMENT_COLUMNS = ("id", "session_key", "kind", "name", "content_type", "size", "created_at", "claimed")
TURN_COLUMNS = ("turn_id", "session_key", "state", "target_json", "started_at", "ended_at")

_TOOL_CALLS: TypeAdapter[tuple[ToolCall, ...]] = TypeAdapter(tuple[ToolCall, ...])
_ATTACHMENTS: TypeAdapter[tuple[AttachmentRef, ...]] = TypeAdapter(tuple[AttachmentRef, ...])
_SOURCE_KINDS = frozenset(get_args(SourceKind))
_ROLES = frozenset(get_args(Role))


def session_from_row(row: Sequence[Any]) -> SessionRecord:
    """A session from its columns in ``SESSION_COLUMNS`` order (a sessions row, or a write's RETURNING)."""
    return SessionRecord.model_construct(
        key=row[0], title=row[1], title_is_default=bool(row[2]), generation=row[3], state_version=row[4],
        history_revision=row[5], revision_seq=row[6], context_start_seq=row[7], created_at=row[9],
        updated_at=row[10])


def _same(value: Any) -> Any:
    return value


def message_from_row(row: Sequence[Any], *, store: str, text: Callable[[Any], str] = _same) -> ChatMessage:
    """A message from its columns in ``MESSAGE_COLUMNS`` order; ``text`` turns the stored content and tool
    call id into ``str`` (for a backend that keeps them as bytes), ``store`` names the backend in errors."""
    try:
        source = json.loads(row[7])
        if source["kind"] not in _SOURCE_KINDS or row[3] not in _ROLES:
            raise ValueError("unknown kind or role")
        calls = json.loads(row[5]) if row[5] not in (None, "[]") else ()
        return ChatMessage.model_construct(
            id=row[0], session_key=row[1], seq=row[2], role=row[3], content=text(row[4]),
            tool_calls=tuple(ToolCall.model_construct(**c) for c in calls),
            tool_call_id=text(row[6]) if row[6] is not None else None,
            source=_source(source), received_at=row[8], created_at=row[9])
    except (TypeError, ValueError, KeyError, IndexError) as exc:
        raise StoreError(f"{store} store: read a malformed message row ({type(exc).__name__})") from None


def _source(fields: dict[str, Any]) -> MessageSource:
    """A stored source; its attachment references (few messages have any) are rebuilt as models, the only
    part validated again: ``model_construct`` would leave them plain dicts."""
    refs = fields.get("attachments")
    if refs:
        fields["attachments"] = _ATTACHMENTS.validate_python(refs)
    elif refs is not None:
        fields["attachments"] = ()
    return MessageSource.model_construct(**fields)


def tool_calls_json(message: NewMessage) -> str:
    """The ``tool_calls`` column of a new message."""
    return _TOOL_CALLS.dump_json(message.tool_calls).decode() if message.tool_calls else "[]"


def new_messages(key: str, first_seq: int, messages: Sequence[NewMessage], ids: Sequence[str],
                 now: float) -> list[ChatMessage]:
    """The records of messages a write just stored (no read back: the write reported where they went)."""
    return [
        ChatMessage.model_construct(
            id=message_id, session_key=key, seq=first_seq + offset, role=m.role, content=m.content,
            source=m.source, tool_calls=m.tool_calls, tool_call_id=m.tool_call_id, received_at=m.received_at,
            created_at=now)
        for offset, (m, message_id) in enumerate(zip(messages, ids, strict=True))
    ]


def turn_from_row(row: Sequence[Any]) -> TurnRecord:
    """A turn from its columns in ``TURN_COLUMNS`` order."""
    return TurnRecord(turn_id=row[0], session_key=row[1], state=row[2], target_json=row[3], started_at=row[4],
                      ended_at=row[5])


def attachment_from_row(row: Sequence[Any]) -> AttachmentRecord:
    """An attachment from its columns in ``ATTACHMENT_COLUMNS`` order."""
    return AttachmentRecord(id=row[0], session_key=row[1], kind=row[2], name=row[3], content_type=row[4],
                            size=row[5], created_at=row[6], claimed=bool(row[7]))


_TRACE_JSON = json.JSONEncoder(default=str, ensure_ascii=False).encode
"""One encoder for every trace payload (``json.dumps`` with options builds a new encoder per call)."""


def trace_payload(payload: dict[str, Any]) -> str:
    """A trace record's payload as JSON text: values JSON cannot encode are stored as their ``str()``, and a
    payload that still fails is marked."""
    try:
        return _TRACE_JSON(payload)
    except (TypeError, ValueError, RecursionError):  # e.g. a circular structure: the record stays, marked
        return _TRACE_JSON({"unencodable_payload": True})
