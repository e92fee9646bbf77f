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

A channel passes as names only what is unique to one user on its platform (a username, never a display name).
A channel that tells its entries apart hands core an :class:`AllowEntries`: an id entry names the user with
exactly that id, a name entry the user with that name (ignoring case and a leading ``@``), and never across —
on Slack a username may be spelled like someone else's user id (``u0bob``), and must not pass for Bob. A plain
list of entries is read as before: an entry names a user when it equals their id or one of their names,
ignoring case and a leading ``@`` (Telegram's entries are numeric ids and usernames, and a username is never
all digits, so the two cannot meet there).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
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


@dataclass(frozen=True, slots=True)
class AllowEntries:
    """An allow list whose entries the channel sorted into user ids and names: each matches only its own kind.

    It is also the plain list of its entries (names with their ``@``), so it goes wherever an allow list goes;
    :class:`Deciders` reads the two kinds apart."""

    ids: frozenset[str] = frozenset()
    names: frozenset[str] = frozenset()

    def __iter__(self) -> Iterator[str]:
        yield from sorted(self.ids)
        yield from ("@" + n.strip().removeprefix("@") for n in sorted(self.names))


class Deciders:
    """The users a channel's allow list names: besides the sender, they may decide its approvals."""

    def __init__(self, allow_from: Iterable[str] = ()) -> None:
        self._ids: frozenset[str] = frozenset()
        self._names: frozenset[str] = frozenset()
        self._either: frozenset[str] = frozenset()
        """A plain list's entries, each matched against ids and names alike."""
        if isinstance(allow_from, AllowEntries):
            self._ids = frozenset(i.strip() for i in allow_from.ids if i.strip() and i.strip() != "*")
            self._names = frozenset(n for n in map(_normal, allow_from.names) if n and n != "*")
        else:
            self._either = frozenset(n for n in map(_normal, map(str, allow_from)) if n and n != "*")

    def names(self, decider: Decider) -> bool:
        if decider.id and decider.id in self._ids:
            return True
        if any(_normal(n) in self._names for n in decider.names if n):
            return True
        return any(_normal(n) in self._either for n in (decider.id, *decider.names) if n)

    def may_decide(self, decider: Decider | None, requested_by: str | None) -> bool:
        if decider is None:
            return False
        if requested_by is not None and decider.id == requested_by:
            return True
        return self.names(decider)


NOBODY_ELSE = Deciders()
"""A channel that named nobody: only the sender of the turn's message decides."""
