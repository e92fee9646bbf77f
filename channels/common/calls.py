"""The one policy every platform call of a channel goes through: pacing, 429 pauses and retries.

Each attempt of a call, the first and every retry, waits for a free slot in the call's throttle scopes and
takes it: a retry is a call like any other and never reaches a chat sooner than the chat's pace allows.
Each attempt is bounded by the policy's ``timeout``. Then:

- transient (5xx, network, timeout): tried again, up to ``attempts`` tries in all, after a backoff. A call
  whose outcome is unknown (a send that timed out may have been carried out) is tried at most
  ``unknown_outcome_attempts`` times unless it is idempotent (an edit or a delete repeats a target state;
  a send carrying an idempotency key the platform honours), so a message appears twice at worst once;
  a call that fails in the end says so (``PlatformError.outcome_unknown``) when any of its tries timed
  out, not only the last, so its caller does not send it again (``core.redelivery``); a call that is itself
  the repeat of one whose outcome was unknown (``repeat``: a live update's send, made again at the end of the
  turn) has used that repeat: it is not tried again when its own outcome is unknown;
- rate_limited (429): the limited scope is paused for retry_after (``Throttle.pause``, the one pause
  mechanism) and the call is made again once the pause is over, however long; a pause does not use up an
  attempt (at most ``max_pauses`` of them per call, so a call stays bounded);
- anything else is raised at once, as is the last failure.

A budget that only part of an attempt counts against (Feishu's sends, shared by the app, inside a streamed
update that also creates and updates a card) is taken inside the attempt with ``pace``; its wait, like the
pace before an attempt, does not count against the attempt's bound (the bound is suspended while it waits),
so a long queue for the budget never turns into a timed-out, half-done attempt. ``outside_bound`` does the
same for any other wait of the bridge's own inside an attempt (a channel's cap on requests in flight).

Each attempt is counted once for the metrics (``observe``) by its result, and one failure once: an error that
several calls share (Feishu's tenant token, fetched once for every call waiting on it, fails them all with the
one error object it raised) counts for the first attempt it failed, not again for each waiter.

``retry=False`` tries once: a live update is superseded by the next one, which repeats the whole target
state with newer content, so retrying it would only show something stale later. Its 429 still pauses the
scope. Retrying is tenacity's business; the first try runs bare (``core.retrying``).
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from channels.common.errors import PlatformError
from channels.common.throttle import Scope, Throttle
from core.metrics import CallResult
from core.retrying import run_with_retries

T = TypeVar("T")

_counted: weakref.WeakSet[PlatformError] = weakref.WeakSet()
"""The failures an attempt was counted for already (see the module docstring)."""

_bound: ContextVar[asyncio.Timeout | None] = ContextVar("attempt_bound", default=None)
"""The bound of the attempt running in this task (``Calls.call``), if any."""


@dataclass(frozen=True, slots=True)
class CallPolicy:
    attempts: int = 3
    """Tries of a call that keeps failing transiently, the first included (the final update's bound)."""
    unknown_outcome_attempts: int = 2
    """Tries of a non-idempotent call whose outcome was unknown (so it is repeated at most once)."""
    initial_wait: float = 0.5
    max_wait: float = 4.0
    max_pauses: int = 20
    """429 pauses one call waits out before it gives up."""
    timeout: float | None = 30.0
    """Bound on one attempt (the pace and pause waits before it are not counted)."""


def _error(state: RetryCallState) -> PlatformError | None:
    exc = state.outcome.exception() if state.outcome is not None else None
    return exc if isinstance(exc, PlatformError) else None


class _Stop(stop_base):
    def __init__(self, policy: CallPolicy, idempotent: bool, repeat: bool = False) -> None:
        self.policy = policy
        self.idempotent = idempotent
        self.failures = 0
        self.unknown_before = 1 if repeat else 0
        """Tries made before this call whose outcome is unknown (its earlier self, for a ``repeat``)."""
        self.pauses = 0

    def __call__(self, state: RetryCallState) -> bool:
        exc = _error(state)
        if exc is not None and exc.kind == "rate_limited":
            self.pauses += 1
            return self.pauses > self.policy.max_pauses
        self.failures += 1
        if exc is not None and exc.outcome_unknown and not self.idempotent:
            return self.unknown_before + self.failures >= self.policy.unknown_outcome_attempts
        return self.failures >= self.policy.attempts


class _Wait(wait_base):
    """Backoff after a transient failure; after a 429 the throttle's pause is the wait (or, for a call
    outside every scope, the retry_after itself)."""

    def __init__(self, policy: CallPolicy, scoped: bool) -> None:
        self.policy = policy
        self.scoped = scoped
        self.failures = 0

    def __call__(self, state: RetryCallState) -> float:
        exc = _error(state)
        if exc is not None and exc.kind == "rate_limited":
            return 0.0 if self.scoped else max(0.0, float(exc.retry_after or 0.0))
        self.failures += 1
        return float(min(self.policy.max_wait, self.policy.initial_wait * 2.0 ** (self.failures - 1)))


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, PlatformError) and exc.kind in ("transient", "rate_limited")


