"""HTTP API and chat page of the web channel (DESIGN.md §6), on the bridge's aiohttp application."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from channels.web.channel import CHANNEL, WebChannel, session_id_of, session_key
from channels.web.sse import HEARTBEAT, Subscriber, encode_event
from core.envelope import ChannelContext, InboundEnvelope
from core.runtime import ChatCore, RouterClosedError
from core.store import UnknownMessageError

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
COOKIE = "chatbridge_token"
SENDER = "web-user"
MAX_TEXT = 32_000
MAX_TITLE = 200
MAX_CALL_ID = 256
HISTORY_PAGE = 200
"""Messages per history page unless ``limit`` says otherwise; ``HISTORY_MAX`` bounds ``limit``."""
HISTORY_MAX = 1000
_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


LOGIN_PAGE = """<!doctype html>
<html lang=en><head><meta charset=utf-8><meta name=viewport content="width=device-width, initial-scale=1">
<title>chatbridge: sign in</title><link rel=stylesheet href="/static/style.css"></head>
<body class=login><form method=post action="/login"><h1>chatbridge</h1>
<p>This chat needs the access token (<code>[web] auth_token</code> in the bridge's config).</p>{note}
<input type=password name=token autocomplete=current-password placeholder="Access token" required autofocus>
<button type=submit>Sign in</button></form></body></html>
"""


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class WebServer:
    def __init__(self, core: ChatCore, channel: WebChannel, *, auth_token: str = "",
                 heartbeat: float = 15.0, max_pending: int = 5000) -> None:
        self.core = core
        self.channel = channel
        self.auth_token = auth_token
        self.heartbeat = heartbeat
        self.max_pending = max_pending
        self.accepting = True
        self.connections: set[asyncio.Task[Any]] = set()

    def install(self, app: web.Application) -> None:
        app.middlewares.append(self._auth_middleware)
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
        r.add_get("/api/sessions/{id}/history", self.history)
        r.add_get("/api/sessions/{id}/stream", self.stream)
        r.add_post("/api/sessions/{id}/stop", self.stop)
        r.add_post("/api/sessions/{id}/approvals/{call_id}", self.decide)

    # ---- auth -----------------------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        if not self.auth_token:
            return True
        header = request.headers.get("Authorization", "")
        candidates = [request.cookies.get(COOKIE, "")]
        if header.lower().startswith("bearer "):
            candidates.append(header[7:].strip())
        expected = self.auth_token.encode()
        return any(c and hmac.compare_digest(c.encode(), expected) for c in candidates)

    @web.middleware
    async def _auth_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        protected = path == "/" or path.startswith("/api/")
        if protected and not self._authorized(request):
            if path.startswith("/api/"):
                return _error(401, "authentication required: send 'Authorization: Bearer <[web] auth_token>'")
            raise web.HTTPFound("/login")
        return await handler(request)

    async def login_form(self, request: web.Request) -> web.StreamResponse:
        if not self.auth_token:
            raise web.HTTPFound("/")
        note = "<p class=err>That token is not right.</p>" if request.query.get("failed") == "1" else ""
        return web.Response(text=LOGIN_PAGE.replace("{note}", note), content_type="text/html")

    async def login(self, request: web.Request) -> web.StreamResponse:
        form = await request.post()
        token = str(form.get("token", ""))
        if not self.auth_token or not hmac.compare_digest(token.encode(), self.auth_token.encode()):
            raise web.HTTPFound("/login?failed=1")
        resp = web.Response(status=303, headers={"Location": "/"})
        resp.set_cookie(COOKIE, token, httponly=True, samesite="Strict", max_age=30 * 24 * 3600,
                        secure=request.secure)
        return resp

    # ---- pages and sessions ---------------------------------------------------------------------

    async def index(self, request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @staticmethod
    def _session_id(request: web.Request) -> str:
        sid = request.match_info["id"]
        if not _ID.match(sid):
            raise web.HTTPBadRequest(text=json.dumps({"error": "bad session id"}), content_type="application/json")
        return sid

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            body = None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text=json.dumps({"error": "expected a JSON object"}),
                                     content_type="application/json")
        return body

    async def list_sessions(self, request: web.Request) -> web.StreamResponse:
        records = await self.core.list_sessions(prefix="web:")
        return web.json_response({"sessions": [
            {"id": session_id_of(r.key), "title": r.title, "history_revision": r.history_revision,
             "updated_at": r.updated_at} for r in records]})

    async def create_session(self, request: web.Request) -> web.StreamResponse:
        sid = uuid.uuid4().hex[:16]
        record = await self.core.create_session(session_key(sid))
        self.channel.publish_feed("session_created", {"session_id": sid, "title": record.title})
        return web.json_response({"id": sid, "title": record.title}, status=201)

    async def rename(self, request: web.Request) -> web.StreamResponse:
        sid = self._session_id(request)
        title = self._text_field(await self._json(request), "title").strip()
        if not title or len(title) > MAX_TITLE:
            return _error(400, f"title must be 1 to {MAX_TITLE} characters")
        await self.core.create_session(session_key(sid))
        await self.core.rename(session_key(sid), title)
        return web.json_response({"id": sid, "title": title})

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
            revision, messages = await self.core.history(session_key(sid), limit=limit + 1, before=before)
        except UnknownMessageError:
            return _error(400, "'before' is not a message of this conversation")
        return web.json_response({"history_revision": revision, "has_more": len(messages) > limit,
                                  "messages": [m.history_view() for m in messages[-limit:]]})

    @staticmethod
    def _text_field(body: dict[str, Any], name: str) -> str:
        value = body.get(name)
        if not isinstance(value, str):
            raise web.HTTPBadRequest(text=json.dumps({"error": f"'{name}' must be a string"}),
                                     content_type="application/json")
        return value

    async def post_message(self, request: web.Request) -> web.StreamResponse:
        sid = self._session_id(request)
        body = await self._json(request)
        text = self._text_field(body, "text")
        if not text.strip():
            return _error(400, "'text' is empty")
        if len(text) > MAX_TEXT:
            return _error(413, f"'text' is longer than {MAX_TEXT} characters")
        client_id = body.get("client_id")
        if client_id is not None and (not isinstance(client_id, str) or not _ID.match(client_id)):
            return _error(400, "'client_id' must be 1 to 64 letters, digits, '-' or '_'")
        if not self.accepting:
            return _error(503, "the bridge is shutting down; send the message again in a minute")
        envelope = InboundEnvelope(
            channel=CHANNEL, chat_id=sid, session_key=session_key(sid), sender_id=SENDER, content=text,
            event_id=client_id, channel_context=ChannelContext(data={"client_id": client_id} if client_id else {}))
        try:
            result = await self.core.submit(envelope)
        except RouterClosedError:
            return _error(503, "the bridge is shutting down; send the message again in a minute")
        return web.json_response({"status": result.value}, status=202)

    async def stop(self, request: web.Request) -> web.StreamResponse:
        sid = self._session_id(request)
        stopped = await self.core.stop(session_key(sid))
        return web.json_response({"stopped": stopped})

    async def decide(self, request: web.Request) -> web.StreamResponse:
        """Allow or deny a pending tool call of the session's running turn (``approval_request``)."""
        sid = self._session_id(request)
        call_id = request.match_info["call_id"]
        if not call_id or len(call_id) > MAX_CALL_ID:
            return _error(400, "bad tool call id")
        decision = (await self._json(request)).get("decision")
        if decision not in ("allow", "deny"):
            return _error(400, "'decision' must be \"allow\" or \"deny\"")
        if not self.core.decide(session_key(sid), call_id, decision, decided_by=SENDER):
            return _error(404, "no such pending approval (already decided, timed out, or the turn ended)")
        return web.json_response({"call_id": call_id, "decision": decision})

    # ---- SSE ------------------------------------------------------------------------------------

    async def _open_sse(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                           "Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        return resp

    async def _pump(self, resp: web.StreamResponse, sub: Subscriber, first: bytes) -> None:
        task = asyncio.current_task()
        if task is not None:
            self.connections.add(task)
        try:
            await resp.write(first)
            while True:
                try:
                    data = await asyncio.wait_for(sub.queue.get(), self.heartbeat)
                except TimeoutError:
                    await resp.write(HEARTBEAT)
                    continue
                if data is None:
                    return
                await resp.write(data)
        except (ConnectionError, RuntimeError):
            return  # the client went away
        finally:
            if task is not None:
                self.connections.discard(task)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        sid = self._session_id(request)
        resp = await self._open_sse(request)
        s = self.channel.hub.stream(sid)
        last = request.headers.get("Last-Event-ID") or request.query.get("last_event_id") or ""
        # From here to subscribe nothing awaits: the opening events and the live ones join without a gap.
        parts = [b"retry: 2000\n\n"]
        replay = s.replay_since(last) if last else None
        if last and replay is None:
            parts.append(encode_event("resync_required", {"session_id": sid, "last_event_id": last}))
        if replay is None:
            parts.append(s.task_state())
        else:
            parts.extend(replay)
        sub = s.subscribe(self.max_pending)
        try:
            await self._pump(resp, sub, b"".join(parts))
        finally:
            s.unsubscribe(sub)
        return resp

    async def feed(self, request: web.Request) -> web.StreamResponse:
        resp = await self._open_sse(request)
        sub = self.channel.feed_subscribe()
        try:
            await self._pump(resp, sub, b"retry: 2000\n\n" + encode_event("ready", {}))
        finally:
            self.channel.feed_unsubscribe(sub)
        return resp

    async def close(self) -> None:
        self.channel.close_connections()
        for task in list(self.connections):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), 1)
