"""Slack rendering: a reply's Markdown → what Slack shows well, in parts that fit Slack's limits.

What Slack accepts (its method and Block Kit reference):
- ``text`` is Slack *mrkdwn*, not Markdown: ``*bold*``, ``_italic_``, ``~strike~``, ``<url|label>``, code and
  quotes, no headings, no tables, and ``&``, ``<``, ``>`` must be escaped. ``chat.update`` refuses a ``text``
  over 4,000 characters (``msg_too_long``); ``chat.postMessage`` cuts one over 40,000.
- a ``markdown`` block (and ``markdown_text``, which Slack stores as one) takes standard Markdown and Slack
  renders it; all markdown blocks of one payload together hold at most 12,000 characters. Tables are not
  among the syntax Slack documents for it everywhere, so a table is never left to it.

The approach: every part of a reply is cut from the Markdown source (``channels.common.splitter``, code
fences closed and reopened) so that its mrkdwn rendering stays within 4,000 UTF-16 units — UTF-16 because
Slack counts in JavaScript string units and that is never less than the character count — which makes every
part updatable with ``chat.update`` at any time. A final part goes out as a ``markdown`` block (Slack's own
Markdown rendering) with the mrkdwn rendering as ``text`` (the notification and accessibility fallback);
if a workspace refuses the block, the same part as mrkdwn ``text`` alone shows the same words. While a reply
streams, parts are mrkdwn ``text`` only (cheap, and never refused for its formatting). GFM tables become an
aligned monospace code block in both forms.

The mrkdwn renderer walks markdown-it-py's token stream (CommonMark with tables and strikethrough, raw HTML
shown as text). No Markdown→mrkdwn package on PyPI fits: the candidates convert with regular expressions
(fragile on nested emphasis, code and lists) or are barely maintained, while markdown-it-py is the well-kept
parser, so only the small token→mrkdwn mapping is written here. Model text can never ping anyone: ``<``
is escaped, so ``<!channel>`` or ``<@U…>`` from the model shows as text.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from typing import Any

from markdown_it import MarkdownIt
from markdown_it.token import Token

from channels.common.ledger import Part
from channels.common.splitter import split_text, utf16_len

TEXT_LIMIT = 4000
"""``chat.update``: the ``text`` field cannot exceed 4,000 characters."""
MARKDOWN_BLOCK_LIMIT = 12000
"""All ``markdown`` blocks of one payload together; also ``markdown_text`` of one stream call."""
POST_TEXT_LIMIT = 40000
"""``chat.postMessage`` truncates ``text`` beyond this (with a ``message_truncated`` warning)."""

_BULLETS = ("•", "◦", "▪")
_ZWSP = "\u200b"  # lets a mrkdwn marker touch a letter: Slack only honours markers at word boundaries
_HR = "———"
_SPECIAL = re.compile(r"<([!@#])")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def escape(text: str) -> str:
    """Escape the three characters mrkdwn treats as control characters."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _parser() -> MarkdownIt:
    return MarkdownIt("commonmark", {"html": False}).enable(["table", "strikethrough"])


def _display_width(text: str) -> int:
    width = 0
    for ch in text:
        if unicodedata.combining(ch):
            continue
        width += 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1
    return width


def _pad(text: str, width: int, align: str) -> str:
    gap = width - _display_width(text)
    if align == "right":
        return " " * gap + text
    if align == "center":
        return " " * (gap // 2) + text + " " * (gap - gap // 2)
    return text + " " * gap


def _plain(inline: Token) -> str:
    """The words of an inline token, markup dropped (table cells in a monospace block)."""
    out = []
    for child in inline.children or []:
        if child.type in ("text", "code_inline", "html_inline"):
            out.append(child.content)
        elif child.type in ("softbreak", "hardbreak"):
            out.append(" ")
        elif child.type == "image":
            out.append(child.content)
    return "".join(out).strip()


def _table(tokens: list[Token], i: int) -> tuple[str, int]:
    """Render the table opening at ``tokens[i]`` as aligned monospace rows; returns (text, index after it)."""
    rows: list[list[str]] = []
    aligns: list[str] = []
    row: list[str] = []
    while tokens[i].type != "table_close":
        tok = tokens[i]
        if tok.type == "tr_open":
            row = []
        elif tok.type in ("th_open", "td_open"):
            if tok.type == "th_open":
                style = str(tok.attrGet("style") or "")
                aligns.append(style.split(":")[-1] if "text-align" in style else "left")
            row.append(_plain(tokens[i + 1]))
        elif tok.type == "tr_close":
            rows.append(row)
        i += 1
    columns = max((len(r) for r in rows), default=0)
    rows = [r + [""] * (columns - len(r)) for r in rows]
    aligns += ["left"] * (columns - len(aligns))
    widths = [max(_display_width(r[c]) for r in rows) for c in range(columns)]
    lines = [" | ".join(_pad(cell, widths[c], aligns[c]) for c, cell in enumerate(r)).rstrip() for r in rows]
    if lines:
        lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines), i + 1


