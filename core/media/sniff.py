"""What a file is, from its first bytes: never from its name or what the sender's platform claims.

The answer decides how a file is read for the model and how the web chat serves it, so it comes from the
bytes alone: a known binary signature (through ``puremagic``), else text when the bytes decode as text (UTF-8,
UTF-16 by its BOM, or a legacy encoding ``charset_normalizer`` recognises: a cp1252 CSV, a GBK note), else
an opaque file. Only the four image formats every vision API accepts count as images; anything else that calls
itself an image is not one here: SVG (a script-capable XML document) is read as text and BMP or TIFF are
opaque files, and none of them is ever served inline.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

import charset_normalizer
import puremagic
from charset_normalizer.utils import is_multi_byte_encoding

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
_ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")
"""A terminal escape sequence: CSI (colours, cursor moves), OSC (a window title, a link) or a two-byte one."""


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
    """True when ``head`` carries a UTF-16 BOM, or is in an encoding ``text_encoding`` finds and holds no NUL
    or other control bytes a text would not (terminal colour codes are allowed: they are removed)."""
    encoding = text_encoding(head)
    if encoding is None:
        return False
    if encoding == "utf-16":
        return True
    text = strip_ansi(codecs.getincrementaldecoder(encoding)(errors="replace").decode(head, final=False))
    return not any(ord(c) < 32 and c not in "\t\n\r\f" for c in text)


def text_encoding(data: bytes) -> str | None:
    """The encoding of a text file whose first bytes are ``data``: UTF-16 by its BOM, UTF-8 when they decode
    as UTF-8 (a character cut at the end allowed), else what ``charset_normalizer`` finds (GBK, Shift JIS,
    cp1251, ...), cp1252 (Windows' Western encoding) among single-byte ones whenever it fits, since short
    single-byte texts are ambiguous. None when they are not text in any encoding."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        return "utf-16"
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=False)
    except UnicodeDecodeError:
        pass
    else:
        return "utf-8-sig"
    if b"\x00" in data:  # no text in a legacy encoding has a NUL: a binary file, not worth the detector's time
        return None
    matches = charset_normalizer.from_bytes(data)
    best = matches.best()
    if best is None:
        return None
    if not is_multi_byte_encoding(best.encoding) and any("cp1252" in m.could_be_from_charset for m in matches):
        return "cp1252"
    return best.encoding


def strip_ansi(text: str) -> str:
    """``text`` without terminal escape sequences (the colours of a log file)."""
    return _ANSI.sub("", text)
