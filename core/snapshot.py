"""TurnSnapshot: the immutable, versioned picture of one turn that sinks render."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

SnapshotState = Literal["running", "completed", "cancelled", "failed"]
ToolStatus = Literal["awaiting_approval", "running", "done", "failed", "denied"]


@dataclass(frozen=True, slots=True)
class ToolActivity:
    call_id: str
    name: str
    status: ToolStatus
    summary: str = ""


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    call_id: str
    tool_name: str
    arguments_summary: str
    requested_by: str | None = None
    """The sender of the turn's message; a channel may let only them (or admins) decide."""


@dataclass(frozen=True, slots=True)
class TurnSnapshot:
    turn_id: str
    session_key: str
    version: int
    state: SnapshotState
    text: str = ""
    """The visible answer so far (the final answer once completed)."""
    tools: tuple[ToolActivity, ...] = ()
    approvals: tuple[ApprovalRequest, ...] = ()
    error: str | None = None
    """Presentable failure or cancellation notice; never a raw provider or storage error."""

    @property
    def terminal(self) -> bool:
        return self.state != "running"
