"""TurnCommitter: persists what a turn produced, atomically and only if the session did not move on.

Completed answers commit only when neither generation (/stop, /new) nor state_version moved since the
turn began; otherwise the turn is Stale and its answer is dropped. Cancelled and failed turns keep the
partial the user already saw. Every turn end raises history_revision by one and publishes the delta
(the user's message included), so history clients never miss a message.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from core.events import EventBus, TurnCommitted
from core.failures import TurnFailure, TurnFailureKind
from core.messages import MessageSource, NewMessage
from core.runner import Cancelled, Completed, Failed, Stale, TurnRunOutcome
from core.store import CommitResult, StaleStateError, Store, TurnState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    outcome: TurnRunOutcome
    """The outcome after the commit: a Completed that could not be persisted becomes Failed/Stale."""
    result: CommitResult | None


class TurnCommitter:
    def __init__(self, store: Store, events: EventBus) -> None:
        self._store = store
        self._events = events

    async def commit(self, key: str, turn_id: str, outcome: TurnRunOutcome, *, base_generation: int,
                     base_state_version: int) -> CommitOutcome:
        if isinstance(outcome, Completed):
            msgs = [NewMessage(role="assistant", content=outcome.text,
                               source=MessageSource(kind="assistant", turn_id=turn_id))]
            expect_gen: int | None = base_generation
        elif isinstance(outcome, (Cancelled, Failed)):
            partial = outcome.partial
            msgs = [NewMessage(role="assistant", content=partial,
                               source=MessageSource(kind="partial", turn_id=turn_id))] if partial else []
            expect_gen = None  # /stop moves the generation; the partial the user saw is still kept
        else:
            msgs, expect_gen = [], None
        try:
            try:
                result = await self._store.commit_turn(key, msgs, expect_generation=expect_gen,
                                                       expect_state_version=base_state_version,
                                                       end_turn=(turn_id, _turn_state(outcome)))
            except StaleStateError:
                log.info("turn %s in %s is stale; its output is not committed", turn_id, key)
                outcome = Stale() if isinstance(outcome, Completed) else outcome
                # Still publish a revision: the user's message must reach history clients.
                result = await self._store.commit_turn(key, [], expect_generation=None,
                                                       expect_state_version=None,
                                                       end_turn=(turn_id, _turn_state(outcome)))
        except Exception as exc:
            log.error("persisting turn %s of %s failed: %s", turn_id, key, exc)
            failure = TurnFailure(TurnFailureKind.TURN_PERSISTENCE, f"{type(exc).__name__}: {exc}")
            # Rule 1: an answer whose persistence failed is never delivered as completed, and its body
            # is never resent as a fallback (the failure notice carries no partial).
            return CommitOutcome(Failed(failure, partial=""), None)
        self._events.publish(TurnCommitted(key, result.history_revision, result.messages))
        return CommitOutcome(outcome, result)


def _turn_state(outcome: TurnRunOutcome) -> TurnState:
    if isinstance(outcome, Completed):
        return "completed"
    if isinstance(outcome, Cancelled):
        return "cancelled"
    if isinstance(outcome, Failed):
        return "failed"
    return "stale"
