"""Telegram rendering: Markdown chunks → message parts.

While streaming, parts are the plain Markdown source (no parse mode, so a half-written ``**`` can never
make Telegram reject an edit). The final version is rendered by telegramify-markdown into plain text
plus MessageEntity objects — entities instead of a parse mode, so "can't parse entities" cannot happen
on our side; a part whose rendering would not fit, or that Telegram still rejects, goes out as plain text.
Splitting under the limit is the shared live sink's (``channels.common.splitter``).
"""

from __future__ import annotations

from typing import Any

from telegramify_markdown import convert

from channels.common.ledger import Part
from channels.common.splitter import utf16_len

MESSAGE_LIMIT = 4096
"""Telegram's limit on a message's text, in UTF-16 code units after entity parsing."""


def format_markdown(source: str, limit: int = MESSAGE_LIMIT) -> Part:
    """One chunk of Markdown as Telegram text + entities, or the plain source when that is not possible."""
    try:
        text, entities = convert(source)
    except Exception:  # a renderer bug must never cost the user the answer
        return Part.plain(source)
    if not text.strip() or utf16_len(text) > limit:
        return Part.plain(source)
    return Part(text=text, source=source, formatting=tuple(_entity(e.to_dict()) for e in entities))


class TelegramRenderer:
    def __init__(self, limit: int = MESSAGE_LIMIT) -> None:
        self.limit = limit

    def stream_part(self, source: str) -> Part:
        return Part.plain(source)

    def final_part(self, source: str) -> Part:
        return format_markdown(source, self.limit)

    def plain_part(self, source: str) -> Part:
        return Part.plain(source)


def _entity(data: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    # hashable and comparable; the client turns it back into aiogram's MessageEntity
    return tuple(sorted(data.items()))
