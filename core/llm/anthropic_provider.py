"""Anthropic Messages API provider, through the official ``anthropic`` SDK.

One ``stream`` call is one HTTP request (the SDK's own retries are disabled: retries are
``core.llm.retry``'s business; the stream's silence is bounded once, by ``core.llm.silence``). The request
maps chatbridge's OpenAI-shaped conversation onto the Messages API (system prompt top-level, tool calls as
``tool_use`` blocks, tool results as ``tool_result`` blocks in a user turn); the SSE events become
``ProviderEvent``s; every failure becomes a ``ProviderError`` whose ``detail`` has the API key removed.

Two things about the SDK (2.x) shape the client set-up:

* it sends ``api_key`` as ``Authorization: Bearer``, while the API documents ``x-api-key`` for keys; we
  send the key in ``x-api-key`` only (and leave ``Authorization`` out);
* it pins ``anthropic-version: 2026-10-21``, under which the API rejects sampling parameters
  (``temperature``, ``top_p``, ``top_k``) with a 400 — the SDK has dropped them from ``messages.create``.
  A configured temperature is therefore not sent (logged once).
"""

from __future__ import annotations

import base64
import json
import logging
import re
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import aiohttp
import anthropic
import httpx2
import pydantic
from anthropic.types import MessageParam, RawMessageStreamEvent, ToolParam

from core.llm.http_errors import Redactor, refused, retry_after, sdk_error
from core.llm.provider import (
    DEFAULT_REQUEST_TIMEOUT,
    LLMImage,
    LLMMessage,
    LLMRequest,
    LLMToolCall,
    ProviderError,
    ProviderErrorKind,
    ProviderEvent,
    ReasoningDelta,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    Usage,
)

log = logging.getLogger(__name__)

MAX_TOKENS_DEFAULT = 4096
"""``max_tokens`` when the operator sets no ``max_output_tokens`` (the Messages API needs a number): what
every Claude model accepts, so that a long answer is not cut off at the first thousand tokens."""

_CONTEXT_OVERFLOW_MARKERS = (
    "prompt is too long",
    "exceed context limit",
    "context length",
    "context window",
    "context_length_exceeded",
    "too many tokens",
)
_OUT_OF_CREDIT_MARKER = "credit balance is too low"
# In-stream ``error`` events worth another attempt; any other in-stream error is MALFORMED.
_TRANSIENT_STREAM_ERRORS = frozenset({"overloaded_error", "api_error", "timeout_error"})
_STOP_REASONS = {"end_turn": "stop", "tool_use": "tool_calls", "max_tokens": "length"}
_API_KEY_HEADER = re.compile(r"(x-api-key['\"]?\s*[:=]\s*['\"]?)[A-Za-z0-9._~+/=-]+", re.IGNORECASE)


