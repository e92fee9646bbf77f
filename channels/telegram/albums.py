"""Albums: the photos (or videos, documents, audio) a user sends together reach core as one message.

Telegram delivers an album as one message per item, all with the same ``media_group_id``; the caption (and so
an @mention of the bot) usually sits on the first only. The user sent one thing and expects one answer about
all of it, so the channel collects an album's messages per chat and hands core one ``InboundEnvelope``
carrying every item, the caption(s) in order, and the first message as the one a group reply quotes. In a group
under ``group_policy = "mention"`` the album is answered when any of its messages is addressed to the bot.

When an album is complete: once none of its messages has come for ``window`` seconds (about one: Telegram
sends an album's messages together, so the next one normally follows within a fraction of that), and at the
latest ``max_wait`` seconds after its first one; at once when it holds ``MAX_PARTS`` (Telegram's largest
album) or when another message of the same chat comes, so that a chat's messages still reach core in the order
they were sent (an album, then the question about it). The quiet window does not run while receiving fails
(``pause``: ``getUpdates`` failing or backing off, a batch not stored): the rest of an album may be waiting at
Telegram then, and it counts again from when receiving works (``resume``); ``max_wait`` still bounds the album.
The clock is injectable, so tests move it themselves.

Nothing accepted is lost. Each message of an album is written to the channel's durable state
(``album:<bot id>:<chat id>:<media_group_id>:<message id>``) before its update is acknowledged to Telegram
(the polling offset saved past it, the webhook answered 200): a write that fails raises ``AdmissionError``,
so the update is not acknowledged and Telegram delivers it again, exactly like a message core could not
store. Acknowledging a part therefore confirms only what the store holds. The merged message is built from
the store (every part written so far, by this process or another sharing the database), submitted to core,
and only once core has accepted it are the parts deleted. A crash or stop at any point leaves the parts in the
store: the next start (every process, at start) finds them and submits the album after ``max_wait`` (so an
album another process is still collecting is left to it), and one that core could not store is tried again.

Never twice, never lost: the parts handed over together are a group, recorded in the album's record
(``album-groups:<bot id>:<chat id>:<media_group_id>``: each group's first message id and the ids of its
parts) before the group is submitted. The first group's event id is the album's
(``<bot id>:<chat id>:album:<media_group_id>``), a later group's the album's followed by its first message id,
so core's durable dedupe drops a second submission of the same group: parts found again after a crash between
the submission and the deletion, two processes that both submit what is left of one album, a retry after core
stored the group but the answer to it was lost. A part Telegram delivers again after its album was handed
over is found in the record: it is stored, submitted again with its group (a duplicate), and deleted. A part
that comes after its album was handed over (the rest of an album delayed by a failing ``getUpdates``, a part
whose first write failed and that Telegram delivered again later) is not in the record: it starts a group of
its own, answered as a follow-up message carrying its photos, and addressed to the bot when the album was.
The record outlives the album's parts (a part can be delivered again up to a day later); records older than
``RECORD_TTL`` are removed when an album of the same chat is handed over, and at every start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from dataclasses import dataclass, field

from pydantic import ValidationError

from channels.common.throttle import Clock
from core.envelope import InboundEnvelope
from core.host import AdmissionError, ChannelHost, ShuttingDownError

log = logging.getLogger(__name__)

MAX_PARTS = 10
"""The most items Telegram puts in one album: an album that holds this many is complete."""
ALBUM_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
"""The form of a media_group_id this channel collects (Telegram's are digits); a message whose id has another
form is answered on its own."""
STATE_PREFIX = "album:"
RECORD_PREFIX = "album-groups:"
RECORD_TTL = 2 * 86400.0
"""Seconds an album's record is kept after its last group was handed over: Telegram keeps an update it could
not deliver for a day, so a part delivered again later than that is not to be expected."""
RETRY_DELAYS = (1.0, 2.0, 5.0, 10.0, 30.0)
"""Between tries of an album core could not store."""


@dataclass(frozen=True, slots=True)
class AlbumPart:
    """One message of an album, normalised as if it came alone (``addressed``: whether it alone would be
    answered under the group policy)."""

    chat_id: str
    album_id: str
    message_id: int
    envelope: InboundEnvelope
    addressed: bool

    def dump(self) -> str:
        return json.dumps({"addressed": self.addressed, "envelope": self.envelope.model_dump(mode="json")})

    @classmethod
    def load(cls, chat_id: str, album_id: str, message_id: int, value: str) -> AlbumPart:
        data = json.loads(value)
        return cls(chat_id, album_id, message_id, InboundEnvelope.model_validate(data["envelope"]),
                   bool(data["addressed"]))


def album_event_id(bot_id: int, chat_id: str, album_id: str, later: int | None = None) -> str:
    """The event id of an album's first group, or (``later``: its first message id) of a later one."""
    base = f"{bot_id}:{chat_id}:album:{album_id}"
    return base if later is None else f"{base}:{later}"


@dataclass(slots=True)
class Record:
    """What was handed over of one album: each group (by its first message id, in the order they were formed)
    with its parts' message ids, whether any part was addressed to the bot, and when it last changed."""

    groups: dict[int, list[int]] = field(default_factory=dict)
    addressed: bool = False
    at: float = 0.0

    def dump(self) -> str:
        return json.dumps({"groups": [[first, ids] for first, ids in self.groups.items()],
                           "addressed": self.addressed, "at": self.at})

    @classmethod
    def load(cls, value: str | None) -> Record:
        if value is None:
            return cls()
        data = json.loads(value)
        return cls({int(first): [int(i) for i in ids] for first, ids in data["groups"]}, bool(data["addressed"]),
                   float(data["at"]))

    def group_of(self, message_id: int) -> int | None:
        return next((first for first, ids in self.groups.items() if message_id in ids), None)


def merge(parts: list[AlbumPart], event_id: str, *, addressed: bool = False) -> InboundEnvelope | None:
    """The one message an album's parts make, or None when none of them is addressed to the bot (and the album
    was not, ``addressed``)."""
    parts = sorted(parts, key=lambda p: p.message_id)
    if not addressed and not any(p.addressed for p in parts):
        return None
    first = parts[0].envelope
    return first.model_copy(update={
        "content": "\n".join(p.envelope.content for p in parts if p.envelope.content.strip()),
        "media": tuple(item for p in parts for item in p.envelope.media),
        "reply_to": next((p.envelope.reply_to for p in parts if p.envelope.reply_to is not None), None),
        "event_id": event_id,
    })


@dataclass(eq=False)
class _Album:
    chat_id: str
    album_id: str
    first: float
    last: float
    quiet: float
    """Seconds without a new part after which the album is complete."""
    parts: set[int] = field(default_factory=set)
    now: asyncio.Event = field(default_factory=asyncio.Event)
    """Set to hand the album over at once."""
    tried: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the album was offered to core (whatever came of it), or its task ended."""
    collecting: bool = True

    @property
    def key(self) -> tuple[str, str]:
        return self.chat_id, self.album_id


class Albums:
    """The albums of one bot being collected in this process."""

    def __init__(self, host: ChannelHost, bot_id: int, *, window: float, max_wait: float,
                 clock: Clock | None = None, retry_delays: tuple[float, ...] = RETRY_DELAYS) -> None:
        self.host = host
        self.bot_id = bot_id
        self.window = window
        self.max_wait = max(max_wait, window)
        self.clock = clock or Clock()
        self.retry_delays = retry_delays
        self.prefix = f"{STATE_PREFIX}{bot_id}:"
        self.record_prefix = f"{RECORD_PREFIX}{bot_id}:"
        self._albums: dict[tuple[str, str], _Album] = {}
        self._handing: dict[tuple[str, str], asyncio.Lock] = {}
        self._paused = False
        self._resumed = asyncio.Event()

    @property
    def pending(self) -> int:
        """Albums being collected or handed over in this process."""
        return len(self._albums)

    def parts(self, chat_id: str) -> int:
        """The parts of the albums of ``chat_id`` collected so far in this process (for tests and logs)."""
        return sum(len(a.parts) for a in self._albums.values() if a.chat_id == chat_id)

    def _name(self, chat_id: str, album_id: str, message_id: int | None = None) -> str:
        return f"{self.prefix}{chat_id}:{album_id}:" + ("" if message_id is None else str(message_id))

    async def add(self, part: AlbumPart) -> None:
        """Keep ``part`` durably, then count it to its album. AdmissionError when it could not be kept (the
        update must not be acknowledged), ShuttingDownError when no album can be started any more (the part
        is kept: the next start hands its album over)."""
        try:
            await self.host.set_state(self._name(part.chat_id, part.album_id, part.message_id), part.dump())
        except Exception as exc:
            log.error("an album part of Telegram chat %s could not be stored: %s", part.chat_id, exc)
            raise AdmissionError("the album part could not be stored") from exc
        album = self._albums.get((part.chat_id, part.album_id))
        now = self.clock.now()
        if album is None or not album.collecting:
            # a first part, or one after its album was handed over (or while it is): a group of its own then, or
            # found in the album's record as a part handed over before (``_hand_over``)
            album = self._start(part.chat_id, part.album_id, now, self.window)
        album.last = now
        album.parts.add(part.message_id)
        if len(album.parts) >= MAX_PARTS:
            album.now.set()

    def _start(self, chat_id: str, album_id: str, now: float, quiet: float) -> _Album:
        album = _Album(chat_id, album_id, first=now, last=now, quiet=quiet)
        self.host.spawn(f"telegram:album:{chat_id}:{album_id}", self._run(album))  # may raise ShuttingDownError
        self._albums[album.key] = album
        return album

    def pause(self) -> None:
        """Receiving fails for now (polling): no album is complete by its quiet window until ``resume``."""
        if not self._paused:
            self._paused = True
            self._resumed = asyncio.Event()

    def resume(self) -> None:
        """Receiving works again: the quiet window of every album being collected counts from now."""
        if self._paused:
            self._paused = False
            now = self.clock.now()
            for album in self._albums.values():
                if album.collecting:
                    album.last = max(album.last, now)
            self._resumed.set()

    async def flush_chat(self, chat_id: str) -> None:
        """Hand over the albums of ``chat_id`` now, and return once each was offered to core: a message of the
        chat that comes after an album goes to core after it."""
        albums = [a for a in self._albums.values() if a.chat_id == chat_id]
        for album in albums:
            album.now.set()
        for album in albums:
            await album.tried.wait()

    async def close(self) -> None:
        """At stop: hand every album over now, and wait until each was offered to core (what core could not
        take stays stored for the next start)."""
        albums = list(self._albums.values())
        for album in albums:
            album.now.set()
        for album in albums:
            await album.tried.wait()

    async def recover(self) -> None:
        """Hand over, after ``max_wait``, the albums whose parts a previous run (or another process) left in
        the store. Raises what the store raises."""
        names = await self.host.state_names(self.prefix)
        found: set[tuple[str, str]] = set()
        for name in names:
            chat_id, sep, rest = name[len(self.prefix):].partition(":")
            album_id, sep2, _ = rest.partition(":")
            if sep and sep2:
                found.add((chat_id, album_id))
        await self._forget_old_records(self.record_prefix)
        now = self.clock.now()
        for key in sorted(found - set(self._albums)):
            log.info("handing over a Telegram album left stored (chat %s)", key[0])
            self._start(*key, now, self.max_wait)

    async def _run(self, album: _Album) -> None:
        try:
            await self._collect(album)
            album.collecting = False
            failures = 0
            while True:
                outcome = await self._hand_over(album)
                album.tried.set()
                if outcome != "retry":
                    return
                await self.clock.sleep(self.retry_delays[min(failures, len(self.retry_delays) - 1)])
                failures += 1
        finally:
            album.collecting = False
            album.tried.set()
            if self._albums.get(album.key) is album:
                del self._albums[album.key]

    async def _collect(self, album: _Album) -> None:
        """Wait until the album is complete: ``quiet`` seconds after its last part, at most ``max_wait`` after
        its first, or at once when told to."""
        while not album.now.is_set():
            paused = self._paused
            bound = album.first + self.max_wait
            left = (bound if paused else min(album.last + album.quiet, bound)) - self.clock.now()
            if left <= 0:
                return
            waiters = [asyncio.ensure_future(self.clock.sleep(left)), asyncio.ensure_future(album.now.wait())]
            if paused:
                waiters.append(asyncio.ensure_future(self._resumed.wait()))
            try:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in waiters:
                    waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.gather(*waiters, return_exceptions=True)

    async def _hand_over(self, album: _Album) -> str:
        """Submit what the store holds of the album, then forget those parts: "done", "retry" (not taken: the
        store or core failed for a moment) or "closing" (core accepts nothing more: the parts stay stored).
        One hand-over of an album at a time in this process: its record is read, changed and written."""
        lock = self._handing.setdefault(album.key, asyncio.Lock())
        try:
            async with lock:
                return await self._hand_over_locked(album)
        finally:
            if not lock.locked() and self._handing.get(album.key) is lock:
                del self._handing[album.key]

    async def _hand_over_locked(self, album: _Album) -> str:
        prefix = self._name(album.chat_id, album.album_id)
        record_name = self._record_name(album.chat_id, album.album_id)
        try:
            names = await self.host.state_names(prefix)
            values = [(name, await self.host.get_state(name)) for name in names]
            stored = await self.host.get_state(record_name)
        except Exception as exc:
            log.warning("the parts of a Telegram album (chat %s) could not be read (%s); trying again",
                        album.chat_id, exc)
            return "retry"
        try:
            record = Record.load(stored)
        except (ValueError, KeyError, TypeError) as exc:  # what is stored now is handed over as new
            log.error("the record of a Telegram album (chat %s) cannot be read and is replaced: %s", album.chat_id, exc)
            record = Record()
        parts: list[AlbumPart] = []
        for name, value in values:
            if value is None:
                continue
            try:
                parts.append(AlbumPart.load(album.chat_id, album.album_id, int(name[len(prefix):]), value))
            except (ValueError, KeyError, TypeError, ValidationError) as exc:
                log.error("a stored Telegram album part (%s) cannot be read and is left out: %s", name, exc)
        groups: dict[int, list[AlbumPart]] = {}
        new = [p for p in parts if record.group_of(p.message_id) is None]
        if new:  # parts not handed over before: a group of their own, recorded before it is submitted
            first = min(p.message_id for p in new)
            record.groups[first] = sorted(p.message_id for p in new)
            record.addressed = record.addressed or any(p.addressed for p in new)
            record.at = time.time()
            try:
                await self.host.set_state(record_name, record.dump())
            except Exception as exc:
                log.warning("a Telegram album (chat %s) could not be recorded (%s); trying again", album.chat_id, exc)
                return "retry"
        for p in parts:
            group = record.group_of(p.message_id)
            assert group is not None
            groups.setdefault(group, []).append(p)
        order = list(record.groups)
        for group, members in sorted(groups.items(), key=lambda g: order.index(g[0])):
            later = None if order.index(group) == 0 else group
            event_id = album_event_id(self.bot_id, album.chat_id, album.album_id, later)
            envelope = merge(members, event_id, addressed=record.addressed)
            if envelope is not None:
                try:
                    await self.host.submit(envelope)
                except ShuttingDownError:
                    return "closing"
                except AdmissionError:
                    log.warning("a Telegram album (chat %s) could not be stored; trying again", album.chat_id)
                    return "retry"
                except Exception as exc:  # our bug: logged, and the album dropped rather than tried forever
                    log.error("a Telegram album (chat %s) could not be handed over and is skipped: %s",
                              album.chat_id, f"{type(exc).__name__}: {exc}")
            for p in members:
                name = self._name(album.chat_id, album.album_id, p.message_id)
                try:
                    await self.host.delete_state(name)
                except Exception as exc:  # found again at the next start, and dropped then as a duplicate
                    log.warning("a handed-over Telegram album part (%s) could not be deleted: %s", name, exc)
        read = {self._name(album.chat_id, album.album_id, p.message_id) for p in parts}
        for name, value in values:  # unreadable parts: left out above, and not kept forever
            if value is not None and name not in read:
                with contextlib.suppress(Exception):
                    await self.host.delete_state(name)
        await self._forget_old_records(f"{self.record_prefix}{album.chat_id}:")
        return "done"

    def _record_name(self, chat_id: str, album_id: str) -> str:
        return f"{self.record_prefix}{chat_id}:{album_id}"

    async def _forget_old_records(self, prefix: str) -> None:
        """Remove the records under ``prefix`` not changed for ``RECORD_TTL``. A store that fails leaves them for
        the next time."""
        try:
            for name in await self.host.state_names(prefix):
                value = await self.host.get_state(name)
                try:
                    old = value is not None and Record.load(value).at < time.time() - RECORD_TTL
                except (ValueError, KeyError, TypeError):
                    old = True  # unreadable: of no use to anyone
                if old:
                    await self.host.delete_state(name)
        except Exception as exc:
            log.warning("old Telegram album records could not be removed (%s); removing them later", exc)
