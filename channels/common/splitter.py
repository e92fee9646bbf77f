"""Split a Markdown reply into parts that each fit a platform's message limit.

Cuts prefer a paragraph break, then a line break, then a sentence end, then any whitespace, and only
then fall back to a hard cut. A fenced code block cut by a split is closed at the end of its part and
reopened (same fence line, language included) at the start of the next, so every part renders on its
own. Nothing is dropped except the whitespace at the cut itself.

Length is measured by a pluggable function: Telegram counts UTF-16 code units, Slack and Feishu bytes.
(telegramify-markdown can split rendered text too, but only on newlines and without re-fencing code, and
the splitting has to work on the Markdown source for every platform, so it lives here.)
"""

from __future__ import annotations

import re
from collections.abc import Callable

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
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if measure(text[:mid]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _best_cut(text: str, end: int) -> tuple[int, int] | None:
    """(head_end, tail_start) of the preferred boundary inside text[:end], or None."""
    window = text[:end]
    for boundary in _BOUNDARIES:
        best: tuple[int, int] | None = None
        for m in boundary.finditer(window):
            if m.start() > 0:
                best = (m.start(), m.end())
        if best is not None:
            # the separator may run past the window (a blank line right at the edge): skip all of it
            tail = boundary.match(text, best[0])
            return best[0], tail.end() if tail else best[1]
    return None


def split_text(text: str, limit: int, *, measure: Measure = utf16_len) -> list[str]:
    """Split ``text`` into parts of at most ``limit`` units each (see the module docstring)."""
    if limit < 16:
        raise ValueError("limit too small to split sensibly")
    parts: list[str] = []
    rest = text
    while measure(rest) > limit:
        budget = limit
        while True:
            end = _prefix_within(rest, budget, measure)
            cut = _best_cut(rest, end)
            head_end, tail_start = cut if cut is not None else (max(end, 1), max(end, 1))
            head = rest[:head_end]
            opener = open_fence(head)
            if opener is not None:
                head = head.rstrip("\n") + "\n" + _closing(opener)
            overflow = measure(head) - limit
            if overflow <= 0:
                break
            budget -= max(overflow, 1)
        parts.append(head)
        tail = rest[tail_start:]
        if opener is not None and measure(opener) < limit // 2:
            # the block continues in the next part: reopen it there (the cut's newline is the separator)
            tail = opener + "\n" + tail
        rest = tail
    if rest.strip() or not parts:
        parts.append(rest)
    return parts
