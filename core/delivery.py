"""TurnDeliveryService: drives a channel's sink from a turn's snapshots and reports whether the
terminal content really became visible.

``start`` failing means "deliver plainly from the start"; the returned DeliveryHandle must be awaited
and says Ok (None) or Err (DeliveryError). The fallback decision is the executor's, never the sink's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from core.channel import ChannelRegistry, SinkError, TurnSink
from core.controller import TurnController
from core.envelope import TurnTarget
from core.retrying import run_with_retries
from core.settings import CoreSettings
from core.snapshot import TurnSnapshot
from core.supervisor import SupervisorClosedError, TaskSupervisor

log = logging.getLogger(__name__)
# Bounds use ``asyncio.timeout``, not ``asyncio.wait_for``: on Python 3.11 wait_for wraps every call in a
# new task, and a turn makes one bounded sink call per snapshot.


class DeliveryStartError(Exception):
    """No live delivery for this turn (unknown channel, open failed, shutting down)."""


@dataclass(frozen=True, slots=True)
class DeliveryError:
    reason: str
    undelivered: str | None = None
    """What the platform does not show of the terminal text; None = unknown (send it all)."""


class _PauseClock:
    """When the platform last asked the sink to hold off, so a waiting handle can allow for it."""

    def __init__(self) -> None:
        self.until = 0.0

    def pause(self, seconds: float) -> None:
        self.until = max(self.until, time.monotonic() + seconds)


class DeliveryHandle:
    def __init__(self, task: asyncio.Task[DeliveryError | None], sink: TurnSink, pauses: _PauseClock,
                 grace: float) -> None:
        self._task = task
        self._sink = sink
        self._pauses = pauses
        self._grace = grace

    async def wait(self, timeout: float) -> DeliveryError | None:
        """None when the terminal snapshot is visible; a DeliveryError otherwise (also on timeout).

        The timeout is stretched by any pause the platform imposed (429 retry_after), however long: a
        paused chat is waited for, not given up on."""
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = max(deadline, self._pauses.until + self._grace) - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                try:
                    async with asyncio.timeout(left):
                        return await asyncio.shield(self._task)
                except TimeoutError:
                    if self._pauses.until + self._grace <= time.monotonic() and time.monotonic() >= deadline:
                        raise
        except TimeoutError:
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._sink.abort(), 5)
            return DeliveryError(f"sink did not finish within {timeout:.0f}s")
        except asyncio.CancelledError:
            if self._task.done() and not self._task.cancelled():
                raise
            self._task.cancel()
            raise


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, TimeoutError) or (isinstance(exc, SinkError) and exc.transient)


def _pause_of(exc: BaseException | None) -> float | None:
    return exc.retry_after if isinstance(exc, SinkError) and exc.retry_after is not None else None


MAX_PAUSES = 20
"""Platform pauses (429 retry_after) a single delivery step waits out before it gives up."""


class _wait_platform(wait_base):
    """Fixed pause between attempts, stretched to the platform's retry_after (however long)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __call__(self, retry_state: RetryCallState) -> float:
        pause = _pause_of(retry_state.outcome.exception() if retry_state.outcome else None)
        return self.delay if pause is None else max(self.delay, pause)


class _stop_platform(stop_base):
    """Stop after ``attempts`` real failures; a platform pause (429) is waited out and does not count,
    up to MAX_PAUSES of them, so the step stays bounded."""

    def __init__(self, attempts: int) -> None:
        self.attempts = max(1, attempts)
        self.failures = 0
        self.pauses = 0

    def __call__(self, retry_state: RetryCallState) -> bool:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if _pause_of(exc) is not None:
            self.pauses += 1
        else:
            self.failures += 1
        return self.failures >= self.attempts or self.pauses > MAX_PAUSES


def platform_retry(attempts: int, delay: float,
                   on_pause: Callable[[float], None] | None = None) -> AsyncRetrying:
    """The retry policy for platform calls made by core (final updates, plain sends)."""

    def before_sleep(state: RetryCallState) -> None:
        pause = _pause_of(state.outcome.exception() if state.outcome else None)
        if pause is not None and on_pause is not None:
            on_pause(pause)

    return AsyncRetrying(stop=_stop_platform(attempts), wait=_wait_platform(delay),
                         retry=retry_if_exception(_is_transient), before_sleep=before_sleep, reraise=True)


