"""TurnCommitter: persists what a turn produced, atomically and only if the session did not move on.

Completed answers commit only when neither generation (/stop, /new) nor state_version moved since the
turn began; otherwise the turn is Stale and its answer is dropped. Cancelled and failed turns keep the
partial the user already saw. Every turn end raises history_revision by one and publishes the delta
(the user's message included), so history clients never miss a message.

A turn that does not end with an answer (failed, stopped, stale) also persists its terminal notice — the
same text its chat is shown — as a message of kind "notice", in the same revision. A page that reloads, or
a client that resyncs after a restart, finds it in history instead of losing it with the live stream.
Notices are for people only: the context builder never sends them to the model. Persisting one delivers
nothing; what a chat is sent stays the executor's business (one terminal message per turn).

A turn record is closed once: a commit that finds it closed already (another process took the session
over and closed it as interrupted, ``Store.commit_turn``) writes nothing and says so (``taken_over``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from core.agent.compaction import summary_message
from core.agent.events import SubagentEnded
from core.events import EventBus, TurnCommitted
from core.failures import TurnFailure, TurnFailureKind, TurnFailurePresenter
from core.messages import MessageSource, NewMessage, ToolCall
from core.runner import Cancelled, Completed, Failed, Stale, TurnRunOutcome
from core.store import CommitResult, StaleStateError, Store, TurnEndedError, TurnState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    outcome: TurnRunOutcome
    """The outcome after the commit: a Completed that could not be persisted becomes Failed/Stale."""
    result: CommitResult | None
    """The revision holding the turn's messages; None when they could not be persisted."""
    notice: str | None
    """The terminal notice of a turn that ended without an answer (what its chat is shown), else None."""
    taken_over: bool = False
    """Nothing was committed: another process took the session over and closed the turn first (with its
    interrupted notice); the outcome is that process's, and this one delivers nothing."""


class TurnCommitter:
    def __init__(self, store: Store, events: EventBus, presenter: TurnFailurePresenter) -> None:
        self._store = store
        self._events = events
        self._presenter = presenter

    async def commit(self, key: str, turn_id: str, outcome: TurnRunOutcome, *, base_generation: int,
                     base_state_version: int,
                     trace: Sequence[tuple[str, dict[str, Any]]] = ()) -> CommitOutcome:
        """``trace`` (the turn's trace records) is written in the same transaction."""
        notice = self._notice_for(outcome)
        msgs = turn_messages(outcome, turn_id) + _notice_messages(notice, turn_id)
        # /stop moves the generation; the partial the user saw is still kept
        expect_gen: int | None = base_generation if isinstance(outcome, Completed) else None
        try:
            try:
                result = await self._store.commit_turn(key, msgs, expect_generation=expect_gen,
                                                       expect_state_version=base_state_version,
                                                       end_turn=(turn_id, _turn_state(outcome)),
                                                       trace=(turn_id, trace))
            except StaleStateError:
                log.info("turn %s in %s is stale; its output is not committed", turn_id, key)
                outcome = Stale() if isinstance(outcome, Completed) else outcome
                notice = self._notice_for(outcome)
                # Still publish a revision: the user's message (and the notice) must reach history clients.
                result = await self._store.commit_turn(key, _notice_messages(notice, turn_id),
                                                       expect_generation=None, expect_state_version=None,
                                                       end_turn=(turn_id, _turn_state(outcome)),
                                                       trace=(turn_id, trace))
        except TurnEndedError:
            log.warning("turn %s of %s was closed by the process that took the session over; its output is "
                        "not committed", turn_id, key)
            return CommitOutcome(outcome, None, None, taken_over=True)
        except Exception as exc:
            log.error("persisting turn %s of %s failed: %s", turn_id, key, exc)
            failure = TurnFailure(TurnFailureKind.TURN_PERSISTENCE, f"{type(exc).__name__}: {exc}")
            # Rule 1: an answer whose persistence failed is never delivered as completed, and its body
            # is never resent as a fallback (the failure notice carries no partial).
            failed = self._presenter.failure(failure)
            # The notice alone may still fit (the write may have failed on the answer); if it lands, a
            # reload shows the user's message with it rather than a question that seems unanswered.
            await self.commit_notice(key, turn_id, failed)
            return CommitOutcome(Failed(failure, partial=""), None, failed)
        self._events.publish(TurnCommitted(key, result.history_revision, result.messages))
        return CommitOutcome(outcome, result, notice)

    async def commit_notice(self, key: str, turn_id: str | None, text: str) -> CommitResult | None:
        """Persist one bridge notice as its own revision (with whatever was persisted since the previous
        revision, e.g. the message of a turn a crash interrupted) and publish it; None when that fails
        (logged: a notice never breaks what it reports on)."""
        try:
            result = await self._store.commit_turn(key, _notice_messages(text, turn_id),
                                                   expect_generation=None, expect_state_version=None)
        except Exception as exc:
            log.error("persisting a notice in %s failed: %s", key, exc)
            return None
        self._events.publish(TurnCommitted(key, result.history_revision, result.messages))
        return result

    def _notice_for(self, outcome: TurnRunOutcome) -> str | None:
        """The terminal notice of a turn without an answer: its failure, or that it was stopped."""
        if isinstance(outcome, Completed):
            return None
        if isinstance(outcome, Failed):
            return self._presenter.failure(outcome.failure)
        return self._presenter.cancelled("", by_shutdown=isinstance(outcome, Cancelled) and outcome.by_shutdown)


