"""A protocol-level fake of an OpenAI-compatible Chat Completions server.

Real HTTP on 127.0.0.1 (ephemeral port) with aiohttp, speaking the wire format the official SDK expects:
SSE chunks (``data: {json}\\n\\n`` with ``choices[0].delta``), a final usage chunk when
``stream_options.include_usage`` is set, then ``data: [DONE]``; plain JSON when ``stream`` is false.

Tests script replies in order::

    async with FakeOpenAI() as fake:
        fake.script(HttpError.server(503), Text("hello"))
        ...  # point the provider at fake.base_url
        assert len(fake.requests) == 2

Every waiting reply (``Hang``, ``Text(hold=...)``) also wakes up when the server stops, so a frozen reply
never blocks shutdown; a client that disconnects cancels its handler.

Images: user messages may carry OpenAI's content parts; ``image_url`` parts must be base64 data URLs of a
PNG, JPEG, GIF or WebP image (otherwise 400, as the API answers), and ``image_parts(body)`` decodes them for
assertions. With ``reject_images`` set the server plays a model without vision: any request carrying an image
gets the 400 OpenAI gives for that, without consuming a scripted reply. With ``refuse_max_tokens`` set it plays one
of OpenAI's reasoning models (o1, o3, gpt-5...): any request carrying ``max_tokens`` gets the 400 OpenAI gives
for that (``HttpError.unsupported_max_tokens``), without consuming a scripted reply; ``max_completion_tokens``
is taken.

Transcriptions: ``POST /v1/audio/transcriptions`` (multipart: ``file``, ``model``, ``response_format``)
records each upload in ``transcriptions`` and answers ``{"text": fake.transcript}``, or ``transcription_error``
(an ``HttpError``) when set.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import inspect
import itertools
import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal

from aiohttp import web

# ---- scripted replies ------------------------------------------------------------------------------


@dataclass
class Text:
    """A normal answer, streamed in ``chunk_size`` pieces.

    ``reasoning`` is streamed first as ``reasoning_field`` deltas (DeepSeek/vLLM style). With ``hold``, the
    reply stops after ``hold_after`` characters of ``text`` until the event is set.
    """

    text: str = "ok"
    chunk_size: int = 8
    delay: float = 0.0
    hold: asyncio.Event | None = None
    hold_after: int = 0
    reasoning: str = ""
    reasoning_field: str = "reasoning_content"
    finish_reason: str = "stop"
    usage: tuple[int, int] | None = None  # (prompt_tokens, completion_tokens); default: estimated
    parts: bool = False
    """Each delta's ``content`` as a list of typed chunks, as Mistral's reasoning models send it: the reasoning
    as ``thinking`` chunks, the text as ``text`` chunks."""


@dataclass
class ToolCalls:
    """Parallel tool calls ``[(name, arguments_json), ...]``; arguments arrive in ``fragment_size`` pieces.

    With ``interleave`` the fragments of different calls alternate on the wire (some servers do that).
    Call ids are ``ids[i]`` when given, else ``call_<request_no>_<i>``.
    """

    calls: list[tuple[str, str]]
    text: str = ""
    fragment_size: int = 5
    interleave: bool = False
    ids: list[str] | None = None
    delay: float = 0.0
    usage: tuple[int, int] | None = None
    reasoning: str = ""
    """Streamed first, as ``reasoning_content`` deltas."""
    hold: asyncio.Event | None = None
    """When set, the reply waits for this event after the last tool-call fragment, before finishing."""
    index: Literal["call", "none", "zero"] = "call"
    """Each fragment's ``index``: the call's (OpenAI), none at all (Gemini's endpoint), or 0 for every call
    (servers that number within each chunk)."""
    finish_reason: str = "tool_calls"
    """``length`` plays a reply cut at the output limit: give the last call's arguments as far as they got."""


@dataclass
class HttpError:
    """An HTTP error with OpenAI's error shape. ``{api_key}`` in the message is replaced by the key sent."""

    status: int
    body: dict[str, Any] | None = None
    headers: dict[str, str] | None = None

    @classmethod
    def auth(cls) -> HttpError:
        return cls(
            401,
            _error_body("Incorrect API key provided: {api_key}.", "invalid_request_error", "invalid_api_key"),
        )

    @classmethod
    def forbidden(cls) -> HttpError:
        return cls(403, _error_body("You are not allowed to use this model.", "invalid_request_error", None))

    @classmethod
    def rate_limit(cls, retry_after: float | None = None) -> HttpError:
        headers = {"retry-after": _fmt_seconds(retry_after)} if retry_after is not None else None
        return cls(
            429,
            _error_body("Rate limit reached for requests.", "requests", "rate_limit_exceeded"),
            headers,
        )

    @classmethod
    def quota(cls) -> HttpError:
        """OpenAI's answer when the account's credit or monthly budget is used up: a 429, but no wait ends it."""
        return cls(
            429,
            _error_body("You exceeded your current quota, please check your plan and billing details.",
                        "insufficient_quota", "insufficient_quota"),
        )

    @classmethod
    def server(cls, status: int = 503) -> HttpError:
        return cls(status, _error_body("The server is overloaded or not ready yet.", "server_error", None))

    @classmethod
    def context_overflow(cls, window: int = 8192, asked: int = 9001) -> HttpError:
        return cls(
            400,
            _error_body(
                f"This model's maximum context length is {window} tokens. However, your messages resulted in "
                f"{asked} tokens. Please reduce the length of the messages.",
                "invalid_request_error",
                "context_length_exceeded",
            ),
        )

    @classmethod
    def unsupported_max_tokens(cls) -> HttpError:
        """OpenAI's answer when a reasoning model (o1, o3, gpt-5...) is sent ``max_tokens``."""
        body = _error_body("Unsupported parameter: 'max_tokens' is not supported with this model. Use "
                           "'max_completion_tokens' instead.", "invalid_request_error", "unsupported_parameter")
        body["error"]["param"] = "max_tokens"
        return cls(400, body)

    @classmethod
    def bad_request(cls, message: str = "Invalid value for 'messages'.") -> HttpError:
        return cls(400, _error_body(message, "invalid_request_error", None))


@dataclass
class Unreadable:
    """An answer the client cannot read: a header over the 8,190 bytes aiohttp reads (what a misconfigured proxy
    in front of a model may send)."""

    header_bytes: int = 20_000


@dataclass
class Hang:
    """Send headers (and ``after_text``), then go silent for ``seconds``; afterwards end without finishing."""

    seconds: float
    after_text: str = ""


@dataclass
class Malformed:
    """Send ``after_text`` normally, then a broken ``data: {not json`` chunk."""

    after_text: str = ""


@dataclass
class StreamError:
    """Send ``after_text``, then an in-stream error event (``event: error`` + ``{"error": {...}}``)."""

    message: str = "An internal error occurred while streaming."
    code: str | int | None = None
    """OpenAI's codes are strings; routers put the upstream's HTTP status here as a number."""
    type: str | None = "server_error"
    after_text: str = ""


@dataclass
class Function:
    """Decide the reply from the request body (sync or async); may return any other Reply."""

    fn: Callable[[dict[str, Any]], Reply | Awaitable[Reply]]


Reply = Text | ToolCalls | HttpError | Unreadable | Hang | Malformed | StreamError | Function


def _error_body(message: str, type_: str | None, code: str | int | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": None, "code": code}}


def _fmt_seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def last_user_text(body: dict[str, Any]) -> str:
    """Content of the last user message of a request body (handy inside ``Function``)."""
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):  # content parts
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


IMAGE_MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp")
_NO_VISION = ("Invalid content type. image_url is only supported by certain models.")


def image_parts(body: dict[str, Any]) -> list[tuple[str, bytes]]:
    """(media type, bytes) of every ``image_url`` part in the request's messages, in order."""
    found = []
    for message in body.get("messages") or []:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") == "image_url":
                found.append(_decode_data_url(str((part.get("image_url") or {}).get("url") or "")))
    return found


def _decode_data_url(url: str) -> tuple[str, bytes]:
    head, _, data = url.partition(",")
    if not head.startswith("data:") or not head.endswith(";base64"):
        raise ValueError("not a base64 data URL")
    media_type = head[5:-7]
    if media_type not in IMAGE_MEDIA_TYPES:
        raise ValueError(f"unsupported image type {media_type!r}")
    try:
        return media_type, base64.b64decode(data, validate=True)
    except binascii.Error as exc:
        raise ValueError("invalid base64") from exc


@dataclass
class Transcribed:
    """One upload to the transcription endpoint."""

    model: str
    filename: str
    content_type: str
    data: bytes


def _pieces(text: str, size: int) -> list[str]:
    size = max(1, size)
    return [text[i : i + size] for i in range(0, len(text), size)]


# ---- the server ------------------------------------------------------------------------------------


class FakeOpenAI:
    """The fake server. Use as ``async with FakeOpenAI() as fake`` or ``await start()`` / ``await stop()``."""

    def __init__(self, *, default: Reply | None = None, api_key: str | None = None) -> None:
        self.default: Reply | None = default if default is not None else Text("ok")
        self.api_key = api_key
        """When set, requests with another bearer token get a 401 (not taken from the script)."""
        self.requests: list[dict[str, Any]] = []
        self.auth_headers: list[str] = []
        self.errors: list[BaseException] = []
        """Exceptions raised by ``Function`` callbacks (the client got a 500)."""
        self.base_url = ""
        self.port = 0
        self.reject_images = False
        """Play a model without vision (400 for any request carrying an image)."""
        self.refuse_max_tokens = False
        """Play a reasoning model that takes its output limit only as ``max_completion_tokens`` (400 for any
        request carrying ``max_tokens``)."""
        self.window: tuple[int, float] | None = None
        """Play a model's context window: (tokens, tokens per character). A request whose message texts cost
        more is refused as OpenAI refuses it (400 context_length_exceeded, the sizes in the message), before
        the script is read."""
        self.image_tokens = 0
        """What each image of a request costs against ``window``, in tokens."""
        self.transcript = "transcribed speech"
        self.transcription_error: HttpError | None = None
        self.transcriptions: list[Transcribed] = []
        self._queue: deque[Reply] = deque()
        self._runner: web.AppRunner | None = None
        self._closing = asyncio.Event()
        self._ids = itertools.count(1)

    # -- lifecycle --

    async def start(self, port: int = 0, *, reuse_port: bool = False) -> FakeOpenAI:
        """Serve on 127.0.0.1:``port`` (0: an ephemeral port). ``reuse_port``: other processes may serve the
        same port (SO_REUSEPORT; the kernel spreads the connections among them)."""
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/audio/transcriptions", self._transcribe)
        self._closing = asyncio.Event()
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, reuse_port=reuse_port or None)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        return self

    async def stop(self) -> None:
        self._closing.set()  # wakes every Hang / hold so handlers finish at once
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> FakeOpenAI:
        return await self.start()

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -- scripting --

    def script(self, *replies: Reply) -> None:
        self._queue.extend(replies)

    @property
    def pending(self) -> int:
        """Scripted replies not consumed yet."""
        return len(self._queue)

    # -- handlers --

    async def _transcribe(self, request: web.Request) -> web.Response:
        if not request.content_type.startswith("multipart/"):
            return web.json_response(_error_body("Expected multipart/form-data.", "invalid_request_error", None),
                                     status=400)
        fields: dict[str, str] = {}
        upload: tuple[str, str, bytes] | None = None
        reader = await request.multipart()
        async for part in reader:
            if not hasattr(part, "name"):  # a nested multipart: not what the API takes
                continue
            if part.filename:  # type: ignore[union-attr]
                upload = (part.filename, part.headers.get("Content-Type", ""),  # type: ignore[union-attr]
                          bytes(await part.read()))  # type: ignore[union-attr]
            else:
                fields[str(part.name)] = await part.text()  # type: ignore[union-attr]
        if upload is None or not fields.get("model"):
            return web.json_response(_error_body("'file' and 'model' are required.", "invalid_request_error", None),
                                     status=400)
        self.transcriptions.append(Transcribed(fields["model"], upload[0], upload[1], upload[2]))
        if self.transcription_error is not None:
            return self._http_error(self.transcription_error, "")
        return web.json_response({"text": self.transcript})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        self.auth_headers.append(auth)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response(
                _error_body("Invalid JSON body.", "invalid_request_error", None), status=400
            )
        if not isinstance(body, dict):
            return web.json_response(
                _error_body("Body must be an object.", "invalid_request_error", None), status=400
            )
        self.requests.append(body)
        request_no = len(self.requests)
        key = auth.removeprefix("Bearer ").strip()
        try:
            images = image_parts(body)
        except ValueError as exc:
            return web.json_response(_error_body(f"Invalid image_url: {exc}", "invalid_request_error",
                                                 "invalid_image_url"), status=400)

        asked = self.tokens(body)
        if self.api_key is not None and key != self.api_key:
            reply: Reply | None = HttpError.auth()
        elif self.window is not None and asked > self.window[0]:
            reply = HttpError.context_overflow(self.window[0], asked)
        elif images and self.reject_images:
            reply = HttpError(400, _error_body(_NO_VISION, "invalid_request_error", None))
        elif self.refuse_max_tokens and "max_tokens" in body:
            reply = HttpError.unsupported_max_tokens()
        elif self._queue:
            reply = self._queue.popleft()
        else:
            reply = self.default
        try:
            while isinstance(reply, Function):
                result = reply.fn(body)
                reply = await result if inspect.isawaitable(result) else result
        except Exception as exc:
            self.errors.append(exc)
            return web.json_response(
                _error_body(f"fake: Function failed: {exc!r}", "server_error", None), status=500
            )
        if reply is None:
            return web.json_response(_error_body("fake: no scripted reply", "server_error", None), status=500)

        if isinstance(reply, HttpError):
            return self._http_error(reply, key)
        if isinstance(reply, Unreadable):
            return web.Response(status=200, headers={"X-Padding": "a" * reply.header_bytes})
        if body.get("stream"):
            return await self._stream(request, body, reply, request_no)
        return await self._plain(body, reply, request_no)

    def tokens(self, body: dict[str, Any]) -> int:
        """What the request's message texts cost at ``window``'s tokens per character."""
        if self.window is None:
            return 0
        chars = 0
        for m in body.get("messages") or ():
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                chars += sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
        return int(chars * self.window[1]) + self.image_tokens * len(image_parts(body))

    def _http_error(self, reply: HttpError, key: str) -> web.Response:
        payload = reply.body if reply.body is not None else _error_body(f"HTTP {reply.status}", "error", None)
        text = json.dumps(payload).replace("{api_key}", key)
        return web.Response(
            status=reply.status, text=text, content_type="application/json", headers=reply.headers or {}
        )

    async def _wait(self, event: asyncio.Event | None, seconds: float | None) -> bool:
        """Wait for ``event`` (or ``seconds``), never beyond server shutdown; False when shutting down."""
        waiters = [asyncio.ensure_future(self._closing.wait())]
        if event is not None:
            waiters.append(asyncio.ensure_future(event.wait()))
        try:
            await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
        return not self._closing.is_set()

    # -- streaming --

    async def _stream(
        self, request: web.Request, body: dict[str, Any], reply: Reply, request_no: int
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "x-request-id": "req_fake",
            },
        )
        await resp.prepare(request)
        chunk_id = f"chatcmpl-fake-{next(self._ids)}"
        model = str(body.get("model", "fake-model"))
        created = int(time.time())
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def send(delta: dict[str, Any] | None, finish: str | None = None, **extra: Any) -> None:
            chunk: dict[str, Any] = {
                "id": chunk_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": []
                if delta is None
                else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            }
            chunk.update(extra)
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")

        async def send_text(text: str, size: int = 8, delay: float = 0.0) -> None:
            for piece in _pieces(text, size):
                if delay:
                    await asyncio.sleep(delay)
                await send({"content": piece})

        async def finish(reason: str, usage: tuple[int, int] | None, completion_text: str) -> None:
            await send({}, reason)
            if include_usage:
                await send(None, usage=self._usage(body, usage, completion_text))
            await resp.write(b"data: [DONE]\n\n")

        await send({"role": "assistant", "content": ""})

        if isinstance(reply, Text) and reply.parts:
            for piece in _pieces(reply.reasoning, reply.chunk_size):
                await send({"content": [{"type": "thinking", "thinking": [{"type": "text", "text": piece}]}]})
            for piece in _pieces(reply.text, reply.chunk_size):
                await send({"content": [{"type": "text", "text": piece}]})
            await finish(reply.finish_reason, reply.usage, reply.reasoning + reply.text)
        elif isinstance(reply, Text):
            for piece in _pieces(reply.reasoning, reply.chunk_size):
                if reply.delay:
                    await asyncio.sleep(reply.delay)
                await send({reply.reasoning_field: piece})
            if reply.hold is not None:
                await send_text(reply.text[: reply.hold_after], reply.chunk_size, reply.delay)
                if not await self._wait(reply.hold, None):
                    await resp.write_eof()  # server stopping: end mid-reply, like a dropped connection
                    return resp
                await send_text(reply.text[reply.hold_after :], reply.chunk_size, reply.delay)
            else:
                await send_text(reply.text, reply.chunk_size, reply.delay)
            await finish(reply.finish_reason, reply.usage, reply.reasoning + reply.text)
        elif isinstance(reply, ToolCalls):
            for piece in _pieces(reply.reasoning, 8):
                await send({"reasoning_content": piece})
            await send_text(reply.text, 8, reply.delay)
            ids = reply.ids or [f"call_{request_no}_{i}" for i in range(len(reply.calls))]
            streams: list[list[dict[str, Any]]] = []
            for i, (name, arguments) in enumerate(reply.calls):
                deltas: list[dict[str, Any]] = [
                    {
                        "index": i,
                        "id": ids[i],
                        "type": "function",
                        "function": {"name": name, "arguments": ""},
                    }
                ]
                deltas += [
                    {"index": i, "function": {"arguments": p}}
                    for p in _pieces(arguments, reply.fragment_size)
                ]
                for delta in deltas:
                    if reply.index == "none":
                        del delta["index"]
                    elif reply.index == "zero":
                        delta["index"] = 0
                streams.append(deltas)
            if reply.interleave:
                ordered = [d for group in itertools.zip_longest(*streams) for d in group if d is not None]
            else:
                ordered = [d for deltas in streams for d in deltas]
            for tool_delta in ordered:
                if reply.delay:
                    await asyncio.sleep(reply.delay)
                await send({"tool_calls": [tool_delta]})
            if reply.hold is not None and not await self._wait(reply.hold, None):
                await resp.write_eof()
                return resp
            completion = reply.text + "".join(n + a for n, a in reply.calls)
            await finish(reply.finish_reason, reply.usage, completion)
        elif isinstance(reply, Hang):
            await send_text(reply.after_text)
            await self._wait(None, reply.seconds)
            # ends without finish_reason / [DONE]: a truncated stream
        elif isinstance(reply, Malformed):
            await send_text(reply.after_text)
            await resp.write(b"data: {not json\n\n")
        elif isinstance(reply, StreamError):
            await send_text(reply.after_text)
            err = _error_body(reply.message, reply.type, reply.code)
            await resp.write(b"event: error\ndata: " + json.dumps(err).encode() + b"\n\n")
        await resp.write_eof()
        return resp

    # -- non-streaming --

    async def _plain(self, body: dict[str, Any], reply: Reply, request_no: int) -> web.StreamResponse:
        message: dict[str, Any] = {"role": "assistant", "content": None}
        finish = "stop"
        usage: tuple[int, int] | None = None
        if isinstance(reply, Text):
            if reply.hold is not None:
                await self._wait(reply.hold, None)
            if reply.delay:
                await asyncio.sleep(reply.delay)
            message["content"] = reply.text
            if reply.reasoning:
                message[reply.reasoning_field] = reply.reasoning
            finish, usage = reply.finish_reason, reply.usage
        elif isinstance(reply, ToolCalls):
            ids = reply.ids or [f"call_{request_no}_{i}" for i in range(len(reply.calls))]
            message["content"] = reply.text or None
            message["tool_calls"] = [
                {"id": ids[i], "type": "function", "function": {"name": name, "arguments": arguments}}
                for i, (name, arguments) in enumerate(reply.calls)
            ]
            finish, usage = "tool_calls", reply.usage
        elif isinstance(reply, Hang):
            await self._wait(None, reply.seconds)
            message["content"] = reply.after_text
        elif isinstance(reply, Malformed):
            return web.Response(status=200, text="{not json", content_type="application/json")
        elif isinstance(reply, StreamError):
            return web.json_response(_error_body(reply.message, reply.type, reply.code), status=500)
        completion_text = message.get("content") or ""
        return web.json_response(
            {
                "id": f"chatcmpl-fake-{next(self._ids)}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": str(body.get("model", "fake-model")),
                "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}],
                "usage": self._usage(body, usage, completion_text),
            }
        )

    @staticmethod
    def _usage(body: dict[str, Any], usage: tuple[int, int] | None, completion_text: str) -> dict[str, int]:
        if usage is None:
            prompt_chars = sum(len(str(m.get("content") or "")) for m in body.get("messages") or [])
            usage = (prompt_chars // 4 + 1, len(completion_text) // 4 + 1)
        prompt, completion = usage
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
