"""The web chat as a ChannelPort: the session's SSE stream is the platform.

A turn is shown by the shared live sink (``channels.common.live_sink``) through the session's stream,
which is a native stream: each ``turn`` event appends what the text gained, or replaces it when a retried
model request rewound it, and carries the tools, approvals and state when they change; at most one event
per ``update_interval`` (latest wins). ``finish`` succeeds once the terminal event is in the stream (from
there every connected client gets it, and a reconnecting one replays it or resyncs).
``send_plain`` (busy notices, command replies, fallbacks) appends a ``notice`` event. History deltas and
titles come from the core's event bus.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from channels.common.calls import CallPolicy, Calls
from channels.common.errors import PlatformError
from channels.common.ledger import Part
from channels.common.live_sink import LiveSettings, LiveSink
from channels.common.ops import Capabilities, NativeStream, PlainRenderer, TextChange
from channels.common.throttle import Scope, Throttle
from channels.web.sse import StreamHub, Subscriber, encode_event
from core.envelope import TurnTarget
from core.events import CoreEvent, SessionTitleChanged, TurnCommitted
from core.snapshot import TurnSnapshot

log = logging.getLogger(__name__)

KEY_PREFIX = "web:"
CHANNEL = "web"
# the page shows a turn as soon as it starts (its "thinking" state): no first-message gate
NO_GATE = LiveSettings(first_chars=0, first_delay=0.0)


def session_key(session_id: str) -> str:
    return KEY_PREFIX + session_id


def session_id_of(key: str) -> str | None:
    return key[len(KEY_PREFIX):] if key.startswith(KEY_PREFIX) else None


class WebOps:
    """``MessageOps`` of one session: a turn is one live entry of its SSE stream, never separate messages."""

    capabilities = Capabilities(limit=None, unit="chars", can_delete=False, native_stream=True)

    def __init__(self, channel: WebChannel, target: TurnTarget) -> None:
        self._stream = WebStream(channel.hub, target.chat_id, target.channel_context.data.get("client_id"))
        self.scopes: tuple[Scope, ...] = (Scope(f"session:{target.chat_id}", channel.update_interval),)

    async def send(self, part: Part, key: str) -> str:
        raise PlatformError("the web chat shows a turn only through its stream", kind="permanent")

    async def edit(self, message_id: str, part: Part) -> None:
        raise PlatformError("the web chat shows a turn only through its stream", kind="permanent")

    async def delete(self, message_id: str) -> None:
        raise PlatformError("the web chat shows a turn only through its stream", kind="permanent")

    async def typing(self) -> None:
        return None  # the page shows the running turn itself

    def stream(self) -> NativeStream | None:
        return self._stream


class WebStream:
    """The session's SSE stream as a native stream: ``turn`` events with ``append`` or ``replace``."""

    shows_activity = True

    def __init__(self, hub: StreamHub, session_id: str, client_id: str | None) -> None:
        self._hub = hub
        self._session_id = session_id
        self._client_id = client_id

    async def push(self, snapshot: TurnSnapshot, text: str, change: TextChange | None) -> None:
        appended = "" if change is None else None if change.replace else change.text
        self._hub.stream(self._session_id).turn_update(snapshot, self._client_id, appended=appended)

    async def close(self, snapshot: TurnSnapshot, part: Part | None) -> str | None:
        stream = self._hub.stream(self._session_id)
        stream.turn_update(snapshot, self._client_id)  # idempotent: a repeat finds the terminal already sent
        if not stream.has_terminal(snapshot.turn_id):
            raise PlatformError("terminal event not recorded", kind="permanent")
        return snapshot.turn_id


class WebChannel:
    """``ChannelPort`` named "web", plus the fan-out of core events to the session streams."""

    name = CHANNEL

    def __init__(self, hub: StreamHub | None = None, *, update_interval: float = 0.05) -> None:
        self.hub = hub if hub is not None else StreamHub()
        self.update_interval = update_interval
        self._feed: set[Subscriber] = set()  # the session-list feed (/api/events)

    async def open_sink(self, target: TurnTarget) -> LiveSink:
        self.hub.stream(target.chat_id)
        # each turn has its own pace (a new turn's first event goes out at once); in-process: no timeouts
        calls = Calls(Throttle(), CallPolicy(timeout=None))
        return LiveSink(WebOps(self, target), PlainRenderer(), calls, settings=NO_GATE)

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
