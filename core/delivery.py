"""TurnDeliveryService: lets a channel's sink follow a turn and reports whether the terminal content really
became visible.

``start`` failing means "deliver plainly from the start"; the returned DeliveryHandle must be awaited
and says Ok (None) or Err (DeliveryError). The fallback decision is the executor's, never the sink's.

Core does not retry platform calls: the sink and ``send_plain`` do, within their channel's bounds (one
retry policy per platform call, ``channels.common``). Core bounds how long it waits for the terminal
content, and stretches that bound by every pause the platform imposed on the chat (429 retry_after).

A shutdown whose bound runs out cancels the wait: ``DeliveryHandle.cut`` aborts the sink and reports what its
ledger says the chat shows, and whether a final edit was cut off on its way (it may have landed); the
executor decides from that whether the next start may send the terminal message (``core.executor``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from core.channel import ChannelRegistry, ShowsWorking, SinkError, TurnSink
from core.controller import TurnController
from core.envelope import TurnTarget
from core.settings import CoreSettings
from core.snapshot import TurnSnapshot
from core.supervisor import SupervisorClosedError, TaskSupervisor

log = logging.getLogger(__name__)
# Bounds use ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11 wait_for wraps every call in a
# new task.


class DeliveryStartError(Exception):
    """No live delivery for this turn (unknown channel, open failed, shutting down)."""


@dataclass(frozen=True, slots=True)
class DeliveryError:
    reason: str
    undelivered: str | None = None
    """What the platform does not show of the terminal text; None = unknown (send it all)."""
    maybe_shown: bool = False
    """The final's send of what is not shown timed out: the platform may show it after all."""


@dataclass(frozen=True, slots=True)
class Cut:
    """What the chat shows of a turn whose delivery the process stopped waiting for (``DeliveryHandle.cut``)."""

    undelivered: str | None
    """What the sink's ledger says the chat does not show of the terminal text ("": all of it shows; None:
    unknown)."""
    final_in_doubt: bool = False
    """A final edit of a message the chat shows was cut off on its way: the chat may show the terminal
    state after all."""


@dataclass(frozen=True, slots=True)
class Unshown:
    """What a plain send left unshown."""

    text: str
    """What of the text the chat does not show ("": all of it)."""
    maybe_shown: bool = False
    """A send of ``text`` timed out: the platform may show it after all, and sending it again could show it
    twice (``core.redelivery``)."""


def _paused(sink: TurnSink) -> float:
    try:
        return max(0.0, float(sink.paused_seconds()))
    except Exception:  # a sink bug must not break the wait
        return 0.0


