"""AnthropicProvider driven through the real anthropic SDK against the fake Messages API (127.0.0.1 only)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anthropic
import pytest

from core.llm.anthropic_provider import AnthropicProvider
from core.llm.provider import (
    LLMMessage,
    LLMRequest,
    LLMToolCall,
    LLMToolSpec,
    ProviderError,
    ProviderErrorKind,
    ProviderEvent,
    ReasoningDelta,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from core.llm.retry import retry_policy
from core.llm.silence import bounded
from core.runtime import ChatCore
from core.sqlite_store import SqliteStore
from tests.fakes.anthropic_server import (
    FakeAnthropic,
    Function,
    Hang,
    HttpError,
    Malformed,
    StreamError,
    Text,
    ToolUses,
    Undecodable,
    last_user_text,
)
from tests.support.channel import TestChannel
from tests.support.harness import FAST, Harness

KEY = "sk-ant-test-SECRET-0123456789abcdef"
REQUEST = LLMRequest(messages=(LLMMessage("system", "be brief"), LLMMessage("user", "hello")))
TINY = (0.01, 0.02, 0.03)


@pytest.fixture
async def provider(fake_anthropic: FakeAnthropic) -> AsyncIterator[AnthropicProvider]:
    p = AnthropicProvider("claude-test", fake_anthropic.base_url, KEY, request_timeout=2.0)
    yield p
    await p.aclose()


async def collect(provider: AnthropicProvider, request: LLMRequest = REQUEST) -> list[ProviderEvent]:
    return [event async for event in provider.stream(request)]


def text_of(events: list[ProviderEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


async def failure(provider: AnthropicProvider, request: LLMRequest = REQUEST) -> ProviderError:
    with pytest.raises(ProviderError) as info:
        await collect(provider, request)
    return info.value


async def through_ladder(provider: AnthropicProvider, delays: tuple[float, ...] = TINY) -> str:
    """One request through core.llm.retry's ladder, as the runner does it."""
    async for attempt in retry_policy(delays):
        with attempt:
            return text_of(await collect(provider))
    raise AssertionError("unreachable")


# ---- streaming -----------------------------------------------------------------------------------


async def test_streaming_text_assembles_exactly(fake_anthropic: FakeAnthropic, provider: AnthropicProvider) -> None:
    answer = "Héllo, wörld! 你好 🌍 — line\nbreak, `code`  and  spaces "
    fake_anthropic.script(Text(answer, chunk_size=3))
    events = await collect(provider)

    assert text_of(events) == answer
    assert sum(isinstance(e, TextDelta) for e in events) > 5
    assert [e for e in events if isinstance(e, StreamEnd)] == [StreamEnd("stop")]
    assert events[-1] == StreamEnd("stop")

    (received,) = fake_anthropic.received
    body = received.body
    assert body["model"] == "claude-test"
    assert body["stream"] is True
    assert body["system"] == "be brief"
    assert body["messages"] == [{"role": "user", "content": "hello"}]
    assert body["max_tokens"] == 4096  # required by the API: the provider's default
    for absent in ("tools", "temperature"):
        assert absent not in body
    # the key goes in x-api-key, as the API documents, and nowhere else
    assert received.headers["x-api-key"] == KEY
    assert "authorization" not in received.headers
    assert received.headers["anthropic-version"]


@pytest.mark.parametrize(
    ("stop_reason", "finish"),
    [("end_turn", "stop"), ("max_tokens", "length"), ("stop_sequence", "stop_sequence"), ("refusal", "refusal")],
)
async def test_stop_reasons_map(
    fake_anthropic: FakeAnthropic, provider: AnthropicProvider, stop_reason: str, finish: str
) -> None:
    fake_anthropic.script(Text("x", stop_reason=stop_reason))
    assert (await collect(provider))[-1] == StreamEnd(finish)


async def test_thinking_becomes_reasoning(fake_anthropic: FakeAnthropic, provider: AnthropicProvider) -> None:
    fake_anthropic.script(Text("42", thinking="let me think about it", chunk_size=4))
    events = await collect(provider)
    reasoning = [e for e in events if isinstance(e, ReasoningDelta)]
    assert "".join(e.text for e in reasoning) == "let me think about it"
    assert len(reasoning) > 1
    assert text_of(events) == "42"
    assert events.index(reasoning[-1]) < next(i for i, e in enumerate(events) if isinstance(e, TextDelta))


