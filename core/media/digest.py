"""What the model can read of a stored file: image limits and a scaled copy, document and PDF text.

Every function here blocks (Pillow, pypdf, file reads) and is run in a worker thread by the caller.

- Images: the dimensions come from the header (Pillow's ``open`` decodes no pixels), so an image that would
  unpack into more than ``max_pixels`` pixels (a decompression bomb: a few kilobytes of PNG that inflate to
  gigabytes) is refused before anything is decoded. One within the limit is then decoded whole, so a broken
  or truncated image is found here, not by a model API that refuses the request carrying it. An image too
  large for a model request (more than ``MODEL_MAX_SIDE`` pixels on a side, or more bytes than Anthropic
  takes per image) gets a scaled copy.
- Text: decoded (UTF-8, UTF-16 by its BOM, or the legacy encoding ``sniff.text_encoding`` finds) up to a
  character budget, terminal colour codes removed; a cut is marked.
- PDF: pypdf extracts the text of each page until the budget is used, and says how many pages were left out.
  pypdf's own limits refuse streams that decompress beyond what any real document needs; the reading itself
  is bounded too (pages, decoded content parsed, seconds), since a thread cannot be stopped: the pages past
  a bound are not read, and the text says so.
"""

from __future__ import annotations

import codecs
import logging
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import pypdf
from PIL import Image, ImageOps, UnidentifiedImageError
from pypdf.errors import LimitReachedError, PyPdfError
from pypdf.generic import ArrayObject, DictionaryObject, PdfObject, StreamObject

from core.media.sniff import strip_ansi, text_encoding

log = logging.getLogger(__name__)

MODEL_MAX_SIDE = 2048
"""Longest side of an image sent to a model; larger ones are scaled (the APIs scale below this anyway)."""
MODEL_MAX_BYTES = 3_750_000
"""Bytes of an image sent to a model (Anthropic takes at most 5 MB of base64 per image)."""
PDF_READ_SECONDS = 3.0
"""Reading a PDF's text starts no new page after this long (the page in progress is bounded by the next two)."""
PDF_MAX_PAGES = 1000
"""Pages of a PDF read at most (each costs its fonts and content even when it has no text)."""
PDF_MAX_CONTENT = 600_000
"""Decoded content bytes (page and form streams) parsed for the text of one PDF at most. pypdf parses and
interprets content at a few hundred KB a second, so this bounds the work of one PDF to a few seconds: a few
KB of operators that inflate to megabytes cannot hold a turn for minutes. A page of text takes a few KB to a
few tens of KB, so the text budget is used up long before this in any ordinary document."""


class Refused(Exception):
    """The file is not kept: it is unsafe to open (``str`` is a few words for the user and the model)."""


class Unreadable(Exception):
    """The file is kept, but its content cannot be read (a broken or encrypted document)."""


@dataclass(frozen=True, slots=True)
class ImageFacts:
    width: int
    height: int


