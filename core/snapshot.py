"""TurnSnapshot: the immutable, versioned picture of one turn that sinks render.

Snapshots are built on demand (when a sink pulls one), never per streamed token; ``text_epoch`` lets a
sink stream increments: while it is unchanged, each snapshot's text extends the previous one's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

SnapshotState = Literal["running", "completed", "cancelled", "failed"]
ToolStatus = Literal["awaiting_approval", "running", "done", "failed", "denied"]


@dataclass(frozen=True, slots=True)
class ToolActivity:
    call_id: str
    name: str
    status: ToolStatus
    summary: str = ""


class ShownArgument(NamedTuple):
    """One argument of a call waiting for approval, as the person deciding sees it."""

    name: str
    value: str
    """The value as JSON text, in full (characters that would not show as themselves escaped)."""
    key: bool
    """A required argument: it says what the call does (fetch_url's url). Shown first and never
    shortened; a channel short of room shortens only the others."""


@dataclass(frozen=True, slots=True)
class ApprovalRequest:
    call_id: str
    tool_name: str
    arguments_summary: str
    """Every argument, one ``name=value`` line each, never cut (what a channel without a limit shows)."""
    requested_by: str | None = None
    """The sender of the turn's message; a channel may let only them (or admins) decide."""
    arguments: tuple[ShownArgument, ...] = ()
    """The same arguments one by one, key ones first, for a channel that has to fit a length limit."""


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
    text_epoch: int = 0
    """Rises whenever the text was replaced rather than extended (a retried model request starts over). Two
    snapshots of one turn with the same epoch: the newer text starts with the older one."""

    @property
    def terminal(self) -> bool:
        return self.state != "running"
