"""FeishuApi: the Open API calls the channel makes, through lark-oapi's typed client, one attempt each.

The client is built with ``domain`` (Feishu, Lark or a test server) and ``enable_set_token(True)``. That
matters: lark-oapi fetches a missing or expired tenant token with blocking ``requests`` inside every call,
``a``-methods included, which would stall the bridge's event loop for as long as the Open Platform takes
to answer. Here the token is fetched with the SDK's own async ``tenant_access_token.ainternal`` (which needs
no token, so nothing blocks) and passed to every call as a ``RequestOption``. This class owns it: one fetch
at a time (single flight), a new one ten minutes before it expires, and on a token error (99991661,
99991663, 99991665: revoked, rotated, expired early) the token is dropped and the call made once more with
a fresh one — the SDK's own cache would keep the bad token until its expiry.

Every failure becomes a ``PlatformError`` for the shared call policy (``channels.common.calls``), decided
on the business ``code`` only (Feishu says its ``msg`` texts change):

- 99991400 (HTTP 429, the app's rate limit): ``rate_limited`` for ``x-ogw-ratelimit-reset`` seconds;
  230020 (a chat's frequency limit) and 11232 (the tenant's message limit) give no reset: a short pause;
- HTTP 5xx, a non-JSON gateway page, a timeout, a network error: ``transient``; the outcome is unknown (the
  request may have been carried out) for a timeout, a broken connection, an answer that cannot be read
  (lark-oapi fails on it with a ``ValueError``, ``AttributeError``, ``TypeError`` or ``UnmarshalException``,
  depending on how it is broken, or it lacks the data the call answers with), an HTTP 5xx but 502/503 (a
  gateway's "not taken") and the internal error 1500;
- an HTTP error whose JSON has no ``code`` (a gateway's own answer: lark-oapi reads the body only, so such an
  answer would look like success): decided by its status, 429 a pause;
- a message recalled or deleted, a card entity gone: ``not_found``;
- card content Feishu cannot render: ``format``;
- anything else: ``permanent``.

Requests in flight are capped (``max_in_flight``, 32): lark-oapi builds a new HTTP client for every request,
with a TLS context of its own (the CA bundle loaded again: about 0.9 MiB and 30-50 ms of CPU), so without a cap
the memory grows with the number of requests waiting for the CPU at once, which under load is every chat
streaming. Over the cap a request waits its turn; that wait is the bridge's own queue, so it is not counted
against the call's bound (``channels.common.calls.outside_bound``). The CPU, not the cap, is what limits the
requests a second (about 30 on one core at that cost per request). ``busy`` says every slot is taken (the
sink then leaves out live updates that would only queue); ``waiting`` counts the requests queued for one.

The app's sends (creates and replies) also pass an ``ArrivalBudget`` of Feishu's limit (``APP_SEND_LIMIT``, 50
a second): each of them waits for the answer to a request and the building of its client, so under load sends
that left at the channel's pace reach Feishu in bunches; the budget keeps every second Feishu counts within
its limit however they bunch (``channels.common.arrivals``).

Each of those clients is left behind in a reference cycle (with its TLS context, its response and its socket),
which only the garbage collector frees; ``chatbridge run`` makes the collector's young passes rare
(``bridge.gc_tuning``), so they piled up (over a hundred MiB under load). Every ``COLLECT_EVERY`` (32)
requests the young and middle generations are collected, which frees them for about 1 ms of CPU a request.

``str()`` of an error carries the API name, HTTP status and code, never a token or a request body.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping
from typing import Any, Literal, TypeVar
from urllib.parse import quote, urlencode, urlsplit

import aiohttp
import httpx
import lark_oapi as lark
from lark_oapi.api.cardkit.v1 import (
    BatchUpdateCardRequest,
    BatchUpdateCardRequestBody,
    ContentCardElementRequest,
    ContentCardElementRequestBody,
    CreateCardRequest,
    CreateCardRequestBody,
)
from lark_oapi.api.im.v1 import (
    CreateMessageReactionRequest,
    CreateMessageReactionRequestBody,
    CreateMessageRequest,
    CreateMessageRequestBody,
    DeleteMessageReactionRequest,
    DeleteMessageRequest,
    Emoji,
    GetMessageResourceRequest,
    PatchMessageRequest,
    PatchMessageRequestBody,
    ReplyMessageRequest,
    ReplyMessageRequestBody,
    UpdateMessageRequest,
    UpdateMessageRequestBody,
)
from lark_oapi.core.exception import UnmarshalException

from channels.common.arrivals import ArrivalBudget
from channels.common.calls import outside_bound
from channels.common.download import stream_url
from channels.common.errors import PlatformError

log = logging.getLogger(__name__)

R = TypeVar("R")
Pace = Callable[[], Awaitable[None]]

RATE_LIMITED = 99991400
CHAT_RATE_LIMITED = (230020, 11232)
CHAT_LIMIT_PAUSE = 1.0
"""Seconds a chat waits after a frequency limit that names no reset (Feishu allows 5 sends a second)."""
TOKEN_ERRORS = frozenset({99991661, 99991663, 99991665})
NOT_FOUND = frozenset({230011, 230110, 200740, 200750, 231003})
FORMAT = frozenset({230099, 200621, 11310, 200570, 200220, 300303})
TRANSIENT = frozenset({1500, 2200, 5000, 300120})
MAYBE_DONE = frozenset({1500})
"""Feishu's internal error: the request may have been carried out."""
NOT_TAKEN = frozenset({502, 503})
"""Server errors that mean the Open Platform never took the request (a gateway in front of it answers)."""
TOKEN_EARLY = 600.0
"""Seconds before its expiry a tenant token is replaced (as lark-oapi's own cache does)."""
MAX_IN_FLIGHT = 32
COLLECT_EVERY = 32
APP_SEND_LIMIT = 50
"""Feishu's limit on the messages an app sends (creates and replies), in any second."""