class DeliveryHandle:
    def __init__(self, task: asyncio.Task[DeliveryError | None], sink: TurnSink, grace: float,
                 controller: TurnController) -> None:
        self._task = task
        self._sink = sink
        self._grace = grace
        self._controller = controller

    async def wait(self, timeout: float) -> DeliveryError | None:
        """None when the terminal snapshot is visible; a DeliveryError otherwise (also on timeout).

        The timeout is stretched by every platform pause (429 retry_after) the chat was under while
        waiting, however long, plus a grace for the calls that follow a pause: a paused chat is waited
        for, not given up on. A wait that runs out aborts the sink, which leaves the chat as it is, and
        asks it what of the terminal text the chat does not show: the fallback carries only that (the
        whole answer may already be there, streamed into a preview the final update never reached)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        counted = _paused(self._sink)
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    paused = _paused(self._sink)
                    if paused <= counted:
                        raise TimeoutError
                    deadline += paused - counted + self._grace
                    counted = paused
                    continue
                bound = asyncio.timeout(left)
                try:
                    async with bound:
                        return await asyncio.shield(self._task)
                except TimeoutError:
                    if not bound.expired():
                        raise
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await self._sink.abort()
            return DeliveryError(f"sink did not finish within {timeout:.0f}s", self._undelivered())
        except asyncio.CancelledError:
            if self._task.done() and not self._task.cancelled():
                raise
            self._task.cancel()
            raise

    def _undelivered(self) -> str | None:
        snapshot = self._controller.snapshot
        if not snapshot.terminal:
            return None
        try:
            return self._sink.undelivered(snapshot)
        except Exception as exc:  # a sink bug: the fallback carries the whole text
            log.warning("could not tell what turn %s's chat shows: %s", snapshot.turn_id, exc)
            return None

    async def cut(self) -> Cut:
        """The process stopped waiting for the terminal content (the shutdown's bound cancelled the wait):
        stop following the turn at once (the sink is aborted: the chat stays as it is, no call is waited
        for) and say what the chat shows of it, from the sink's ledger, and whether a final edit was on its
        way when the abort came."""
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task  # its cancellation aborts the sink
        task = self._task
        if task.done() and not task.cancelled() and task.exception() is None and task.result() is None:
            return Cut("")  # it landed just before the cut
        with contextlib.suppress(Exception):  # (again, when the task ended before its abort could run)
            async with asyncio.timeout(5):
                await self._sink.abort()
        try:
            doubt = bool(self._sink.final_in_doubt())
        except Exception:  # a sink bug: nothing is taken as shown
            doubt = False
        return Cut(self._undelivered(), doubt)

    async def abandon(self) -> None:
        """Stop following the turn at once and show nothing more of it (the sink is aborted, its terminal
        state never sent): another process owns the turn's outcome."""
        self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task  # its cancellation aborts the sink


class PlainSender:
    """Sends one ordinary message through a channel (fallbacks, notices, command replies).

    The channel retries and waits out platform pauses itself; a failure here is final."""

    def __init__(self, channels: ChannelRegistry) -> None:
        self._channels = channels

    async def send(self, target: TurnTarget, text: str) -> bool:
        return await self._send(target, text) is None

    async def send_rest(self, target: TurnTarget, text: str) -> Unshown:
        """Send ``text`` (not empty); returns what of it the chat does not show: "" when the platform took
        all of it, the unsent rest when it took the first messages of a long one, else ``text``."""
        failure = await self._send(target, text)
        if failure is None:
            return Unshown("")
        if not isinstance(failure, SinkError):
            return Unshown(text)
        return Unshown(failure.unsent or text, failure.outcome_unknown)

    async def _send(self, target: TurnTarget, text: str) -> Exception | None:
        channel = self._channels.get(target.channel)
        if channel is None:
            log.error("cannot reply in %s: no channel %r", target.session_key, target.channel)
            return LookupError(f"no channel {target.channel!r}")
        try:
            await channel.send_plain(target, text)
        except Exception as exc:
            log.warning("plain send to %s failed: %s", target.session_key, exc)
            return exc
        return None


class TurnDeliveryService:
    def __init__(self, channels: ChannelRegistry, supervisor: TaskSupervisor, settings: CoreSettings) -> None:
        self._channels = channels
        self._supervisor = supervisor
        self._settings = settings

    def working(self, target: TurnTarget) -> AbstractAsyncContextManager[None]:
        """The chat's sign of life while a turn prepares, before its sink opens, where the channel has one
        (``core.channel.ShowsWorking``); nothing otherwise."""
        channel = self._channels.get(target.channel)
        if isinstance(channel, ShowsWorking) and not self._supervisor.closed:
            return channel.working(target)
        return contextlib.nullcontext()

    async def start(self, target: TurnTarget, controller: TurnController) -> DeliveryHandle:
        channel = self._channels.get(target.channel)
        if channel is None:
            raise DeliveryStartError(f"no channel named {target.channel!r}")
        if self._supervisor.closed:
            raise DeliveryStartError("shutting down")
        try:
            async with asyncio.timeout(self._settings.sink_open_timeout):
                sink = await channel.open_sink(target)
        except Exception as exc:  # open failed: the turn is delivered plainly
            raise DeliveryStartError(f"open failed: {type(exc).__name__}: {exc}") from exc
        try:
            task = self._supervisor.spawn(f"sink:{controller.snapshot.turn_id}", self._drive(sink, controller))
        except SupervisorClosedError as exc:
            with contextlib.suppress(Exception):
                await sink.abort()
            raise DeliveryStartError(str(exc)) from exc
        return DeliveryHandle(task, sink, self._settings.sink_open_timeout, controller)

    async def _drive(self, sink: TurnSink, controller: TurnController) -> DeliveryError | None:
        turn_id = controller.snapshot.turn_id
        try:
            try:
                await sink.follow(controller)
            except Exception as exc:  # live updates are best effort: the final repeats the whole state
                log.warning("live updates for turn %s stopped: %s", turn_id, exc)
            while not controller.terminal:
                await controller.changed(urgent_only=True)
            return await self._finish(sink, controller.snapshot)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(5):
                    await sink.abort()
            raise

    @staticmethod
    async def _finish(sink: TurnSink, snap: TurnSnapshot) -> DeliveryError | None:
        try:
            await sink.finish(snap)
        except Exception as exc:
            log.warning("final delivery failed for turn %s: %s", snap.turn_id, exc)
            undelivered: str | None = None
            with contextlib.suppress(Exception):
                undelivered = sink.undelivered(snap)
            return DeliveryError(f"{type(exc).__name__}: {exc}", undelivered,
                                 isinstance(exc, SinkError) and exc.outcome_unknown)
        return None
