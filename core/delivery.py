"""TurnDeliveryService: drives a channel's sink from a turn's snapshots and reports whether the
terminal content really became visible.

``start`` failing means "deliver plainly from the start"; the returned DeliveryHandle must be awaited
and says Ok (None) or Err (DeliveryError). The fallback decision is the executor's, never the sink's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, stop_after_attempt
from tenacity.wait import wait_base

from core.channel import ChannelRegistry, SinkError, TurnSink
from core.controller import TurnController
from core.envelope import TurnTarget
from core.settings import CoreSettings
from core.snapshot import TurnSnapshot
from core.supervisor import SupervisorClosedError, TaskSupervisor

log = logging.getLogger(__name__)


class DeliveryStartError(Exception):
    """No live delivery for this turn (unknown channel, open failed, shutting down)."""


@dataclass(frozen=True, slots=True)
class DeliveryError:
    reason: str
    undelivered: str | None = None
    """What the platform does not show of the terminal text; None = unknown (send it all)."""


class DeliveryHandle:
    def __init__(self, task: asyncio.Task[DeliveryError | None], sink: TurnSink) -> None:
        self._task = task
        self._sink = sink

    async def wait(self, timeout: float) -> DeliveryError | None:
        """None when the terminal snapshot is visible; a DeliveryError otherwise (also on timeout)."""
        try:
            return await asyncio.wait_for(asyncio.shield(self._task), timeout)
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


class _wait_sink_retry(wait_base):
    """Fixed pause between final-update attempts, stretched to the platform's retry_after."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __call__(self, retry_state: RetryCallState) -> float:
        exc = retry_state.outcome.exception() if retry_state.outcome else None
        if isinstance(exc, SinkError) and exc.retry_after is not None:
            return max(self.delay, exc.retry_after)
        return self.delay


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
            sink = await asyncio.wait_for(channel.open_sink(target), self._settings.sink_update_timeout)
        except Exception as exc:  # open failed: the turn is delivered plainly
            raise DeliveryStartError(f"open failed: {type(exc).__name__}: {exc}") from exc
        try:
            task = self._supervisor.spawn(f"sink:{controller.snapshot.turn_id}", self._drive(sink, controller))
        except SupervisorClosedError as exc:
            with contextlib.suppress(Exception):
                await sink.abort()
            raise DeliveryStartError(str(exc)) from exc
        return DeliveryHandle(task, sink)

    async def _drive(self, sink: TurnSink, controller: TurnController) -> DeliveryError | None:
        try:
            async for snap in controller.watch():
                if snap.terminal:
                    return await self._finish(sink, snap)
                try:
                    await asyncio.wait_for(sink.update(snap), self._settings.sink_update_timeout)
                except Exception as exc:
                    # A failed live update is not fatal: the next snapshot (or the final) repeats the
                    # whole target state.
                    log.warning("sink update failed for turn %s: %s", snap.turn_id, exc)
            return DeliveryError("turn ended without a terminal snapshot")
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(sink.abort(), 5)
            raise

    async def _finish(self, sink: TurnSink, snap: TurnSnapshot) -> DeliveryError | None:
        s = self._settings
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_attempt(max(1, s.sink_finish_attempts)),
                wait=_wait_sink_retry(s.sink_finish_retry_delay),
                retry=retry_if_exception(_is_transient),
                reraise=True,
            ):
                with attempt:
                    await asyncio.wait_for(sink.finish(snap), s.sink_update_timeout)
        except Exception as exc:
            log.warning("final delivery failed for turn %s: %s", snap.turn_id, exc)
            undelivered: str | None = None
            with contextlib.suppress(Exception):
                undelivered = sink.undelivered(snap)
            return DeliveryError(f"{type(exc).__name__}: {exc}", undelivered)
        return None
