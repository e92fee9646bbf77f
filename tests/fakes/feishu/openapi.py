"""A protocol-level fake of the Feishu/Lark Open API on 127.0.0.1, driven by the real lark-oapi client.

Build the client with ``lark.Client.builder().app_id(fake.app_id).app_secret(fake.app_secret)
.domain(fake.base_url)``: every API, CardKit included, then goes to this server. It runs in its own thread
(see ``server_thread``), so the SDK's blocking token fetch cannot deadlock it.

What it implements, with Feishu's wire shapes (``{"code": 0, "msg": "success", "data": ...}``, errors with the
documented HTTP status, business code and message):

- ``GET /open-apis/bot/v3/info``: the bot's open_id and name (no typed SDK method: ``client.arequest``).
- ``POST /open-apis/auth/v3/tenant_access_token/internal``: tokens last ``token_ttl`` seconds; asking again
  returns the same token while it has 30 minutes or more left, a new one otherwise (both stay valid), as
  Feishu does. ``revoke_tokens()`` invalidates every issued token: the next call gets 99991663.
- im/v1 messages: create (``receive_id_type`` chat_id/open_id), reply (``reply_in_thread``), update (PUT, text
  and post only, at most 20 edits), patch (cards, ``update_multi`` required), delete (recall); the ``uuid``
  idempotency key of create/reply: a repeated uuid returns the first message and never posts twice. Content
  limits: text 150 KB, post and cards 30 KB (230025); cards at most 200 elements.
- Reactions: create and delete.
- Message resources (``GET /open-apis/im/v1/messages/{message_id}/resources/{file_key}?type=image|file``):
  the bytes of a resource added with ``add_resource`` to a user's message, as a binary body with the
  resource's ``Content-Type`` (which a test may set wrong) and a ``Content-Disposition`` naming the file.
  A key that is not in that message answers 234003 (HTTP 400), an image asked for as ``type=file`` (or the
  other way round) or a missing ``type`` 234001; ``downloads`` lists what was handed out.
- CardKit v1: cards create (JSON 2.0 only), update (PUT), settings (PATCH), batch_update, and element
  content (the streaming text update), create, update, patch, delete. Every card operation carries a
  ``sequence`` that must be strictly greater than the card's last one (300317); element content needs
  ``streaming_mode`` on (300309) and a markdown or plain_text element (300310); a card must stay within
  30 KB (200860). CardKit's ``uuid`` makes a repeated operation a no-op.
- Slow answers (``delays``: seconds per route), calls held until the test lets them through (``hold``), and
  the most requests handled at once (``max_in_flight``).
- Faults per call (``fail``): by route and/or method, the nth call of a route, a predicate on the request;
  any HTTP status, business code, headers (e.g. 99991400 with 429 and ``x-ogw-ratelimit-reset``), a raw
  non-JSON body (a gateway 5xx), a hang (a client timeout), or carrying the call out before failing (a lost
  response).
- Rate limits (``enforce_limits``, off unless asked for), as Feishu publishes them: sending (create, reply) at
  most 50 a second for the app (99991400, HTTP 429 with the ``x-ogw-ratelimit-*`` headers) and 5 a second to
  one chat (230020, HTTP 400); a card entity updated at most 10 times a second (99991400).

It keeps what every chat shows: the bot's and users' messages with their current content, whether they
were edited or recalled, their reactions, and for a card sent by ``card_id`` the card entity itself (its
elements and their content, streaming state, sequence history). ``shown(chat_id)`` and ``texts(chat_id)``
are what a user would see.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import re
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.fakes.feishu.server_thread import ServerThread

TEXT_LIMIT = 150 * 1024
"""Bytes of a text message's request content."""
CARD_LIMIT = 30 * 1024
"""Bytes of a card's or a post's content (Feishu documents the figure as 30 KB)."""
CARD_ELEMENT_LIMIT = 200
CONTENT_CHARS_LIMIT = 100_000
"""Characters of one element content (streaming text) update."""
MAX_EDITS = 20
ELEMENT_ID = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,19}")
"""Feishu's rule for element_id: letters, digits, underscore; a letter first; at most 20 characters."""
STREAMING_TIMEOUT = 600.0
HOLD_LIMIT = 30.0
"""Seconds a held call waits at most for its gate (``hold``)."""
"""Seconds after which Feishu closes a card's streaming_mode by itself (then content updates get 200850)."""
UUID_WINDOW = 3600.0
"""Seconds during which a message uuid is remembered (Feishu: at most one message per uuid within an hour)."""

OK_MSG = "success"
ROUTES = (
    "token", "bot.info", "message.create", "message.reply", "message.update", "message.patch", "message.delete",
    "reaction.create", "reaction.delete", "card.create", "card.update", "card.settings", "card.batch_update",
    "element.content", "element.create", "element.update", "element.patch", "element.delete",
    "message_resource.get",
)
RESOURCE_TYPES = ("image", "file")


class ApiError(Exception):
    def __init__(self, code: int, msg: str, status: int = 400, headers: dict[str, str] | None = None) -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg
        self.status = status
        self.headers = headers or {}


SENDS = frozenset({"message.create", "message.reply"})
CARD_OPS = frozenset({"card.update", "card.settings", "card.batch_update", "element.content", "element.create",
                      "element.update", "element.patch", "element.delete"})


def app_limited() -> ApiError:
    return ApiError(99991400, "request trigger frequency limit", 429,
                    {"x-ogw-ratelimit-limit": "50", "x-ogw-ratelimit-reset": "1"})


def chat_limited() -> ApiError:
    return ApiError(230020, "This operation triggers the frequency limit.")


