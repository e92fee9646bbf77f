"""What core needs from a channel: a live sink per turn and a plain message for fallbacks and notices."""

from __future__ import annotations

from typing import Protocol

from core.envelope import TurnTarget
from core.snapshot import TurnSnapshot


class SinkError(Exception):
    """A sink could not make the platform show a snapshot.

    ``transient`` errors (timeouts, 5xx, rate limits) may succeed on retry; permanent ones
    (message not found, forbidden) will not. ``retry_after`` is the platform's requested pause.
    """

    def __init__(self, detail: str, *, transient: bool, retry_after: float | None = None) -> None:
        super().__init__(detail)
        self.transient = transient
        self.retry_after = retry_after


class TurnSink(Protocol):
    """Live rendering of one turn on one platform. Created by ``ChannelPort.open_sink``."""

    async def update(self, snapshot: TurnSnapshot) -> None:
        """Show a running snapshot (best effort; throttling is the sink's business)."""
        ...

    async def finish(self, snapshot: TurnSnapshot) -> None:
        """Make the platform show the terminal snapshot, or raise SinkError. Must be idempotent:
        a retry repeats the same target state and never duplicates text."""
        ...

    async def abort(self) -> None:
        """Stop all platform work for this turn (shutdown or a hanging sink)."""
        ...

    def undelivered(self, snapshot: TurnSnapshot) -> str | None:
        """The part of ``snapshot``'s text the platform does not show yet (for the fallback), or None
        when the sink cannot tell, in which case the fallback carries the whole text."""
        ...


class ChannelPort(Protocol):
    name: str

    async def open_sink(self, target: TurnTarget) -> TurnSink:
        """Prepare live delivery for one turn. Raising means: deliver plainly from the start."""
        ...

    async def send_plain(self, target: TurnTarget, text: str) -> None:
        """Send one ordinary message (fallbacks, notices, command replies); raise on failure."""
        ...


class ChannelRegistry:
    def __init__(self) -> None:
        self._channels: dict[str, ChannelPort] = {}

    def add(self, channel: ChannelPort) -> None:
        if channel.name in self._channels:
            raise ValueError(f"channel {channel.name!r} registered twice")
        self._channels[channel.name] = channel

    def get(self, name: str) -> ChannelPort | None:
        return self._channels.get(name)

    def names(self) -> list[str]:
        return sorted(self._channels)
