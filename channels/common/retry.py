"""Retrying transient platform errors (5xx, timeouts, network) with tenacity.

Rate limits are deliberately not retried here: a 429 pauses the whole chat (``ChatThrottle.pause``) and
the caller decides when to repeat its target state. A call whose outcome is unknown (a send that timed
out) is repeated at most ``unknown_outcome_attempts - 1`` times, so a message can appear twice at worst
once, never more (DESIGN.md §4).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

from tenacity import AsyncRetrying, RetryCallState, stop_after_attempt, wait_exponential

from channels.common.errors import PlatformError

T = TypeVar("T")


class RetryPolicy:
    def __init__(self, *, attempts: int = 3, unknown_outcome_attempts: int = 2, initial_wait: float = 0.2,
                 max_wait: float = 2.0) -> None:
        self.attempts = attempts
        self.unknown_outcome_attempts = unknown_outcome_attempts
        self.initial_wait = initial_wait
        self.max_wait = max_wait

    def _should_retry(self, state: RetryCallState) -> bool:
        exc = state.outcome.exception() if state.outcome else None
        if not isinstance(exc, PlatformError) or exc.kind != "transient":
            return False
        if exc.outcome_unknown and state.attempt_number >= self.unknown_outcome_attempts:
            return False
        return True

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(max(1, self.attempts)),
            wait=wait_exponential(multiplier=self.initial_wait, max=self.max_wait),
            retry=self._should_retry,
            reraise=True,
        ):
            with attempt:
                return await fn()
        raise AssertionError("unreachable")  # pragma: no cover
