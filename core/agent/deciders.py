"""Who may decide a pending tool approval: one rule, kept by core, for every channel.

An approval is requested on behalf of the sender of the turn's message (``requested_by``). Core accepts a
decision from:

- that sender, or
- a user the channel's allow list names (its ``allow_from``, handed to core by the channel through its
  host's ``set_deciders``). ``"*"`` lets everyone *use* the bot but names nobody in particular, so under
  ``"*"`` only the sender decides — in a group, a bystander never approves someone else's tool call.

Anyone else is refused and the approval stays pending; the channel answers with its "not yours" text. So a
channel only translates: a press becomes a :class:`Decider` (the platform user id, and the names the
platform vouches for, such as a Telegram @username), and core's :class:`DecideResult` becomes the
platform's answer. A channel without identities (the web chat) decides as the sender it submits as.

An entry names a user when it equals their id or one of their names, ignoring case and a leading ``@``. A
channel passes as names only what is unique to one user on its platform (a username, never a display name).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Decider:
    """Who pressed: the platform user id, and the names the platform guarantees are theirs alone."""

    id: str
    names: tuple[str, ...] = ()
    shown: str = ""
    """How the chat shows this user (a display name), for saying who decided; never used to decide who may."""

    @classmethod
    def of(cls, who: Decider | str | None) -> Decider | None:
        """A decider from a channel's ``decided_by`` (a bare id is a decider without names)."""
        if who is None or isinstance(who, Decider):
            return who
        return cls(str(who))


class DecideResult(enum.Enum):
    """Core's answer to a decision."""

    DECIDED = "decided"
    NOT_PENDING = "not_pending"
    """Nothing is pending under that id (already decided, timed out, stopped, the turn is over)."""
    REFUSED = "refused"
    """Pending, but this decider may not decide it; the approval stays pending."""

    def __bool__(self) -> bool:
        # True only for an accepted decision, so a caller testing the answer as a yes/no (as the answer was
        # once a bool) can never take a refusal for a success.
        return self is DecideResult.DECIDED


def _normal(name: str) -> str:
    return name.strip().removeprefix("@").casefold()


class Deciders:
    """The users a channel's allow list names: besides the sender, they may decide its approvals."""

    def __init__(self, allow_from: Iterable[str] = ()) -> None:
        self._named = frozenset(n for n in map(_normal, map(str, allow_from)) if n and n != "*")

    def names(self, decider: Decider) -> bool:
        return any(_normal(n) in self._named for n in (decider.id, *decider.names) if n)

    def may_decide(self, decider: Decider | None, requested_by: str | None) -> bool:
        if decider is None:
            return False
        if requested_by is not None and decider.id == requested_by:
            return True
        return self.names(decider)


NOBODY_ELSE = Deciders()
"""A channel that named nobody: only the sender of the turn's message decides."""