class AnthropicProvider:
    """``LLMProvider`` for the Anthropic Messages API (``POST {base_url}/v1/messages``, streamed)."""

    name = "anthropic"

    def __init__(
        self,
        model: str,
        base_url: str,
        api_key: str,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        max_tokens_default: int = MAX_TOKENS_DEFAULT,
    ) -> None:
        self.model = model
        self.base_url = base_url
        self.request_timeout = request_timeout
        self.max_tokens_default = max_tokens_default
        self._redactor = Redactor(api_key, _API_KEY_HEADER)
        self._warned_temperature = False
        omit = anthropic.omit
        # The key travels in ``x-api-key`` alone (see the module docstring); with no key (a local proxy)
        # neither header is sent. Passing ``api_key`` explicitly also stops the SDK from reading
        # ANTHROPIC_API_KEY / profiles / workload identity from the environment.
        headers: dict[str, str | anthropic.Omit] = {
            "Authorization": omit,
            "X-Api-Key": api_key if api_key else omit,
        }
        self._client = anthropic.AsyncAnthropic(
            base_url=base_url,
            api_key=api_key,
            timeout=request_timeout,
            max_retries=0,
            # header layers may carry Omit to drop a header; the SDK types them as plain strings
            default_headers=cast("dict[str, str]", headers),
            # no OpenTelemetry spans (the environment could otherwise turn on capturing chat content)
            open_telemetry=False,
            # the SDK's aiohttp transport, as for the OpenAI provider (aiohttp is a dependency anyway)
            http_client=anthropic.DefaultAioHttpClient(timeout=request_timeout),
        )

    async def aclose(self) -> None:
        await self._client.close()

    # ---- request ---------------------------------------------------------------------------------

    def _params(self, request: LLMRequest) -> dict[str, Any]:
        system, messages = _messages_param(request.messages)
        params: dict[str, Any] = {
            "model": request.model or self.model,
            "max_tokens": request.max_tokens if request.max_tokens is not None else self.max_tokens_default,
            "messages": cast("list[MessageParam]", messages),
            "stream": True,
        }
        if system:
            params["system"] = system
        if request.tools:
            params["tools"] = cast(
                "list[ToolParam]",
                [
                    {"name": t.name, "description": t.description, "input_schema": _input_schema(t.parameters)}
                    for t in request.tools
                ],
            )
        if request.temperature is not None and not self._warned_temperature:
            self._warned_temperature = True
            log.warning(
                "[llm] temperature is not sent to Anthropic: the API version of the anthropic SDK rejects "
                "sampling parameters"
            )
        return params

    async def stream(self, request: LLMRequest) -> AsyncIterator[ProviderEvent]:
        """One model request. ``request_timeout`` is the transport's connect/read timeout; the silence of the
        whole stream (pings included) is bounded by the caller (``core.llm.silence.bounded``)."""
        params = self._params(request)
        state = _StreamState()
        events: anthropic.AsyncStream[RawMessageStreamEvent] | None = None
        try:
            events = await self._client.messages.create(**params)
            async for event in events:
                try:
                    mapped = list(state.feed(event))
                except (AttributeError, TypeError, ValueError, KeyError) as exc:
                    raise ProviderError(
                        ProviderErrorKind.MALFORMED, self._redact(f"unexpected event shape: {exc!r}")
                    ) from None
                for item in mapped:
                    yield item
            if state.stop_reason is None or not state.stopped:
                raise ProviderError(
                    ProviderErrorKind.TRANSIENT,
                    "stream ended before message_stop / stop_reason (connection cut short?)",
                )
            if state.usage_seen:
                yield Usage(state.input_tokens, state.output_tokens)
            yield StreamEnd(_STOP_REASONS.get(state.stop_reason, state.stop_reason))
        except ProviderError:
            raise
        except Exception as exc:
            error = self._map_error(exc)
            if error is None:
                raise
            raise error from None
        finally:
            if events is not None:
                await events.close()

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
        message: str | None = None,
    ) -> ProviderError:
        error_type = _error_type(getattr(exc, "body", None))
        return sdk_error(kind, exc, self._redactor, status=status, retry_after=retry_after, message=message,
                         extra={"error_type": error_type} if error_type else None)

    def _map_error(self, exc: Exception) -> ProviderError | None:
        """The ProviderError for ``exc``; None for exceptions that are bugs, not provider failures."""
        K = ProviderErrorKind
        if isinstance(exc, anthropic.APIStatusError):
            status = exc.status_code
            if status < 400:
                # An ``event: error`` inside a 200 stream: the SDK raises it with the stream's status.
                error_type = _error_type(exc.body)
                message = _error_message(exc.body) or exc.message
                if error_type in _TRANSIENT_STREAM_ERRORS:
                    return self._error(K.TRANSIENT, exc, message=message)
                if error_type == "rate_limit_error":
                    return self._error(K.RATE_LIMIT, exc, message=message)
                if _is_context_overflow(exc):
                    return self._error(K.CONTEXT_OVERFLOW, exc, message=message)
                return self._error(K.MALFORMED, exc, message=message)
            if status in (401, 403):
                return self._error(K.AUTH, exc, status=status)
            if status == 429:
                return self._error(K.RATE_LIMIT, exc, status=status, retry_after=retry_after(exc.response.headers))
            if status >= 500:  # 529 overloaded included
                return self._error(K.TRANSIENT, exc, status=status)
            if status == 408:
                return self._error(K.TIMEOUT, exc, status=status)
            if status == 409:
                return self._error(K.TRANSIENT, exc, status=status)
            if _is_out_of_credit(exc):
                # Anthropic sends a used-up credit balance as a 400 invalid_request_error, told from a bad
                # request only by its words: the request is fine, the operator has to buy credits
                return self._error(K.QUOTA, exc, status=status)
            if status == 413 or _is_context_overflow(exc):  # 413: the request is over the API's size limit
                return self._error(K.CONTEXT_OVERFLOW, exc, status=status)
            return self._error(K.BAD_REQUEST, exc, status=status)
        if isinstance(exc, anthropic.APITimeoutError):
            # The aiohttp transport reports a refused connection as a connect *timeout*; it is not one.
            return self._error(K.TRANSIENT if refused(exc) else K.TIMEOUT, exc)
        if isinstance(exc, anthropic.APIConnectionError):
            return self._error(K.TRANSIENT, exc)
        if isinstance(exc, anthropic.APIResponseValidationError):
            return self._error(K.MALFORMED, exc, status=exc.status_code)
        if isinstance(exc, anthropic.APIError):
            return self._error(K.MALFORMED, exc)
        if isinstance(exc, (TimeoutError, httpx2.TimeoutException)):
            return ProviderError(
                K.TIMEOUT, f"no response or event within {self.request_timeout:g}s", extra={"exception": "timeout"}
            )
        if isinstance(exc, (httpx2.RequestError, ConnectionError, aiohttp.ClientError)):
            # a transport failure the SDK passes on unwrapped: its aiohttp transport re-raises what it does not
            # map (an answer with oversized headers, a broken payload), and an error while a stream is read
            # (a body that does not decode) is not wrapped at all
            return self._error(K.TRANSIENT, exc)
        if isinstance(exc, (json.JSONDecodeError, pydantic.ValidationError, UnicodeDecodeError)):
            return self._error(K.MALFORMED, exc)
        if isinstance(exc, anthropic.AnthropicError):
            return self._error(K.BAD_REQUEST, exc)
        return None




