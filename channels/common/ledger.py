"""The ledger of one turn: which platform messages show which part of the reply.

It changes only when the platform accepted a call, so it is always a true picture of the chat, and the
fallback can tell exactly which parts the chat does not show yet.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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


class Ledger:
    def __init__(self) -> None:
        self.entries: list[Entry] = []

    def __len__(self) -> int:
        return len(self.entries)

    def accepted_send(self, message_id: str, part: Part) -> None:
        self.entries.append(Entry(message_id, part))

    def accepted_edit(self, index: int, part: Part) -> None:
        self.entries[index].part = part

    def accepted_delete(self, index: int) -> None:
        del self.entries[index]

    def gone(self, index: int) -> None:
        """The platform reported message ``index`` as deleted: it shows nothing any more."""
        self.entries[index].part = Part(text="")
        self.entries[index].gone = True

    def freeze_all_but_last(self) -> None:
        for entry in self.entries[:-1]:
            entry.frozen = True

    def shows(self, index: int, part: Part) -> bool:
        """Whether message ``index`` shows all of ``part``'s words: its rendered form, or its plain source
        (a part frozen during streaming holds the finished plain text)."""
        if index >= len(self.entries):
            return False
        if self.entries[index].gone:
            return False
        shown = self.entries[index].part
        return shown.content == part.content or (shown.formatting == () and shown.text == part.source)

    def missing(self, desired: list[Part]) -> list[Part]:
        """The desired parts the chat does not show (what a fallback must still send)."""
        return [part for i, part in enumerate(desired) if not self.shows(i, part)]
