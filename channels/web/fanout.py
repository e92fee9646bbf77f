"""The web chat across processes: a browser connected to one process sees the turns every process runs.

With several processes on one store (``core.relay``; the host gives no relay to a process alone, and then
nothing here runs), each web channel relays to the others, on the topic ``channel.web``, every event its
session streams append (``SessionStream.share``: ``turn`` increments, ``turn_committed``, ``session_title``,
``notice``, ``message_queued``, ``subagent``) and every event of its session-list feed. A process that
receives one appends it to its own stream of that session — only if it has one, i.e. a browser follows that
session there — under its own event ids, so ids stay monotonic per connection, and a reconnect that lands on
another process cannot replay and gets ``resync_required`` + ``task_state``.

Messages (JSON): ``{"e": name, "s": session id, "d": data}`` an event of a session stream;
``{"f": name, "d": data}`` a feed event; ``{"sync": session id | null}`` "send the whole running turn(s)":
each process answers for the turns it runs with one ``turn`` event that tells everything
(``LiveTurn.full_event``). A process asks for it when a browser opens a stream it had no state for, and
when it gets an increment of a turn it does not know (it began listening midway).

Gaps (the bus lost its listening connection, or a relay message was lost): every session stream forgets
the turns other processes showed it, tells its connected browsers ``resync_required`` (they fetch the
history again) and a fresh ``task_state``, and the process asks every other for its running turns.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from channels.web.sse import StreamHub
from core.relay import Relay

log = logging.getLogger(__name__)

SYNC_INTERVAL = 1.0
"""Seconds between two requests for the whole turn of one session (while increments keep coming)."""


class WebFanout:
    def __init__(self, relay: Relay, hub: StreamHub, publish_feed: Callable[[str, dict[str, Any]], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._relay = relay
        self._hub = hub
        self._publish_feed = publish_feed
        self._clock = clock
        self._asked: dict[str | None, float] = {}
        hub.share = self.share_event
        self._unlisten = relay.listen(self._on_message, self._on_gap)

    def close(self) -> None:
        self._unlisten()
        self._hub.share = None

    # ---- sending --------------------------------------------------------------------------------

    def _send(self, body: dict[str, Any]) -> None:
        try:
            self._relay.send(json.dumps(body, ensure_ascii=False, separators=(",", ":")))
        except ValueError:  # text with a lone surrogate: escaped, it travels as ASCII
            self._relay.send(json.dumps(body, separators=(",", ":")))

    def share_event(self, session_id: str, name: str, data: dict[str, Any]) -> None:
        self._send({"e": name, "s": session_id, "d": data})

    def share_feed(self, name: str, data: dict[str, Any]) -> None:
        self._send({"f": name, "d": data})

    def opened(self, session_id: str) -> None:
        """A browser opened a stream this process had no state for: ask whoever runs its turn for it whole."""
        self._ask(session_id)

    def _ask(self, session_id: str | None) -> None:
        now = self._clock()
        last = self._asked.get(session_id)
        if last is not None and now - last < SYNC_INTERVAL:
            return
        if len(self._asked) > 1000:
            self._asked = {k: t for k, t in self._asked.items() if now - t < SYNC_INTERVAL}
        self._asked[session_id] = now
        self._send({"sync": session_id})

    # ---- receiving ------------------------------------------------------------------------------

    def _on_message(self, sender: str, message: str) -> None:
        try:
            body = json.loads(message)
            if "e" in body:
                stream = self._hub.get(str(body["s"]))
                if stream is not None and not stream.apply_remote(str(body["e"]), dict(body["d"])):
                    self._ask(stream.session_id)
            elif "f" in body:
                self._publish_feed(str(body["f"]), dict(body["d"]))
            elif "sync" in body:
                self._send_whole(body["sync"])
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("web fan-out: a malformed message from process %s was ignored (%s)", sender,
                        type(exc).__name__)

    def _send_whole(self, session_id: str | None) -> None:
        if session_id is None:
            streams = self._hub.streams()
        else:
            one = self._hub.get(str(session_id))
            streams = [one] if one is not None else []
        for stream in streams:
            live = stream.live
            if live is not None and live.held_here and live.state == "running":
                self.share_event(stream.session_id, "turn", live.full_event())

    def _on_gap(self) -> None:
        log.info("web fan-out: events of other processes may have been missed; browsers resynchronise")
        for stream in self._hub.streams():
            stream.resync()
        self._asked.pop(None, None)
        self._ask(None)
