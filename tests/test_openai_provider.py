"""OpenAIProvider driven through the real openai SDK against the fake server (127.0.0.1 only)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime

import httpx2
import openai
import pytest

from core.llm.http_errors import retry_after as _retry_after
from core.llm.openai_provider import OpenAIProvider
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
from tests.fakes.openai_server import (
    FakeOpenAI,
    Function,
    Hang,
    HttpError,
    Malformed,
    StreamError,
    Text,
    ToolCalls,
    Unreadable,
    last_user_text,
)

KEY = "sk-test-SECRET-0123456789abcdef"
REQUEST = LLMRequest(messages=(LLMMessage("system", "be brief"), LLMMessage("user", "hello")))


@pytest.fixture
async def provider(fake_openai: FakeOpenAI) -> AsyncIterator[OpenAIProvider]:
    p = OpenAIProvider("test-model", fake_openai.base_url, KEY, request_timeout=2.0)
    yield p
    await p.aclose()


async def collect(provider: OpenAIProvider, request: LLMRequest = REQUEST) -> list[ProviderEvent]:
    return [event async for event in provider.stream(request)]


def text_of(events: list[ProviderEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


async def failure(provider: OpenAIProvider, request: LLMRequest = REQUEST) -> ProviderError:
    with pytest.raises(ProviderError) as info:
        await collect(provider, request)
    return info.value


# ---- streaming -----------------------------------------------------------------------------------


async def test_streaming_text_assembles_exactly(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    answer = "Héllo, wörld! 你好 🌍 — line\nbreak, `code`  and  spaces "
    fake_openai.script(Text(answer, chunk_size=3))
    events = await collect(provider)

    assert text_of(events) == answer
    assert sum(isinstance(e, TextDelta) for e in events) > 5
    assert [e for e in events if isinstance(e, StreamEnd)] == [StreamEnd("stop")]
    assert events[-1] == StreamEnd("stop")

    body = fake_openai.requests[0]
    assert body["model"] == "test-model"
    assert body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    for absent in ("tools", "max_tokens", "temperature"):
        assert absent not in body
    assert fake_openai.auth_headers == [f"Bearer {KEY}"]


async def test_request_maps_messages_tools_and_options(
    fake_openai: FakeOpenAI, provider: OpenAIProvider
) -> None:
    call = LLMToolCall(id="call_1", name="get_time", arguments='{"tz": "UTC"}')
    request = LLMRequest(
        messages=(
            LLMMessage("system", "sys"),
            LLMMessage("user", "what time is it?"),
            LLMMessage("assistant", "", tool_calls=(call,)),
            LLMMessage("tool", "12:00", tool_call_id="call_1"),
        ),
        tools=(LLMToolSpec("get_time", "Current time", {"type": "object", "properties": {}}),),
        max_tokens=64,
        temperature=0.2,
    )
    await collect(provider, request)
    body = fake_openai.requests[0]
    assert body["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "what time is it?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
    ]
    assert body["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_time",
                "description": "Current time",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    assert body["max_tokens"] == 64
    assert body["temperature"] == 0.2


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_reasoning_deltas(fake_openai: FakeOpenAI, provider: OpenAIProvider, field: str) -> None:
    fake_openai.script(Text("42", reasoning="let me think about it", reasoning_field=field, chunk_size=4))
    events = await collect(provider)
    reasoning = [e for e in events if isinstance(e, ReasoningDelta)]
    assert "".join(e.text for e in reasoning) == "let me think about it"
    assert len(reasoning) > 1
    assert text_of(events) == "42"
    # reasoning comes before the answer
    assert events.index(reasoning[-1]) < next(i for i, e in enumerate(events) if isinstance(e, TextDelta))


@pytest.mark.parametrize("interleave", [False, True])
async def test_parallel_tool_calls_assemble(
    fake_openai: FakeOpenAI, provider: OpenAIProvider, interleave: bool
) -> None:
    calls = [
        ("search", json.dumps({"query": "weather in Paris", "limit": 3})),
        ("get_time", json.dumps({"tz": "Europe/Paris"})),
        ("noop", "{}"),
    ]
    fake_openai.script(ToolCalls(calls, text="Let me check.", fragment_size=4, interleave=interleave))
    events = await collect(provider)

    assert text_of(events) == "Let me check."
    deltas = [e for e in events if isinstance(e, ToolCallDelta)]
    assert len(deltas) > len(calls) * 2  # arguments really arrived in fragments
    assembled: dict[int, dict[str, str]] = {}
    for d in deltas:
        slot = assembled.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
        slot["id"] += d.id or ""
        slot["name"] += d.name or ""
        slot["arguments"] += d.arguments
    assert [(assembled[i]["name"], assembled[i]["arguments"]) for i in sorted(assembled)] == calls
    assert [assembled[i]["id"] for i in sorted(assembled)] == ["call_1_0", "call_1_1", "call_1_2"]
    assert events[-1] == StreamEnd("tool_calls")


async def test_usage_reported_once_before_end(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake_openai.script(Text("counted", usage=(12, 34)))
    events = await collect(provider)
    assert [e for e in events if isinstance(e, Usage)] == [Usage(prompt_tokens=12, completion_tokens=34)]
    assert events[-2:] == [Usage(12, 34), StreamEnd("stop")]


async def test_function_reply_echoes(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake_openai.script(Function(lambda body: Text("echo: " + last_user_text(body))))
    assert text_of(await collect(provider)) == "echo: hello"


async def test_function_failure_is_a_500(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    def broken(body: dict[str, object]) -> Text:
        raise RuntimeError("scripting bug")

    fake_openai.script(Function(broken))
    error = await failure(provider)
    assert error.kind is ProviderErrorKind.TRANSIENT and error.status == 500
    assert [type(e) for e in fake_openai.errors] == [RuntimeError]


async def test_default_reply_when_queue_empty(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    assert text_of(await collect(provider)) == "ok"
    fake_openai.default = Text("other")
    assert text_of(await collect(provider)) == "other"


# ---- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("reply", "kind", "status"),
    [
        (HttpError.auth(), ProviderErrorKind.AUTH, 401),
        (HttpError.forbidden(), ProviderErrorKind.AUTH, 403),
        (HttpError.server(503), ProviderErrorKind.TRANSIENT, 503),
        (HttpError.server(500), ProviderErrorKind.TRANSIENT, 500),
        (HttpError(502, body=None), ProviderErrorKind.TRANSIENT, 502),
        (HttpError.rate_limit(), ProviderErrorKind.RATE_LIMIT, 429),
        (HttpError.context_overflow(), ProviderErrorKind.CONTEXT_OVERFLOW, 400),
        (
            HttpError(400, {"error": {"message": "prompt is too long: 210000 tokens > 200000 maximum"}}),
            ProviderErrorKind.CONTEXT_OVERFLOW,
            400,
        ),
        (
            HttpError(413, {"error": {"message": "Request has too many tokens"}}),
            ProviderErrorKind.CONTEXT_OVERFLOW,
            413,
        ),
        (HttpError.bad_request(), ProviderErrorKind.BAD_REQUEST, 400),
        (HttpError(404, {"error": {"message": "model not found"}}), ProviderErrorKind.BAD_REQUEST, 404),
        (HttpError(408), ProviderErrorKind.TIMEOUT, 408),
        (Malformed(), ProviderErrorKind.MALFORMED, None),
        (StreamError(), ProviderErrorKind.TRANSIENT, None),  # in-stream server_error
        (StreamError(type="requests", code="rate_limit_exceeded"), ProviderErrorKind.RATE_LIMIT, None),
        (StreamError("Provider returned error", code=502, type=None), ProviderErrorKind.TRANSIENT, None),
        (StreamError("Rate limit exceeded", code=429, type=None), ProviderErrorKind.RATE_LIMIT, None),
        (StreamError("something odd", type="invalid_request_error"), ProviderErrorKind.MALFORMED, None),
        (Hang(0.05, after_text="cut short"), ProviderErrorKind.TRANSIENT, None),  # ends without finish_reason
    ],
)
async def test_error_mapping(
    fake_openai: FakeOpenAI,
    provider: OpenAIProvider,
    reply: HttpError | Malformed | StreamError | Hang,
    kind: ProviderErrorKind,
    status: int | None,
) -> None:
    fake_openai.script(reply)
    error = await failure(provider)
    assert error.kind is kind
    assert error.status == status
    assert error.retryable == (
        kind
        not in {ProviderErrorKind.AUTH, ProviderErrorKind.CONTEXT_OVERFLOW, ProviderErrorKind.BAD_REQUEST}
    )
    assert len(fake_openai.requests) == 1  # the SDK never retries on its own


async def test_rate_limit_retry_after_parsed(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake_openai.script(HttpError.rate_limit(7), HttpError.rate_limit(0.25))
    assert (await failure(provider)).retry_after == 7.0
    assert (await failure(provider)).retry_after == 0.25


def test_retry_after_header_forms() -> None:
    assert _retry_after(httpx2.Headers({"retry-after": "3"})) == 3.0
    assert _retry_after(httpx2.Headers({"retry-after-ms": "1500", "retry-after": "9"})) == 1.5
    assert _retry_after(httpx2.Headers({"retry-after": "soon"})) is None
    assert _retry_after(httpx2.Headers({})) is None
    date = format_datetime(datetime.now(UTC) + timedelta(seconds=30), usegmt=True)
    parsed = _retry_after(httpx2.Headers({"retry-after": date}))
    assert parsed is not None and 25 <= parsed <= 31


async def test_malformed_after_partial_text(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    fake_openai.script(Malformed(after_text="partial answer"))
    seen: list[ProviderEvent] = []
    with pytest.raises(ProviderError) as info:
        async for event in provider.stream(REQUEST):
            seen.append(event)
    assert info.value.kind is ProviderErrorKind.MALFORMED
    assert text_of(seen) == "partial answer"
    assert not any(isinstance(e, StreamEnd) for e in seen)


async def test_api_key_never_in_error(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    # the fake echoes the key it received, as some servers do
    fake_openai.script(
        HttpError.auth(),
        HttpError(400, {"error": {"message": "bad header: Authorization: Bearer {api_key}"}}),
        HttpError(500, {"error": {"message": "upstream failed for key {api_key}"}}),
    )
    for _ in range(3):
        error = await failure(provider)
        for text in (str(error), repr(error), error.detail, json.dumps(error.extra)):
            assert KEY not in text
        assert error.__cause__ is None and error.__suppress_context__
    assert "***" in str(error)


async def test_hang_times_out_within_request_timeout(fake_openai: FakeOpenAI) -> None:
    provider = OpenAIProvider("m", fake_openai.base_url, KEY, request_timeout=0.3)
    try:
        for reply in (Hang(10), Hang(10, after_text="half an ans")):
            fake_openai.script(reply)
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


async def test_silent_before_headers_times_out(fake_openai: FakeOpenAI) -> None:
    async def slow(body: dict[str, object]) -> Text:
        await asyncio.sleep(5)
        return Text("late")

    fake_openai.script(Function(slow))
    provider = OpenAIProvider("m", fake_openai.base_url, KEY, request_timeout=0.3)
    try:
        started = time.monotonic()
        error = await failure(provider)
        assert error.kind is ProviderErrorKind.TIMEOUT
        assert time.monotonic() - started < 3.0  # the 0.3 s bound, not the 5 s wait
    finally:
        await provider.aclose()


async def test_connection_refused_is_transient() -> None:
    async with FakeOpenAI() as fake:
        url = fake.base_url
    provider = OpenAIProvider("m", url, KEY, request_timeout=1.0)  # nothing listens there any more
    try:
        error = await failure(provider)
        assert error.kind is ProviderErrorKind.TRANSIENT
        assert error.retryable
    finally:
        await provider.aclose()


async def test_cancellation_propagates(fake_openai: FakeOpenAI, provider: OpenAIProvider) -> None:
    hold = asyncio.Event()
    fake_openai.script(Text("abcdefghij", chunk_size=2, hold=hold, hold_after=4))
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
    # the provider is still usable after a cancelled stream
    hold.set()
    assert text_of(await collect(provider)) == "ok"


async def test_aclose_closes_client(fake_openai: FakeOpenAI) -> None:
    provider = OpenAIProvider("m", fake_openai.base_url, KEY)
    assert text_of(await collect(provider)) == "ok"
    await provider.aclose()
    assert provider._client.is_closed()


# ---- the fake itself -----------------------------------------------------------------------------


async def test_fake_non_streaming_json(fake_openai: FakeOpenAI) -> None:
    client = openai.AsyncOpenAI(base_url=fake_openai.base_url, api_key=KEY, max_retries=0)
    try:
        fake_openai.script(Text("plain", usage=(3, 1)), ToolCalls([("f", '{"a": 1}')]))
        first = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert first.choices[0].message.content == "plain"
        assert first.usage is not None and first.usage.prompt_tokens == 3
        second = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        tool_calls = second.choices[0].message.tool_calls or []
        assert second.choices[0].finish_reason == "tool_calls"
        assert [(c.id, c.function.name, c.function.arguments) for c in tool_calls] == [  # type: ignore[union-attr]
            ("call_2_0", "f", '{"a": 1}')
        ]
    finally:
        await client.close()


async def test_fake_stop_is_prompt_while_a_reply_is_frozen() -> None:
    fake = await FakeOpenAI().start()
    provider = OpenAIProvider("m", fake.base_url, KEY, request_timeout=30.0)
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
        with pytest.raises(ProviderError):  # the stream ended without a finish_reason
            await asyncio.wait_for(task, 5.0)
    finally:
        task.cancel()
        await provider.aclose()


async def test_an_answer_the_transport_cannot_read_is_a_transient_failure(fake_openai: FakeOpenAI,
                                                                        provider: OpenAIProvider) -> None:
    """The SDK's aiohttp transport passes on what it does not map (here: headers too large to read): it is a
    failure of the request, retried like a 5xx, never a crash of the turn."""
    fake_openai.script(Unreadable())
    error = await failure(provider)
    assert error.kind is ProviderErrorKind.TRANSIENT and error.retryable
    assert KEY not in str(error)


async def test_content_as_typed_chunks_is_the_answer_and_its_reasoning(fake_openai: FakeOpenAI,
                                                                     provider: OpenAIProvider) -> None:
    """Mistral's reasoning models send ``content`` as a list of ``thinking`` and ``text`` chunks: the chat shows
    the text, never the list."""
    fake_openai.script(Text("Paris.", reasoning="The capital of France", parts=True, chunk_size=4))
    events = await collect(provider)
    assert text_of(events) == "Paris."
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "The capital of France"
