"""Per-session SSE streams with a bounded replay buffer.

Every event a session's page may need (live turn progress, history deltas, titles, notices) is appended
to that session's ``SessionStream``. The stream numbers its events ``<epoch>-<seq>``: ``seq`` rises by one
per event, and ``epoch`` is new for every stream object (so for every channel instance and every process),
which is how a ``Last-Event-ID`` from another life of the stream is recognised. The most recent events are
kept, bounded by count and by bytes, and replayed to a reconnecting client when its ``Last-Event-ID`` is
still covered; otherwise the client is told ``resync_required`` and starts from a fresh ``task_state``.

A page message that was queued (its turn has not begun) is told once, live, as a ``message_queued`` event,
and listed in every fresh connection's ``task_state`` (``queued``) until its turn begins or a ``/new``
drops it; the ``/new``'s notice names the ones it dropped (``dropped``), whoever sent them and the ``/new``.

A pending tool approval appears in the ``turn`` events' ``approvals`` list and, once, as an
``approval_request`` event; a fresh connection's ``task_state`` carries the approvals still pending.

Turn progress is sent as increments: a ``turn`` event carries the text appended since the previous
``turn`` event of that turn (``append``), or the whole text when it no longer extends it (``replace``,
after a retried model request), so an N-character reply costs O(N) bytes on the wire.

Several processes on one store: every event a stream appends for a turn this process runs (and every
history delta, title and notice) is also handed to the hub's ``share`` callback, which relays it to the
other processes (``channels.web.fanout``); there ``apply_remote`` appends it to the same session's
stream under that process's own ids, keeping the turn it shows (``LiveTurn.held_here`` false) up to date for
``task_state``. ``approval_request`` events are derived where they are shown, never relayed.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from core.agent.events import ChildEvent, SessionMeta, SubagentEnded, trace_payload
from core.snapshot import TurnSnapshot


def encode_event(name: str, data: Any, event_id: str | None = None) -> bytes:
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"id: {event_id}\n" if event_id is not None else ""
    # JSON text never contains a raw newline, so one data line is enough.
    return f"{head}event: {name}\ndata: {payload}\n\n".encode()


HEARTBEAT = b": keep-alive\n\n"
BATCH_BYTES = 64 * 1024
"""At most this much of a connection's waiting events is joined into one write (``Subscriber.next``): what a
connection's buffer takes before a write waits, so a client that stopped reading pins no more than before."""
CLIENT_IDS_KEPT = 1000
"""How many turns' client ids a stream remembers (``SessionStream.client_ids``)."""
WAITING_KEPT = 200
"""How many queued, not yet begun messages (and pending ``/new`` commands) a stream follows."""
_SEQ = re.compile(r"[0-9]{1,18}")  # ASCII digits only: str.isdigit() also accepts "²", which int() refuses


def tool_view(snapshot: TurnSnapshot) -> list[dict[str, str]]:
    return [{"call_id": t.call_id, "name": t.name, "status": t.status, "summary": t.summary} for t in snapshot.tools]


def approvals_view(snapshot: TurnSnapshot, id_of: Callable[[str], str] = str) -> list[dict[str, Any]]:
    # requested_by stays out: clients never see internal sender ids (as in history). A child session's
    # request (run_subagent) also says whose it is: its origin (session ids, outermost first) and label.
    return [{"call_id": a.call_id, "tool_name": a.tool_name, "arguments": a.arguments_summary,
             **({"origin": [id_of(k) for k in a.origin], "label": a.label} if a.origin else {})}
            for a in snapshot.approvals]


