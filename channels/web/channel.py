"""The web chat as a ``Channel`` (core.channel): the session's SSE stream is the platform.

A turn is shown by the shared live sink (``channels.common.live_sink``) through the session's stream,
which is a native stream: each ``turn`` event appends what the text gained, or replaces it when a retried
model request rewound it, and carries the tools, approvals and state when they change; at most one event
per ``update_interval`` (latest wins), approvals at once. ``finish`` succeeds once the terminal event is in
the stream (from there every connected client gets it, and a reconnecting one replays it or resyncs).
``send_plain`` (busy notices, command replies, fallbacks) appends a ``notice`` event (marked ``sender_only``
when it answers one page message, not a ``/new``: only the tab that sent it shows it). History deltas and
titles come from core events, through the channel's ``SessionHost``; the HTTP API is ``WebServer``. With
other processes on the same store, the turns they run reach this one's browsers (``channels.web.fanout``).

Lifecycle: ``start`` loads the key that signs login cookies (kept in the channel's durable state, so a
restart keeps browsers signed in), and begins reclaiming idle streams and ending streams whose client left
(supervised tasks); ``stop`` refuses new messages (503) while running turns finish; ``close`` ends every
open stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from typing import Any

from aiohttp import web

from channels.common.calls import CallPolicy, Calls
from channels.common.errors import PlatformError
from channels.common.ledger import Part
from channels.common.live_sink import LiveSettings, LiveSink
from channels.common.ops import Capabilities, NativeStream, PlainRenderer, TextChange
from channels.common.throttle import Scope, Throttle
from channels.web.context import CHANNEL, WebContext, message_view, page_id, session_id_of
from channels.web.fanout import WebFanout
from channels.web.server import HEARTBEAT_SECONDS, WebAccess, WebServer
from channels.web.sse import SessionStream, StreamHub, Subscriber, child_event_view, encode_event
from core.agent.events import Forwarded, SubagentEnded, TurnEvent
from core.agent.subagents import is_child_key
from core.envelope import TurnTarget
from core.events import CoreEvent, SessionTitleChanged, TurnCommitted, TurnStarted
from core.host import SessionHost
from core.snapshot import TurnSnapshot

log = logging.getLogger(__name__)

UPDATE_INTERVAL = 0.05
"""Seconds between two ``turn`` events of one turn (latest snapshot wins)."""
SWEEP_INTERVAL = 60.0
"""Seconds between two passes that reclaim idle session streams."""
REAP_INTERVAL = 1.0
"""Seconds between two passes that end streams whose client went away."""
COOKIE_KEY_STATE = "login_cookie_key"
# the page shows a turn as soon as it starts (its "thinking" state): no first-message gate
NO_GATE = LiveSettings(first_chars=0, first_delay=0.0)


class WebOps:
    """``MessageOps`` of one session: a turn is one live entry of its SSE stream, never separate messages."""

    capabilities = Capabilities(limit=None, unit="chars", can_delete=False, native_stream=True)

    def __init__(self, channel: WebChannel, target: TurnTarget) -> None:
        self._stream = WebStream(channel.hub, target.chat_id, WebContext.of(target).client_id)
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
        self._shown: tuple[str, str] | None = None
        """(turn id, text) of the turn's entry as the pages show it."""

    async def push(self, snapshot: TurnSnapshot, text: str, change: TextChange | None) -> None:
        appended = "" if change is None else None if change.replace else change.text
        self._hub.stream(self._session_id).turn_update(snapshot, self._client_id, appended=appended)
        self._shown = (snapshot.turn_id, text)

    async def close(self, snapshot: TurnSnapshot, part: Part | None) -> str | None:
        stream = self._hub.stream(self._session_id)
        stream.turn_update(snapshot, self._client_id)  # idempotent: a repeat finds the terminal already sent
        if not stream.has_terminal(snapshot.turn_id):
            raise PlatformError("terminal event not recorded", kind="permanent")
        return snapshot.turn_id

    def leftover(self) -> tuple[str, Part] | None:
        return None if self._shown is None else (self._shown[0], Part.plain(self._shown[1]))


