"""Subagents: the ``run_subagent`` tool and the child sessions it runs.

A ``run_subagent`` call starts a *child session*: a session of its own (its key is the parent's key with
``-sub-<12 hex>`` appended, so the key records its parent) whose first user message is the call's ``task``.
The child runs the same turn machinery as any conversation — ``TurnInputBuilder``, ``TurnRunner`` (agent
loop, merge queue, approvals, retries, compaction, overflow recovery) and ``TurnCommitter`` (history and
trace) — with the settings of its profile (system prompt, tool allow-list, ``max_turns``, model).

Streams: every event of the child's turn is forwarded into the parent turn's stream (``ToolContext.emit``,
the parent's merge queue, so it interleaves with the parent's own events by arrival) as
``Forwarded(origin, event)``; each hop prepends its child's key, so ``origin`` lists the children from the
outermost one. The child's stream begins with its ``SessionMeta``. The child's trace is its own; the
parent's trace keeps one ``SubagentEnded`` pointer per child (pushed just before the call's output).

Approvals a child asks for are decided in the parent's chat: they appear in the parent's snapshot with
their ``origin`` (``TurnController``) and are answered through ``ChatCore.decide(parent, call, origin=...)``,
which checks that the origin descends from the parent (``descends``). ``/stop`` in the parent cancels the
call's task; the child is then stopped through its own cancel signal (its pending approvals denied, its
"Stopped" notice committed in its history, the shutdown's when the bridge's shutdown stopped the parent) before
the cancellation goes on; a stop while its first write is being saved waits for that write and closes the turn
it began. A parent *abandoned* (its process lost the session's lease, ``CancelSignal.abandon``) abandons the
child too: it commits nothing, and the process that takes the session over closes the child's turn with the
parent's.

Result: the child's final answer is the call's output (cut like any tool output by the agent loop). A child
that failed (a model error after its retries, its ``max_turns``, a crash) or was stopped raises
``SubagentError``: the parent's model gets a clear failed output and carries on.

Limits, each a clear tool error: ``max_depth`` (a child at that depth cannot start another),
``max_concurrent`` (``run_subagent`` calls running at once in one turn) and the profile's allow-list
(``ChildTools``: a tool outside it is not offered to the child, and a call to it is refused unrun).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from core.agent.approvals import ApprovalBroker
from core.agent.compaction import Compactor
from core.agent.events import Forwarded, SessionMeta, SubagentEnded, SubagentOutcome, TurnEvent, trace_payload
from core.agent.loop import cut_off_reason
from core.cancel_signal import CancelSignal
from core.committer import TurnCommitter
from core.controller import TurnController
from core.failures import TurnFailure, TurnFailureKind, TurnFailurePresenter
from core.input_builder import RuntimeContext, TurnInputBuilder
from core.llm.provider import LLMProvider, LLMToolSpec
from core.messages import MessageSource, NewMessage
from core.metrics import Metrics
from core.runner import Cancelled, Completed, Failed, TurnRunner, TurnRunOutcome
from core.settings import CoreSettings, SubagentProfile
from core.snapshot import subagent_label
from core.store import SessionRecord, Store
from core.supervisor import TaskSupervisor
from core.tools.arguments import ArgumentChecker
from core.tools.base import ApprovalPolicy, Tool, ToolContext, ToolRegistry

log = logging.getLogger(__name__)

TOOL_NAME = "run_subagent"
CHILD_MARK = "-sub-"
_CHILD_SUFFIX = re.compile(r"-sub-[0-9a-f]{12}\Z")
_SUFFIX_LEN = len(CHILD_MARK) + 12
CHILD_GLOB = "*" + CHILD_MARK + "[0-9a-f]" * 12
"""Matches every child session key (SQL ``GLOB``): lists of conversations leave them out."""


class SubagentError(Exception):
    """A ``run_subagent`` call that did not give an answer; the message is the output the model gets."""


# ---- child session keys ------------------------------------------------------------------------------


def new_child_key(parent_key: str) -> str:
    return f"{parent_key}{CHILD_MARK}{uuid.uuid4().hex[:12]}"


def is_child_key(key: str) -> bool:
    return _CHILD_SUFFIX.search(key) is not None


def parent_of(key: str) -> str | None:
    """The key of the session that started child session ``key`` (None for a conversation's own key)."""
    return key[:-_SUFFIX_LEN] if is_child_key(key) else None


def descends(parent_key: str, origin: Sequence[str]) -> bool:
    """True when ``origin`` is a chain of child sessions starting at a child of ``parent_key``."""
    current = parent_key
    for key in origin:
        if parent_of(key) != current:
            return False
        current = key
    return True


# ---- the child's tools ---------------------------------------------------------------------------------


class _Refused:
    """A tool a child may not call: offered to nobody, and a call to it fails with the reason, unrun."""

    def __init__(self, spec: LLMToolSpec, reason: str) -> None:
        self._spec = spec
        self._reason = reason

    @property
    def spec(self) -> LLMToolSpec:
        return self._spec

    @property
    def approval(self) -> ApprovalPolicy | None:
        return "auto"  # nothing runs: nobody is asked to approve a call that is refused anyway

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        raise SubagentError(self._reason)


class ChildTools(ToolRegistry):
    """The parent's tools as a child session sees them: only those its profile allows (all when the profile
    names none), and ``run_subagent`` only while the child may still nest. The parent's registry stays the
    one source (an MCP server's tools, policies, schemas)."""

    def __init__(self, base: ToolRegistry, *, allowed: frozenset[str] | None, profile: str | None,
                 may_nest: bool, max_depth: int) -> None:
        super().__init__()
        self._base = base
        self._allowed = allowed
        self._profile = profile
        self._may_nest = may_nest
        self._max_depth = max_depth
        self._child_specs: tuple[LLMToolSpec, ...] | None = None

    def _refusal(self, name: str) -> str | None:
        if self._allowed is not None and name not in self._allowed:
            allowed = ", ".join(sorted(self._allowed)) or "none"
            return (f"The tool {name!r} is not allowed for subagent profile {self._profile!r} "
                    f"(its tools: {allowed}); the call was not run.")
        if name == TOOL_NAME and not self._may_nest:
            return depth_error(self._max_depth)
        return None

    def add(self, tool: Tool) -> None:
        raise TypeError("a child session's tools come from its parent's registry")

    def get(self, name: str) -> Tool | None:
        tool = self._base.get(name)
        if tool is None:
            return None
        reason = self._refusal(name)
        return tool if reason is None else _Refused(tool.spec, reason)

    def checker(self, name: str) -> ArgumentChecker | None:
        return self._base.checker(name)

    def names(self) -> list[str]:
        return [n for n in self._base.names() if self._refusal(n) is None]

    def specs(self) -> tuple[LLMToolSpec, ...]:
        if self._child_specs is None:
            self._child_specs = tuple(s for s in self._base.specs() if self._refusal(s.name) is None)
        return self._child_specs

    def policy(self, name: str) -> ApprovalPolicy:
        if self._base.get(name) is None:
            return "deny"
        if self._refusal(name) is not None:
            return "auto"
        return self._base.policy(name)


def depth_error(max_depth: int) -> str:
    return (f"run_subagent is not available here: subagents may nest at most max_depth = {max_depth} "
            f"level{'s' if max_depth != 1 else ''} deep, and this session is already at that depth. "
            "Do the task yourself.")


# ---- the tool ------------------------------------------------------------------------------------------


class SubagentTool:
    """``run_subagent``: runs one child session per call and answers with its final answer."""

    def __init__(self, *, settings: CoreSettings, store: Store, provider: LLMProvider, supervisor: TaskSupervisor,
                 broker: ApprovalBroker, tools: ToolRegistry, committer: TurnCommitter,
                 presenter: TurnFailurePresenter, metrics: Metrics | None = None) -> None:
        """``metrics``: a child's model retries count with every other (its turn is not a conversation's
        turn: turn outcomes count only those)."""
        self._settings = settings
        self._store = store
        self._provider = provider
        self._supervisor = supervisor
        self._broker = broker
        self._tools = tools
        self._committer = committer
        self._presenter = presenter
        self._metrics = metrics
        self._profiles = {p.name: p for p in settings.subagents.profiles}
        self._running: dict[tuple[str, str], int] = {}
        known = set(tools.names()) | {TOOL_NAME}
        for p in settings.subagents.profiles:
            unknown = sorted(set(p.tools or ()) - known)
            if unknown:  # a typo, or an MCP server that did not start: the profile simply lacks the tool
                log.warning("subagent profile %s lists tools that do not exist: %s", p.name, ", ".join(unknown))

    @property
    def spec(self) -> LLMToolSpec:
        properties: dict[str, Any] = {"task": {
            "type": "string", "minLength": 1,
            "description": "Everything the subagent needs to know: it sees only this text, not this conversation."}}
        description = ("Delegate a self-contained task to a subagent: a separate assistant with its own "
                       "conversation that works on the task and returns its final answer. Several calls in one "
                       "response run at the same time.")
        if self._profiles:
            properties["profile"] = {"type": "string", "enum": sorted(self._profiles),
                                     "description": "The kind of subagent to run (default: a general one)."}
            description += " Profiles: " + ", ".join(sorted(self._profiles)) + "."
        return LLMToolSpec(TOOL_NAME, description, {"type": "object", "properties": properties,
                                                    "required": ["task"], "additionalProperties": False})

    @property
    def approval(self) -> ApprovalPolicy | None:
        return "auto"  # what the child does is approved call by call, in the chat, like any turn's tools

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        limits = self._settings.subagents
        task = str(arguments.get("task", "")).strip()
        if not task:
            raise SubagentError("'task' must say what the subagent should do.")
        name = arguments.get("profile")
        profile = self._profiles.get(str(name)) if name is not None else None
        if name is not None and profile is None:
            raise SubagentError(f"There is no subagent profile {name!r} (profiles: "
                                f"{', '.join(sorted(self._profiles)) or 'none'}).")
        if context.depth >= limits.max_depth:
            raise SubagentError(depth_error(limits.max_depth))
        if context.emit is None:
            raise SubagentError("run_subagent runs only inside a turn.")
        turn = (context.session_key, context.turn_id)
        running = self._running.get(turn, 0)
        if running >= limits.max_concurrent:
            raise SubagentError(f"At most max_concurrent = {limits.max_concurrent} subagents run at once in one "
                                "reply; this call was refused. Call it again once one of them has answered.")
        self._running[turn] = running + 1
        try:
            return await self._run_child(task, profile, context, context.emit)
        finally:
            left = self._running[turn] - 1
            if left:
                self._running[turn] = left
            else:
                del self._running[turn]

    def _child_settings(self, profile: SubagentProfile | None) -> CoreSettings:
        s = self._settings
        if profile is None:
            return s
        return dataclasses.replace(s, system_prompt=profile.system_prompt or s.system_prompt,
                                   max_turns=profile.max_turns or s.max_turns, model=profile.model or s.model)

    async def _run_child(self, task: str, profile: SubagentProfile | None, context: ToolContext,
                         emit: Callable[[TurnEvent], None]) -> str:
        key = new_child_key(context.session_key)
        turn_id = uuid.uuid4().hex
        profile_name = profile.name if profile is not None else None
        label = subagent_label(profile_name, task)
        settings = self._child_settings(profile)
        controller = TurnController(turn_id, key)

        def forward(event: TurnEvent) -> None:
            emit(Forwarded((key, *event.origin), event.event) if isinstance(event, Forwarded)
                 else Forwarded((key,), event))

        controller.subscribe(forward)
        controller.apply(SessionMeta(key, context.session_key, profile_name, task, context.call_id))

        def ended(outcome: SubagentOutcome, error: str | None = None) -> None:
            emit(SubagentEnded(context.call_id, key, profile_name, task, outcome, error))

        builder = TurnInputBuilder(self._store, settings)
        record: SessionRecord | None = None
        # The write that begins the child's turn runs in a task of its own: a stop that comes while it is being
        # saved cannot take it back (a write under way lands), so the stop waits for it and, when it began the
        # turn, closes that turn as stopped (else the turn would stay "running" until the next start).
        starting = asyncio.get_running_loop().create_task(self._store.append_message(key, NewMessage(
            role="user", content=task, source=MessageSource(
                kind="user_input", from_user_id=context.requested_by, turn_id=turn_id,
                extra={"parent": context.session_key, "call_id": context.call_id, "profile": profile_name})),
            begin_turn=(turn_id, json.dumps({"subagent_of": context.session_key}))), name=f"subagent:{key}:start")
        try:
            _, began = await asyncio.shield(starting)
            record = began
            prepared = await builder.prepare(key, began.state_version,
                                             RuntimeContext(channel=context.session_key.split(":", 1)[0]))
        except asyncio.CancelledError:  # stopped while starting: a turn it began still ends, once
            if record is None:
                await asyncio.wait({starting}, timeout=self._settings.shutdown_timeout)
                if starting.done() and not starting.cancelled() and starting.exception() is None:
                    _, record = starting.result()
            if record is not None:
                await self._close(key, turn_id, Cancelled(""), record, controller)
            ended("cancelled", "stopped")
            raise
        except Exception as exc:
            log.error("subagent %s of %s could not start: %s", key, context.session_key, exc)
            if record is not None:  # its turn began: it ends as failed, with its notice
                await self._close(key, turn_id, Failed(TurnFailure(TurnFailureKind.CONTEXT_PREPARATION, repr(exc)),
                                                       ""), record, controller)
            else:
                controller.finish("failed")
            ended("failed", "it could not be started")
            raise SubagentError(f"The subagent ({label}) could not be started: its session could not be "
                                "stored or read. Try again later or do the task yourself.") from None
        may_nest = context.depth + 1 < self._settings.subagents.max_depth
        allowed = frozenset(profile.tools) if profile is not None and profile.tools is not None else None
        tools = ChildTools(self._tools, allowed=allowed, profile=profile_name, may_nest=may_nest,
                           max_depth=self._settings.subagents.max_depth)
        runner = TurnRunner(self._provider, builder, self._store, self._supervisor, settings, tools=tools,
                            broker=self._broker, compactor=Compactor(
                                self._provider, builder, settings,
                                on_model_retry=self._metrics.model_retries.inc if self._metrics is not None else None),
                            metrics=self._metrics)
        cancel = CancelSignal()
        try:
            work = self._supervisor.spawn(f"subagent:{key}", runner.run(
                prepared, controller, cancel, requested_by=context.requested_by, depth=context.depth + 1))
        except Exception:  # shutting down: the child's turn ends before it began
            await self._close(key, turn_id, Cancelled(""), record, controller)
            ended("cancelled", "stopped")
            raise SubagentError(f"The subagent ({label}) could not run: the bridge is shutting down.") from None
        try:
            outcome = await asyncio.shield(work)
        except asyncio.CancelledError:
            if context.cancel is not None and context.cancel.abandoned:
                # The parent was abandoned (its process lost the session): so is the child, which commits
                # nothing; the session's new holder closes its turn with the parent's.
                cancel.abandon()
                await asyncio.wait({work}, timeout=self._settings.shutdown_timeout)
                ended("cancelled", "stopped")
                raise
            # The parent was stopped: stop the child the same way (its approvals denied, its stop
            # committed in its own history, saying so when the bridge's shutdown stopped the parent), bounded,
            # then let the cancellation go on.
            if context.cancel is not None and context.cancel.by_shutdown:
                cancel.shutdown()
            else:
                cancel.set()
            done, _ = await asyncio.wait({work}, timeout=self._settings.shutdown_timeout)
            stopped: TurnRunOutcome = work.result() if work in done and not work.cancelled() \
                and work.exception() is None else Cancelled(controller.text)
            stopped = await self._close(key, turn_id, stopped, record, controller)
            ended("completed" if isinstance(stopped, Completed) and stopped.notice is None else "cancelled",
                  None if isinstance(stopped, Completed) else "stopped")
            raise
        except Exception as exc:  # the runner itself broke: the child still ends, once
            log.exception("subagent %s of %s crashed", key, context.session_key)
            outcome = Failed(TurnFailure(TurnFailureKind.AGENT_CREATION, repr(exc)), controller.text)
        outcome = await self._close(key, turn_id, outcome, record, controller)
        return self._answer(outcome, label, settings, ended)

    async def _close(self, key: str, turn_id: str, outcome: TurnRunOutcome, record: SessionRecord,
                     controller: TurnController) -> TurnRunOutcome:
        """Commit the child's turn (history, turn record, its own trace) and end its stream."""
        try:
            trace = [(e.kind, trace_payload(e)) for e in controller.trace]
        except Exception as exc:  # tracing never breaks a turn
            log.warning("trace of %s could not be built: %s", key, exc)
            trace = []
        committed = await self._committer.commit(key, turn_id, outcome, base_generation=record.generation,
                                                 base_state_version=record.state_version, trace=trace)
        try:  # its answer reached its parent (the call's output): nothing is left to deliver after a restart
            await self._store.mark_delivered(turn_id)
        except Exception as exc:
            log.warning("could not mark subagent turn %s delivered: %s", turn_id, exc)
        if isinstance(committed.outcome, Completed):
            controller.finish("completed", text=committed.outcome.text)
        else:
            controller.finish("failed" if isinstance(committed.outcome, Failed) else "cancelled",
                              error=committed.notice)
        return committed.outcome

    def _answer(self, outcome: TurnRunOutcome, label: str, settings: CoreSettings,
                ended: Callable[[SubagentOutcome, str | None], None]) -> str:
        if isinstance(outcome, Completed) and outcome.notice is None:
            ended("completed", None)
            last = outcome.rounds[-1].text if outcome.rounds else ""
            return last if last.strip() else outcome.text
        cut = cut_off_reason(outcome.rounds[-1].finish_reason) if isinstance(outcome, Completed) \
            and outcome.rounds else None
        if isinstance(outcome, Completed) and cut is not None:  # an answer, though not a whole one
            ended("completed", None)
            return f"{outcome.rounds[-1].text}\n\n[The subagent's answer was cut off here: {cut}.]"
        if isinstance(outcome, Completed):
            error = (f"it reached its limit of max_turns = {settings.max_turns} model requests without a final "
                     "answer")
        elif isinstance(outcome, Failed):
            error = self._presenter.failure(outcome.failure).removeprefix("⚠️ ")
        elif isinstance(outcome, Cancelled):
            ended("cancelled", "stopped")
            raise SubagentError(f"The subagent ({label}) was stopped before it answered.")
        else:
            error = "its answer could not be saved"
        ended("failed", error)
        raise SubagentError(f"The subagent ({label}) failed: {error.rstrip('.')}. You may try again or do the task "
                            "yourself.")