async def test_parallel_tool_calls_assemble(fake_anthropic: FakeAnthropic, provider: AnthropicProvider) -> None:
    calls = [
        ("search", json.dumps({"query": "weather in Paris", "limit": 3})),
        ("get_time", json.dumps({"tz": "Europe/Paris"})),
        ("noop", ""),  # a call without arguments streams no JSON at all
    ]
    fake_anthropic.script(ToolUses(calls, text="Let me check.", fragment_size=4))
    events = await collect(provider)

    assert text_of(events) == "Let me check."
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert len(deltas) > len(calls) * 3  # arguments really arrived in fragments
    # the text block is content block 0, yet tool calls are numbered from 0 in the order they start
    assert sorted({d.index for d in deltas}) == [0, 1, 2]
    assembled: dict[int, dict[str, str]] = {}
    for d in deltas:
        slot = assembled.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        slot["id"] += d.id or ""
        slot["name"] += d.name or ""
        slot["arguments"] += d.arguments
    assert [(assembled[i]["name"], assembled[i]["arguments"]) for i in range(3)] == [
        calls[0],
        calls[1],
        ("noop", "{}"),
    ]
    assert [assembled[i]["id"] for i in range(3)] == ["toolu_1_0", "toolu_1_1", "toolu_1_2"]
    # id and name come once, on the first fragment of each call
    assert sum(1 for d in deltas if d.id) == 3
    assert events[-1] == StreamEnd("tool_calls")


async def test_usage_reported_once_before_end(fake_anthropic: FakeAnthropic, provider: AnthropicProvider) -> None:
    fake_anthropic.script(Text("counted", usage=(12, 34)))
    events = await collect(provider)
    assert [e for e in events if isinstance(e, Usage)] == [Usage(prompt_tokens=12, completion_tokens=34)]
    assert events[-2:] == [Usage(12, 34), StreamEnd("stop")]


async def test_request_maps_system_tools_and_tool_round_trip(
    fake_anthropic: FakeAnthropic, provider: AnthropicProvider
) -> None:
    calls = (
        LLMToolCall(id="toolu_a", name="get_time", arguments='{"tz": "UTC"}'),
        LLMToolCall(id="toolu_b", name="get_date", arguments=""),
    )
    request = LLMRequest(
        messages=(
            LLMMessage("system", "sys one"),
            LLMMessage("user", "what time is it?"),
            LLMMessage("system", "sys two"),
            LLMMessage("assistant", "Checking.", tool_calls=calls),
            LLMMessage("tool", "12:00", tool_call_id="toolu_a"),
            LLMMessage("tool", "2025-01-01", tool_call_id="toolu_b"),
            LLMMessage("assistant", "It is noon."),
            LLMMessage("user", "thanks"),
        ),
        tools=(
            LLMToolSpec("get_time", "Current time", {"type": "object", "properties": {"tz": {"type": "string"}}}),
            LLMToolSpec("get_date", "Current date", {}),
        ),
        max_tokens=64,
    )
    await collect(provider, request)
    body = fake_anthropic.requests[0]
    assert body["system"] == "sys one\n\nsys two"
    assert body["messages"] == [
        {"role": "user", "content": "what time is it?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_a", "name": "get_time", "input": {"tz": "UTC"}},
                {"type": "tool_use", "id": "toolu_b", "name": "get_date", "input": {}},
            ],
        },
        {
            "role": "user",  # both results in one user turn
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_a", "content": "12:00"},
                {"type": "tool_result", "tool_use_id": "toolu_b", "content": "2025-01-01"},
            ],
        },
        {"role": "assistant", "content": "It is noon."},
        {"role": "user", "content": "thanks"},
    ]
    assert body["tools"] == [
        {
            "name": "get_time",
            "description": "Current time",
            "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}},
        },
        {"name": "get_date", "description": "Current date", "input_schema": {"type": "object", "properties": {}}},
    ]
    assert body["max_tokens"] == 64


async def test_tool_result_followed_by_user_text_stays_one_turn(
    fake_anthropic: FakeAnthropic, provider: AnthropicProvider
) -> None:
    request = LLMRequest(
        messages=(
            LLMMessage("user", "go"),
            LLMMessage("assistant", "", tool_calls=(LLMToolCall("t1", "f", "not json"),)),
            LLMMessage("tool", "", tool_call_id="t1"),
            LLMMessage("user", "and now?"),
        )
    )
    await collect(provider, request)
    assert fake_anthropic.requests[0]["messages"] == [
        {"role": "user", "content": "go"},
        # input must be an object: unparseable arguments are kept, wrapped
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f",
                                           "input": {"arguments": "not json"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"},
                                     {"type": "text", "text": "and now?"}]},
    ]