def child_event_view(event: ChildEvent, id_of: Callable[[str], str]) -> dict[str, Any]:
    """A child session's event as the page gets it: its kind and fields, session keys as session ids,
    without internal sender ids."""
    if isinstance(event, SessionMeta):
        return {"kind": event.kind, "session_id": id_of(event.session_key), "parent_id": id_of(event.parent_key),
                "profile": event.profile, "task": event.task, "call_id": event.call_id}
    if isinstance(event, SubagentEnded):
        return {"kind": event.kind, "session_id": id_of(event.session_key), "call_id": event.call_id,
                "profile": event.profile, "task": event.task, "outcome": event.outcome, "error": event.error}
    view = {"kind": event.kind, **trace_payload(event)}
    view.pop("requested_by", None)
    if event.kind == "approval_request":
        view.pop("arguments", None)  # the summary says it all; the decision goes through the parent's turn
    return view


@dataclass
class ChildCard:
    """What the page needs to draw one child session of the running turn after a reload (``task_state``),
    kept from the ``subagent`` events the stream carried."""

    origin: list[str]
    call_id: str
    profile: str | None
    task: str
    state: str = "running"
    text: str = ""
    tools: list[dict[str, str]] = field(default_factory=list)
    error: str | None = None
    new_request: bool = False

    def view(self) -> dict[str, Any]:
        return {"origin": self.origin, "session_id": self.origin[-1], "call_id": self.call_id,
                "profile": self.profile, "task": self.task, "state": self.state, "text": self.text,
                "tools": self.tools, "error": self.error}

    def apply(self, ev: dict[str, Any]) -> None:
        kind = ev["kind"]
        if kind == "request_begin":
            self.new_request = bool(self.text)
        elif kind == "partial_text" and ev.get("phase") == "delta":
            if self.new_request:
                self.text += "\n\n"
                self.new_request = False
            self.text += ev.get("text", "")
        elif kind == "tool_call":
            self.tools.append({"call_id": ev["call_id"], "name": ev["name"], "status": "awaiting_approval"})
        elif kind == "approval_decision":
            self._tool(ev["call_id"], "running" if ev["decision"] == "allow" else "denied")
        elif kind == "tool_call_output":
            self._tool(ev["call_id"], ev["status"])
        elif kind == "abort":
            self.state = "cancelled"

    def _tool(self, call_id: str, status: str) -> None:
        for tool in self.tools:
            if tool["call_id"] == call_id:
                tool["status"] = status


@dataclass
class LiveTurn:
    """What the stream has told clients about the current turn (the base for the next increment)."""

    turn_id: str
    client_id: str | None
    version: int
    state: str
    text: str
    tools: list[dict[str, str]]
    approvals: list[dict[str, Any]]
    error: str | None
    held_here: bool = True
    """False when another process runs the turn and this one only shows it."""

    def view(self) -> dict[str, Any]:
        return {"turn_id": self.turn_id, "client_id": self.client_id, "version": self.version,
                "state": self.state, "text": self.text, "tools": self.tools, "approvals": self.approvals,
                "error": self.error}

    def full_event(self) -> dict[str, Any]:
        """A ``turn`` event that tells everything (as a turn's first event does): for a process that may
        have missed increments."""
        data: dict[str, Any] = {"turn_id": self.turn_id, "version": self.version, "state": self.state,
                                "client_id": self.client_id, "replace": self.text, "tools": self.tools,
                                "approvals": self.approvals}
        if self.error:
            data["error"] = self.error
        return data