@dataclass
class RateLimit:
    """At most ``limit`` calls of ``routes`` within ``window`` seconds per ``per`` (app, chat or card)."""

    routes: frozenset[str]
    per: str
    limit: int
    window: float
    error: Callable[[], ApiError]
    seen: dict[str, deque[float]] = field(default_factory=dict)

    def full(self, key: str, now: float) -> bool:
        """Whether a call now would exceed the limit (calls refused count for no budget)."""
        recent = self.seen.setdefault(key, deque())
        while recent and now - recent[0] >= self.window:
            recent.popleft()
        return len(recent) >= self.limit

    def take(self, key: str, now: float) -> None:
        self.seen[key].append(now)


def invalid_param(detail: str) -> ApiError:
    return ApiError(230001, f"Your request contains an invalid request parameter, ext={detail}.")


@dataclass
class Call:
    route: str
    method: str
    path: str
    query: dict[str, str]
    body: Any
    headers: dict[str, str]
    at: float
    status: int = 200
    code: int = 0


@dataclass
class Fault:
    route: str | None = None
    method: str | None = None
    status: int = 500
    code: int = 1500
    msg: str = "internal error"
    headers: dict[str, str] = field(default_factory=dict)
    raw_body: str | None = None
    """Answer with this text instead of a JSON envelope (what a gateway's 502 page looks like)."""
    nth: int | None = None
    """Fail only the nth call (1-based) of this route; counts calls since the fault was added."""
    times: int = 1
    when: Callable[[Call], bool] | None = None
    hang: float = 0.0
    """Seconds to wait before answering (longer than the client's timeout: the call times out)."""
    apply_first: bool = False
    """Carry the call out, then answer with the error (the work was done, the response was lost)."""
    seen: int = 0
    hits: int = 0

    def matches(self, call: Call) -> bool:
        if self.times <= 0:
            return False
        if self.route is not None and self.route != call.route:
            return False
        if self.method is not None and self.method.upper() != call.method:
            return False
        if self.when is not None and not self.when(call):
            return False
        self.seen += 1
        return self.nth is None or self.seen == self.nth


@dataclass
class Card:
    card_id: str
    data: dict[str, Any]
    sequence: int = 0
    sequences: list[int] = field(default_factory=list)
    message_id: str | None = None
    uuids: dict[str, str] = field(default_factory=dict)
    streaming_since: float | None = None
    """When streaming_mode was last turned on (Feishu turns it off by itself 10 minutes later)."""

    @property
    def config(self) -> dict[str, Any]:
        return self.data.setdefault("config", {})

    @property
    def streaming(self) -> bool:
        return bool(self.config.get("streaming_mode"))

    @property
    def elements(self) -> list[dict[str, Any]]:
        return self.data.setdefault("body", {}).setdefault("elements", [])

    def element(self, element_id: str) -> dict[str, Any] | None:
        return next((e for e in walk_elements(self.elements) if e.get("element_id") == element_id), None)

    @property
    def text(self) -> str:
        return card_text(self.data)

    @property
    def buttons(self) -> list[tuple[str, Any]]:
        return card_buttons(self.data)


@dataclass
class Message:
    message_id: str
    chat_id: str
    msg_type: str
    content: dict[str, Any]
    from_bot: bool
    sender_open_id: str | None = None
    root_id: str | None = None
    parent_id: str | None = None
    thread_id: str | None = None
    uuid: str | None = None
    deleted: bool = False
    edits: int = 0
    patches: int = 0
    created: float = 0.0
    reactions: dict[str, str] = field(default_factory=dict)
    """reaction_id → emoji_type, the bot's reactions on this message."""


@dataclass
class Resource:
    """An image, file, voice message or video of a user's message."""

    data: bytes
    kind: str  # image | file: the ``type`` it is downloaded as
    content_type: str
    file_name: str | None = None


@dataclass
class Chat:
    chat_id: str
    chat_type: str  # p2p | group
    user_open_id: str | None = None


def walk_elements(elements: list[Any]) -> Iterator[dict[str, Any]]:
    """Every element of a card body, depth first, containers included."""
    for element in elements:
        if not isinstance(element, dict):
            continue
        yield element
        for key in ("elements", "columns", "actions"):
            children = element.get(key)
            if isinstance(children, list):
                yield from walk_elements(children)


def card_text(card: dict[str, Any]) -> str:
    """What a user reads on a card: its title and every markdown and plain text element, in order."""
    parts: list[str] = []
    title = ((card.get("header") or {}).get("title") or {}).get("content")
    if title:
        parts.append(str(title))
    body = card.get("body") or {}
    elements = body.get("elements") if isinstance(body, dict) else None
    for element in walk_elements(elements if elements is not None else card.get("elements") or []):
        tag = element.get("tag")
        if tag == "markdown" or tag == "plain_text":
            parts.append(str(element.get("content", "")))
        elif tag == "div":
            parts.append(str((element.get("text") or {}).get("content", "")))
    return "\n\n".join(p for p in parts if p)


def card_buttons(card: dict[str, Any]) -> list[tuple[str, Any]]:
    """The card's buttons as (label, callback value); JSON 2.0 ``behaviors`` and 1.0 ``value`` both."""
    body = card.get("body") or {}
    elements = body.get("elements") if isinstance(body, dict) else None
    buttons: list[tuple[str, Any]] = []
    for element in walk_elements(elements if elements is not None else card.get("elements") or []):
        if element.get("tag") != "button":
            continue
        label = str((element.get("text") or {}).get("content", ""))
        value = element.get("value")
        for behavior in element.get("behaviors") or []:
            if behavior.get("type") == "callback":
                value = behavior.get("value")
        buttons.append((label, value))
    return buttons


