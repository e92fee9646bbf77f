"""ChatCore: wires the reply chain together; the bridge drives it, channels reach it through a host.

Channels never hold the ChatCore: ``host_for(name)`` gives each one the narrow ``core.host`` interface,
and ``add_channel`` registers it for delivery (``open_sink``, ``send_plain``).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Literal

from core.agent.approval_relay import TOPIC as APPROVALS_TOPIC
from core.agent.approval_relay import ApprovalRelay
from core.agent.approvals import ApprovalBroker
from core.agent.compaction import Compactor, summary_message
from core.agent.deciders import NOBODY_ELSE, Decider, DecideResult, Deciders
from core.agent.subagents import CHILD_GLOB, SubagentTool, descends, is_child_key
from core.bus import BusError, ClusterBus, LocalBus
from core.channel import Channel, ChannelRegistry
from core.committer import TurnCommitter
from core.delivery import PlainSender, TurnDeliveryService
from core.envelope import InboundEnvelope, TurnTarget
from core.events import EventBus, SessionTitleChanged, TurnCommitted
from core.executor import ConversationExecutor
from core.failover import SessionFailover
from core.failures import TurnFailurePresenter
from core.host import CoreHost
from core.input_builder import RuntimeContext, TurnInputBuilder, summary_of
from core.leadership import Leadership, LocalLeadership
from core.leases import LocalLeases, SessionLeases
from core.llm.provider import LLMProvider, ProviderError
from core.media.intake import AttachmentIntake
from core.media.library import MediaLibrary, Refusal, display_name
from core.media.transcribe import Transcriber
from core.media.vision import VisionPolicy
from core.messages import AttachmentRef, ChatMessage
from core.metrics import Metrics
from core.processes import Processes
from core.redelivery import Redelivery
from core.relay import Relay
from core.router import AdmissionError, IngressRouter, RouterClosedError, SubmitResult
from core.runner import TurnRunner
from core.session import Admitted, Job, SessionManager
from core.settings import CoreSettings
from core.store import (
    AttachmentRecord,
    SessionRecord,
    StaleStateError,
    Store,
    StoreError,
    TurnRecord,
    UndeliveredTurn,
)
from core.supervisor import TaskSupervisor
from core.text import sound_text
from core.title import TitleService
from core.tools.base import ToolRegistry

log = logging.getLogger(__name__)

__all__ = ["AdmissionError", "ChatCore", "RouterClosedError", "SubmitResult"]


class ChatCore:
    def __init__(self, *, store: Store, provider: LLMProvider, settings: CoreSettings | None = None,
                 presenter: TurnFailurePresenter | None = None, tools: ToolRegistry | None = None,
                 media_dir: Path | None = None, transcriber: Transcriber | None = None,
                 bus: ClusterBus | None = None, leadership: Leadership | None = None,
                 leases: SessionLeases | None = None) -> None:
        """``media_dir``: where attachments are stored (None: they are only described to the model);
        ``transcriber``: turns voice messages into text (None: they are described); ``bus``: notes to the
        other processes sharing the store (``core.bus``; None: this process is alone); ``leadership``: which
        process receives through a single-consumer transport (default: this one, the only one); ``leases``:
        shared session leases when several processes use one database (``core.failover``; None: this process
        is the only one)."""
        self.settings = settings or CoreSettings()
        self.store = store
        self.bus: ClusterBus = bus or LocalBus()
        self.leadership: Leadership = leadership or LocalLeadership()
        self.node = secrets.token_hex(6)
        """This process's name among those sharing the store (new for every start)."""
        self._relays: dict[str, Relay] = {}
        self.provider = provider
        self.presenter = presenter or TurnFailurePresenter()
        self.supervisor = TaskSupervisor()
        self.channels = ChannelRegistry()
        self.events = EventBus()
        self.metrics = Metrics()
        s = self.settings
        self._plain = PlainSender(self.channels)
        self._redelivery = Redelivery(store, self.channels, self._plain, self.supervisor, s,
                                      count_sent=lambda channel: self.metrics.fallbacks.labels(channel).inc())
        self.tools = tools or ToolRegistry()
        self.approvals = ApprovalBroker()
        self._deciders: dict[str, Deciders] = {}
        approvals_relay = self.relay(APPROVALS_TOPIC)
        self._approval_relay = ApprovalRelay(approvals_relay, self._decide_here) \
            if approvals_relay is not None else None
        self.vision = VisionPolicy(s.vision, provider.name, str(getattr(provider, "model", "")))
        self.media = MediaLibrary(media_dir, store, s) if media_dir is not None else None
        self._transcriber = transcriber
        if transcriber is not None:  # its retries show in /metrics
            transcriber.count_retry = self.metrics.transcription_retries.inc
        builder = TurnInputBuilder(store, s, images=self.media.model_image if self.media else None,
                                   vision=self.vision.enabled)
        self._builder = builder
        self._compactor = Compactor(provider, builder, s, on_model_retry=self.metrics.model_retries.inc)
        self._committer = TurnCommitter(store, self.events, self.presenter)
        if s.subagents.enabled:
            self.tools.add(SubagentTool(settings=s, store=store, provider=provider, supervisor=self.supervisor,
                                        broker=self.approvals, tools=self.tools, committer=self._committer,
                                        presenter=self.presenter, metrics=self.metrics))
        self.executor = ConversationExecutor(
            store=store, builder=builder,
            runner=TurnRunner(provider, builder, store, self.supervisor, s, tools=self.tools,
                              broker=self.approvals, compactor=self._compactor, metrics=self.metrics,
                              images_rejected=self.vision.rejected),
            committer=self._committer,
            delivery=TurnDeliveryService(self.channels, self.supervisor, s),
            plain=self._plain, redelivery=self._redelivery, presenter=self.presenter,
            titles=TitleService(store, provider, self.supervisor, self.events, s,
                                on_model_retry=self.metrics.model_retries.inc),
            events=self.events, settings=s, metrics=self.metrics,
            intake=AttachmentIntake(self.media, s, sources=self.channels.get, transcriber=transcriber)
            if self.media is not None else None)
        self.leases = leases or LocalLeases()
        self.processes = Processes(self.leases, self.node)
        self.failover = SessionFailover(store=store, leases=self.leases, settings=s, supervisor=self.supervisor,
                                        recovery=self, bus=self.bus, processes=self.processes) \
            if self.leases.shared else None
        self.sessions = SessionManager(store, self.executor, self.supervisor, s, leases=self.leases,
                                       takeover=self.failover)
        if self.failover is not None:
            self.failover.sessions = self.sessions
        self.metrics.watch(queue_depth=self.sessions.queued_count, active_sessions=self.sessions.busy_count,
                           running_turns=self.sessions.running_count)
        self.router = IngressRouter(store=store, sessions=self.sessions, plain=self._plain,
                                    presenter=self.presenter, supervisor=self.supervisor, settings=s,
                                    new_context=self._new_context, compact=self.compact, failover=self.failover)
        self._started = False

    def add_channel(self, channel: Channel) -> None:
        """Register ``channel`` for delivery: turn targets and notices naming it go through it."""
        self.channels.add(channel)

    def relay(self, topic: str) -> Relay | None:
        """The relay of ``topic`` to the other processes sharing the store (``core.relay``); None when this
        process shares it with nobody (``LocalBus``), so a process alone never sends or waits for notes."""
        if isinstance(self.bus, LocalBus):
            return None
        relay = self._relays.get(topic)
        if relay is None:
            relay = self._relays[topic] = Relay(self.bus, topic, self.node, self.supervisor.spawn)
        return relay

    def host_for(self, channel: str) -> CoreHost:
        """What the channel named ``channel`` is handed instead of this object (``core.host``)."""
        return CoreHost(self, channel)

    async def start(self) -> None:
        """Open the store, send again the terminal message of turns a crash cut off between their commit and
        their delivery, close turns a previous process left running (each one's notice goes into its
        session's history, where a page that reconnects after the restart finds it, then its chat is told
        once) and queue the messages it had accepted but not begun to answer, in arrival order; one older
        than ``resume_max_age`` gets a notice instead of an answer."""
        await self.store.open()
        self._started = True
        try:
            await self.bus.open()
        except BusError as exc:
            raise StoreError(str(exc)) from None
        if self.media is not None:
            await self.media.open()
            self.supervisor.spawn("media:expiry", self._expire_media(self.media))
        if self.failover is not None:  # several processes: recover each session as its lease is taken
            await self.leases.open()
            await self.processes.announce()
            await self.failover.start()
            return
        await self._redeliver()
        for turn in await self.store.close_interrupted_turns():
            await self.interrupted(turn)
        await self._resume()

    async def interrupted(self, turn: TurnRecord) -> None:
        """A turn a stopped process left running: its notice goes into its session's history, where a page
        that reconnects finds it, then its chat is told once."""
        notice = self.presenter.interrupted_by_restart()
        await self._committer.commit_notice(turn.session_key, turn.turn_id, notice)
        if is_child_key(turn.session_key):
            return  # a subagent's chat is its parent's, which is told once, by the parent's own turn
        try:
            target = TurnTarget.model_validate_json(turn.target_json)
        except ValueError:
            log.warning("interrupted turn %s has an unreadable target", turn.turn_id)
            return
        await self._plain.send(target, notice)

    async def _redeliver(self) -> None:
        """Turns a crash cut off between their commit and their delivery, or whose delivery failed and was
        still being retried (``core.redelivery``): the chat may show nothing of the answer, or a preview of
        part of it, and nothing would ever finish it. Each gets its terminal message (the answer, or the
        notice of a turn without one) once, as an ordinary message, in the order they ended; one the
        platform does not take now is tried again in the background. Those older than ``resume_max_age``
        are left, like the messages that old."""
        for item in await self.store.undelivered_turns(time.time() - self.settings.resume_max_age):
            await self.redeliver(item)

    async def redeliver(self, item: UndeliveredTurn) -> None:
        """Send an undelivered turn's terminal message once (see ``_redeliver``)."""
        turn_id = item.turn.turn_id
        if is_child_key(item.turn.session_key):  # a subagent answers its parent, never a chat
            await self.store.mark_delivered(turn_id)
            return
        try:
            target = TurnTarget.model_validate_json(item.turn.target_json)
        except ValueError:
            log.warning("undelivered turn %s has an unreadable target", turn_id)
            await self.store.mark_delivered(turn_id)
            return
        channel = self.channels.get(target.channel)
        # a channel whose clients read the history (the web chat) already shows the committed answer
        if channel is None or not item.text or getattr(channel, "shows_history", False):
            if channel is None:
                log.warning("undelivered turn %s is for channel %r, which is not running", turn_id,
                            target.channel)
            await self.store.mark_delivered(turn_id)
            return
        log.info("sending the %s turn %s again: a restart came before its delivery", item.turn.state, turn_id)
        rest = await self._redelivery.deliver(turn_id, target, item.text)
        if rest.text:
            self._redelivery.schedule(turn_id, target, rest)

    async def _resume(self) -> None:
        now = time.time()
        waiting = await self.store.waiting_inbound()
        if waiting:
            log.info("resuming %d message(s) accepted before the restart", len(waiting))
        for record in waiting:
            try:
                envelope = InboundEnvelope.model_validate_json(record.payload)
            except ValueError:
                log.warning("inbound message %s is unreadable and is dropped", record.seq)
                await self.store.finish_inbound([record.seq])
                continue
            age = now - envelope.received_at
            if age <= self.settings.resume_max_age:
                self.sessions.resume(envelope, record.seq)
            else:  # in the session's order, so it never overtakes an earlier message's answer
                self.sessions.schedule(envelope.key(), "too-old notice",
                                       functools.partial(self._too_old, envelope, record.seq, age))

    async def _too_old(self, envelope: InboundEnvelope, seq: int, age: float, _: Sequence[Admitted]) -> None:
        await self.too_old(envelope, seq, age)

    async def too_old(self, envelope: InboundEnvelope, seq: int, age: float) -> None:
        """A stored message too old to answer after a restart: one notice instead."""
        if not await self.store.finish_inbound([seq]):  # before the notice, and only by its finisher: once
            return  # another process read it as waiting too, and finished it first
        notice = self.presenter.too_old_after_restart(age)
        await self._committer.commit_notice(envelope.key(), None, notice)  # in history too, as above
        await self._plain.send(envelope.target(), notice)

    async def submit(self, envelope: InboundEnvelope) -> SubmitResult:
        """Hand one inbound message to core; returns only after the message is durably accepted (QUEUED: it
        will be answered, after a crash too), or found a duplicate, or refused as BUSY, or started as a
        command. Raises RouterClosedError while shutting down and AdmissionError when the message could not
        be stored: then nothing marks it as seen, and the channel must not acknowledge it to its platform
        (see ``IngressRouter.submit``)."""
        return await self.router.submit(envelope)

    async def stop(self, key: str) -> bool:
        """Stop ``key``'s running turn, here or in the process that holds the session (True: a turn ran
        here and was stopped, or the stop went to the holder)."""
        if await self.sessions.stop(key):
            return True
        return self.failover is not None and await self.failover.forward_stop(key)

    async def stop_here(self, envelope: InboundEnvelope) -> None:
        """``/stop`` another process received for a session this one holds."""
        await self.router.stop_here(envelope)

    def stored_job(self, command: str, envelope: InboundEnvelope, seq: int) -> Job | None:
        """The job of a command another process stored for a session this one serves (a forwarded ``/new``)."""
        return self.router.stored_job(command, envelope, seq)

    def set_deciders(self, channel: str, allow_from: Iterable[str]) -> None:
        """The users (ids or names, as in ``allow_from``) who may decide any approval of ``channel``'s
        sessions besides the sender of the turn's message (``core.agent.deciders``)."""
        self._deciders[channel] = Deciders(allow_from)

    def decide(self, session_key: str, tool_call_id: str, decision: Literal["allow", "deny"],
               decided_by: Decider | str | None, *, channel: str | None = None,
               origin: Sequence[str] = ()) -> DecideResult:
        """Answer a pending approval (snapshot.approvals) of ``session_key`` on behalf of ``decided_by``.

        Core decides who may: the sender of the turn's message, or a user the allow list of ``channel``
        (the session's channel) names; anyone else gets REFUSED and the approval stays pending. NOT_PENDING
        when nothing is pending under that id (already decided, timed out, or the turn ended). A call of a
        child session (``run_subagent``) is decided in its parent's chat: ``origin`` is the request's
        (the child keys, outermost first) and must descend from ``session_key``, else NOT_PENDING."""
        if decision not in ("allow", "deny"):
            raise ValueError(f"decision must be 'allow' or 'deny', not {decision!r}")
        if origin and not descends(session_key, origin):
            return DecideResult.NOT_PENDING
        deciders = self._deciders.get(channel, NOBODY_ELSE) if channel is not None else NOBODY_ELSE
        target = origin[-1] if origin else session_key
        return self.approvals.decide(target, tool_call_id, decision, decided_by, deciders)

    def _decide_here(self, session_key: str, tool_call_id: str, decision: Literal["allow", "deny"],
                     decided_by: Decider | None, channel: str | None, origin: Sequence[str]) -> DecideResult:
        return self.decide(session_key, tool_call_id, decision, decided_by, channel=channel, origin=origin)

    async def decide_anywhere(self, session_key: str, tool_call_id: str, decision: Literal["allow", "deny"],
                              decided_by: Decider | str | None, *, channel: str | None = None,
                              origin: Sequence[str] = ()) -> DecideResult:
        """``decide``, wherever the turn runs: an approval not pending in this process is forwarded to the
        process sharing the store that holds it, which decides it by the same rule and answers
        (``core.agent.approval_relay``; NOT_PENDING when none answers in time)."""
        result = self.decide(session_key, tool_call_id, decision, decided_by, channel=channel, origin=origin)
        if result is not DecideResult.NOT_PENDING or self._approval_relay is None:
            return result
        if origin and not descends(session_key, origin):
            return result
        return await self._approval_relay.decide(session_key, tool_call_id, decision, Decider.of(decided_by),
                                                 channel, origin)

    async def compact(self, key: str) -> str:
        """/compact: summarize the session's context now (not while a reply is being written)."""
        if self.sessions.is_running(key):
            return "A reply is being written; try /compact again when it is done."
        record = await self.store.get_session(key)
        if record is None:
            return "Nothing to compact yet."
        prepared = await self._builder.prepare(key, record.state_version, RuntimeContext(channel=""))
        messages = list(prepared.history)
        if len(messages) < 2:
            return "Nothing to compact yet."
        try:
            text, _ = await self._compactor.summarize(prepared.summary, messages, window_chars=prepared.window_chars)
        except ProviderError as exc:
            log.warning("compaction of %s failed: %s", key, exc)
            return "The conversation could not be compacted right now; please try again later."
        summary = summary_of(text, prepared.summary, messages)
        try:
            result = await self.store.commit_turn(key, [summary_message(summary, None)],
                                                  expect_generation=record.generation,
                                                  expect_state_version=record.state_version)
        except StaleStateError:
            return "The conversation moved on while compacting; try /compact again."
        self.events.publish(TurnCommitted(key, result.history_revision, result.messages))
        return f"Compacted {len(messages)} messages into a summary; the conversation continues from it."

    async def history(self, key: str, *, limit: int = 1000,
                      before: str | None = None) -> tuple[int, list[ChatMessage]]:
        """See ``Store.history`` (``before`` pages backwards; UnknownMessageError for a foreign id)."""
        return await self.store.history(key, limit=limit, before=before)

    async def list_sessions(self, *, prefix: str | None = None, subagents: bool = True) -> list[SessionRecord]:
        """``subagents=False``: conversations only (a subagent is shown inside its parent)."""
        return await self.store.list_sessions(prefix=prefix, exclude_glob=None if subagents else CHILD_GLOB)

    async def create_session(self, key: str) -> SessionRecord:
        return await self.store.get_or_create_session(key)

    async def rename(self, key: str, title: str) -> str:
        """A user's rename; returns the title as stored (made sound: ``core.text``)."""
        title = sound_text(title)
        await self.store.rename(key, title)
        self.events.publish(SessionTitleChanged(key, title))
        return title

    async def _new_context(self, key: str, drop_inbound: Sequence[int], sent_at: float,
                           serves: int | None) -> None:
        await self.store.new_context(key, drop_inbound=drop_inbound, serves=serves)
        self._builder.forget_window(key)  # what overflowed the model stays behind: the new context starts full
        if self.media is not None:  # uploads never sent before /new; attachments of messages stay
            await self.media.forget_unclaimed(key, before=sent_at)

    async def _expire_media(self, media: MediaLibrary) -> None:
        while True:
            try:
                gone = await media.sweep()
                if gone:
                    log.info("deleted %d expired attachment files", gone)
            except Exception as exc:  # the next pass tries again
                log.warning("deleting expired attachments failed: %s", exc)
            await asyncio.sleep(self.settings.media_sweep_interval)

    # ---- attachments (the web chat's uploads and downloads) -------------------------------------------

    async def upload(self, key: str, name: str | None, chunks: AsyncIterator[bytes]) -> AttachmentRef:
        """Store a file sent for session ``key`` ahead of its message; raises Refusal (nothing kept)."""
        if self.media is None:
            raise Refusal("this bridge keeps no attachments")
        return await self.media.save(key, display_name(name, "file"), chunks, claimed=False)

    async def attachment(self, key: str, attachment_id: str) -> tuple[AttachmentRecord, Path] | None:
        """The stored attachment ``attachment_id`` of session ``key`` and its file (None: not there)."""
        if self.media is None:
            return None
        return await self.media.get(key, attachment_id)

    def stop_new_turns(self) -> None:
        """The first step of a shutdown: no session starts a new turn from now on, while the running turns go
        on (the channels are stopped meanwhile; a ``/new`` queued behind a turn is still carried out). Messages
        still accepted stay stored and are answered at the next start; ``shutdown`` then stops what still runs."""
        self.sessions.stop_starting()

    async def shutdown(self, timeout: float | None = None) -> list[str]:
        """Bounded shutdown: no new input, running turns end once, every task is reclaimed, within ``timeout``
        seconds (default ``shutdown_timeout``), then the store is closed.
        Returns the names of tasks that had to be abandoned."""
        self.sessions.stop_starting()
        total = self.settings.shutdown_timeout if timeout is None else max(0.0, timeout)
        self.router.close()
        if self.failover is not None:
            self.failover.close()
        await asyncio.gather(self.router.drain(total / 2), self.sessions.shutdown(total / 2))
        if self._approval_relay is not None:
            self._approval_relay.close()
        stragglers = await self.supervisor.shutdown(total / 2)
        try:
            if self.failover is not None:  # the others take this process's sessions over at once
                await self.leases.close()
            await self.provider.aclose()
            if self._transcriber is not None:
                await self._transcriber.aclose()
        finally:
            if self._started:
                try:
                    await self.bus.close()
                finally:
                    await self.store.close()
        return stragglers
