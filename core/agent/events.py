"""Typed turn events: what one turn produces, in the total order the merge queue gives them.

Partial events (``partial = True``) are the streaming fragments of a message: each segment is strictly
start → delta* → stop and is followed at once by its complete message. The trace keeps every complete
message (and every event) in stream order and skips the partials and the ``Forwarded`` events of child
sessions (``run_subagent``): a child's stream order lives in the child's own trace, the parent keeps one
``SubagentEnded`` pointer per child.

Nothing changes an event once it is made. Most are frozen dataclasses; the partials built once per streamed
token (``PartialText``, ``PartialReasoning``) are plain slotted ones, because a frozen dataclass sets each
field through ``object.__setattr__`` and that made building one more than twice as costly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from core.snapshot import ShownArgument

Phase = Literal["start", "delta", "stop"]
RequestStatus = Literal["completed", "failed", "timeout", "malformed", "aborted", "auth"]
Decision = Literal["allow", "deny"]
DecisionReason = Literal["policy", "user", "timeout", "abort", "unshown"]
OutputStatus = Literal["done", "failed", "denied", "aborted"]


@dataclass(frozen=True, slots=True)
class RequestBegin:
    kind: ClassVar[str] = "request_begin"
    partial: ClassVar[bool] = False
    request_no: int
    """1-based count of model requests in this turn (max_turns bounds it)."""
    attempt: int = 1


@dataclass(slots=True)  # not frozen: built once per streamed token (module docstring)
class PartialText:
    kind: ClassVar[str] = "partial_text"
    partial: ClassVar[bool] = True
    phase: Phase
    text: str = ""


@dataclass(frozen=True, slots=True)
class CompleteText:
    kind: ClassVar[str] = "text"
    partial: ClassVar[bool] = False
    text: str


@dataclass(slots=True)  # not frozen: built once per streamed token (module docstring)
class PartialReasoning:
    kind: ClassVar[str] = "partial_reasoning"
    partial: ClassVar[bool] = True
    phase: Phase
    text: str = ""


@dataclass(frozen=True, slots=True)
class CompleteReasoning:
    kind: ClassVar[str] = "reasoning"
    partial: ClassVar[bool] = False
    text: str


@dataclass(frozen=True, slots=True)
class PartialToolCall:
    kind: ClassVar[str] = "partial_tool_call"
    partial: ClassVar[bool] = True
    phase: Phase
    call_id: str
    name: str
    arguments: str = ""
    """The fragment of the JSON arguments carried by a ``delta``."""


@dataclass(frozen=True, slots=True)
class CompleteToolCall:
    kind: ClassVar[str] = "tool_call"
    partial: ClassVar[bool] = False
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ApprovalRequested:
    kind: ClassVar[str] = "approval_request"
    partial: ClassVar[bool] = False
    call_id: str
    tool_name: str
    arguments_summary: str
    """Every argument, one ``name=value`` line each, never cut."""
    requested_by: str | None
    arguments: tuple[ShownArgument, ...] = ()


@dataclass(frozen=True, slots=True)
class ApprovalDecided:
    kind: ClassVar[str] = "approval_decision"
    partial: ClassVar[bool] = False
    call_id: str
    decision: Decision
    reason: DecisionReason
    decided_by: str | None = None
    shown_by: str = ""
    """How the chat shows who decided (``Decider.shown``), when a user did."""


@dataclass(frozen=True, slots=True)
class PartialToolOutput:
    kind: ClassVar[str] = "partial_tool_call_output"
    partial: ClassVar[bool] = True
    phase: Phase
    call_id: str
    text: str = ""


@dataclass(frozen=True, slots=True)
class ToolOutput:
    kind: ClassVar[str] = "tool_call_output"
    partial: ClassVar[bool] = False
    call_id: str
    name: str
    output: str
    status: OutputStatus


@dataclass(frozen=True, slots=True)
class TokenUsage:
    kind: ClassVar[str] = "token_usage"
    partial: ClassVar[bool] = False
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class RequestEnd:
    kind: ClassVar[str] = "request_end"
    partial: ClassVar[bool] = False
    status: RequestStatus
    attempt: int = 1
    retry_in: float | None = None
    """Seconds until the next attempt when this attempt failed and will be retried."""


@dataclass(frozen=True, slots=True)
class CompactionBegin:
    kind: ClassVar[str] = "compaction_begin"
    partial: ClassVar[bool] = False
    messages: int


@dataclass(frozen=True, slots=True)
class CompactionEnd:
    kind: ClassVar[str] = "compaction_end"
    partial: ClassVar[bool] = False
    status: Literal["completed", "failed", "skipped"]


@dataclass(frozen=True, slots=True)
class Abort:
    kind: ClassVar[str] = "abort"
    partial: ClassVar[bool] = False
    reason: str = "stop"


@dataclass(frozen=True, slots=True)
class Notice:
    kind: ClassVar[str] = "notice"
    partial: ClassVar[bool] = False
    text: str


@dataclass(frozen=True, slots=True)
class SessionMeta:
    """The first event of a child session's stream (``run_subagent``): which session it is and why."""

    kind: ClassVar[str] = "session_meta"
    partial: ClassVar[bool] = False
    session_key: str
    parent_key: str
    profile: str | None
    task: str
    call_id: str
    """The parent's ``run_subagent`` call this child answers."""


SubagentOutcome = Literal["completed", "failed", "cancelled"]


@dataclass(frozen=True, slots=True)
class SubagentEnded:
    """The parent's pointer to one child session (its trace keeps this, never the child's messages)."""

    kind: ClassVar[str] = "subagent"
    partial: ClassVar[bool] = False
    call_id: str
    session_key: str
    profile: str | None
    task: str
    outcome: SubagentOutcome
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Forwarded:
    """An event of a child session, forwarded into its parent's stream. ``origin`` lists the child session
    keys from the outermost child to the one that produced ``event``: each forwarding hop prepends its
    child's key. The trace of a session never keeps forwarded events (each child has its own trace)."""

    kind: ClassVar[str] = "forwarded"
    partial: ClassVar[bool] = False
    origin: tuple[str, ...]
    event: ChildEvent


ChildEvent = (RequestBegin | PartialText | CompleteText | PartialReasoning | CompleteReasoning | PartialToolCall
              | CompleteToolCall | ApprovalRequested | ApprovalDecided | PartialToolOutput | ToolOutput
              | TokenUsage | RequestEnd | CompactionBegin | CompactionEnd | Abort | Notice | SessionMeta
              | SubagentEnded)
"""What a session's stream carries of its own."""

TurnEvent = ChildEvent | Forwarded


def trace_payload(event: TurnEvent) -> dict[str, Any]:
    """The event's fields as a JSON-ready dict (for the trace)."""
    return {name: getattr(event, name) for name in event.__dataclass_fields__}
