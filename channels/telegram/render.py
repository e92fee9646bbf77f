"""Telegram rendering: Markdown chunks → message parts.

While streaming, parts are the plain Markdown source (no parse mode, so a half-written ``**`` can never
make Telegram reject an edit). The final version is rendered by telegramify-markdown into plain text
plus MessageEntity objects — entities instead of a parse mode, so "can't parse entities" cannot happen
on our side; a part whose rendering would not fit, or that Telegram still rejects, goes out as plain text.
Splitting under the limit is the shared live sink's (``channels.common.splitter``).

A rendering that lost words goes out as plain text too: telegramify-markdown drops an HTML block inside a
list item ("- <summary>Details</summary>" rendered as an empty bullet). Every word of the source must be in
the rendered text or in an entity (a link's URL, a code block's language); when one is not, pyromark's
parse of the source says which words Markdown shows at all (not tag names, closed comments, a code fence's
info string, a reference definition), and the rendering stands only if each of those is in it.
"""

from __future__ import annotations

import re
import string
from typing import Any

import pyromark
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
    formatting = tuple(_entity(e.to_dict()) for e in entities)
    shown = " ".join([text, *(str(v) for e in formatting for k, v in e if k in ("url", "language"))])
    if not keeps_every_word(source, shown):
        return Part.plain(source)
    return Part(text=text, source=source, formatting=formatting)


_WORD = re.compile(r"[^\W_]+")
"""A word: letters and digits (an underscore is Markdown's emphasis as often as a word's)."""
_SPACED = str.maketrans(dict.fromkeys(string.punctuation, " "))
_OPTIONS = pyromark.Options.ENABLE_TABLES | pyromark.Options.ENABLE_STRIKETHROUGH | pyromark.Options.ENABLE_TASKLISTS
_HIDDEN_HTML = re.compile(r"<!--.*?-->|<[^>]*>", re.DOTALL)
"""What a browser does not show of raw HTML: closed comments and the tags themselves."""


def keeps_every_word(source: str, shown: str) -> bool:
    """Whether ``shown`` (a rendering's text, its links' URLs and code blocks' languages) has every word
    Markdown shows of ``source``. Most renderings have every word of the source itself, which is checked first
    (the source's words a subset of the rendering's, cheap for every final part); only when that fails is the
    source parsed."""
    if set(source.translate(_SPACED).split()).issubset(shown.translate(_SPACED).split()):
        return True
    return all(word in shown for word in _visible_words(source))


def _visible_words(source: str) -> set[str]:
    words: set[str] = set()
    for event in pyromark.events(source, options=_OPTIONS):
        if not isinstance(event, dict):
            continue
        (kind, value), = event.items()
        if kind in ("Text", "Code"):
            words.update(_WORD.findall(str(value)))
        elif kind == "Html":  # a block of raw HTML (inline tags are ``InlineHtml``: never shown)
            words.update(_WORD.findall(_HIDDEN_HTML.sub(" ", str(value))))
        elif kind == "Start" and isinstance(value, dict) and ("Link" in value or "Image" in value):
            link = value.get("Link") or value.get("Image") or {}
            words.update(_WORD.findall(str(link.get("dest_url", ""))))
    return words


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
