"""The provider retry ladder (tenacity).

Only ``ProviderError``s with ``retryable`` set are retried (timeout, transient, rate limit, malformed);
auth, quota, bad request and context overflow fail at once. So does a rate limit whose ``retry-after`` is
longer than the bridge will wait (``MAX_RETRY_AFTER``, or the ladder's longest step if that is longer): a turn
that sleeps through it shows only its "…" and keeps the session busy the whole time, and every later
message queues behind it; failing says so now, and when to try again. Usage::

    async for attempt in retry_policy(settings.retry_delays, on_retry=log_retry):
        with attempt:
            async for event in provider.stream(request):
                ...

The last error is re-raised as is (never wrapped in ``tenacity.RetryError``).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence

import tenacity

from core.llm.provider import LLMProvider, LLMRequest, ProviderError, ProviderErrorKind, TextDelta
from core.llm.silence import bounded
from core.settings import DEFAULT_RETRY_DELAYS

OnRetry = Callable[[ProviderError, int, float], Awaitable[None] | None]
"""``on_retry(error, attempt_number, sleep_seconds)``: attempt ``attempt_number`` (1-based) failed with
``error``; the next attempt starts after ``sleep_seconds``. Called before the sleep; may be async."""


def counting(tally: Callable[[], None] | None) -> OnRetry | None:
    """An ``on_retry`` that only counts the retries (``tally()`` once each: the metrics' model retries)."""
    if tally is None:
        return None

    def on_retry(error: ProviderError, attempt: int, sleep: float) -> None:
        tally()

    return on_retry


MAX_RETRY_AFTER = 60.0
"""The longest ``retry-after`` waited out (unless the ladder has a longer step). A minute covers the
per-minute windows providers limit requests and tokens by, and is as long as a chat already waits for a
model's first token (``DEFAULT_REQUEST_TIMEOUT``); a longer one (an hourly or daily limit) would leave the chat
showing nothing but its "…" for that long."""


def wait_bound(ladder: Sequence[float]) -> float:
    """The longest ``retry-after`` a policy with this ladder waits out: an operator who set longer steps has
    accepted longer waits."""
    return max((MAX_RETRY_AFTER, *ladder))


def total_bound(ladder: Sequence[float]) -> float:
    """The most a policy with this ladder waits in all, retry-afters included: the ladder's own waits (a
    minute by default), or ``MAX_RETRY_AFTER`` if that is longer. A provider asking for a minute before every
    attempt would otherwise hold the chat on its "…" for five."""
    return max(MAX_RETRY_AFTER, sum(ladder))


def retry_policy(
    delays: Sequence[float] = DEFAULT_RETRY_DELAYS, *, on_retry: OnRetry | None = None
) -> tenacity.AsyncRetrying:
    """At most ``len(delays) + 1`` attempts; before retry ``n`` wait ``delays[n-1]`` seconds.

    A rate-limit error with ``retry_after`` waits ``max(delays[n-1], retry_after)``; one whose ``retry_after``
    is over ``wait_bound(delays)`` is not retried: it is raised at once, as is. Nor is any error whose wait
    would take the waits in all past ``total_bound(delays)``.
    """
    ladder = tuple(float(d) for d in delays)
    bound = wait_bound(ladder)
    total = total_bound(ladder)

    def waited_enough(state: tenacity.RetryCallState) -> bool:
        # tenacity works out the next wait (``upcoming_sleep``) before it asks whether to stop
        return state.idle_for + state.upcoming_sleep > total

    # at most ``len(ladder) + 1`` attempts, and no wait past ``total``

    def is_retryable(exc: BaseException) -> bool:
        if not isinstance(exc, ProviderError) or not exc.retryable:
            return False
        return not (exc.kind is ProviderErrorKind.RATE_LIMIT and exc.retry_after is not None
                    and exc.retry_after > bound)

    def wait(state: tenacity.RetryCallState) -> float:
        if not ladder:
            return 0.0
        base = ladder[min(state.attempt_number, len(ladder)) - 1]
        outcome = state.outcome
        error = outcome.exception() if outcome is not None and outcome.failed else None
        if (
            isinstance(error, ProviderError)
            and error.kind is ProviderErrorKind.RATE_LIMIT
            and error.retry_after is not None
        ):
            return max(base, error.retry_after)
        return base

    async def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is None:
            return
        outcome = state.outcome
        error = outcome.exception() if outcome is not None else None
        if not isinstance(error, ProviderError):  # pragma: no cover - only ProviderErrors are retried
            return
        sleep = state.next_action.sleep if state.next_action is not None else state.upcoming_sleep
        result = on_retry(error, state.attempt_number, float(sleep))
        if inspect.isawaitable(result):
            await result

    return tenacity.AsyncRetrying(
        retry=tenacity.retry_if_exception(is_retryable),
        stop=lambda state: state.attempt_number > len(ladder) or waited_enough(state),
        wait=wait,
        before_sleep=before_sleep if on_retry is not None else None,
        reraise=True,
    )


async def collect_text(
    provider: LLMProvider,
    request: LLMRequest,
    delays: Sequence[float] = DEFAULT_RETRY_DELAYS,
    *,
    timeout: float,
    on_retry: OnRetry | None = None,
) -> str:
    """Run one request through the ladder and return its concatenated answer text (e.g. for titles).

    ``timeout`` bounds the stream's silence (``core.llm.silence``). Each attempt starts from scratch, so a
    reply cut short mid-way never leaks into the result.
    """
    async for attempt in retry_policy(delays, on_retry=on_retry):
        with attempt:
            parts: list[str] = []
            async for event in bounded(provider.stream(request), timeout):
                if isinstance(event, TextDelta):
                    parts.append(event.text)
            return "".join(parts)
    raise AssertionError("unreachable: the retry policy either returns or re-raises")  # pragma: no cover