def post_text(content: dict[str, Any]) -> str:
    """The words of a post message, paragraph by paragraph."""
    lang = next(iter(content.values()), {}) if "content" not in content else content
    lines: list[str] = []
    if lang.get("title"):
        lines.append(str(lang["title"]))
    for paragraph in lang.get("content") or []:
        line = ""
        for node in paragraph:
            tag = node.get("tag")
            if tag in ("text", "a", "md", "code_block"):
                line += str(node.get("text", ""))
            elif tag == "at":
                line += f"@{node.get('user_name') or node.get('user_id')}"
            elif tag == "hr":
                line += "---"
        lines.append(line)
    return "\n".join(lines)


def utf8(text: str) -> int:
    return len(text.encode("utf-8"))


class FakeFeishu:
    def __init__(self, *, token_ttl: int = 7200, bot_open_id: str = "ou_bot0000000000000000000000000000",
                 bot_name: str = "chatbridge") -> None:
        # a unique app id per fake: lark-oapi caches tenant tokens process-wide by app_id
        self.app_id = f"cli_{secrets.token_hex(8)}"
        self.app_secret = secrets.token_urlsafe(24)
        self.bot_open_id = bot_open_id
        self.bot_name = bot_name
        self.token_ttl = token_ttl
        self.tenant_key = "tenant_0001"
        self.calls: list[Call] = []
        self.faults: list[Fault] = []
        self.messages: dict[str, Message] = {}
        self.rate_limits: list[RateLimit] = []
        self.chats: dict[str, Chat] = {}
        self.cards: dict[str, Card] = {}
        self.resources: dict[tuple[str, str], Resource] = {}
        """(message_id, key) → the resource a user's message carries."""
        self.downloads: list[tuple[str, str, str]] = []
        """(message_id, key, type) of every resource handed out, in order."""
        self.tokens: dict[str, float] = {}
        """Issued tenant tokens → expiry (monotonic)."""
        self.clock: Callable[[], float] = time.monotonic
        self.delays: dict[str, float] = {}
        """Route → seconds every call of it waits before it is handled (a slow Open Platform)."""
        self.held: dict[str, threading.Event] = {}
        """Route → a gate every call of it waits behind until it is set (``hold``)."""
        self.in_flight = 0
        self.max_in_flight = 0
        """The most requests this server was handling at once."""
        self._uuids: dict[tuple[str, str], tuple[str, float]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.RLock()
        self._server = ServerThread(self._app, name="fake-feishu-openapi")
        self.base_url = ""

    # ---- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> FakeFeishu:
        self.base_url = self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def __enter__(self) -> FakeFeishu:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    async def __aenter__(self) -> FakeFeishu:
        return await asyncio.to_thread(self.start)

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.to_thread(self.stop)

    # ---- driving it from a test --------------------------------------------------------------------

    def fail(self, route: str | None = None, **kw: Any) -> Fault:
        if route is not None and route not in ROUTES:
            raise ValueError(f"unknown route {route!r}; one of {ROUTES}")
        fault = Fault(route, **kw)
        with self._lock:
            self.faults.append(fault)
        return fault

    def hold(self, route: str) -> threading.Event:
        """Calls of ``route`` are not answered until the returned event is set (at most HOLD_LIMIT seconds)."""
        if route not in ROUTES:
            raise ValueError(f"unknown route {route!r}; one of {ROUTES}")
        gate = self.held[route] = threading.Event()
        return gate

    def rate_limit(self, route: str | None = None, *, reset: int = 30, **kw: Any) -> Fault:
        """99991400 with HTTP 429 and the ``x-ogw-ratelimit-*`` headers, as Feishu's gateway answers."""
        headers = {"x-ogw-ratelimit-limit": "50", "x-ogw-ratelimit-reset": str(reset)}
        return self.fail(route, status=429, code=99991400, msg="request trigger frequency limit",
                         headers=headers, **kw)

    def enforce_limits(self, *, app_sends: int = 50, chat_sends: int = 5, card_updates: int = 10) -> None:
        """Answer as Feishu does past its published limits, per second: ``app_sends`` messages sent by the app,
        ``chat_sends`` to one chat, ``card_updates`` operations on one card entity."""
        with self._lock:
            self.rate_limits = [RateLimit(SENDS, "app", app_sends, 1.0, app_limited),
                                RateLimit(SENDS, "chat", chat_sends, 1.0, chat_limited),
                                RateLimit(CARD_OPS, "card", card_updates, 1.0, app_limited)]

    def _enforce(self, call: Call, match: dict[str, str]) -> None:
        now = self.clock()
        applying = []
        for rule in self.rate_limits:
            if call.route not in rule.routes:
                continue
            if rule.per == "card":
                key = match.get("card_id", "")
            elif rule.per == "chat":
                replied = self.messages.get(match.get("message_id", ""))
                key = replied.chat_id if replied is not None else str((call.body or {}).get("receive_id"))
            else:
                key = "app"
            if rule.full(key, now):
                raise rule.error()
            applying.append((rule, key))
        for rule, key in applying:
            rule.take(key, now)

    def chat_rate_limit(self, route: str | None = None, **kw: Any) -> Fault:
        """230020, the per-chat frequency limit of the message APIs (HTTP 400)."""
        return self.fail(route, status=400, code=230020, msg="This operation triggers the frequency limit.", **kw)

    def revoke_tokens(self) -> None:
        """Every tenant token issued so far stops working (as after a secret reset or expiry)."""
        with self._lock:
            self.tokens.clear()

    def chat(self, chat_id: str, chat_type: str = "group", *, user_open_id: str | None = None) -> Chat:
        with self._lock:
            chat = self.chats.get(chat_id)
            if chat is None:
                chat = self.chats[chat_id] = Chat(chat_id, chat_type, user_open_id)
            return chat

    def user_message(self, chat_id: str, text: str = "", *, chat_type: str = "group",
                     open_id: str = "ou_user0000000000000000000000000001", msg_type: str = "text",
                     content: dict[str, Any] | None = None, parent_id: str | None = None,
                     thread: bool = False) -> Message:
        """Record a message a user posted (so that the bot can reply to it and react on it)."""
        with self._lock:
            self.chat(chat_id, chat_type, user_open_id=open_id if chat_type == "p2p" else None)
            message = Message(self._new_id("om_"), chat_id, msg_type, content or {"text": text}, from_bot=False,
                              sender_open_id=open_id, created=self.clock())
            if parent_id is not None:
                parent = self.messages[parent_id]
                message.parent_id = parent_id
                message.root_id = parent.root_id or parent_id
                message.thread_id = parent.thread_id
            elif thread:
                message.thread_id = self._new_id("omt_")
            self.messages[message.message_id] = message
            return message

    def add_resource(self, message: Message, key: str, data: bytes, *, kind: str = "file",
                     content_type: str = "application/octet-stream", file_name: str | None = None) -> None:
        """Attach a resource to a user's message (an image is ``kind="image"``, anything else ``"file"``)."""
        if kind not in RESOURCE_TYPES:
            raise ValueError(f"kind is one of {RESOURCE_TYPES}")
        with self._lock:
            self.resources[(message.message_id, key)] = Resource(data, kind, content_type, file_name)

    def shown(self, chat_id: str, *, bot_only: bool = True) -> list[Message]:
        """The messages a user of ``chat_id`` sees now (the bot's, by default), oldest first."""
        with self._lock:
            return [m for m in self.messages.values()
                    if m.chat_id == chat_id and not m.deleted and (m.from_bot or not bot_only)]

    def text_of(self, message: Message) -> str:
        """What a user reads in one message (a card sent by id shows its card entity)."""
        with self._lock:
            if message.msg_type == "text":
                return str(message.content.get("text", ""))
            if message.msg_type == "post":
                return post_text(message.content)
            if message.msg_type == "interactive":
                card = self.card_of(message)
                return card.text if card is not None else card_text(message.content)
            return json.dumps(message.content, ensure_ascii=False)

    def texts(self, chat_id: str) -> list[str]:
        return [self.text_of(m) for m in self.shown(chat_id)]

    def card_of(self, message: Message) -> Card | None:
        with self._lock:
            if message.content.get("type") == "card":
                return self.cards.get(str((message.content.get("data") or {}).get("card_id")))
            return None

    def calls_to(self, *routes: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if not routes or c.route in routes]

    def count(self, route: str) -> int:
        return len(self.calls_to(route))

    # ---- the protocol ------------------------------------------------------------------------------

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids):06d}{secrets.token_hex(6)}"

    def _app(self) -> web.Application:
        app = web.Application(client_max_size=4 * 1024 * 1024)
        r = app.router
        r.add_post("/open-apis/auth/v3/tenant_access_token/internal", self._route("token", self._token, auth=False))
        r.add_get("/open-apis/bot/v3/info", self._route("bot.info", self._bot_info))
        r.add_post("/open-apis/im/v1/messages", self._route("message.create", self._create))
        r.add_post("/open-apis/im/v1/messages/{message_id}/reply", self._route("message.reply", self._reply))
        r.add_put("/open-apis/im/v1/messages/{message_id}", self._route("message.update", self._update))
        r.add_patch("/open-apis/im/v1/messages/{message_id}", self._route("message.patch", self._patch))
        r.add_delete("/open-apis/im/v1/messages/{message_id}", self._route("message.delete", self._delete))
        r.add_post("/open-apis/im/v1/messages/{message_id}/reactions",
                   self._route("reaction.create", self._react))
        r.add_delete("/open-apis/im/v1/messages/{message_id}/reactions/{reaction_id}",
                     self._route("reaction.delete", self._unreact))
        r.add_post("/open-apis/cardkit/v1/cards", self._route("card.create", self._card_create))
        r.add_put("/open-apis/cardkit/v1/cards/{card_id}", self._route("card.update", self._card_update))
        r.add_patch("/open-apis/cardkit/v1/cards/{card_id}/settings",
                    self._route("card.settings", self._card_settings))
        r.add_post("/open-apis/cardkit/v1/cards/{card_id}/batch_update",
                   self._route("card.batch_update", self._card_batch))
        r.add_put("/open-apis/cardkit/v1/cards/{card_id}/elements/{element_id}/content",
                  self._route("element.content", self._element_content))
        r.add_post("/open-apis/cardkit/v1/cards/{card_id}/elements",
                   self._route("element.create", self._element_create))
        r.add_put("/open-apis/cardkit/v1/cards/{card_id}/elements/{element_id}",
                  self._route("element.update", self._element_update))
        r.add_patch("/open-apis/cardkit/v1/cards/{card_id}/elements/{element_id}",
                    self._route("element.patch", self._element_patch))
        r.add_delete("/open-apis/cardkit/v1/cards/{card_id}/elements/{element_id}",
                     self._route("element.delete", self._element_delete))
        r.add_get("/open-apis/im/v1/messages/{message_id}/resources/{file_key}",
                  self._route("message_resource.get", self._resource))
        return app

    Handler = Callable[[Call, dict[str, str]], Any]

    def _route(self, name: str, handler: Handler, *, auth: bool = True) -> Callable[[web.Request], Any]:
        async def handle(request: web.Request) -> web.StreamResponse:
            with self._lock:
                self.in_flight += 1
                self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                if self.delays.get(name):
                    await asyncio.sleep(self.delays[name])
                gate = self.held.get(name)
                for _ in range(int(HOLD_LIMIT / 0.01)):  # polled: the gate is set from the test's thread
                    if gate is None or gate.is_set():
                        break
                    await asyncio.sleep(0.01)
                return await answer(request)
            finally:
                with self._lock:
                    self.in_flight -= 1

        async def answer(request: web.Request) -> web.StreamResponse:
            raw = await request.read()
            try:
                # the SDK's blocking token request sends JSON without a Content-Type: parse whatever came
                body = json.loads(raw) if raw else None
            except ValueError:
                return self._error(ApiError(9499, "bad request: body is not JSON"))
            call = Call(name, request.method, request.path, dict(request.query), body,
                        {k.lower(): v for k, v in request.headers.items()}, self.clock())
            with self._lock:
                self.calls.append(call)
                fault = next((f for f in self.faults if f.matches(call)), None)
                if fault is not None:
                    fault.times -= 1
                    fault.hits += 1
            if fault is not None:
                if fault.apply_first:  # carried out at once, as Feishu does with a request it received
                    try:
                        self._run(call, handler, dict(request.match_info), auth)
                    except ApiError:
                        pass
                if fault.hang:
                    await asyncio.sleep(fault.hang)
                call.status, call.code = fault.status, fault.code
                if fault.raw_body is not None:
                    return web.Response(status=fault.status, text=fault.raw_body, headers=fault.headers,
                                        content_type="text/html")
                return self._error(ApiError(fault.code, fault.msg, fault.status, fault.headers))
            try:
                data = self._run(call, handler, dict(request.match_info), auth)
            except ApiError as exc:
                call.status, call.code = exc.status, exc.code
                return self._error(exc)
            if isinstance(data, Resource):  # a binary body, no JSON envelope
                disposition = f"attachment; filename=\"{data.file_name}\"" if data.file_name else "attachment"
                return web.Response(body=data.data, headers={"Content-Type": data.content_type,
                                                             "Content-Disposition": disposition})
            if name in ("token", "bot.info"):  # these two answer without the "data" wrapper
                return web.json_response(data)
            return web.json_response({"code": 0, "msg": OK_MSG, "data": data})
        return handle

    def _run(self, call: Call, handler: Handler, match: dict[str, str], auth: bool) -> Any:
        with self._lock:
            if auth:
                self._check_token(call)
            self._enforce(call, match)
            return handler(call, match)

    @staticmethod
    def _error(exc: ApiError) -> web.Response:
        body = {"code": exc.code, "msg": exc.msg,
                "error": {"log_id": secrets.token_hex(16).upper(),
                          "troubleshooter": f"https://open.feishu.cn/search?code={exc.code}"}}
        return web.json_response(body, status=exc.status, headers=exc.headers)

    def _check_token(self, call: Call) -> None:
        header = call.headers.get("authorization", "")
        if not header.startswith("Bearer ") or not header[7:]:
            raise ApiError(99991661, "Missing access token for authorization. Please make a request with token "
                                     "attached.")
        expiry = self.tokens.get(header[7:])
        if expiry is None or expiry <= self.clock():
            raise ApiError(99991663, "Invalid access token for authorization. Please make a request with token "
                                     "attached.")

    # ---- auth --------------------------------------------------------------------------------------

    def _token(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        body = call.body or {}
        if body.get("app_id") != self.app_id:
            raise ApiError(10003, "invalid param")
        if body.get("app_secret") != self.app_secret:
            raise ApiError(10014, "app secret invalid")
        now = self.clock()
        live = [(exp, tok) for tok, exp in self.tokens.items() if exp > now]
        if live:
            exp, token = max(live)
            if exp - now >= 1800:
                return {"code": 0, "msg": "ok", "tenant_access_token": token, "expire": int(exp - now)}
        token = f"t-{secrets.token_hex(20)}"
        self.tokens[token] = now + self.token_ttl
        return {"code": 0, "msg": "ok", "tenant_access_token": token, "expire": self.token_ttl}

    def _bot_info(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        return {"code": 0, "msg": "ok", "bot": {"activate_status": 2, "app_name": self.bot_name,
                                                "avatar_url": "", "ip_white_list": [],
                                                "open_id": self.bot_open_id}}

    # ---- message resources -------------------------------------------------------------------------

    def _resource(self, call: Call, match: dict[str, str]) -> Resource:
        kind = call.query.get("type")
        if kind not in RESOURCE_TYPES:
            raise ApiError(234001, "Invalid request param.")
        resource = self.resources.get((match["message_id"], match["file_key"]))
        if resource is None:
            raise ApiError(234003, "File not in msg.")
        if resource.kind != kind:
            raise ApiError(234001, "Invalid request param.")
        self.downloads.append((match["message_id"], match["file_key"], kind))
        return resource

    # ---- messages ----------------------------------------------------------------------------------

    def _message_out(self, m: Message) -> dict[str, Any]:
        out: dict[str, Any] = {
            "message_id": m.message_id, "msg_type": m.msg_type, "chat_id": m.chat_id,
            "create_time": str(int(m.created * 1000)), "update_time": str(int(m.created * 1000)),
            "deleted": m.deleted, "updated": m.edits > 0,
            "sender": {"id": self.app_id, "id_type": "app_id", "sender_type": "app", "tenant_key": self.tenant_key},
            "body": {"content": json.dumps(m.content, ensure_ascii=False)}}
        for key in ("root_id", "parent_id", "thread_id"):
            if getattr(m, key):
                out[key] = getattr(m, key)
        return out

    def _content(self, body: dict[str, Any], *, allowed: tuple[str, ...] | None = None) -> tuple[str, dict[str, Any]]:
        msg_type = str(body.get("msg_type") or "")
        raw = body.get("content")
        if not msg_type or not isinstance(raw, str):
            raise ApiError(9499, "Bad Request: msg_type and content are required")
        if allowed is not None and msg_type not in allowed:
            raise invalid_param(f"msg_type {msg_type} is not supported")
        try:
            content = json.loads(raw)
        except ValueError:
            raise invalid_param("invalid message content") from None
        if not isinstance(content, dict):
            raise invalid_param("invalid message content")
        limit = TEXT_LIMIT if msg_type == "text" else CARD_LIMIT
        if utf8(raw) > limit:
            raise ApiError(230025, "The length of the message content reaches its limit.")
        if msg_type == "text" and not str(content.get("text", "")).strip():
            raise invalid_param("text content is empty")
        if msg_type == "post" and not post_text(content).strip():
            raise invalid_param("post content is empty")
        if msg_type == "interactive":
            self._check_card_message(content)
        return msg_type, content

    def _check_card_message(self, content: dict[str, Any]) -> None:
        if content.get("type") == "card":
            card_id = str((content.get("data") or {}).get("card_id") or "")
            card = self.cards.get(card_id)
            if card is None:
                raise ApiError(230099, f"Failed to create card content, ext=ErrCode: 200740; ErrMsg: card entity "
                                       f"does not exist; ErrorValue: {card_id}; ")
            if card.message_id is not None:
                raise ApiError(230099, "Failed to create card content, ext=ErrCode: 11310; ErrMsg: the card "
                                       "entity has already been sent; ")
            return
        self._check_card_json(content, api="im")

    def _check_card_json(self, card: dict[str, Any], *, api: str) -> None:
        size = utf8(json.dumps(card, ensure_ascii=False))
        count = sum(1 for _ in walk_elements(
            (card.get("body") or {}).get("elements") or card.get("elements") or []))
        if api == "im":
            if size > CARD_LIMIT:
                raise ApiError(230025, "The length of the message content reaches its limit.")
            if count > CARD_ELEMENT_LIMIT:
                raise ApiError(230099, "Failed to create card content, ext=ErrCode: 11310; ErrMsg: element "
                                       "exceeds the limit; code:230099")
            return
        if str(card.get("schema")) != "2.0":
            raise ApiError(300303, "Only schema 2.0 is supported")
        if size > CARD_LIMIT:
            raise ApiError(200860, "Card content exceeds limit.")
        if count > CARD_ELEMENT_LIMIT:
            raise ApiError(300305, "The number of card components exceeds 200")
        body = card.get("body") if isinstance(card.get("body"), dict) else {}
        ids = [e["element_id"] for e in walk_elements(body.get("elements") or []) if "element_id" in e]
        if not all(isinstance(i, str) and ELEMENT_ID.fullmatch(i) for i in ids):
            raise ApiError(10002, "Your request contains an invalid request parameter.")
        if len(ids) != len(set(ids)):
            raise ApiError(300301, "Duplicate element_id in card component.")
        if card.get("config", {}).get("update_multi") is False:
            raise ApiError(300302, "update_multi property is false")

    def _remembered(self, uuid: str | None, kind: str) -> Message | None:
        if not uuid:
            return None
        if len(uuid) > 50:
            raise invalid_param("uuid is longer than 50 characters")
        seen = self._uuids.get((kind, uuid))
        if seen is not None and self.clock() - seen[1] < UUID_WINDOW:
            return self.messages.get(seen[0])
        return None

    def _post(self, chat_id: str, msg_type: str, content: dict[str, Any], uuid: str | None,
              parent: Message | None = None, in_thread: bool = False) -> Message:
        message = Message(self._new_id("om_"), chat_id, msg_type, content, from_bot=True, uuid=uuid,
                          created=self.clock())
        if parent is not None:
            message.parent_id = parent.message_id
            message.root_id = parent.root_id or parent.message_id
            message.thread_id = parent.thread_id or (self._new_id("omt_") if in_thread else None)
            if in_thread and parent.thread_id is None:
                parent.thread_id = message.thread_id
        if content.get("type") == "card":
            self.cards[str(content["data"]["card_id"])].message_id = message.message_id
        self.messages[message.message_id] = message
        if uuid:
            self._uuids[("send", uuid)] = (message.message_id, self.clock())
        return message

    def _create(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        body = call.body or {}
        id_type = call.query.get("receive_id_type", "")
        receive_id = str(body.get("receive_id") or "")
        if id_type not in ("chat_id", "open_id", "user_id", "union_id", "email"):
            raise ApiError(99992402, "field validation failed")
        first = self._remembered(body.get("uuid"), "send")
        if first is not None:
            return self._message_out(first)
        msg_type, content = self._content(body)
        if id_type == "chat_id":
            if receive_id not in self.chats:
                raise ApiError(230002, "The bot can not be outside the group.")
            chat_id = receive_id
        else:
            chat = next((c for c in self.chats.values() if c.chat_type == "p2p" and c.user_open_id == receive_id),
                        None)
            chat = chat or self.chat(self._new_id("oc_"), "p2p", user_open_id=receive_id)
            chat_id = chat.chat_id
        return self._message_out(self._post(chat_id, msg_type, content, body.get("uuid")))

    def _message(self, match: dict[str, str]) -> Message:
        message = self.messages.get(match["message_id"])
        if message is None:
            raise invalid_param("invalid message_id")
        return message

    def _reply(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        body = call.body or {}
        first = self._remembered(body.get("uuid"), "send")
        if first is not None:
            return self._message_out(first)
        parent = self._message(match)
        if parent.deleted:
            raise ApiError(230011, "The message is recalled.")
        msg_type, content = self._content(body)
        return self._message_out(self._post(parent.chat_id, msg_type, content, body.get("uuid"), parent,
                                            bool(body.get("reply_in_thread"))))

    def _own(self, match: dict[str, str]) -> Message:
        message = self._message(match)
        if message.deleted:
            raise ApiError(230011, "The message is recalled.")
        if not message.from_bot:
            raise ApiError(230071, "The operator is not the sender of the message.")
        return message

    def _update(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        message = self._own(match)
        if message.msg_type not in ("text", "post"):
            raise ApiError(230054, "This operation is not supported for this message type.")
        msg_type, content = self._content(call.body or {}, allowed=("text", "post"))
        if message.edits >= MAX_EDITS:
            raise ApiError(230072, "The message has reached the number of times it can be edited.")
        message.msg_type, message.content = msg_type, content
        message.edits += 1
        return self._message_out(message)

    def _patch(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        message = self._own(match)
        if message.msg_type != "interactive":
            raise ApiError(230054, "This operation is not supported for this message type.")
        raw = (call.body or {}).get("content")
        try:
            content = json.loads(raw) if isinstance(raw, str) else None
        except ValueError:
            content = None
        if not isinstance(content, dict):
            raise invalid_param("invalid message content")
        if content.get("type") != "card":
            before = self.card_of(message)
            config_before = before.config if before is not None else message.content.get("config") or {}
            if not config_before.get("update_multi") or not (content.get("config") or {}).get("update_multi"):
                raise invalid_param("update_multi must be true before and after the update")
            self._check_card_json(content, api="im")
        message.content = content
        message.patches += 1
        return {}

    def _delete(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        message = self._message(match)
        if message.deleted:
            raise ApiError(230011, "The message is recalled.")
        if not message.from_bot:
            raise ApiError(230026, "No permission to recall this message.")
        message.deleted = True
        return {}

    def _react(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        message = self.messages.get(match["message_id"])
        if message is None or message.deleted:
            raise ApiError(231003, "The message is not found, maybe not exist or deleted.")
        emoji = str(((call.body or {}).get("reaction_type") or {}).get("emoji_type") or "")
        if not emoji or not emoji.replace("_", "").isalnum():
            raise ApiError(231001, "reaction type is invalid.")
        reaction_id = self._new_id("ZCa")
        message.reactions[reaction_id] = emoji
        return {"reaction_id": reaction_id, "operator": {"operator_id": self.app_id, "operator_type": "app"},
                "action_time": str(int(time.time() * 1000)), "reaction_type": {"emoji_type": emoji}}

    def _unreact(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        message = self.messages.get(match["message_id"])
        if message is None or message.deleted:
            raise ApiError(231003, "The message is not found, maybe not exist or deleted.")
        emoji = message.reactions.pop(match["reaction_id"], None)
        if emoji is None:
            raise ApiError(231011, "The request has an invalid reaction_id.")
        return {"reaction_id": match["reaction_id"],
                "operator": {"operator_id": self.app_id, "operator_type": "app"},
                "action_time": str(int(time.time() * 1000)), "reaction_type": {"emoji_type": emoji}}

    # ---- CardKit -----------------------------------------------------------------------------------

    def _card_json(self, raw: Any) -> dict[str, Any]:
        if not isinstance(raw, str) or not raw:
            raise ApiError(300307, "The card DSL is empty")
        try:
            card = json.loads(raw)
        except ValueError:
            raise ApiError(200220, "Failed to generate card content") from None
        if not isinstance(card, dict):
            raise ApiError(200220, "Failed to generate card content")
        self._check_card_json(card, api="cardkit")
        return card

    def _card_create(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        body = call.body or {}
        if body.get("type") != "card_json":
            raise ApiError(10002, "Your request contains an invalid request parameter.")
        card = Card(str(7_000_000_000_000_000_000 + next(self._ids)), self._card_json(body.get("data")))
        if card.streaming:
            card.streaming_since = self.clock()
        self.cards[card.card_id] = card
        return {"card_id": card.card_id}

    def _card_op(self, call: Call, match: dict[str, str], apply: Callable[[Card, dict[str, Any]], None]) -> dict:
        """The checks every card operation shares: the card exists, a repeated uuid is a no-op, the sequence
        strictly increases; ``apply`` changes a copy that replaces the card only if it stays valid."""
        card = self.cards.get(match["card_id"])
        if card is None:
            raise ApiError(200740, "The card entity does not exist")
        body = call.body or {}
        uuid = body.get("uuid")
        fingerprint = json.dumps([call.route, match, body], sort_keys=True)
        if uuid:
            previous = card.uuids.get(uuid)
            if previous == fingerprint:
                return {}
            if previous is not None:
                raise ApiError(200770, "UUID conflict")
        sequence = body.get("sequence")
        if not isinstance(sequence, int) or not 1 <= sequence <= 2_147_483_647:
            raise ApiError(10002, "Your request contains an invalid request parameter.")
        if sequence <= card.sequence:
            raise ApiError(300317, "The sequence number for operating on the card did not increment "
                                   "consecutively")
        if card.streaming and card.streaming_since is not None \
                and self.clock() - card.streaming_since >= STREAMING_TIMEOUT:
            card.config["streaming_mode"] = False  # Feishu's own timeout
        was_streaming = card.streaming
        draft = Card(card.card_id, copy.deepcopy(card.data), card.sequence, streaming_since=card.streaming_since)
        apply(draft, body)
        self._check_card_json(draft.data, api="cardkit")
        card.data = draft.data
        if card.streaming and not was_streaming:
            card.streaming_since = self.clock()
        card.sequence = sequence
        card.sequences.append(sequence)
        if uuid:
            card.uuids[uuid] = fingerprint
        return {}

    def _card_update(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        def apply(card: Card, body: dict[str, Any]) -> None:
            new = body.get("card") or {}
            if new.get("type") != "card_json":
                raise ApiError(10002, "Your request contains an invalid request parameter.")
            card.data = self._card_json(new.get("data"))
        return self._card_op(call, match, apply)

    def _settings(self, card: Card, settings: dict[str, Any]) -> None:
        for key, value in (settings.get("config") or {}).items():
            card.config[key] = value
        if "card_link" in settings:
            card.data["card_link"] = settings["card_link"]

    def _card_settings(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        def apply(card: Card, body: dict[str, Any]) -> None:
            try:
                settings = json.loads(body.get("settings") or "")
            except ValueError:
                raise ApiError(300122, "Failed to update card configuration") from None
            self._settings(card, settings)
        return self._card_op(call, match, apply)

    def _card_batch(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        def apply(card: Card, body: dict[str, Any]) -> None:
            try:
                actions = json.loads(body.get("actions") or "")
            except ValueError:
                raise ApiError(10002, "Your request contains an invalid request parameter.") from None
            for action in actions:
                params = action.get("params") or {}
                kind = action.get("action")
                if kind == "partial_update_setting":
                    self._settings(card, params.get("settings") or {})
                elif kind == "add_elements":
                    self._add_elements(card, params)
                elif kind == "delete_elements":
                    for element_id in params.get("element_ids") or []:
                        self._remove_element(card, element_id)
                elif kind == "partial_update_element":
                    self._partial_element(card, params.get("element_id"), params.get("partial_element") or {})
                elif kind == "update_element":
                    self._replace_element(card, params.get("element_id"), params.get("element") or {})
                else:
                    raise ApiError(10002, "Your request contains an invalid request parameter.")
        return self._card_op(call, match, apply)

    def _element_content(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        def apply(card: Card, body: dict[str, Any]) -> None:
            if not card.streaming:
                timed_out = card.streaming_since is not None and \
                    self.clock() - card.streaming_since >= STREAMING_TIMEOUT
                if timed_out:
                    raise ApiError(200850, "Card streaming timeout")
                raise ApiError(300309, "Card streaming closed")
            element = card.element(match["element_id"])
            if element is None:
                raise ApiError(300313, "Failed to update element properties")
            if element.get("tag") not in ("markdown", "plain_text"):
                raise ApiError(300310, "Only update text")
            content = body.get("content")
            if not isinstance(content, str) or not 1 <= len(content) <= CONTENT_CHARS_LIMIT:
                raise ApiError(10002, "Your request contains an invalid request parameter.")
            element["content"] = content
        return self._card_op(call, match, apply)

    @staticmethod
    def _parse_json(raw: Any) -> Any:
        try:
            return json.loads(raw) if isinstance(raw, str) else raw
        except ValueError:
            raise ApiError(10002, "Your request contains an invalid request parameter.") from None

    def _add_elements(self, card: Card, params: dict[str, Any]) -> None:
        new = self._parse_json(params.get("elements"))
        if not isinstance(new, list):
            raise ApiError(300315, "Failed to add element")
        where = params.get("type") or "append"
        if where == "append":
            card.elements.extend(new)
            return
        target = params.get("target_element_id")
        for siblings in self._containers(card.elements):
            for i, element in enumerate(siblings):
                if element.get("element_id") == target:
                    at = i if where == "insert_before" else i + 1
                    siblings[at:at] = new
                    return
        raise ApiError(300315, "Failed to add element")

    @classmethod
    def _containers(cls, elements: list[dict[str, Any]]) -> Iterator[list[dict[str, Any]]]:
        yield elements
        for element in elements:
            for key in ("elements", "columns", "actions"):
                children = element.get(key)
                if isinstance(children, list):
                    yield from cls._containers(children)

    def _remove_element(self, card: Card, element_id: Any) -> None:
        for siblings in self._containers(card.elements):
            for i, element in enumerate(siblings):
                if element.get("element_id") == element_id:
                    del siblings[i]
                    return
        raise ApiError(300314, "Failed to delete element")

    def _partial_element(self, card: Card, element_id: Any, partial: Any) -> None:
        element = card.element(str(element_id))
        partial = self._parse_json(partial)
        if element is None or not isinstance(partial, dict):
            raise ApiError(300313, "Failed to update element properties")
        if "tag" in partial and partial["tag"] != element.get("tag"):
            raise ApiError(300312, "Unable to update element tag")
        element.update(partial)

    def _replace_element(self, card: Card, element_id: Any, new: Any) -> None:
        new = self._parse_json(new)
        for siblings in self._containers(card.elements):
            for i, element in enumerate(siblings):
                if element.get("element_id") == element_id and isinstance(new, dict):
                    siblings[i] = {**new, "element_id": element_id}
                    return
        raise ApiError(300121, "Failed to replace element")

    def _element_create(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        return self._card_op(call, match, lambda card, body: self._add_elements(card, body))

    def _element_update(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        return self._card_op(call, match, lambda card, body: self._replace_element(
            card, match["element_id"], body.get("element")))

    def _element_patch(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        return self._card_op(call, match, lambda card, body: self._partial_element(
            card, match["element_id"], body.get("partial_element")))

    def _element_delete(self, call: Call, match: dict[str, str]) -> dict[str, Any]:
        return self._card_op(call, match, lambda card, body: self._remove_element(card, match["element_id"]))
