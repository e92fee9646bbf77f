"""The Tool protocol and the registry the agent loop draws from.

A tool has a spec the model sees, an optional approval policy of its own, and an async ``run`` that
returns text. Raising from ``run`` is allowed: the agent loop turns it into a failed tool output. The
registry compiles each tool's parameters schema once (``checker``): a call is checked against it before it
is run or offered for approval (``core.tools.arguments``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

from core.llm.provider import LLMToolSpec
from core.tools.arguments import ArgumentChecker

if TYPE_CHECKING:
    from core.agent.events import TurnEvent
    from core.cancel_signal import CancelSignal

ApprovalPolicy = Literal["auto", "ask", "deny"]
DEFAULT_APPROVAL: ApprovalPolicy = "ask"
"""A tool call waits for Allow / Deny in the chat unless the operator or the tool says otherwise."""


@dataclass(frozen=True, slots=True)
class ToolContext:
    """What a tool may know about the call it serves."""

    session_key: str
    turn_id: str
    call_id: str
    requested_by: str | None = None
    """The sender of the turn's message (who may decide approvals a tool's own work asks for)."""
    depth: int = 0
    """0 in a conversation's own turn; a subagent's turn is one deeper than its parent's."""
    emit: Callable[[TurnEvent], None] | None = None
    """Pushes a turn event (``core.agent.events``) into the turn's stream, in arrival order with the rest:
    how ``run_subagent`` forwards its child session's events. Only while ``run`` runs."""
    cancel: CancelSignal | None = None
    """The turn's cancel signal, to read (never to set): once the call is cancelled, whether its turn was
    abandoned (``abandoned``: the process lost the session, whose new holder closes what ran) rather than
    stopped, and whether the bridge's shutdown stopped it (``by_shutdown``)."""


class Tool(Protocol):
    @property
    def spec(self) -> LLMToolSpec:
        """Name, description and JSON-schema parameters, as offered to the model."""
        ...

    @property
    def approval(self) -> ApprovalPolicy | None:
        """This tool's own policy; None means the operator's default (``[agent].approval``)."""
        ...

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str: ...


class ToolRegistry:
    def __init__(self, default_policy: ApprovalPolicy = DEFAULT_APPROVAL,
                 overrides: dict[str, ApprovalPolicy] | None = None) -> None:
        self._tools: dict[str, Tool] = {}
        self._checkers: dict[str, ArgumentChecker] = {}
        self._default = default_policy
        self._overrides = dict(overrides or {})
        self._specs: tuple[LLMToolSpec, ...] | None = None

    def add(self, tool: Tool) -> None:
        name = tool.spec.name
        if name in self._tools:
            raise ValueError(f"tool {name!r} registered twice")
        self._tools[name] = tool
        self._checkers[name] = ArgumentChecker(name, tool.spec.parameters)
        self._specs = None

    def extend(self, tools: Iterable[Tool]) -> None:
        for tool in tools:
            self.add(tool)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def checker(self, name: str) -> ArgumentChecker | None:
        """The compiled parameters schema of a registered tool (None for an unknown name)."""
        return self._checkers.get(name)

    def names(self) -> list[str]:
        return sorted(self._tools)

    def specs(self) -> tuple[LLMToolSpec, ...]:
        """What the model is offered: every tool whose policy is not ``deny`` (computed once per change;
        every model request asks)."""
        if self._specs is None:
            self._specs = tuple(t.spec for name, t in sorted(self._tools.items()) if self.policy(name) != "deny")
        return self._specs

    def policy(self, name: str) -> ApprovalPolicy:
        """Operator override for this tool, else the tool's own policy, else the default.
        An unknown tool is denied."""
        if name in self._overrides:
            return self._overrides[name]
        tool = self._tools.get(name)
        if tool is None:
            return "deny"
        return tool.approval or self._default
