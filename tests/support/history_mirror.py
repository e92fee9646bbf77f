"""HistoryMirror: the client side of history deltas (seed 001 §11), as reference logic for tests.

A client keeps one mirror per session. It applies a TurnCommitted delta only when it carries the next
revision, ignores messages it already has (by id), and asks for one full fetch on a revision gap. Deltas
for a session other than the open one only mark that session unread. The web page implements the same
rules in JavaScript (channels/web/static/app.js); this module states them in Python, and the page's
behaviour is tested against the same cases.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class DeltaResult(Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    NEEDS_FULL_FETCH = "needs_full_fetch"
    MARKED_UNREAD = "marked_unread"


@dataclass
class HistoryMirror:
    open_session: str | None = None
    revision: int | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    unread: set[str] = field(default_factory=set)
    fetch_pending: bool = False
    _ids: set[str] = field(default_factory=set)

    def load_full(self, session: str, revision: int, messages: list[dict[str, Any]]) -> None:
        """First load, reconnect miss, gap recovery or a session switch: replace everything."""
        self.open_session = session
        self.revision = revision
        self.messages = list(messages)
        self._ids = {m["id"] for m in messages}
        self.unread.discard(session)
        self.fetch_pending = False

    def apply_delta(self, session: str, revision: int, messages: list[dict[str, Any]]) -> DeltaResult:
        if session != self.open_session:
            self.unread.add(session)
            return DeltaResult.MARKED_UNREAD
        if self.revision is not None and revision <= self.revision:
            return DeltaResult.DUPLICATE
        if self.revision is None or revision != self.revision + 1:
            if self.fetch_pending:  # one full fetch is already on its way
                return DeltaResult.DUPLICATE
            self.fetch_pending = True
            return DeltaResult.NEEDS_FULL_FETCH
        for m in messages:
            if m["id"] not in self._ids:
                self._ids.add(m["id"])
                self.messages.append(m)
        self.revision = revision
        return DeltaResult.APPLIED
