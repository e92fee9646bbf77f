"""The retry ladder, with the real openai SDK against the fake server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence

import pytest
import tenacity

from core.llm.openai_provider import OpenAIProvider
from core.llm.provider import (
    LLMMessage,
    LLMRequest,
    ProviderError,
    ProviderErrorKind,
    ProviderEvent,
    TextDelta,
)
from core.llm.retry import OnRetry, collect_text, retry_policy
from core.settings import DEFAULT_RETRY_DELAYS
from tests.fakes.openai_server import FakeOpenAI, Hang, HttpError, Malformed, StreamError, Text

KEY = "sk-retry-SECRET-abcdef0123456789"
REQUEST = LLMRequest(messages=(LLMMessage("user", "hello"),))
LADDER = (0.01, 0.02)


@pytest.fixture
async def provider(fake_openai: FakeOpenAI) -> AsyncIterator[OpenAIProvider]:
    p = OpenAIProvider("m", fake_openai.base_url, KEY, request_timeout=0.3)
    yield p
    await p.aclose()


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[ProviderErrorKind, int, float]] = []

    def __call__(self, error: ProviderError, attempt: int, sleep: float) -> None:
        self.calls.append((error.kind, attempt, sleep))

    @property
    def sleeps(self) -> list[float]:
        return [s for _, _, s in self.calls]


async def run(
    provider: OpenAIProvider, delays: Sequence[float] = LADDER, on_retry: OnRetry | None = None
) -> str:
    async for attempt in retry_policy(delays, on_retry=on_retry):
        with attempt:
            events: list[ProviderEvent] = [e async for e in provider.stream(REQUEST)]
            return "".join(e.text for e in events if isinstance(e, TextDelta))
    raise AssertionError("unreachable")


async def test_auth_is_not_retried(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake_openai.default = HttpError.auth()
    rec = Recorder()
    with pytest.raises(ProviderError) as info:
        await run(provider, (0.01, 0.01, 0.01), rec)
    assert info.value.kind is ProviderErrorKind.AUTH
    assert len(fake_openai.requests) == 1  # no retry storm
    assert rec.calls == []
    assert KEY not in str(info.value)


async def test_server_error_then_success(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake_openai.script(HttpError.server(503), Text("recovered"))
    rec = Recorder()
    assert await run(provider, LADDER, rec) == "recovered"
    assert len(fake_openai.requests) == 2
    assert rec.calls == [(ProviderErrorKind.TRANSIENT, 1, 0.01)]


async def test_waits_follow_the_ladder(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake_openai.script(
        HttpError.server(503), HttpError.server(502), HttpError.server(500), Text("third time")
    )
    rec = Recorder()
    started = time.monotonic()
    assert await run(provider, (0.01, 0.02, 0.04), rec) == "third time"
    assert time.monotonic() - started >= 0.07
    assert rec.sleeps == [0.01, 0.02, 0.04]
    assert [a for _, a, _ in rec.calls] == [1, 2, 3]
    assert len(fake_openai.requests) == 4


async def test_gives_up_after_the_ladder_with_the_last_error(
    fake_openai: FakeOpenAI, provider: OpenAIProvider
) -> None:
    fake_openai.default = HttpError.server(503)
    rec = Recorder()
    with pytest.raises(ProviderError) as info:  # the error itself, not tenacity.RetryError
        await run(provider, LADDER, rec)
    assert info.value.kind is ProviderErrorKind.TRANSIENT
    assert info.value.status == 503
    assert len(fake_openai.requests) == len(LADDER) + 1
    assert rec.sleeps == list(LADDER)


async def test_rate_limit_honours_retry_after(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    # retry-after longer than the ladder step wins; shorter loses to the ladder
    fake_openai.script(HttpError.rate_limit(0.2), HttpError.rate_limit(0.001), Text("through"))
    rec = Recorder()
    started = time.monotonic()
    assert await run(provider, (0.01, 0.05), rec) == "through"
    assert time.monotonic() - started >= 0.25
    assert rec.calls == [(ProviderErrorKind.RATE_LIMIT, 1, 0.2), (ProviderErrorKind.RATE_LIMIT, 2, 0.05)]
    assert len(fake_openai.requests) == 3


async def test_hang_times_out_then_ladder_then_final_error(
    fake_openai: FakeOpenAI, provider: OpenAIProvider
) -> None:
    fake_openai.default = Hang(10, after_text="partial")
    rec = Recorder()
    started = time.monotonic()
    with pytest.raises(ProviderError) as info:
        await run(provider, LADDER, rec)
    elapsed = time.monotonic() - started
    assert info.value.kind is ProviderErrorKind.TIMEOUT
    assert rec.calls == [(ProviderErrorKind.TIMEOUT, 1, 0.01), (ProviderErrorKind.TIMEOUT, 2, 0.02)]
    assert len(fake_openai.requests) == 3
    assert 0.9 <= elapsed < 3.0  # three attempts of ~request_timeout each (not the 10 s hang), plus the tiny waits


async def test_malformed_is_retried(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake_openai.script(Malformed(after_text="garbage"), StreamError("odd", type="invalid_request_error"), Text("clean"))
    rec = Recorder()
    assert await run(provider, LADDER, rec) == "clean"
    assert [k for k, _, _ in rec.calls] == [ProviderErrorKind.MALFORMED, ProviderErrorKind.MALFORMED]
    assert len(fake_openai.requests) == 3


@pytest.mark.parametrize(
    ("reply", "kind"),
    [
        (HttpError.context_overflow(), ProviderErrorKind.CONTEXT_OVERFLOW),
        (HttpError.bad_request(), ProviderErrorKind.BAD_REQUEST),
        (HttpError.forbidden(), ProviderErrorKind.AUTH),
    ],
)
async def test_permanent_errors_are_not_retried(
    fake_openai: FakeOpenAI, provider: OpenAIProvider, reply: HttpError, kind: ProviderErrorKind
) -> None:
    fake_openai.script(reply, Text("must not be reached"))
    rec = Recorder()
    with pytest.raises(ProviderError) as info:
        await run(provider, LADDER, rec)
    assert info.value.kind is kind
    assert len(fake_openai.requests) == 1
    assert rec.calls == []


async def test_async_on_retry_is_awaited_before_the_sleep(
    fake_openai: FakeOpenAI, provider: OpenAIProvider
) -> None:
    fake_openai.script(HttpError.server(503), Text("ok"))
    seen: list[tuple[int, float, int]] = []

    async def on_retry(error: ProviderError, attempt: int, sleep: float) -> None:
        await asyncio.sleep(0)
        seen.append((attempt, sleep, len(fake_openai.requests)))

    assert await run(provider, LADDER, on_retry) == "ok"
    assert seen == [(1, 0.01, 1)]


async def test_empty_ladder_means_one_attempt(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake_openai.script(HttpError.server(503), Text("unused"))
    with pytest.raises(ProviderError):
        await run(provider, ())
    assert len(fake_openai.requests) == 1


async def test_non_provider_errors_propagate_without_retry() -> None:
    attempts = 0
    with pytest.raises(KeyError):
        async for attempt in retry_policy(LADDER):
            with attempt:
                attempts += 1
                raise KeyError("bug")
    assert attempts == 1


async def test_ladder_clamps_to_its_last_step_and_default() -> None:
    # without a server: rate-limit waits beyond the ladder length reuse the last step
    sleeps: list[float] = []
    errors = iter(
        [
            ProviderError(ProviderErrorKind.TIMEOUT),
            ProviderError(ProviderErrorKind.RATE_LIMIT, retry_after=0.03),
        ]
    )
    async for attempt in retry_policy((0.001, 0.002), on_retry=lambda e, n, s: sleeps.append(s)):
        with attempt:
            error = next(errors, None)
            if error is not None:
                raise error
    assert sleeps == [0.001, 0.03]


async def without_sleeping(policy: tenacity.AsyncRetrying, error: ProviderError) -> list[float]:
    """The waits ``policy`` would make (not made) for an attempt that fails with ``error`` every time."""
    sleeps: list[float] = []

    async def note(seconds: float) -> None:
        sleeps.append(seconds)

    policy.sleep = note
    with pytest.raises(ProviderError):
        async for attempt in policy:
            with attempt:
                raise error
    return sleeps


async def test_the_default_ladder_makes_six_attempts() -> None:
    sleeps = await without_sleeping(retry_policy(), ProviderError(ProviderErrorKind.TIMEOUT))
    assert sleeps == list(DEFAULT_RETRY_DELAYS)  # five waits: six attempts


async def test_retry_afters_within_the_bound_still_stop_at_the_ladders_total() -> None:
    # a provider asking for a minute before every attempt waited five minutes in all, the chat on its placeholder
    minute = ProviderError(ProviderErrorKind.RATE_LIMIT, retry_after=60.0)
    assert await without_sleeping(retry_policy(), minute) == [60.0]
    half = ProviderError(ProviderErrorKind.RATE_LIMIT, retry_after=20.0)
    assert await without_sleeping(retry_policy(), half) == [20.0, 20.0, 20.0]
    # an operator's longer ladder is a longer total
    assert await without_sleeping(retry_policy((50.0, 50.0)), minute) == [60.0]
    assert await without_sleeping(retry_policy((50.0, 50.0, 50.0)), minute) == [60.0, 60.0]


async def test_collect_text_through_the_ladder(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    # the partial text of a failed attempt never leaks into the result
    fake_openai.script(
        HttpError.server(503), Malformed(after_text="Broken ti"), Text("A fine title", chunk_size=3)
    )
    assert await collect_text(provider, REQUEST, LADDER, timeout=2.0) == "A fine title"
    assert len(fake_openai.requests) == 3


async def test_collect_text_reraises_permanent_errors(
    fake_openai: FakeOpenAI, provider: OpenAIProvider
) -> None:
    fake_openai.script(HttpError.auth())
    with pytest.raises(ProviderError) as info:
        await collect_text(provider, REQUEST, LADDER, timeout=2.0)
    assert info.value.kind is ProviderErrorKind.AUTH
    assert len(fake_openai.requests) == 1
