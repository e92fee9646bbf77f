"""Run an operation under a tenacity policy without paying for the policy when the first try succeeds.

Building and driving a tenacity ``AsyncRetrying`` costs about 28 µs, and every turn runs two policies (the
model request ladder and the sink's final update) whose first try nearly always succeeds. So the first
try runs bare; if it fails, the policy takes over with that failure as its attempt 1 (its retry
predicate, waits, stop rule and callbacks see exactly what they would have seen) and makes every further
attempt. Retrying itself stays tenacity's business.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar, cast

import tenacity

T = TypeVar("T")
_UNSET = object()


async def run_with_retries(policy: Callable[[], tenacity.AsyncRetrying], body: Callable[[], Awaitable[T]]) -> T:
    """``await body()``; on an exception, ``policy()`` decides about retrying (its first attempt is the
    failure that already happened) and the last error is whatever the policy re-raises."""
    try:
        return await body()
    except Exception as exc:
        first: Exception | None = exc
    result: object = _UNSET
    async for attempt in policy():
        with attempt:
            if first is not None:
                failure, first = first, None
                raise failure
            result = await body()
    if result is _UNSET:  # pragma: no cover - a policy either ends in success or re-raises
        raise RuntimeError("retry policy ended without a result")
    return cast(T, result)
