"""MediaLibrary: the stored attachments of every session (files in ``core.media.files``, rows in the Store).

``save`` is the only way in: the bytes are written under the size cap, the type is sniffed from them, an
image is checked against the pixel limit by its header and then decoded whole (a broken one is kept as a
file with a note, never shown to a model as an image), and only then does the file get its row; anything
refused is deleted again, so what is stored is always whole and safe to open. An attachment belongs to the
session it was sent in: ``get`` answers only for that session.

Files expire ``keep_seconds`` after they were stored (``sweep``, run by core every so often); ``/new``
drops a session's uploads stored before it that no message refers to (``forget_unclaimed``). Messages keep
their references (and any text read from the file) after the file is gone; the model is then told the file
is no longer available.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import unicodedata
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from core.llm.provider import LLMImage
from core.media import digest
from core.media.describe import image_description
from core.media.files import NO_ROOM, MediaFiles, StorageError, TooLarge, valid_id
from core.media.sniff import IMAGE_TYPES, sniff
from core.messages import AttachmentRef
from core.settings import CoreSettings
from core.store import AttachmentRecord, Store
from core.text import sound_text

log = logging.getLogger(__name__)

MAX_NAME = 200


class Refusal(Exception):
    """An attachment was not kept; ``str`` says why in a few words (for the user and the model). ``storage``:
    the fault is the bridge's own (its disk is full or failing), not the file's (the web chat answers 507)."""

    def __init__(self, reason: str, *, storage: bool = False) -> None:
        super().__init__(reason)
        self.storage = storage


def display_name(name: str | None, fallback: str) -> str:
    """A file name fit to show (and to offer in a download): its last path component, without control
    characters, at most ``MAX_NAME`` characters. Never used for anything on disk."""
    text = sound_text(name or "")
    text = re.split(r"[\\\\/]", text)[-1]
    text = "".join(c for c in text if unicodedata.category(c)[0] != "C").strip().lstrip(".")
    return text[:MAX_NAME] or fallback


class MediaLibrary:
    def __init__(self, root: Path, store: Store, settings: CoreSettings) -> None:
        self.files = MediaFiles(root)
        self._store = store
        self._settings = settings

    async def open(self) -> None:
        await asyncio.to_thread(self.files.prepare)

    async def save(self, key: str, name: str, chunks: AsyncIterator[bytes], *, claimed: bool) -> AttachmentRef:
        """Store the bytes of ``chunks`` as an attachment of session ``key``. Raises Refusal (nothing kept)
        past the size cap or the pixel limit, or when the disk refuses the write (``storage``: full, failing);
        errors of ``chunks`` pass through (nothing kept either)."""
        limit = self._settings.media_max_bytes
        try:
            written = await self.files.write(chunks, limit)
        except TooLarge:
            raise Refusal(f"it is larger than the {_megabytes(limit)} limit for attachments") from None
        except StorageError as exc:
            log.warning("an attachment could not be stored: %s", exc)
            raise Refusal("the bridge has no room to store it" if exc.no_room else "the bridge could not store it",
                          storage=True) from None
        except OSError as exc:  # a full disk however it surfaces; other OSErrors are the chunks' own
            if exc.errno not in NO_ROOM:
                raise
            log.warning("an attachment could not be stored: the disk is full")
            raise Refusal("the bridge has no room to store it", storage=True) from None
        path = self.files.path(written.id)
        kind = await asyncio.to_thread(sniff, written.head)  # a legacy encoding's detection takes milliseconds
        ref = AttachmentRef(id=written.id, kind=kind.kind, name=name, size=written.size,
                            content_type=kind.content_type)
        try:
            if kind.kind == "image":
                try:
                    found = await asyncio.to_thread(digest.image_facts, path, self._settings.media_max_pixels)
                except digest.Unreadable as exc:  # kept as a file, never sent to a model as an image
                    ref = ref.model_copy(update={"kind": "file", "content_type": "application/octet-stream",
                                                 "note": str(exc)})
                else:
                    ref = ref.model_copy(update={"width": found.width, "height": found.height})
            await self._store.add_attachment(AttachmentRecord(
                id=written.id, session_key=key, kind=ref.kind, name=name, content_type=ref.content_type or "",
                size=written.size, created_at=time.time(), claimed=claimed))
        except digest.Refused as exc:
            await asyncio.to_thread(self.files.remove, written.id)
            raise Refusal(str(exc)) from None
        except BaseException:
            await asyncio.to_thread(self.files.remove, written.id)
            raise
        return ref

    async def get(self, key: str, attachment_id: str) -> tuple[AttachmentRecord, Path] | None:
        """The attachment ``attachment_id`` of session ``key`` and its file, or None (not this session's, gone)."""
        if not valid_id(attachment_id):
            return None
        record = await self._store.get_attachment(attachment_id)
        if record is None or record.session_key != key:
            return None
        path = self.files.path(attachment_id)
        return (record, path) if path.is_file() else None

    async def claim(self, ids: Sequence[str]) -> None:
        await self._store.claim_attachments(ids)

    async def forget_unclaimed(self, key: str, *, before: float) -> int:
        """``/new``, sent at ``before``: drop the uploads of ``key`` stored before it that no message refers
        to. An upload stored after it belongs to a message of the new conversation (which may be waiting
        behind ``/new`` in its session's queue), so it stays."""
        ids = await self._store.drop_unclaimed_attachments(key, before=before)
        for attachment_id in ids:
            await asyncio.to_thread(self.files.remove, attachment_id)
        return len(ids)

    async def sweep(self) -> int:
        """Delete the attachments older than ``[media] keep_hours`` (rows, then files)."""
        cutoff = time.time() - self._settings.media_keep_seconds
        ids = await self._store.drop_expired_attachments(cutoff)
        for attachment_id in ids:
            await asyncio.to_thread(self.files.remove, attachment_id)
        orphans = await asyncio.to_thread(self.files.remove_older_than, cutoff)
        await asyncio.to_thread(self.files.remove_stale_parts)
        return len(ids) + orphans

    async def prepare_image(self, ref: AttachmentRef) -> AttachmentRef:
        """Make the scaled copy a model request needs, once, when the stored image is too large for one."""
        if ref.id is None or ref.kind != "image":
            return ref
        path = self.files.path(ref.id)
        try:
            await asyncio.to_thread(digest.scale_for_model, path, self.files.scaled_path(ref.id), ref.size or 0)
        except (OSError, ValueError) as exc:
            log.warning("an image could not be prepared for the model: %s", type(exc).__name__)
            return ref.model_copy(update={"note": "the image could not be read"})
        return ref

    async def model_image(self, ref: AttachmentRef) -> LLMImage | None:
        """The image of ``ref`` as the model gets it (its scaled copy if it has one); None when the file is
        gone (expired) or cannot be read."""
        if ref.id is None or ref.content_type not in IMAGE_TYPES:
            return None
        try:
            data, scaled = await asyncio.to_thread(_load, self.files.scaled_path(ref.id), self.files.path(ref.id))
        except OSError:
            return None
        media_type = sniff(data).content_type if scaled else ref.content_type
        return LLMImage(media_type, data, image_description(ref))


def _load(scaled: Path, original: Path) -> tuple[bytes, bool]:
    """The bytes of the scaled copy if there is one (and True), else of the original."""
    try:
        return scaled.read_bytes(), True
    except FileNotFoundError:
        return original.read_bytes(), False


def _megabytes(limit: int) -> str:
    return f"{limit / 1_000_000:g} MB"