class Subscriber:
    """One SSE connection: a queue of encoded events; a client that falls too far behind is cut off.

    "Too far" is ``max_pending`` events or ``max_bytes`` bytes waiting (the connection's pump takes them off
    with :meth:`next`): a reader that stalls pins no more than that, and as the bytes bound is at most what
    a session's replay buffer holds, the reconnect it is cut off into gets a replay where one is possible,
    else ``resync_required``."""

    def __init__(self, max_pending: int, max_bytes: int | None = None) -> None:
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self._max_pending = max_pending
        self._max_bytes = max_bytes
        self.pending_bytes = 0
        self.overflowed = False
        self.closed = False
        self._ending = False
        """``next`` took the end off the queue with the last events: the connection ends at the next call."""

    def push(self, data: bytes) -> None:
        if self.overflowed or self.closed:
            return
        # one event alone always fits (as the replay buffer always keeps the newest one)
        if self.queue.qsize() >= self._max_pending or (
                self._max_bytes is not None and self.pending_bytes
                and self.pending_bytes + len(data) > self._max_bytes):
            # It will reconnect with its Last-Event-ID and get a replay or a resync.
            self.overflowed = True
            self.queue.put_nowait(None)
            return
        self.pending_bytes += len(data)
        self.queue.put_nowait(data)

    async def next(self) -> bytes | None:
        """What to send next: the events waiting now, joined up to ``BATCH_BYTES`` (events that came together
        leave in one write); None: the connection ends (closed, or cut off), after every event queued before."""
        if self._ending:
            return None
        data = await self.queue.get()
        if data is None:
            return None
        batch = [data]
        size = len(data)
        while size < BATCH_BYTES and not self.queue.empty():
            more = self.queue.get_nowait()
            if more is None:  # nothing is queued after the end
                self._ending = True
                break
            batch.append(more)
            size += len(more)
        self.pending_bytes -= size
        return batch[0] if len(batch) == 1 else b"".join(batch)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(None)


Share = Callable[[str, str, dict[str, Any]], None]
"""(session id, event name, event data) → relayed to the other processes."""


