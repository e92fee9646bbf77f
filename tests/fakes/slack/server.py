"""A protocol-level fake of the Slack Web API on 127.0.0.1, driven by the real slack_sdk / slack-bolt clients.

``POST /api/<method>`` (and GET for the read methods) accepts what ``AsyncWebClient(base_url=...)`` sends: a
JSON body, a form body, or query parameters on a POST (slack_sdk sends ``chat.delete`` and ``reactions.*``
that way), with the token as ``Authorization: Bearer`` or a ``token`` parameter. Answers are Slack's envelope:
HTTP 200 with ``{"ok": true, ...}`` or ``{"ok": false, "error": "<code>"}``; a rate limit is HTTP 429 with
``Retry-After`` and ``{"ok": false, "error": "ratelimited"}``.

What it checks like Slack does (figures from Slack's method reference):
- tokens: none → ``not_authed``; unknown → ``invalid_auth``; the app-level token (xapp-) only for
  ``apps.connections.open`` and the bot token only elsewhere → ``not_allowed_token_type``;
- ``chat.update``: ``text`` at most 4,000 characters (``msg_too_long``); a message still streaming →
  ``streaming_state_conflict``; ``text`` without ``blocks`` drops the old blocks, ``blocks`` without ``text``
  keeps the old text (Slack's documented update rules);
- ``chat.postMessage``: ``text`` longer than 40,000 characters is truncated with a ``message_truncated``
  warning (Slack posts it anyway); ``markdown_text`` with ``text`` or ``blocks`` → ``markdown_text_conflict``;
- blocks: at most 50, known types, section text ≤ 3,000, header ≤ 150, button text ≤ 75, value ≤ 2,000,
  action_id ≤ 255 (``invalid_blocks``); all ``markdown`` blocks of a payload together ≤ 12,000 characters
  (``msg_blocks_too_long``); ``markdown_text`` ≤ 12,000 per call;
- streaming: ``chat.startStream`` needs ``thread_ts`` and, outside DMs, ``recipient_user_id`` /
  ``recipient_team_id``; a stream idle longer than ``stream_idle_timeout`` or older than ``stream_max_age``
  is closed server-side, and appends/stops then fail with ``message_not_in_streaming_state`` (what a
  long-running agent sees from real Slack);
- ``reactions.add`` twice → ``already_reacted``; ``reactions.remove`` of a missing one → ``no_reaction``;
- ``message_not_found`` / ``cant_update_message`` / ``cant_delete_message`` / ``channel_not_found``;
- files: ``files.info`` answers a file added with ``add_file`` (``file_not_found`` otherwise), and its
  ``url_private_download`` serves the bytes only with the bot token as ``Authorization: Bearer`` (else 404, as
  Slack answers an unauthenticated file URL with a login page rather than the file).

It keeps what every channel shows (``Message`` by ts: text, blocks, thread, reactions, edit history, stream
state), ephemeral messages, posts to ``response_url``, assistant statuses, and every call (``calls``).
Faults are injected per method (``fail``: any error code or HTTP status, the nth call, a predicate, a hang,
a dropped connection, or "carry it out, then fail"); rate limits are switchable per method (``rate_limit``),
or all at once at Slack's published tier floors (``enforce_tiers``).
The clock is injectable (``clock``) so stream expiry and rate windows run on test time.

The Socket Mode websocket (``socket``) and the event builders live beside this module.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any

from aiohttp import web

from tests.fakes.slack.blocks import MARKDOWN_LIMIT, SlackError, block_text, check_blocks
from tests.fakes.slack.socket import FakeSocketMode
from tests.fakes.slack.users import UserActions

UPDATE_TEXT_LIMIT = 4000
"""chat.update: "The `text` field cannot exceed 4,000 characters" (msg_too_long)."""
POST_TEXT_LIMIT = 40000
"""chat.postMessage / postEphemeral: longer text is truncated with a ``message_truncated`` warning."""

TIERS: dict[str, int | None] = {
    # Slack's published tier per method (per workspace and app); None = special rules (see SPECIAL_PER_CHANNEL)
    "auth.test": None, "apps.connections.open": 1, "chat.postMessage": None, "chat.update": 3, "chat.delete": 3,
    "chat.postEphemeral": 4, "chat.startStream": 2, "chat.appendStream": 4, "chat.stopStream": 2,
    "reactions.add": 3, "reactions.remove": 2, "assistant.threads.setStatus": 3, "conversations.replies": 3,
    "conversations.history": 3, "users.info": 4, "files.info": 4,
}
PER_MINUTE = {1: 1, 2: 20, 3: 50, 4: 100}
"""The floor of each tier ("Tier 3: 50+ per minute")."""
SPECIAL_PER_CHANNEL = {"chat.postMessage": 1}
"""chat.postMessage: about one message per second per channel."""

_JSON_FIELDS = {"blocks", "attachments", "metadata", "chunks", "loading_messages"}
_APP_TOKEN_METHODS = {"apps.connections.open"}
_STREAM_OK_CHANNELS = ("im",)


@dataclass
class Message:
    """One message in a channel as Slack stores it."""

    channel: str
    ts: str
    text: str = ""
    blocks: list[dict[str, Any]] = field(default_factory=list)
    user: str | None = None
    bot_id: str | None = None
    thread_ts: str | None = None
    subtype: str | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    deleted: bool = False
    edits: list[tuple[str, list[dict[str, Any]]]] = field(default_factory=list)
    """Every earlier (text, blocks) this message showed, oldest first."""
    reactions: dict[str, list[str]] = field(default_factory=dict)
    stream: str | None = None
    """None for an ordinary message; "streaming", "stopped" or "expired" for one made by chat.startStream."""
    stream_started: float = 0.0
    stream_touched: float = 0.0
    metadata: dict[str, Any] | None = None
    """What ``chat.postMessage`` was given as ``metadata`` (read back with ``include_all_metadata``)."""

    @property
    def from_bot(self) -> bool:
        return self.bot_id is not None

    @property
    def streaming(self) -> bool:
        return self.stream == "streaming"

    @property
    def shown(self) -> str:
        """The words a person reads: the blocks' text where there are blocks, else ``text``."""
        if not self.blocks:
            return self.text
        return "\n".join(t for t in (block_text(b) for b in self.blocks) if t)

    def as_event_message(self, *, metadata: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "message", "ts": self.ts, "text": self.text}
        if metadata and self.metadata is not None:
            out["metadata"] = self.metadata
        if self.user:
            out["user"] = self.user
        if self.bot_id:
            out["bot_id"] = self.bot_id
        if self.blocks:
            out["blocks"] = self.blocks
        if self.thread_ts:
            out["thread_ts"] = self.thread_ts
        if self.subtype:
            out["subtype"] = self.subtype
        if self.files:
            out["files"] = self.files
        return out


