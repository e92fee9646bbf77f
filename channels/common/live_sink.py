"""LiveSink: one turn's live reply on one platform, written once for every channel.

A platform supplies its message operations, rendering and approval prompts (``channels.common.ops``);
this is the rest of the ``TurnSink`` contract:

- First-message gate: nothing is posted until the answer has ``first_chars`` characters or ``first_delay``
  seconds have passed; a typing indicator shows meanwhile (repeated every ``typing_every`` seconds). The
  first one may be sent without the turn waiting for it (``start_typing``): the model request then starts
  at once, and the first text shown and the end both wait for that call to land, so the indicator never
  comes after text. With a ``delay`` it is made only if nothing is shown by then: a first message still
  waiting for its slot in a budget every chat shares (a bot's new messages, in a burst) counts as not shown,
  and leaves once the indicator's call has landed (``before_first_text``). A chat that refuses it for good
  (the bot blocked, the chat gone) gets no live updates, only the final attempt.
- Latest wins by pulling: ``follow`` runs in the turn's delivery task and takes the newest snapshot when
  the chat's next slot comes (``Throttle.ready_in``), never a backlog. It sleeps until that slot and is
  woken early only by what must be shown at once (new or ended approvals, the end of the turn). Where many
  chats wait for one budget's slots (Slack's workspace), each sleeps on past the next slot by a random share
  of the time the others waiting ahead would take (``Throttle.waiting``): about one of them looks per slot,
  instead of all of them waking for each slot and all but one finding it taken. A streamed token therefore
  costs the sink nothing: rendering and splitting happen per platform call.
- A new message's content is decided when its slot comes (``_at_slot``), not when it was booked: it may wait
  long in a budget shared by every chat (a bot's new messages), so it carries the newest snapshot then, and
  the final's rendering when the turn ended meanwhile (``finish`` then has nothing left to do).
- Rendering at flush, in time linear in the reply: finished parts (every message but the last, once the
  reply outgrew one) are frozen, and only the unfinished tail is split and rendered again
  (``splitter.split`` from where the tail starts). A native stream gets only what was appended, or the
  whole text when the snapshot's ``text_epoch`` says it was replaced. A stream that lives in a chat
  message (``ops.MessageStream``, Slack's) hands that message to the ledger when the reply outgrows it or
  the stream ends early, so edits finish it.
- The finish handshake is sequential by construction: ``follow`` returns once the turn is over (a call in
  flight lands first, so the ledger stays true), then core calls ``finish``, which closes a native stream
  and reconciles the formatted final rendering (plain text if the platform rejects the formatting).
- Every call goes through ``Calls``: live updates are tried once (the next one repeats the whole state);
  the final's calls are retried within the policy, each retry in its own pace slot (the first of them may
  use the scope's burst: ``throttle.ending``, so the end shows at once, not at the next slot); 429 pauses
  are the throttle's. A live update's new message whose send may have been carried out (it timed out, on a
  platform that cannot recognise a repeat) ends the live updates: sent again at every next slot it could
  show once per slot; the final repeats it, and that is its one repeat (``Calls.call``'s ``repeat``).
  If the final still fails, previews that do not show their final form are deleted where the
  platform allows, so the core's single fallback (exactly the parts the ledger says are missing) leaves
  the chat showing the formatted answer once (``channels.common.ledger``).
- Abort (core gave up waiting, or shutdown) stops at once and leaves the chat as it is: nothing is
  removed, so every message, and what a native stream leaves in the chat (``NativeStream.leftover``),
  counts for the words it shows, and ``undelivered`` names only the rest. A call the abort cut off may
  have been carried out: an edit or a send counts as not made (its text may then show twice, never be
  lost), a delete as made. A final edit cut off so is also reported (``final_in_doubt``): the core then
  knows the chat may show the terminal state after all (``core.executor``: a turn the shutdown stopped).
- Approvals: a new pending approval is posted at once by the platform's prompts; one that ended without
  a press is marked with how it ended. One that could not be posted (after the call policy's retries) is
  reported to core (``TurnFeed.approval_unshown``), which denies it at once: the turn goes on, and the model
  is told the request could not be shown, instead of waiting for a press nobody can make. A post whose
  outcome is unknown (it may show) leaves the request pending.
- Subagents: while child sessions of the turn run, the last streamed message carries one status line per
  running child (``channels.common.status``) where it fits; the final reply never does. A stream that
  shows activity itself (the web chat's cards) gets none.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from channels.common.calls import Calls, outside_bound
from channels.common.errors import PlatformError
from channels.common.ledger import Ledger, Part
from channels.common.ops import (
    MEASURES,
    ApprovalPrompts,
    MessageOps,
    MessageStream,
    NativeStream,
    Renderer,
    TextChange,
)
from channels.common.reconciler import Reconciler
from channels.common.splitter import Chunk, split
from channels.common.status import status_lines
from channels.common.throttle import Scope, ending
from core.agent.approvals import DENIED_BY_TIMEOUT, DENIED_BY_USER
from core.channel import SinkError, TurnFeed
from core.controller import REPLY_FAILED
from core.snapshot import ApprovalRequest, TurnSnapshot

log = logging.getLogger(__name__)

Spawn = Callable[[str, Coroutine[Any, Any, None]], "asyncio.Task[None]"]


@dataclass(frozen=True, slots=True)
class LiveSettings:
    first_chars: int = 24
    """Nothing is posted before the answer has this many characters..."""
    first_delay: float = 1.0
    """...or this many seconds have passed since the turn began."""
    typing_every: float = 4.0
    """How often the typing indicator is repeated while nothing is shown (Telegram's lasts about 5 s)."""


def _leftover(stream: NativeStream) -> tuple[str, Part] | None:
    """What a stream that failed or was given up leaves in the chat (``MessageStream.leftover``), if anything."""
    return stream.leftover() if isinstance(stream, MessageStream) else None


def body(snapshot: TurnSnapshot) -> str:
    """The text a terminal snapshot stands for: the answer, then any notice after a blank line."""
    text = snapshot.text
    if snapshot.error:
        return f"{text}\n\n{snapshot.error}" if text.strip() else snapshot.error
    return text


FAILED_LINE = "⚠️ The reply failed before a decision."
"""How a prompt ends whose turn (or subagent) failed while it waited: nobody stopped it, nothing timed out."""


def ended_line(snapshot: TurnSnapshot, call_id: str, origin: tuple[str, ...] = ()) -> str:
    """How an approval ended without a press on its prompt in this process (timed out, stopped, failed, or
    decided through another process): from the turn's record of it (``snapshot.decided``), naming who decided
    when their channel named them; failing that (the abort or the end of its turn or child closed it), from the
    tool's status or the turn's state (for a subagent's call, from its child's state: its tools are not the
    turn's)."""
    outcome = next((o for o in reversed(snapshot.decided) if o.call_id == call_id and o.origin == origin), None)
    if outcome is not None and outcome.reason == "unshown":
        return "⚠️ Denied: the request could not be shown in the chat."
    if outcome is not None and outcome.reason in ("user", "timeout"):
        if outcome.reason == "timeout":
            return "⌛ Denied: nobody decided in time."
        mark = "✅ Allowed" if outcome.decision == "allow" else "❌ Denied"
        return f"{mark} by {outcome.shown_by}" if outcome.shown_by else f"{mark}."
    if origin:
        child = next((c for c in snapshot.children if c.origin == origin), None)
        if snapshot.state == "failed" or (child is not None and child.state == "failed"):
            return FAILED_LINE
        if snapshot.state == "cancelled" or (child is not None and child.state == "cancelled"):
            return "⏹ The reply was stopped before a decision."
        return "⌛ Denied: nobody decided in time."
    tool = next((t for t in snapshot.tools if t.call_id == call_id), None)
    if snapshot.state == "failed" or (tool is not None and tool.status == "failed" and tool.summary == REPLY_FAILED):
        return FAILED_LINE
    if tool is not None and tool.status == "denied" and tool.summary == DENIED_BY_TIMEOUT:
        return "⌛ Denied: nobody decided in time."
    if tool is not None and tool.status == "denied" and tool.summary == DENIED_BY_USER:
        return "❌ Denied."
    if tool is not None and tool.status in ("running", "done"):
        return "✅ Allowed."
    return "⏹ The reply was stopped before a decision."  # /stop denies what is pending


@dataclass(slots=True)
class _Asked:
    posting: asyncio.Task[None] | None
    handle: Any = None
    ended: bool = False


class _Paced:
    """The reconciler's calls, through the channel's policy: one try while streaming, retried at the end."""

    def __init__(self, sink: LiveSink) -> None:
        self._sink = sink
        self._unsure: set[str] = set()
        """The keys of sends whose outcome was unknown: the next call of one is its one repeat."""

    async def send(self, content: Callable[[], Part], key: str) -> str:
        s = self._sink

        async def leave() -> str:  # the send's slot came: "typing…" lands first (or is not shown at all)
            await s.before_first_text()
            return await s.ops.send(content(), key)

        try:
            return await s.calls.call(leave, scopes=s.ops.scopes + s.send_scopes, retry=s.final,
                                      idempotent=s.ops.capabilities.idempotent_sends, repeat=key in self._unsure)
        except PlatformError as exc:
            if exc.outcome_unknown:
                self._unsure.add(key)
            raise

    async def edit(self, message_id: str, part: Part) -> None:
        s = self._sink
        if not s.final:
            await s.calls.call(lambda: s.ops.edit(message_id, part), scopes=s.ops.scopes, retry=False)
            return
        s.finishing = message_id  # cleared when the platform answered, not when an abort cuts the call off
        try:
            await s.calls.call(lambda: s.ops.edit(message_id, part), scopes=s.ops.scopes, retry=True)
        except PlatformError as exc:
            if not exc.outcome_unknown:  # refused: not carried out
                s.finishing = None
            raise
        s.finishing = None

    async def delete(self, message_id: str) -> None:
        s = self._sink
        s.deleting = message_id  # cleared when the call is over, not when an abort cuts it off
        try:
            await s.calls.call(lambda: s.ops.delete(message_id), scopes=s.ops.scopes, retry=s.final)
        except PlatformError:
            s.deleting = None
            raise
        s.deleting = None


class LiveSink:
    """A ``core.channel.TurnSink`` over a platform's ``MessageOps``."""

    def __init__(self, ops: MessageOps, render: Renderer, calls: Calls, *, settings: LiveSettings | None = None,
                 prompts: ApprovalPrompts | None = None, spawn: Spawn | None = None,
                 send_scopes: tuple[Scope, ...] = ()) -> None:
        """``spawn`` runs the approval prompts' calls and the opening typing indicator as supervised tasks
        (needed with ``prompts`` and for ``start_typing``); ``send_scopes`` are the budgets a new message
        counts against besides ``ops.scopes`` (a bot's sends over all its chats)."""
        if prompts is not None and spawn is None:
            raise ValueError("approval prompts need a spawn function")
        self.ops = ops
        self.send_scopes = send_scopes
        self.render = render
        self.calls = calls
        self.settings = settings or LiveSettings()
        self.prompts = prompts
        self._spawn_task = spawn
        caps = ops.capabilities
        self._limit = caps.limit
        self._measure = caps.measure or MEASURES[caps.unit]
        self.stream: NativeStream | None = ops.stream() if caps.native_stream else None
        self.reconciler = Reconciler(_Paced(self), honours_keys=caps.idempotent_sends)
        self.final = False
        """Set once the turn is over: calls are then retried within the policy."""
        self.deleting: str | None = None
        """The message a delete is on its way for (an abort counts it as deleted)."""
        self.finishing: str | None = None
        """The message a final edit is on its way for, or whose final edit timed out: the chat may show the
        edit after all (``final_in_doubt``)."""
        self._loop = asyncio.get_running_loop()
        self._opened = self._loop.time()
        self._typing_at = -1e9
        self._aborted = False
        self._finishing = False
        self._plain_final = False
        self._shown = False
        self._live_broken = False
        # the unfinished tail of the reply starts at ``_base`` in the text (with the fence ``_reopen``); the
        # ``_frozen`` messages before it are finished. ``_base_text`` is the text it was found in.
        self._incremental = True
        self._base, self._reopen, self._frozen, self._base_text = 0, "", 0, ""
        self._epoch = 0
        self._flushed: tuple[int, int, str] | None = None  # (text_epoch, length, status lines) last shown
        self._streamed_status = ""
        self._flushed_version = 0
        self._streamed: tuple[int, int, int] | None = None  # (text_epoch, base, length) the stream shows
        self._approvals: tuple[ApprovalRequest, ...] = ()
        self._pushed_approvals: tuple[ApprovalRequest, ...] = ()
        self._asked: dict[tuple[tuple[str, ...], str], _Asked] = {}
        """Posted prompts by (origin, call id): a subagent's call ids are its own, they may repeat the turn's."""
        self._paused_at_open = calls.throttle.paused_total(ops.scopes)
        self._opening: asyncio.Task[None] | None = None
        self._typing_skipped = asyncio.Event()
        """The opening typing indicator's call while nothing has waited for it yet (``start_typing``)."""
        self._final_cache: tuple[int, bool, list[Part]] | None = None
        self._feed: TurnFeed | None = None
        """The turn ``follow`` shows: a new message carries its newest snapshot (``_at_slot``)."""

    @property
    def ledger(self) -> Ledger:
        return self.reconciler.ledger

    # ---- TurnSink ------------------------------------------------------------------------------

    async def typing(self) -> None:
        """Show the typing indicator now (raises PlatformError: a channel may refuse to open on it)."""
        self._typing_at = self._loop.time()
        await self.calls.call(self.ops.typing, scopes=self.ops.scopes, paced=False, retry=False)

    def start_typing(self, delay: float = 0.0) -> None:
        """Show the typing indicator without waiting for it (so the model request does not wait behind a
        platform round trip); needs ``spawn``. What is shown next waits for this call to land. ``delay``: make
        the call only that many seconds from now, and not at all if something is shown (or the turn ends)
        before then."""
        self._typing_at = self._loop.time()
        self._opening = self._spawn("typing", self._open_typing(delay))

    async def _open_typing(self, delay: float) -> None:
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._typing_skipped.wait()
            if self._typing_skipped.is_set() or self._aborted:
                return
        try:
            await self.calls.call(self.ops.typing, scopes=self.ops.scopes, paced=False, retry=False)
        except PlatformError as exc:
            if exc.transient:
                log.debug("typing indicator failed: %s", exc)
                return
            log.info("the chat refused the typing indicator (%s): no live updates, only the final", exc)
            self._live_broken = True

    async def _typing_landed(self) -> None:
        """Wait for the opening typing indicator's call, if it was not waited for yet (typing before text)."""
        opening, self._opening = self._opening, None
        self._typing_skipped.set()  # an opening call still waiting for its moment is not made
        if opening is not None:
            await asyncio.wait((opening,))

    async def before_first_text(self) -> None:
        """Called as a new message is about to leave (its slot came): the opening typing indicator lands first,
        and is not made at all if its moment has not come yet. Until then it stays due: a first message waiting
        for its slot in a budget shared by every chat (a bot's new messages, in a burst) shows "typing…"
        meanwhile. A chat that refused the indicator for good gets no live message, only the final."""
        if self._opening is None:
            return
        async with outside_bound():  # the bridge's own wait, not the platform being slow to answer
            await self._typing_landed()
        if self._live_broken and not self.final:
            raise PlatformError("the chat refused the typing indicator: no live updates", kind="permanent")

    async def follow(self, turn: TurnFeed) -> None:
        self._feed = turn
        while not self._aborted and not self._finishing:
            snap = turn.snapshot
            if snap.terminal:
                return
            self._sync_approvals(snap)
            if self._live_broken:
                await turn.changed(urgent_only=True)
                continue
            if not self._news(snap):
                await turn.changed()
                continue
            now = self._loop.time()
            if not self._shown and not self._ready_to_show(snap, now):
                if now - self._typing_at >= self.settings.typing_every:
                    await self._quiet_typing()
                gate = self._opened + self.settings.first_delay - now
                await self._doze(turn, gate if gate > 0 else self.settings.typing_every, any_change=True)
                continue
            urgent = self._shows_approvals and snap.approvals is not self._pushed_approvals
            wait = 0.0 if urgent else self.calls.throttle.ready_in(self.ops.scopes)
            if wait > 0:
                with self.calls.throttle.waiting(self.ops.scopes) as ahead:
                    await self._doze(turn, wait + random.uniform(0.0, ahead), any_change=False)
                continue
            await self._flush(snap, urgent=urgent)

    async def finish(self, snapshot: TurnSnapshot) -> None:
        with ending():  # the end takes the chat's burst, not its next slot
            await self._finish(snapshot)

    async def _finish(self, snapshot: TurnSnapshot) -> None:
        self._finishing = True
        self.final = True
        await self._typing_landed()
        self._sync_approvals(snapshot)  # a terminal snapshot has none pending: the prompts are marked
        parts = self._final_parts(snapshot)
        try:
            if self.stream is not None:
                await self._close_stream(snapshot, parts)
            if not self.reconciler.pending(parts, final=True):
                return  # already showing it: finish is idempotent
            try:
                await self.reconciler.apply(parts, final=True)
            except PlatformError as exc:
                if exc.kind != "format":
                    raise
                log.warning("the platform rejected the formatted reply (%s); sending it as plain text", exc)
                self._plain_final = True
                parts = self._final_parts(snapshot)
                await self.reconciler.apply(parts, final=True)
        except PlatformError as exc:
            unsure = exc.outcome_unknown and self._unsure_send(parts)
            await self._remove_stale(parts)
            raise SinkError(str(exc), outcome_unknown=unsure) from None

    def _unsure_send_pending(self) -> bool:
        """Whether the next new message's last send, not accepted, may have been carried out on a platform that
        cannot recognise a repeat of it."""
        return not self.reconciler.honours_keys and self.reconciler.maybe_sent(len(self.ledger))

    def _unsure_send(self, parts: list[Part]) -> bool:
        """Whether the first part the chat does not show is a new message whose send may have been carried out:
        sending it again (the fallback) could show it twice."""
        ledger = self.ledger
        for i, part in enumerate(parts):
            if not ledger.shows(i, part):
                return i >= len(ledger) and self.reconciler.maybe_sent(i)
        return False

    async def abort(self) -> None:
        if self._aborted:
            return
        self._aborted = True
        ledger = self.ledger
        stream, self.stream = self.stream, None
        if stream is not None:
            self._adopt(stream.leftover())
        for index, entry in enumerate(ledger.entries):
            if entry.message_id == self.deleting:
                ledger.gone(index)  # maybe deleted: its words are sent again rather than lost
            elif not entry.gone:
                ledger.keep(index)

    def undelivered(self, snapshot: TurnSnapshot) -> str | None:
        return "\n\n".join(self.ledger.unshown(self._final_parts(snapshot)))

    def final_in_doubt(self) -> bool:
        """Whether a final edit of a message the chat shows was cut off by the abort (or timed out): it may
        have been carried out, so the chat may show the terminal state although the ledger counts it as not
        made."""
        return self.finishing is not None

    def paused_seconds(self) -> float:
        return max(0.0, self.calls.throttle.paused_total(self.ops.scopes) - self._paused_at_open)

    # ---- streaming -----------------------------------------------------------------------------

    def _news(self, snap: TurnSnapshot) -> bool:
        if self.stream is not None and self.stream.shows_activity:
            return snap.version != self._flushed_version
        return self._flushed != (snap.text_epoch, len(snap.text), status_lines(snap))

    def _ready_to_show(self, snap: TurnSnapshot, now: float) -> bool:
        """The first-message gate."""
        s = self.settings
        if now - self._opened < s.first_delay and len(snap.text) < s.first_chars:
            return False
        return bool(snap.text.strip()) or (self.stream is not None and self.stream.shows_activity) \
            or bool(status_lines(snap))

    async def _doze(self, turn: TurnFeed, seconds: float, *, any_change: bool) -> None:
        """Sleep ``seconds``, or less if the turn changes urgently (or at all, with ``any_change``)."""
        change = turn.changed(urgent_only=not any_change)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await change

    @property
    def _shows_approvals(self) -> bool:
        return self.stream is not None and self.stream.shows_activity

    async def _flush(self, snap: TurnSnapshot, *, urgent: bool = False) -> None:
        """Show ``snap`` with one step of platform calls (each taking its own slot; a stream that shows
        approvals shows a change of them at once)."""
        if self._opening is not None and self.stream is not None:  # a new message waits at its slot instead
            await self._typing_landed()
            if self._live_broken:
                return
        self._flushed = (snap.text_epoch, len(snap.text), status_lines(snap))
        self._flushed_version = snap.version
        try:
            stream = self.stream
            if stream is not None:
                try:
                    await self._flush_stream(snap, stream, urgent=urgent)
                    return
                except PlatformError as exc:
                    if exc.kind != "unsupported":
                        raise
                    log.info("native streaming ended here (%s); streaming by edits instead", exc)
                    self.stream = None
                    self._adopt(_leftover(stream))
                    if not self._shown and not snap.text.strip():
                        await self._quiet_typing()  # the stream was to show that the turn works: this does
            await self._flush_messages(snap)
        except PlatformError as exc:
            if exc.outcome_unknown and self._unsure_send_pending():
                # a new message that may show already: sending it again at the next slot could leave one copy
                # per slot; the final repeats it once (it is the send's one repeat), with the whole answer
                self._live_broken = True
            elif exc.transient:
                self._flushed = None  # shown again at the next slot
            elif exc.kind != "unsupported":
                self._live_broken = True  # e.g. the preview was deleted: only the final can repair it
            log.info("live update failed (the final repeats it): %s", exc)

    def _tail(self, snap: TurnSnapshot) -> list[Chunk]:
        """The unfinished tail of the text, split under the limit (only it: finished parts stay frozen)."""
        text = snap.text
        if self._limit is None:
            return [Chunk(text, 0)]
        if snap.text_epoch != self._epoch:
            self._epoch = snap.text_epoch
            if self._base and text[:self._base] != self._base_text[:self._base]:
                # rewound into finished parts: from now on every flush splits the whole text, and the
                # frozen messages wait for the final (rare: a retry after a whole message was written)
                self._incremental = False
                self._base, self._reopen, self._frozen = 0, "", 0
        return split(text, self._limit, self._measure, start=self._base, reopen=self._reopen)

    def _advance(self, snap: TurnSnapshot, chunks: list[Chunk], finished: int) -> None:
        """``finished`` more chunks are now frozen messages: the tail starts after them."""
        if finished and self._incremental:
            self._frozen += finished
            self._base, self._reopen, self._base_text = chunks[finished].start, chunks[finished].reopen, snap.text

    def _with_status(self, text: str, status: str) -> str:
        """``text`` with the status lines under it, when they fit the message (else ``text``)."""
        if not status:
            return text
        shown = f"{text}\n\n{status}" if text.strip() else status
        return shown if self._limit is None or self._measure(shown) <= self._limit else text

    async def _flush_messages(self, snap: TurnSnapshot) -> None:
        chunks = self._tail(snap)
        desired = self._stream_parts(snap, chunks)
        await self.reconciler.apply(desired, final=False, at_slot=self._at_slot(snap, len(desired)))
        self._shown = self._shown or bool(self.ledger)
        self._advance(snap, chunks, len(chunks) - 1)

    def _stream_parts(self, snap: TurnSnapshot, chunks: list[Chunk]) -> list[Part]:
        """What the messages show while ``snap`` streams: the frozen ones, then the tail with the status lines."""
        desired = [e.part for e in self.ledger.entries[:self._frozen]]
        texts = [c.text for c in chunks if c.text.strip()]
        status = status_lines(snap)
        if not status:
            return desired + [self.render.stream_part(t) for t in texts]
        last = texts.pop() if texts else ""
        # the status lines are shown, not said: the part's source stays the answer's words alone, so a
        # preview left in the chat counts as the beginning of its part (``Ledger.unshown``)
        shown = replace(self.render.stream_part(self._with_status(last, status)), source=last)
        return desired + [self.render.stream_part(t) for t in texts] + [shown]

    def _at_slot(self, booked: TurnSnapshot, count: int) -> Callable[[int, Part], Part]:
        """What a new message of a flush of ``booked`` (``count`` parts) carries when its send's slot comes: the
        turn's snapshot then, not the one it was booked with (a bot's budget of new messages may hold it for
        tens of seconds). Once the turn is over, the final's part for that message, so ``finish`` finds it
        shown (a format error on it ends in the plain final all the same); while it streams, the newest
        rendering of the open message, when the newest text still agrees with the messages before it."""

        def decide(index: int, part: Part) -> Part:
            latest = self._feed.snapshot if self._feed is not None else booked
            if latest is booked:
                return part
            if latest.terminal:
                final = self._final_parts(latest)
                return final[index] if index < len(final) else part
            if index != count - 1 or latest.text_epoch != booked.text_epoch:
                return part
            newest = self._stream_parts(latest, self._tail(latest))  # the same epoch: the tail starts where it did
            shown = self.ledger.entries[:index]
            if len(newest) <= index or any(e.part.content != p.content for e, p in zip(shown, newest, strict=False)):
                return part
            self._flushed = (latest.text_epoch, len(latest.text), status_lines(latest))
            return newest[index]

        return decide

    async def _flush_stream(self, snap: TurnSnapshot, stream: NativeStream, *, urgent: bool = False) -> None:
        chunks = self._tail(snap)
        if len(chunks) > 1:  # finished parts become messages; the stream shows only the last one
            if isinstance(stream, MessageStream) and self._streamed is not None:
                # the stream's message becomes the first finished part (edited into it below)
                handed = await self.calls.call(stream.handover, scopes=self.ops.scopes, retry=False)
                self._streamed = None
                self._adopt(handed)
            desired = [e.part for e in self.ledger.entries[:self._frozen]]
            desired += [self.render.stream_part(c.text) for c in chunks[:-1]]
            await self.reconciler.apply(desired, final=False, open_last=False)
            self._advance(snap, chunks, len(chunks) - 1)
        text = chunks[-1].text
        shown = self._streamed
        state = (snap.text_epoch, self._base, len(text))
        status = "" if stream.shows_activity else status_lines(snap)
        change: TextChange | None
        if status or self._streamed_status:  # the lines change as children move on: the whole text again
            text = self._with_status(text, status)
            change = TextChange(text, replace=True) if text.strip() else None
        elif shown is None or shown[:2] != state[:2] or len(text) < shown[2]:
            change = TextChange(text, replace=True)
        elif len(text) > shown[2]:
            change = TextChange(text[shown[2]:])
        else:
            change = None
        if change is None and not stream.shows_activity:
            return
        await self.calls.call(lambda: stream.push(snap, text, change), scopes=self.ops.scopes, retry=False,
                              paced=not urgent)
        self._streamed = state
        self._streamed_status = status
        self._pushed_approvals = snap.approvals
        self._shown = True

    async def _quiet_typing(self) -> None:
        if self.calls.throttle.paused_for(self.ops.scopes) > 0 or (self._opening and not self._opening.done()):
            return
        try:
            await self.typing()
        except PlatformError as exc:
            log.debug("typing indicator failed: %s", exc)

    # ---- the end -------------------------------------------------------------------------------

    def _final_parts(self, snapshot: TurnSnapshot) -> list[Part]:
        cached = self._final_cache
        if cached is not None and cached[0] == snapshot.version and cached[1] == self._plain_final:
            return cached[2]
        text = body(snapshot)
        render = self.render.plain_part if self._plain_final else self.render.final_part
        if not text.strip():
            parts: list[Part] = []
        elif self._limit is None:
            parts = [render(text)]
        else:
            parts = [render(c.text) for c in split(text, self._limit, self._measure)]
        self._final_cache = (snapshot.version, self._plain_final, parts)
        return parts

    async def _close_stream(self, snapshot: TurnSnapshot, parts: list[Part]) -> None:
        stream = self.stream  # kept until the close is over: an abort meanwhile counts what it shows
        assert stream is not None
        index = len(self.ledger)
        part = parts[index] if index < len(parts) else None
        try:
            message_id = await self.calls.call(lambda: stream.close(snapshot, part), scopes=self.ops.scopes)
        except PlatformError:
            self.stream = None
            self._adopt(_leftover(stream))  # a stale preview now: removed before a fallback
            raise
        self.stream = None
        if message_id is not None and part is not None:
            self.ledger.accepted_send(message_id, part)

    def _adopt(self, handed: tuple[str, Part] | None) -> None:
        """A stream's message joins the ledger as the next message (right after the frozen ones)."""
        if handed is not None:
            self.ledger.accepted_send(*handed)

    async def _remove_stale(self, parts: list[Part]) -> None:
        """The final could not be shown: delete every message that does not show its final part, so the
        fallback (which sends exactly the parts the ledger says are missing) does not leave the answer
        next to a stale preview. A message that cannot be deleted stays and counts for its words."""
        ledger = self.ledger
        for index in range(len(ledger) - 1, -1, -1):
            entry = ledger.entries[index]
            if entry.gone or (index < len(parts) and entry.part.content == parts[index].content):
                continue
            if not self.ops.capabilities.can_delete:
                ledger.keep(index)
                continue
            try:
                await self.reconciler.ops.delete(entry.message_id)
            except PlatformError as exc:
                log.warning("could not delete a stale preview: %s", exc)
                ledger.keep(index)
                continue
            ledger.gone(index)

    # ---- approvals -----------------------------------------------------------------------------

    def _sync_approvals(self, snapshot: TurnSnapshot) -> None:
        """Post new pending approvals; mark those that ended without a press. Never waits."""
        if self.prompts is None or snapshot.approvals is self._approvals:
            return
        self._approvals = snapshot.approvals
        prompts = self.prompts
        pending = {(a.origin, a.call_id) for a in snapshot.approvals}
        for request in snapshot.approvals:
            if (request.origin, request.call_id) not in self._asked:
                asked = _Asked(None)
                asked.posting = self._spawn(f"approval:{request.call_id}",
                                            self._post(prompts, asked, snapshot.session_key, request, self._feed))
                self._asked[(request.origin, request.call_id)] = asked
        for (origin, call_id), asked in self._asked.items():
            if (origin, call_id) not in pending and not asked.ended:
                asked.ended = True
                self._spawn(f"approval-ended:{call_id}",
                            self._end(prompts, asked, ended_line(snapshot, call_id, origin)))

    @staticmethod
    async def _post(prompts: ApprovalPrompts, asked: _Asked, session_key: str, request: ApprovalRequest,
                    turn: TurnFeed | None) -> None:
        """Post one request. When it cannot be shown (the post failed after the call policy's retries), core
        is told (``TurnFeed.approval_unshown``): it denies the call at once, saying why, instead of the turn
        waiting for a press nobody can make until the approval timeout. A post whose outcome is unknown (it
        may show, with its buttons) leaves the request pending: a press on it still decides it."""
        try:
            asked.handle = await prompts.post(session_key, request)
        except PlatformError as exc:
            if exc.outcome_unknown:
                log.warning("no answer to the approval request for %s (it may show); it stays pending: %s",
                            request.tool_name, exc)
                return
            log.warning("could not post the approval request for %s: %s", request.tool_name, exc)
        except Exception as exc:  # the prompt's own bookkeeping failed: nothing to press
            log.warning("could not post the approval request for %s: %s", request.tool_name, exc)
        if asked.handle is None and turn is not None:
            turn.approval_unshown(request.call_id, request.origin)

    @staticmethod
    async def _end(prompts: ApprovalPrompts, asked: _Asked, line: str) -> None:
        if asked.posting is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(asked.posting)
        if asked.handle is not None:
            await prompts.ended(asked.handle, line)

    def _spawn(self, name: str, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None] | None:
        assert self._spawn_task is not None
        try:
            return self._spawn_task(name, coro)
        except Exception:  # shutting down
            coro.close()
            return None
