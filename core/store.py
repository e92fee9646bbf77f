"""The Store protocol: every durable fact of chatbridge goes through it.

SQLite (``core.sqlite_store``) is the default; ``core.postgresql.store`` keeps the same durable facts on a
PostgreSQL server (``tests/test_store_contract.py`` holds both to the same behaviour).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict

from core.messages import ChatMessage, NewMessage

DEFAULT_TITLE = "New chat"
"""A session's title until the first exchange names it (or a user renames it)."""

TurnState = Literal["running", "completed", "cancelled", "failed", "stale", "interrupted"]


class StoreError(Exception):
    """A storage operation failed. The message is safe to log; it never reaches a chat."""


class StaleStateError(StoreError):
    """A conditional write found the session moved on (generation or state_version changed)."""


class TurnEndedError(StoreError):
    """A commit that closes a turn found its record closed already: another process took the session over
    and closed the turn as interrupted (``close_interrupted_turns``); that process owns its outcome."""


class InboundServedError(StoreError):
    """A write that serves an inbound message found it no longer waiting: it was served already (a process
    whose lease ran out while its write was on its way, and the one that took the session over, both read it
    as waiting; the first write to land serves it) or dropped. The write wrote nothing."""


class UnknownMessageError(LookupError):
    """A history page was asked for relative to a message id that is not in that session (bad input, not a
    storage failure)."""


class SessionRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    key: str
    title: str
    title_is_default: bool
    generation: int
    state_version: int
    history_revision: int
    revision_seq: int
    """Highest message seq already covered by ``history_revision``."""
    context_start_seq: int
    """Messages with seq <= this are history only (``/new`` starts a fresh context)."""
    created_at: float
    updated_at: float


class CommitResult(BaseModel):
    """One history revision: every message persisted since the previous revision, in seq order."""

    model_config = ConfigDict(frozen=True)

    session_key: str
    history_revision: int
    messages: tuple[ChatMessage, ...]
    state_version: int
    """The session's state_version after the commit (one higher than before if it inserted anything)."""
    inserted: int
    """How many of ``messages`` (the last ones) this commit inserted."""


class TurnRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    turn_id: str
    session_key: str
    state: TurnState
    target_json: str
    started_at: float
    ended_at: float | None


class UndeliveredTurn(BaseModel):
    """A turn that ended (committed) but whose terminal state may never have reached its chat."""

    model_config = ConfigDict(frozen=True)

    turn: TurnRecord
    text: str | None
    """Its terminal message as history keeps it: the answer, or the notice of a turn without one."""


class AttachmentRecord(BaseModel):
    """A stored attachment file (``core.media``): whose it is and what it is. ``claimed`` once a message
    refers to it (a web upload waits unclaimed until its message is sent)."""

    model_config = ConfigDict(frozen=True)

    id: str
    session_key: str
    kind: str
    name: str
    content_type: str
    size: int
    created_at: float
    claimed: bool = True


class InboundRecord(BaseModel):
    """An accepted inbound message whose turn has not started yet (see ``Store.admit_inbound``)."""

    model_config = ConfigDict(frozen=True)

    seq: int
    """Arrival order."""
    payload: str
    admitted_at: float