# ---- event assembly ------------------------------------------------------------------------------


@dataclass(slots=True)
class _StreamState:
    stop_reason: str | None = None
    stopped: bool = False
    usage_seen: bool = False
    input_tokens: int = 0
    output_tokens: int = 0
    tool_index: dict[int, int] = field(default_factory=dict)
    """content block index → running tool-call index (0, 1, ... in the order the calls start)"""
    tool_has_arguments: dict[int, bool] = field(default_factory=dict)
    without_input: list[int] = field(default_factory=list)
    """tool_use blocks that stopped without any input, not yet known to be whole (``_inputs_done``)"""

    def _usage(self, usage: Any) -> None:
        if usage is None:
            return
        # values are cumulative; message_delta may repeat input counts: keep the latest of each
        prompt = [getattr(usage, name, None) for name in _INPUT_FIELDS]
        if any(value is not None for value in prompt):
            self.input_tokens = sum(int(value or 0) for value in prompt)
        output = getattr(usage, "output_tokens", None)
        if output is not None:
            self.output_tokens = int(output)
        self.usage_seen = True

    def feed(self, event: Any) -> Iterator[ProviderEvent]:
        """Map one stream event. A wrong shape raises AttributeError/TypeError/ValueError/KeyError,
        which the caller reports as MALFORMED."""
        kind = event.type
        if kind == "message_start":
            self._usage(event.message.usage)
        elif kind == "content_block_start":
            yield from self._inputs_done()  # the model went on: the calls before were whole
            block = event.content_block
            index = int(event.index)
            if block.type == "text":
                if block.text:
                    yield TextDelta(str(block.text))
            elif block.type == "thinking":
                if block.thinking:
                    yield ReasoningDelta(str(block.thinking))
            elif block.type == "tool_use":
                tool = self.tool_index.setdefault(index, len(self.tool_index))
                initial = block.input
                arguments = json.dumps(initial) if initial else ""
                self.tool_has_arguments[index] = bool(arguments)
                yield ToolCallDelta(index=tool, id=str(block.id), name=str(block.name), arguments=arguments)
        elif kind == "content_block_delta":
            delta = event.delta
            index = int(event.index)
            if delta.type == "text_delta":
                if delta.text:
                    yield TextDelta(str(delta.text))
            elif delta.type == "thinking_delta":
                if delta.thinking:
                    yield ReasoningDelta(str(delta.thinking))
            elif delta.type == "input_json_delta":
                if index not in self.tool_index:
                    raise ValueError(f"input_json_delta for block {index}, which is not a tool_use block")
                if delta.partial_json:
                    self.tool_has_arguments[index] = True
                    yield ToolCallDelta(index=self.tool_index[index], arguments=str(delta.partial_json))
            # signature_delta, citations_delta, ...: nothing to show
        elif kind == "content_block_stop":
            index = int(event.index)
            if index in self.tool_index and not self.tool_has_arguments.get(index):
                # a call without arguments streams no JSON at all; but neither does one the output limit cut
                # before its first argument, and that is known only from the stop reason (or the next block)
                self.without_input.append(index)
        elif kind == "message_delta":
            self._usage(event.usage)
            if event.delta.stop_reason:
                self.stop_reason = str(event.delta.stop_reason)
                if self.stop_reason == "tool_use":
                    yield from self._inputs_done()
                # any other reason leaves it as it is: the agent loop takes it as a call without arguments,
                # unless the reply was cut off (max_tokens above all), and then it does not run it
        elif kind == "message_stop":
            self.stopped = True
        # ping and unknown event types: ignored (the API may add event types)

    def _inputs_done(self) -> Iterator[ProviderEvent]:
        """The calls in ``without_input`` are whole calls without arguments: make them valid, empty JSON (so
        they complete, and are decided, at once)."""
        for index in self.without_input:
            self.tool_has_arguments[index] = True
            yield ToolCallDelta(index=self.tool_index[index], arguments="{}")
        self.without_input.clear()


