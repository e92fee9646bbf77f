"""A 429 whose retry-after is longer than the bridge waits, and an account out of quota: both end the turn at
once with words that tell the user (or the operator) what to do, instead of a chat stuck on its placeholder."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import pytest

from core.failures import TurnFailurePresenter, provider_failure
from core.llm.openai_provider import OpenAIProvider
from core.llm.provider import LLMMessage, LLMRequest, ProviderError, ProviderErrorKind
from core.llm.retry import MAX_RETRY_AFTER, collect_text, retry_policy, wait_bound
from tests.fakes.openai_server import FakeOpenAI, HttpError, StreamError, Text
from tests.support.harness import make_harness

KEY = "sk-cap-SECRET-abcdef0123456789"
REQUEST = LLMRequest(messages=(LLMMessage("user", "hello"),))
BOUND = 10.0
"""Seconds a request through the ladder may take here: it fails at once (a bridge that waited out the provider's
retry-after would sleep past this)."""


async def failed(provider: OpenAIProvider) -> ProviderError:
    """The error one request through the ladder (steps of 10 and 20 ms) ends with."""
    with pytest.raises(ProviderError) as info:
        async with asyncio.timeout(BOUND):
            async for attempt in retry_policy((0.01, 0.02)):
                with attempt:
                    [_ async for _ in provider.stream(REQUEST)]
    return info.value


@pytest.fixture
async def provider(fake_openai: FakeOpenAI) -> AsyncIterator[OpenAIProvider]:
    p = OpenAIProvider("m", fake_openai.base_url, KEY, request_timeout=2.0)
    yield p
    await p.aclose()


async def test_an_hour_long_retry_after_fails_the_turn_at_once(tmp_path, fake_openai: FakeOpenAI) -> None:
    # before: the turn slept the hour with "…" showing and the session busy (settle timed out)
    fake_openai.script(HttpError.rate_limit(retry_after=3600), Text("answer to the next message"))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("hi")
    await h.settle(timeout=5.0)
    assert len(fake_openai.requests) == 1  # not tried again after the hour either
    [shown] = h.platform.visible("c1")
    assert shown == ("⚠️ The model provider is rate-limiting the bridge and asked it to wait 60 minutes. "
                     "Please try again after that.")
    await h.say("hi again")  # the session is free: the next message is answered
    await h.settle(timeout=5.0)
    assert h.platform.visible("c1")[-1] == "answer to the next message"
    await h.core.shutdown()


async def test_the_user_is_told_roughly_when_to_try_again(fake_openai: FakeOpenAI,
                                                           provider: OpenAIProvider) -> None:
    fake_openai.script(HttpError.rate_limit(retry_after=3600), Text("must not be reached"))
    text = TurnFailurePresenter().failure(provider_failure(await failed(provider)))
    assert text == ("⚠️ The model provider is rate-limiting the bridge and asked it to wait 60 minutes. "
                    "Please try again after that.")
    # a wait within a minute keeps the usual words (the ladder waited it out and still failed)
    short = provider_failure(ProviderError(ProviderErrorKind.RATE_LIMIT, retry_after=20.0))
    assert TurnFailurePresenter().failure(short).endswith("Please try again in a minute.")


async def test_every_user_of_the_policy_gets_the_bound(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    # titles go through collect_text; compaction and transcription through retry_policy, the same bound
    fake_openai.script(HttpError.rate_limit(retry_after=MAX_RETRY_AFTER + 1), Text("a title"))
    retries: list[float] = []
    with pytest.raises(ProviderError) as info:
        async with asyncio.timeout(BOUND):
            await collect_text(provider, REQUEST, (1.0, 3.0), timeout=2.0,
                               on_retry=lambda error, attempt, sleep: retries.append(sleep))
    assert info.value.kind is ProviderErrorKind.RATE_LIMIT
    assert info.value.retry_after == MAX_RETRY_AFTER + 1
    assert retries == []
    assert len(fake_openai.requests) == 1


def test_a_ladder_with_longer_steps_waits_longer() -> None:
    assert wait_bound((2.0, 4.0, 8.0, 16.0, 30.0)) == MAX_RETRY_AFTER == 60.0
    assert wait_bound((30.0, 120.0)) == 120.0  # the operator chose to wait that long
    assert wait_bound(()) == MAX_RETRY_AFTER


async def test_insufficient_quota_is_not_retried_and_names_the_operator(tmp_path, fake_openai: FakeOpenAI,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    # before: retried five times, then "rate-limiting the bridge. Please try again in a minute"
    caplog.set_level(logging.WARNING, logger="core.runner")
    fake_openai.default = HttpError.quota()
    h = await make_harness(tmp_path, fake_openai)
    await h.say("hi")
    await h.settle(timeout=5.0)
    assert len(fake_openai.requests) == 1
    assert h.platform.visible("c1") == [
        "⚠️ The model provider says the bridge's account has run out of quota (its credit or budget is used up), "
        "so no answer can be written until the operator tops it up or raises the limit."]
    # the operator's log line names the kind and keeps the provider's words
    assert any("quota: " in r.getMessage() and "check your plan and billing" in r.getMessage()
               for r in caplog.records)
    await h.core.shutdown()


@pytest.mark.parametrize(
    "reply",
    [
        HttpError.quota(),
        HttpError(402, {"error": {"message": "Insufficient Balance", "type": "unknown_error", "code": None}}),
        StreamError("You exceeded your current quota.", code="insufficient_quota", type="insufficient_quota"),
    ],
    ids=["openai-429", "http-402", "in-stream"],
)
async def test_quota_errors_map_to_quota(fake_openai: FakeOpenAI, provider: OpenAIProvider,
                                         reply: HttpError | StreamError) -> None:
    fake_openai.script(reply, Text("must not be reached"))
    error = await failed(provider)
    assert error.kind is ProviderErrorKind.QUOTA
    assert not error.retryable
    assert len(fake_openai.requests) == 1
    assert KEY not in str(error)
