"""HTTP API and chat page of the web channel (DESIGN.md §6), on the bridge's aiohttp application.

Everything it does to sessions goes through the channel's ``SessionHost`` (core.host): submit, stop,
decide, list, history, rename.

Every request to the chat's paths passes one middleware first: forwarded headers from trusted proxies, the
host and origin rules of :mod:`channels.web.guard`, then the token of :mod:`channels.web.auth`. JSON routes
take ``application/json`` only (a foreign page can send ``text/plain`` without asking the browser first)
and answer 400 to anything that is not a JSON object, however deeply nested.

Attachments: ``POST /api/sessions/{id}/attachments`` takes one file as ``multipart/form-data`` (the only body
that is not JSON, with the same origin rules) and streams it into core's media store under ``[media]
max_bytes`` (413 past it, nothing kept); the message that carries it names it in ``attachments``. ``GET
/api/sessions/{id}/attachments/{attachment id}`` serves a stored file to a client of that session only
(another session's id is a 404): images of a type browsers show safely inline, everything else as a
download (``Content-Disposition: attachment``, ``application/octet-stream``), always with ``nosniff`` and the
chat's content security policy.

Server-sent event streams are capped in total and per client (503 past the cap), and a stream whose
client went away is let go within a second (:meth:`WebServer.reap_closed`): aiohttp does not cancel a
handler when its client leaves, and a stream that only noticed at its next heartbeat kept its connection,
queue and subscription alive for up to 15 s each. A client that stops reading pins little: its queue is cut
off past the session's replay buffer in bytes (it reconnects and gets a replay or a resync), and its
connection is closed once it has taken no data for ``WRITE_TIMEOUT_SECONDS``. The same pass queues the heartbeats
of idle streams and closes a connection stuck in a write: a stream's pump sets no timer per event, and the
events waiting for it together leave in one write (``Subscriber.next``).

A session stream asked for with ``?feed=1`` also carries the session-list feed (the events of
``/api/events``, without ids): the chat page holds that one connection per tab, as a browser allows only six
per host over HTTP/1.1 to all its tabs together.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from aiohttp import BodyPartReader, web

from channels.common.http import streams_own_body
from channels.web.auth import COOKIE, COOKIE_MAX_AGE, GuessLimiter, TokenCheck, client_key
from channels.web.context import CHANNEL, WebContext, message_view, session_id_of, session_key
from channels.web.guard import RequestGuard, add_security_headers, is_chat_path
from channels.web.sse import HEARTBEAT, Subscriber, encode_event
from core.agent.subagents import is_child_key
from core.envelope import InboundEnvelope, MediaItem
from core.host import AdmissionError, AttachmentRefused, DecideResult, SessionHost, ShuttingDownError, SubmitResult
from core.media.sniff import IMAGE_TYPES
from core.router import parse_command
from core.store import UnknownMessageError

if TYPE_CHECKING:
    from channels.web.channel import WebChannel

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
OLD_COOKIE = "chatbridge_token"  # held the raw token in earlier versions; removed at the next sign-in
SENDER = "web-user"
MAX_TEXT = 32_000
MAX_TITLE = 200
MAX_CALL_ID = 256
HISTORY_PAGE = 200
"""Messages per history page unless ``limit`` says otherwise; ``HISTORY_MAX`` bounds ``limit``."""
HISTORY_MAX = 1000
_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # a subagent's id is its parent's with -sub-<12 hex> per level
_CLIENT_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_ATTACHMENT_ID = re.compile(r"[0-9a-f]{32}")
UPLOAD_CHUNK = 64 * 1024
MULTIPART_OVERHEAD = 64 * 1024
"""What a multipart body may carry besides the file itself (boundaries, part headers)."""
HEARTBEAT_SECONDS = 15.0
"""A comment line on every idle SSE connection this often keeps proxies from closing it."""
WRITE_TIMEOUT_SECONDS = 30.0
"""An SSE client that takes none of the data waiting for it for this long has stalled (or is gone without a
word): its connection is closed rather than left to hold the stream's slot and memory."""
FEED_MAX_PENDING = 1000
"""Events waiting for a connection to the session-list feed alone (they are small)."""
# Event ids are "<epoch>-<seq>"; anything longer, or with digits other than ASCII ones, is not ours.
_LAST_EVENT_ID = re.compile(r"[A-Za-z0-9]{1,64}-[0-9]{1,18}")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