def image_facts(path: Path, max_pixels: int) -> ImageFacts:
    """The dimensions of the image at ``path``, read from its header; Refused past ``max_pixels``. Within it the
    image is then decoded whole (a JPEG at an eighth of its scale, which still reads every byte of it), so a
    broken or truncated one is Unreadable here rather than sent to a model that refuses it."""
    try:
        with Image.open(path) as img:
            width, height = img.size
            if width * height > max_pixels:
                raise Refused(f"{width}×{height} pixels is more than the {max_pixels // 1_000_000} megapixels "
                              "images may have here")
            img.draft("RGB", (max(1, width // 8), max(1, height // 8)))  # JPEG only: less memory, same check
            img.load()
    except Image.DecompressionBombError:
        raise Refused("it has more pixels than images may have here") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, struct.error):
        raise Unreadable("the image could not be read (it is broken or cut short)") from None
    return ImageFacts(width, height)


def scale_for_model(path: Path, out: Path, size: int) -> str | None:
    """Write a copy of the image at ``path`` small enough for a model request to ``out`` when the original is
    not, and return its content type; None when the original fits. Only for images within the pixel limit."""
    with Image.open(path) as img:
        if max(img.size) <= MODEL_MAX_SIDE and size <= MODEL_MAX_BYTES:
            return None
        img.draft("RGB", (MODEL_MAX_SIDE, MODEL_MAX_SIDE))  # JPEG: decode at a fraction of the size
        frame = ImageOps.exif_transpose(img)
        frame.thumbnail((MODEL_MAX_SIDE, MODEL_MAX_SIDE))
        alpha = frame.mode in ("RGBA", "LA") or (frame.mode == "P" and "transparency" in frame.info)
        if alpha:
            frame.convert("RGBA").save(out, "PNG", optimize=True)
            return "image/png"
        frame.convert("RGB").save(out, "JPEG", quality=85)
        return "image/jpeg"


def text_excerpt(path: Path, budget: int) -> str:
    """The text of the file at ``path`` up to ``budget`` characters, the cut marked."""
    size = path.stat().st_size
    limit = budget * 4 + 4  # a character is at most four bytes in UTF-8 (two units of two in UTF-16)
    with path.open("rb") as f:
        raw = f.read(limit)
    complete = len(raw) >= size
    encoding = text_encoding(raw) or "utf-8-sig"
    text = strip_ansi(codecs.getincrementaldecoder(encoding)(errors="replace").decode(raw, final=complete))
    if complete:
        return cut(text, budget)
    return f"{text[:budget]}\n[… cut here: the rest of its {size:,} bytes not shown]"


def cut(text: str, budget: int) -> str:
    """``text`` up to ``budget`` characters, the cut marked (a document's text, a transcript)."""
    if len(text) <= budget:
        return text
    return f"{text[:budget]}\n[… cut here: {len(text) - budget:,} more characters not shown]"


def pdf_excerpt(path: Path, budget: int) -> tuple[str, int]:
    """(the text of the PDF at ``path`` up to ``budget`` characters, page by page, with the pages left out
    counted; its number of pages). Refused when it unpacks beyond pypdf's limits, Unreadable when broken.
    The work is bounded (``PDF_MAX_PAGES``, ``PDF_MAX_CONTENT``, ``PDF_READ_SECONDS``): pages past a bound are
    not read, and the text says so."""
    try:
        reader = pypdf.PdfReader(path)
        if reader.is_encrypted and not reader.decrypt(""):
            raise Unreadable("the PDF is encrypted")
        pages = len(reader.pages)
        parts: list[str] = []
        used = 0
        work = 0
        deadline = time.monotonic() + PDF_READ_SECONDS
        for number, page in enumerate(reader.pages, start=1):
            work += _content_bytes(page)
            if number > PDF_MAX_PAGES or work > PDF_MAX_CONTENT or (number > 1 and time.monotonic() > deadline):
                unread = f"page {number}" if number == pages else f"pages {number}–{pages}"
                parts.append(f"[… {unread} not read: the PDF is too long or too complex to read whole]")
                break
            text = (page.extract_text() or "").strip()
            left = budget - used
            if len(text) > left:
                if left > 0:
                    parts.append(f"[Page {number}]\n{text[:left]}\n[… cut here: {len(text) - left:,} more "
                                 "characters of this page not shown]")
                rest = pages - number + (0 if left > 0 else 1)
                if rest:
                    parts.append(f"[… {rest} more page{'s' if rest != 1 else ''} not included]")
                break
            parts.append(f"[Page {number}]\n{text}")
            used += len(text)
        return "\n\n".join(parts), pages
    except LimitReachedError:
        raise Refused("it unpacks to more data than documents may have here") from None
    except Unreadable:
        raise
    except (PyPdfError, ValueError, KeyError, TypeError, AttributeError, OSError, RecursionError) as exc:
        log.info("a PDF could not be read: %s", type(exc).__name__)
        raise Unreadable("the PDF could not be read") from None


def _content_bytes(page: pypdf.PageObject) -> int:
    """The decoded bytes extracting the text of ``page`` parses: its content streams and the form XObjects
    its resources name (nested ones too, each once). Decompressing is fast and bounded by pypdf's limits;
    parsing what it yields is the slow part this measures."""
    seen: set[int] = set()

    def streams(obj: object) -> int:
        obj = obj.get_object() if isinstance(obj, PdfObject) else obj
        if isinstance(obj, ArrayObject):
            return sum(streams(item) for item in obj)
        if isinstance(obj, StreamObject) and id(obj) not in seen:
            seen.add(id(obj))
            return len(obj.get_data()) + forms(obj.get("/Resources"))
        return 0

    def forms(resources: object) -> int:
        resources = resources.get_object() if isinstance(resources, PdfObject) else resources
        if not isinstance(resources, DictionaryObject):
            return 0
        xobjects = resources.get("/XObject")
        xobjects = xobjects.get_object() if isinstance(xobjects, PdfObject) else xobjects
        if not isinstance(xobjects, DictionaryObject):
            return 0
        total = 0
        for ref in xobjects.values():
            xobject = ref.get_object() if isinstance(ref, PdfObject) else ref
            if isinstance(xobject, StreamObject) and xobject.get("/Subtype") == "/Form":  # images: never parsed
                total += streams(xobject)
        return total

    return streams(page.get("/Contents")) + forms(page.get("/Resources"))
