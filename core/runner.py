"""TurnRunner: runs the agent loop for one prepared turn, racing it against the turn's cancel signal.

It feeds the TurnController (the only source of snapshots) with turn events and returns a typed
TurnRunOutcome carrying the rounds to persist; it never talks to a channel and never persists (that is
the committer's job). Abort (/stop, shutdown) cancels the stream and running tools, denies pending
approvals, and emits the abort event last. A failed turn ends with an abort event too (``Abort("failed")``): what
it left waiting for approval, and the subagents still running, end as failed, not as stopped or timed out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from core.agent.approvals import ApprovalBroker
from core.agent.compaction import Compactor
from core.agent.events import Abort, ApprovalDecided, Forwarded, SubagentEnded
from core.agent.loop import AgentLoop, Round
from core.cancel_signal import CancelSignal
from core.controller import TurnController
from core.failures import TurnFailure, TurnFailureKind, provider_failure
from core.input_builder import PreparedTurnInput, Summary, TurnInputBuilder
from core.llm.provider import LLMMessage, LLMProvider, ProviderError
from core.metrics import Metrics
from core.settings import CoreSettings
from core.store import Store
from core.supervisor import TaskSupervisor
from core.tools.base import ToolRegistry

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Completed:
    text: str
    """The visible answer (every request's text, and a max_turns notice if one ended the loop)."""
    rounds: tuple[Round, ...] = ()
    notice: str | None = None
    summary: Summary | None = None
    """A compaction summary made for this turn (persisted with it)."""


@dataclass(frozen=True, slots=True)
class Cancelled:
    partial: str
    rounds: tuple[Round, ...] = ()
    summary: Summary | None = None
    by_shutdown: bool = False
    """Stopped because the bridge is shutting down, not by a user's /stop."""


@dataclass(frozen=True, slots=True)
class Failed:
    failure: TurnFailure
    partial: str
    rounds: tuple[Round, ...] = ()
    summary: Summary | None = None


@dataclass(frozen=True, slots=True)
class Stale:
    pass


TurnRunOutcome = Completed | Cancelled | Failed | Stale


class _RecoveryFailed(Exception):
    """Rebuilding the input after a context overflow failed."""


class TurnRunner:
    def __init__(self, provider: LLMProvider, builder: TurnInputBuilder, store: Store,
                 supervisor: TaskSupervisor, settings: CoreSettings, *, tools: ToolRegistry | None = None,
                 broker: ApprovalBroker | None = None, compactor: Compactor | None = None,
                 metrics: Metrics | None = None, images_rejected: Callable[[], None] | None = None) -> None:
        self._provider = provider
        self._builder = builder
        self._store = store
        self._supervisor = supervisor
        self._settings = settings
        self._tools = tools or ToolRegistry()
        self._broker = broker or ApprovalBroker()
        self._compactor = compactor
        self._images_rejected = images_rejected
        self._on_model_retry = metrics.model_retries.inc if metrics is not None else None

    async def run(self, prepared: PreparedTurnInput, controller: TurnController, cancel: CancelSignal,
                  *, requested_by: str | None = None, depth: int = 0) -> TurnRunOutcome:
        """``depth``: 0 for a conversation's own turn, one more per ``run_subagent`` level."""
        snap = controller.snapshot
        loop = AgentLoop(provider=self._provider, tools=self._tools, broker=self._broker,
                         settings=self._settings, session_key=snap.session_key, turn_id=snap.turn_id,
                         requested_by=requested_by, emit=controller.apply, spawn=self._supervisor.spawn,
                         depth=depth, on_model_retry=self._on_model_retry,
                         images_rejected=self._images_rejected, cancel=cancel)
        compaction: list[Summary] = []
        work = self._supervisor.spawn(f"turn:{snap.turn_id}:loop",
                                      self._run_loop(loop, prepared, controller, compaction))
        key = snap.session_key

        def stop() -> None:
            # In the same step as the stop: its pending approvals (and its subagents') close now, so a press
            # from here on is answered "no longer pending" and no decision starts a tool after the stop.
            self._broker.stop(key)
            work.cancel()  # /stop cancels the work directly

        unsubscribe = cancel.on_set(stop)
        unshown = controller.on_unshown(lambda call_id, origin: self._broker.unshown(
            origin[-1] if origin else key, call_id))
        try:
            await asyncio.wait({work})
        finally:
            unsubscribe()
            unshown()
            if not work.done():
                work.cancel()
                with contextlib.suppress(BaseException):
                    await work
            self._broker.resume(key)
        if work.cancelled() or cancel.is_set():
            self._abort(controller, loop.rounds)
            return Cancelled(controller.text, tuple(loop.rounds), compaction[0] if compaction else None,
                             by_shutdown=cancel.by_shutdown)
        outcome = work.result()
        if isinstance(outcome, Failed):
            self._abort(controller, loop.rounds, failed=True)
        return outcome

    @staticmethod
    def _abort(controller: TurnController, rounds: list[Round], *, failed: bool = False) -> None:
        """End what the turn left open. A stop denies each pending approval (its own and its subagents'), then
        the abort event marks what still ran as stopped. A failure (the model's stream, the loop) does it all in
        its abort event, which records the pending approvals as ended by the failure and the running subagents
        as failed, so no prompt says it was stopped or timed out.

        The round's merge queue was closed before its subagents were stopped, so their ``subagent`` pointers
        never reached the trace: they are added before the abort event, which stays the trace's last (one per
        child, as DESIGN §3 keeps them), from the round's record of its children (``Round.subagents``)."""
        if not failed:
            for pending in controller.snapshot.approvals:
                denied = ApprovalDecided(pending.call_id, "deny", "abort")
                controller.apply(Forwarded(pending.origin, denied) if pending.origin else denied)
        traced = {e.call_id for e in controller.trace if isinstance(e, SubagentEnded)}
        controller.trace.extend(ended for rnd in rounds for call_id, ended in rnd.subagents.items()
                                if call_id not in traced)
        controller.apply(Abort("failed" if failed else "stop"))

    async def _run_loop(self, loop: AgentLoop, prepared: PreparedTurnInput, controller: TurnController,
                        compaction: list[Summary]) -> TurnRunOutcome:
        summary: Summary | None = None
        if self._compactor is not None:
            prepared, summary = await self._compactor.maybe_compact(prepared, controller.apply)
            if summary is not None:
                compaction.append(summary)
        current = prepared

        async def recover(overflow: ProviderError, refused: tuple[LLMMessage, ...]) -> tuple[LLMMessage, ...]:
            nonlocal current
            try:
                current = await self._builder.recover_after_overflow(current, overflow.window_share, refused)
            except Exception as exc:
                raise _RecoveryFailed(repr(exc)) from exc
            return current.messages

        try:
            await loop.run(prepared.messages, recover)
        except ProviderError as exc:
            log.warning("model request failed for %s: %s", prepared.session_key, exc)
            return Failed(provider_failure(exc), controller.text, tuple(loop.rounds), summary)
        except _RecoveryFailed as exc:
            return Failed(TurnFailure(TurnFailureKind.CONTEXT_PREPARATION, str(exc)), controller.text,
                          tuple(loop.rounds), summary)
        except Exception as exc:  # the agent could not run (a provider bug, shutting down): still one answer
            log.exception("agent loop failed for %s", prepared.session_key)
            return Failed(TurnFailure(TurnFailureKind.AGENT_CREATION, repr(exc)), controller.text,
                          tuple(loop.rounds), summary)
        return Completed(controller.text, tuple(loop.rounds), loop.notice, summary)
