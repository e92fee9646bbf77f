"""A protocol-level fake of the Telegram Bot API on 127.0.0.1, driven by the real aiogram client.

Routes ``/bot<token>/<method>`` accept form bodies (aiogram sends forms whose object fields are JSON
strings) and JSON bodies, and answer with Telegram's envelope: ``{"ok": true, "result": ...}`` or
``{"ok": false, "error_code": N, "description": "...", "parameters": {"retry_after": S}}``.

What it checks like Telegram does: the token (401), message length in UTF-16 code units (4096), empty
text, entity offsets and lengths against the text, "message is not modified", "message to edit/delete
not found", drafts only in private chats, getUpdates 409 while a webhook is set, a waiting long poll ended
with 409 Conflict by a newer getUpdates (two bot instances polling at once; ``conflicts`` counts them),
callback_data of at most 64 bytes, and a callback query answered at most once (an unknown or repeated id
is a 400). getUpdates has real
offset semantics (updates below the offset are confirmed and forgotten) and long polling.

It keeps what every chat shows (``Shown`` messages by id, with text, entities and the inline keyboard,
deleted ones marked), the answers to callback queries (``callback_answers``),
every call (``calls``, with a monotonic timestamp), per-method, per-call faults (``fail``), and held
methods (``hold``: a call is recorded, then answered only once the test releases it).

Files: ``add_file(file_id, data)`` makes a file known; ``getFile`` answers its ``file_path`` (or Telegram's
"file is too big" past the Bot API's 20 MB download limit) and ``GET /file/bot<token>/<file_path>`` serves
its bytes in chunks, as api.telegram.org does. ``file_redirect`` makes the file URL answer a redirect to
another address instead (the client must not follow it off the Bot API host); ``downloads`` records the
paths fetched.

Rate limits (``enforce_limits``, off unless asked for): Telegram's published pace (its Bots FAQ), a message
call answering 429 ``Too Many Requests: retry after N`` past it. In one chat about one message per second,
"short bursts" allowed (a bucket of ``per_chat`` calls refilled at ``per_chat / window`` a second, sends and
edits alike); across all chats about 30 new messages per second (``overall``, in a bucket of as many; edits
do not count: the FAQ names messages sent, not edits).
``limited`` counts the 429s it answered, ``limited_by`` the same by method and budget (``"chat"`` or ``"bot"``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

LIMIT = 4096
DOWNLOAD_LIMIT = 20 * 1024 * 1024
"""The official Bot API hands out files up to 20 MB (getFile fails beyond)."""
_INT_FIELDS = {"chat_id", "message_id", "message_thread_id", "offset", "limit", "timeout", "draft_id",
               "max_connections"}
_JSON_FIELDS = {"entities", "reply_parameters", "commands", "allowed_updates", "reply_markup",
                "link_preview_options", "scope"}


def utf16_len(text: str) -> int:
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


@dataclass
class Shown:
    message_id: int
    chat_id: int
    text: str
    entities: list[dict[str, Any]]
    thread_id: int | None = None
    reply_to: int | None = None
    deleted: bool = False
    edits: int = 0
    from_bot: bool = True
    reply_markup: dict[str, Any] | None = None

    @property
    def buttons(self) -> list[tuple[str, str]]:
        """The inline keyboard as (text, callback_data), row by row; empty when there is none."""
        rows = (self.reply_markup or {}).get("inline_keyboard") or []
        return [(b["text"], b.get("callback_data", "")) for row in rows for b in row]


@dataclass
class Call:
    method: str
    params: dict[str, Any]
    at: float
    status: int = 200

    @property
    def chat_id(self) -> int | None:
        value = self.params.get("chat_id")
        return int(value) if value is not None else None


@dataclass
class Fault:
    method: str
    status: int = 400
    description: str = "Bad Request"
    retry_after: int | None = None
    times: int = 1
    when: Callable[[dict[str, Any]], bool] | None = None
    apply_first: bool = False
    """Carry the call out, then answer with the error (a response lost after the work was done); with
    ``hang``, carried out before the wait (a call that lands but whose answer comes too late)."""
    hang: float = 0.0
    until: asyncio.Event | None = None
    """Like ``hang``, until this event is set (a call whose answer comes only when the test says so)."""
    body: str | None = None
    """Answer with this text instead of Telegram's JSON error (a gateway's HTML page, a truncated answer)."""
    content_type: str = "text/html"


SENDS = frozenset({"sendMessage", "sendPhoto", "sendDocument", "sendVoice", "sendAudio", "sendVideo"})
"""The methods that post a new message (``sendChatAction`` and drafts are no message)."""
MESSAGE_CALLS = SENDS | {"editMessageText", "editMessageReplyMarkup", "editMessageCaption"}


@dataclass
class RateLimit:
    """A budget of ``methods`` per chat (``per_chat``) or over all chats, as a bucket: ``burst`` calls may come
    at once, and the bucket refills at ``rate`` calls a second (a pace "with short bursts allowed")."""

    methods: frozenset[str]
    burst: int
    rate: float
    per_chat: bool
    retry_after: int = 1
    buckets: dict[Any, tuple[float, float]] = field(default_factory=dict)
    """Calls left in each bucket, and when that was counted."""

    def full(self, key: Any, now: float) -> bool:
        """Whether a call now would exceed the budget (calls refused take nothing from it)."""
        left, at = self.buckets.get(key, (float(self.burst), now))
        left = min(float(self.burst), left + (now - at) * self.rate)
        self.buckets[key] = (left, now)
        return left < 1.0

    def take(self, key: Any, now: float) -> None:
        left, at = self.buckets[key]
        self.buckets[key] = (left - 1.0, at)


@dataclass
class FakeTelegram:
    token: str = "123456:TEST-secret-token-0123456789"
    bot_id: int = 123456
    username: str = "chatbridge_test_bot"
    drafts_supported: bool = True
    calls: list[Call] = field(default_factory=list)
    chats: dict[int, dict[int, Shown]] = field(default_factory=dict)
    drafts: dict[int, tuple[int, str]] = field(default_factory=dict)
    draft_calls: int = 0
    commands: list[dict[str, Any]] = field(default_factory=list)
    webhook: dict[str, Any] | None = None
    faults: list[Fault] = field(default_factory=list)
    holds: dict[str, asyncio.Event] = field(default_factory=dict)
    migrated: dict[int, int] = field(default_factory=dict)
    """Groups upgraded to supergroups (``migrate``): the old chat id, the new one."""
    base_url: str = ""
    updates: list[dict[str, Any]] = field(default_factory=list)
    callback_answers: list[dict[str, Any]] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)
    file_paths: dict[str, str] = field(default_factory=dict)
    downloads: list[str] = field(default_factory=list)
    file_redirect: str | None = None
    download_limit: int = DOWNLOAD_LIMIT
    rate_limits: list[RateLimit] = field(default_factory=list)
    limited: int = 0
    limited_by: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    clock: Callable[[], float] = time.monotonic
    """The rate limits' time (tests may hold it still)."""
    _open_queries: set[str] = field(default_factory=set)
    _query_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(9001))
    _update_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1001))
    _message_ids: dict[int, itertools.count[int]] = field(default_factory=dict)
    conflicts: int = 0
    """Long polls ended by a newer ``getUpdates`` of the same bot (409 Conflict): two pollers at once."""
    _polls: int = 0
    _new_update: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None
    _closing: asyncio.Event = field(default_factory=asyncio.Event)

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> FakeTelegram:
        app = web.Application()
        app.router.add_route("*", "/bot{token}/{method}", self._handle)
        app.router.add_get("/file/bot{token}/{path:.+}", self._file)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = int(self._runner.addresses[0][1])
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        self._closing.set()
        self._new_update.set()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> FakeTelegram:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- driving it from a test --------------------------------------------------------------------

    def fail(self, method: str, **kw: Any) -> Fault:
        fault = Fault(method, **kw)
        self.faults.append(fault)
        return fault

    def migrate(self, chat_id: int, to_chat_id: int) -> None:
        """Upgrade a group to a supergroup: every call to ``chat_id`` is answered as Telegram answers it then
        (400, ``migrate_to_chat_id``); the supergroup is a new chat."""
        self.migrated[chat_id] = to_chat_id

    def hold(self, method: str) -> asyncio.Event:
        """Hold every call of ``method`` (recorded on arrival) until the returned event is set; then each is
        answered as usual."""
        return self.holds.setdefault(method, asyncio.Event())

    def enforce_limits(self, *, per_chat: int = 3, window: float = 3.0, overall: int = 30) -> None:
        """Answer 429 as Telegram does past its pace: in one chat ``per_chat`` message calls per ``window``
        seconds (about one a second), bursts of ``per_chat`` allowed; over all chats ``overall`` new messages
        a second, bursts of ``overall`` allowed."""
        self.rate_limits = [RateLimit(MESSAGE_CALLS, per_chat, per_chat / window, per_chat=True),
                            RateLimit(SENDS, overall, float(overall), per_chat=False)]

    def _rate_limited(self, method: str, params: dict[str, Any]) -> int | None:
        if method not in MESSAGE_CALLS:
            return None
        now = self.clock()
        applying = [(rule, params.get("chat_id") if rule.per_chat else 0)
                    for rule in self.rate_limits if method in rule.methods]
        for rule, key in applying:
            if rule.full(key, now):
                self.limited_by[method, "chat" if rule.per_chat else "bot"] += 1
                return rule.retry_after
        for rule, key in applying:
            rule.take(key, now)
        return None

    def user_message(self, text: str | None = None, *, chat_id: int = 555, user_id: int = 777,
                     username: str | None = "alice", chat_type: str = "private", thread_id: int | None = None,
                     entities: list[dict[str, Any]] | None = None, reply_to: dict[str, Any] | None = None,
                     caption: str | None = None, photo: bool | str = False, document: dict[str, Any] | None = None,
                     voice: dict[str, Any] | None = None,
                     edited: bool = False, message_id: int | None = None, is_forum: bool = False,
                     extra: dict[str, Any] | None = None, enqueue: bool = True) -> dict[str, Any]:
        """Build (and by default queue for getUpdates) an update carrying a user's message; ``extra`` adds (or
        replaces) fields of the message as given, e.g. a field of a kind newer than the client knows (or the
        ``media_group_id`` of an album). ``photo``: True, or the file id of its largest size (default "big")."""
        mid = message_id if message_id is not None else next(self._ids(chat_id))
        chat: dict[str, Any] = {"id": chat_id, "type": chat_type}
        if chat_type == "private":
            chat["first_name"] = "Alice"
        else:
            chat["title"] = "Test group"
            if is_forum or thread_id is not None:
                chat["is_forum"] = True
        user = {"id": user_id, "is_bot": False, "first_name": "Alice"}
        if username:
            user["username"] = username
        message: dict[str, Any] = {"message_id": mid, "date": int(time.time()), "chat": chat, "from": user}
        if text is not None:
            message["text"] = text
        if entities:
            message["entities" if text is not None else "caption_entities"] = entities
        if caption is not None:
            message["caption"] = caption
        if photo:
            message["photo"] = [
                {"file_id": "small", "file_unique_id": "s", "width": 90, "height": 90, "file_size": 1000},
                {"file_id": "big" if photo is True else photo, "file_unique_id": "b", "width": 1280, "height": 960,
                 "file_size": 90000}]
        if document:
            message["document"] = {"file_unique_id": "d", **document}
        if voice:
            message["voice"] = {"file_unique_id": "v", "duration": 3, "mime_type": "audio/ogg", **voice}
        if thread_id is not None:
            message["message_thread_id"] = thread_id
            message["is_topic_message"] = True
        if reply_to is not None:
            message["reply_to_message"] = reply_to
        message.update(extra or {})
        update = {"update_id": next(self._update_ids), "edited_message" if edited else "message": message}
        if enqueue:
            self.updates.append(update)
            self._new_update.set()
        return update

    def add_file(self, file_id: str, data: bytes, *, path: str | None = None) -> None:
        """Make a file known by ``file_id`` (its ``file_path`` defaults to one like Telegram's)."""
        self.files[file_id] = data
        self.file_paths[file_id] = path or f"documents/file_{len(self.files)}"

    def press(self, chat_id: int, message_id: int, button: str, *, user_id: int = 777,
              username: str | None = "alice", data: str | None = None, enqueue: bool = True) -> dict[str, Any]:
        """A user presses the inline button labelled ``button`` under the bot's message: build (and by default
        queue for getUpdates) the callback_query update Telegram sends. ``data`` stands in for a button the
        message no longer shows (a press from a client that had not refreshed yet)."""
        shown = self.chats[chat_id][message_id]
        if data is None:
            data = next(d for text, d in shown.buttons if text == button)
        user: dict[str, Any] = {"id": user_id, "is_bot": False, "first_name": (username or "User").title()}
        if username:
            user["username"] = username
        chat: dict[str, Any] = {"id": chat_id, "type": "private" if chat_id > 0 else "supergroup"}
        message: dict[str, Any] = {
            "message_id": message_id, "date": int(time.time()), "chat": chat, "text": shown.text,
            "from": {"id": self.bot_id, "is_bot": True, "first_name": "Bot", "username": self.username}}
        if shown.thread_id is not None:
            message["message_thread_id"] = shown.thread_id
            message["is_topic_message"] = True
        if shown.reply_markup:
            message["reply_markup"] = shown.reply_markup
        query_id = str(next(self._query_ids))
        self._open_queries.add(query_id)
        update = {"update_id": next(self._update_ids), "callback_query": {
            "id": query_id, "from": user, "message": message, "chat_instance": f"ci{chat_id}", "data": data}}
        if enqueue:
            self.updates.append(update)
            self._new_update.set()
        return update

    def answers(self, update: dict[str, Any]) -> list[dict[str, Any]]:
        """The answerCallbackQuery calls for the callback query in ``update``."""
        qid = update["callback_query"]["id"]
        return [a for a in self.callback_answers if str(a.get("callback_query_id")) == qid]

    def bot_message(self, chat_id: int, message_id: int) -> dict[str, Any]:
        """A message of the bot as Telegram embeds it in ``reply_to_message``."""
        shown = self.chats[chat_id][message_id]
        return {"message_id": message_id, "date": int(time.time()), "chat": {"id": chat_id, "type": "group"},
                "from": {"id": self.bot_id, "is_bot": True, "first_name": "Bot", "username": self.username},
                "text": shown.text}

    def messages(self, chat_id: int, *, thread_id: int | None = None, any_thread: bool = True) -> list[Shown]:
        """The bot's messages a user of ``chat_id`` sees now, oldest first."""
        return [m for m in self.chats.get(chat_id, {}).values()
                if not m.deleted and m.from_bot and (any_thread or m.thread_id == thread_id)]

    def visible(self, chat_id: int) -> list[str]:
        return [m.text for m in self.messages(chat_id)]

    def calls_to(self, chat_id: int, *methods: str) -> list[Call]:
        return [c for c in self.calls if c.chat_id == chat_id and (not methods or c.method in methods)]

    def count(self, method: str) -> int:
        return sum(1 for c in self.calls if c.method == method)

    # ---- the protocol ------------------------------------------------------------------------------

    def _ids(self, chat_id: int) -> itertools.count[int]:
        return self._message_ids.setdefault(chat_id, itertools.count(1))

    @staticmethod
    def _error(code: int, description: str, retry_after: int | None = None, *,
               parameters: dict[str, Any] | None = None) -> web.Response:
        body: dict[str, Any] = {"ok": False, "error_code": code, "description": description}
        if retry_after is not None:
            body["parameters"] = {"retry_after": retry_after}
        if parameters:
            body["parameters"] = parameters
        return web.json_response(body, status=code)

    async def _params(self, request: web.Request) -> dict[str, Any]:
        if request.content_type == "application/json":
            raw = await request.json()
            return dict(raw)
        form = await request.post() if request.method == "POST" else request.query
        params: dict[str, Any] = {}
        for key, value in form.items():
            text = str(value)
            if key in _INT_FIELDS:
                params[key] = int(text)
            elif key in _JSON_FIELDS:
                params[key] = json.loads(text)
            elif text in ("true", "false"):
                params[key] = text == "true"
            else:
                params[key] = text
        return params

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        method = request.match_info["method"]
        if request.match_info["token"] != self.token:
            return self._error(401, "Unauthorized")
        try:
            params = await self._params(request)
        except (ValueError, json.JSONDecodeError):
            return self._error(400, "Bad Request: invalid parameters")
        call = Call(method, params, time.monotonic())
        self.calls.append(call)
        held = self.holds.get(method)
        if held is not None:
            await held.wait()
        fault = self._fault(method, params)
        handler = getattr(self, f"_m_{method}", None)
        if fault is not None:
            if fault.apply_first and handler is not None:
                await handler(params)
            if fault.hang:
                await asyncio.sleep(fault.hang)
            if fault.until is not None:
                await fault.until.wait()
            call.status = fault.status
            if fault.body is not None:
                return web.Response(text=fault.body, status=fault.status, content_type=fault.content_type)
            return self._error(fault.status, fault.description, fault.retry_after)
        moved = self.migrated.get(call.chat_id) if call.chat_id is not None else None
        if moved is not None:
            call.status = 400
            return self._error(400, "Bad Request: group chat was upgraded to a supergroup chat",
                               parameters={"migrate_to_chat_id": moved})
        if handler is None:
            call.status = 404
            return self._error(404, "Not Found")
        retry_after = self._rate_limited(method, params)
        if retry_after is not None:
            call.status = 429
            self.limited += 1
            return self._error(429, f"Too Many Requests: retry after {retry_after}", retry_after)
        try:
            result = await handler(params)
        except _ApiError as exc:
            call.status = exc.code
            return self._error(exc.code, exc.description)
        return web.json_response({"ok": True, "result": result})

    def _fault(self, method: str, params: dict[str, Any]) -> Fault | None:
        for fault in self.faults:
            if fault.method == method and fault.times > 0 and (fault.when is None or fault.when(params)):
                fault.times -= 1
                return fault
        return None

    async def _file(self, request: web.Request) -> web.StreamResponse:
        if request.match_info["token"] != self.token:
            return web.Response(status=404)
        path = request.match_info["path"]
        self.downloads.append(path)
        if self.file_redirect is not None:
            raise web.HTTPFound(self.file_redirect)
        file_id = next((fid for fid, p in self.file_paths.items() if p == path), None)
        if file_id is None:
            return web.Response(status=404)
        data = self.files[file_id]
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream",
                                               "Content-Length": str(len(data))})
        await response.prepare(request)
        for start in range(0, len(data), 256 * 1024):
            await response.write(data[start:start + 256 * 1024])
        await response.write_eof()
        return response

    # ---- methods -----------------------------------------------------------------------------------

    async def _m_getFile(self, p: dict[str, Any]) -> dict[str, Any]:
        file_id = str(p.get("file_id") or "")
        if file_id not in self.files:
            raise _ApiError(400, "Bad Request: invalid file_id")
        size = len(self.files[file_id])
        if size > self.download_limit:
            raise _ApiError(400, "Bad Request: file is too big")
        return {"file_id": file_id, "file_unique_id": f"u{file_id}", "file_size": size,
                "file_path": self.file_paths[file_id]}

    async def _m_getMe(self, p: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.bot_id, "is_bot": True, "first_name": "Bot", "username": self.username,
                "can_join_groups": True, "can_read_all_group_messages": False, "supports_inline_queries": False}

    async def _m_setMyCommands(self, p: dict[str, Any]) -> bool:
        self.commands = list(p.get("commands") or [])
        return True

    async def _m_setWebhook(self, p: dict[str, Any]) -> bool:
        if not str(p.get("url", "")).strip():
            raise _ApiError(400, "Bad Request: bad webhook: URL is empty")
        self.webhook = p
        return True

    async def _m_deleteWebhook(self, p: dict[str, Any]) -> bool:
        self.webhook = None
        return True

    async def _m_getUpdates(self, p: dict[str, Any]) -> list[dict[str, Any]]:
        if self.webhook is not None:
            raise _ApiError(409, "Conflict: can't use getUpdates method while webhook is active; use "
                                 "deleteWebhook to delete the webhook first")
        self._polls += 1
        poll = self._polls
        self._new_update.set()  # a poll still waiting ends with a conflict, as on Telegram
        offset = int(p.get("offset") or 0)
        if offset:
            self.updates = [u for u in self.updates if u["update_id"] >= offset]  # confirmed: forgotten
        limit = int(p.get("limit") or 100)
        deadline = time.monotonic() + float(p.get("timeout") or 0)
        while True:
            if poll != self._polls:
                self.conflicts += 1
                raise _ApiError(409, "Conflict: terminated by other getUpdates request; make sure that only one "
                                     "bot instance is running")
            ready = [u for u in self.updates if u["update_id"] >= offset][:limit]
            if ready or self._closing.is_set():
                return ready
            left = deadline - time.monotonic()
            if left <= 0:
                return []
            self._new_update.clear()
            try:
                await asyncio.wait_for(self._new_update.wait(), left)
            except TimeoutError:
                return []

    async def _m_sendChatAction(self, p: dict[str, Any]) -> bool:
        self._chat(p)
        return True

    async def _m_answerCallbackQuery(self, p: dict[str, Any]) -> bool:
        qid = str(p.get("callback_query_id") or "")
        if qid not in self._open_queries:
            raise _ApiError(400, "Bad Request: query is too old and response timeout expired or query ID is invalid")
        self._open_queries.discard(qid)
        self.callback_answers.append(p)
        return True

    @staticmethod
    def _check_markup(p: dict[str, Any]) -> dict[str, Any] | None:
        markup = p.get("reply_markup")
        if markup is None:
            return None
        rows = markup.get("inline_keyboard")
        if not isinstance(rows, list):
            raise _ApiError(400, "Bad Request: can't parse reply keyboard markup JSON object")
        for row in rows:
            for button in row:
                if not str(button.get("text") or "").strip():
                    raise _ApiError(400, "Bad Request: text buttons are unallowed in the inline keyboard")
                if len(str(button.get("callback_data", "")).encode()) > 64:
                    raise _ApiError(400, "Bad Request: BUTTON_DATA_INVALID")
        return dict(markup) if rows else None

    def _chat(self, p: dict[str, Any]) -> int:
        if "chat_id" not in p:
            raise _ApiError(400, "Bad Request: chat_id is empty")
        return int(p["chat_id"])

    def _check_text(self, p: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
        text = str(p.get("text") or "")
        if "parse_mode" in p:
            raise _ApiError(400, "Bad Request: the fake expects entities, not parse_mode")
        if not text.strip():
            raise _ApiError(400, "Bad Request: message text is empty")
        size = utf16_len(text)
        if size > LIMIT:
            raise _ApiError(400, "Bad Request: message is too long")
        entities = list(p.get("entities") or [])
        for ent in entities:
            off, length = int(ent.get("offset", -1)), int(ent.get("length", 0))
            if off < 0 or length <= 0 or off + length > size:
                raise _ApiError(400, f"Bad Request: can't parse entities: entity at offset {off} with length "
                                     f"{length} is out of the text of {size} UTF-16 code units")
        return text, entities

    async def _m_sendMessage(self, p: dict[str, Any]) -> dict[str, Any]:
        chat_id = self._chat(p)
        text, entities = self._check_text(p)
        markup = self._check_markup(p)
        mid = next(self._ids(chat_id))
        reply = (p.get("reply_parameters") or {}).get("message_id")
        thread = p.get("message_thread_id")
        self.chats.setdefault(chat_id, {})[mid] = Shown(mid, chat_id, text, entities, thread, reply,
                                                        reply_markup=markup)
        self.drafts.pop(chat_id, None)  # a real message replaces the draft preview
        result: dict[str, Any] = {"message_id": mid, "date": int(time.time()), "text": text,
                                  "chat": {"id": chat_id, "type": "private" if chat_id > 0 else "supergroup"},
                                  "from": {"id": self.bot_id, "is_bot": True, "first_name": "Bot"}}
        if entities:
            result["entities"] = entities
        if thread is not None:
            result["message_thread_id"] = thread
        return result

    async def _m_editMessageText(self, p: dict[str, Any]) -> dict[str, Any]:
        chat_id = self._chat(p)
        shown = self.chats.get(chat_id, {}).get(int(p.get("message_id") or 0))
        if shown is None or shown.deleted:
            raise _ApiError(400, "Bad Request: message to edit not found")
        text, entities = self._check_text(p)
        markup = self._check_markup(p)  # an edit without reply_markup removes the inline keyboard
        if text == shown.text and entities == shown.entities and markup == shown.reply_markup:
            raise _ApiError(400, "Bad Request: message is not modified: specified new message content and reply "
                                 "markup are exactly the same as a current content and reply markup of the message")
        shown.text, shown.entities, shown.reply_markup = text, entities, markup
        shown.edits += 1
        return {"message_id": shown.message_id, "date": int(time.time()), "text": text,
                "chat": {"id": chat_id, "type": "private" if chat_id > 0 else "supergroup"}}

    async def _m_editMessageReplyMarkup(self, p: dict[str, Any]) -> dict[str, Any]:
        chat_id = self._chat(p)
        shown = self.chats.get(chat_id, {}).get(int(p.get("message_id") or 0))
        if shown is None or shown.deleted:
            raise _ApiError(400, "Bad Request: message to edit not found")
        markup = self._check_markup(p)
        if markup == shown.reply_markup:
            raise _ApiError(400, "Bad Request: message is not modified: specified new message content and reply "
                                 "markup are exactly the same as a current content and reply markup of the message")
        shown.reply_markup = markup
        shown.edits += 1
        return {"message_id": shown.message_id, "date": int(time.time()), "text": shown.text,
                "chat": {"id": chat_id, "type": "private" if chat_id > 0 else "supergroup"}}

    async def _m_deleteMessage(self, p: dict[str, Any]) -> bool:
        chat_id = self._chat(p)
        shown = self.chats.get(chat_id, {}).get(int(p.get("message_id") or 0))
        if shown is None or shown.deleted:
            raise _ApiError(400, "Bad Request: message to delete not found")
        shown.deleted = True
        return True

    async def _m_sendMessageDraft(self, p: dict[str, Any]) -> bool:
        if not self.drafts_supported:
            raise _ApiError(404, "Not Found")
        chat_id = self._chat(p)
        if chat_id < 0:
            raise _ApiError(400, "Bad Request: drafts can be sent only to private chats")
        if not int(p.get("draft_id") or 0):
            raise _ApiError(400, "Bad Request: draft_id must be non-zero")
        text = str(p.get("text") or "")
        if utf16_len(text) > LIMIT:
            raise _ApiError(400, "Bad Request: message is too long")
        self.drafts[chat_id] = (int(p["draft_id"]), text)
        self.draft_calls += 1
        return True


class _ApiError(Exception):
    def __init__(self, code: int, description: str) -> None:
        super().__init__(description)
        self.code = code
        self.description = description