class FeishuApi:
    def __init__(self, app_id: str, app_secret: str, domain: str, *, timeout: float = 30.0,
                 max_in_flight: int = MAX_IN_FLIGHT) -> None:
        self.app_id = app_id
        self._in_flight = asyncio.Semaphore(max_in_flight)
        self.sends = ArrivalBudget(APP_SEND_LIMIT)
        """The app's sends as Feishu counts them (see the module docstring)."""
        self.waiting = 0
        """Requests waiting for a slot."""
        self._requests = 0
        self._secret = app_secret
        self.domain = domain
        self.client = (lark.Client.builder().app_id(app_id).app_secret(app_secret).domain(domain)
                       .timeout(timeout).enable_set_token(True).log_level(lark.LogLevel.ERROR).build())
        self._token: str | None = None
        self._expires = 0.0
        self._fetching: asyncio.Task[str] | None = None

    @property
    def busy(self) -> bool:
        """Every request slot is taken: a request made now would wait in the bridge's own queue."""
        return self._in_flight.locked()

    # ---- the tenant token ----------------------------------------------------------------------

    async def token(self) -> str:
        if self._token is not None and time.monotonic() < self._expires:
            return self._token
        if self._fetching is None or self._fetching.done():
            self._fetching = asyncio.ensure_future(self._fetch_token())
        return await asyncio.shield(self._fetching)

    def drop_token(self, token: str) -> None:
        if self._token == token:
            self._token = None

    async def _fetch_token(self) -> str:
        body = (lark.auth.v3.InternalTenantAccessTokenRequestBody.builder().app_id(self.app_id)
                .app_secret(self._secret).build())
        request = lark.auth.v3.InternalTenantAccessTokenRequest.builder().request_body(body).build()
        resp = await self._send("tenant_access_token", lambda: self.client.auth.v3.tenant_access_token.ainternal(
            request))
        # the token and its lifetime are at the top level of the body, which the typed response leaves out
        try:
            data = json.loads(resp.raw.content)
            token, expire = str(data["tenant_access_token"]), float(data.get("expire") or 7200)
        except (ValueError, KeyError, TypeError):
            raise PlatformError("tenant_access_token: unexpected answer", kind="transient") from None
        self._token = token
        self._expires = time.monotonic() + max(60.0, expire - TOKEN_EARLY)
        return token

    # ---- one call ------------------------------------------------------------------------------

    async def _send(self, what: str, fn: Callable[[], Awaitable[R]], pace: Pace | None = None,
                    budget: ArrivalBudget | None = None) -> R:
        """One request, its failures as PlatformError (the response must have code 0). ``pace`` is waited for
        once the request has its slot, right before it goes out: a budget taken earlier, while the request
        still queued for a slot, would let the queue's requests reach the platform in a burst over it. Then
        ``budget`` (the app's sends as Feishu counts them) is taken, and given back with the answer."""
        if self._in_flight.locked():
            self.waiting += 1
            try:
                async with outside_bound():
                    await self._in_flight.acquire()
            finally:
                self.waiting -= 1
        else:
            await self._in_flight.acquire()
        try:
            if pace is not None:
                await pace()
            async with budget.slot() if budget is not None else contextlib.nullcontext():
                resp: Any = await fn()
        except httpx.TimeoutException:
            raise PlatformError(f"{what}: no answer in time", kind="transient", outcome_unknown=True) from None
        except httpx.ConnectError as exc:
            raise PlatformError(f"{what}: cannot connect ({type(exc).__name__})", kind="transient") from None
        except (httpx.HTTPError, ValueError, AttributeError, TypeError, UnmarshalException) as exc:
            # a dropped connection, or an answer lark-oapi could not read (a gateway's HTML page, a body that is
            # not UTF-8, JSON of another shape): the request may have been carried out
            raise PlatformError(f"{what}: {type(exc).__name__}", kind="transient", outcome_unknown=True) from None
        finally:
            self._in_flight.release()
            self._requests += 1
            if self._requests % COLLECT_EVERY == 0:
                gc.collect(1)  # the SDK's clients of the last requests, left in reference cycles
        raw = getattr(resp, "raw", None)
        status = int(getattr(raw, "status_code", 0) or 0)
        if resp.code is None:  # a body without Feishu's code: a gateway's answer, decided by its status
            if status >= 400:
                raise refused(what, status, 0, getattr(raw, "headers", None) or {})
            raise PlatformError(f"{what}: HTTP {status}, an answer without a code", kind="transient",
                                outcome_unknown=True)
        code = int(resp.code)
        if code == 0:
            return resp  # type: ignore[no-any-return]
        raise _error(what, code, resp)

    async def call(self, what: str, fn: Callable[[lark.RequestOption], Awaitable[R]], pace: Pace | None = None,
                   budget: ArrivalBudget | None = None) -> R:
        """An authenticated call; a token error refreshes the token once."""
        for attempt in range(2):
            token = await self.token()
            option = lark.RequestOption.builder().tenant_access_token(token).build()
            try:
                return await self._send(what, lambda o=option: fn(o), pace, budget)  # type: ignore[misc]
            except _TokenError:
                self.drop_token(token)
                if attempt:
                    raise PlatformError(f"{what}: the tenant token was refused twice", kind="permanent") from None
                log.info("%s: the tenant token was refused; fetching a new one", what)
        raise AssertionError("unreachable")

    # ---- the calls the channel makes -------------------------------------------------------------

    async def bot_open_id(self) -> str:
        request = (lark.BaseRequest.builder().http_method(lark.HttpMethod.GET).uri("/open-apis/bot/v3/info")
                   .token_types({lark.AccessTokenType.TENANT}).build())
        resp: Any = await self.call("bot.info", lambda o: self.client.arequest(request, o))
        try:
            return str(json.loads(resp.raw.content)["bot"]["open_id"])
        except (ValueError, KeyError, TypeError):
            raise PlatformError("bot.info: unexpected answer", kind="transient") from None

    async def send(self, chat_id: str, msg_type: str, content: str, uuid: str, *,
                   reply_to: str | None = None, in_thread: bool = False, pace: Pace | None = None) -> str:
        """Post a message (as a reply to ``reply_to`` when given); ``uuid`` makes a retry post nothing new;
        ``pace`` takes the send's slot of a budget right before it goes out."""
        if reply_to:
            body = ReplyMessageRequestBody.builder().msg_type(msg_type).content(content).uuid(uuid[:50])
            if in_thread:
                body = body.reply_in_thread(True)
            reply = ReplyMessageRequest.builder().message_id(reply_to).request_body(body.build()).build()
            resp: Any = await self.call("message.reply", lambda o: self.client.im.v1.message.areply(reply, o), pace,
                                        self.sends)
        else:
            cbody = (CreateMessageRequestBody.builder().receive_id(chat_id).msg_type(msg_type).content(content)
                     .uuid(uuid[:50]).build())
            create = CreateMessageRequest.builder().receive_id_type("chat_id").request_body(cbody).build()
            resp = await self.call("message.create", lambda o: self.client.im.v1.message.acreate(create, o), pace,
                                   self.sends)
        return _answered("message.reply" if reply_to else "message.create", resp, "message_id")

    async def update(self, message_id: str, msg_type: str, content: str) -> None:
        """Edit a text or post message (PUT)."""
        body = UpdateMessageRequestBody.builder().msg_type(msg_type).content(content).build()
        request = UpdateMessageRequest.builder().message_id(message_id).request_body(body).build()
        await self.call("message.update", lambda o: self.client.im.v1.message.aupdate(request, o))

    async def patch_card(self, message_id: str, card: dict[str, Any]) -> None:
        """Replace the card of a card message sent as JSON (not one sent by card_id)."""
        body = PatchMessageRequestBody.builder().content(json.dumps(card, ensure_ascii=False)).build()
        request = PatchMessageRequest.builder().message_id(message_id).request_body(body).build()
        await self.call("message.patch", lambda o: self.client.im.v1.message.apatch(request, o))

    async def delete(self, message_id: str) -> None:
        request = DeleteMessageRequest.builder().message_id(message_id).build()
        await self.call("message.delete", lambda o: self.client.im.v1.message.adelete(request, o))

    async def react(self, message_id: str, emoji: str) -> str:
        body = CreateMessageReactionRequestBody.builder().reaction_type(
            Emoji.builder().emoji_type(emoji).build()).build()
        request = CreateMessageReactionRequest.builder().message_id(message_id).request_body(body).build()
        resp: Any = await self.call("reaction.create",
                                    lambda o: self.client.im.v1.message_reaction.acreate(request, o))
        return str(resp.data.reaction_id)

    async def unreact(self, message_id: str, reaction_id: str) -> None:
        request = DeleteMessageReactionRequest.builder().message_id(message_id).reaction_id(reaction_id).build()
        await self.call("reaction.delete", lambda o: self.client.im.v1.message_reaction.adelete(request, o))

    async def open_resource(self, session: aiohttp.ClientSession, message_id: str, file_key: str,
                            kind: Literal["image", "file"]) -> tuple[AsyncGenerator[bytes, None], bytes]:
        """One attempt at ``GET /open-apis/im/v1/messages/{message_id}/resources/{file_key}?type=image|file``
        (scope ``im:message`` or ``im:message:readonly``): the download once it started, and its first chunk.

        The request is lark-oapi's typed ``GetMessageResourceRequest``, but its bytes are streamed here:
        ``message_resource.aget`` reads the whole body into memory (up to Feishu's 100 MB per resource)
        before it returns, which ``[media] max_bytes`` could not bound (and, looking up ``Content-Type`` in
        httpx's lower-cased headers, leaves a refusal's code unread). A refusal is a PlatformError decided
        on its business code like every other call; a refused token is replaced once."""
        request = (GetMessageResourceRequest.builder().message_id(message_id).file_key(file_key).type(kind)
                   .build())
        path = str(request.uri)
        for name, value in request.paths.items():
            path = path.replace(f":{name}", quote(value, safe=""))
        url = f"{self.domain.rstrip('/')}{path}?{urlencode(request.queries)}"
        host = urlsplit(self.domain).hostname or ""
        for attempt in range(2):
            token = await self.token()
            chunks = stream_url(session, url, allowed_hosts={host}, headers={"Authorization": f"Bearer {token}"},
                                refusal=_resource_refusal)
            try:
                first = await anext(chunks, b"")
            except _TokenError:
                self.drop_token(token)
                if attempt:
                    raise PlatformError("message_resource.get: the tenant token was refused twice",
                                        kind="permanent") from None
                log.info("message_resource.get: the tenant token was refused; fetching a new one")
                continue
            except BaseException:
                await chunks.aclose()
                raise
            return chunks, first
        raise AssertionError("unreachable")

    async def create_card(self, card: dict[str, Any]) -> str:
        body = CreateCardRequestBody.builder().type("card_json").data(json.dumps(card, ensure_ascii=False)).build()
        request = CreateCardRequest.builder().request_body(body).build()
        resp: Any = await self.call("card.create", lambda o: self.client.cardkit.v1.card.acreate(request, o))
        return _answered("card.create", resp, "card_id")

    async def card_content(self, card_id: str, element_id: str, content: str, sequence: int, uuid: str) -> None:
        body = (ContentCardElementRequestBody.builder().content(content).sequence(sequence).uuid(uuid)
                .build())
        request = (ContentCardElementRequest.builder().card_id(card_id).element_id(element_id)
                   .request_body(body).build())
        await self.call("element.content", lambda o: self.client.cardkit.v1.card_element.acontent(request, o))

    async def card_batch(self, card_id: str, actions: list[dict[str, Any]], sequence: int, uuid: str) -> None:
        body = (BatchUpdateCardRequestBody.builder().actions(json.dumps(actions, ensure_ascii=False))
                .sequence(sequence).uuid(uuid).build())
        request = BatchUpdateCardRequest.builder().card_id(card_id).request_body(body).build()
        await self.call("card.batch_update", lambda o: self.client.cardkit.v1.card.abatch_update(request, o))


