"""Feishu/Lark rendering: model Markdown → the markdown element of a CardKit JSON 2.0 card, and → ``post``
message content for plain sends; splitting a long reply into card-sized parts.

Card markdown (JSON 2.0 rich text) renders standard CommonMark and GFM tables, so the model's Markdown goes
through nearly as written. What must change, found by parsing it (pyromark gives every event's source
range, so the rewrite touches only those spans):

- Raw HTML is neutralised (``<`` → ``&#60;``, the escape Feishu documents): card markdown interprets tags
  such as ``<at id=all></at>`` (notifies everyone), ``<font>``, ``<person>``, ``<link>``; a model must not
  be able to produce them.
- Images become links: a card image needs an ``img_key`` uploaded by the app, and an unknown one makes
  the whole card fail (200570).
- At most four tables render per markdown element; any further table is shown as a code block (nothing
  is dropped).

Sizes: a card is at most 30 KB (200860 / 230025), at most 200 elements, and one element content update at
most 100,000 characters. A reply is split (``channels.common.splitter.split_text``: paragraph, line,
sentence boundaries; code fences closed and reopened) so that each part, JSON-encoded, stays within
``CARD_PART_BYTES``, leaving the rest of the card's budget to its other elements (tool activity, approval
requests, the "continued" note).

``post`` content is built from the same parse as structured nodes (``text`` with styles, ``a``,
``code_block``, ``hr``): text nodes are literal, so nothing in the model's text can become an @mention,
and a link is sent as a link only with an http(s) address (Feishu refuses the message otherwise).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pyromark

from channels.common.splitter import split_text

CARD_BYTES = 30 * 1024
"""A card's JSON, at most (Feishu: 30 KB)."""
CARD_ELEMENTS = 200
TABLES_PER_ELEMENT = 4
ELEMENT_CONTENT_CHARS = 100_000
"""Characters of one streaming element content update."""
TEXT_BYTES = 150 * 1024
POST_BYTES = 30 * 1024
CARD_PART_BYTES = 24 * 1024
"""JSON-encoded bytes of the answer markdown of one card; the other ~6 KB are for its other elements."""
POST_PART_BYTES = 20 * 1024
"""JSON-encoded bytes of the Markdown source of one post; node overhead is checked after rendering."""

_OPTIONS = (pyromark.Options.ENABLE_TABLES | pyromark.Options.ENABLE_STRIKETHROUGH
            | pyromark.Options.ENABLE_TASKLISTS)
_ESCAPED_LT = "&#60;"
# code_block languages Feishu names for posts; any other language is left out rather than risk a refusal
_POST_LANGUAGES = frozenset({
    "PYTHON", "C", "CPP", "GO", "JAVA", "KOTLIN", "SWIFT", "PHP", "RUBY", "RUST", "JAVASCRIPT", "TYPESCRIPT",
    "BASH", "SHELL", "SQL", "JSON", "XML", "YAML", "HTML", "THRIFT"})
_LANGUAGE_ALIASES = {"PY": "PYTHON", "JS": "JAVASCRIPT", "TS": "TYPESCRIPT", "SH": "SHELL", "C++": "CPP",
                     "GOLANG": "GO", "YML": "YAML", "RS": "RUST", "RB": "RUBY"}


def json_bytes(text: str) -> int:
    """UTF-8 bytes of ``text`` as a JSON string body (what it adds to a card or post, quotes excluded)."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8")) - 2


def card_measure(text: str) -> int:
    """An upper bound of ``json_bytes(card_markdown(text))``, cheap enough for the splitter's search: every
    ``<`` counted as its escape, which only raw HTML needs."""
    return json_bytes(text) + (len(_ESCAPED_LT) - 1) * text.count("<")


def _events(source: str) -> Iterator[tuple[Any, int, int]]:
    for event, span in pyromark.events_with_range(source, options=_OPTIONS):
        yield event, span["start"], span["end"]


def _kind(event: Any) -> tuple[str, Any]:
    """("Start"|"End"|…, the tag) of a pyromark event, whatever its shape."""
    if isinstance(event, str):
        return event, None
    (key, value), = event.items()
    return str(key), value


def _tag(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return str(next(iter(value)))
    return ""


def card_markdown(source: str) -> str:
    """``source`` as a card markdown element's content (see the module docstring)."""
    edits: list[tuple[int, int, bytes]] = []
    raw = source.encode("utf-8")
    tables = 0
    depth = 0  # inside a list or a block quote: a table there is left as it is
    for event, start, end in _events(source):
        kind, value = _kind(event)
        tag = _tag(value)
        if kind in ("InlineHtml", "Html"):
            edits.append((start, end, raw[start:end].replace(b"<", _ESCAPED_LT.encode())))
        elif kind == "Start" and tag == "Image" and raw[start:start + 1] == b"!":
            edits.append((start, start + 1, b""))
        elif kind == "Start" and tag in ("List", "BlockQuote", "Item"):
            depth += 1
        elif kind == "End" and tag in ("List", "BlockQuote", "Item"):
            depth -= 1
        elif kind == "Start" and tag == "Table":
            tables += 1
            if tables > TABLES_PER_ELEMENT and depth == 0:
                body = raw[start:end].rstrip(b"\n")
                fence = b"`" * max(3, _longest_run(body, ord("`")) + 1)
                edits.append((start, start + len(body), fence + b"\n" + body + b"\n" + fence))
    if not edits:
        return source
    out = bytearray(raw)
    for start, end, replacement in sorted(edits, reverse=True):
        out[start:end] = replacement
    return out.decode("utf-8")


