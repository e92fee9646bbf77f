"""A protocol-level fake of the Anthropic Messages API.

Real HTTP on 127.0.0.1 (ephemeral port) with aiohttp. ``POST /v1/messages`` wants ``x-api-key`` and
``anthropic-version`` headers and answers with the wire format the official SDK expects: named SSE events
(``event: message_start`` / ``content_block_start`` / ``ping`` / ``content_block_delta`` /
``content_block_stop`` / ``message_delta`` / ``message_stop``, each with ``data: {json}``) when ``stream`` is
true, a Message JSON object otherwise; errors in Anthropic's shape
``{"type": "error", "error": {"type": ..., "message": ...}}``.

Tests script replies in order::

    async with FakeAnthropic() as fake:
        fake.script(HttpError.overloaded(), Text("hello"))
        ...  # point the provider at fake.base_url (no /v1: the SDK adds it)
        assert len(fake.requests) == 2

Like the real API under the ``anthropic-version`` the SDK pins, a body with ``temperature``, ``top_p`` or
``top_k`` gets a 400. Every waiting reply (``Hang``, ``Text(hold=...)``) also wakes up when the server stops.
Image blocks are checked as the API checks them (base64 source, one of the four image types, at most 5 MB of
base64: otherwise a 400); ``image_blocks(body)`` decodes them for assertions.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import inspect
import itertools
import json
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

SAMPLING_PARAMETERS = ("temperature", "top_p", "top_k")

# ---- scripted replies ------------------------------------------------------------------------------


@dataclass
class Text:
    """A normal answer: an optional ``thinking`` block, then a text block streamed in ``chunk_size`` pieces.

    With ``hold``, the reply stops after ``hold_after`` characters of ``text`` until the event is set.
    """

    text: str = "ok"
    chunk_size: int = 8
    delay: float = 0.0
    hold: asyncio.Event | None = None
    hold_after: int = 0
    thinking: str = ""
    stop_reason: str = "end_turn"
    usage: tuple[int, int] | None = None  # (input_tokens, output_tokens); default: estimated


@dataclass
class ToolUses:
    """Parallel ``tool_use`` blocks ``[(name, input_json), ...]`` after an optional text block; each input
    arrives as ``input_json_delta`` fragments of ``fragment_size`` characters. Ids are ``ids[i]`` when given,
    else ``toolu_<request_no>_<i>``."""

    calls: list[tuple[str, str]]
    text: str = ""
    fragment_size: int = 5
    ids: list[str] | None = None
    delay: float = 0.0
    usage: tuple[int, int] | None = None
    stop_reason: str = "tool_use"
    """``max_tokens`` plays a reply cut at the output limit: give the last call's input as far as it got (even
    ``""``, nothing of it)."""


@dataclass
class HttpError:
    """An HTTP error in Anthropic's shape. ``{api_key}`` in the message is replaced by the key sent."""

    status: int
    body: dict[str, Any] | None = None
    headers: dict[str, str] | None = None

    @classmethod
    def of(cls, status: int, type_: str, message: str, headers: dict[str, str] | None = None) -> HttpError:
        return cls(status, error_body(type_, message), headers)

    @classmethod
    def auth(cls) -> HttpError:
        return cls.of(401, "authentication_error", "invalid x-api-key: {api_key}")

    @classmethod
    def forbidden(cls) -> HttpError:
        return cls.of(403, "permission_error", "Your API key does not have permission to use this model.")

    @classmethod
    def rate_limit(cls, retry_after: float | None = None) -> HttpError:
        headers = {"retry-after": _fmt_seconds(retry_after)} if retry_after is not None else None
        return cls.of(429, "rate_limit_error", "Number of request tokens has exceeded your rate limit.", headers)

    @classmethod
    def overloaded(cls) -> HttpError:
        return cls.of(529, "overloaded_error", "Overloaded")

    @classmethod
    def server(cls, status: int = 500) -> HttpError:
        return cls.of(status, "api_error", "Internal server error")

    @classmethod
    def prompt_too_long(cls) -> HttpError:
        return cls.of(400, "invalid_request_error", "prompt is too long: 215012 tokens > 200000 maximum")

    @classmethod
    def credit_too_low(cls) -> HttpError:
        """The API's answer when the account's prepaid credit is used up: a 400, like any bad request."""
        return cls.of(400, "invalid_request_error", "Your credit balance is too low to access the Anthropic API. "
                      "Please go to Plans & Billing to upgrade or purchase credits.")

    @classmethod
    def bad_request(cls, message: str = "messages.0.content: Field required") -> HttpError:
        return cls.of(400, "invalid_request_error", message)


