"""TurnController: the only producer of TurnSnapshots for a turn.

Turn events (text deltas, retries, the terminal state) become new immutable snapshots with a rising
version. Watchers always get the newest snapshot: a slow consumer skips intermediate ones, never
builds a backlog.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

from core.snapshot import SnapshotState, TurnSnapshot


class TurnController:
    def __init__(self, turn_id: str, session_key: str) -> None:
        self._snap = TurnSnapshot(turn_id=turn_id, session_key=session_key, version=1, state="running")
        self._waiters: list[asyncio.Future[None]] = []

    @property
    def snapshot(self) -> TurnSnapshot:
        return self._snap

    @property
    def text(self) -> str:
        return self._snap.text

    def _publish(self, **changes: object) -> TurnSnapshot:
        if self._snap.terminal:
            return self._snap  # a terminal snapshot is final; late events are ignored
        self._snap = dataclasses.replace(self._snap, version=self._snap.version + 1, **changes)  # type: ignore[arg-type]
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)
        return self._snap

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

    async def watch(self) -> AsyncIterator[TurnSnapshot]:
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
