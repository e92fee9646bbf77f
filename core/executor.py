"""ConversationExecutor: the flow of one turn, top to bottom.

1. fetch the message's attachments (bounded; ``core.media.intake``), persist the user message (source:
   channel, sender, received_at, reply_to, attachment references; its inbound record is served), tell the
   user about refused attachments. The attachments are fetched here, not at admission: a message resumed
   after a restart carries its envelope's attachments, and they are fetched (or found stored) then.
2. TurnInputBuilder.prepare (system prompt + context + runtime context, once)
3. TurnRunner (model ⟂ cancel; at most one overflow recovery); an answer without a word gets a notice saying
   so, so a message never ends with nothing in the chat
4. TurnCommitter (generation/state_version check, atomic persistence — a turn without an answer keeps
   its terminal notice in history — then the terminal snapshot)
5. DeliveryHandle.wait → plain fallback at most once; the turn is marked delivered only when the chat shows
   its terminal content, else the missing text is sent again later (``core.redelivery``)
6. TitleService.schedule (background)

A shutdown that comes during step 1 (fetching the attachments) ends the turn there, storing nothing, like a
turn abandoned there: the message's inbound record stays waiting, and the next start answers it, fetching
its attachments then (a partial download is never kept: ``core.media.files``). A user's ``/stop`` during
step 1 instead stores the message with its attachments unread and stops its turn, as it stops any turn.

A turn whose process lost the session to another one (``CancelSignal.abandon`` when the lease was lost, or
a commit that finds the turn closed by the new holder) ends before step 4 or at it: it commits nothing,
sends no terminal message and no fallback, and its live view stops where it is. The new holder closes it
with its interrupted notice (``core.failover``): the chat sees one terminal outcome. When both
processes read a message as waiting (the old holder's lease ran out while its step 1 was on its way), the
first write to land serves it and the other's step 1 finds it no longer waiting (``InboundServedError``):
that turn ends there, showing nothing; the first one's turn, or the notice closing it, answers the message.

A shutdown stops the running turns (each commits and shows its stopped notice) and waits for their delivery
only within its bound; one that runs out cancels the wait in step 5 (``DeliveryHandle.cut``). What happens
next is decided by the same truth as every fallback, the sink's ledger (``channels.common.ledger``: it
changes only on a platform's answer), plus the one thing a ledger cannot know: whether a final edit was on
its way when the abort came (``TurnSink.final_in_doubt``; Telegram, say, carries an edit out and answers
late). A turn whose chat shows all of its terminal text is marked delivered. A stopped or failed turn whose
final edit was cut off on its way is marked delivered too: that edit may have landed, and the next start's
redelivery (``ChatCore._redeliver``), an ordinary new message that cannot edit or recognise the one the
platform may show, would then be a second terminal message (rule 6); its partial answer is in the message
the edit was for, where it stays (rule 4: never sent again), and what may be missing is the stopped or
failure notice under it. Any other cut turn stays undelivered and the next start sends its terminal message
once, as after a crash: a completed answer is never given up on a maybe (it may then show twice, as after
a final edit that timed out). Waiting longer instead would not help: the bound is the operator's, and a
platform answering late answers later than any bound inside it. The turn's log line names how it had
ended and what its cut delivery left (``cancelled (the shutdown cut its final edit on its way; …)``), not
"abandoned", which stays for a turn cut before it ended.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import Any

from core.agent.events import trace_payload
from core.cancel_signal import CancelSignal
from core.committer import TurnCommitter
from core.context_cache import ContextCache
from core.controller import TurnController
from core.delivery import (
    Cut,
    DeliveryError,
    DeliveryHandle,
    DeliveryStartError,
    PlainSender,
    TurnDeliveryService,
    Unshown,
)
from core.envelope import InboundEnvelope, TurnTarget
from core.events import EventBus, TurnStarted
from core.failures import TurnFailure, TurnFailureKind, TurnFailurePresenter
from core.input_builder import RuntimeContext, TurnInputBuilder, quote_extra
from core.media.intake import AttachmentIntake, Intake, unread
from core.messages import MessageSource, NewMessage
from core.metrics import Metrics
from core.redelivery import Redelivery
from core.runner import Cancelled, Completed, Failed, Stale, TurnRunner, TurnRunOutcome
from core.settings import CoreSettings
from core.snapshot import TurnSnapshot
from core.store import InboundServedError, Store, TurnState
from core.title import TitleService
from core.turn_log import TurnOutcome, turn_scope

log = logging.getLogger(__name__)

ABANDONED = "abandoned (the session moved to another process)"
"""How a turn ends in its log line when its process lost the session's lease (``CancelSignal.abandon``)."""
SERVED_ELSEWHERE = "skipped (the message was served by another process)"
"""How a turn ends in its log line when its message was no longer waiting (``InboundServedError``)."""
LEFT_FOR_RESTART = "abandoned (the shutdown came while its attachments were fetched; the next start answers it)"
"""How a turn ends in its log line when the shutdown stopped its step 1: its stored message waits for the next
start, which answers it."""


