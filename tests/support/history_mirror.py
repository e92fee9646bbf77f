"""HistoryMirror: the client side of history deltas (seed 001 §11), as reference logic for tests.

A client keeps one mirror per session. It applies a TurnCommitted delta only when it carries the next
revision, ignores messages it already has (by id), and asks for one full fetch on a revision gap. Deltas
for a session other than the open one only mark that session unread. History is read in pages (newest
first): an older page is added in front only when it ends right before the oldest message held, and a full
fetch (the newest page) keeps older pages already loaded when it overlaps them — stored messages never
change, so what was loaded stays true. The web page implements the same rules in JavaScript
(channels/web/static/app.js); this module is what they are tested against.
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
    has_more: bool = False
    """Older messages exist than the oldest one held."""
    _ids: set[str] = field(default_factory=set)

    def load_full(self, session: str, revision: int, messages: list[dict[str, Any]],
                  has_more: bool = False) -> None:
        """First load, reconnect miss, gap recovery or a session switch: the newest page replaces what is
        held, except older pages of the same session that it overlaps."""
        kept: list[dict[str, Any]] = []
        if session == self.open_session and messages:
            first = messages[0]["id"]
            at = next((i for i, m in enumerate(self.messages) if m["id"] == first), None)
            if at is not None:
                kept, has_more = self.messages[:at], self.has_more
        self.open_session = session
        self.revision = revision
        self.messages = kept + list(messages)
        self._ids = {m["id"] for m in self.messages}
        self.unread.discard(session)
        self.fetch_pending = False
        self.has_more = has_more

    def load_older(self, session: str, before: str, messages: list[dict[str, Any]], has_more: bool) -> bool:
        """The page of messages older than ``before``; False (nothing changes) unless ``before`` is still the
        oldest message held in ``session``."""
        if session != self.open_session or not self.messages or self.messages[0]["id"] != before:
            return False
        older = [m for m in messages if m["id"] not in self._ids]
        self._ids.update(m["id"] for m in older)
        self.messages = older + self.messages
        self.has_more = has_more
        return True

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
