"""What the model can read of a stored file: image limits and a scaled copy, document and PDF text.

Every function here blocks (Pillow, pypdf, file reads) and is run in a worker thread by the caller.

- Images: the dimensions come from the header (Pillow's ``open`` decodes no pixels), so an image that would
  unpack into more than ``max_pixels`` pixels (a decompression bomb: a few kilobytes of PNG that inflate to
  gigabytes) is refused before anything is decoded. An image too large for a model request (more than
  ``MODEL_MAX_SIDE`` pixels on a side, or more bytes than Anthropic takes per image) gets a scaled copy.
- Text: decoded (UTF-8, or UTF-16 by its BOM) up to a character budget; a cut is marked.
- PDF: pypdf extracts the text of each page until the budget is used, and says how many pages were left out.
  pypdf's own limits refuse streams that decompress beyond what any real document needs.
"""

from __future__ import annotations

import codecs
import logging
from dataclasses import dataclass
from pathlib import Path

import pypdf
from PIL import Image, ImageOps, UnidentifiedImageError
from pypdf.errors import LimitReachedError, PyPdfError

log = logging.getLogger(__name__)

MODEL_MAX_SIDE = 2048
"""Longest side of an image sent to a model; larger ones are scaled (the APIs scale below this anyway)."""
MODEL_MAX_BYTES = 3_750_000
"""Bytes of an image sent to a model (Anthropic takes at most 5 MB of base64 per image)."""


class Refused(Exception):
    """The file is not kept: it is unsafe to open (``str`` is a few words for the user and the model)."""


class Unreadable(Exception):
    """The file is kept, but its content cannot be read (a broken or encrypted document)."""


@dataclass(frozen=True, slots=True)
class ImageFacts:
    width: int
    height: int


def image_facts(path: Path, max_pixels: int) -> ImageFacts:
    """The dimensions of the image at ``path``, read from its header; Refused past ``max_pixels``."""
    try:
        with Image.open(path) as img:
            width, height = img.size
    except Image.DecompressionBombError:
        raise Refused("it has more pixels than images may have here") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError):
        raise Unreadable("the image could not be read") from None
    if width * height > max_pixels:
        raise Refused(f"{width}×{height} pixels is more than the {max_pixels // 1_000_000} megapixels "
                      "images may have here")
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
    if raw.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        encoding = "utf-16"
    else:
        encoding = "utf-8-sig"
    text = codecs.getincrementaldecoder(encoding)(errors="replace").decode(raw, final=complete)
    if complete and len(text) <= budget:
        return text
    shown = text[:budget]
    rest = f"{len(text) - budget:,} more characters" if complete else f"the rest of its {size:,} bytes"
    return f"{shown}\n[… cut here: {rest} not shown]"


def pdf_excerpt(path: Path, budget: int) -> tuple[str, int]:
    """(the text of the PDF at ``path`` up to ``budget`` characters, page by page, with the pages left out
    counted; its number of pages). Refused when it unpacks beyond pypdf's limits, Unreadable when broken."""
    try:
        reader = pypdf.PdfReader(path)
        if reader.is_encrypted and not reader.decrypt(""):
            raise Unreadable("the PDF is encrypted")
        pages = len(reader.pages)
        parts: list[str] = []
        used = 0
        for number, page in enumerate(reader.pages, start=1):
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