def tables_as_code(markdown: str) -> str:
    """``markdown`` with every top-level GFM table replaced by a fenced, aligned monospace block."""
    if "|" not in markdown:
        return markdown
    tokens = _parser().parse(markdown)
    lines = markdown.split("\n")
    replacements: list[tuple[int, int, str]] = []
    for i, tok in enumerate(tokens):
        if tok.type == "table_open" and tok.level == 0 and tok.map is not None:
            text, _ = _table(tokens, i)
            replacements.append((tok.map[0], tok.map[1], f"```\n{text}\n```"))
    for start, end, text in reversed(replacements):
        lines[start:end] = [text]
    return "\n".join(lines)


def defuse(markdown: str) -> str:
    """``markdown`` for a ``markdown`` block, with Slack's special sequences (``<!channel>``, ``<@U…>``,
    ``<#C…>``) broken by an invisible space outside code blocks, so model text cannot ping anyone."""
    if "<" not in markdown:
        return markdown
    out, fence = [], ""
    for line in markdown.split("\n"):
        m = _FENCE.match(line)
        if m and (not fence or (m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence))):
            fence = "" if fence else m.group(1)
        elif not fence:
            line = _SPECIAL.sub("<" + _ZWSP + r"\1", line)
        out.append(line)
    return "\n".join(out)