class WebChannel:
    """The ``Channel`` named "web", the fan-out of core events to the session streams, and the HTTP API."""

    name = CHANNEL
    shows_history = True
    """Its pages show the stored history: a committed answer needs no second delivery after a restart."""

    def __init__(self, host: SessionHost, *, access: WebAccess | None = None, hub: StreamHub | None = None,
                 update_interval: float = UPDATE_INTERVAL, heartbeat: float = HEARTBEAT_SECONDS,
                 sweep_interval: float = SWEEP_INTERVAL, reap_interval: float = REAP_INTERVAL) -> None:
        self.host = host
        self.hub = hub if hub is not None else StreamHub()
        self.update_interval = update_interval
        self._sweep_interval = sweep_interval
        self._reap_interval = reap_interval
        self._feed: set[Subscriber] = set()  # the session-list feed (/api/events; session streams with ?feed=1)
        relay = host.relay()
        self.fanout = WebFanout(relay, self.hub, self._feed_here) if relay is not None else None
        self.server = WebServer(host, self, access=access, heartbeat=heartbeat)
        self._unsubscribe = host.subscribe(self.on_core_event)
        self._tasks: list[asyncio.Task[None]] = []
        self._state = "ready"

    def install(self, app: web.Application) -> None:
        """Add the chat page and the HTTP API to ``app`` (before it starts)."""
        self.server.install(app)

    # ---- lifecycle ------------------------------------------------------------------------------

    def state(self) -> str:
        return self._state

    async def start(self) -> None:
        if self.server.access.auth_token and self.server.access.cookie_key is None:
            self.server.use_cookie_key(await self._cookie_key())
        self._tasks = [self.host.spawn("web:reclaim-idle-streams", self._sweep()),
                       self.host.spawn("web:end-abandoned-streams", self._reap())]
        self._state = "serving"

    async def _cookie_key(self) -> bytes:
        stored = await self.host.get_state(COOKIE_KEY_STATE)
        if stored:
            return bytes.fromhex(stored)
        key = secrets.token_bytes(32)
        await self.host.set_state(COOKIE_KEY_STATE, key.hex())
        return key

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(self._reap_interval)
            self.server.reap_closed()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self._sweep_interval)
            gone = self.hub.reclaim_idle()
            if gone:
                log.debug("reclaimed %d idle web session streams", len(gone))

    async def stop(self) -> None:
        self.server.accepting = False
        self._state = "stopping"

    async def close(self) -> None:
        tasks, self._tasks = self._tasks, []
        for task in tasks:  # core's shutdown may have cancelled them already
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._unsubscribe()
        if self.fanout is not None:
            self.fanout.close()
        await self.server.close()
        self._state = "closed"

    # ---- delivery -------------------------------------------------------------------------------

    async def open_sink(self, target: TurnTarget) -> LiveSink:
        self.hub.stream(target.chat_id)
        # each turn has its own pace (a new turn's first event goes out at once); in-process: no timeouts
        calls = Calls(Throttle(), CallPolicy(timeout=None))
        return LiveSink(WebOps(self, target), PlainRenderer(), calls, settings=NO_GATE)

    async def send_plain(self, target: TurnTarget, text: str) -> None:
        context = WebContext.of(target)
        stream = self.hub.stream(target.chat_id)
        data: dict[str, Any] = {"text": text, "client_id": context.client_id, "at": time.time()}
        dropped = stream.dropped_by(context.command_id)
        if dropped:  # the notice of a /new: the page marks these messages as not answered
            data["dropped"] = dropped
        if context.client_id is not None and context.command_id is None:
            # A busy notice, a command's answer: it concerns the page that sent the message. A stream does not
            # know which tab it feeds, so every tab gets it and each page keeps only those of its own client
            # ids; a /new's notice is everyone's (the conversation restarted, and it names what it dropped).
            data["sender_only"] = True
        stream.append("notice", data)

    # ---- core events ----------------------------------------------------------------------------

    def on_core_event(self, event: CoreEvent) -> None:
        if isinstance(event, TurnStarted):
            sid = session_id_of(event.session_key)
            if sid is not None and not is_child_key(event.session_key):
                self._follow_children(sid, event)
        elif isinstance(event, TurnCommitted):
            sid = session_id_of(event.session_key)
            if sid is None:
                return
            stream = self.hub.stream(sid)
            stream.append("turn_committed", {
                "session_id": sid, "history_revision": event.history_revision,
                "messages": [message_view(m.history_view(), stream.client_ids) for m in event.messages]})
            if not is_child_key(event.session_key):  # a subagent is shown inside its parent, not listed
                self.publish_feed("session_activity",
                                  {"session_id": sid, "history_revision": event.history_revision})
        elif isinstance(event, SessionTitleChanged):
            sid = session_id_of(event.session_key)
            if sid is None:
                return
            self.hub.stream(sid).append("session_title", {"session_id": sid, "title": event.title})
            self.publish_feed("session_title", {"session_id": sid, "title": event.title})

    def _follow_children(self, sid: str, started: TurnStarted) -> None:
        """Forward the events of the turn's child sessions (``run_subagent``) to the session's stream as
        they arrive, interleaved with its own ``turn`` events: the page draws one card per child."""
        turn_id = started.turn_id

        def on_event(event: TurnEvent) -> None:
            if isinstance(event, Forwarded):
                origin = [page_id(k) for k in event.origin]
                self.hub.stream(sid).child_event(turn_id, origin, child_event_view(event.event, page_id))
            elif isinstance(event, SubagentEnded):
                self.hub.stream(sid).child_event(turn_id, [], child_event_view(event, page_id))

        self.hub.stream(sid).id_of = page_id
        started.controller.subscribe(on_event)

    # ---- the session-list feed ------------------------------------------------------------------

    def open_stream(self, session_id: str) -> SessionStream:
        """The session's stream for a browser that connects; one new here is filled in by the process
        running its turn, if another does."""
        fresh = self.hub.get(session_id) is None
        stream = self.hub.stream(session_id)
        if fresh and self.fanout is not None:
            self.fanout.opened(session_id)
        return stream

    def publish_feed(self, name: str, data: dict[str, Any]) -> None:
        self._feed_here(name, data)
        if self.fanout is not None:
            self.fanout.share_feed(name, data)

    def _feed_here(self, name: str, data: dict[str, Any]) -> None:
        encoded = encode_event(name, data)
        for sub in list(self._feed):
            sub.push(encoded)

    def feed_subscribe(self, sub: Subscriber) -> Subscriber:
        """Add a connection to the session-list feed: one of ``/api/events``, or a session stream's that
        carries the feed too (``?feed=1``)."""
        self._feed.add(sub)
        return sub

    def feed_unsubscribe(self, sub: Subscriber) -> None:
        self._feed.discard(sub)

    def close_connections(self) -> None:
        self.hub.close_all()
        for sub in list(self._feed):
            sub.close()
