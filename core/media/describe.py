"""Attachments in the words the model is sent (and that stand for them in a compaction summary).

A user message reaches the model as its text followed by one block per attachment: a document's text
between markers, a transcript marked as one, or a one-line description of what was attached and why its
content is not there. Images go as image parts where the model takes them; otherwise, and for the images of
older messages that no longer fit the context, they are described the same way.
"""

from __future__ import annotations

from collections.abc import Iterable

from core.messages import AttachmentRef

_WHAT = {"image": "an image", "text": "a text file", "pdf": "a PDF", "audio": "an audio message",
         "video": "a video", "file": "a file"}


def size_text(size: int | None) -> str:
    if size is None:
        return ""
    if size < 1000:
        return f"{size} bytes"
    if size < 1_000_000:
        return f"{size / 1000:.0f} KB"
    return f"{size / 1_000_000:.1f} MB"


def facts(ref: AttachmentRef) -> str:
    """``name (type, width×height, size)``, with what is known."""
    bits = [b for b in (ref.content_type, f"{ref.width}×{ref.height}" if ref.width and ref.height else "",
                        f"{ref.pages} pages" if ref.pages else "", size_text(ref.size)) if b]
    name = ref.name or "unnamed"
    return f"{name} ({', '.join(bits)})" if bits else name


def image_description(ref: AttachmentRef, *, gone: bool = False) -> str:
    """What the model reads instead of an image it is not shown (``gone``: its file expired)."""
    why = "Its file is no longer available." if gone else "It is not shown to you."
    return f"[The user attached an image: {facts(ref)}. {why}]"


def block(ref: AttachmentRef) -> str | None:
    """The text that carries ``ref`` in its message; None for an image that is to be shown (or described) as
    an image (``image_description``)."""
    if ref.note:
        return f"[The user attached {_WHAT[ref.kind]}: {facts(ref)}. It could not be read: {ref.note}.]"
    if ref.kind == "image":
        return None
    if ref.size == 0 and ref.id is not None:  # nothing to read: not "a file whose content is not shown"
        return f"[The user attached a file: {ref.name or 'unnamed'}. It is empty (0 bytes).]"
    if ref.text is not None and ref.kind == "audio":
        return f"[Voice message, transcribed]\n{ref.text}" if ref.text else "[Voice message: no speech in it]"
    if ref.text is not None:
        label = "PDF" if ref.kind == "pdf" else "file"
        return f"[Attached {label}: {facts(ref)}]\n{ref.text}\n[End of {ref.name or 'the attachment'}]"
    if ref.kind in ("audio", "video"):
        return (f"[The user attached {_WHAT[ref.kind]}: {facts(ref)}. It was not transcribed, so its content "
                "is not available to you.]")
    return f"[The user attached {_WHAT[ref.kind]}: {facts(ref)}. Its content is not shown to you.]"


def with_blocks(content: str, refs: Iterable[AttachmentRef]) -> str:
    """``content`` followed by the blocks of its non-image attachments."""
    blocks = [b for b in (block(r) for r in refs) if b is not None]
    if not blocks:
        return content
    return "\n\n".join([content, *blocks]) if content else "\n\n".join(blocks)


def mention(refs: Iterable[AttachmentRef]) -> str:
    """One line naming attachments (for compaction: the fact that they existed is never dropped)."""
    return "; ".join(f"{_WHAT[r.kind]}: {facts(r)}" for r in refs)
