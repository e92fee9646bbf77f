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
"""

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
    """Live rendering of one turn on one platform. Created by ``Channel.open_sink``."""

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
        """Send one ordinary message (fallbacks, notices, command replies); raise on failure."""
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
