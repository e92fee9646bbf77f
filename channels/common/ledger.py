"""The ledger of one turn: which platform messages show which part of the reply.

It changes only when the platform accepted a call, so it is always a true picture of the chat, and the
fallback can tell exactly which parts the chat does not show yet.

What counts as shown: a message shows a part when it shows the part's final rendering. A streaming
preview (the plain Markdown source) is stale once the final failed: the sink removes it before the
fallback, so the chat ends showing the formatted answer once. Only a preview that stays (``kept``: the
platform would not let us remove it, or the sink was aborted and left the chat as it was) still counts
for its words: sending them again would show them twice. A kept preview that shows the beginning of its
part (the reply grew after its last update) leaves only the rest of that part missing; when the preview
stopped inside a word, the rest begins with "…".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CONTINUED = "…"
"""Put before the rest of a part whose kept preview stopped inside a word, so the rest does not read as a
word of its own ("…rld, and more" after a preview ending "Hello wo")."""


@dataclass(frozen=True, slots=True)
class Part:
    """One message's worth of a reply.

    ``text`` is what the platform shows; ``formatting`` is the platform's opaque markup for it (Telegram
    entities, a Slack block list) — two parts are the same message content when both are equal.
    ``source`` is the Markdown this part was rendered from.
    """

    text: str
    source: str = ""
    formatting: tuple[Any, ...] = ()

    @property
    def content(self) -> tuple[str, tuple[Any, ...]]:
        return self.text, self.formatting

    @classmethod
    def plain(cls, source: str) -> Part:
        return cls(text=source, source=source)


@dataclass(slots=True)
class Entry:
    message_id: str
    part: Part
    frozen: bool = False
    gone: bool = False
    kept: bool = False
    """A stale preview that could not be removed: it still shows the words of its part's source."""


class Ledger:
    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def __len__(self) -> int:
        return len(self.entries)

    def accepted_send(self, message_id: str, part: Part, *, frozen: bool = False) -> None:
        self.entries.append(Entry(message_id, part, frozen))

    def accepted_edit(self, index: int, part: Part) -> None:
        self.entries[index].part = part

    def accepted_delete(self, index: int) -> None:
        del self.entries[index]

    def gone(self, index: int) -> None:
        """Message ``index`` shows nothing any more (deleted by us, or the platform says it is gone)."""
        self.entries[index].part = Part(text="")
        self.entries[index].gone = True

    def keep(self, index: int) -> None:
        """Message ``index`` is stale but could not be removed."""
        self.entries[index].kept = True

    def freeze(self, upto: int) -> None:
        """Messages before ``upto`` are finished: streaming never touches them again."""
        for entry in self.entries[:upto]:
            entry.frozen = True

    def shows(self, index: int, part: Part) -> bool:
        """Whether message ``index`` shows ``part`` in its final form (or, when it is a stale preview that
        could not be removed, at least its words)."""
        if index >= len(self.entries):
            return False
        entry = self.entries[index]
        if entry.gone:
            return False
        shown = entry.part
        return shown.content == part.content or (entry.kept and shown.text == part.source)

    def missing(self, desired: list[Part]) -> list[Part]:
        """The desired parts the chat does not show (what a fallback must still send)."""
        return [part for i, part in enumerate(desired) if not self.shows(i, part)]

    def unshown(self, desired: list[Part]) -> list[str]:
        """The Markdown the chat does not show of each desired part it does not show in full: the whole
        source, or the rest of it after what a kept preview of that part already shows."""
        rest: list[str] = []
        for i, part in enumerate(desired):
            if self.shows(i, part):
                continue
            entry = self.entries[i] if i < len(self.entries) else None
            shown = entry.part.source.rstrip() if entry is not None and entry.kept and not entry.gone else ""
            if shown.strip() and part.source.startswith(shown):
                after = part.source[len(shown):]
                left = after.strip()
                if left and shown[-1].isalnum() and after[0].isalnum():
                    left = CONTINUED + left  # the preview stopped inside a word: say the rest goes on from it
                if left:
                    rest.append(left)
                continue
            rest.append(part.source)
        return rest