def turn_messages(outcome: TurnRunOutcome, turn_id: str) -> list[NewMessage]:
    """What a turn persists, in order: its compaction summary, then per model request either the
    assistant's tool calls followed by one result per call (call order), or its text; a max_turns notice
    last. A cancelled or failed turn keeps what the user saw (text as "partial"); a tool call it did not
    finish gets a synthetic result saying so (the note the next context sees)."""
    if isinstance(outcome, Stale):
        return []
    msgs: list[NewMessage] = []
    if outcome.summary is not None:
        msgs.append(summary_message(outcome.summary, turn_id))
    completed = isinstance(outcome, Completed)
    if not outcome.rounds:
        text = outcome.text if isinstance(outcome, Completed) else outcome.partial
        if completed or text:
            msgs.append(NewMessage(role="assistant", content=text, source=MessageSource(
                kind="assistant" if completed else "partial", turn_id=turn_id)))
        return msgs
    for i, rnd in enumerate(outcome.rounds):
        if rnd.calls:
            msgs.append(NewMessage(
                role="assistant", content=rnd.text,
                tool_calls=tuple(ToolCall(id=c.call_id, name=c.name, arguments=c.arguments) for c in rnd.calls),
                source=MessageSource(kind="assistant", turn_id=turn_id)))
            msgs.extend(NewMessage(role="tool", content=rnd.output_for(c.call_id), tool_call_id=c.call_id,
                                   source=MessageSource(kind="tool", turn_id=turn_id,
                                                        extra=_tool_extra(c.name, rnd.subagents.get(c.call_id))))
                        for c in rnd.calls)
        elif rnd.text or (completed and i == len(outcome.rounds) - 1):
            msgs.append(NewMessage(role="assistant", content=rnd.text, source=MessageSource(
                kind="assistant" if completed else "partial", turn_id=turn_id)))
    if isinstance(outcome, Completed) and outcome.notice:
        msgs.append(notice_message(outcome.notice, turn_id))
    return msgs


def _tool_extra(name: str, child: SubagentEnded | None) -> dict[str, Any]:
    """A tool result's extra facts: the tool's name, and for ``run_subagent`` the child session it ran (so a
    client can show the child's own history)."""
    if child is None:
        return {"name": name}
    return {"name": name, "subagent": {"session_key": child.session_key, "profile": child.profile,
                                       "task": child.task, "outcome": child.outcome, "error": child.error}}


def notice_message(text: str, turn_id: str | None) -> NewMessage:
    """A bridge notice in history: shown to people, never sent to the model (``core.input_builder``)."""
    return NewMessage(role="assistant", content=text, source=MessageSource(kind="notice", turn_id=turn_id))


def _notice_messages(notice: str | None, turn_id: str | None) -> list[NewMessage]:
    return [notice_message(notice, turn_id)] if notice else []


def _turn_state(outcome: TurnRunOutcome) -> TurnState:
    if isinstance(outcome, Completed):
        return "completed"
    if isinstance(outcome, Cancelled):
        return "cancelled"
    if isinstance(outcome, Failed):
        return "failed"
    return "stale"
