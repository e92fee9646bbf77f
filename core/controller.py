"""TurnController: the only producer of TurnSnapshots for a turn.

Turn events (``core.agent.events``: text, tool calls, approvals, tool outputs, retries, notices, abort)
become new immutable snapshots with a rising version; tool activity and pending approvals come only
from here. Watchers always get the newest snapshot: a slow consumer skips intermediate ones, never builds
a backlog. Event listeners (``subscribe``) get every turn event, partials included, in stream order.

Visible text: the text of every model request of the turn, joined by a blank line (a sentence the model
wrote before calling a tool stays visible), plus a max_turns notice if one ended the loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncGenerator, Callable

from core.agent.approvals import summarize_arguments
from core.agent.events import (
    Abort,
    ApprovalDecided,
    ApprovalRequested,
    CompleteToolCall,
    Notice,
    PartialText,
    RequestBegin,
    RequestEnd,
    ToolOutput,
    TurnEvent,
)
from core.snapshot import ApprovalRequest, SnapshotState, ToolActivity, ToolStatus, TurnSnapshot

log = logging.getLogger(__name__)

EventListener = Callable[[TurnEvent], None]


class TurnController:
    def __init__(self, turn_id: str, session_key: str) -> None:
        self._snap = TurnSnapshot(turn_id=turn_id, session_key=session_key, version=1, state="running")
        self._waiters: list[asyncio.Future[None]] = []
        self._listeners: list[EventListener] = []
        self._request_text = ""  # visible text when the current request began (a retry goes back to it)
        self._separate = False  # the next request's first text starts after a blank line
        self._aborted = False
        self.trace: list[TurnEvent] = []
        """Every complete (non-partial) event in stream order; written to the store after the turn."""

    @property
    def snapshot(self) -> TurnSnapshot:
        return self._snap

    @property
    def text(self) -> str:
        return self._snap.text

    def subscribe(self, listener: EventListener) -> Callable[[], None]:
        """Get every turn event of this turn, in stream order (listeners must not block)."""
        self._listeners.append(listener)
        return lambda: self._listeners.remove(listener) if listener in self._listeners else None

    def _publish(self, **changes: object) -> TurnSnapshot:
        if self._snap.terminal:
            return self._snap  # a terminal snapshot is final; late events are ignored
        self._snap = dataclasses.replace(self._snap, version=self._snap.version + 1, **changes)  # type: ignore[arg-type]
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)
        return self._snap

    # ---- turn events ---------------------------------------------------------------------------

    def apply(self, event: TurnEvent) -> None:
        """One turn event, in stream order. Nothing follows an abort event."""
        if self._aborted or self._snap.terminal:
            return
        if not event.partial:
            self.trace.append(event)
        self._update(event)
        if isinstance(event, Abort):
            self._aborted = True
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("turn event listener failed on %s", event.kind)

    def _update(self, event: TurnEvent) -> None:
        snap = self._snap
        if isinstance(event, RequestBegin):
            if event.attempt == 1:
                self._request_text = snap.text
                self._separate = bool(snap.text)
        elif isinstance(event, PartialText):
            if event.phase == "delta" and event.text:
                sep = "\n\n" if self._separate and snap.text == self._request_text else ""
                self._publish(text=snap.text + sep + event.text)
        elif isinstance(event, RequestEnd):
            if event.retry_in is not None:
                self.reset_text(self._request_text)
        elif isinstance(event, CompleteToolCall):
            self._publish(tools=(*snap.tools, ToolActivity(event.call_id, event.name, "awaiting_approval",
                                                           summarize_arguments(event.arguments, 80))))
        elif isinstance(event, ApprovalRequested):
            self._publish(approvals=(*snap.approvals, ApprovalRequest(
                event.call_id, event.tool_name, event.arguments_summary, event.requested_by, event.arguments)))
        elif isinstance(event, ApprovalDecided):
            self._publish(approvals=tuple(a for a in snap.approvals if a.call_id != event.call_id),
                          tools=self._tool_status(event.call_id, "running" if event.decision == "allow"
                                                  else "denied"))
        elif isinstance(event, ToolOutput):
            status: ToolStatus = ("done" if event.status == "done" else "denied" if event.status == "denied"
                                  else "failed")
            self._publish(tools=self._tool_status(event.call_id, status, summarize_arguments(event.output, 80)))
        elif isinstance(event, Notice):
            self._publish(text=f"{snap.text}\n\n{event.text}" if snap.text else event.text)
        elif isinstance(event, Abort):
            tools = tuple(dataclasses.replace(t, status="failed", summary="stopped")
                          if t.status in ("running", "awaiting_approval") else t for t in snap.tools)
            self._publish(approvals=(), tools=tools)

    def _tool_status(self, call_id: str, status: ToolStatus, summary: str | None = None) -> tuple[ToolActivity, ...]:
        return tuple(dataclasses.replace(t, status=status, summary=t.summary if summary is None else summary)
                     if t.call_id == call_id else t for t in self._snap.tools)

    # ---- text and terminal state ---------------------------------------------------------------

    def append_text(self, delta: str) -> None:
        if delta:
            self._publish(text=self._snap.text + delta)

    def reset_text(self, text: str) -> None:
        """A retried model request starts over: the visible text goes back to ``text``."""
        if text != self._snap.text:
            self._publish(text=text)

    def finish(self, state: SnapshotState, *, text: str | None = None, error: str | None = None) -> TurnSnapshot:
        if state == "running":
            raise ValueError("finish needs a terminal state")
        return self._publish(state=state, text=self._snap.text if text is None else text, error=error,
                             approvals=())

    async def watch(self) -> AsyncGenerator[TurnSnapshot, None]:
        """Yield the newest snapshot whenever it changed, ending after the terminal one."""
        seen = 0
        while True:
            snap = self._snap
            if snap.version > seen:
                seen = snap.version
                yield snap
                if snap.terminal:
                    return
                continue
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut
