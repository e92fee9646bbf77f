"""The web chat as a ChannelPort: the session's SSE stream is the platform.

A sink appends ``turn`` events to its session's stream; ``finish`` succeeds once the terminal event is in
the stream (from there every connected client gets it, and a reconnecting one replays it or resyncs).
``send_plain`` (busy notices, command replies, fallbacks) appends a ``notice`` event. History deltas and
titles come from the core's event bus.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from channels.web.sse import StreamHub, Subscriber, encode_event
from core.channel import SinkError
from core.envelope import TurnTarget
from core.events import CoreEvent, SessionTitleChanged, TurnCommitted
from core.snapshot import TurnSnapshot

log = logging.getLogger(__name__)

KEY_PREFIX = "web:"
CHANNEL = "web"


def session_key(session_id: str) -> str:
    return KEY_PREFIX + session_id


def session_id_of(key: str) -> str | None:
    return key[len(KEY_PREFIX):] if key.startswith(KEY_PREFIX) else None


class WebSink:
    """Live rendering of one turn into its session's SSE stream, at most one event per ``interval``."""

    def __init__(self, channel: WebChannel, target: TurnTarget) -> None:
        self._channel = channel
        self._session_id = target.chat_id
        self._client_id = target.channel_context.data.get("client_id")
        self._last_emit = 0.0

    async def update(self, snapshot: TurnSnapshot) -> None:
        # Latest wins: while this waits, newer snapshots replace each other in the controller.
        wait = self._last_emit + self._channel.update_interval - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        self._channel.hub.stream(self._session_id).turn_update(snapshot, self._client_id)
        self._last_emit = time.monotonic()

    async def finish(self, snapshot: TurnSnapshot) -> None:
        stream = self._channel.hub.stream(self._session_id)
        stream.turn_update(snapshot, self._client_id)  # idempotent: a repeat finds the terminal already sent
        if not stream.has_terminal(snapshot.turn_id):
            raise SinkError("terminal event not recorded", transient=True)

    async def abort(self) -> None:
        return None

    def undelivered(self, snapshot: TurnSnapshot) -> str | None:
        return None


class WebChannel:
    """``ChannelPort`` named "web", plus the fan-out of core events to the session streams."""

    name = CHANNEL

    def __init__(self, hub: StreamHub | None = None, *, update_interval: float = 0.05) -> None:
        self.hub = hub if hub is not None else StreamHub()
        self.update_interval = update_interval
        self._feed: set[Subscriber] = set()  # the session-list feed (/api/events)

    async def open_sink(self, target: TurnTarget) -> WebSink:
        self.hub.stream(target.chat_id)
        return WebSink(self, target)

    async def send_plain(self, target: TurnTarget, text: str) -> None:
        data: dict[str, Any] = {"text": text, "client_id": target.channel_context.data.get("client_id"),
                                "at": time.time()}
        self.hub.stream(target.chat_id).append("notice", data)

    # ---- core events ----------------------------------------------------------------------------

    def on_core_event(self, event: CoreEvent) -> None:
        if isinstance(event, TurnCommitted):
            sid = session_id_of(event.session_key)
            if sid is None:
                return
            self.hub.stream(sid).append("turn_committed", {
                "session_id": sid, "history_revision": event.history_revision,
                "messages": [m.history_view() for m in event.messages]})
            self.publish_feed("session_activity", {"session_id": sid, "history_revision": event.history_revision})
        elif isinstance(event, SessionTitleChanged):
            sid = session_id_of(event.session_key)
            if sid is None:
                return
            self.hub.stream(sid).append("session_title", {"session_id": sid, "title": event.title})
            self.publish_feed("session_title", {"session_id": sid, "title": event.title})

    # ---- the session-list feed ------------------------------------------------------------------

    def publish_feed(self, name: str, data: dict[str, Any]) -> None:
        encoded = encode_event(name, data)
        for sub in list(self._feed):
            sub.push(encoded)

    def feed_subscribe(self) -> Subscriber:
        sub = Subscriber(max_pending=1000)
        self._feed.add(sub)
        return sub

    def feed_unsubscribe(self, sub: Subscriber) -> None:
        self._feed.discard(sub)

    def close_connections(self) -> None:
        self.hub.close_all()
        for sub in list(self._feed):
            sub.close()