class MrkdwnRenderer:
    """Markdown → Slack mrkdwn, from markdown-it-py's token stream."""

    def __init__(self) -> None:
        self._md = _parser()

    def render(self, markdown: str) -> str:
        blocks, _ = self._blocks(self._md.parse(markdown), 0, None, 0)
        return "\n\n".join(text for text, _ in blocks).strip("\n")

    # ---- blocks ----

    def _blocks(self, tokens: list[Token], i: int, end: str | None, depth: int) -> tuple[list[tuple[str, bool]], int]:
        """Rendered blocks (text, is_list) from ``tokens[i]`` up to the token of type ``end``."""
        out: list[tuple[str, bool]] = []
        while i < len(tokens) and tokens[i].type != end:
            tok = tokens[i]
            kind = tok.type
            if kind == "paragraph_open":
                out.append((self._inline(tokens[i + 1]), False))
                i += 3
            elif kind == "heading_open":
                title = self._inline(tokens[i + 1], in_bold=True)
                out.append((f"*{title}*" if title.strip() else title, False))
                i += 3
            elif kind in ("bullet_list_open", "ordered_list_open"):
                text, i = self._list(tokens, i, depth)
                out.append((text, True))
            elif kind == "blockquote_open":
                inner, i = self._blocks(tokens, i + 1, "blockquote_close", depth)
                body = "\n".join(text for text, _ in inner)
                out.append(("\n".join(f"> {line}" if line else ">" for line in body.split("\n")), False))
                i += 1
            elif kind in ("fence", "code_block"):
                out.append((self._code(tok.content), False))
                i += 1
            elif kind == "table_open":
                text, i = _table(tokens, i)
                out.append((self._code(text + "\n"), False))
            elif kind == "hr":
                out.append((_HR, False))
                i += 1
            elif kind == "html_block":
                out.append((escape(tok.content.rstrip("\n")), False))
                i += 1
            else:
                i += 1
        return out, i

    @staticmethod
    def _code(content: str) -> str:
        body = escape(content).replace("```", "`" + _ZWSP + "``")
        if body and not body.endswith("\n"):
            body += "\n"
        return f"```\n{body}```"

    def _list(self, tokens: list[Token], i: int, depth: int) -> tuple[str, int]:
        ordered = tokens[i].type == "ordered_list_open"
        close = "ordered_list_close" if ordered else "bullet_list_close"
        number = int(tokens[i].attrGet("start") or 1)
        indent = "    " * depth
        lines: list[str] = []
        i += 1
        while tokens[i].type != close:
            marker = f"{number}." if ordered else _BULLETS[depth % len(_BULLETS)]
            inner, i = self._blocks(tokens, i + 1, "list_item_close", depth + 1)
            i += 1  # list_item_close
            first = True
            for text, is_list in inner:
                if is_list:
                    if first:
                        lines.append(f"{indent}{marker}")
                    lines.append(text)
                else:
                    for line in text.split("\n"):
                        lines.append(f"{indent}{marker} {line}" if first else f"{indent}   {line}")
                        first = False
                first = False
            if not inner:
                lines.append(f"{indent}{marker}")
            number += 1
        return "\n".join(lines), i + 1

    # ---- inline ----

    def _inline(self, inline: Token, *, in_bold: bool = False) -> str:
        return self._children(inline.children or [], in_bold)

    def _children(self, children: list[Token], in_bold: bool) -> str:
        out: list[str] = []

        def marker(mark: str, opening: bool, nxt: Token | None) -> None:
            if opening:
                if out and out[-1] and out[-1][-1].isalnum():
                    out.append(_ZWSP)
                out.append(mark)
            else:
                out.append(mark)
                if nxt is not None and nxt.type == "text" and nxt.content[:1].isalnum():
                    out.append(_ZWSP)

        i = 0
        while i < len(children):
            tok = children[i]
            nxt = children[i + 1] if i + 1 < len(children) else None
            kind = tok.type
            if kind == "text" or kind == "html_inline":
                out.append(escape(tok.content))
            elif kind in ("softbreak", "hardbreak"):
                out.append("\n")
            elif kind == "code_inline":
                marker("`", True, None)
                out.append(escape(tok.content))
                marker("`", False, nxt)
            elif kind in ("strong_open", "strong_close"):
                if not in_bold:
                    marker("*", kind == "strong_open", nxt)
            elif kind in ("em_open", "em_close"):
                marker("_", kind == "em_open", nxt)
            elif kind in ("s_open", "s_close"):
                marker("~", kind == "s_open", nxt)
            elif kind == "link_open":
                depth, j = 1, i + 1
                while j < len(children) and depth:
                    depth += {"link_open": 1, "link_close": -1}.get(children[j].type, 0)
                    j += 1
                label = self._children(children[i + 1:j - 1], in_bold)
                out.append(_link(str(tok.attrGet("href") or ""), label))
                i = j
                continue
            elif kind == "image":
                out.append(_link(str(tok.attrGet("src") or ""), escape(tok.content)))
            i += 1
        return "".join(out)


def _link(url: str, label: str) -> str:
    target = escape(url).replace("|", "%7C")
    if not label or label == escape(url):
        return f"<{target}>"
    if "|" in label:  # mrkdwn has no escape for "|" inside a link label
        return f"{label} (<{target}>)"
    return f"<{target}|{label}>"


_renderer = MrkdwnRenderer()


def to_mrkdwn(markdown: str) -> str:
    return _renderer.render(markdown)


@dataclass(frozen=True, slots=True)
class SlackPart:
    """One message's worth of a reply, in both forms Slack takes."""

    source: str
    """The Markdown chunk this part was cut from."""
    mrkdwn: str
    """Its mrkdwn rendering: the ``text`` (at most ``TEXT_LIMIT`` UTF-16 units)."""
    markdown: str
    """What goes into the ``markdown`` block: the chunk with tables as code blocks, mentions defused."""

    def message(self, *, rich: bool) -> dict[str, Any]:
        """Keyword arguments for ``chat_postMessage`` / ``chat_update``: the markdown block with the mrkdwn
        fallback when ``rich``, else the mrkdwn text alone (which also drops blocks an update replaces)."""
        if rich:
            return {"text": self.mrkdwn, "blocks": [{"type": "markdown", "text": self.markdown}]}
        return {"text": self.mrkdwn}


