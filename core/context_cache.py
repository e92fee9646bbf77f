"""ContextCache: an active session's context messages, kept between its turns.

Without it every turn reloads and rebuilds up to ``history_limit`` rows although only the previous
turn's messages are new. The cache is exact, not approximate: it holds the context *at one
state_version*, and every message write raises the session's state_version, so a write the cache did
not see (``/new``, ``/compact``, another process) shows up as a version it does not hold, and the next
turn reloads. It belongs to the session worker, so an idle session (worker reaped) keeps nothing here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from core.llm.provider import LLMMessage
from core.messages import ChatMessage
from core.store import CommitResult, SessionRecord


class ContextCache:
    def __init__(self, limit: int) -> None:
        self._limit = max(limit, 0)
        self._version: int | None = None
        self._messages: list[ChatMessage] = []
        self._converted: dict[int, LLMMessage] = {}
        """Model-side form of cached messages by seq: a turn converts only what is new."""

    @property
    def version(self) -> int | None:
        """The state_version the cached messages belong to; None when nothing is cached."""
        return self._version

    def get(self, state_version: int) -> list[ChatMessage] | None:
        """The context at ``state_version`` (newest ``limit`` messages, seq order), if that is what is held."""
        if self._version != state_version:
            return None
        return list(self._messages)

    def converted(self, message: ChatMessage, convert: Callable[[ChatMessage], LLMMessage]) -> LLMMessage:
        """``convert(message)``, computed once per held message (messages never change once stored)."""
        done = self._converted.get(message.seq)
        if done is None:
            done = convert(message)
            if self._version is not None:
                self._converted[message.seq] = done
        return done

    def put(self, state_version: int, messages: Sequence[ChatMessage]) -> None:
        """Hold ``messages`` as the context at ``state_version`` (as the store returned it)."""
        self._converted = {}
        self._version = state_version
        self._messages = list(messages[max(len(messages) - self._limit, 0):])

    def extend(self, before: int, after: int, messages: Sequence[ChatMessage]) -> None:
        """A write moved the session from ``before`` to ``after`` by appending ``messages``. Applied only
        when the cache holds ``before`` and the messages continue it; anything else drops the cache."""
        if self._version != before:
            self.clear()
            return
        last = self._messages[-1].seq if self._messages else None
        for m in messages:
            if last is not None and m.seq <= last:
                self.clear()  # not a continuation: never guess
                return
            last = m.seq
        self._messages.extend(messages)
        if len(self._messages) > self._limit:
            del self._messages[: len(self._messages) - self._limit]
            first = self._messages[0].seq if self._messages else 0
            for seq in [s for s in self._converted if s < first]:
                del self._converted[seq]
        self._version = after

    def appended(self, message: ChatMessage, session: SessionRecord) -> None:
        """``Store.append_message`` returned ``message`` and the session after it (state_version +1).

        A message that is the first of its context (a new conversation, or the first after ``/new``) is
        that whole context: the cache holds it without a load, whatever it held before."""
        if message.seq == session.context_start_seq + 1:
            self.put(session.state_version, [message])
            return
        self.extend(session.state_version - 1, session.state_version, [message])

    def committed(self, result: CommitResult) -> None:
        """``Store.commit_turn`` inserted the last ``result.inserted`` of ``result.messages``."""
        before = result.state_version - (1 if result.inserted else 0)
        new = result.messages[len(result.messages) - result.inserted:] if result.inserted else ()
        self.extend(before, result.state_version, new)

    def clear(self) -> None:
        self._version = None
        self._messages = []
        self._converted = {}