class PlainSender:
    """Sends one ordinary message through a channel (fallbacks, notices, command replies).

    Each attempt is bounded by ``plain_send_timeout``; a send whose outcome is unknown is retried at most
    once; a platform pause (SinkError with retry_after) is waited out here, however long, and does not
    count as an attempt."""

    def __init__(self, channels: ChannelRegistry, settings: CoreSettings) -> None:
        self._channels = channels
        self._settings = settings

    async def send(self, target: TurnTarget, text: str) -> bool:
        channel = self._channels.get(target.channel)
        if channel is None:
            log.error("cannot reply in %s: no channel %r", target.session_key, target.channel)
            return False
        async def send() -> None:
            async with asyncio.timeout(self._settings.plain_send_timeout):
                await channel.send_plain(target, text)

        try:
            await run_with_retries(lambda: platform_retry(2, 0.5), send)
        except Exception as exc:
            log.warning("plain send to %s failed: %s", target.session_key, exc)
            return False
        return True


class TurnDeliveryService:
    def __init__(self, channels: ChannelRegistry, supervisor: TaskSupervisor, settings: CoreSettings) -> None:
        self._channels = channels
        self._supervisor = supervisor
        self._settings = settings

    async def start(self, target: TurnTarget, controller: TurnController) -> DeliveryHandle:
        channel = self._channels.get(target.channel)
        if channel is None:
            raise DeliveryStartError(f"no channel named {target.channel!r}")
        if self._supervisor.closed:
            raise DeliveryStartError("shutting down")
        try:
            async with asyncio.timeout(self._settings.sink_update_timeout):
                sink = await channel.open_sink(target)
        except Exception as exc:  # open failed: the turn is delivered plainly
            raise DeliveryStartError(f"open failed: {type(exc).__name__}: {exc}") from exc
        pauses = _PauseClock()
        try:
            task = self._supervisor.spawn(f"sink:{controller.snapshot.turn_id}",
                                          self._drive(sink, controller, pauses))
        except SupervisorClosedError as exc:
            with contextlib.suppress(Exception):
                await sink.abort()
            raise DeliveryStartError(str(exc)) from exc
        grace = self._settings.sink_update_timeout * max(1, self._settings.sink_finish_attempts)
        return DeliveryHandle(task, sink, pauses, grace)

    async def _drive(self, sink: TurnSink, controller: TurnController,
                     pauses: _PauseClock) -> DeliveryError | None:
        try:
            # closed here rather than left to the garbage collector (which costs a task per turn)
            async with contextlib.aclosing(controller.watch()) as snapshots:
                async for snap in snapshots:
                    if snap.terminal:
                        return await self._finish(sink, snap, pauses)
                    try:
                        async with asyncio.timeout(self._settings.sink_update_timeout):
                            await sink.update(snap)
                    except Exception as exc:
                        # A failed live update is not fatal: the next snapshot (or the final) repeats the
                        # whole target state.
                        log.warning("sink update failed for turn %s: %s", snap.turn_id, exc)
            return DeliveryError("turn ended without a terminal snapshot")
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sink.abort(), 5)
            raise

    async def _finish(self, sink: TurnSink, snap: TurnSnapshot, pauses: _PauseClock) -> DeliveryError | None:
        s = self._settings

        async def finish() -> None:
            async with asyncio.timeout(s.sink_update_timeout):
                await sink.finish(snap)

        try:
            await run_with_retries(
                lambda: platform_retry(s.sink_finish_attempts, s.sink_finish_retry_delay, pauses.pause), finish)
        except Exception as exc:
            log.warning("final delivery failed for turn %s: %s", snap.turn_id, exc)
            undelivered: str | None = None
            with contextlib.suppress(Exception):
                undelivered = sink.undelivered(snap)
            return DeliveryError(f"{type(exc).__name__}: {exc}", undelivered)
        return None