class SessionStream:
    def __init__(self, session_id: str, epoch: str, *, max_events: int, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic, share: Share | None = None) -> None:
        self.session_id = session_id
        self._share = share
        self._mirroring = False
        self.epoch = epoch
        self.seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffer_bytes = 0
        self._max_events = max_events
        self._max_bytes = max_bytes
        self.subscribers: set[Subscriber] = set()
        self.live: LiveTurn | None = None
        self.children_turn: str | None = None
        self.children: dict[tuple[str, ...], ChildCard] = {}
        """The child sessions (``run_subagent``) of turn ``children_turn``, by origin."""
        self.id_of: Callable[[str], str] = str
        """Session key → the id the page knows it by (set by the channel)."""
        self.client_ids: dict[str, str] = {}
        """Turn id → the client_id of the page message it answers, for the latest ``CLIENT_IDS_KEPT`` turns this
        stream showed (history views of user messages name it; in memory: not after a restart)."""
        self._queued: dict[str, dict[str, Any]] = {}
        """Client id → the page's view (``client_id``, ``text``, ``attachments``) of each message queued through
        this process that still waits for its turn (not left behind by a ``/new``), oldest first:
        ``task_state``'s ``queued``, so a reload or another tab shows it as sent."""
        self._new_commands: dict[str, list[str]] = {}
        """Client id of a ``/new`` sent through this process → the messages queued when it came."""
        self._clock = clock
        self.last_activity = clock()

    # ---- appending ------------------------------------------------------------------------------

    def last_id(self) -> str:
        return f"{self.epoch}-{self.seq}"

    def append(self, name: str, data: dict[str, Any]) -> str:
        self.seq += 1
        event_id = self.last_id()
        encoded = encode_event(name, data, event_id)
        self._buffer.append((self.seq, encoded))
        self._buffer_bytes += len(encoded)
        while len(self._buffer) > 1 and (len(self._buffer) > self._max_events
                                         or self._buffer_bytes > self._max_bytes):
            _, dropped = self._buffer.popleft()
            self._buffer_bytes -= len(dropped)
        for sub in list(self.subscribers):
            sub.push(encoded)
        self.last_activity = self._clock()
        if self._share is not None and not self._mirroring and name != "approval_request":
            self._share(self.session_id, name, data)
        return event_id

    def apply_remote(self, name: str, data: dict[str, Any]) -> bool:
        """Append an event another process's stream of this session appended (never relayed again); for a
        ``turn`` event, also follow the turn it shows. False when it is an increment of a turn this stream
        does not know (the whole turn must be asked for: ``LiveTurn.full_event``)."""
        self._mirroring = True
        try:
            if name == "turn":
                return self._remote_turn(data)
            if name == "subagent":
                self.child_event(str(data["turn_id"]), list(data["origin"]), dict(data["event"]))
                return True
            if name == "message_queued" and data["client_id"] not in self.client_ids.values():
                # kept for the task_state of pages that connect here later
                self._remember_queued({k: v for k, v in data.items() if k != "session_id"})
            elif name == "notice":  # a /new's notice: what it dropped waits no more
                for client_id in data.get("dropped", []):
                    self._queued.pop(client_id, None)
            if name == "turn_committed" and self.live is not None and not self.live.held_here:
                # a commit closes the turn (a page treats it so); its terminal event may never come, when
                # another process closed it for a process that died
                self.live.state = "committed" if self.live.state == "running" else self.live.state
            self.append(name, data)
            return True
        finally:
            self._mirroring = False

    def _remote_turn(self, data: dict[str, Any]) -> bool:
        live = self.live
        whole = "replace" in data and "tools" in data and "approvals" in data
        if live is None or live.turn_id != data["turn_id"]:
            if not whole:
                return False
            self.live = LiveTurn(data["turn_id"], data.get("client_id"), data["version"], data["state"],
                                 data["replace"], data["tools"], data["approvals"], data.get("error"),
                                 held_here=False)
            self._turn_began(data["turn_id"], data.get("client_id"))
            self.append("turn", data)
            self._announce(data["turn_id"], data["approvals"], [])
            return True
        if live.held_here or data["version"] <= live.version:
            return True  # ours, or known already
        before = live.approvals
        if "replace" in data:
            live.text = data["replace"]
        elif "append" in data:
            live.text += data["append"]
        live.tools = data.get("tools", live.tools)
        live.approvals = data.get("approvals", live.approvals)
        live.error = data.get("error", live.error)
        live.version, live.state = data["version"], data["state"]
        self.append("turn", data)
        self._announce(data["turn_id"], live.approvals, before)
        return True

    def resync(self) -> None:
        """Events from other processes may have been missed: forget the turn they showed, and tell the
        clients to fetch the history again and take the turn afresh (``resync_required``, ``task_state``)."""
        if self.live is not None and not self.live.held_here:
            self.live = None
        if not self.subscribers:
            return
        self._mirroring = True
        try:
            self.append("resync_required", {"session_id": self.session_id, "last_event_id": None})
            self.append("task_state", self.task_state_data())
        finally:
            self._mirroring = False

    def turn_update(self, snapshot: TurnSnapshot, client_id: str | None, *, appended: str | None = None) -> bool:
        """Append the increment from what clients were last told to ``snapshot``; False if nothing changed.
        ``appended``: what the text gained since then, when the caller knows (saves comparing the texts)."""
        live = self.live
        tools, approvals = tool_view(snapshot), approvals_view(snapshot, self.id_of)
        data: dict[str, Any] = {"turn_id": snapshot.turn_id, "version": snapshot.version, "state": snapshot.state}
        if live is None or live.turn_id != snapshot.turn_id:
            data["client_id"] = client_id
            data["replace"] = snapshot.text
            data["tools"] = tools
            data["approvals"] = approvals
            if snapshot.error:
                data["error"] = snapshot.error
            self.live = LiveTurn(snapshot.turn_id, client_id, snapshot.version, snapshot.state, snapshot.text,
                                 tools, approvals, snapshot.error)
            self._turn_began(snapshot.turn_id, client_id)
            self.append("turn", data)
            self._announce(snapshot.turn_id, approvals, [])
            return True
        if snapshot.version <= live.version or live.state != "running":
            return False  # an older (or repeated) snapshot: clients already have newer
        if appended is not None:
            if appended:
                data["append"] = appended
        elif snapshot.text.startswith(live.text):
            if len(snapshot.text) > len(live.text):
                data["append"] = snapshot.text[len(live.text):]
        else:
            data["replace"] = snapshot.text
        if tools != live.tools:
            data["tools"] = tools
        if approvals != live.approvals:
            data["approvals"] = approvals
        if snapshot.error != live.error:
            data["error"] = snapshot.error
        changed = len(data) > 3 or snapshot.state != live.state
        before = live.approvals
        live.version, live.state, live.text = snapshot.version, snapshot.state, snapshot.text
        live.tools, live.approvals, live.error = tools, approvals, snapshot.error
        if changed:
            self.append("turn", data)
            self._announce(snapshot.turn_id, approvals, before)
        return changed

    # ---- which page message is which --------------------------------------------------------------

    def _turn_began(self, turn_id: str, client_id: str | None) -> None:
        if not client_id:
            return
        self.client_ids[turn_id] = client_id
        if len(self.client_ids) > CLIENT_IDS_KEPT:
            del self.client_ids[next(iter(self.client_ids))]
        self._queued.pop(client_id, None)

    def message_queued(self, client_id: str, view: dict[str, Any] | None = None) -> None:
        """A page message was queued (its turn has not begun); ``view``: what a page shows of it. It is listed
        in ``task_state``'s ``queued`` for pages that connect later, and told at once to the pages connected
        now (a ``message_queued`` event): a tab sees at once what another tab (or an API client) queued."""
        if client_id in self.client_ids.values():
            return  # its turn began while the POST was being answered: it waits no more
        self._remember_queued({**(view or {}), "client_id": client_id})
        self.append("message_queued", {"session_id": self.session_id, **self._queued[client_id]})

    def _remember_queued(self, entry: dict[str, Any]) -> None:
        self._queued[entry["client_id"]] = entry
        if len(self._queued) > WAITING_KEPT:
            del self._queued[next(iter(self._queued))]

    def new_requested(self, command_id: str) -> None:
        """A ``/new`` was accepted (``command_id``: the server's name for it, as its client may have sent no
        client id): the messages waiting now are the ones it may leave unanswered, which its notice names;
        none of them is listed as queued any more."""
        waiting = list(self._queued)
        self._queued.clear()
        self._new_commands[command_id] = waiting
        if len(self._new_commands) > WAITING_KEPT:
            del self._new_commands[next(iter(self._new_commands))]

    def dropped_by(self, command_id: str | None) -> list[str]:
        """The messages a ``/new`` (by its ``command_id``) left unanswered: those waiting when it came whose
        turn never began (a /new that failed leaves them to be answered); [] for anything else."""
        before = self._new_commands.pop(command_id, []) if command_id else []
        began = set(self.client_ids.values())
        return [c for c in before if c not in began]

    def _announce(self, turn_id: str, approvals: list[dict[str, Any]], before: list[dict[str, Any]]) -> None:
        """One ``approval_request`` event per approval that was not pending in the previous ``turn`` event."""
        known = {(tuple(a.get("origin", ())), a["call_id"]) for a in before}
        for a in approvals:
            if (tuple(a.get("origin", ())), a["call_id"]) not in known:
                self.append("approval_request", {"session_id": self.session_id, "turn_id": turn_id, **a})

    def child_event(self, turn_id: str, origin: list[str], event: dict[str, Any]) -> None:
        """One event of a child session of turn ``turn_id`` (``origin``: its session ids, outermost first;
        empty for the turn's own ``subagent`` pointer), appended as a ``subagent`` event and kept for
        ``task_state``."""
        if self.children_turn != turn_id:
            self.children_turn, self.children = turn_id, {}
        kind = event["kind"]
        if kind == "session_meta":
            self.children[tuple(origin)] = ChildCard(list(origin), event["call_id"], event["profile"], event["task"])
        elif kind == "subagent":
            card = self.children.get((*origin, event["session_id"]))
            if card is not None:
                card.state, card.error = event["outcome"], event["error"]
        else:
            card = self.children.get(tuple(origin))
            if card is not None:
                card.apply(event)
        self.append("subagent", {"session_id": self.session_id, "turn_id": turn_id, "origin": origin,
                                 "event": event})

    def has_terminal(self, turn_id: str) -> bool:
        return self.live is not None and self.live.turn_id == turn_id and self.live.state != "running"

    # ---- connecting -----------------------------------------------------------------------------

    def task_state(self, title: str | None = None) -> bytes:
        """The opening event of a fresh connection: the live turn so far (or none), its pending approvals, and
        the page messages queued through this process that wait for their turn."""
        return encode_event("task_state", self.task_state_data(title), self.last_id())

    def task_state_data(self, title: str | None = None) -> dict[str, Any]:
        running = self.live if self.live is not None and self.live.state == "running" else None
        data: dict[str, Any] = {"session_id": self.session_id, "turn": running.view() if running else None,
                                "approvals": list(running.approvals) if running else []}
        if running is not None and self.children_turn == running.turn_id and self.children:
            data["children"] = [c.view() for c in self.children.values()]
        if title is not None:
            data["title"] = title
        data["queued"] = list(self._queued.values())
        return data

    def replay_since(self, last_event_id: str) -> list[bytes] | None:
        """The events after ``last_event_id``, or None when that id cannot be resumed (another epoch, evicted,
        or from the future)."""
        epoch, sep, seq_text = last_event_id.strip().rpartition("-")
        if not sep or epoch != self.epoch or not _SEQ.fullmatch(seq_text):
            return None
        seq = int(seq_text)
        if seq > self.seq:
            return None
        if seq == self.seq:
            return []
        first = self._buffer[0][0] if self._buffer else self.seq + 1
        if seq + 1 < first:
            return None  # some of the missed events were evicted
        return [data for s, data in self._buffer if s > seq]

    def subscribe(self, max_pending: int, max_bytes: int | None = None) -> Subscriber:
        sub = Subscriber(max_pending, max_bytes)
        self.subscribers.add(sub)
        self.last_activity = self._clock()
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        self.last_activity = self._clock()

    def idle_since(self) -> float | None:
        """When the stream became reclaimable, or None while a client listens or a turn runs."""
        if self.subscribers or (self.live is not None and self.live.state == "running"):
            return None
        return self.last_activity

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def buffered_bytes(self) -> int:
        return self._buffer_bytes


