"""Telegram rendering: snapshots → message parts.

While streaming, parts are the plain Markdown source (no parse mode, so a half-written ``**`` can never
make Telegram reject an edit). The final version is rendered by telegramify-markdown into plain text
plus MessageEntity objects — entities instead of a parse mode, so "can't parse entities" cannot happen
on our side; a part whose rendering would not fit, or that Telegram still rejects, goes out as plain text.
"""

from __future__ import annotations

from typing import Any

from telegramify_markdown import convert

from channels.common.ledger import Part
from channels.common.splitter import split_text, utf16_len
from core.snapshot import TurnSnapshot

MESSAGE_LIMIT = 4096
"""Telegram's limit on a message's text, in UTF-16 code units after entity parsing."""


def body(snapshot: TurnSnapshot) -> str:
    """The text a terminal snapshot stands for: the answer, then any notice after a blank line."""
    text = snapshot.text
    if snapshot.error:
        return f"{text}\n\n{snapshot.error}" if text.strip() else snapshot.error
    return text


def stream_parts(text: str, limit: int = MESSAGE_LIMIT) -> list[Part]:
    if not text.strip():
        return []
    return [Part.plain(chunk) for chunk in split_text(text, limit)]


def format_markdown(source: str, limit: int = MESSAGE_LIMIT) -> Part:
    """One chunk of Markdown as Telegram text + entities, or the plain source when that is not possible."""
    try:
        text, entities = convert(source)
    except Exception:  # a renderer bug must never cost the user the answer
        return Part.plain(source)
    if not text.strip() or utf16_len(text) > limit:
        return Part.plain(source)
    return Part(text=text, source=source, formatting=tuple(_entity(e.to_dict()) for e in entities))


def final_parts(snapshot: TurnSnapshot, limit: int = MESSAGE_LIMIT) -> list[Part]:
    text = body(snapshot)
    if not text.strip():
        return []
    return [format_markdown(chunk, limit) for chunk in split_text(text, limit)]


def plain_parts(parts: list[Part]) -> list[Part]:
    return [Part.plain(p.source) for p in parts]


def _entity(data: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    # hashable and comparable; the client turns it back into aiogram's MessageEntity
    return tuple(sorted(data.items()))
