"""What a file is, from its first bytes: never from its name or what the sender's platform claims.

The answer decides how a file is read for the model and how the web chat serves it, so it comes from the
bytes alone: a known binary signature (through ``puremagic``), else text when the bytes decode as text, else
an opaque file. Only the four image formats every vision API accepts count as images; anything else that calls
itself an image is not one here: SVG (a script-capable XML document) is read as text and BMP or TIFF are
opaque files, and none of them is ever served inline.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass

import puremagic

from core.messages import AttachmentKind

SNIFF_BYTES = 8192
"""How much of the head is looked at."""
IMAGE_TYPES = frozenset({"image/jpeg", "image/png", "image/gif", "image/webp"})
"""Images the model may be shown (OpenAI-compatible and Anthropic APIs accept these), and the only types the
web chat serves inline."""
OCTET_STREAM = "application/octet-stream"
TEXT_PLAIN = "text/plain"
_ALIASES = {"application/ogg": "audio/ogg", "audio/x-wav": "audio/wav", "audio/wave": "audio/wav"}
_TEXT_LIKE = frozenset({"application/json", "application/xml", "application/javascript", "application/x-sh"})


@dataclass(frozen=True, slots=True)
class Sniffed:
    content_type: str
    kind: AttachmentKind


def sniff(head: bytes) -> Sniffed:
    """The content type and kind of a file whose first bytes are ``head`` (at most ``SNIFF_BYTES`` are used)."""
    head = head[:SNIFF_BYTES]
    magic = _magic(head)
    if magic is not None:
        if magic in IMAGE_TYPES:
            return Sniffed(magic, "image")
        if magic == "application/pdf":
            return Sniffed(magic, "pdf")
        if magic.startswith("audio/"):
            return Sniffed(magic, "audio")
        if magic.startswith("video/"):
            return Sniffed(magic, "video")
        if (magic.startswith("text/") or magic in _TEXT_LIKE) and looks_like_text(head):
            return Sniffed(magic if magic != "text/html" else TEXT_PLAIN, "text")
    if head and looks_like_text(head):
        return Sniffed(TEXT_PLAIN, "text")
    return Sniffed(OCTET_STREAM, "file")


def _magic(head: bytes) -> str | None:
    if not head:
        return None
    try:
        candidates = puremagic.magic_string(head)
    except (puremagic.PureError, ValueError):
        return None
    for candidate in candidates:
        if candidate.mime_type:
            mime = str(candidate.mime_type).lower()
            return _ALIASES.get(mime, mime)
    return None


def looks_like_text(head: bytes) -> bool:
    """True when ``head`` decodes as UTF-8 (a character cut at its end allowed) or carries a UTF-16 BOM, and
    holds no NUL or other control bytes a text would not."""
    if head.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return True
    try:
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=False)
    except UnicodeDecodeError:
        return False
    return not any(ord(c) < 32 and c not in "\t\n\r\f" for c in text)