LOGIN_PAGE = """<!doctype html>
<html lang=en><head><meta charset=utf-8><meta name=viewport content="width=device-width, initial-scale=1">
<title>chatbridge: sign in</title><link rel=stylesheet href="/static/style.css"></head>
<body class=login><form method=post action="/login"><h1>chatbridge</h1>
<p>This chat needs the access token (<code>[web] auth_token</code> in the bridge's config).</p>{note}
<input type=password name=token autocomplete=current-password placeholder="Access token" required autofocus>
<button type=submit>Sign in</button></form></body></html>
"""


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def content_disposition(name: str, *, inline: bool) -> str:
    """``attachment`` (or ``inline``) with the file name: an ASCII fallback and the exact name (RFC 6266)."""
    ascii_name = "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else "_" for c in name) or "file"
    return f"{'inline' if inline else 'attachment'}; filename=\"{ascii_name}\"; filename*=UTF-8''{quote(name, safe='')}"


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=json.dumps({"error": message}), content_type="application/json")


@dataclass(frozen=True)
class WebAccess:
    """Who may use the web chat and how much of it (the ``[web]`` keys of DESIGN.md §6)."""

    auth_token: str = ""
    bind_host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    trusted_proxies: tuple[str, ...] = ()
    max_streams: int = 200
    max_streams_per_client: int = 20
    cookie_key: bytes | None = None
    """Signs the login cookie; None: a random key for this process (the channel loads the durable one at start)."""


class StreamSlots:
    """Counts open event streams in total and per client; a client's entry exists only while it has one."""

    def __init__(self, total: int, per_client: int) -> None:
        self.total = total
        self.per_client = per_client
        self.open = 0
        self.by_client: dict[str, int] = {}

    def acquire(self, client: str) -> str | None:
        """None when ``client`` may open one more stream (and it is counted), else why not."""
        if self.by_client.get(client, 0) >= self.per_client:
            return f"too many open event streams from this client (at most {self.per_client})"
        if self.open >= self.total:
            return f"too many open event streams (at most {self.total}); try again in a moment"
        self.open += 1
        self.by_client[client] = self.by_client.get(client, 0) + 1
        return None

    def release(self, client: str) -> None:
        self.open -= 1
        left = self.by_client.get(client, 0) - 1
        if left > 0:
            self.by_client[client] = left
        else:
            self.by_client.pop(client, None)


@dataclass(slots=True)
class _Listener:
    """One open event stream, as :meth:`WebServer.reap_closed` looks after it."""

    request: web.Request
    quiet_since: float
    """When its last write went out, or its last heartbeat was queued (``time.monotonic``)."""
    writing_since: float | None = None
    """When the write under way began; None between writes."""