def _longest_run(data: bytes, char: int) -> int:
    best = run = 0
    for byte in data:
        run = run + 1 if byte == char else 0
        best = max(best, run)
    return best


def _fit(source: str, budget: int, measure: Callable[[str], int], fits: Callable[[str], bool]) -> list[str]:
    """Split ``source`` by ``measure``; while a rendered part still does not fit (expansions the cheap measure
    cannot see, e.g. many extra tables fenced, or a post's per-node overhead), split again smaller."""
    limit = budget
    while True:
        parts = split_text(source, limit, measure=measure) if source.strip() else []
        if all(fits(p) for p in parts) or limit <= 256:
            return parts
        limit = limit * 3 // 4


def card_parts(source: str, budget: int = CARD_PART_BYTES) -> list[str]:
    """The reply split into card markdown contents, each within ``budget`` JSON bytes once rendered."""
    parts = _fit(source, budget, card_measure, lambda p: json_bytes(card_markdown(p)) <= budget)
    return [card_markdown(p) for p in parts]


# ---- post ---------------------------------------------------------------------------------------------

Node = dict[str, Any]


class _PostBuilder:
    def __init__(self) -> None:
        self.paragraphs: list[list[Node]] = []
        self.line: list[Node] = []
        self.styles: list[str] = []
        self.quotes = 0
        self.items: list[list[Any]] = []
        """Open list items, outermost first: [marker, whether its first line was written]."""
        self.link: tuple[str, list[str]] | None = None
        self.list_numbers: list[int | None] = []

    @property
    def nested(self) -> bool:
        return bool(self.quotes or self.items)

    def _start_line(self) -> None:
        if self.line:
            return
        prefix = "> " * self.quotes
        if self.items:
            marker, started = self.items[-1]
            prefix += "    " * (len(self.items) - 1) + (" " * len(marker) if started else marker)
            self.items[-1][1] = True
        if prefix:
            self.line.append({"tag": "text", "text": prefix})

    def text(self, text: str) -> None:
        if not text:
            return
        if self.link is not None:
            self.link[1].append(text)
            return
        self._start_line()
        node: Node = {"tag": "text", "text": text}
        if self.styles:
            node["style"] = sorted(set(self.styles))
        self.line.append(node)

    def anchor(self, href: str, label: str) -> None:
        self._start_line()
        self.line.append({"tag": "a", "href": href, "text": label})

    def newline(self) -> None:
        if self.line:
            self.paragraphs.append(self.line)
        self.line = []

    def block(self, node: Node) -> None:
        self.newline()
        self.paragraphs.append([node])

    def gap(self) -> None:
        """A blank line between top-level blocks (a post has no paragraph spacing of its own)."""
        self.newline()
        if self.paragraphs and self.paragraphs[-1] != [{"tag": "text", "text": ""}]:
            self.paragraphs.append([{"tag": "text", "text": ""}])


def _post_language(info: str) -> str | None:
    word = info.strip().split(" ")[0].upper() if info.strip() else ""
    word = _LANGUAGE_ALIASES.get(word, word)
    return word if word in _POST_LANGUAGES else None


