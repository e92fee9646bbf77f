"""The media directory: attachment files under ``<data_dir>/media``, named only by ids we generate.

No name a user or a platform supplied ever becomes part of a path: a file is ``<id>`` (32 hex digits,
checked on every use), its scaled copy for the model ``<id>.scaled``, and a write in progress
``tmp/<random>.part``. A write streams chunks to the temporary file and counts them: past ``max_bytes`` it
stops, deletes what it wrote and raises :class:`TooLarge`; any other failure (the download broke, the turn
was stopped) deletes it too. Only a complete file is renamed into place, so a partial file is never kept.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from core.media.sniff import SNIFF_BYTES

log = logging.getLogger(__name__)

_ID = re.compile(r"[0-9a-f]{32}")
SCALED_SUFFIX = ".scaled"


class TooLarge(Exception):
    """The file is larger than the cap; nothing of it was kept."""

    def __init__(self, limit: int, seen: int) -> None:
        super().__init__(f"more than {limit} bytes")
        self.limit = limit
        self.seen = seen


def valid_id(attachment_id: str) -> bool:
    return bool(_ID.fullmatch(attachment_id))


@dataclass(frozen=True, slots=True)
class Written:
    id: str
    size: int
    head: bytes
    """The first bytes (for sniffing)."""


class MediaFiles:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._tmp = root / "tmp"

    def prepare(self) -> None:
        """Create the directory and delete writes a previous process left unfinished (blocking: run in a thread)."""
        self._tmp.mkdir(parents=True, exist_ok=True)
        for leftover in self._tmp.glob("*.part"):
            with contextlib.suppress(OSError):
                leftover.unlink()

    def path(self, attachment_id: str) -> Path:
        if not valid_id(attachment_id):
            raise ValueError("not an attachment id")
        return self.root / attachment_id

    def scaled_path(self, attachment_id: str) -> Path:
        return self.path(attachment_id).with_name(attachment_id + SCALED_SUFFIX)

    async def write(self, chunks: AsyncIterator[bytes], max_bytes: int) -> Written:
        """Store the bytes of ``chunks`` as a new file. Raises TooLarge past ``max_bytes`` (nothing kept);
        any error of ``chunks`` passes through, with nothing kept either."""
        attachment_id = uuid.uuid4().hex
        part = self._tmp / f"{uuid.uuid4().hex}.part"
        size = 0
        head = bytearray()
        # Local disk writes go to the page cache; a thread hop per chunk would cost more than the write.
        out = part.open("wb")
        try:
            try:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise TooLarge(max_bytes, size)
                    if len(head) < SNIFF_BYTES:
                        head += chunk[: SNIFF_BYTES - len(head)]
                    out.write(chunk)
            finally:
                out.close()
            os.replace(part, self.path(attachment_id))
        except BaseException:
            with contextlib.suppress(OSError):
                part.unlink()
            raise
        return Written(attachment_id, size, bytes(head))

    def remove(self, attachment_id: str) -> None:
        """Delete a file and its scaled copy (blocking: small; missing files are fine)."""
        for path in (self.path(attachment_id), self.scaled_path(attachment_id)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def remove_older_than(self, cutoff: float) -> int:
        """Delete every file last written before ``cutoff`` (epoch seconds), whatever the database says:
        the backstop for a file whose row was lost. Returns how many (blocking: run in a thread)."""
        gone = 0
        for entry in os.scandir(self.root):
            name = entry.name.removesuffix(SCALED_SUFFIX)
            if not entry.is_file() or not valid_id(name):
                continue
            try:
                if entry.stat().st_mtime < cutoff:
                    os.unlink(entry.path)
                    gone += 1
            except FileNotFoundError:
                continue
        return gone