class Calls:
    def __init__(self, throttle: Throttle, policy: CallPolicy | None = None, *,
                 observe: Callable[[CallResult], None] | None = None) -> None:
        """``observe`` is told the result of every attempt (``ChannelHost.count_call``, for the metrics)."""
        self.throttle = throttle
        self.policy = policy or CallPolicy()
        self.observe = observe

    async def call(self, fn: Callable[[], Awaitable[T]], *, scopes: Sequence[Scope] = (), paced: bool = True,
                   retry: bool = True, idempotent: bool = True, timeout: float | None = None,
                   repeat: bool = False) -> T:
        """Run one platform call (``fn`` makes one attempt and raises PlatformError) under the policy.
        ``paced=False`` honours the scopes' pauses without taking a slot; ``timeout`` overrides the
        policy's bound on one attempt (a long poll); ``repeat``: an earlier call of the same non-idempotent
        request may have been carried out (its one repeat is this call)."""
        bound = timeout if timeout is not None else self.policy.timeout
        unknown = False
        """A try of this call timed out: it may have been carried out."""

        async def attempt() -> T:
            nonlocal unknown
            if scopes:
                if paced:
                    await self.throttle.reserve(scopes)
                else:
                    await self.throttle.wait_unpaused(scopes)
            try:
                if bound is None:
                    result = await fn()
                else:
                    async with asyncio.timeout(bound) as timer:
                        token = _bound.set(timer)
                        try:
                            result = await fn()
                        finally:
                            _bound.reset(token)
            except TimeoutError:
                self._observe("error")
                unknown = True
                raise PlatformError(f"no answer within {bound:g}s", kind="transient", outcome_unknown=True) from None
            except PlatformError as exc:
                unknown = unknown or exc.outcome_unknown
                if exc not in _counted:
                    _counted.add(exc)
                    self._observe("rate_limited" if exc.kind == "rate_limited" else "error")
                if exc.kind == "rate_limited" and scopes:
                    self.throttle.pause(exc.scope or scopes[0].key, exc.retry_after or 1.0)
                raise
            self._observe("ok")
            return result

        if not retry:
            return await attempt()

        def policy() -> AsyncRetrying:
            return AsyncRetrying(stop=_Stop(self.policy, idempotent, repeat), wait=_Wait(self.policy, bool(scopes)),
                                 retry=retry_if_exception(_retryable), reraise=True)

        try:
            return await run_with_retries(policy, attempt)
        except PlatformError as exc:
            exc.outcome_unknown = exc.outcome_unknown or unknown  # an earlier try may have been carried out
            raise

    async def pace(self, scopes: Sequence[Scope]) -> None:
        """Take a slot in ``scopes`` from inside an attempt. The attempt's bound stands still while this waits
        (``outside_bound``), as the pace before an attempt is not counted either."""
        if self.throttle.ready_in(scopes) <= 0:
            await self.throttle.reserve(scopes)
            return
        async with outside_bound():
            await self.throttle.reserve(scopes)

    def _observe(self, result: CallResult) -> None:
        if self.observe is not None:
            self.observe(result)


@contextlib.asynccontextmanager
async def outside_bound() -> AsyncIterator[None]:
    """Inside, the bound of the attempt running in this task (``Calls.call``) stands still, keeping the time it
    had left: for a wait that is the bridge's own queue (a budget's slot, a turn among requests in flight),
    not the platform being slow to answer. Outside an attempt it does nothing."""
    timer = _bound.get()
    when = timer.when() if timer is not None else None
    loop = asyncio.get_running_loop()
    left = 0.0
    held = False
    if timer is not None and when is not None:
        left = when - loop.time()
        try:
            timer.reschedule(None)
            held = True
        except RuntimeError:  # a task started inside an attempt that is over since: no bound to hold
            pass
    try:
        yield
    finally:
        if held and timer is not None:
            timer.reschedule(loop.time() + left)