@dataclass
class Call:
    method: str
    params: dict[str, Any]
    at: float
    token: str | None = None
    status: int = 200
    error: str | None = None

    @property
    def channel(self) -> str | None:
        value = self.params.get("channel") or self.params.get("channel_id")
        return str(value) if value is not None else None


@dataclass
class Fault:
    """An injected failure for calls to ``method`` (see ``FakeSlack.fail``)."""

    method: str
    error: str = "internal_error"
    status: int = 200
    retry_after: int | None = None
    times: int = 1
    nth: int | None = None
    """Only the nth call (1-based, counting every call to the method) fails."""
    when: Callable[[dict[str, Any]], bool] | None = None
    hang: float = 0.0
    drop: bool = False
    """Close the connection without an answer (the client sees a network error)."""
    apply_first: bool = False
    """Carry the call out, then answer with the failure (a response lost after the work was done); with
    ``hang``, carried out before the wait (a call that lands but whose answer comes too late)."""
    body: str | None = None
    """A raw body for the failure (e.g. an HTML error page on a 5xx)."""
    content_type: str = "text/html"


@dataclass
class RateRule:
    method: str
    per: str  # "channel" | "workspace"
    limit: int
    window: float
    retry_after: int
    hits: dict[str, list[float]] = field(default_factory=dict)

    def admit(self, key: str, now: float) -> bool:
        recent = [t for t in self.hits.get(key, []) if now - t < self.window]
        if len(recent) >= self.limit:
            self.hits[key] = recent
            return False
        recent.append(now)
        self.hits[key] = recent
        return True