@dataclass
class Hang:
    """Send headers, ``message_start`` (and ``after_text``), then go silent for ``seconds``; afterwards end
    without ``message_delta`` / ``message_stop``."""

    seconds: float
    after_text: str = ""
    ping_every: float | None = None
    """Keep the connection busy with ``ping`` events meanwhile (no content, no progress)."""


@dataclass
class Malformed:
    """Send ``after_text`` normally, then a ``content_block_delta`` event whose data is not JSON."""

    after_text: str = ""


@dataclass
class StreamError:
    """Send ``after_text``, then an in-stream ``event: error`` (``overloaded_error`` by default)."""

    type: str = "overloaded_error"
    message: str = "Overloaded"
    after_text: str = ""


@dataclass
class Undecodable:
    """A stream labelled gzip whose body is not: the client fails while it reads the stream (a proxy that
    mangles compressed answers)."""


@dataclass
class Function:
    """Decide the reply from the request body (sync or async); may return any other Reply."""

    fn: Callable[[dict[str, Any]], Reply | Awaitable[Reply]]


Reply = Text | ToolUses | HttpError | Undecodable | Hang | Malformed | StreamError | Function


def error_body(type_: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": type_, "message": message}}


def _fmt_seconds(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def last_user_text(body: dict[str, Any]) -> str:
    """Text of the last user turn of a request body (handy inside ``Function``)."""
    for message in reversed(body.get("messages") or []):
        if message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text")
    return ""


IMAGE_MEDIA_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def image_blocks(body: dict[str, Any]) -> list[tuple[str, bytes]]:
    """(media type, bytes) of every ``image`` block in the request's messages, in order."""
    found = []
    for message in body.get("messages") or []:
        content = message.get("content")
        if isinstance(content, list):
            for block in content:
                if isinstance(block, dict) and block.get("type") == "image":
                    source = block.get("source") or {}
                    found.append((str(source.get("media_type")), base64.b64decode(str(source.get("data")))))
    return found


def _pieces(text: str, size: int) -> list[str]:
    size = max(1, size)
    return [text[i : i + size] for i in range(0, len(text), size)]


@dataclass
class Received:
    """One request as it arrived."""

    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)


# ---- the server ------------------------------------------------------------------------------------


class FakeAnthropic:
    """The fake server. Use as ``async with FakeAnthropic() as fake`` or ``await start()`` / ``await stop()``."""

    def __init__(self, *, default: Reply | None = None, api_key: str | None = None) -> None:
        self.default: Reply | None = default if default is not None else Text("ok")
        self.api_key = api_key
        """When set, requests with another ``x-api-key`` get a 401 (not taken from the script)."""
        self.requests: list[dict[str, Any]] = []
        """Every request body that reached the script (in order)."""
        self.received: list[Received] = []
        """Every request, with its headers (lower-case names), including those refused for headers."""
        self.errors: list[BaseException] = []
        """Exceptions raised by ``Function`` callbacks (the client got a 500)."""
        self.base_url = ""
        self.port = 0
        self._queue: deque[Reply] = deque()
        self._runner: web.AppRunner | None = None
        self._closing = asyncio.Event()
        self._ids = itertools.count(1)

    # -- lifecycle --

    async def start(self) -> FakeAnthropic:
        app = web.Application()
        app.router.add_post("/v1/messages", self._messages)
        self._closing = asyncio.Event()
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        self.base_url = f"http://127.0.0.1:{self.port}"
        return self

    async def stop(self) -> None:
        self._closing.set()  # wakes every Hang / hold so handlers finish at once
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> FakeAnthropic:
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

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        headers = {name.lower(): value for name, value in request.headers.items()}
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        self.received.append(Received(body if isinstance(body, dict) else {}, headers))
        key = headers.get("x-api-key", "")
        if not key:
            return _error(401, "authentication_error", "x-api-key header is required")
        if not headers.get("anthropic-version"):
            return _error(400, "invalid_request_error", "anthropic-version: header is required")
        if not isinstance(body, dict):
            return _error(400, "invalid_request_error", "The request body is not valid JSON.")
        problem = _validate(body)
        if problem:
            return _error(400, "invalid_request_error", problem)
        self.requests.append(body)
        request_no = len(self.requests)

        if self.api_key is not None and key != self.api_key:
            reply: Reply | None = HttpError.auth()
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
            return _error(500, "api_error", f"fake: Function failed: {exc!r}")
        if reply is None:
            return _error(500, "api_error", "fake: no scripted reply")

        if isinstance(reply, HttpError):
            payload = reply.body if reply.body is not None else error_body("api_error", f"HTTP {reply.status}")
            text = json.dumps(payload).replace("{api_key}", key)
            return web.Response(
                status=reply.status, text=text, content_type="application/json", headers=reply.headers or {}
            )
        if isinstance(reply, Undecodable):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Content-Encoding": "gzip"})
            await resp.prepare(request)
            await resp.write(b"\x1f\x8b\x08\x00" + b"not deflate at all " * 8)
            await resp.write_eof()
            return resp
        if body.get("stream"):
            return await self._stream(request, body, reply, request_no)
        return await self._plain(body, reply, request_no)

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

    def _message(self, body: dict[str, Any], content: list[dict[str, Any]], stop_reason: str | None,
                 usage: dict[str, int]) -> dict[str, Any]:
        return {
            "id": f"msg_fake_{next(self._ids)}",
            "type": "message",
            "role": "assistant",
            "model": str(body.get("model", "fake-model")),
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": None,
            "usage": usage,
        }

    # -- streaming --

    async def _stream(
        self, request: web.Request, body: dict[str, Any], reply: Reply, request_no: int
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "request-id": "req_fake"},
        )
        await resp.prepare(request)
        fixed = reply.usage if isinstance(reply, (Text, ToolUses)) else None
        input_tokens = fixed[0] if fixed is not None else _estimate_input(body)

        async def send(event: str, data: dict[str, Any]) -> None:
            await resp.write(f"event: {event}\ndata: {json.dumps(data)}\n\n".encode())

        block = itertools.count()

        async def text_block(text: str, size: int, delay: float, hold: asyncio.Event | None = None,
                             hold_after: int = 0) -> bool:
            """A text block; False when the server stopped during a hold (the stream then just ends)."""
            index = next(block)
            await send("content_block_start",
                       {"type": "content_block_start", "index": index,
                        "content_block": {"type": "text", "text": ""}})
            head, tail = (text[:hold_after], text[hold_after:]) if hold is not None else (text, "")
            for piece in _pieces(head, size):
                if delay:
                    await asyncio.sleep(delay)
                await send("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "text_delta", "text": piece}})
            if hold is not None:
                if not await self._wait(hold, None):
                    return False
                for piece in _pieces(tail, size):
                    if delay:
                        await asyncio.sleep(delay)
                    await send("content_block_delta", {"type": "content_block_delta", "index": index,
                                                       "delta": {"type": "text_delta", "text": piece}})
            await send("content_block_stop", {"type": "content_block_stop", "index": index})
            return True

        async def finish(stop_reason: str, output_tokens: int) -> None:
            await send("message_delta", {"type": "message_delta",
                                         "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                                         "usage": {"output_tokens": output_tokens}})
            await send("message_stop", {"type": "message_stop"})

        await send("message_start", {"type": "message_start", "message": self._message(
            body, [], None, {"input_tokens": input_tokens, "output_tokens": 1})})
        await send("ping", {"type": "ping"})

        if isinstance(reply, Text):
            if reply.thinking:
                index = next(block)
                await send("content_block_start", {"type": "content_block_start", "index": index,
                                                   "content_block": {"type": "thinking", "thinking": "",
                                                                     "signature": ""}})
                for piece in _pieces(reply.thinking, reply.chunk_size):
                    if reply.delay:
                        await asyncio.sleep(reply.delay)
                    await send("content_block_delta", {"type": "content_block_delta", "index": index,
                                                       "delta": {"type": "thinking_delta", "thinking": piece}})
                await send("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "signature_delta", "signature": "c2lnbmVk"}})
                await send("content_block_stop", {"type": "content_block_stop", "index": index})
            if not await text_block(reply.text, reply.chunk_size, reply.delay, reply.hold, reply.hold_after):
                await resp.write_eof()  # server stopping: end mid-reply, like a dropped connection
                return resp
            output = fixed[1] if fixed is not None else len(reply.thinking + reply.text) // 4 + 1
            await finish(reply.stop_reason, output)
        elif isinstance(reply, ToolUses):
            if reply.text:
                await text_block(reply.text, 8, reply.delay)
            ids = reply.ids or [f"toolu_{request_no}_{i}" for i in range(len(reply.calls))]
            for i, (name, arguments) in enumerate(reply.calls):
                index = next(block)
                await send("content_block_start", {"type": "content_block_start", "index": index,
                                                   "content_block": {"type": "tool_use", "id": ids[i],
                                                                     "name": name, "input": {}}})
                # the API's first input delta is often empty
                for piece in ["", *_pieces(arguments, reply.fragment_size)]:
                    if reply.delay:
                        await asyncio.sleep(reply.delay)
                    await send("content_block_delta", {"type": "content_block_delta", "index": index,
                                                       "delta": {"type": "input_json_delta", "partial_json": piece}})
                await send("content_block_stop", {"type": "content_block_stop", "index": index})
            completion = reply.text + "".join(n + a for n, a in reply.calls)
            await finish(reply.stop_reason, fixed[1] if fixed is not None else len(completion) // 4 + 1)
        elif isinstance(reply, Hang):
            if reply.after_text:
                index = next(block)
                await send("content_block_start", {"type": "content_block_start", "index": index,
                                                   "content_block": {"type": "text", "text": ""}})
                await send("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "text_delta", "text": reply.after_text}})
            if reply.ping_every:
                deadline = asyncio.get_running_loop().time() + reply.seconds
                while asyncio.get_running_loop().time() < deadline:
                    if not await self._wait(None, reply.ping_every):
                        break
                    await send("ping", {"type": "ping"})
            else:
                await self._wait(None, reply.seconds)
            # ends without message_delta / message_stop: a truncated stream
        elif isinstance(reply, Malformed):
            index = next(block)
            await send("content_block_start", {"type": "content_block_start", "index": index,
                                               "content_block": {"type": "text", "text": ""}})
            if reply.after_text:
                await send("content_block_delta", {"type": "content_block_delta", "index": index,
                                                   "delta": {"type": "text_delta", "text": reply.after_text}})
            await resp.write(b"event: content_block_delta\ndata: {not json\n\n")
        elif isinstance(reply, StreamError):
            if reply.after_text:
                await text_block(reply.after_text, 8, 0.0)
            await send("error", error_body(reply.type, reply.message))
        await resp.write_eof()
        return resp

    # -- non-streaming --

    async def _plain(self, body: dict[str, Any], reply: Reply, request_no: int) -> web.StreamResponse:
        content: list[dict[str, Any]] = []
        stop_reason = "end_turn"
        fixed: tuple[int, int] | None = None
        if isinstance(reply, Text):
            if reply.hold is not None:
                await self._wait(reply.hold, None)
            if reply.delay:
                await asyncio.sleep(reply.delay)
            if reply.thinking:
                content.append({"type": "thinking", "thinking": reply.thinking, "signature": "c2lnbmVk"})
            content.append({"type": "text", "text": reply.text})
            stop_reason, fixed = reply.stop_reason, reply.usage
        elif isinstance(reply, ToolUses):
            ids = reply.ids or [f"toolu_{request_no}_{i}" for i in range(len(reply.calls))]
            if reply.text:
                content.append({"type": "text", "text": reply.text})
            content += [
                {"type": "tool_use", "id": ids[i], "name": name, "input": json.loads(arguments or "{}")}
                for i, (name, arguments) in enumerate(reply.calls)
            ]
            stop_reason, fixed = "tool_use", reply.usage
        elif isinstance(reply, Hang):
            await self._wait(None, reply.seconds)
            content.append({"type": "text", "text": reply.after_text})
        elif isinstance(reply, Malformed):
            return web.Response(status=200, text="{not json", content_type="application/json")
        elif isinstance(reply, StreamError):
            status = 529 if reply.type == "overloaded_error" else 500
            return _error(status, reply.type, reply.message)
        completion = "".join(str(b.get("text") or b.get("thinking") or b.get("input") or "") for b in content)
        usage = {
            "input_tokens": fixed[0] if fixed is not None else _estimate_input(body),
            "output_tokens": fixed[1] if fixed is not None else len(completion) // 4 + 1,
        }
        return web.json_response(self._message(body, content, stop_reason, usage))


def _error(status: int, type_: str, message: str) -> web.Response:
    return web.json_response(error_body(type_, message), status=status)


def _validate(body: dict[str, Any]) -> str | None:
    """The 400 message the API would give for what this fake can check, or None."""
    for name in ("model", "max_tokens", "messages"):
        if name not in body:
            return f"{name}: Field required"
    if not isinstance(body["max_tokens"], int) or body["max_tokens"] < 1:
        return "max_tokens: Input should be a positive integer"
    for name in SAMPLING_PARAMETERS:
        if name in body:
            return f"{name}: Extra inputs are not permitted"
    for i, message in enumerate(body["messages"]):
        if message.get("role") not in ("user", "assistant"):
            return f"messages.{i}.role: Input should be 'user' or 'assistant'"
        content = message.get("content")
        for j, block in enumerate(content if isinstance(content, list) else []):
            if isinstance(block, dict) and block.get("type") == "image":
                problem = _image_problem(block.get("source"))
                if problem:
                    return f"messages.{i}.content.{j}.image.source.base64: {problem}"
    return None


def _image_problem(source: Any) -> str | None:
    """What the API says of an image block's source, as far as this fake checks it."""
    if not isinstance(source, dict) or source.get("type") != "base64":
        return "source.type: Input should be 'base64'"
    if source.get("media_type") not in IMAGE_MEDIA_TYPES:
        return f"media_type: Input should be {', '.join(repr(t) for t in IMAGE_MEDIA_TYPES)}"
    try:
        data = base64.b64decode(str(source.get("data") or ""), validate=True)
    except binascii.Error:
        return "data: invalid base64 data"
    if len(base64.b64encode(data)) > 5 * 1024 * 1024:
        return "image exceeds 5 MB maximum"
    return None


def _estimate_input(body: dict[str, Any]) -> int:
    return len(json.dumps(body.get("messages") or [])) // 4 + len(str(body.get("system") or "")) // 4 + 1