async def test_temperature_is_not_sent(
    fake_anthropic: FakeAnthropic, provider: AnthropicProvider, caplog: pytest.LogCaptureFixture
) -> None:
    # the API version the SDK pins refuses sampling parameters (the fake does too)
    request = dataclasses.replace(REQUEST, temperature=0.3)
    with caplog.at_level(logging.WARNING, logger="core.llm.anthropic_provider"):
        assert text_of(await collect(provider, request)) == "ok"
        assert text_of(await collect(provider, request)) == "ok"
    assert "temperature" not in fake_anthropic.requests[0]
    assert sum("temperature" in r.getMessage() for r in caplog.records) == 1  # said once


async def test_function_reply_echoes(fake_anthropic: FakeAnthropic, provider: AnthropicProvider) -> None:
    fake_anthropic.script(Function(lambda body: Text("echo: " + last_user_text(body))))
    assert text_of(await collect(provider)) == "echo: hello"


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "kind", "status"),
    [
        (HttpError.auth(), ProviderErrorKind.AUTH, 401),
        (HttpError.forbidden(), ProviderErrorKind.AUTH, 403),
        (HttpError.overloaded(), ProviderErrorKind.TRANSIENT, 529),
        (HttpError.server(500), ProviderErrorKind.TRANSIENT, 500),
        (HttpError(502, body=None), ProviderErrorKind.TRANSIENT, 502),
        (HttpError.rate_limit(), ProviderErrorKind.RATE_LIMIT, 429),
        (HttpError.prompt_too_long(), ProviderErrorKind.CONTEXT_OVERFLOW, 400),
        (
            HttpError.of(400, "invalid_request_error", "input length and `max_tokens` exceed context limit: 1 + 2"),
            ProviderErrorKind.CONTEXT_OVERFLOW,
            400,
        ),
        (HttpError.of(413, "request_too_large", "Request exceeds the maximum size"),
         ProviderErrorKind.CONTEXT_OVERFLOW, 413),
        (HttpError.bad_request(), ProviderErrorKind.BAD_REQUEST, 400),
        (HttpError.of(404, "not_found_error", "model: claude-nope"), ProviderErrorKind.BAD_REQUEST, 404),
        (Malformed(), ProviderErrorKind.MALFORMED, None),
        (StreamError(), ProviderErrorKind.TRANSIENT, None),  # in-stream overloaded_error
        (StreamError("api_error", "Internal server error"), ProviderErrorKind.TRANSIENT, None),
        (StreamError("invalid_request_error", "something odd"), ProviderErrorKind.MALFORMED, None),
        (Hang(0.05, after_text="cut short"), ProviderErrorKind.TRANSIENT, None),  # ends without message_stop
    ],
)
async def test_error_mapping(
    fake_anthropic: FakeAnthropic,
    provider: AnthropicProvider,
    reply: HttpError | Malformed | StreamError | Hang,
    kind: ProviderErrorKind,
    status: int | None,
) -> None:
    fake_anthropic.script(reply)
    error = await failure(provider)
    assert error.kind is kind
    assert error.status == status
    assert error.retryable == (
        kind not in {ProviderErrorKind.AUTH, ProviderErrorKind.CONTEXT_OVERFLOW, ProviderErrorKind.BAD_REQUEST}
    )
    assert len(fake_anthropic.requests) == 1  # the SDK never retries on its own


async def test_in_stream_overloaded_after_partial_text(
    fake_anthropic: FakeAnthropic, provider: AnthropicProvider
) -> None:
    fake_anthropic.script(StreamError(after_text="partial answer"))
    seen: list[ProviderEvent] = []
    with pytest.raises(ProviderError) as info:
        async for event in provider.stream(REQUEST):
            seen.append(event)
    assert info.value.kind is ProviderErrorKind.TRANSIENT
    assert "Overloaded" in info.value.detail
    assert info.value.extra["error_type"] == "overloaded_error"
    assert text_of(seen) == "partial answer"
    assert not any(isinstance(e, StreamEnd) for e in seen)


