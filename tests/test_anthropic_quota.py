"""An Anthropic account whose credit balance is used up: the API answers a 400 invalid_request_error ("Your
credit balance is too low ..."), which the chat words as an account out of quota, not as a refused request,
and which is not retried."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from core.llm.anthropic_provider import AnthropicProvider
from core.llm.provider import LLMMessage, LLMRequest, ProviderError, ProviderErrorKind
from core.llm.retry import retry_policy
from tests.fakes.anthropic_server import FakeAnthropic, HttpError
from tests.support.harness import anthropic_harness

KEY = "sk-ant-quota-SECRET-0123456789abcdef"
REQUEST = LLMRequest(messages=(LLMMessage("user", "hello"),))


@pytest.fixture
async def provider(fake_anthropic: FakeAnthropic) -> AsyncIterator[AnthropicProvider]:
    p = AnthropicProvider("claude-test", fake_anthropic.base_url, KEY, request_timeout=2.0)
    yield p
    await p.aclose()


async def failed(provider: AnthropicProvider) -> ProviderError:
    """The error one request through the ladder (steps of 10 and 20 ms) ends with."""
    with pytest.raises(ProviderError) as info:
        async for attempt in retry_policy((0.01, 0.02)):
            with attempt:
                [_ async for _ in provider.stream(REQUEST)]
    return info.value


async def test_a_used_up_credit_balance_is_worded_as_out_of_quota(tmp_path: Path, fake_anthropic: FakeAnthropic,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    # before: "The model provider refused the request. The operator can find details in ..." (a bad request)
    caplog.set_level(logging.WARNING, logger="core.runner")
    fake_anthropic.default = HttpError.credit_too_low()
    h = await anthropic_harness(tmp_path, fake_anthropic, api_key=KEY)
    try:
        await h.say("hi")
        await h.settle(timeout=5.0)
        assert len(fake_anthropic.requests) == 1
        assert h.platform.visible("c1") == [
            "⚠️ The model provider says the bridge's account has run out of quota (its credit or budget is used "
            "up), so no answer can be written until the operator tops it up or raises the limit."]
        # the operator's log line names the kind and keeps the provider's words, not the key
        lines = [r.getMessage() for r in caplog.records]
        assert any("quota: " in line and "credit balance is too low" in line for line in lines)
        assert not any(KEY in line for line in lines)
    finally:
        await h.core.shutdown()


async def test_only_the_credit_balance_message_is_quota(fake_anthropic: FakeAnthropic,
                                                        provider: AnthropicProvider) -> None:
    fake_anthropic.script(HttpError.credit_too_low())
    error = await failed(provider)
    assert (error.kind, error.status, error.retryable) == (ProviderErrorKind.QUOTA, 400, False)
    assert len(fake_anthropic.requests) == 1
    # any other 400 invalid_request_error is still a refused request
    fake_anthropic.script(HttpError.bad_request())
    assert (await failed(provider)).kind is ProviderErrorKind.BAD_REQUEST
    assert len(fake_anthropic.requests) == 2
