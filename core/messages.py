"""Durable conversation facts: what the store keeps and what history clients see."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["system", "user", "assistant", "tool"]
SourceKind = Literal["user_input", "assistant", "tool", "partial", "summary", "notice"]


class MessageSource(BaseModel):
    model_config = ConfigDict(frozen=True)

    kind: SourceKind
    from_channel: str | None = None
    from_user_id: str | None = None
    reply_to: str | None = None
    """Platform id of the message the user replied to (typed ReplyTo.message_id)."""
    turn_id: str | None = None
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
            **({"subagent": self.source.extra["subagent"]} if "subagent" in self.source.extra else {}),
        }
