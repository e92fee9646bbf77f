"""OpenAI-compatible Chat Completions provider, through the official ``openai`` SDK.

One ``stream`` call is one ``chat.completions.create(stream=True)`` request through the SDK's typed API (two
when the model refuses ``max_tokens``: ``OpenAIProvider.stream``). The SDK's own retries are disabled: retries are
``core.llm.retry``'s business; the stream's silence is bounded once, by ``core.llm.silence``, for every caller.
The SDK's ``ChatCompletionChunk``s become ``ProviderEvent``s; every failure becomes a ``ProviderError`` whose
``detail`` has the API key removed.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
import httpx2
import openai
import pydantic
from openai.types.chat import (
    ChatCompletionChunk,
    ChatCompletionMessageParam,
    ChatCompletionToolUnionParam,
)
from openai.types.chat.completion_create_params import CompletionCreateParamsStreaming

from core.llm.http_errors import Redactor, refused, retry_after, sdk_error
from core.llm.provider import (
    DEFAULT_REQUEST_TIMEOUT,
    LLMImage,
    LLMMessage,
    LLMRequest,
    ProviderError,
    ProviderErrorKind,
    ProviderEvent,
    ReasoningDelta,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    Usage,
)

_CONTEXT_OVERFLOW_MARKERS = (
    "context_length_exceeded",
    "maximum context length",
    "context length",
    "context window",
    "too many tokens",
    "prompt is too long",
)
_REASONING_FIELDS = ("reasoning_content", "reasoning")
"""The delta's reasoning as DeepSeek and vLLM (``reasoning_content``) or OpenRouter and Ollama (``reasoning``) send
it: no field of the SDK's ``ChoiceDelta``, so it is among the fields the SDK keeps as sent (``model_extra``)."""

log = logging.getLogger(__name__)