async def test_malformed_after_partial_text(fake_anthropic: FakeAnthropic, provider: AnthropicProvider) -> None:
    fake_anthropic.script(Malformed(after_text="partial answer"))
    seen: list[ProviderEvent] = []
    with pytest.raises(ProviderError) as info:
        async for event in provider.stream(REQUEST):
            seen.append(event)
    assert info.value.kind is ProviderErrorKind.MALFORMED
    assert text_of(seen) == "partial answer"
    assert not any(isinstance(e, StreamEnd) for e in seen)


async def test_auth_fails_at_once_through_the_ladder(
    fake_anthropic: FakeAnthropic, provider: AnthropicProvider
) -> None:
    fake_anthropic.script(HttpError.auth(), Text("never asked for"))
    with pytest.raises(ProviderError) as info:
        await through_ladder(provider)
    assert info.value.kind is ProviderErrorKind.AUTH
    assert len(fake_anthropic.requests) == 1
    assert fake_anthropic.pending == 1


async def test_overloaded_then_success_follows_the_ladder(
    fake_anthropic: FakeAnthropic, provider: AnthropicProvider
) -> None:
    fake_anthropic.script(HttpError.overloaded(), StreamError(), HttpError.server(503), Text("finally"))
    started = time.monotonic()
    assert await through_ladder(provider) == "finally"
    assert len(fake_anthropic.requests) == 4
    assert time.monotonic() - started < 3.0  # the ladder's short waits, not the SDK's own backoff


async def test_overloaded_beyond_the_ladder_gives_up(
    fake_anthropic: FakeAnthropic, provider: AnthropicProvider
) -> None:
    fake_anthropic.script(*[HttpError.overloaded()] * 5)
    with pytest.raises(ProviderError) as info:
        await through_ladder(provider, (0.01, 0.01))
    assert info.value.kind is ProviderErrorKind.TRANSIENT and info.value.status == 529
    assert len(fake_anthropic.requests) == 3


async def test_rate_limit_retry_after_honoured(fake_anthropic: FakeAnthropic, provider: AnthropicProvider) -> None:
    fake_anthropic.script(HttpError.rate_limit(7), HttpError.rate_limit(0.3), Text("after the pause"))
    assert (await failure(provider)).retry_after == 7.0
    started = time.monotonic()
    assert await through_ladder(provider) == "after the pause"  # ladder says 0.01 s, the server 0.3 s
    assert time.monotonic() - started >= 0.28
    assert len(fake_anthropic.requests) == 3


async def test_api_key_never_in_error(fake_anthropic: FakeAnthropic, provider: AnthropicProvider) -> None:
    # the fake echoes the key it received, as some servers do
    fake_anthropic.script(
        HttpError.auth(),
        HttpError.of(400, "invalid_request_error", "bad header: x-api-key: {api_key}"),
        HttpError.of(500, "api_error", "upstream failed for Authorization: Bearer {api_key}"),
        HttpError.of(500, "api_error", "upstream failed for key {api_key}"),
        StreamError("invalid_request_error", "stream broke"),
    )
    for _ in range(5):
        error = await failure(provider)
        for text in (str(error), repr(error), error.detail, json.dumps(error.extra)):
            assert KEY not in text
        assert error.__cause__ is None and error.__suppress_context__
    assert len(fake_anthropic.requests) == 5


async def test_missing_key_is_refused_by_the_fake(fake_anthropic: FakeAnthropic) -> None:
    provider = AnthropicProvider("m", fake_anthropic.base_url, "", request_timeout=2.0)
    try:
        error = await failure(provider)
        assert error.kind is ProviderErrorKind.AUTH
        headers = fake_anthropic.received[0].headers
        assert "x-api-key" not in headers and "authorization" not in headers
    finally:
        await provider.aclose()


async def test_hang_times_out_within_request_timeout(fake_anthropic: FakeAnthropic) -> None:
    provider = AnthropicProvider("m", fake_anthropic.base_url, KEY, request_timeout=0.3)
    try:
        for reply in (Hang(10), Hang(10, after_text="half an ans")):
            fake_anthropic.script(reply)
            seen: list[ProviderEvent] = []
            started = time.monotonic()
            with pytest.raises(ProviderError) as info:
                async for event in provider.stream(REQUEST):
                    seen.append(event)
            elapsed = time.monotonic() - started
            assert info.value.kind is ProviderErrorKind.TIMEOUT
            assert 0.25 <= elapsed < 3.0  # the 0.3 s bound, not the 10 s hang
            assert text_of(seen) == reply.after_text
    finally:
        await provider.aclose()


