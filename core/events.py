"""In-process notifications for clients of core (the web chat's SSE streams, tests)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from core.controller import TurnController
from core.messages import ChatMessage

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TurnStarted:
    session_key: str
    turn_id: str
    controller: TurnController


@dataclass(frozen=True, slots=True)
class TurnCommitted:
    """The history delta of one revision: every message persisted since the previous one."""

    session_key: str
    history_revision: int
    messages: tuple[ChatMessage, ...]


@dataclass(frozen=True, slots=True)
class SessionTitleChanged:
    session_key: str
    title: str


CoreEvent = TurnStarted | TurnCommitted | SessionTitleChanged
Listener = Callable[[CoreEvent], None]


class EventBus:
    """Synchronous fan-out; listeners must not block (they hand work to their own queues)."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        self._listeners.append(listener)

        def unsubscribe() -> None:
            if listener in self._listeners:
                self._listeners.remove(listener)

        return unsubscribe

    def publish(self, event: CoreEvent) -> None:
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:
                log.exception("event listener failed on %s", type(event).__name__)
