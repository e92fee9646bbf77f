"""Split a Markdown reply into parts that each fit a platform's message limit, in time linear in its length.

Cuts prefer a paragraph break, then a line break, then a sentence end, then any whitespace, and only
then fall back to a hard cut. A fenced code block cut by a split is closed at the end of its part and
reopened (same fence line, language included) at the start of the next, so every part renders on its
own. Nothing is dropped except the whitespace at the cut itself.

Length is measured by a pluggable function: Telegram counts UTF-16 code units, Slack characters, Feishu
bytes. Every unit function counts at least one unit per character, so a part never holds more than
``limit`` characters: each cut is searched in a window of that size from where the part starts, and the
text after it is never measured or copied as a whole (the cost is linear in the reply's length).
``split`` can start anywhere in the text (``start``, with the fence ``reopen``ed there), which is how a
live sink re-splits only the unfinished tail of a reply it is streaming.

(telegramify-markdown can split rendered text too, but only on newlines and without re-fencing code, and
the splitting has to work on the Markdown source for every platform, so it lives here.)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

Measure = Callable[[str], int]


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units (how Telegram counts message length and entity offsets)."""
    if text.isascii():
        return len(text)
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


_FENCE_RE = re.compile(r"^ {0,3}(`{3,}|~{3,})(.*)$")
# Boundaries by preference; each regex matches the separator that is dropped at the cut.
_BOUNDARIES = (
    re.compile(r"\n[ \t]*\n\s*"),          # paragraph
    re.compile(r"\n"),                     # line
    re.compile(r"(?<=[.!?。！？])[ \t]+"),   # sentence
    re.compile(r"[ \t]+"),                 # word
)


@dataclass(frozen=True, slots=True)
class Chunk:
    """One part of a split: ``text`` is what a message shows (with a fence reopened at its start and closed
    at its end where a split cut a code block); ``start`` is where its own text begins in the source, and
    ``reopen`` the fence line put before it ("" when none)."""

    text: str
    start: int
    reopen: str = ""


def open_fence(text: str) -> str | None:
    """The opening fence line (e.g. "```python") of a code block still open at the end of ``text``."""
    opener: str | None = None
    marker = ""
    for line in text.split("\n"):
        m = _FENCE_RE.match(line)
        if not m:
            continue
        if opener is None:
            opener, marker = line.strip(), m.group(1)
        elif m.group(1)[0] == marker[0] and len(m.group(1)) >= len(marker) and not m.group(2).strip():
            opener, marker = None, ""
    return opener


def _closing(opener: str) -> str:
    m = _FENCE_RE.match(opener)
    assert m is not None
    return m.group(1)


def _prefix_within(text: str, budget: int, measure: Measure) -> int:
    """The largest index i such that measure(text[:i]) <= budget (binary search; measure is monotonic)."""
    if measure(text) <= budget:
        return len(text)
    lo, hi = 0, min(len(text), budget)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if measure(text[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _best_cut(window: str, end: int, floor: int) -> tuple[int, re.Pattern[str]] | None:
    """Where to cut ``window[:end]`` (after ``floor``) by the preferred boundary, and that boundary. A cut
    that would leave a part ending in the opening line of a code block (an empty block) is not taken."""
    head = window[:end]
    for boundary in _BOUNDARIES:
        best = -1
        for m in boundary.finditer(head):
            best = m.start()
        if best > floor and not _ends_in_opener(head[:best]):
            return best, boundary
    return None


def _hard_cut(window: str, at: int, floor: int) -> int:
    """A cut with no boundary in reach: at ``at``, or before the line there if that is a fence line (a fence
    cut in two would stop being one)."""
    line_start = window.rfind("\n", 0, at) + 1
    line_end = window.find("\n", line_start)
    if line_start > floor and _FENCE_RE.match(window[line_start:line_end if line_end >= 0 else len(window)]):
        return line_start
    return at


def _ends_in_opener(head: str) -> bool:
    last = head.rstrip("\n").rpartition("\n")[2]
    return _FENCE_RE.match(last) is not None and open_fence(head) is not None


def split(text: str, limit: int, measure: Measure = utf16_len, *, start: int = 0, reopen: str = "") -> list[Chunk]:
    """Split ``text[start:]`` (continuing a code block opened by the fence line ``reopen``) into parts of at
    most ``limit`` units each (see the module docstring)."""
    if limit < 16:
        raise ValueError("limit too small to split sensibly")
    chunks: list[Chunk] = []
    n = len(text)
    pos, carry = start, reopen
    while True:
        prefix = carry + "\n" if carry else ""
        if len(prefix) + n - pos <= limit:  # could fit: only now is the rest measured
            rest = prefix + text[pos:]
            if measure(rest) <= limit:
                if rest.strip() or not chunks:
                    chunks.append(Chunk(rest, pos, carry))
                return chunks
        window = prefix + text[pos:pos + limit]  # a part holds at most ``limit`` characters
        budget = limit
        while True:
            end = _prefix_within(window, budget, measure)
            cut = _best_cut(window, end, len(prefix))
            head_end = cut[0] if cut is not None else _hard_cut(window, max(end, len(prefix) + 1), len(prefix))
            head = window[:head_end]
            opener = open_fence(head)
            if opener is not None:
                head = head.rstrip("\n") + "\n" + _closing(opener)
            overflow = measure(head) - limit
            if overflow <= 0:
                break
            budget -= max(overflow, 1)
        chunks.append(Chunk(head, pos, carry))
        cut_at = pos + head_end - len(prefix)
        if cut is not None:  # the separator may run past the window (a blank line right at the edge)
            tail = cut[1].match(text, cut_at)
            cut_at = tail.end() if tail else cut_at
        pos = cut_at
        # the block continues in the next part: reopen it there (the cut's newline is the separator)
        carry = opener if opener is not None and measure(opener) < limit // 2 else ""


def split_text(text: str, limit: int, *, measure: Measure = utf16_len) -> list[str]:
    """Split ``text`` into parts of at most ``limit`` units each (see the module docstring)."""
    return [c.text for c in split(text, limit, measure)]