async def test_pings_only_time_out(fake_anthropic: FakeAnthropic) -> None:
    # the socket stays busy with keep-alive pings, so only the per-event bound every model stream goes
    # through (core.llm.silence.bounded) can end the wait
    fake_anthropic.script(Hang(10, after_text="thinking...", ping_every=0.05))
    provider = AnthropicProvider("m", fake_anthropic.base_url, KEY, request_timeout=0.3)
    try:
        started = time.monotonic()
        with pytest.raises(ProviderError) as info:
            async for _event in bounded(provider.stream(REQUEST), 0.3):
                pass
        assert info.value.kind is ProviderErrorKind.TIMEOUT
        assert 0.25 <= time.monotonic() - started < 3.0  # the 0.3 s bound, not the 10 s hang
    finally:
        await provider.aclose()


async def test_silent_before_headers_times_out(fake_anthropic: FakeAnthropic) -> None:
    async def slow(body: dict[str, object]) -> Text:
        await asyncio.sleep(5)
        return Text("late")

    fake_anthropic.script(Function(slow))
    provider = AnthropicProvider("m", fake_anthropic.base_url, KEY, request_timeout=0.3)
    try:
        started = time.monotonic()
        error = await failure(provider)
        assert error.kind is ProviderErrorKind.TIMEOUT
        assert time.monotonic() - started < 3.0  # the 0.3 s bound, not the 5 s wait
    finally:
        await provider.aclose()


async def test_connection_refused_is_transient() -> None:
    async with FakeAnthropic() as fake:
        url = fake.base_url
    provider = AnthropicProvider("m", url, KEY, request_timeout=1.0)  # nothing listens there any more
    try:
        error = await failure(provider)
        assert error.kind is ProviderErrorKind.TRANSIENT
        assert error.retryable
    finally:
        await provider.aclose()


