"""TurnController: the only producer of TurnSnapshots for a turn.

Turn events (``core.agent.events``: text, tool calls, approvals, tool outputs, retries, notices, abort)
change the turn's state; tool activity and pending approvals come only from here. Event listeners
(``subscribe``) get every turn event, partials included, in stream order.

Snapshots are pulled, not pushed: an event only records the change and raises the version (a streamed
token costs a list append and a counter, no snapshot and no wake-up), and ``snapshot`` builds the
immutable picture when someone asks for it. A sink asks when the platform's pace lets it show something,
so a slow sink sees the newest snapshot, never a backlog. ``changed`` wakes a waiting sink on the next
change; ``urgent_only`` waits only for what must be shown at once (approvals, the terminal state).

An abort event (``Abort``: "stop" for /stop and shutdown, "failed" for a failed turn) ends what is left: each
pending approval is recorded as ended by it (``decided``), and running tools and children are marked stopped or
failed, in the same change, so every prompt can say how it ended (``channels.common.live_sink.ended_line``).

Visible text: the text of every model request of the turn, joined by a blank line (a sentence the model
wrote before calling a tool stays visible), plus a max_turns notice if one ended the loop. A retried
request rewinds it to where that request began (``text_epoch`` rises).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from core.agent.approvals import summarize_arguments
from core.agent.events import (
    Abort,
    ApprovalDecided,
    ApprovalRequested,
    CompleteToolCall,
    Forwarded,
    Notice,
    PartialText,
    RequestBegin,
    RequestEnd,
    SessionMeta,
    SubagentEnded,
    ToolOutput,
    TurnEvent,
)
from core.snapshot import (
    ApprovalOutcome,
    ApprovalRequest,
    ChildActivity,
    ChildState,
    SnapshotState,
    ToolActivity,
    ToolStatus,
    TurnSnapshot,
)

log = logging.getLogger(__name__)

EventListener = Callable[[TurnEvent], None]

REPLY_FAILED = "the reply failed"
"""The summary of a tool call a failure cut off or left waiting for approval (``Abort("failed")``)."""


class TurnController:
    def __init__(self, turn_id: str, session_key: str) -> None:
        self._snap = TurnSnapshot(turn_id=turn_id, session_key=session_key, version=1, state="running")
        self._version = 1
        self._state: SnapshotState = "running"
        # The visible text is "".join(self._pieces): appending a streamed token is O(1); the string is
        # built only when a snapshot (or ``text``) is asked for.
        self._pieces: list[str] = []
        self._length = 0
        self._epoch = 0
        self._tools: tuple[ToolActivity, ...] = ()
        self._approvals: tuple[ApprovalRequest, ...] = ()
        self._decided: tuple[ApprovalOutcome, ...] = ()
        self._error: str | None = None
        self._children: dict[tuple[str, ...], ChildActivity] = {}
        self._children_view: tuple[ChildActivity, ...] = ()
        self._waiters: list[asyncio.Future[None]] = []
        self._urgent: list[asyncio.Future[None]] = []
        self._listeners: list[EventListener] = []
        self._request_length = 0  # visible length when the current request began (a retry goes back to it)
        self._separate = False  # the next request's first text starts after a blank line
        self._closed = False
        """Set by an abort event or the terminal state: later events are ignored."""
        self._unshown: Callable[[str, tuple[str, ...]], object] | None = None
        self.trace: list[TurnEvent] = []
        """Every complete (non-partial) event in stream order; written to the store after the turn. Events
        forwarded from child sessions are not part of it (each child keeps its own trace)."""

    @property
    def snapshot(self) -> TurnSnapshot:
        """The newest snapshot (built now if anything changed since the last one)."""
        snap = self._snap
        if snap.version != self._version:
            snap = self._snap = TurnSnapshot(
                turn_id=snap.turn_id, session_key=snap.session_key, version=self._version, state=self._state,
                text=self.text, tools=self._tools, approvals=self._approvals, decided=self._decided,
                error=self._error,
                text_epoch=self._epoch, children=self._children_view)
        return snap

    @property
    def text(self) -> str:
        pieces = self._pieces
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]
        return pieces[0] if pieces else ""

    @property
    def terminal(self) -> bool:
        return self._state != "running"

    def subscribe(self, listener: EventListener) -> Callable[[], None]:
        """Get every turn event of this turn, in stream order (listeners must not block)."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def on_unshown(self, handler: Callable[[str, tuple[str, ...]], object]) -> Callable[[], None]:
        """Who denies a pending request the chat could not show (the turn's runner: ``approval_unshown``);
        returns the function that takes it back."""
        self._unshown = handler

        def remove() -> None:
            if self._unshown is handler:
                self._unshown = None

        return remove

    def approval_unshown(self, call_id: str, origin: tuple[str, ...] = ()) -> None:
        """A sink could not show this pending approval request (its post failed, after the channel's retries):
        it is denied at once, and the model is told why, rather than the turn waiting for a press nobody can
        make until the approval timeout. Nothing happens when it is no longer pending."""
        if self._closed or self._unshown is None:
            return
        if any(a.call_id == call_id and a.origin == origin for a in self._approvals):
            self._unshown(call_id, origin)

    def changed(self, *, urgent_only: bool = False) -> asyncio.Future[None]:
        """A future resolved by the next change (``urgent_only``: the next change of the pending approvals or
        the terminal state). Already resolved once the turn is over. Cancelling it is how a waiter gives up."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self.terminal:
            fut.set_result(None)
            return fut
        waiters = self._urgent if urgent_only else self._waiters
        if len(waiters) > 8:  # waiters that gave up (timed out) are dropped here, not on every change
            waiters[:] = [w for w in waiters if not w.done()]
        waiters.append(fut)
        return fut

    def _changed(self, *, urgent: bool = False) -> None:
        self._version += 1
        if self._waiters:
            self._wake(self._waiters)
        if urgent and self._urgent:
            self._wake(self._urgent)

    @staticmethod
    def _wake(waiters: list[asyncio.Future[None]]) -> None:
        woken = list(waiters)
        waiters.clear()
        for w in woken:
            if not w.done():
                w.set_result(None)

    # ---- turn events ---------------------------------------------------------------------------

    def apply(self, event: TurnEvent) -> None:
        """One turn event, in stream order. Nothing follows an abort event or the terminal state."""
        if self._closed:
            return
        if event.partial:  # a streamed fragment (most events): not part of the trace
            self._update(event)
        elif isinstance(event, Forwarded):
            self._child_event(event.origin, event.event)
        else:
            self.trace.append(event)
            self._update(event)
            if isinstance(event, Abort):
                self._closed = True
        if self._listeners:
            for listener in list(self._listeners):
                try:
                    listener(event)
                except Exception:
                    log.exception("turn event listener failed on %s", event.kind)

    def _update(self, event: TurnEvent) -> None:
        if isinstance(event, PartialText):  # by far the most frequent event: checked first
            if event.phase == "delta" and event.text:
                if self._separate and self._length == self._request_length and self._length:
                    self._append("\n\n")
                self._append(event.text)
                self._changed()
        elif isinstance(event, RequestBegin):
            if event.attempt == 1:
                self._request_length = self._length
                self._separate = bool(self._length)
        elif isinstance(event, RequestEnd):
            if event.retry_in is not None and self._length != self._request_length:
                self._rewind(self._request_length)
        elif isinstance(event, CompleteToolCall):
            self._tools = (*self._tools, ToolActivity(event.call_id, event.name, "awaiting_approval",
                                                      summarize_arguments(event.arguments, 80)))
            self._changed()
        elif isinstance(event, ApprovalRequested):
            self._approvals = (*self._approvals, ApprovalRequest(
                event.call_id, event.tool_name, event.arguments_summary, event.requested_by, event.arguments))
            self._changed(urgent=True)
        elif isinstance(event, ApprovalDecided):
            self._approvals = tuple(a for a in self._approvals if a.call_id != event.call_id)
            self._decided_one((), event)
            self._tools = self._tool_status(event.call_id, "running" if event.decision == "allow" else "denied")
            self._changed(urgent=True)
        elif isinstance(event, ToolOutput):
            status: ToolStatus = ("done" if event.status == "done" else "denied" if event.status == "denied"
                                  else "failed")
            self._tools = self._tool_status(event.call_id, status, summarize_arguments(event.output, 80))
            self._changed()
        elif isinstance(event, Notice):
            if self._length:
                self._append("\n\n")
            self._append(event.text)
            self._changed()
        elif isinstance(event, SubagentEnded):
            self._child_ended((event.session_key,), event)
        elif isinstance(event, Abort):
            failed = event.reason == "failed"
            summary = REPLY_FAILED if failed else "stopped"
            self._tools = tuple(dataclasses.replace(t, status="failed", summary=summary)
                                if t.status in ("running", "awaiting_approval") else t for t in self._tools)
            self._end_approvals(lambda _: True)
            self._end_children((), failed=failed)
            self._changed(urgent=True)

    # ---- child sessions ------------------------------------------------------------------------

    def _child_event(self, origin: tuple[str, ...], event: TurnEvent) -> None:
        """An event of the child session ``origin[-1]``: its status line and its pending approvals (which
        are decided in this chat). Its text never becomes this turn's text."""
        if isinstance(event, SessionMeta):
            self._set_child(origin, ChildActivity(origin, event.call_id, event.profile, event.task))
            return
        child = self._children.get(origin)
        if child is None:
            return
        if isinstance(event, PartialText):
            if event.phase == "delta" and child.step != "writing":
                self._set_child(origin, dataclasses.replace(child, step="writing"))
        elif isinstance(event, RequestBegin):
            self._set_child(origin, dataclasses.replace(child, step="thinking"))
        elif isinstance(event, CompleteToolCall):
            self._set_child(origin, dataclasses.replace(child, step=event.name))
        elif isinstance(event, ApprovalRequested):
            self._approvals = (*self._approvals, ApprovalRequest(
                event.call_id, event.tool_name, event.arguments_summary, event.requested_by, event.arguments,
                origin, child.label))
            self._set_child(origin, dataclasses.replace(child, step=f"waiting for approval: {event.tool_name}"),
                            urgent=True)
        elif isinstance(event, ApprovalDecided):
            self._approvals = tuple(a for a in self._approvals
                                    if not (a.origin == origin and a.call_id == event.call_id))
            self._decided_one(origin, event)
            self._changed(urgent=True)
        elif isinstance(event, SubagentEnded):
            self._child_ended((*origin, event.session_key), event)
        elif isinstance(event, Abort):  # the child was stopped (or failed), and every child it had started with it
            self._end_approvals(lambda a: a.origin[:len(origin)] == origin)
            self._end_children(origin, failed=event.reason == "failed")
            self._changed(urgent=True)

    def _decided_one(self, origin: tuple[str, ...], event: ApprovalDecided) -> None:
        self._decided = (*self._decided, ApprovalOutcome(event.call_id, origin, event.decision, event.reason,
                                                         event.shown_by))

    def _child_ended(self, origin: tuple[str, ...], event: SubagentEnded) -> None:
        child = self._children.get(origin)
        if child is None:  # its session_meta never reached this turn (defensive: every child sends one first)
            child = ChildActivity(origin, event.call_id, event.profile, event.task)
        # in the same change as the child's state, which says how its prompts ended (a failed child's too)
        self._end_approvals(lambda a: a.origin[:len(origin)] == origin)
        self._set_child(origin, dataclasses.replace(child, state=event.outcome, step=event.outcome), urgent=True)

    def _end_approvals(self, which: Callable[[ApprovalRequest], bool]) -> None:
        """The pending approvals ``which`` selects end without a decision (their turn or child ended): each is
        recorded as denied by the abort, so every prompt that showed it is marked from the turn's record (how:
        from the state of the turn or the child that ended, ``channels.common.live_sink.ended_line``)."""
        ended = [a for a in self._approvals if which(a)]
        if not ended:
            return
        self._approvals = tuple(a for a in self._approvals if not which(a))
        self._decided = (*self._decided, *(ApprovalOutcome(a.call_id, a.origin, "deny", "abort") for a in ended))

    def _end_children(self, origin: tuple[str, ...], *, failed: bool) -> None:
        """The children under ``origin`` (all of them for ``()``) that still run end with it: stopped, or failed
        when a failure ended it."""
        state: ChildState = "failed" if failed else "cancelled"
        step = "failed" if failed else "stopped"
        for key, other in self._children.items():
            if key[:len(origin)] == origin and other.state == "running":
                self._children[key] = dataclasses.replace(other, state=state, step=step)
        self._children_view = tuple(self._children.values())

    def _set_child(self, origin: tuple[str, ...], child: ChildActivity, *, urgent: bool = False) -> None:
        self._children[origin] = child
        self._children_view = tuple(self._children.values())
        self._changed(urgent=urgent)

    def _append(self, text: str) -> None:
        self._pieces.append(text)
        self._length += len(text)

    def _rewind(self, length: int) -> None:
        """A retried model request starts over: the visible text goes back to its first ``length`` characters."""
        text = self.text[:length]
        self._pieces[:] = [text] if text else []
        self._length = length
        self._epoch += 1
        self._changed()

    def _tool_status(self, call_id: str, status: ToolStatus, summary: str | None = None) -> tuple[ToolActivity, ...]:
        return tuple(dataclasses.replace(t, status=status, summary=t.summary if summary is None else summary)
                     if t.call_id == call_id else t for t in self._tools)

    # ---- terminal state ------------------------------------------------------------------------

    def finish(self, state: SnapshotState, *, text: str | None = None, error: str | None = None) -> TurnSnapshot:
        """The terminal snapshot (final: later events are ignored). ``text`` replaces the visible text."""
        if state == "running":
            raise ValueError("finish needs a terminal state")
        if self.terminal:
            return self.snapshot
        if text is not None and text != self.text:
            if not text.startswith(self.text):
                self._epoch += 1
            self._pieces[:] = [text] if text else []
            self._length = len(text)
        self._state, self._error = state, error
        self._end_approvals(lambda _: True)
        if any(c.state == "running" for c in self._children.values()):
            self._end_children((), failed=state == "failed")
        self._closed = True
        self._changed(urgent=True)
        self._wake(self._waiters)
        return self.snapshot