def render_parts(markdown: str, limit: int = TEXT_LIMIT) -> list[SlackPart]:
    """``markdown`` split into parts whose mrkdwn fits ``limit`` and whose markdown block fits Slack's 12,000.

    Escaping can make a rendering longer than its source, so a chunk that renders too long is cut again
    with a proportionally smaller budget; nothing is ever truncated."""
    if not markdown.strip():
        return []
    source = tables_as_code(markdown)
    parts: list[SlackPart] = []
    pending = split_text(source, limit, measure=utf16_len)
    pending.reverse()
    while pending:
        chunk = pending.pop()
        rendered = to_mrkdwn(chunk)
        size = utf16_len(rendered)
        if (size <= limit and utf16_len(chunk) <= MARKDOWN_BLOCK_LIMIT) or utf16_len(chunk) <= 16:
            if rendered.strip():
                parts.append(SlackPart(chunk, rendered, defuse(chunk)))
            continue
        budget = max(16, min(utf16_len(chunk) - 1, utf16_len(chunk) * limit // max(size, 1) - 8))
        pending.extend(reversed(split_text(chunk, budget, measure=utf16_len)))
    return parts


def stream_pieces(delta: str, limit: int = MARKDOWN_BLOCK_LIMIT) -> list[str]:
    """``delta`` cut into consecutive pieces of at most ``limit`` UTF-16 units for ``chat.appendStream``.

    Unlike ``split_text`` this never adds or drops a character (appends concatenate on Slack's side), and it
    never splits a surrogate pair."""
    pieces: list[str] = []
    start, size = 0, 0
    for index, ch in enumerate(delta):
        units = 2 if ord(ch) > 0xFFFF else 1
        if size + units > limit:
            pieces.append(delta[start:index])
            start, size = index, 0
        size += units
    if start < len(delta):
        pieces.append(delta[start:])
    return pieces


def stream_delta(shown: str, target: str) -> str | None:
    """What to append to a native stream that shows ``shown`` so that it shows ``target``; None when
    ``target`` does not extend ``shown`` (the text was rewritten: the stream must be finished by an edit)."""
    if not target.startswith(shown):
        return None
    return target[len(shown):]


PART_LIMIT = 3500
"""The Markdown source of one message part, in UTF-16 units: its mrkdwn rendering nearly always stays within
``TEXT_LIMIT`` (escaping rarely adds 500), and ``SlackRenderer`` has a same-length fallback when it does not."""

_LOOKALIKE = str.maketrans({"&": "＆", "<": "＜", ">": "＞"})


def safe_mrkdwn(source: str) -> str:
    """The mrkdwn rendering of ``source`` when it fits ``TEXT_LIMIT``; else the source itself with mrkdwn's three
    control characters replaced by look-alikes, which keeps every word, never pings, and is no longer than the
    source (a part's source is at most ``PART_LIMIT`` units)."""
    rendered = to_mrkdwn(source)
    if utf16_len(rendered) <= TEXT_LIMIT:
        return rendered
    return source.translate(_LOOKALIKE)


class SlackRenderer:
    """The live sink's ``Renderer`` for Slack (``channels.common.ops``): a part's ``text`` is mrkdwn; a final part
    also carries a ``markdown`` block (``formatting``: ``(("markdown", text),)``) that Slack renders itself."""

    def stream_part(self, source: str) -> Part:
        return Part(text=safe_mrkdwn(source), source=source)

    def final_part(self, source: str) -> Part:
        return Part(text=safe_mrkdwn(source), source=source,
                    formatting=(("markdown", defuse(tables_as_code(source))),))

    def plain_part(self, source: str) -> Part:
        return Part(text=safe_mrkdwn(source), source=source)


def message_args(part: Part) -> dict[str, Any]:
    """Keyword arguments for ``chat_postMessage`` / ``chat_update`` showing ``part`` (text alone also removes
    the blocks an earlier version of the message had)."""
    blocks = [{"type": "markdown", "text": value} for kind, value in part.formatting if kind == "markdown"]
    if blocks:
        return {"text": part.text, "blocks": blocks}
    return {"text": part.text}
