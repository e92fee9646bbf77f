"""The media directory: attachment files under ``<data_dir>/media``, named only by ids we generate.

No name a user or a platform supplied ever becomes part of a path: a file is ``<id>`` (32 hex digits,
checked on every use), its scaled copy for the model ``<id>.scaled``, and a write in progress
``tmp/<random>.part``. A write streams chunks to the temporary file and counts them: past ``max_bytes`` it
stops, deletes what it wrote and raises :class:`TooLarge`; any other failure (the download broke, the turn
was stopped) deletes it too. Only a complete file is renamed into place, so a partial file is never kept.
A failure of the disk itself (full, over quota) is a :class:`StorageError`, told apart from the chunks' own.
A write left by a process that died is deleted once it is ``STALE_PART_SECONDS`` old (at the next start, or
by the sweep), never sooner: the directory may be shared with other processes writing into it.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

from core.media.sniff import SNIFF_BYTES

log = logging.getLogger(__name__)

_ID = re.compile(r"[0-9a-f]{32}")
SCALED_SUFFIX = ".scaled"
STALE_PART_SECONDS = 3600.0
"""A temporary write untouched this long was abandoned by a process that died (a live one writes every
chunk, and no download or upload outlasts the fetch timeout of minutes): it is deleted at the next start or
sweep. Younger ones may be another process's downloads in progress (a data directory shared on PostgreSQL)."""


class TooLarge(Exception):
    """The file is larger than the cap; nothing of it was kept."""

    def __init__(self, limit: int, seen: int) -> None:
        super().__init__(f"more than {limit} bytes")
        self.limit = limit
        self.seen = seen


NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT})
"""The errors of a disk that is full (or a quota used up)."""


class StorageError(Exception):
    """The disk refused the write (full, over quota, failing); nothing of the file was kept."""

    def __init__(self, error: OSError) -> None:
        super().__init__(f"{type(error).__name__}: {errno.errorcode.get(error.errno or 0, error.errno)}")
        self.no_room = error.errno in NO_ROOM


@contextlib.contextmanager
def _disk() -> Iterator[None]:
    """An OSError of the write itself (not of the chunks it is given) as a StorageError."""
    try:
        yield
    except OSError as exc:
        raise StorageError(exc) from exc


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
        self.remove_stale_parts()

    def remove_stale_parts(self, now: float | None = None) -> int:
        """Delete the temporary writes not written to for ``STALE_PART_SECONDS``: left by a process that died.
        Only those: the directory may be shared by several processes (PostgreSQL), and a write in progress in
        another one is touched at every chunk. Returns how many (blocking: run in a thread)."""
        cutoff = (time.time() if now is None else now) - STALE_PART_SECONDS
        gone = 0
        for leftover in self._tmp.glob("*.part"):
            with contextlib.suppress(OSError):
                if leftover.stat().st_mtime < cutoff:
                    leftover.unlink()
                    gone += 1
        return gone

    def path(self, attachment_id: str) -> Path:
        if not valid_id(attachment_id):
            raise ValueError("not an attachment id")
        return self.root / attachment_id

    def scaled_path(self, attachment_id: str) -> Path:
        return self.path(attachment_id).with_name(attachment_id + SCALED_SUFFIX)

    async def write(self, chunks: AsyncIterator[bytes], max_bytes: int) -> Written:
        """Store the bytes of ``chunks`` as a new file. Raises TooLarge past ``max_bytes`` and StorageError when
        the disk refuses the write (nothing kept); any error of ``chunks`` passes through, with nothing kept
        either."""
        attachment_id = uuid.uuid4().hex
        part = self._tmp / f"{uuid.uuid4().hex}.part"
        size = 0
        head = bytearray()
        # Local disk writes go to the page cache; a thread hop per chunk would cost more than the write.
        with _disk():
            out = part.open("wb")
        try:
            try:
                async for chunk in chunks:
                    size += len(chunk)
                    if size > max_bytes:
                        raise TooLarge(max_bytes, size)
                    if len(head) < SNIFF_BYTES:
                        head += chunk[: SNIFF_BYTES - len(head)]
                    with _disk():
                        out.write(chunk)
            except BaseException:
                with contextlib.suppress(OSError):
                    out.close()
                raise
            with _disk():
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