@dataclass
class Ephemeral:
    channel: str
    user: str
    text: str
    blocks: list[dict[str, Any]]
    thread_ts: str | None


class FakeSlack(UserActions):
    """The Slack Web API, ``response_url`` endpoints and the Socket Mode websocket on one local server."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic, stream_idle_timeout: float = 300.0,
                 stream_max_age: float = 600.0) -> None:
        self.bot_token = "xoxb-1111-2222-fakeBotToken"
        self.app_token = "xapp-1-A0APP-3333-fakeAppToken"
        self.signing_secret = "8f742231b10e8888abcd99yyyzzz85a5"
        self.team_id = "T0TEAM"
        self.team_domain = "chatbridge-test"
        self.app_id = "A0APP"
        self.bot_user_id = "U0BOT"
        self.bot_id = "B0BOT"
        self.bot_name = "chatbridge"
        self.clock = clock
        self.stream_idle_timeout = stream_idle_timeout
        self.stream_max_age = stream_max_age
        self.users: dict[str, dict[str, Any]] = {}
        self.channel_types: dict[str, str] = {}
        self.channels: dict[str, dict[str, Message]] = {}
        self.calls: list[Call] = []
        self.faults: list[Fault] = []
        self.holds: dict[str, asyncio.Event] = {}
        self.rate_rules: list[RateRule] = []
        self.ephemerals: list[Ephemeral] = []
        self.responses: list[dict[str, Any]] = []
        """Posts to a ``response_url`` (each with ``"_url"`` added)."""
        self.statuses: list[dict[str, Any]] = []
        """Every assistant.threads.setStatus call's parameters, in order."""
        self.warnings: list[str] = []
        self.files: dict[str, tuple[dict[str, Any], bytes]] = {}
        """Files users shared (``add_file``): their ``files.info`` object and bytes."""
        self.downloads: list[tuple[str, str | None]] = []
        """Every request for a file's bytes: (file id, the Authorization header sent)."""
        self.base = ""
        self.base_url = ""
        """What ``AsyncWebClient(base_url=...)`` takes: ``http://127.0.0.1:<port>/api/``."""
        self.socket = FakeSocketMode(self)
        self._ts_seq = itertools.count(1)
        self._ts_base = int(time.time())
        self._event_seq = itertools.count(1)
        self._method_counts: dict[str, int] = {}
        self._runner: web.AppRunner | None = None
        self.add_user("U0ALICE", "alice", "Alice Example")
        self.add_user("U0BOB", "bob", "Bob Example")
        self.add_user(self.bot_user_id, self.bot_name, "chatbridge", is_bot=True, bot_id=self.bot_id)
        self.add_channel("D0ALICE", "im")
        self.add_channel("D0BOB", "im")
        self.add_channel("C0GENERAL", "channel")

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> FakeSlack:
        app = web.Application()
        app.router.add_route("*", "/api/{method}", self._handle)
        app.router.add_post("/respond/{rid}", self._respond)
        app.router.add_get("/files-pri/{file_id}/{name}", self._file_download)
        self.socket.mount(app)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = int(self._runner.addresses[0][1])
        self.base = f"http://127.0.0.1:{port}"
        self.base_url = f"{self.base}/api/"
        return self

    async def stop(self) -> None:
        await self.socket.close()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> FakeSlack:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # ---- set-up and driving it from a test ---------------------------------------------------------

    def add_user(self, user_id: str, name: str, real_name: str, *, is_bot: bool = False,
                 bot_id: str | None = None, display_name: str | None = None) -> None:
        """``name`` is the username (unique, set by the workspace); ``display_name`` (the username unless given)
        is what the member chose to be called, which may be anything."""
        shown = name if display_name is None else display_name
        profile: dict[str, Any] = {"real_name": real_name, "display_name": shown}
        if bot_id:
            profile["bot_id"] = bot_id
        self.users[user_id] = {"id": user_id, "team_id": self.team_id, "name": name, "real_name": real_name,
                               "deleted": False, "is_bot": is_bot, "profile": profile}

    def add_channel(self, channel: str, kind: str) -> None:
        """Register a conversation: ``im``, ``mpim``, ``channel`` (public) or ``group`` (private)."""
        self.channel_types[channel] = kind
        self.channels.setdefault(channel, {})

    def add_file(self, file_id: str, name: str, mimetype: str, content: bytes) -> dict[str, Any]:
        """A file a user shares: returns the file object a ``file_share`` message event carries."""
        info = {"id": file_id, "name": name, "title": name, "mimetype": mimetype, "filetype": name.rsplit(".", 1)[-1],
                "size": len(content), "url_private": f"{self.base}/files-pri/{file_id}/{name}",
                "url_private_download": f"{self.base}/files-pri/{file_id}/{name}"}
        self.files[file_id] = (info, content)
        return dict(info)

    async def _file_download(self, request: web.Request) -> web.Response:
        file_id = request.match_info["file_id"]
        auth = request.headers.get("Authorization")
        self.downloads.append((file_id, auth))
        if file_id not in self.files or auth != f"Bearer {self.bot_token}":
            return web.Response(status=404, text="<html>Sign in to Slack</html>", content_type="text/html")
        info, content = self.files[file_id]
        return web.Response(body=content, content_type=str(info["mimetype"]))

    def fail(self, method: str, error: str = "internal_error", **kw: Any) -> Fault:
        """Make calls to ``method`` fail. ``status=429`` answers a rate limit (``retry_after`` seconds),
        ``status>=500`` a server error; otherwise HTTP 200 with ``{"ok": false, "error": error}``."""
        fault = Fault(method, error, **kw)
        self.faults.append(fault)
        return fault

    def rate_limit(self, method: str, *, per: str = "channel", limit: int = 1, window: float = 1.0,
                   retry_after: int = 1) -> RateRule:
        """Answer 429 once ``method`` was called ``limit`` times within ``window`` seconds (of ``clock``) for the
        same channel (``per="channel"``) or the whole workspace (``per="workspace"``)."""
        rule = RateRule(method, per, limit, window, retry_after)
        self.rate_rules.append(rule)
        return rule

    def enforce_tiers(self, retry_after: int = 30) -> None:
        """Answer 429 as Slack's published limits would: each tiered method's per-minute floor for the whole
        workspace, and chat.postMessage's one per second per channel (on ``clock``)."""
        for method, tier in TIERS.items():
            if tier is not None:
                self.rate_limit(method, per="workspace", limit=PER_MINUTE[tier], window=60.0,
                                retry_after=retry_after)
        for method, per_second in SPECIAL_PER_CHANNEL.items():
            self.rate_limit(method, per="channel", limit=per_second, window=1.0, retry_after=1)

    def next_ts(self) -> str:
        return f"{self._ts_base}.{next(self._ts_seq):06d}"

    def next_event_id(self) -> str:
        return f"Ev{next(self._event_seq):08d}"

    def message(self, channel: str, ts: str) -> Message:
        return self.channels[channel][ts]

    def messages(self, channel: str, *, thread_ts: str | EllipsisType | None = ...,
                 bot_only: bool = True) -> list[Message]:
        """The messages a member of ``channel`` sees now, oldest first (the bot's only, by default); with
        ``thread_ts`` only those in that thread (``None``: only top-level ones)."""
        out = []
        for m in self.channels.get(channel, {}).values():
            if m.deleted or (bot_only and not m.from_bot):
                continue
            if thread_ts is not ... and m.thread_ts != thread_ts:
                continue
            out.append(m)
        return sorted(out, key=lambda m: m.ts)

    def visible(self, channel: str, *, thread_ts: str | EllipsisType | None = ...) -> list[str]:
        return [m.shown for m in self.messages(channel, thread_ts=thread_ts)]

    def hold(self, method: str) -> asyncio.Event:
        """Hold every call of ``method`` (recorded on arrival) until the returned event is set; then each is
        answered as usual."""
        return self.holds.setdefault(method, asyncio.Event())

    def calls_to(self, method: str, *, channel: str | None = None) -> list[Call]:
        return [c for c in self.calls if c.method == method and (channel is None or c.channel == channel)]

    def count(self, method: str) -> int:
        return sum(1 for c in self.calls if c.method == method)

    # ---- the protocol ------------------------------------------------------------------------------

    async def _params(self, request: web.Request) -> dict[str, Any]:
        params: dict[str, Any] = dict(request.query)
        if request.method == "POST" and request.can_read_body:
            if request.content_type == "application/json":
                body = await request.json()
                if not isinstance(body, dict):
                    raise SlackError("invalid_json")
                params.update(body)
            else:
                form = await request.post()
                params.update({k: str(v) for k, v in form.items()})
        for key in _JSON_FIELDS:
            if isinstance(params.get(key), str):
                try:
                    params[key] = json.loads(params[key])
                except json.JSONDecodeError:
                    raise SlackError("invalid_blocks_format" if key == "blocks" else "invalid_arguments") from None
        return params

    @staticmethod
    def _token(request: web.Request, params: dict[str, Any]) -> str | None:
        header = request.headers.get("Authorization", "")
        if header.startswith("Bearer "):
            return header[len("Bearer "):].strip()
        token = params.pop("token", None)
        return str(token) if token else None

    def _reply(self, call: Call, body: dict[str, Any], status: int = 200,
               headers: dict[str, str] | None = None) -> web.Response:
        call.status = status
        call.error = None if body.get("ok") else str(body.get("error"))
        return web.json_response(body, status=status, headers=headers)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        method = request.match_info["method"]
        call = Call(method, {}, self.clock())
        self.calls.append(call)
        try:
            params = await self._params(request)
        except SlackError as exc:
            return self._reply(call, {"ok": False, "error": exc.error})
        token = self._token(request, params)
        call.params, call.token = params, token
        self._method_counts[method] = n = self._method_counts.get(method, 0) + 1

        auth_error = self._auth_error(method, token)
        if auth_error is not None:
            return self._reply(call, {"ok": False, "error": auth_error})
        handler = getattr(self, "_m_" + method.replace(".", "_"), None)
        held = self.holds.get(method)
        if held is not None:
            await held.wait()

        fault = self._fault(method, params, n)
        if fault is not None:
            return await self._apply_fault(request, call, fault, handler, params)
        limited = self._rate_limited(method, params)
        if limited is not None:
            return self._reply(call, {"ok": False, "error": "ratelimited"}, status=429,
                               headers={"Retry-After": str(limited)})
        if handler is None:
            return self._reply(call, {"ok": False, "error": "unknown_method"})
        try:
            result = handler(params)
        except SlackError as exc:
            return self._reply(call, {"ok": False, "error": exc.error, **exc.extra})
        return self._reply(call, {"ok": True, **result})

    def _auth_error(self, method: str, token: str | None) -> str | None:
        if not token:
            return "not_authed"
        if token not in (self.bot_token, self.app_token):
            return "invalid_auth"
        wants_app = method in _APP_TOKEN_METHODS
        if wants_app != (token == self.app_token):
            return "not_allowed_token_type"
        return None

    def _fault(self, method: str, params: dict[str, Any], n: int) -> Fault | None:
        for fault in self.faults:
            if fault.method != method or fault.times <= 0:
                continue
            if fault.nth is not None and fault.nth != n:
                continue
            if fault.when is not None and not fault.when(params):
                continue
            fault.times -= 1
            return fault
        return None

    async def _apply_fault(self, request: web.Request, call: Call, fault: Fault,
                           handler: Callable[[dict[str, Any]], dict[str, Any]] | None,
                           params: dict[str, Any]) -> web.StreamResponse:
        if fault.apply_first and handler is not None:
            try:
                handler(params)
            except SlackError:
                pass
        if fault.hang:
            await asyncio.sleep(fault.hang)
        if fault.drop:
            call.status, call.error = 0, "dropped"
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=500)  # never reaches the client: the connection is gone
        if fault.status == 429:
            retry_after = fault.retry_after if fault.retry_after is not None else 1
            return self._reply(call, {"ok": False, "error": "ratelimited"}, status=429,
                               headers={"Retry-After": str(retry_after)})
        if fault.body is not None:
            call.status, call.error = fault.status, fault.error
            return web.Response(status=fault.status, text=fault.body, content_type=fault.content_type)
        return self._reply(call, {"ok": False, "error": fault.error}, status=fault.status)

    def _rate_limited(self, method: str, params: dict[str, Any]) -> int | None:
        now = self.clock()
        for rule in self.rate_rules:
            if rule.method != method:
                continue
            key = str(params.get("channel") or params.get("channel_id") or "") if rule.per == "channel" else "*"
            if not rule.admit(key, now):
                return rule.retry_after
        return None

    async def _respond(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.responses.append({"_url": str(request.url), **body})
        return web.Response(text="ok")

    def response_url(self) -> str:
        return f"{self.base}/respond/{next(self._event_seq)}"

    # ---- validation --------------------------------------------------------------------------------

    def _channel(self, params: dict[str, Any], key: str = "channel") -> str:
        channel = str(params.get(key) or "")
        if channel not in self.channel_types:
            raise SlackError("channel_not_found")
        return channel

    def _existing(self, channel: str, ts: Any) -> Message:
        message = self.channels[channel].get(str(ts or ""))
        if message is None or message.deleted:
            raise SlackError("message_not_found")
        return message

    def _content(self, params: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(text, blocks) of a post/update; ``markdown_text`` becomes one markdown block (how Slack shows it)."""
        markdown = params.get("markdown_text")
        text = params.get("text")
        blocks = params.get("blocks")
        if markdown is not None:
            if text is not None or blocks is not None:
                raise SlackError("markdown_text_conflict")
            if len(str(markdown)) > MARKDOWN_LIMIT:
                raise SlackError("msg_blocks_too_long")
            return str(markdown), [{"type": "markdown", "text": str(markdown)}]
        checked = check_blocks(blocks) if blocks is not None else None
        if text is None and not checked:
            raise SlackError("no_text")
        return (str(text) if text is not None else None), checked

    def _post_text(self, text: str | None) -> tuple[str, list[str]]:
        if text is not None and len(text) > POST_TEXT_LIMIT:
            return text[:POST_TEXT_LIMIT], ["message_truncated"]
        return text or "", []

    def _expire(self, message: Message) -> None:
        if not message.streaming:
            return
        now = self.clock()
        idle, age = now - message.stream_touched, now - message.stream_started
        if idle > self.stream_idle_timeout or age > self.stream_max_age:
            message.stream = "expired"

    def _stream_target(self, params: dict[str, Any]) -> Message:
        channel = self._channel(params)
        message = self._existing(channel, params.get("ts"))
        if not message.from_bot or message.bot_id != self.bot_id:
            raise SlackError("message_not_owned_by_app")
        self._expire(message)
        if not message.streaming:
            raise SlackError("message_not_in_streaming_state")
        return message

    @staticmethod
    def _stream_markdown(params: dict[str, Any]) -> str:
        text = str(params.get("markdown_text") or "")
        for chunk in params.get("chunks") or []:
            if chunk.get("type") == "markdown_text":
                text += str(chunk.get("text") or "")
        if len(text) > MARKDOWN_LIMIT:
            raise SlackError("msg_blocks_too_long")
        return text

    def _ok_message(self, message: Message, warnings: list[str]) -> dict[str, Any]:
        out: dict[str, Any] = {"channel": message.channel, "ts": message.ts,
                               "message": {**message.as_event_message(), "bot_id": self.bot_id,
                                           "app_id": self.app_id, "team": self.team_id}}
        if warnings:
            self.warnings.extend(warnings)
            out["warning"] = ",".join(warnings)
            out["response_metadata"] = {"warnings": warnings}
        return out

    # ---- methods -----------------------------------------------------------------------------------

    def _m_auth_test(self, p: dict[str, Any]) -> dict[str, Any]:
        return {"url": f"https://{self.team_domain}.slack.com/", "team": "Chatbridge Test", "user": self.bot_name,
                "team_id": self.team_id, "user_id": self.bot_user_id, "bot_id": self.bot_id,
                "is_enterprise_install": False}

    def _m_apps_connections_open(self, p: dict[str, Any]) -> dict[str, Any]:
        return {"url": self.socket.issue_url()}

    def _m_chat_postMessage(self, p: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(p)
        text, blocks = self._content(p)
        shown, warnings = self._post_text(text)
        thread_ts = str(p["thread_ts"]) if p.get("thread_ts") else None
        if thread_ts is not None:
            self._existing(channel, thread_ts)
        metadata = p.get("metadata")
        if metadata is not None and not (isinstance(metadata, dict) and isinstance(metadata.get("event_type"), str)
                                         and isinstance(metadata.get("event_payload"), dict)):
            raise SlackError("invalid_metadata_format")
        message = Message(channel, self.next_ts(), shown, blocks or [], user=self.bot_user_id, bot_id=self.bot_id,
                          thread_ts=thread_ts, metadata=metadata)
        self.channels[channel][message.ts] = message
        return self._ok_message(message, warnings)

    def _m_chat_update(self, p: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(p)
        message = self._existing(channel, p.get("ts"))
        if message.bot_id != self.bot_id:
            raise SlackError("cant_update_message")
        self._expire(message)
        if message.streaming:
            raise SlackError("streaming_state_conflict")
        text, blocks = self._content(p)
        if text is not None and len(text) > UPDATE_TEXT_LIMIT:
            raise SlackError("msg_too_long")
        message.edits.append((message.text, message.blocks))
        if text is not None:
            message.text = text
            message.blocks = blocks or []  # text without blocks: the old blocks go
        elif blocks is not None:
            message.blocks = blocks  # blocks without text: the old text stays (notification fallback)
        return {"channel": channel, "ts": message.ts, "text": message.text,
                "message": {**message.as_event_message(), "bot_id": self.bot_id}}

    def _m_chat_delete(self, p: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(p)
        message = self._existing(channel, p.get("ts"))
        if message.bot_id != self.bot_id:
            raise SlackError("cant_delete_message")
        message.deleted = True
        return {"channel": channel, "ts": message.ts}

    def _m_chat_postEphemeral(self, p: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(p)
        user = str(p.get("user") or "")
        if user not in self.users:
            raise SlackError("user_not_in_channel")
        text, blocks = self._content(p)
        if text is not None and len(text) > POST_TEXT_LIMIT:
            raise SlackError("msg_too_long")
        self.ephemerals.append(Ephemeral(channel, user, text or "", blocks or [],
                                         str(p["thread_ts"]) if p.get("thread_ts") else None))
        return {"message_ts": self.next_ts()}

    def _m_chat_startStream(self, p: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(p)
        thread_ts = str(p.get("thread_ts") or "")
        if not thread_ts:
            raise SlackError("invalid_arguments")
        self._existing(channel, thread_ts)
        if self.channel_types[channel] not in _STREAM_OK_CHANNELS:
            if not p.get("recipient_user_id"):
                raise SlackError("missing_recipient_user_id")
            if not p.get("recipient_team_id"):
                raise SlackError("missing_recipient_team_id")
        text = self._stream_markdown(p)
        now = self.clock()
        message = Message(channel, self.next_ts(), text, [], user=self.bot_user_id, bot_id=self.bot_id,
                          thread_ts=thread_ts, stream="streaming", stream_started=now, stream_touched=now)
        self.channels[channel][message.ts] = message
        return {"channel": channel, "ts": message.ts}

    def _m_chat_appendStream(self, p: dict[str, Any]) -> dict[str, Any]:
        message = self._stream_target(p)
        text = self._stream_markdown(p)
        if not text:
            raise SlackError("no_text")
        message.text += text
        message.stream_touched = self.clock()
        return {"channel": message.channel, "ts": message.ts}

    def _m_chat_stopStream(self, p: dict[str, Any]) -> dict[str, Any]:
        message = self._stream_target(p)
        message.text += self._stream_markdown(p)
        if p.get("blocks") is not None:
            message.blocks = [{"type": "markdown", "text": message.text}, *check_blocks(p["blocks"])]
        message.stream = "stopped"
        return {"channel": message.channel, "ts": message.ts,
                "message": {**message.as_event_message(), "bot_id": self.bot_id}}

    def _m_reactions_add(self, p: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(p)
        message = self._existing(channel, p.get("timestamp"))
        name = str(p.get("name") or "").strip(":")
        if not name:
            raise SlackError("invalid_name")
        users = message.reactions.setdefault(name, [])
        if self.bot_user_id in users:
            raise SlackError("already_reacted")
        users.append(self.bot_user_id)
        return {}

    def _m_reactions_remove(self, p: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(p)
        message = self._existing(channel, p.get("timestamp"))
        name = str(p.get("name") or "").strip(":")
        users = message.reactions.get(name, [])
        if self.bot_user_id not in users:
            raise SlackError("no_reaction")
        users.remove(self.bot_user_id)
        if not users:
            del message.reactions[name]
        return {}

    def _m_assistant_threads_setStatus(self, p: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(p, "channel_id")
        if str(p.get("thread_ts") or "") not in self.channels[channel]:
            raise SlackError("invalid_thread_ts")
        self.statuses.append(dict(p))
        return {}

    def _m_conversations_replies(self, p: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(p)
        root = self.channels[channel].get(str(p.get("ts") or ""))
        if root is None:
            raise SlackError("thread_not_found")
        root_ts = root.thread_ts or root.ts
        thread = sorted((m for m in self.channels[channel].values()
                         if not m.deleted and (m.ts == root_ts or m.thread_ts == root_ts)
                         and _in_window(m.ts, p)), key=lambda m: m.ts)
        return {"messages": [m.as_event_message(metadata=_with_metadata(p)) for m in thread], "has_more": False}

    def _m_conversations_history(self, p: dict[str, Any]) -> dict[str, Any]:
        """The channel's own messages (thread replies are not in it), newest first, ``oldest``/``latest`` and
        ``limit`` as Slack takes them; one page (no cursor)."""
        channel = self._channel(p)
        limit = int(p.get("limit") or 100)
        top = sorted((m for m in self.channels[channel].values()
                      if not m.deleted and (m.thread_ts is None or m.thread_ts == m.ts) and _in_window(m.ts, p)),
                     key=lambda m: m.ts, reverse=True)
        return {"messages": [m.as_event_message(metadata=_with_metadata(p)) for m in top[:limit]],
                "has_more": False}

    def _m_files_info(self, p: dict[str, Any]) -> dict[str, Any]:
        found = self.files.get(str(p.get("file") or ""))
        if found is None:
            raise SlackError("file_not_found")
        return {"file": found[0]}

    def _m_users_info(self, p: dict[str, Any]) -> dict[str, Any]:
        user = self.users.get(str(p.get("user") or ""))
        if user is None:
            raise SlackError("user_not_found")
        return {"user": user}


def _with_metadata(p: dict[str, Any]) -> bool:
    """Whether a history call asked for the messages' metadata (``include_all_metadata``)."""
    return str(p.get("include_all_metadata")).lower() in ("1", "true")


def _in_window(ts: str, p: dict[str, Any]) -> bool:
    """Whether a message's ``ts`` lies within a history call's ``oldest``/``latest`` (``inclusive`` or not)."""
    at, inclusive = float(ts), str(p.get("inclusive")).lower() in ("1", "true")
    oldest, latest = p.get("oldest"), p.get("latest")
    if oldest is not None and (at < float(oldest) or (at == float(oldest) and not inclusive)):
        return False
    return latest is None or at < float(latest) or (at == float(latest) and inclusive)