class StreamHub:
    """The session streams of one web channel instance."""

    def __init__(self, *, max_events: int = 1000, max_bytes: int = 2 * 1024 * 1024, idle_seconds: float = 900.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.instance = secrets.token_hex(4)
        self._streams: dict[str, SessionStream] = {}
        self._count = 0
        self.max_events = max_events
        self.max_bytes = max_bytes
        self.idle_seconds = idle_seconds
        self._clock = clock
        self.share: Share | None = None
        """Set when other processes share the store: what streams append is relayed to them."""

    def streams(self) -> list[SessionStream]:
        return list(self._streams.values())

    def get(self, session_id: str) -> SessionStream | None:
        return self._streams.get(session_id)

    def stream(self, session_id: str) -> SessionStream:
        s = self._streams.get(session_id)
        if s is None:
            self._count += 1
            s = SessionStream(session_id, f"{self.instance}x{self._count}", max_events=self.max_events,
                              max_bytes=self.max_bytes, clock=self._clock, share=self.share)
            self._streams[session_id] = s
        return s

    def release(self, session_id: str) -> None:
        """Forget the session's stream at once if it never carried an event and nobody listens: opening a
        stream for an id (any id) must not leave anything behind."""
        s = self._streams.get(session_id)
        if s is not None and s.seq == 0 and s.live is None and not s.subscribers:
            del self._streams[session_id]

    def reclaim_idle(self) -> list[str]:
        now = self._clock()
        gone = []
        for sid, s in list(self._streams.items()):
            since = s.idle_since()
            if since is not None and now - since >= self.idle_seconds:
                del self._streams[sid]
                gone.append(sid)
        return gone

    def close_all(self) -> None:
        for s in self._streams.values():
            for sub in list(s.subscribers):
                sub.close()

    def __len__(self) -> int:
        return len(self._streams)