class ConversationExecutor:
    def __init__(self, *, store: Store, builder: TurnInputBuilder, runner: TurnRunner,
                 committer: TurnCommitter, delivery: TurnDeliveryService, plain: PlainSender,
                 redelivery: Redelivery,
                 presenter: TurnFailurePresenter, titles: TitleService, events: EventBus,
                 settings: CoreSettings, metrics: Metrics | None = None,
                 intake: AttachmentIntake | None = None) -> None:
        self._store = store
        self._builder = builder
        self._runner = runner
        self._committer = committer
        self._delivery = delivery
        self._plain = plain
        self._redelivery = redelivery
        self._presenter = presenter
        self._titles = titles
        self._events = events
        self._settings = settings
        self._intake = intake
        self._on_turn_end = metrics.turn_ended if metrics is not None else None

    async def execute(self, envelope: InboundEnvelope, cancel: CancelSignal, context: ContextCache, *,
                      inbound: int | None = None) -> str:
        """Run one turn; returns how it ended (its log line's words, e.g. ``SERVED_ELSEWHERE``). ``context``
        is the session worker's cache of its context between turns; ``inbound`` is the message's stored
        inbound record (``Store.admit_inbound``), served by step 1.

        Everything logged for the turn (in tasks it spawns too) carries its id; it ends with one INFO line."""
        turn_id = uuid.uuid4().hex
        with turn_scope(turn_id, envelope.key(), self._on_turn_end) as result:
            result.outcome = await self._execute(envelope, cancel, context, turn_id, inbound, result)
        return result.outcome

    async def _execute(self, envelope: InboundEnvelope, cancel: CancelSignal, context: ContextCache,
                       turn_id: str, inbound: int | None, result: TurnOutcome) -> str:
        """The six steps; returns how the turn ended (for the turn's log line; ``result.cut`` says it when
        the shutdown cuts step 5)."""
        target = envelope.target()
        key = target.session_key

        # 1. fetch the attachments, then persist the user message with their references
        attachments = await self._take_attachments(envelope, cancel)
        if cancel.abandoned:  # the session moved to another process: it answers the stored message
            return ABANDONED
        if cancel.by_shutdown and inbound is not None:
            # the shutdown (not a user's /stop) came while the attachments were fetched: nothing is stored, the
            # message stays waiting and the next start answers it, its attachments fetched then
            log.info("the shutdown came while the attachments of a message in %s were fetched; the next start "
                     "answers it", key)
            return LEFT_FOR_RESTART
        try:
            message, record = await self._store.append_message(key, NewMessage(
                role="user", content=envelope.content, received_at=envelope.received_at,
                source=MessageSource(kind="user_input", from_channel=envelope.channel,
                                     from_user_id=envelope.sender_id, turn_id=turn_id,
                                     reply_to=envelope.reply_to.message_id if envelope.reply_to else None,
                                     attachments=attachments.refs, extra=quote_extra(envelope.reply_to))),
                begin_turn=(turn_id, target.model_dump_json()),  # the reply target survives a crash
                serves=inbound)  # from here on the turn record stands for the message
            base_generation, base_state_version = record.generation, record.state_version
        except InboundServedError:
            # another process's turn stands for it (see the module docstring): its one answer comes from there
            context.clear()
            log.warning("a message in %s was served by another process; nothing to do here", key)
            return SERVED_ELSEWHERE
        except Exception as exc:
            context.clear()
            log.error("persisting the user message in %s failed: %s", key, exc)
            await self._forget(inbound)
            await self._plain.send(target, self._presenter.failure(TurnFailure(TurnFailureKind.INPUT_PERSISTENCE)))
            return f"failed ({TurnFailureKind.INPUT_PERSISTENCE.value})"
        context.appended(message, record)
        if attachments.notes:
            await self._plain.send(target, attachments.note_text() or "")

        controller = TurnController(turn_id, key)
        self._events.publish(TurnStarted(key, turn_id, controller))
        handle = await self._start_delivery(target, controller)

        # 2.-3. prepare the input and run the model
        outcome: TurnRunOutcome
        try:
            runtime = RuntimeContext(channel=envelope.channel, sender_name=envelope.sender_name)
            prepared = await self._builder.prepare(key, base_state_version, runtime, context)
        except Exception as exc:
            log.error("preparing the context of %s failed: %s", key, exc)
            outcome = Failed(TurnFailure(TurnFailureKind.CONTEXT_PREPARATION, repr(exc)), "")
        else:
            try:
                outcome = await self._runner.run(prepared, controller, cancel, requested_by=envelope.sender_id)
            except Exception as exc:  # the agent could not run at all (e.g. shutting down): still one answer
                log.exception("running the turn in %s failed", key)
                outcome = Failed(TurnFailure(TurnFailureKind.AGENT_CREATION, repr(exc)), controller.text)
        answered = not isinstance(outcome, Completed) or bool(outcome.text.strip())
        if isinstance(outcome, Completed) and not answered:
            outcome = self._say_empty(outcome)  # a chat is never left without a reply

        # 4. commit, and only then show the terminal state; a turn whose session moved to another process
        # meanwhile (its lease was lost, or the new holder closed the turn first) ends here: the new holder
        # closes it with its interrupted notice, the chat gets nothing more from this one
        if cancel.abandoned:
            return await self._abandon(key, handle, context)
        trace = self._trace_records(key, controller)  # complete once the run is over
        committed = await self._committer.commit(key, turn_id, outcome, base_generation=base_generation,
                                                 base_state_version=base_state_version, trace=trace)
        if committed.taken_over:
            return await self._abandon(key, handle, context)
        outcome = committed.outcome
        if committed.result is not None:
            context.committed(committed.result)
        else:
            context.clear()
        terminal = self._finish(controller, outcome, committed.notice)
        if committed.result is None:  # the commit did not close the turn record
            await self._record_turn_end(turn_id, terminal)

        # 5. wait for the sink; fall back to one plain message if the terminal content is not visible; marked
        # delivered only once the chat shows it (from then on a crash no longer leaves the chat without it)
        try:
            await self._deliver_terminal(turn_id, target, handle, outcome, terminal, result)
        except asyncio.CancelledError:
            if result.cut is None:  # (cut in its fallback: the next start sends what is not marked delivered)
                result.cut = f"{_outcome_label(outcome)} (the shutdown cut its delivery)"
            raise
        if committed.result is None:  # the commit (and the trace with it) did not land: try the trace alone
            await self._write_trace(key, turn_id, trace)

        # 6. title in the background
        if isinstance(outcome, Completed) and answered and committed.result \
                and committed.result.history_revision == 1:
            self._titles.schedule(key, base_generation, envelope.content, outcome.text)
        return _outcome_label(outcome)

    # ---- steps ---------------------------------------------------------------------------------

    @staticmethod
    async def _abandon(key: str, handle: DeliveryHandle | None, context: ContextCache) -> str:
        """Leave the turn to the process that took its session over: no commit, no terminal message, no
        fallback; the live view stops where it is."""
        log.warning("the turn in %s is left to the process that took the session over", key)
        context.clear()
        if handle is not None:
            await handle.abandon()
        return ABANDONED

    async def _take_attachments(self, envelope: InboundEnvelope, cancel: CancelSignal) -> Intake:
        """The message's attachments, fetched and read; ``/stop`` abandons the downloads at once. The chat shows
        a sign of life meanwhile where its channel has one (``TurnDeliveryService.working``): no sink is open
        yet, and downloads can take a while."""
        if not envelope.media:
            return Intake()
        if self._intake is None:  # no media store: each attachment is described as it was announced
            return Intake(tuple(unread(item, "this bridge does not download attachments")
                                for item in envelope.media))
        try:
            async with asyncio.timeout(None) as scope, self._delivery.working(envelope.target()):
                loop = asyncio.get_running_loop()
                unsubscribe = cancel.on_set(lambda: scope.reschedule(loop.time()))
                try:
                    return await self._intake.take(envelope)
                finally:
                    unsubscribe()
        except TimeoutError:  # stopped: nothing half-downloaded is kept (core.media.files)
            return Intake(tuple(unread(item, "the reply was stopped before it was downloaded")
                                for item in envelope.media))
        except Exception:  # a bug or a failing store: the words of the message are still answered
            log.exception("the attachments of a message in %s could not be taken", envelope.key())
            return Intake(tuple(unread(item, "it could not be read") for item in envelope.media))

    async def _forget(self, inbound: int | None) -> None:
        """The user is told to send the message again: it must not count as seen (its event id stays free),
        nor be answered after a restart."""
        if inbound is None:
            return
        try:
            await self._store.forget_inbound(inbound)
        except Exception as exc:  # the store is failing: the message is answered after a restart instead
            log.warning("could not release inbound message %s: %s", inbound, exc)

    async def _start_delivery(self, target: TurnTarget, controller: TurnController) -> DeliveryHandle | None:
        try:
            return await self._delivery.start(target, controller)
        except DeliveryStartError as exc:
            log.warning("live delivery unavailable for %s, replying plainly: %s", target.session_key, exc)
            return None

    def _say_empty(self, outcome: Completed) -> Completed:
        """A completed turn whose answer has no text: a notice saying so is what its final shows (and what history
        keeps as a notice, never sent to the model)."""
        notice = self._presenter.empty_answer()
        return dataclasses.replace(outcome, text=notice, notice=notice)

    @staticmethod
    def _finish(controller: TurnController, outcome: TurnRunOutcome, notice: str | None) -> TurnSnapshot:
        """The terminal snapshot; its error is the notice the commit persisted (one text, live and in history)."""
        if isinstance(outcome, Completed):
            return controller.finish("completed", text=outcome.text)
        return controller.finish("failed" if isinstance(outcome, Failed) else "cancelled", error=notice)

    async def _deliver_terminal(self, turn_id: str, target: TurnTarget, handle: DeliveryHandle | None,
                                outcome: TurnRunOutcome, terminal: TurnSnapshot, result: TurnOutcome) -> None:
        err: DeliveryError | None
        if handle is None:
            err = DeliveryError("no live delivery")
        else:
            try:
                err = await handle.wait(self._settings.delivery_wait_timeout)
            except asyncio.CancelledError:
                result.cut = await self._cut(turn_id, handle, outcome)
                raise
        if err is None:  # rule 2: delivered → no plain message
            await self._redelivery.mark_delivered(turn_id)
            return
        text = self._fallback_text(outcome, terminal, err)
        if text and err.maybe_shown:  # the final's send timed out: the chat may show it, a fallback twice
            self._redelivery.schedule(turn_id, target, Unshown(text, maybe_shown=True))
            return
        if text:
            log.info("delivery for %s failed (%s); sending one plain fallback", target.session_key, err.reason)
        else:
            log.info("delivery for %s failed (%s); the chat shows all of it already", target.session_key, err.reason)
        rest = await self._redelivery.deliver(turn_id, target, text)
        if rest.text:
            log.warning("the fallback for %s failed too", target.session_key)
            self._redelivery.schedule(turn_id, target, rest)

    async def _cut(self, turn_id: str, handle: DeliveryHandle, outcome: TurnRunOutcome) -> str:
        """The shutdown's bound cancelled the wait for the terminal delivery (see the module docstring):
        record what the sink's ledger says the chat shows, so that the next start sends the turn's terminal
        message only when that cannot show it twice. Returns the turn's log line's words."""
        label = _outcome_label(outcome)
        try:
            cut = await handle.cut()
        except Exception as exc:  # a bug: the next start sends it
            log.warning("the delivery of turn %s was cut by the shutdown and could not be read: %s", turn_id, exc)
            cut = Cut(None)
        if cut.undelivered == "":
            await self._redelivery.mark_delivered(turn_id)
            return f"{label} (its delivery was cut by the shutdown; the chat shows all of it)"
        if cut.final_in_doubt and not isinstance(outcome, Completed):
            # its final edit may have landed: a terminal message at the next start could be a second one
            # (rule 6), and its partial answer is in the message that edit was for (rule 4: never again)
            await self._redelivery.mark_delivered(turn_id)
            log.warning("the shutdown cut the final edit of turn %s on its way; its message stays as the chat "
                        "shows it, and the next start sends nothing more of it", turn_id)
            return f"{label} (the shutdown cut its final edit on its way; the chat keeps its message)"
        log.warning("the shutdown cut the delivery of turn %s; the next start sends its terminal message", turn_id)
        return f"{label} (the shutdown cut its delivery; the next start sends it)"

    def _fallback_text(self, outcome: TurnRunOutcome, terminal: TurnSnapshot, err: DeliveryError) -> str:
        if isinstance(outcome, Completed):
            # rule 3: only what the chat does not show yet
            return outcome.text if err.undelivered is None else err.undelivered
        if isinstance(outcome, Failed):
            # rule 4: never the body again; the failure, with the partial only if one was displayable
            if outcome.partial:
                return self._presenter.failed_with_partial(outcome.failure, outcome.partial)
            return self._presenter.failure(outcome.failure)
        if isinstance(outcome, Cancelled):
            return self._presenter.cancelled(outcome.partial, by_shutdown=outcome.by_shutdown)
        return self._presenter.cancelled(terminal.text)

    @staticmethod
    def _trace_records(key: str, controller: TurnController) -> list[tuple[str, dict[str, Any]]]:
        try:
            return [(e.kind, trace_payload(e)) for e in controller.trace]
        except Exception as exc:  # tracing never breaks a turn
            log.warning("trace of %s could not be built: %s", key, exc)
            return []

    async def _write_trace(self, key: str, turn_id: str, trace: list[tuple[str, dict[str, Any]]]) -> None:
        """The turn's complete events in stream order (partials skipped), when the commit could not
        carry them."""
        try:
            await self._store.append_traces(key, turn_id, trace)
        except Exception as exc:  # tracing never breaks a turn
            log.warning("trace write failed for %s: %s", key, exc)

    async def _record_turn_end(self, turn_id: str, terminal: TurnSnapshot) -> None:
        state: TurnState = terminal.state if terminal.state != "running" else "failed"
        try:
            await self._store.end_turn(turn_id, state)
        except Exception as exc:
            log.warning("could not close turn record %s: %s", turn_id, exc)


def _outcome_label(outcome: TurnRunOutcome) -> str:
    if isinstance(outcome, Failed):
        return f"failed ({outcome.failure.kind.value})"
    return type(outcome).__name__.lower()


__all__ = ["ConversationExecutor", "Stale"]
