"""ClusterBus: short notes between the chatbridge processes that share one store.

Several processes on one PostgreSQL database tell each other what cannot wait for a poll: a message for a
session another process serves, a ``/stop`` for a turn running elsewhere, a web event for a browser
connected to another process. A note is a topic and a small text payload; every subscriber of that topic
in every process gets it, the publishing process included, in publishing order per publisher.

Notes are hints, never the durable record: everything they announce is in the store first, and a process
that may have missed notes (its listening connection was lost and came back) is told through ``on_gap``,
so it can read the store again. A single process on SQLite uses :class:`LocalBus`, which only reaches its
own subscribers.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

MAX_PAYLOAD_BYTES = 7000
"""The largest payload (UTF-8) a note may carry: PostgreSQL's NOTIFY takes under 8,000 bytes, and the topic
travels with it. A larger fact goes into the store and the note names it."""

_TOPIC = re.compile(r"[a-z][a-z0-9_.-]{0,39}")

Callback = Callable[[str], None]
Unsubscribe = Callable[[], None]


class BusError(RuntimeError):
    """A note could not be published (the server is unreachable). Safe to log."""


class ClusterBus(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def publish(self, topic: str, payload: str) -> None:
        """Send ``payload`` to every subscriber of ``topic`` in every process (this one included).
        Raises ValueError for a bad topic or an oversized payload, BusError when it cannot be sent."""
        ...

    def subscribe(self, topic: str, callback: Callback) -> Unsubscribe:
        """Call ``callback(payload)`` for each note on ``topic``, on the event loop; it must not block.
        Notes published before the subscription are not replayed."""
        ...

    def on_gap(self, callback: Callable[[], None]) -> Unsubscribe:
        """Call ``callback()`` when notes may have been missed (after a lost connection came back)."""
        ...


def check_note(topic: str, payload: str) -> None:
    """Raise ValueError unless ``topic`` is a short lowercase name and ``payload`` fits in a note."""
    if not _TOPIC.fullmatch(topic):
        raise ValueError(f"bus topic {topic!r}: expected a lowercase name of at most 40 characters "
                         "(letters, digits, '_', '.', '-')")
    if "\x00" in payload:
        raise ValueError(f"bus note on {topic!r} contains a NUL character (encode binary data)")
    size = len(payload.encode("utf-8", "surrogatepass"))
    if size > MAX_PAYLOAD_BYTES:
        raise ValueError(f"bus note on {topic!r} is {size} bytes; at most {MAX_PAYLOAD_BYTES} fit "
                         "(store the fact and send its id)")


class Subscribers:
    """The callbacks of one process, by topic, and of gaps; shared by the bus implementations."""

    def __init__(self) -> None:
        self._topics: dict[str, list[Callback]] = {}
        self._gaps: list[Callable[[], None]] = []

    def add(self, topic: str, callback: Callback) -> Unsubscribe:
        check_note(topic, "")
        callbacks = self._topics.setdefault(topic, [])
        callbacks.append(callback)

        def unsubscribe() -> None:
            if callback in callbacks:
                callbacks.remove(callback)

        return unsubscribe

    def add_gap(self, callback: Callable[[], None]) -> Unsubscribe:
        self._gaps.append(callback)

        def unsubscribe() -> None:
            if callback in self._gaps:
                self._gaps.remove(callback)

        return unsubscribe

    def deliver(self, topic: str, payload: str) -> None:
        for callback in list(self._topics.get(topic, ())):
            try:
                callback(payload)
            except Exception:
                log.exception("a subscriber of bus topic %r failed", topic)

    def gap(self) -> None:
        for callback in list(self._gaps):
            try:
                callback()
            except Exception:
                log.exception("a bus gap callback failed")


class LocalBus:
    """The bus of a process that shares its store with nobody: notes reach this process's subscribers,
    soon after ``publish`` returns (never inside it, as with a server), in publishing order."""

    def __init__(self) -> None:
        self._subscribers = Subscribers()

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def publish(self, topic: str, payload: str) -> None:
        check_note(topic, payload)
        asyncio.get_running_loop().call_soon(self._subscribers.deliver, topic, payload)

    def subscribe(self, topic: str, callback: Callback) -> Unsubscribe:
        return self._subscribers.add(topic, callback)

    def on_gap(self, callback: Callable[[], None]) -> Unsubscribe:
        return self._subscribers.add_gap(callback)
