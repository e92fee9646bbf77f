"""Relay: messages of any size, in order, from one process to the others sharing its store, over a ClusterBus.

A bus note holds at most ``core.bus.MAX_PAYLOAD_BYTES``; a relay message may be larger (a ``turn`` event
of a long reply, a history delta). Each process numbers the messages it sends on a topic (``seq``, from 1)
and splits each one into notes of at most ``NOTE_BYTES`` of UTF-8, never inside a character::

    <node>:<seq>:<index>/<count>\\n<chunk>

``node`` names the sending process (a fresh random id per process life). One task sends a relay's notes,
one at a time, so every process receives them in sending order (the bus keeps one publisher's order) and
the fragments of one message back to back. Messages that queued up while a note was on its way travel
together: the task joins them into one numbered message (each item ``<length>:<text>``, the length in
characters), so a busy process sends fewer, fuller notes instead of falling behind one round trip per
message.

A receiver (:class:`Reassembler`) joins the fragments again, skips its own notes (the bus delivers them
to the sender too) and notes it has already seen (a publish the bus retried), and reports a *gap* when a
sender's numbering jumps or a message is cut short: notes were lost (a publish that failed for good, an
outbox that overflowed), and whoever keeps state built from them must rebuild it. The bus reports the gaps
of its own (a lost listening connection) through ``on_gap``; a relay passes those on, too.

A process alone on its store (``LocalBus``) needs no relay: ``ChatCore.relay`` gives None there, so a
single process never pays for one.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from core.bus import MAX_PAYLOAD_BYTES, ClusterBus, Unsubscribe

log = logging.getLogger(__name__)

NOTE_BYTES = MAX_PAYLOAD_BYTES - 100
"""The UTF-8 bytes of a message one note carries; the header takes the rest."""
OUTBOX_LIMIT = 10_000
"""Messages waiting to be sent; past it a message is dropped, and the receivers see the gap."""
BATCH_BYTES = 4 * NOTE_BYTES
"""About how much (UTF-8) one numbered message gathers of the messages waiting to be sent."""

_HEADER = re.compile(r"([0-9a-z]{1,32}):([0-9]{1,18}):([0-9]{1,9})/([0-9]{1,9})")

Spawn = Callable[[str, Coroutine[Any, Any, None]], "asyncio.Task[None]"]


def checked(message: str) -> bytes:
    """``message`` as UTF-8; ValueError when it is not valid UTF-8 text (a lone surrogate) or holds a NUL."""
    if "\x00" in message:
        raise ValueError("a relay message cannot hold a NUL character")
    try:
        return message.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("a relay message must be valid UTF-8 text (it holds a lone surrogate)") from None


def join_items(items: list[str]) -> str:
    return "".join(f"{len(item)}:{item}" for item in items)


def split_items(message: str) -> list[str]:
    """The items ``join_items`` joined; ValueError when ``message`` is not such a join."""
    items, at = [], 0
    while at < len(message):
        colon = message.index(":", at)
        size = int(message[at:colon])
        if size < 0 or colon + 1 + size > len(message):
            raise ValueError("a relay item runs past the message")
        items.append(message[colon + 1:colon + 1 + size])
        at = colon + 1 + size
    return items


def split_message(node: str, seq: int, message: str, note_bytes: int = NOTE_BYTES) -> list[str]:
    """The notes that carry ``message``: each at most ``note_bytes`` of it, cut between characters.
    Raises ValueError when the message is not valid UTF-8 text (a lone surrogate) or holds a NUL."""
    data = checked(message)
    chunks: list[str] = []
    start = 0
    while True:
        end = min(start + note_bytes, len(data))
        while end < len(data) and (data[end] & 0xC0) == 0x80:  # a continuation byte: back to the start
            end -= 1
        chunks.append(data[start:end].decode("utf-8"))
        start = end
        if start >= len(data):
            break
    return [f"{node}:{seq}:{i}/{len(chunks)}\n{chunk}" for i, chunk in enumerate(chunks)]


@dataclass(slots=True)
class Received:
    """What one note completed: a whole message from ``sender`` (or none yet), and whether notes before it
    were lost."""

    sender: str | None = None
    message: str | None = None
    gap: bool = False


@dataclass(slots=True)
class _Sender:
    done: int
    """The last seq of this sender that is complete (or given up)."""
    parts: list[str] | None = None
    """The fragments so far of message ``done + 1``, while it is being joined."""


@dataclass
class Reassembler:
    """Joins the notes of one topic into messages, per sender (see the module docstring)."""

    own: str
    senders: dict[str, _Sender] = field(default_factory=dict)

    def reset(self) -> None:
        """Forget every sender: after a gap the bus reported, the next note of each starts afresh."""
        self.senders.clear()

    def feed(self, note: str) -> Received:
        head, sep, chunk = note.partition("\n")
        m = _HEADER.fullmatch(head)
        if not sep or m is None:
            log.debug("relay: a note without a relay header was ignored")
            return Received()
        node, seq, index, count = m[1], int(m[2]), int(m[3]), int(m[4])
        if node == self.own or count < 1 or index >= count:
            return Received()
        st = self.senders.get(node)
        if st is None:  # the first note heard from it: what it sent before concerns nobody here
            st = self.senders[node] = _Sender(done=seq - 1 if index == 0 else seq)
            if index != 0:
                return Received()  # the rest of a message begun before we listened
        if seq <= st.done:
            return Received()  # seen already (the bus may deliver a retried publish twice)
        gap = False
        if st.parts is not None and seq == st.done + 1 and index < len(st.parts):
            return Received()  # a fragment repeated
        if st.parts is not None and seq == st.done + 1 and index == len(st.parts):
            st.parts.append(chunk)
        else:
            gap = st.parts is not None or seq != st.done + 1 or index != 0
            st.parts = None
            if index != 0:
                st.done = seq  # its beginning is lost: give up on this one
                return Received(gap=True)
            st.done = seq - 1
            st.parts = [chunk]
        if len(st.parts) < count:
            return Received(gap=gap)
        message = "".join(st.parts)
        st.parts, st.done = None, seq
        return Received(node, message, gap)


class Relay:
    """Sends and receives the messages of one topic (see the module docstring). ``send`` never waits:
    messages queue in an outbox that one supervised task publishes, in order."""

    def __init__(self, bus: ClusterBus, topic: str, node: str, spawn: Spawn, *,
                 note_bytes: int = NOTE_BYTES, outbox_limit: int = OUTBOX_LIMIT) -> None:
        self.bus = bus
        self.topic = topic
        self.node = node
        self._spawn = spawn
        self._note_bytes = note_bytes
        self._outbox: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        self._outbox_limit = outbox_limit
        self._seq = 0
        self._dropped = False
        self._sender: asyncio.Task[None] | None = None
        self._failing = False

    def send(self, message: str) -> None:
        """Queue ``message`` for every other process listening on this topic. Raises ValueError for a
        message that is not valid UTF-8 text; a message that cannot be sent is dropped (and logged), and
        the receivers learn of the gap from the next one."""
        size = len(checked(message))
        if self._outbox.qsize() >= self._outbox_limit:
            if not self._dropped:
                log.warning("relay %s: %d messages wait to be sent; dropping", self.topic, self._outbox_limit)
            self._dropped = True
            return
        if self._sender is None or self._sender.done():
            try:
                self._sender = self._spawn(f"relay:{self.topic}", self._send_all())
            except Exception as exc:  # shutting down: nothing will be sent any more
                log.debug("relay %s: not sending (%s)", self.topic, exc)
                return
        self._outbox.put_nowait((message, size))

    async def _send_all(self) -> None:
        while True:
            message, size = await self._outbox.get()
            batch = [message]
            while size < BATCH_BYTES and not self._outbox.empty():
                message, more = self._outbox.get_nowait()
                batch.append(message)
                size += more
            self._seq += 2 if self._dropped else 1  # a number skipped: the receivers see the loss
            self._dropped = False
            try:
                for note in split_message(self.node, self._seq, join_items(batch), self._note_bytes):
                    await self.bus.publish(self.topic, note)
            except Exception as exc:  # BusError after the bus's own retries; the receivers see the gap
                if not self._failing:
                    log.warning("relay %s: a message could not be sent: %s", self.topic, exc)
                self._failing = True
            else:
                self._failing = False

    def listen(self, on_message: Callable[[str, str], None], on_gap: Callable[[], None]) -> Unsubscribe:
        """Call ``on_message(sender, message)`` for each message of the other processes, in their sending
        order, and ``on_gap()`` (before the next message) when some may have been missed."""
        joiner = Reassembler(self.node)

        def gap() -> None:
            joiner.reset()
            on_gap()

        def note(payload: str) -> None:
            got = joiner.feed(payload)
            if got.gap:
                on_gap()
            if got.sender is None or got.message is None:
                return
            try:
                items = split_items(got.message)
            except ValueError:
                log.warning("relay %s: an unreadable message from process %s was ignored", self.topic, got.sender)
                return
            for item in items:
                try:
                    on_message(got.sender, item)
                except Exception:
                    log.exception("relay %s: a listener failed", self.topic)

        off_note = self.bus.subscribe(self.topic, note)
        off_gap = self.bus.on_gap(gap)

        def unsubscribe() -> None:
            off_note()
            off_gap()

        return unsubscribe
