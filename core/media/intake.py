"""AttachmentIntake: a message's attachments, from its channel to stored, readable references.

This is the first step of a turn (``core.executor``), after the message was admitted, so a slow download
never holds up the channel's acknowledgement. For each ``MediaItem`` of the envelope, at most
``[media] max_files``:

- a web upload (``attachment_id``) is already stored: it is checked to belong to this session and claimed;
- anything else is downloaded through the channel's ``AttachmentSource`` (``core.media.fetch``) into the
  library, bounded by ``max_bytes`` (a size the platform declares beyond it is refused without downloading)
  and by the fetch timeout; a download that fails transiently (a 429, a 5xx, a body cut short) is made again
  from the start (``FETCH_RETRY_DELAYS``, at least the platform's ``Retry-After``; tenacity), its partial
  file deleted first, as long as the fetch timeout leaves time for it;
- then read for the model: an image gets its scaled copy if it needs one, a text file or PDF its text within
  the message's character budget, voice and audio their transcript when ``[media.transcription]`` is set
  (within the same budget, shared with the documents: a transcript is cut like a document's text).

Whatever cannot be fetched or read becomes a reference with a ``note`` (the model is told in one line) and,
where the user can do something about it, a short note for the user. Nothing here raises for a bad file.

A message's downloads run at the same time, at most ``FETCH_CONCURRENCY`` of them at once (platforms
rate-limit file downloads; each channel's own pacing of its API calls still applies underneath), and all under
ONE deadline: the fetch timeout counts from the start of the message's downloads, not per file, so a message of
ten files on a stalled file host keeps the chat silent for one timeout, not ten. No separate per-file bound is
needed: a file can take no longer than its message. A download still running at the deadline is abandoned
("it took too long to download"); one still waiting for its turn then is not started ("there was no time left
to download it"). Whatever finished first, the references keep the order of the message's items, and so do the
user's notes, which number the unnamed files of a kind when the message has several (``photo 3 of 10``); a
named file keeps its name. Cancelling ``take`` (a ``/stop``, ``core.executor``) cancels every download at once,
and a cancelled one keeps nothing (``core.media.files``).

Reading the stored files follows the same rule: at most ``FETCH_CONCURRENCY`` at once, under one deadline of the
fetch timeout counted from the start of the reading. It matters for transcripts, each a request to the
transcription service: ten voice notes on a stalled service cost one timeout ("it took too long to
transcribe", or "there was no time left to transcribe it" for one whose turn came after), not ten.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import tenacity

from core.envelope import InboundEnvelope, MediaItem, TurnTarget
from core.media import digest
from core.media.fetch import AttachmentSource, FetchError
from core.media.library import MediaLibrary, Refusal, display_name
from core.media.transcribe import Transcriber, TranscriptionError
from core.messages import AttachmentKind, AttachmentRef
from core.retrying import run_with_retries
from core.settings import CoreSettings

log = logging.getLogger(__name__)

_FALLBACK_NAMES = {"photo": "photo", "document": "file", "audio": "audio", "voice": "voice message",
                   "video": "video"}
_KINDS: dict[str, AttachmentKind] = {"photo": "image", "audio": "audio", "voice": "audio", "video": "video"}
FETCH_CONCURRENCY = 4
"""Downloads of one message at once, at most: a message's files come from one platform, which rate-limits its
file downloads (Telegram's getFile, Slack's files, Feishu's message resources)."""
FETCH_RETRY_DELAYS: tuple[float, ...] = (0.5, 2.0, 5.0)
"""Waits before each new try of a download that failed transiently (so at most four tries), each at least the
platform's ``Retry-After``; a wait that would end past the fetch timeout is not started."""


@dataclass(frozen=True, slots=True)
class Intake:
    refs: tuple[AttachmentRef, ...] = ()
    notes: tuple[str, ...] = ()
    """One line per attachment the user should hear about (refused, could not be downloaded)."""

    def note_text(self) -> str | None:
        return "\n".join(self.notes) if self.notes else None


class AttachmentIntake:
    def __init__(self, library: MediaLibrary, settings: CoreSettings, *,
                 sources: Callable[[str], object | None], transcriber: Transcriber | None = None) -> None:
        self._library = library
        self._settings = settings
        self._sources = sources
        self._transcriber = transcriber

    async def take(self, envelope: InboundEnvelope) -> Intake:
        """Fetch, store and read the attachments of ``envelope`` (never raises for a bad file)."""
        if not envelope.media:
            return Intake()
        key, target = envelope.key(), envelope.target()
        limit = self._settings.media_max_files
        items = envelope.media
        labels = _labels(items)
        fetched: list[tuple[AttachmentRef, str | None]] = [
            (unread(item, name=_name(item), note=f"only {limit} attachments of a message are read"), None)
            for item in items]
        deadline = asyncio.get_running_loop().time() + self._settings.media_fetch_timeout
        slots = asyncio.Semaphore(FETCH_CONCURRENCY)

        async def fetch(index: int, item: MediaItem) -> None:
            fetched[index] = await self._fetch(item, _name(item), key, target, envelope.channel,
                                               slots=slots, deadline=deadline)

        try:
            async with asyncio.TaskGroup() as group:
                for index, item in enumerate(items[:limit]):
                    group.create_task(fetch(index, item))
        except ExceptionGroup as failed:  # a failing store (a web upload's lookup): as if fetched one by one
            raise failed.exceptions[0] from None
        refs = [ref for ref, _ in fetched]
        notes = [f"⚠️ {label}: {note}." for label, (_, note) in zip(labels, fetched, strict=True) if note]
        documents = sum(1 for r in refs if r.id is not None and self._reads_text(r) and not r.note)
        budget = max(1000, self._text_budget() // max(documents, 1))
        read = list(refs)
        deadline = asyncio.get_running_loop().time() + self._settings.media_fetch_timeout

        async def read_one(index: int, ref: AttachmentRef) -> None:
            async with slots:
                read[index] = await self._read(ref, budget, deadline)

        try:
            async with asyncio.TaskGroup() as group:
                for index, ref in enumerate(refs):
                    group.create_task(read_one(index, ref))
        except ExceptionGroup as failed:  # as if read one by one: the first failure is the message's
            raise failed.exceptions[0] from None
        for label, ref, done in zip(labels, refs, read, strict=True):
            if ref.id is not None and done.id is None:  # refused once opened (a PDF that unpacks too far)
                notes.append(f"⚠️ {label}: {done.note}.")
        if len(items) > limit:
            left = len(items) - limit
            notes.append(f"⚠️ Only the first {limit} attachments of a message are read; {left} "
                         f"{'was' if left == 1 else 'were'} left out.")
        return Intake(tuple(read), tuple(notes))

    def _reads_text(self, ref: AttachmentRef) -> bool:
        """Whether the model gets text read from ``ref`` (a document, a PDF, a transcript): its share of the
        message's text budget."""
        return ref.kind in ("text", "pdf") or (ref.kind == "audio" and self._transcriber is not None)

    def _text_budget(self) -> int:
        # about a quarter of the context window (four characters to a token), and never more than configured
        return min(self._settings.media_text_chars, self._settings.context_window)

    async def _fetch(self, item: MediaItem, name: str, key: str, target: TurnTarget, channel: str, *,
                     slots: asyncio.Semaphore, deadline: float) -> tuple[AttachmentRef, str | None]:
        """(the stored reference, or one with a note; a note for the user, if any). A download waits for one
        of ``slots`` and ends by ``deadline`` (the event loop's time), retries included."""
        if item.attachment_id is not None:
            found = await self._library.get(key, item.attachment_id)
            if found is None:
                return unread(item, name=name, note="it is no longer available"), "it is no longer available"
            record, _ = found
            await self._library.claim([record.id])
            return AttachmentRef.model_validate({
                "id": record.id, "kind": record.kind, "name": record.name, "size": record.size,
                "content_type": record.content_type}), None
        cap = self._settings.media_max_bytes
        if item.size is not None and item.size > cap:
            reason = f"it is larger than the {cap / 1_000_000:g} MB limit for attachments"
            return unread(item, name=name, note=reason), reason
        source = self._sources(channel)
        if not isinstance(source, AttachmentSource):
            return unread(item, name=name, note="this chat's files cannot be downloaded"), None
        async def download() -> AttachmentRef:  # from the start: a failed try's partial file is already deleted
            chunks = source.fetch_attachment(item, target)
            async with contextlib.aclosing(chunks):
                return await self._library.save(key, name, chunks, claimed=True)

        started = False
        try:
            async with asyncio.timeout_at(deadline), slots:
                started = True
                ref = await run_with_retries(lambda: _fetch_policy(deadline, channel), download)
        except Refusal as exc:
            return unread(item, name=name, note=str(exc)), str(exc)
        except FetchError as exc:
            log.warning("an attachment from %s could not be downloaded: %s", channel, exc)
            reason = (f"it is larger than {channel} lets bots download" if exc.too_large
                      else "it could not be downloaded")
            return unread(item, name=name, note=reason), reason
        except TimeoutError:
            reason = "it took too long to download" if started else "there was no time left to download it"
            return unread(item, name=name, note=reason), reason
        except Exception as exc:  # a channel's bug must not cost the user the answer to their caption
            log.warning("downloading an attachment from %s failed: %s", channel, type(exc).__name__)
            return unread(item, name=name, note="it could not be downloaded"), "it could not be downloaded"
        return ref, ref.note  # kept but unreadable (a broken image): the sender is told too

    async def _read(self, ref: AttachmentRef, budget: int, deadline: float) -> AttachmentRef:
        """What the model can read of a stored attachment (its text, a transcript by ``deadline``, the event
        loop's time; a scaled image)."""
        if ref.id is None or ref.note:
            return ref
        path = self._library.files.path(ref.id)
        try:
            if ref.kind == "image":
                return await self._library.prepare_image(ref)
            if ref.kind == "text":
                text = await asyncio.to_thread(digest.text_excerpt, path, budget)
                return ref.model_copy(update={"text": text})
            if ref.kind == "pdf":
                text, pages = await asyncio.to_thread(digest.pdf_excerpt, path, budget)
                return ref.model_copy(update={"text": text, "pages": pages})
            if ref.kind == "audio" and self._transcriber is not None:
                return await self._transcribe(ref, path, budget, deadline)
        except digest.Refused as exc:
            await asyncio.to_thread(self._library.files.remove, ref.id)
            return ref.model_copy(update={"id": None, "note": str(exc)})
        except digest.Unreadable as exc:
            return ref.model_copy(update={"note": str(exc)})
        except OSError as exc:
            log.warning("an attachment could not be read: %s", type(exc).__name__)
            return ref.model_copy(update={"note": "it could not be read"})
        return ref

    async def _transcribe(self, ref: AttachmentRef, path: Path, budget: int, deadline: float) -> AttachmentRef:
        assert self._transcriber is not None
        if asyncio.get_running_loop().time() >= deadline:  # its turn came too late: not sent at all
            return ref.model_copy(update={"note": "there was no time left to transcribe it"})
        try:
            async with asyncio.timeout_at(deadline):
                text = await self._transcriber.transcribe(path, ref.content_type or "audio/ogg")
        except TimeoutError:
            log.warning("transcription took longer than the fetch timeout")
            return ref.model_copy(update={"note": "it took too long to transcribe"})
        except TranscriptionError as exc:
            log.warning("transcription failed: %s", exc)
            return ref.model_copy(update={"note": "it could not be transcribed"})
        return ref.model_copy(update={"text": digest.cut(text, budget)})


def _fetch_policy(deadline: float, channel: str) -> tenacity.AsyncRetrying:
    """Fetch again after a transient FetchError: at most ``len(FETCH_RETRY_DELAYS)`` more tries, each after its
    delay (or the platform's ``retry_after`` if longer), never one whose wait would end past ``deadline``."""
    delays = FETCH_RETRY_DELAYS

    def error(state: tenacity.RetryCallState) -> BaseException | None:
        return state.outcome.exception() if state.outcome is not None and state.outcome.failed else None

    def wait(state: tenacity.RetryCallState) -> float:
        base = delays[min(state.attempt_number, len(delays)) - 1] if delays else 0.0
        exc = error(state)
        if isinstance(exc, FetchError) and exc.retry_after is not None:
            return max(base, exc.retry_after)
        return base

    def stop(state: tenacity.RetryCallState) -> bool:
        if state.attempt_number > len(delays):
            return True
        return asyncio.get_running_loop().time() + wait(state) >= deadline

    def before_sleep(state: tenacity.RetryCallState) -> None:
        log.info("downloading an attachment from %s failed (%s); trying again", channel, error(state))

    return tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(lambda exc: isinstance(exc, FetchError) and exc.transient),
        stop=stop, wait=wait, before_sleep=before_sleep, reraise=True)


def _name(item: MediaItem) -> str:
    return display_name(item.file_name, _FALLBACK_NAMES.get(item.kind, "file"))


def _labels(items: Sequence[MediaItem]) -> list[str]:
    """How the user's notes call each item: a named file by its name; an unnamed one by its kind, numbered
    among the message's unnamed items of that kind when there are several (``photo 3 of 10``)."""
    fallbacks = [None if display_name(item.file_name, "") else _FALLBACK_NAMES.get(item.kind, "file")
                 for item in items]
    totals = Counter(f for f in fallbacks if f is not None)
    seen: Counter[str] = Counter()
    labels = []
    for item, fallback in zip(items, fallbacks, strict=True):
        if fallback is None:
            labels.append(_name(item))
            continue
        seen[fallback] += 1
        labels.append(fallback if totals[fallback] == 1 else f"{fallback} {seen[fallback]} of {totals[fallback]}")
    return labels


def unread(item: MediaItem, note: str, name: str | None = None) -> AttachmentRef:
    """A reference to an attachment that was not kept: what the platform said about it, and why."""
    kind = _KINDS.get(item.kind, "file")
    name = name or display_name(item.file_name, _FALLBACK_NAMES.get(item.kind, "file"))
    return AttachmentRef(id=None, kind=kind, name=name, size=item.size, content_type=None, note=note)