async def test_cancellation_propagates(fake_anthropic: FakeAnthropic, provider: AnthropicProvider) -> None:
    hold = asyncio.Event()
    fake_anthropic.script(Text("abcdefghij", chunk_size=2, hold=hold, hold_after=4))
    seen: list[ProviderEvent] = []
    got_partial = asyncio.Event()

    async def consume() -> None:
        async for event in provider.stream(REQUEST):
            seen.append(event)
            if text_of(seen) == "abcd":
                got_partial.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(got_partial.wait(), 5.0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    hold.set()
    assert text_of(await collect(provider)) == "ok"  # still usable after a cancelled stream


async def test_aclose_closes_client(fake_anthropic: FakeAnthropic) -> None:
    provider = AnthropicProvider("m", fake_anthropic.base_url, KEY)
    assert text_of(await collect(provider)) == "ok"
    await provider.aclose()
    assert provider._client.is_closed()


# ---- the fake itself -----------------------------------------------------------------------------


async def test_fake_non_streaming_json(fake_anthropic: FakeAnthropic) -> None:
    client = anthropic.AsyncAnthropic(base_url=fake_anthropic.base_url, api_key=KEY, max_retries=0,
                                      default_headers={"X-Api-Key": KEY})
    try:
        fake_anthropic.script(Text("plain", usage=(3, 1)), ToolUses([("f", '{"a": 1}')]))
        first = await client.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": "x"}])
        assert [b.text for b in first.content if b.type == "text"] == ["plain"]
        assert first.usage.input_tokens == 3 and first.stop_reason == "end_turn"
        second = await client.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": "x"}])
        assert second.stop_reason == "tool_use"
        assert [(b.id, b.name, b.input) for b in second.content if b.type == "tool_use"] == [
            ("toolu_2_0", "f", {"a": 1})
        ]
    finally:
        await client.close()


async def test_fake_rejects_missing_version_header(fake_anthropic: FakeAnthropic) -> None:
    client = anthropic.AsyncAnthropic(base_url=fake_anthropic.base_url, api_key=KEY, max_retries=0,
                                      default_headers={"X-Api-Key": KEY, "anthropic-version": anthropic.omit})  # type: ignore[dict-item]
    try:
        with pytest.raises(anthropic.BadRequestError, match="anthropic-version"):
            await client.messages.create(model="m", max_tokens=16, messages=[{"role": "user", "content": "x"}])
        assert fake_anthropic.requests == []
    finally:
        await client.close()


async def test_fake_stop_is_prompt_while_a_reply_is_frozen() -> None:
    fake = await FakeAnthropic().start()
    provider = AnthropicProvider("m", fake.base_url, KEY, request_timeout=30.0)
    fake.script(Text("never finished", hold=asyncio.Event(), hold_after=5))
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in provider.stream(REQUEST):
            first.set()

    task = asyncio.create_task(consume())
    try:
        await asyncio.wait_for(first.wait(), 5.0)
        started = time.monotonic()
        await fake.stop()
        assert time.monotonic() - started < 5.0  # the held stream let go at once, not after the 30 s
        with pytest.raises(ProviderError):  # the stream ended without message_stop
            await asyncio.wait_for(task, 5.0)
    finally:
        task.cancel()
        await provider.aclose()


# ---- end to end ----------------------------------------------------------------------------------


def _said(body: dict[str, object]) -> str:
    """The user's own words in the last user turn (the core appends a runtime-context note)."""
    return last_user_text(body).split("\n\n[Runtime context]")[0]


async def test_chat_core_answers_through_anthropic(tmp_path: Path, fake_anthropic: FakeAnthropic) -> None:
    fake_anthropic.script(
        HttpError.overloaded(),  # one overloaded answer first: the ladder takes it in stride
        Function(lambda body: Text("Claude says: " + _said(body), chunk_size=4, usage=(20, 5))),
    )
    provider = AnthropicProvider("claude-test", fake_anthropic.base_url, KEY, request_timeout=FAST.request_timeout)
    store = SqliteStore(tmp_path / "chat.db")
    core = ChatCore(store=store, provider=provider, settings=FAST)
    channel = TestChannel()
    core.add_channel(channel)
    await core.start()
    h = Harness(core, channel, fake_anthropic, store)  # type: ignore[arg-type]
    try:
        await h.say("hello there")
        await h.wait_for(lambda: h.platform.visible("c1") == ["Claude says: hello there"])
        await h.settle()
        assert len(h.commits()) == 1
        assert len(fake_anthropic.requests) == 2
        body = fake_anthropic.requests[-1]
        assert body["model"] == "claude-test"
        assert body["messages"][-1]["role"] == "user" and _said(body) == "hello there"
        assert all(m["role"] in ("user", "assistant") for m in body["messages"])
        assert isinstance(body.get("system"), str) and body["system"]  # the core's system prompt, top-level
    finally:
        await core.shutdown()
    assert provider._client.is_closed()


async def test_build_provider_wires_anthropic(fake_anthropic: FakeAnthropic) -> None:
    from bridge.app import build_provider
    from bridge.config import AppConfig, LLMConfig

    config = AppConfig(llm=LLMConfig(provider="anthropic", model="claude-test", base_url=fake_anthropic.base_url,
                                     api_key=KEY, request_timeout=7, max_output_tokens=321))
    provider = build_provider(config)
    try:
        assert isinstance(provider, AnthropicProvider)
        assert (provider.model, provider.request_timeout, provider.max_tokens_default) == ("claude-test", 7.0, 321)
        assert text_of(await collect(provider)) == "ok"
        assert fake_anthropic.received[0].headers["x-api-key"] == KEY
        assert fake_anthropic.requests[0]["max_tokens"] == 321
    finally:
        await provider.aclose()
    default = AppConfig(llm=LLMConfig(provider="anthropic", model="m", api_key=KEY))
    official = build_provider(default)
    try:
        assert isinstance(official, AnthropicProvider) and official.base_url == "https://api.anthropic.com"
        assert official.max_tokens_default == 4096  # unset: a long answer is not cut at a thousand tokens
    finally:
        await official.aclose()


async def test_a_stream_that_fails_to_decode_is_a_transient_failure(fake_anthropic: FakeAnthropic,
                                                                   provider: AnthropicProvider) -> None:
    """The SDK does not wrap what fails while it reads a stream (here: a body labelled gzip that is not):
    a failure of the request, retried like a 5xx, never a crash of the turn."""
    fake_anthropic.script(Undecodable())
    error = await failure(provider)
    assert error.kind is ProviderErrorKind.TRANSIENT and error.retryable
    assert KEY not in str(error)