_INPUT_FIELDS = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")


# ---- request mapping -----------------------------------------------------------------------------


def _messages_param(messages: tuple[LLMMessage, ...]) -> tuple[str, list[dict[str, Any]]]:
    """(system prompt, Messages API turns). Same-role neighbours merge into one turn (the API wants
    user/assistant alternation); tool results become ``tool_result`` blocks of a user turn."""
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "system":
            if message.content:
                system.append(message.content)
            continue
        blocks: list[dict[str, Any]]
        if message.role == "tool":
            result: dict[str, Any] = {"type": "tool_result", "tool_use_id": message.tool_call_id or ""}
            if message.content:
                result["content"] = message.content
            role, blocks = "user", [result]
        else:
            role = message.role
            # images before the text that asks about them, as Anthropic's guide recommends
            blocks = [_image_block(image) for image in message.images]
            blocks += [{"type": "text", "text": message.content}] if message.content else []
            if message.role == "assistant":
                blocks += [_tool_use(call) for call in message.tool_calls]
        if not blocks:
            continue  # the API rejects empty content
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})
    for turn in turns:  # plain text turns go on the wire as plain strings
        content = turn["content"]
        if len(content) == 1 and content[0]["type"] == "text":
            turn["content"] = content[0]["text"]
    return "\n\n".join(system), turns


def _image_block(image: LLMImage) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": image.media_type,
                                        "data": base64.b64encode(image.data).decode("ascii")}}


def _tool_use(call: LLMToolCall) -> dict[str, Any]:
    """A ``tool_use`` block; ``input`` must be a JSON object, so other arguments are wrapped."""
    raw = call.arguments.strip()
    parsed: Any
    if not raw:
        parsed = {}
    else:
        try:
            parsed = json.loads(raw)
        except ValueError:
            parsed = {"arguments": call.arguments}  # what the model sent, kept for its next turn
        else:
            if not isinstance(parsed, dict):
                parsed = {"arguments": parsed}
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": parsed}


def _input_schema(parameters: Mapping[str, Any]) -> dict[str, Any]:
    schema = dict(parameters)
    schema.setdefault("type", "object")
    if schema["type"] == "object":
        schema.setdefault("properties", {})
    return schema


# ---- error helpers -------------------------------------------------------------------------------


def _error_field(body: object, name: str) -> str | None:
    if isinstance(body, Mapping):
        inner = body.get("error")
        if isinstance(inner, Mapping):
            value = inner.get(name)
            if isinstance(value, str):
                return value
    return None


def _error_type(body: object) -> str | None:
    return _error_field(body, "type")


def _error_message(body: object) -> str | None:
    return _error_field(body, "message")


def _is_out_of_credit(exc: anthropic.APIError) -> bool:
    """The API's "Your credit balance is too low to access the Anthropic API": the account's prepaid credit is
    used up."""
    message = _error_message(exc.body) or exc.message or ""
    return _OUT_OF_CREDIT_MARKER in message.lower()


def _is_context_overflow(exc: anthropic.APIError) -> bool:
    parts: list[str] = [exc.message or "", _error_message(exc.body) or ""]
    if isinstance(exc.body, str):
        parts.append(exc.body)
    text = " ".join(parts).lower()
    return any(marker in text for marker in _CONTEXT_OVERFLOW_MARKERS)