class WebServer:
    def __init__(self, host: SessionHost, channel: WebChannel, *, access: WebAccess | None = None,
                 heartbeat: float = HEARTBEAT_SECONDS, max_pending: int = 5000,
                 max_pending_bytes: int | None = None, write_timeout: float = WRITE_TIMEOUT_SECONDS,
                 guesses: GuessLimiter | None = None) -> None:
        access = access if access is not None else WebAccess()
        self.host = host
        self.channel = channel
        self.access = access
        self.guard = RequestGuard(bind_host=access.bind_host, allowed_hosts=access.allowed_hosts,
                                  trusted_proxies=access.trusted_proxies)
        self.tokens = TokenCheck(access.auth_token, access.cookie_key or secrets.token_bytes(32))
        # With an access token, the key that signs login cookies is the channel's durable one, loaded at its
        # start (after the server listens): until then a login would get a cookie signed with the throwaway
        # key above (void a moment later) and a good cookie would be refused, so the chat answers 503.
        self.key_loaded = access.cookie_key is not None or not access.auth_token
        self.guesses = guesses if guesses is not None else GuessLimiter()
        self.slots = StreamSlots(access.max_streams, access.max_streams_per_client)
        self.heartbeat = heartbeat
        self.max_pending = max_pending
        # what a connection may have waiting: no more than a session's replay buffer can give it back
        self.max_pending_bytes = max_pending_bytes if max_pending_bytes is not None else channel.hub.max_bytes
        self.write_timeout = write_timeout
        self.accepting = True
        self.connections: set[asyncio.Task[Any]] = set()
        self._listening: dict[Subscriber, _Listener] = {}

    def install(self, app: web.Application) -> None:
        app.middlewares.append(self._guard_middleware)
        app.on_response_prepare.append(self._on_prepare)
        r = app.router
        r.add_get("/", self.index)
        r.add_get("/login", self.login_form)
        r.add_post("/login", self.login)
        r.add_static("/static/", STATIC_DIR, append_version=False)
        r.add_get("/api/sessions", self.list_sessions)
        r.add_post("/api/sessions", self.create_session)
        r.add_get("/api/events", self.feed)
        r.add_patch("/api/sessions/{id}", self.rename)
        r.add_post("/api/sessions/{id}/messages", self.post_message)
        r.add_post("/api/sessions/{id}/attachments", self.upload)
        r.add_get("/api/sessions/{id}/attachments/{attachment_id}", self.download)
        r.add_get("/api/sessions/{id}/history", self.history)
        r.add_get("/api/sessions/{id}/stream", self.stream)
        r.add_post("/api/sessions/{id}/stop", self.stop)
        r.add_post("/api/sessions/{id}/approvals/{call_id}", self.decide)

    # ---- who may ask ----------------------------------------------------------------------------

    @staticmethod
    async def _on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        add_security_headers(request, response)

    @web.middleware
    async def _guard_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if not is_chat_path(request.path):
            return await handler(request)  # webhooks and /healthz have their own rules
        request = self.guard.effective(request)
        refused = self.guard.check(request)
        if refused is not None:
            log.info("web chat: refused %s %s: %s", request.method, request.path, refused)
            return _error(403, refused)
        path = request.path
        if not self.key_loaded and not path.startswith("/static/"):
            return _error(503, "the web chat is starting; try again in a moment", headers={"Retry-After": "1"})
        if (path == "/" or path.startswith("/api/")) and self.tokens.required:
            denied = self._authenticate(request)
            if denied is not None:
                return denied
        return await handler(request)

    def _authenticate(self, request: web.Request) -> web.StreamResponse | None:
        """None when the request carries the login cookie or the right bearer token, else the answer."""
        if self.tokens.cookie_ok(request.cookies.get(COOKIE, "")):
            return None
        header = request.headers.get("Authorization", "")
        if header.lower().startswith("bearer "):
            client = client_key(request.remote)
            wait = self.guesses.retry_after(client)
            if wait is not None:
                return _error(429, "too many wrong access tokens from this address; try again later",
                              headers={"Retry-After": str(math.ceil(wait))})
            if self.tokens.token_ok(header[7:].strip()):
                self.guesses.succeeded(client)
                return None
            self.guesses.failed(client)
        if request.path.startswith("/api/"):
            return _error(401, "authentication required: send 'Authorization: Bearer <[web] auth_token>'")
        raise web.HTTPFound("/login")

    def _login_page(self, note: str = "", status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
        return web.Response(text=LOGIN_PAGE.replace("{note}", note), content_type="text/html", status=status,
                            headers=headers)

    async def login_form(self, request: web.Request) -> web.StreamResponse:
        if not self.tokens.required:
            raise web.HTTPFound("/")
        note = "<p class=err>That token is not right.</p>" if request.query.get("failed") == "1" else ""
        return self._login_page(note)

    async def login(self, request: web.Request) -> web.StreamResponse:
        if not self.tokens.required:
            raise web.HTTPFound("/")
        client = client_key(request.remote)
        wait = self.guesses.retry_after(client)
        if wait is not None:
            seconds = math.ceil(wait)
            return self._login_page(f"<p class=err>Too many wrong tokens from this address. Try again in "
                                    f"{seconds} seconds.</p>", status=429, headers={"Retry-After": str(seconds)})
        form = await request.post()
        token = form.get("token")
        if not isinstance(token, str) or not self.tokens.token_ok(token):
            self.guesses.failed(client)
            raise web.HTTPFound("/login?failed=1")
        self.guesses.succeeded(client)
        resp = web.Response(status=303, headers={"Location": "/"})
        resp.set_cookie(COOKIE, self.tokens.cookie_value, httponly=True, samesite="Strict", path="/",
                        max_age=COOKIE_MAX_AGE, secure=request.secure)
        if OLD_COOKIE in request.cookies:
            resp.del_cookie(OLD_COOKIE)
        return resp

    # ---- pages and sessions ---------------------------------------------------------------------

    async def index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @staticmethod
    def _session_id(request: web.Request) -> str:
        sid = request.match_info["id"]
        if not _ID.match(sid):
            raise _bad_request("bad session id")
        return sid

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        if request.content_type != "application/json":
            raise web.HTTPUnsupportedMediaType(
                text=json.dumps({"error": "send the body as JSON with 'Content-Type: application/json'"}),
                content_type="application/json")
        try:
            body = json.loads(await request.read())
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested deeper than the parser goes
            body = None
        if not isinstance(body, dict):
            raise _bad_request("expected a JSON object")
        return body

    async def list_sessions(self, request: web.Request) -> web.StreamResponse:
        records = await self.host.list_sessions()
        return web.json_response({"sessions": [
            {"id": session_id_of(r.key), "title": r.title, "history_revision": r.history_revision,
             "updated_at": r.updated_at} for r in records]})

    async def create_session(self, request: web.Request) -> web.StreamResponse:
        sid = uuid.uuid4().hex[:16]
        record = await self.host.create_session(session_key(sid))
        self.channel.publish_feed("session_created", {"session_id": sid, "title": record.title})
        return web.json_response({"id": sid, "title": record.title}, status=201)

    async def rename(self, request: web.Request) -> web.StreamResponse:
        sid = self._session_id(request)
        title = self._text_field(await self._json(request), "title").strip()
        if not title or len(title) > MAX_TITLE:
            return _error(400, f"title must be 1 to {MAX_TITLE} characters")
        await self.host.create_session(session_key(sid))
        stored = await self.host.rename(session_key(sid), title)
        return web.json_response({"id": sid, "title": stored})

    async def history(self, request: web.Request) -> web.StreamResponse:
        """The newest ``limit`` messages, or with ``before=<message id>`` the ones older than that message;
        ``has_more`` tells whether older ones remain (the page loads them when scrolled to the top)."""
        sid = self._session_id(request)
        raw_limit = request.query.get("limit", str(HISTORY_PAGE))
        if not (raw_limit.isascii() and raw_limit.isdigit() and len(raw_limit) <= 6
                and 1 <= int(raw_limit) <= HISTORY_MAX):
            return _error(400, f"'limit' must be a whole number from 1 to {HISTORY_MAX}")
        limit = int(raw_limit)
        before = request.query.get("before")
        if before is not None and not _ID.match(before):
            return _error(400, "'before' must be a message id")
        try:  # one more than asked: whether older messages remain, without a second query
            revision, messages = await self.host.history(session_key(sid), limit=limit + 1, before=before)
        except UnknownMessageError:
            return _error(400, "'before' is not a message of this conversation")
        stream = self.channel.hub.get(sid)
        client_ids = stream.client_ids if stream is not None else {}
        return web.json_response({"history_revision": revision, "has_more": len(messages) > limit,
                                  "messages": [message_view(m.history_view(), client_ids) for m in messages[-limit:]]})

    @staticmethod
    def _text_field(body: dict[str, Any], name: str) -> str:
        value = body.get(name)
        if not isinstance(value, str):
            raise _bad_request(f"'{name}' must be a string")
        return value

    async def post_message(self, request: web.Request) -> web.StreamResponse:
        sid = self._session_id(request)
        if is_child_key(session_key(sid)):
            return _error(409, "this is a subagent's conversation: it is shown in its parent's and takes no messages")
        body = await self._json(request)
        text = self._text_field(body, "text")
        found = await self._attachments(sid, body.get("attachments", []))
        if isinstance(found, web.Response):
            return found
        media, refs = found
        if not text.strip() and not media:
            return _error(400, "'text' is empty")
        if len(text) > MAX_TEXT:
            return _error(413, f"'text' is longer than {MAX_TEXT} characters")
        client_id = body.get("client_id")
        if client_id is not None and (not isinstance(client_id, str) or not _CLIENT_ID.match(client_id)):
            return _error(400, "'client_id' must be 1 to 64 letters, digits, '-' or '_'")
        if not self.accepting:
            return _error(503, "the bridge is shutting down; send the message again in a minute")
        command_id = uuid.uuid4().hex if parse_command(text) == "new" else None
        envelope = InboundEnvelope(
            channel=CHANNEL, chat_id=sid, session_key=session_key(sid), sender_id=SENDER, content=text,
            media=media, event_id=client_id,
            channel_context=WebContext(client_id=client_id, command_id=command_id).wrap())
        try:
            result = await self.host.submit(envelope)
        except ShuttingDownError:
            return _error(503, "the bridge is shutting down; send the message again in a minute")
        except AdmissionError:  # not stored, so its client_id is still free for the resend
            return _error(503, "the message could not be saved; send it again")
        self._follow(sid, client_id, command_id, text, refs, result)
        return web.json_response({"status": result.value}, status=202)

    def _follow(self, sid: str, client_id: str | None, command_id: str | None, text: str,
                refs: list[dict[str, Any]], result: SubmitResult) -> None:
        """Keep which page messages wait (told to the open pages at once, listed by ``task_state``, named by
        the ``/new`` notice that leaves them unanswered) and which ``/new`` came after them."""
        if result is SubmitResult.QUEUED and client_id is not None:
            self.channel.hub.stream(sid).message_queued(client_id, {"text": text, "attachments": refs})
        elif result is SubmitResult.COMMAND and command_id is not None:
            self.channel.hub.stream(sid).new_requested(command_id)

    async def _attachments(self, sid: str,
                           ids: Any) -> tuple[tuple[MediaItem, ...], list[dict[str, Any]]] | web.Response:
        """The uploads a message names, each checked to be a stored file of this session, and their views as
        the history shows them."""
        limit = self.host.media_limits().max_files
        if not isinstance(ids, list) or not all(isinstance(i, str) and _ATTACHMENT_ID.fullmatch(i) for i in ids):
            return _error(400, "'attachments' must be a list of attachment ids")
        if len(ids) > limit:
            return _error(400, f"at most {limit} attachments per message")
        items, refs = [], []
        for attachment_id in dict.fromkeys(ids):
            found = await self.host.attachment(session_key(sid), attachment_id)
            if found is None:
                return _error(400, "an attachment is not (or no longer) stored for this conversation; attach it again")
            record, _ = found
            items.append(MediaItem(kind="photo" if record.kind == "image" else "document", file_id=record.id,
                                   attachment_id=record.id, file_name=record.name, size=record.size,
                                   mime_type=record.content_type))
            refs.append({"id": record.id, "kind": record.kind, "name": record.name, "size": record.size,
                         "content_type": record.content_type, "note": None})
        return tuple(items), refs

    @streams_own_body  # files up to [media] max_bytes, past the server's cap for other bodies
    async def upload(self, request: web.Request) -> web.StreamResponse:
        """Store one file (the ``file`` field of a multipart form) for the message that will carry it."""
        sid = self._session_id(request)
        if request.content_type != "multipart/form-data":
            return _error(415, "send the file as multipart/form-data (a 'file' field)")
        max_bytes = self.host.media_limits().max_bytes
        if request.content_length is not None and request.content_length > max_bytes + MULTIPART_OVERHEAD:
            return _error(413, f"it is larger than the {max_bytes / 1_000_000:g} MB limit for attachments")
        if not self.accepting:
            return _error(503, "the bridge is shutting down; try again in a minute")
        try:
            reader = await request.multipart()
            part = await reader.next()
        except (ValueError, AssertionError, RuntimeError) as exc:  # no boundary, a garbled body
            return _error(400, f"not a multipart form: {type(exc).__name__}")
        if not isinstance(part, BodyPartReader) or part.name != "file":
            return _error(400, "expected one 'file' field")
        file = part

        async def chunks() -> AsyncGenerator[bytes, None]:
            while chunk := await file.read_chunk(UPLOAD_CHUNK):
                yield chunk

        try:
            ref = await self.host.upload(session_key(sid), file.filename, chunks())
        except AttachmentRefused as exc:  # 507: the bridge's disk is full or failing, not the file's fault
            return _error(507 if exc.storage else 413, str(exc))
        return web.json_response(ref.history_view(), status=201)

    async def download(self, request: web.Request) -> web.StreamResponse:
        sid = self._session_id(request)
        attachment_id = request.match_info["attachment_id"]
        found = await self.host.attachment(session_key(sid), attachment_id) \
            if _ATTACHMENT_ID.fullmatch(attachment_id) else None
        if found is None:
            return _error(404, "no such attachment in this conversation (it may have expired)")
        record, path = found
        inline = record.content_type in IMAGE_TYPES
        return web.FileResponse(path, headers={
            "Content-Type": record.content_type if inline else "application/octet-stream",
            "Content-Disposition": content_disposition(record.name, inline=inline),
            "Cache-Control": "private, max-age=3600"})

    async def stop(self, request: web.Request) -> web.StreamResponse:
        sid = self._session_id(request)
        stopped = await self.host.stop(session_key(sid))
        return web.json_response({"stopped": stopped})

    async def decide(self, request: web.Request) -> web.StreamResponse:
        """Allow or deny a pending tool call of the session's running turn (``approval_request``)."""
        sid = self._session_id(request)
        call_id = request.match_info["call_id"]
        if not call_id or len(call_id) > MAX_CALL_ID:
            return _error(400, "bad tool call id")
        body = await self._json(request)
        decision = body.get("decision")
        if decision not in ("allow", "deny"):
            return _error(400, "'decision' must be \"allow\" or \"deny\"")
        # A subagent's call is decided here too, in its parent's conversation: the request's ``origin`` (the
        # child session ids of its approval_request) says whose call it is; core checks it descends from sid.
        origin = body.get("origin", [])
        if not isinstance(origin, list) or len(origin) > 8 or not all(isinstance(o, str) and _ID.match(o)
                                                                     for o in origin):
            return _error(400, "'origin' must be the list of session ids of the approval request")
        # The web chat has no user identities: every client that passed the token check speaks as the one
        # SENDER its messages are submitted as, so core lets it decide the pending approvals of the session it
        # addresses, and no other session's (approvals are keyed by session).
        result = await self.host.decide(session_key(sid), call_id, decision, decided_by=SENDER,
                                  origin=[session_key(o) for o in origin])
        if result is DecideResult.REFUSED:
            return _error(403, "this approval was requested by someone else")
        if result is not DecideResult.DECIDED:
            return _error(404, "no such pending approval (already decided, timed out, or the turn ended)")
        return web.json_response({"call_id": call_id, "decision": decision})

    # ---- SSE ------------------------------------------------------------------------------------

    def _take_slot(self, request: web.Request) -> str | web.Response:
        client = client_key(request.remote)
        refused = self.slots.acquire(client)
        if refused is not None:
            return _error(503, refused, headers={"Retry-After": "5"})
        return client

    async def _pump(self, request: web.Request, sub: Subscriber, first: bytes) -> web.StreamResponse:
        task = asyncio.current_task()
        if task is not None:
            self.connections.add(task)
        listener = self._listening[sub] = _Listener(request, time.monotonic())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            await resp.prepare(request)
            await self._write(listener, resp.write(first))
            while (data := await sub.next()) is not None:
                await self._write(listener, resp.write(data))
            # The stream ends (cut off, or the channel closes), and its connection with it: the client
            # reconnects on a new one, and one that stopped reading is not kept as an idle keep-alive.
            resp.force_close()
            await self._write(listener, resp.write_eof())
        except (ConnectionError, RuntimeError):
            pass  # the client went away (aiohttp finishes a response whose connection is gone quietly)
        finally:
            self._listening.pop(sub, None)
            if task is not None:
                self.connections.discard(task)
        return resp

    @staticmethod
    async def _write(listener: _Listener, write: Awaitable[None]) -> None:
        """Run ``write`` (of the response's body), telling the once-a-second pass (:meth:`reap_closed`) that it
        is under way: one that has not gone out after ``write_timeout`` seconds has its connection closed. A
        write waits only while the connection's buffer is over aiohttp's high-water mark (tens of KiB), so a
        slow client that keeps reading is not cut; nor is one that reads nothing while nothing is sent to it
        (heartbeats aside)."""
        listener.writing_since = time.monotonic()
        try:
            await write
        finally:
            listener.writing_since = None
        listener.quiet_since = time.monotonic()

    def use_cookie_key(self, key: bytes) -> None:
        """Sign login cookies with ``key`` from now on (the channel's durable key, loaded at start)."""
        self.tokens = TokenCheck(self.access.auth_token, key)
        self.key_loaded = True

    def reap_closed(self) -> int:
        """Look after the open event streams, about once a second: end those whose client has gone, or has taken
        none of a write for ``write_timeout`` seconds (its connection is closed: a socket that never drains
        would hold the stream's pump in that write for good), and queue a heartbeat on those quiet for
        ``heartbeat`` seconds. Returns how many it ended. (One pass for all of them, rather than a timer around
        each event's wait and write.)"""
        now = time.monotonic()
        gone = 0
        for sub, listener in list(self._listening.items()):
            transport = listener.request.transport
            writing = listener.writing_since
            stalled = writing is not None and now - writing >= self.write_timeout
            if stalled:
                log.info("web chat: an event stream's client took no data for %g s; its connection is closed",
                         self.write_timeout)
                if transport is not None:
                    transport.abort()  # close() would wait for the buffer to drain, which it does not
            if stalled or transport is None or transport.is_closing():
                sub.close()
                gone += 1
            elif writing is None and now - listener.quiet_since >= self.heartbeat:
                sub.push(HEARTBEAT)
                listener.quiet_since = now
        return gone

    @staticmethod
    def _last_event_id(request: web.Request) -> str:
        return (request.headers.get("Last-Event-ID") or request.query.get("last_event_id") or "").strip()

    async def stream(self, request: web.Request) -> web.StreamResponse:
        sid = self._session_id(request)
        slot = self._take_slot(request)
        if isinstance(slot, web.Response):
            return slot
        try:
            last = self._last_event_id(request)
            s = self.channel.open_stream(sid)
            # From here to subscribe nothing awaits: the opening events and the live ones join without a gap
            # (what arrives while the response is being prepared waits in the subscriber's queue).
            parts = [b"retry: 2000\n\n"]
            replay = s.replay_since(last) if _LAST_EVENT_ID.fullmatch(last) else None
            if last and replay is None:
                parts.append(encode_event("resync_required", {
                    "session_id": sid, "last_event_id": last if _LAST_EVENT_ID.fullmatch(last) else None}))
            if replay:
                parts.extend(replay)
            # After a replay too: the snapshot settles what the client missed before its replay buffer began.
            parts.append(s.task_state())
            sub = s.subscribe(self.max_pending, self.max_pending_bytes)
            with_feed = request.query.get("feed") == "1"
            if with_feed:
                self.channel.feed_subscribe(sub)
            try:
                return await self._pump(request, sub, b"".join(parts))
            finally:
                s.unsubscribe(sub)
                if with_feed:
                    self.channel.feed_unsubscribe(sub)
                self.channel.hub.release(sid)
        finally:
            self.slots.release(slot)

    async def feed(self, request: web.Request) -> web.StreamResponse:
        slot = self._take_slot(request)
        if isinstance(slot, web.Response):
            return slot
        try:
            sub = self.channel.feed_subscribe(Subscriber(FEED_MAX_PENDING, self.max_pending_bytes))
            try:
                return await self._pump(request, sub, b"retry: 2000\n\n" + encode_event("ready", {}))
            finally:
                self.channel.feed_unsubscribe(sub)
        finally:
            self.slots.release(slot)

    async def close(self) -> None:
        self.channel.close_connections()
        for task in list(self.connections):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), 1)
