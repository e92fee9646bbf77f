"""The Channel seam: what one chat platform is to core and to the bridge.

A channel implements :class:`Channel`. Core uses two of its methods: ``open_sink`` (live delivery of one
turn) and ``send_plain`` (fallbacks, notices, command replies). The bridge drives its lifecycle:

    start()   begin receiving (polling, a socket, webhook registration); the bridge is serving HTTP by now
    stop()    stop receiving new input; outbound calls keep working
              -- core shuts down here and still delivers the terminal state of running turns --
    close()   release transports (HTTP sessions, sockets)

``state()`` is a short word for ``/healthz`` ("polling", "connected", "serving", ...); :data:`ERROR`
means the channel cannot work right now, and ``/healthz`` then answers 503 naming it.

A channel is handed a narrow host (``core.host.ChannelHost``), never the core itself.

Retries and pacing of platform calls are the channel's business (one policy per platform call, in
``channels.common.calls``): core calls a sink's ``finish`` and a channel's ``send_plain`` once each and only
bounds how long it waits, stretching that bound by any pause the platform imposed (429 retry_after).
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from typing import Protocol, runtime_checkable

from core.envelope import TurnTarget
from core.snapshot import TurnSnapshot


class SinkError(Exception):
    """A sink or a channel could not make the platform show something (after its own retries)."""

    def __init__(self, message: str = "", *, unsent: str | None = None, outcome_unknown: bool = False) -> None:
        super().__init__(message)
        self.unsent = unsent
        """From ``send_plain`` of a text sent as several messages of which the first were taken: the rest,
        which the chat does not show. None: nothing of the text is shown (or the channel cannot tell)."""
        self.outcome_unknown = outcome_unknown
        """A send of what is not shown timed out: the platform may show it after all."""


class TurnFeed(Protocol):
    """A running turn as a sink sees it (``core.controller.TurnController``): pull the newest snapshot when
    the platform can take it; wait for a change when there is nothing new to show."""

    @property
    def snapshot(self) -> TurnSnapshot:
        """The newest snapshot."""
        ...

    def changed(self, *, urgent_only: bool = False) -> asyncio.Future[None]:
        """Resolved by the next change (``urgent_only``: pending approvals or the terminal state changed).
        A waiter that gives up cancels it."""
        ...

    def approval_unshown(self, call_id: str, origin: tuple[str, ...] = ()) -> None:
        """The sink could not show this pending approval request (``ApprovalRequest.call_id`` and ``origin``)
        after the channel's retries: core denies it at once, telling the model the request could not be shown,
        and the turn goes on (nothing happens if it is no longer pending)."""
        ...


class TurnSink(Protocol):
    """Live rendering of one turn on one platform. Created by ``Channel.open_sink``."""

    async def follow(self, turn: TurnFeed) -> None:
        """Show the running turn until its snapshot is terminal: pull the newest snapshot whenever the
        platform's pace allows (latest wins), and show new or ended approvals at once. Returns soon after
        the terminal snapshot appears (a platform call in flight lands first). A failed live update is the
        sink's business: the next one, or the final, repeats the whole state."""
        ...

    async def finish(self, snapshot: TurnSnapshot) -> None:
        """Make the platform show the terminal snapshot (retrying within the channel's bounds), or raise."""
        ...

    async def abort(self) -> None:
        """Stop all platform work for this turn (shutdown or a hanging sink). What the chat shows stays as
        it is (no call is waited for: the platform may be the one hanging)."""
        ...

    def undelivered(self, snapshot: TurnSnapshot) -> str | None:
        """After a failed ``finish`` or an ``abort``: the part of ``snapshot``'s text the platform does not
        show (for the fallback; "" when it shows all of it), or None when the sink cannot tell, in which
        case the fallback carries the whole text."""
        ...

    def final_in_doubt(self) -> bool:
        """After an ``abort``: whether a call of ``finish`` that edits a message the chat shows was cut off on
        its way (or timed out), so the platform may show the terminal snapshot after all, although
        ``undelivered`` counts that edit as not made."""
        ...

    def paused_seconds(self) -> float:
        """Seconds of platform-imposed pause (429 retry_after) this turn's chat has been under since the sink
        opened; core's wait for ``finish`` is stretched by them, however long."""
        ...


@runtime_checkable
class ShowsWorking(Protocol):
    """A channel that can show a sign of life in a chat before a turn's sink opens: while a message's
    attachments download (step 1 of a turn), which can take a while. Optional; a channel without one shows
    nothing then. A sink opened later shows its own sign (its typing indicator or first words)."""

    def working(self, target: TurnTarget) -> AbstractAsyncContextManager[None]:
        """Show the sign for as long as the block runs; it is gone (or expires by itself) after. Entering and
        leaving never raise and never wait for the platform: a failed call is the channel's to log."""
        ...


ERROR = "error"
"""The state of a channel that cannot receive or send right now (bad credentials, platform unreachable)."""


class Channel(Protocol):
    name: str
    """Unique per process; the ``channel`` of its envelopes and turn targets."""

    async def start(self) -> None:
        """Begin receiving. Failures the channel can retry by itself leave ``state()`` at :data:`ERROR`
        instead of raising; raise only when it can never work with this configuration."""
        ...

    async def stop(self) -> None:
        """Stop receiving new input. ``open_sink`` and ``send_plain`` must keep working until ``close``."""
        ...

    async def close(self) -> None:
        """Release transports; called after core has shut down."""
        ...

    def state(self) -> str:
        """A short word for /healthz; :data:`ERROR` when the channel cannot work right now."""
        ...

    async def open_sink(self, target: TurnTarget) -> TurnSink:
        """Prepare live delivery for one turn. Raising means: deliver plainly from the start."""
        ...

    async def send_plain(self, target: TurnTarget, text: str) -> None:
        """Send one ordinary message (fallbacks, notices, command replies), retrying within the channel's
        bounds and waiting out platform pauses; raise on failure (a SinkError says what the chat does not
        show when a long text was taken in part)."""
        ...


class ChannelRegistry:
    def __init__(self) -> None:
        self._channels: dict[str, Channel] = {}

    def add(self, channel: Channel) -> None:
        if channel.name in self._channels:
            raise ValueError(f"channel {channel.name!r} registered twice")
        self._channels[channel.name] = channel

    def get(self, name: str) -> Channel | None:
        return self._channels.get(name)