class FeishuError(PlatformError):
    """A refused call, with Feishu's business ``code``."""

    def __init__(self, detail: str, code: int, **kw: Any) -> None:
        super().__init__(detail, **kw)
        self.code = code


class _TokenError(FeishuError):
    pass


def _error(what: str, code: int, resp: Any) -> PlatformError:
    raw = getattr(resp, "raw", None)
    return refused(what, int(getattr(raw, "status_code", 0) or 0), code, getattr(raw, "headers", None) or {})


def refused(what: str, status: int, code: int, headers: Mapping[str, str]) -> PlatformError:
    """A refused call as the PlatformError the call policy decides on (by ``code``; by status for a gateway's
    answer without one)."""
    detail = f"{what}: HTTP {status}, code {code}"
    if code in TOKEN_ERRORS:
        return _TokenError(detail, code, kind="permanent")
    if code == RATE_LIMITED or (status == 429 and not code):
        lowered = {str(k).lower(): v for k, v in headers.items()}
        try:
            reset = float(lowered.get("x-ogw-ratelimit-reset") or 1.0)
        except ValueError:
            reset = 1.0
        return FeishuError(detail, code, kind="rate_limited", retry_after=max(reset, 0.5))
    if code in CHAT_RATE_LIMITED:
        return FeishuError(detail, code, kind="rate_limited", retry_after=CHAT_LIMIT_PAUSE)
    if status >= 500 or code in TRANSIENT:
        maybe = status not in NOT_TAKEN and (code in MAYBE_DONE or status >= 500)
        return FeishuError(detail, code, kind="transient", outcome_unknown=maybe)
    if code in NOT_FOUND:
        return FeishuError(detail, code, kind="not_found")
    if code in FORMAT:
        return FeishuError(detail, code, kind="format")
    return FeishuError(detail, code, kind="permanent")


def _resource_refusal(status: int, headers: Mapping[str, str], body: bytes) -> PlatformError:
    try:
        code = int(json.loads(body).get("code") or 0)
    except (ValueError, TypeError, AttributeError):
        code = 0  # a gateway's page: decided by the status
    return refused("message_resource.get", status, code, headers)


def _answered(what: str, resp: Any, field: str) -> str:
    """The id a successful call answers with; an answer without it was carried out but cannot be used: a
    repeat (under the same uuid where the call takes one) answers with it."""
    value = getattr(getattr(resp, "data", None), field, None)
    if not value:
        raise PlatformError(f"{what}: an answer without its {field}", kind="transient", outcome_unknown=True)
    return str(value)


def code_of(exc: BaseException) -> int | None:
    """The business code of a refused call (None for a network failure or another error)."""
    return exc.code if isinstance(exc, FeishuError) else None