class Store(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    # sessions
    async def get_or_create_session(self, key: str, *, default_title: str = DEFAULT_TITLE) -> SessionRecord: ...

    async def get_session(self, key: str) -> SessionRecord | None: ...

    async def list_sessions(self, *, prefix: str | None = None, limit: int = 200,
                            exclude_glob: str | None = None) -> list[SessionRecord]:
        """Most recently updated first; only keys starting with ``prefix``, and none matching the SQL
        ``GLOB`` pattern ``exclude_glob`` (how a conversation list leaves subagent sessions out)."""
        ...

    async def bump_generation(self, key: str) -> int: ...

    async def new_context(self, key: str, *, drop_inbound: Sequence[int] = (),
                          serves: int | None = None) -> SessionRecord:
        """Start a fresh model context: older messages stay in history; generation and state_version bump.
        The inbound messages ``drop_inbound`` (waiting in this session) are marked served in the same
        transaction: they belong to the conversation that ended and are never answered. ``serves`` is the
        stored command this carries out (a forwarded ``/new``), marked served too; InboundServedError (and
        nothing written) when it is no longer waiting: a command is carried out once."""
        ...

    async def rename(self, key: str, title: str) -> None:
        """A user rename: sets the title and clears title_is_default, so a late automatic title loses."""
        ...

    async def set_title_if_default(self, key: str, title: str, *, expect_generation: int) -> bool: ...

    # messages
    async def append_message(self, key: str, message: NewMessage, *, begin_turn: tuple[str, str] | None = None,
                             serves: int | None = None) -> tuple[ChatMessage, SessionRecord]:
        """Persist one message (state_version +1, no revision bump); returns it and the session after it.
        A session numbers its messages 1, 2, 3, ... without gaps (``core.context_cache`` relies on it).

        In the same transaction, ``begin_turn=(turn_id, target_json)`` records a running turn and
        ``serves`` marks that inbound message (``admit_inbound``) served. Raises InboundServedError (and
        writes nothing) when that message is no longer waiting: a message is served once."""
        ...

    async def commit_turn(
        self,
        key: str,
        messages: Sequence[NewMessage],
        *,
        expect_generation: int | None,
        expect_state_version: int | None,
        end_turn: tuple[str, TurnState] | None = None,
        trace: tuple[str, Sequence[tuple[str, dict[str, Any]]]] | None = None,
    ) -> CommitResult:
        """Atomically check the expectations, insert ``messages`` and raise history_revision by one;
        ``end_turn=(turn_id, state)`` closes a running turn and ``trace=(turn_id, [(kind, payload), ...])``
        appends its trace records, in the same transaction.

        Raises StaleStateError (and writes nothing) when an expectation fails, and TurnEndedError (and writes
        nothing) when ``end_turn`` names a recorded turn that is no longer running: a turn record is closed
        once, by its commit or by ``close_interrupted_turns``, and whichever comes first owns the outcome.
        """
        ...

    async def history(self, key: str, *, limit: int = 1000,
                      before: str | None = None) -> tuple[int, list[ChatMessage]]:
        """(history_revision, the newest ``limit`` messages in seq order), consistent with each other.

        ``before`` (a message id of this session) pages backwards: the newest ``limit`` messages older than
        that one. Raises UnknownMessageError when the session has no such message."""
        ...

    async def context_messages(self, key: str, *, limit: int) -> tuple[int, list[ChatMessage]]:
        """(state_version, the newest ``limit`` messages after the session's context start in seq order),
        consistent with each other. Every message write raises state_version, so the pair identifies
        exactly this context (``core.context_cache`` relies on it)."""
        ...

    # inbound messages and dedupe
    async def admit_inbound(self, channel: str, event_id: str | None, payload: str, *,
                            ttl_seconds: float, key: str | None = None) -> int | None:
        """Durably keep an accepted inbound message until its turn starts; returns its seq (arrival order).

        With an ``event_id``, the same transaction records the dedupe mark (kept ``ttl_seconds`` past
        admission, and while the message waits), and None means the event was seen within its TTL: nothing
        is written. ``payload`` is opaque to the store; ``key`` is the session it waits for (what
        ``waiting_inbound(key=...)`` finds it by)."""
        ...

    async def mark_event_processed(self, channel: str, event_id: str, *, ttl_seconds: float) -> bool:
        """Only the dedupe mark: True if this event is new (and is now recorded); False if it was seen
        within its TTL."""
        ...

    async def event_seen(self, channel: str, event_id: str) -> bool:
        """Whether a dedupe mark for this event exists (read only)."""
        ...

    async def waiting_inbound(self, *, key: str | None = None, after_seq: int = 0) -> list[InboundRecord]:
        """Every admitted inbound message not yet served, in arrival order (read at start-up); with ``key``
        only those admitted for that session, and only those with a seq above ``after_seq``."""
        ...

    async def finish_inbound(self, seqs: Sequence[int]) -> list[int]:
        """Mark inbound messages served without a turn (e.g. answered with a notice); dedupe marks stay.
        Returns those that were still waiting: a notice answering one is sent by the caller that finished
        it, so once, whichever processes read it as waiting."""
        ...

    async def forget_inbound(self, seq: int) -> None:
        """Remove an inbound message and its dedupe mark: it was not accepted after all (its turn could not
        even store it), so the same event may be sent again."""
        ...

    # turns (opened by append_message, closed by commit_turn or end_turn)
    async def end_turn(self, turn_id: str, state: TurnState) -> None: ...

    async def mark_delivered(self, turn_id: str) -> None:
        """The turn's terminal state is visible in its chat (its sink or a plain message was accepted)."""
        ...

    async def undelivered_turns(self, since: float, *, key: str | None = None,
                                ended_before: float | None = None) -> list[UndeliveredTurn]:
        """Turns that ended after ``since`` (completed, failed or cancelled) and were never marked delivered:
        a crash came between their commit and their delivery, or the platform never took their terminal
        message (read at start-up), oldest first. ``key``: only that session's; ``ended_before``: only those
        that ended before it."""
        ...

    async def close_interrupted_turns(self, *, key: str | None = None,
                                      prefix: str | None = None) -> list[TurnRecord]:
        """Mark every turn still 'running' as 'interrupted' and return them in the order they started (called
        once at start-up); with ``key`` only that session's, and with ``prefix`` too those of the sessions
        whose key starts with it (a process taking over a session from one that died closes the session's
        turn and its subagents' turns: ``prefix`` = the key + ``CHILD_MARK``)."""
        ...

    # attachments
    async def add_attachment(self, record: AttachmentRecord) -> None: ...

    async def get_attachment(self, attachment_id: str) -> AttachmentRecord | None: ...

    async def claim_attachments(self, ids: Sequence[str]) -> None:
        """Mark attachments as referred to by a message (kept until they expire)."""
        ...

    async def drop_unclaimed_attachments(self, key: str, *, before: float) -> list[str]:
        """Forget the attachments of ``key`` stored before ``before`` that no message refers to; returns their
        ids (to delete the files)."""
        ...

    async def drop_expired_attachments(self, before: float) -> list[str]:
        """Forget the attachments created before ``before``; returns their ids (to delete the files)."""
        ...

    # channel state
    async def get_channel_state(self, channel: str, name: str) -> str | None:
        """A small durable value a channel keeps across restarts (e.g. Telegram's update offset)."""
        ...

    async def set_channel_state(self, channel: str, name: str, value: str) -> None: ...

    async def channel_state_names(self, channel: str, prefix: str) -> list[str]:
        """The names of ``channel``'s values that begin with ``prefix`` (exactly, case and all), sorted."""
        ...

    async def delete_channel_state(self, channel: str, name: str) -> None:
        """Forget one value of ``channel`` (nothing happens when there is none)."""
        ...

    # traces (written with commit_turn; alone when the commit failed)
    async def append_traces(self, key: str, turn_id: str, records: Sequence[tuple[str, dict[str, Any]]]) -> None:
        """Append several (kind, payload) records in one transaction, in order."""
        ...
