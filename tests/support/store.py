"""What the store tests build their records from: a clock the test sets and moves, and a user's message."""

from __future__ import annotations

from core.messages import MessageSource, NewMessage


class FakeClock:
    """The store's clock: ``now`` stands still until the test moves it."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def user(text: str) -> NewMessage:
    return NewMessage(role="user", content=text, source=MessageSource(kind="user_input"))
