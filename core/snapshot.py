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
    origin: tuple[str, ...] = ()
    """Empty for the turn's own calls; for a call of a child session (``run_subagent``) the child session
    keys from the outermost child to the one asking. A decision names it (``ChatCore.decide``)."""
    label: str | None = None
    """Who asks, for a child's call: its profile and task, short (channels show it with the request)."""


@dataclass(frozen=True, slots=True)
class ApprovalOutcome:
    """How one approval request of the turn ended, so that every prompt that showed it can say so."""

    call_id: str
    origin: tuple[str, ...]
    """As the request's (``ApprovalRequest.origin``)."""
    decision: Literal["allow", "deny"]
    reason: Literal["policy", "user", "timeout", "abort", "unshown"]
    shown_by: str = ""
    """Who decided, as the chat shows them (when a user did and their channel named them)."""


ChildState = Literal["running", "completed", "failed", "cancelled"]


@dataclass(frozen=True, slots=True)
class ChildActivity:
    """One child session (``run_subagent``) of the turn, for a compact status line."""

    origin: tuple[str, ...]
    """The child session keys from the outermost child to this one (its own key last)."""
    call_id: str
    profile: str | None
    task: str
    state: ChildState = "running"
    step: str = "starting"
    """What it does now: ``starting``, ``thinking``, ``writing``, ``waiting for approval: <tool>`` or the
    name of the tool it runs."""

    @property
    def label(self) -> str:
        return subagent_label(self.profile, self.task)


def subagent_label(profile: str | None, task: str, limit: int = 48) -> str:
    """A child as people see it: its profile (if it has one) and the start of its task."""
    task = " ".join(task.split())
    if len(task) > limit:
        task = task[: limit - 1] + "…"
    if profile:
        return f"{profile}: {task}" if task else profile
    return task or "subagent"


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
    """The requests waiting for a decision."""
    decided: tuple[ApprovalOutcome, ...] = ()
    """How the requests that no longer wait ended, in the order they did."""
    error: str | None = None
    """Presentable failure or cancellation notice; never a raw provider or storage error."""
    text_epoch: int = 0
    """Rises whenever the text was replaced rather than extended (a retried model request starts over). Two
    snapshots of one turn with the same epoch: the newer text starts with the older one."""
    children: tuple[ChildActivity, ...] = ()
    """The child sessions this turn started (``run_subagent``), nested ones included, in start order."""

    @property
    def terminal(self) -> bool:
        return self.state != "running"