class OpenAIProvider:
    """``LLMProvider`` for OpenAI and any OpenAI-compatible endpoint (vLLM, Ollama, DeepSeek, ...)."""

    name = "openai"

    def __init__(self, model: str, base_url: str, api_key: str,
                 request_timeout: float = DEFAULT_REQUEST_TIMEOUT) -> None:
        self.model = model
        self.base_url = base_url
        self.request_timeout = request_timeout
        self._redactor = Redactor(api_key)
        self._completion_tokens: set[str] = set()
        """The models whose requests carry their output limit as ``max_completion_tokens``: those that refused
        ``max_tokens`` (OpenAI's reasoning models: o1, o3, gpt-5...). ``max_tokens`` is the default, as vLLM,
        Ollama, LM Studio and OpenRouter take it and some servers do not know ``max_completion_tokens``; by model,
        as a subagent's profile may name another model on the same endpoint."""
        self._client = openai.AsyncOpenAI(
            base_url=base_url,
            # the SDK refuses an empty key; local servers often need none, so send a placeholder
            api_key=api_key or "none",
            timeout=request_timeout,
            max_retries=0,
            # The SDK's documented aiohttp transport: about 40 % less CPU per streamed request than its
            # default httpx transport (tests/bench/core_overhead.py), and aiohttp is a dependency anyway.
            http_client=openai.DefaultAioHttpClient(timeout=request_timeout),
        )

    async def aclose(self) -> None:
        await self._client.close()

    # ---- request ---------------------------------------------------------------------------------

    async def stream(self, request: LLMRequest) -> AsyncIterator[ProviderEvent]:
        """One model request. ``request_timeout`` is the transport's connect/read timeout; the silence of the
        whole stream (keep-alives included) is bounded by the caller (``core.llm.silence.bounded``).

        A model that refuses ``max_tokens`` (``_refuses_max_tokens``) is asked again at once with
        ``max_completion_tokens``, and every later request to that model sends it from the start. The second
        request is part of the same attempt, not a retry: the refusal is no passing failure that waiting could
        end, nothing was streamed yet, and it is made at most once (its own failure is the attempt's), so it takes
        no step of the retry ladder."""
        messages = cast("list[ChatCompletionMessageParam]", [_message_param(m) for m in request.messages])
        tools = cast(
            "list[ChatCompletionToolUnionParam]",
            [
                {
                    "type": "function",
                    "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
                }
                for t in request.tools
            ],
        )
        model = request.model or self.model
        body: CompletionCreateParamsStreaming = {
            "model": model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if tools:
            body["tools"] = tools
        if request.max_tokens is not None:
            if model in self._completion_tokens:
                body["max_completion_tokens"] = request.max_tokens
            else:
                body["max_tokens"] = request.max_tokens
        if request.temperature is not None:
            body["temperature"] = request.temperature
        state = _StreamState()
        chunks: openai.AsyncStream[ChatCompletionChunk] | None = None
        try:
            # The SDK's typed call: it checks the body against its TypedDicts, and parses each SSE line into
            # its ``ChatCompletionChunk`` model, which ``_StreamState.feed`` reads (what that costs a turn is
            # the SDK's own work: tests/bench/core_overhead.py, README "Benchmarks").
            try:
                chunks = await self._client.chat.completions.create(**body)
            except openai.BadRequestError as exc:
                if "max_tokens" not in body or not _refuses_max_tokens(exc):
                    raise
                if model not in self._completion_tokens:
                    self._completion_tokens.add(model)
                    log.info("model %s refuses max_tokens: its output limit goes as max_completion_tokens from "
                             "now on", model)
                body["max_completion_tokens"] = body.pop("max_tokens")
                chunks = await self._client.chat.completions.create(**body)
            async for chunk in chunks:
                try:
                    events = state.feed(chunk)
                except (AttributeError, TypeError, ValueError) as exc:
                    raise ProviderError(
                        ProviderErrorKind.MALFORMED, self._redact(f"unexpected chunk shape: {exc!r}")
                    ) from None
                for event in events:
                    yield event
            if state.finish_reason is None:
                raise ProviderError(
                    ProviderErrorKind.TRANSIENT, "stream ended before a finish_reason (connection cut short?)"
                )
            if state.usage is not None:
                yield state.usage
            yield StreamEnd(state.finish_reason)
        except ProviderError:
            raise
        except Exception as exc:
            error = self._map_error(exc)
            if error is None:
                raise
            raise error from None
        finally:
            if chunks is not None:
                await chunks.close()

    # ---- errors ----------------------------------------------------------------------------------

    def _redact(self, text: str) -> str:
        return self._redactor(text)

    def _error(
        self,
        kind: ProviderErrorKind,
        exc: BaseException,
        *,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> ProviderError:
        code = exc.code if isinstance(exc, openai.APIError) else None
        return sdk_error(kind, exc, self._redactor, status=status, retry_after=retry_after,
                         extra={"code": code} if isinstance(code, str) else None)

    def _map_error(self, exc: Exception) -> ProviderError | None:
        """The ProviderError for ``exc``; None for exceptions that are bugs, not provider failures."""
        K = ProviderErrorKind
        if isinstance(exc, openai.APIStatusError):
            status = exc.status_code
            if isinstance(exc, (openai.AuthenticationError, openai.PermissionDeniedError)) or status in (
                401,
                403,
            ):
                return self._error(K.AUTH, exc, status=status)
            if status == 402 or _is_out_of_quota(exc):
                # OpenAI sends a used-up account's quota as a 429 (code ``insufficient_quota``), DeepSeek and
                # OpenRouter as 402: no wait ends it, so it is not a rate limit to retry
                return self._error(K.QUOTA, exc, status=status)
            if isinstance(exc, openai.RateLimitError) or status == 429:
                return self._error(
                    K.RATE_LIMIT, exc, status=status, retry_after=retry_after(exc.response.headers)
                )
            if status >= 500:
                return self._error(K.TRANSIENT, exc, status=status)
            if status == 408:
                return self._error(K.TIMEOUT, exc, status=status)
            if status == 409:  # lock/conflict on the provider side: the SDK itself treats it as retryable
                return self._error(K.TRANSIENT, exc, status=status)
            if status == 413 or _is_context_overflow(exc):  # 413: the request is over the server's size limit
                return self._error(K.CONTEXT_OVERFLOW, exc, status=status)
            return self._error(K.BAD_REQUEST, exc, status=status)
        if isinstance(exc, openai.APITimeoutError):
            # The aiohttp transport reports a refused connection as a connect *timeout*; it is not one.
            return self._error(K.TRANSIENT if refused(exc) else K.TIMEOUT, exc)
        if isinstance(exc, openai.APIConnectionError):
            return self._error(K.TRANSIENT, exc)
        if isinstance(exc, openai.APIResponseValidationError):
            return self._error(K.MALFORMED, exc, status=exc.status_code)
        if isinstance(exc, openai.APIError):
            # an error event inside the stream (``data: {"error": ...}``)
            return self._error(_stream_error_kind(exc), exc)
        if isinstance(exc, (TimeoutError, httpx2.TimeoutException)):
            return ProviderError(
                K.TIMEOUT,
                f"no response or chunk within {self.request_timeout:g}s",
                extra={"exception": "timeout"},
            )
        if isinstance(exc, (httpx2.RequestError, ConnectionError, aiohttp.ClientError)):
            # a transport failure the SDK passes on unwrapped: its aiohttp transport re-raises what it does not
            # map (an answer with oversized headers, a broken payload), and an error while a stream is read
            # (a body that does not decode) is not wrapped at all
            return self._error(K.TRANSIENT, exc)
        if isinstance(exc, (json.JSONDecodeError, pydantic.ValidationError, UnicodeDecodeError)):
            return self._error(K.MALFORMED, exc)
        if isinstance(exc, openai.OpenAIError):
            return self._error(K.BAD_REQUEST, exc)
        return None


# ---- chunk assembly ------------------------------------------------------------------------------


@dataclass(slots=True)
class _StreamState:
    finish_reason: str | None = None
    usage: Usage | None = None
    call_ids: dict[str, int] = field(default_factory=dict)
    """Each tool call's id → the index it is known by here (``_call_index``)."""
    open_at: dict[int, int] = field(default_factory=dict)
    """The wire's ``index`` (-1 - the position in its chunk when none is given) → the call its fragments
    without an id continue."""
    opened_at: dict[int, int] = field(default_factory=dict)
    """Each call (by the index it is known by here) → the wire index it opened at."""
    opened: int = 0

    def _call_index(self, wire: int, call_id: str | None) -> int:
        """The index of the call a fragment belongs to, counted here in the order calls open. A call opens
        with its id (OpenAI sends it on a call's first fragment only); later fragments carry the wire's
        index, or none at all (Gemini's endpoint), or 0 for every call (some servers number within each
        chunk): so a fragment with an id not seen before opens a new call, and one without an id continues
        the call last opened at its wire index. An id seen before continues its call (some servers repeat it on
        every fragment), unless the fragment names another wire index than the call opened at: a model that
        gave two calls of one reply the same id (the loop renames the second, ``AgentLoop._unique_call_id``);
        without indices that cannot be told from a repeat, and the second call's fragments continue the first."""
        if call_id:
            known = self.call_ids.get(call_id)
            if known is None or (wire >= 0 and self.opened_at[known] >= 0 and self.opened_at[known] != wire):
                known = self.call_ids[call_id] = self._open()
                self.opened_at[known] = wire
            self.open_at[wire] = known
            return known
        known = self.open_at.get(wire)
        if known is None:  # a server that sends no ids: its wire indices tell the calls apart
            known = self.open_at[wire] = self._open()
            self.opened_at[known] = wire
        return known

    def _open(self) -> int:
        self.opened += 1
        return self.opened - 1

    def feed(self, chunk: ChatCompletionChunk) -> list[ProviderEvent]:
        """Map one of the SDK's chunks to events (a list, not a generator: this runs for every streamed token).

        The SDK builds its models without validating them: a field the server left out is None (a tool-call
        fragment without ``index``, as Gemini's endpoint sends it), a value of another type than the model's is
        kept as sent (``content`` as a list of typed chunks), and fields the model does not know are kept too
        (``model_extra``: the reasoning of DeepSeek, vLLM, OpenRouter). A chunk of the wrong shape raises
        AttributeError/TypeError/ValueError, which the caller reports as MALFORMED; a chunk carrying an
        ``error`` never gets here (the SDK raises it as an ``APIError``)."""
        events: list[ProviderEvent] = []
        usage = chunk.usage
        if usage is not None and (usage.prompt_tokens is not None or usage.completion_tokens is not None):
            # some servers repeat (cumulative) usage on several chunks: keep the last, report once at the end
            self.usage = Usage(int(usage.prompt_tokens or 0), int(usage.completion_tokens or 0))
        for choice in chunk.choices or ():
            delta = choice.delta  # read first: a choice that is no object fails here, as MALFORMED
            if choice.index not in (0, None):
                continue  # we never ask for n > 1
            if delta is not None:
                extra = delta.model_extra
                if extra:  # most deltas have no field the SDK does not know
                    reasoning = _reasoning_text(extra)
                    if reasoning:
                        events.append(ReasoningDelta(reasoning))
                content: object = delta.content
                if content:
                    if isinstance(content, str):
                        events.append(TextDelta(content))
                    else:
                        events += _typed_chunks(cast("Iterable[Any]", content))
                refusal = delta.refusal
                if refusal:
                    events.append(TextDelta(str(refusal)))
                tool_calls = delta.tool_calls
                if tool_calls:  # tested first: an ``enumerate`` on every token costs as much as the lookups
                    for position, call in enumerate(tool_calls):
                        index = call.index
                        call_id = call.id or None
                        function = call.function
                        events.append(ToolCallDelta(
                            index=self._call_index(-1 - position if index is None else int(index), call_id),
                            id=call_id,
                            name=(function.name or None) if function is not None else None,
                            arguments=(function.arguments or "") if function is not None else "",
                        ))
            if choice.finish_reason:
                self.finish_reason = str(choice.finish_reason)
        return events


def _typed_chunks(content: Iterable[Any]) -> list[ProviderEvent]:
    """A delta's ``content`` given as a list of typed chunks (Mistral's reasoning models; the SDK keeps it as the
    server sent it, JSON objects): ``text`` chunks are the answer, ``thinking`` chunks (a list of ``text``
    chunks, or a string) the reasoning; other kinds (a reference, an image) have no text to show."""
    events: list[ProviderEvent] = []
    for chunk in content:
        kind = chunk.get("type")
        if kind == "text" and chunk.get("text"):
            events.append(TextDelta(str(chunk["text"])))
        elif kind == "thinking":
            thinking = chunk.get("thinking")
            parts = [thinking] if isinstance(thinking, str) else [p.get("text") for p in thinking or ()]
            text = "".join(str(p) for p in parts if p)
            if text:
                events.append(ReasoningDelta(text))
    return events


def _reasoning_text(extra: Mapping[str, Any]) -> str:
    for name in _REASONING_FIELDS:
        value = extra.get(name)
        if isinstance(value, str) and value:
            return value
    return ""


def _message_param(message: LLMMessage) -> dict[str, Any]:
    if message.role == "tool":
        return {"role": "tool", "tool_call_id": message.tool_call_id or "", "content": message.content}
    if message.role == "assistant" and message.tool_calls:
        return {
            "role": "assistant",
            "content": message.content or None,
            "tool_calls": [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in message.tool_calls
            ],
        }
    if message.images:
        # OpenAI's content parts: the text, then each image as a data URL (base64 of the stored bytes)
        parts: list[dict[str, Any]] = [{"type": "text", "text": message.content}] if message.content else []
        parts += [{"type": "image_url", "image_url": {"url": data_url(image)}} for image in message.images]
        return {"role": message.role, "content": parts}
    return {"role": message.role, "content": message.content}


def data_url(image: LLMImage) -> str:
    return f"data:{image.media_type};base64,{base64.b64encode(image.data).decode('ascii')}"


# ---- error helpers -------------------------------------------------------------------------------

_STREAM_RATE_LIMITED = frozenset({"rate_limit_exceeded", "rate_limit_error", "requests", "tokens", "429"})
_STREAM_TRANSIENT = frozenset({"server_error", "api_error", "overloaded_error", "timeout_error",
                               "service_unavailable", "internal_error", "500", "502", "503", "504", "529"})


def _stream_error_kind(exc: openai.APIError) -> ProviderErrorKind:
    """The kind of an error event inside a stream, read from its ``type`` and ``code`` (OpenAI's
    ``server_error``; a router's numeric status as the code): the provider failed or limited the bridge
    mid-answer, which the chat reports as such, not as an answer it could not read. Anything else is
    MALFORMED (retried)."""
    if _is_context_overflow(exc):
        return ProviderErrorKind.CONTEXT_OVERFLOW
    if _is_out_of_quota(exc):
        return ProviderErrorKind.QUOTA
    marks = {str(exc.type or "").lower(), str(exc.code or "").lower()}
    if marks & _STREAM_RATE_LIMITED:
        return ProviderErrorKind.RATE_LIMIT
    if marks & _STREAM_TRANSIENT:
        return ProviderErrorKind.TRANSIENT
    return ProviderErrorKind.MALFORMED


def _refuses_max_tokens(exc: openai.APIError) -> bool:
    """OpenAI's 400 for ``max_tokens`` sent to a model that takes only ``max_completion_tokens`` (its reasoning
    models): code ``unsupported_parameter``, param ``max_tokens``. Only this refusal switches the parameter; a
    server that refused ``max_completion_tokens`` would never be sent it."""
    return exc.code == "unsupported_parameter" and exc.param == "max_tokens"


def _is_out_of_quota(exc: openai.APIError) -> bool:
    """OpenAI's ``insufficient_quota`` (as the error's code or type): the account's credit or budget is used
    up."""
    return "insufficient_quota" in {str(exc.code or "").lower(), str(exc.type or "").lower()}


def _is_context_overflow(exc: openai.APIError) -> bool:
    parts: list[str] = [str(exc.code or ""), exc.message or ""]
    body = exc.body
    if isinstance(body, Mapping):
        for key in ("code", "message", "type"):
            value = body.get(key)
            if isinstance(value, str):
                parts.append(value)
        inner = body.get("error")
        if isinstance(inner, Mapping):
            parts += [str(inner.get(key) or "") for key in ("code", "message", "type")]
    elif isinstance(body, str):
        parts.append(body)
    text = " ".join(parts).lower()
    return any(marker in text for marker in _CONTEXT_OVERFLOW_MARKERS)

