"""Durable conversation facts: what the store keeps and what history clients see."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["system", "user", "assistant", "tool"]
SourceKind = Literal["user_input", "assistant", "tool", "partial", "summary", "notice"]
AttachmentKind = Literal["image", "text", "pdf", "audio", "video", "file"]
"""What an attachment is, by its bytes (``core.media.sniff``), not by its name or the platform's word."""


class AttachmentRef(BaseModel):
    """What a message keeps of one attachment: a reference to the stored file (``id``; None when nothing was
    kept) with what the user and the model are told about it. The file itself lives in the media store and
    expires; the reference, and ``text`` (what the model reads of it), stay with the message."""

    model_config = ConfigDict(frozen=True)

    id: str | None = None
    kind: AttachmentKind = "file"
    name: str = ""
    """For display only (made safe for it); never part of a path."""
    size: int | None = None
    content_type: str | None = None
    """Sniffed from the bytes; None when the file was never read."""
    width: int | None = None
    height: int | None = None
    text: str | None = None
    """What the model reads of it: a document's text within the budget (cut marked), a transcript."""
    pages: int | None = None
    note: str | None = None
    """Why its content is not available (too large, could not be downloaded, ...), in a few words."""

    def history_view(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind, "name": self.name, "size": self.size,
                "content_type": self.content_type, "note": self.note}


class MessageSource(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: SourceKind
    from_channel: str | None = None
    from_user_id: str | None = None
    reply_to: str | None = None
    """Platform id of the message the user replied to (typed ReplyTo.message_id)."""
    turn_id: str | None = None
    attachments: tuple[AttachmentRef, ...] = Field(default=(), exclude_if=lambda refs: not refs)
    """What the user sent along with the text (user_input), or what a compaction summary stands for. Left out
    of the stored JSON when empty (most messages have none)."""
    extra: dict[str, Any] = Field(default_factory=dict)


class ToolCall(BaseModel):
    model_config = ConfigDict(frozen=True)

    id: str
    name: str
    arguments: str  # JSON text as the model produced it


class NewMessage(BaseModel):
    """A message about to be persisted (no id or seq yet)."""

    model_config = ConfigDict(frozen=True)

    role: Role
    content: str
    source: MessageSource
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    received_at: float = Field(default_factory=time.time)


class ChatMessage(BaseModel):
    """A persisted message. ``id`` is globally unique; ``seq`` is monotonic within its session."""

    model_config = ConfigDict(frozen=True)

    id: str
    session_key: str
    seq: int
    role: Role
    content: str
    source: MessageSource
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    received_at: float
    created_at: float

    def history_view(self) -> dict[str, Any]:
        """The client-facing projection: internal sender ids are not exposed."""
        return {
            "id": self.id,
            "seq": self.seq,
            "role": self.role,
            "content": self.content,
            "created_at": self.created_at,
            "kind": self.source.kind,
            "tool_calls": [tc.model_dump() for tc in self.tool_calls],
            "tool_call_id": self.tool_call_id,
            "turn_id": self.source.turn_id,
            "attachments": [a.history_view() for a in self.source.attachments],
            **({"subagent": self.source.extra["subagent"]} if "subagent" in self.source.extra else {}),
        }
