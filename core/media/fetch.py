"""The seam through which core downloads an attachment: a channel implements :class:`AttachmentSource`.

A channel that receives files (Telegram, Slack, Feishu) puts a ``MediaItem`` per file in the envelope and
implements one method, ``fetch_attachment(item, target)``: an async generator yielding the file's bytes in
chunks, fetched with its platform's own API (Telegram ``getFile`` and the file URL, Slack ``files.info`` and
``url_private_download`` with the bot token, Feishu's message-resource API). ``target`` is the turn's target,
so the channel can read its typed context (e.g. the platform message id a resource belongs to).

Core does everything else, once for every platform (``core.media.intake``): it calls the method after the
message was admitted (in the turn, never in the channel's acknowledgement path), stops reading past
``[media] max_bytes`` (closing the generator, so the channel's ``finally`` releases the HTTP response),
deletes whatever was written when anything fails, sniffs the type from the bytes and tells the model and the
user what happened. A fetch that takes longer than the fetch timeout is abandoned the same way.

The generator raises :class:`FetchError` (with ``too_large`` when the platform itself refuses the size) for
a file the platform does not hand over; any other exception is treated the same, logged with its type only.
A FetchError marked ``transient`` (a 429, a 5xx, a connection broken or a body cut short) is fetched again
from the start, after a backoff (``retry_after`` when the platform said how long), within the fetch timeout.
It follows no redirect to a host that is not the platform's (``channels.common.download`` does that for
aiohttp).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol, runtime_checkable

from core.envelope import MediaItem, TurnTarget


class FetchError(Exception):
    """The platform did not hand the file over. The message is for logs (no secrets: no tokenised URLs)."""

    def __init__(self, detail: str, *, too_large: bool = False, transient: bool = False,
                 retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.too_large = too_large
        self.transient = transient
        """Asking again may well work (429, 5xx, a broken connection): core fetches it again from the start."""
        self.retry_after = retry_after
        """Seconds the platform asked to wait before asking again (a 429's ``Retry-After``), if it said."""


@runtime_checkable
class AttachmentSource(Protocol):
    """What a channel implements so that core can download the attachments of its messages."""

    def fetch_attachment(self, item: MediaItem, target: TurnTarget) -> AsyncGenerator[bytes, None]:
        """The bytes of ``item`` (an async generator; raise FetchError when the platform refuses)."""
        ...