def post_paragraphs(source: str) -> list[list[Node]]:
    """Markdown → the paragraphs (lists of nodes) of a post's ``content``."""
    b = _PostBuilder()
    raw = source.encode("utf-8")
    code: tuple[str | None, list[str]] | None = None
    table: int | None = None
    for event, start, end in _events(source):
        kind, value = _kind(event)
        tag = _tag(value)
        if table is not None:
            if kind == "End" and tag == "Table":
                b.block({"tag": "code_block", "text": raw[table:end].decode("utf-8").rstrip("\n")})
                if not b.nested:
                    b.gap()
                table = None
            continue
        if code is not None:
            if kind == "End" and tag == "CodeBlock":
                node: Node = {"tag": "code_block", "text": "".join(code[1]).rstrip("\n")}
                if code[0]:
                    node["language"] = code[0]
                b.block(node)
                if not b.nested:
                    b.gap()
                code = None
            elif kind == "Text":
                code[1].append(value)
            continue
        if kind == "Start":
            if tag == "CodeBlock":
                info = value["CodeBlock"]
                fenced = info.get("Fenced") if isinstance(info, dict) else None
                code = (_post_language(fenced) if fenced else None, [])
            elif tag == "Table":
                table = start
            elif tag in ("Strong", "Emphasis", "Strikethrough"):
                b.styles.append({"Strong": "bold", "Emphasis": "italic", "Strikethrough": "lineThrough"}[tag])
            elif tag == "Heading":
                b.styles.append("bold")
            elif tag in ("Link", "Image"):
                b.link = (str(value[tag].get("dest_url", "")), [])
            elif tag == "List":
                b.list_numbers.append(value["List"])
            elif tag == "Item":
                b.newline()
                number = b.list_numbers[-1] if b.list_numbers else None
                b.items.append([f"{number}. " if number is not None else "• ", False])
                if number is not None:
                    b.list_numbers[-1] = number + 1
            elif tag == "BlockQuote":
                b.quotes += 1
        elif kind == "End":
            if tag in ("Strong", "Emphasis", "Strikethrough", "Heading") and b.styles:
                b.styles.pop()
            if tag in ("Link", "Image") and b.link is not None:
                href, words = b.link
                b.link = None
                label = "".join(words) or href
                if href.startswith(("http://", "https://")):
                    b.anchor(href, label)
                else:
                    b.text(label if not href or href == label else f"{label} ({href})")
            elif tag == "Item":
                b.newline()
                b.items.pop()
            elif tag == "List":
                b.list_numbers.pop()
                if not b.list_numbers:
                    b.gap()
            elif tag == "BlockQuote":
                b.quotes -= 1
                if not b.nested:
                    b.gap()
            elif tag in ("Paragraph", "Heading", "HtmlBlock"):
                b.newline()
                if not b.nested:
                    b.gap()
        elif kind == "Html":
            b.text(str(value).rstrip("\n"))
            b.newline()
        elif kind in ("Text", "InlineHtml"):
            b.text(str(value))
        elif kind == "Code":
            b.text(f"`{value}`")
        elif kind in ("SoftBreak", "HardBreak"):
            b.newline()
        elif kind == "Rule":
            b.block({"tag": "hr"})
            b.gap()
        elif kind == "TaskListMarker":
            b.text("[x] " if value else "[ ] ")
    b.newline()
    while b.paragraphs and b.paragraphs[-1] == [{"tag": "text", "text": ""}]:
        b.paragraphs.pop()
    return b.paragraphs


def post_content(source: str, *, title: str = "") -> str:
    """One post message's ``content`` (a JSON string) for a chunk of Markdown."""
    return json.dumps({"zh_cn": {"title": title, "content": post_paragraphs(source)}}, ensure_ascii=False)


def plain_post_content(text: str, *, title: str = "") -> str:
    """A post showing ``text`` exactly, line by line, with no Markdown interpretation (notices, errors)."""
    lines = [[{"tag": "text", "text": line}] for line in text.split("\n")]
    return json.dumps({"zh_cn": {"title": title, "content": lines}}, ensure_ascii=False)


def post_sources(source: str, budget: int = POST_PART_BYTES, limit: int = POST_BYTES) -> list[str]:
    """The reply split into Markdown chunks whose post content is each within Feishu's 30 KB."""
    return _fit(source, budget, json_bytes, lambda p: len(post_content(p).encode("utf-8")) <= limit)


def post_parts(source: str, budget: int = POST_PART_BYTES, limit: int = POST_BYTES) -> list[str]:
    """The reply as post contents (JSON strings), each within Feishu's 30 KB."""
    return [post_content(p) for p in post_sources(source, budget, limit)]
