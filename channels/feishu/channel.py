"""FeishuChannel: the Feishu / Lark ``Channel`` (core.channel), working through its ``ChannelHost``.

Receiving, in one of two modes:

- **websocket** (the long connection): ``lark.ws.Client`` runs its own event loop and blocks in
  ``start()``, so it runs on a dedicated thread (``LongConnection``). Its handlers run on that thread, and
  Feishu takes the handler's return as the ack (no ack within 3 s, or an exception: the event is pushed
  again). So a message handler hands the event to the bridge's loop and waits until core has stored it
  (at most ``submit_wait`` seconds, a local SQLite write): an ack always means the message survives a
  crash. A message core could not store (shutting down, a failed write, too slow) makes the handler raise,
  and Feishu pushes it again. A card button press (``card.action.trigger``) arrives on the same connection and its
  answer (a toast, the decided card) rides on the ack: the handler waits for the bridge's answer at most
  ``press_wait`` seconds (a press still being carried out then is told it was received: it goes on).
- **webhook**: ``POST /feishu/events`` on the [web] server. The body is capped (``max_body_bytes``). With an
  ``encrypt_key``, a signed request (one carrying any of the ``X-Lark-*`` signature headers) must carry all
  three, a timestamp of digits at most five minutes off, and the signature of exactly those values: the bridge
  checks this itself (``signed``) before lark-oapi, which neither checks the age nor tells a missing header
  from an empty one, so the timestamp's digits moved to the front of the nonce signed the same and made an old
  request look unstamped. An unsigned request goes on to lark-oapi, which refuses every one but
  ``url_verification``. lark-oapi's dispatcher then decrypts the body, checks the verification token and
  ``X-Lark-Signature`` again, and answers ``url_verification`` (plain or encrypted). It is synchronous, so it
  runs in a worker thread. A request it refuses is answered 401 without reaching core. An accepted message is
  answered 200 only after core stored it (503 otherwise, and Feishu delivers it again).

Events the bridge does not handle (a message recalled or read, the bot added to a chat, …: subscribed to in
the developer console, or pushed to every app) are acknowledged and dropped, never refused: lark-oapi answers
an event without a handler with an error (HTTP 500, or a 500 ack over the long connection), which Feishu takes
for a failed delivery and pushes again for hours. The long connection registers a no-op for the IM events an
app commonly subscribes to (``IGNORED_EVENTS``); the webhook reads the event's type first and registers a no-op
for it, so any type is answered 200 (``{"msg": "ignored"}``) once lark-oapi's token and signature checks
passed. Each type is logged once, at INFO.

Several processes on one database need no leader here. Feishu's long connection works in cluster mode:
each process opens its own (an app may hold up to 50), and Feishu pushes every event to one of them at
random, never to all; a webhook request reaches whichever process the load balancer picks. A re-push (an
ack later than 3 s) may reach another process, and the dedupe below drops it there too.

Dedupe is durable and on two keys: the envelope's ``event_id`` is ``msg:<message_id>``, which core records
with the message (so a redelivered event, and the same message pushed again under a new event id as Feishu
documents, are answered once, also after a restart); a press's ``header.event_id`` goes through
``host.mark_seen``, so a press pushed again is carried out once, and answered with the card as its request
ended (``_press``).

Then: our own messages are ignored, ``allow_from`` (open_id, user_id or union_id) and ``group_policy``
(``mention``: a group message only when the bot is @mentioned) apply before anything reaches core. A message
of a kind the bridge cannot read (a forwarded conversation, a shared chat or contact, a card, a vote, …:
``channels.feishu.inbound``) reaches no model: in a private chat, or @mentioning the bot in a group, its sender
is told (``UNREADABLE``, a reply to it), and the message is acknowledged only once the reply was sent, as a
message is once stored: a reply that could not be sent (Feishu down past the call policy's tries, or still
being sent after ``submit_wait``) leaves the message unacknowledged (no ack over the long connection, 503 over
the webhook), and Feishu pushes it again, which tries again. The reply's ``uuid`` derives from the message, so
within Feishu's hour a repeat posts nothing new; the message id is marked seen (``host.mark_seen``) once the
reply was sent, and a push of a message older than that hour is told only if it was never marked (its
message id is then marked first, as no uuid covers it any more). Anywhere else it is ignored.
Commands (``/stop``, ``/new``, ``/help``, ``/compact``) are message text, with or without the @mention
(the bot's mention is removed from the text).

Approvals: each request is a card of its own with Allow / Deny buttons (``channels.feishu.sink``); a press
is decided by core's rule through ``host.decide`` and answered with a toast and the decided card. Requests
still open are kept in the channel's durable state, so the next start marks the cards a crash left behind
(with several processes: the cards of a process that died, marked by one live process). Feishu hands a
press to whichever process's connection it picks, not necessarily the one that posted the card: that one
finds the request by its ref in the posting process's record and decides through ``host.decide``, which
forwards the decision to the process holding the approval and waits at most 2 s for its answer (inside
``press_wait`` and Feishu's 3 s); the press is answered with a toast, and the posting process's sink
replaces the card once, as for an approval that ended without a press there.

Attachments (images, files, voice, video, the images of a post) travel as ``MediaItem``s; core downloads
them during the turn through ``fetch_attachment`` (``core.media.fetch.AttachmentSource``), which streams
Feishu's message-resource API (``FeishuApi.open_resource``). Both receiving modes hand the same envelope
to core, so both get them. Meanwhile the user's message shows the working reaction (``working``,
``core.channel.ShowsWorking``), which the turn's sink takes over.

Sending: every call is one attempt through ``FeishuApi`` under the shared call policy: a chat's scope
paces it (``stream_interval_ms``), a send also takes a slot of the app's budget (``app_sends_per_second``), a
99991400/230020 pauses that chat (a send's 99991400: every chat's sends) and the call is made again after
the pause, 5xx and timeouts are retried, any other error is a failure of that call. The tenant token is
fetched asynchronously and never blocks the loop (``channels.feishu.api``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import hmac
import json
import logging
import re
import secrets
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import lark_oapi as lark
from aiohttp import web
from lark_oapi.core.const import LARK_REQUEST_NONCE, LARK_REQUEST_SIGNATURE, LARK_REQUEST_TIMESTAMP
from lark_oapi.core.utils import AESCipher
from lark_oapi.event.callback.model.p2_card_action_trigger import P2CardActionTrigger, P2CardActionTriggerResponse
from lark_oapi.ws import client as ws_client_module

from channels.common.calls import Calls
from channels.common.errors import ChannelStartupError, PlatformError
from channels.common.live_sink import LiveSettings
from channels.common.open_approvals import RESTARTED, OpenApprovals, Record
from channels.common.throttle import Scope, Throttle
from channels.common.working_sign import WorkingSigns
from channels.feishu import approvals, render
from channels.feishu.api import FeishuApi
from channels.feishu.context import FeishuContext
from channels.feishu.inbound import CHANNEL, FeishuMessage, Sender, read_message
from channels.feishu.settings import WEBHOOK_PATH, FeishuConfig
from channels.feishu.sink import (
    Destination,
    FeishuOps,
    FeishuPrompts,
    FeishuRenderer,
    FeishuSink,
    PendingApproval,
    PendingApprovals,
)
from core.channel import ERROR, SinkError
from core.envelope import InboundEnvelope, MediaItem, TurnTarget
from core.host import AdmissionError, ChannelHost, Decider, DecideResult, ShuttingDownError
from core.media.fetch import FetchError

log = logging.getLogger(__name__)

_OPERATOR = FeishuConfig()
TRY_AGAIN = "Please try again in a moment."
UNREADABLE = "I can't read this kind of message ({kind}) yet; please send it as text."
"""The answer to a message of a kind the bridge cannot read (``{kind}``: Feishu's message type)."""
_MESSAGE_TYPE = re.compile(r"^[a-z][a-z0-9_]{0,39}$")
FRESHNESS = 300.0
"""Seconds a signed webhook request may be old (or early)."""
_STAMP = re.compile(r"[0-9]{1,12}")
"""A webhook request's timestamp: seconds, digits only (nothing a shifted nonce could lend it)."""
_EVENT_TYPE = re.compile(r"^[a-z][a-z0-9_.]{0,79}$")
HANDLED_EVENTS = frozenset({"im.message.receive_v1", "card.action.trigger"})
IGNORED_EVENTS = (
    "im.message.recalled_v1", "im.message.message_read_v1", "im.message.reaction.created_v1",
    "im.message.reaction.deleted_v1", "im.chat.member.bot.added_v1", "im.chat.member.bot.deleted_v1",
    "im.chat.member.user.added_v1", "im.chat.member.user.deleted_v1", "im.chat.member.user.withdrawn_v1",
    "im.chat.updated_v1", "im.chat.disbanded_v1", "im.chat.access_event.bot_p2p_chat_entered_v1",
)
"""Events an app commonly subscribes to that the bridge does not handle: the long connection acknowledges
and drops them (lark-oapi would answer 500, and Feishu push them again)."""
WORKING_SIGN_DELAY = 0.25
"""Seconds a turn's card (its working sign) waits before it opens, unless text comes first: lark-oapi builds a
new HTTP client (a TLS context with the CA bundle) for every request, 30-50 ms of CPU in the event loop, which
the model's request would otherwise wait behind. A quarter of a second later is not a wait anyone sees."""
APP_SENDS_PER_SECOND = 39.0
"""Messages the app sends (creates or replies) a second over all chats. Feishu allows 50, counted over any
second in which they arrive. After the bridge's event loop was held up, the throttle lets the sends whose slots
passed meanwhile leave together, up to ``catch_up`` (a quarter of a second) of them and the one due, so one
second may see the pace times 1.25, plus one: 39 keeps that within 50 (``tests/test_feishu_send_pacing.py``).
Paced at 50, and at 45, a thousand chats starting at once drew tens of 429s (``tests.bench.e2e``)."""
WORKING_HANDOVER = 5.0
"""Seconds the working reaction shown while a message's files downloaded waits for its turn's sink to take it
over (the message is stored first, and refused files are reported) before it is removed: a turn that ended there
(the session moved, the bridge is stopping) leaves none behind."""
UUID_REMEMBERED = 50 * 60
"""Seconds within which a message's uuid certainly still finds it (Feishu remembers one for an hour)."""
CHAT_BURST = 2
"""Calls a chat takes at once: its pace (``stream_interval_ms``) is the bridge's own, under what Feishu allows a
chat (5 sends a second, more updates to a card); the end of a turn uses one call of it (``throttle.ending``), so
the whole reply shows without waiting for the next slot."""


@dataclass(frozen=True, slots=True)
class FeishuSettings:
    """What the channel runs with: the operator's ``[channels.feishu]`` and pacing that is not an operator key."""

    app_id: str = ""
    app_secret: str = field(default="", repr=False)
    domain: str = _OPERATOR.base_url()
    mode: Literal["websocket", "webhook"] = _OPERATOR.mode
    verification_token: str = field(default="", repr=False)
    encrypt_key: str = field(default="", repr=False)
    allow_from: tuple[str, ...] = tuple(_OPERATOR.allow_from)
    group_policy: str = _OPERATOR.group_policy
    stream_interval: float = _OPERATOR.stream_interval_ms / 1000
    max_body_bytes: int = _OPERATOR.max_body_bytes
    first_chars: int = 24
    first_delay: float = 1.0
    press_wait: float = 2.5
    """Seconds a card press waits for the bridge's answer (Feishu allows 3)."""
    submit_wait: float = 2.5
    """Seconds a pushed message waits for core to store it before the ack (Feishu allows 3)."""
    setup_backoff: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)
    request_timeout: float = 30.0
    app_sends_per_second: float = APP_SENDS_PER_SECOND
    connection_domain: str = ""
    """Where the long connection asks for its address; ``domain`` unless set (tests run it apart)."""
    reconnect_timeout: float = 600.0
    """Seconds the long connection may stay down (reconnecting, or its client ended) before a new client is
    opened in its place: lark-oapi's own retries come every two minutes or so, and stop for good after an
    answer it takes for a client error."""
    watch_interval: float = 5.0
    """Seconds between two looks at the long connection."""

    @classmethod
    def of(cls, config: FeishuConfig) -> FeishuSettings:
        return cls(app_id=config.app_id, app_secret=config.app_secret, domain=config.base_url(), mode=config.mode,
                   verification_token=config.verification_token, encrypt_key=config.encrypt_key,
                   allow_from=tuple(config.allow_from), group_policy=config.group_policy,
                   stream_interval=config.stream_interval_ms / 1000, max_body_bytes=config.max_body_bytes)


class NotTold(Exception):
    """The sender of a message the bridge cannot read was not told (yet): the message is left unacknowledged,
    and Feishu pushes it again."""


def signed(headers: Any, body: bytes, encrypt_key: str, now: float) -> bool:
    """A webhook request's ``X-Lark-*`` headers are all there, its timestamp is digits within ``FRESHNESS`` of
    ``now``, and its signature is sha256(timestamp + nonce + encrypt_key + body) of exactly those values."""
    stamp = headers.get(LARK_REQUEST_TIMESTAMP)
    nonce = headers.get(LARK_REQUEST_NONCE)
    signature = headers.get(LARK_REQUEST_SIGNATURE)
    if stamp is None or nonce is None or signature is None or not (nonce.isascii() and signature.isascii()):
        return False
    if not _STAMP.fullmatch(stamp) or abs(now - int(stamp)) > FRESHNESS:
        return False
    expected = hashlib.sha256((stamp + nonce + encrypt_key).encode("utf-8") + body).hexdigest()
    return hmac.compare_digest(expected.encode("ascii"), signature.encode("ascii"))


class AllowList:
    """``allow_from``: ``"*"`` is everyone; otherwise a sender is allowed when any of their ids is listed."""

    def __init__(self, entries: tuple[str, ...]) -> None:
        self.everyone = "*" in entries
        self.ids = frozenset(entries)

    def allows(self, sender: Sender) -> bool:
        return self.everyone or any(i in self.ids for i in sender.ids())


class LongConnection:
    """``lark.ws.Client`` on a thread of its own.

    lark-oapi runs every ws client on one event loop it captured when ``lark_oapi`` was first imported (the
    public module attribute ``lark_oapi.ws.client.loop``); ``start()`` blocks on it forever and there is no
    ``stop()``. So the client runs on a dedicated thread, and stopping cancels every task on that loop from
    outside; ``start()`` then ends with CancelledError and the thread drains the cancelled tasks, so nothing
    of this client resumes under a later one. This needs ``lark_oapi`` imported while no loop was running
    (the bridge imports this module before it starts its loop).

    The client is built on that thread too (``make_client``), with the SDK's loop as the thread's loop: its
    constructor starts a task that clears the cache of split frames on whatever loop is current, which on the
    bridge's loop would edit that cache from the bridge's thread while the SDK's thread uses it (and stay behind
    there once the client stopped).
    """

    def __init__(self, make_client: Callable[[], Any]) -> None:
        self._make_client = make_client
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    @staticmethod
    def sdk_loop() -> asyncio.AbstractEventLoop:
        return ws_client_module.loop  # type: ignore[no-any-return]

    def start(self) -> None:
        loop = self.sdk_loop()
        if loop.is_running():
            raise ChannelStartupError(
                "[channels.feishu] the long connection cannot start: another Feishu long connection runs in this "
                "process, or lark-oapi was first imported inside a running event loop")

        def run() -> None:
            try:
                asyncio.set_event_loop(loop)
                self._make_client().start()
            except asyncio.CancelledError:
                pass  # stopped
            except BaseException as exc:  # reported through state()
                self.error = exc
                log.error("the Feishu long connection ended: %s", type(exc).__name__)
            finally:
                pending = asyncio.all_tasks(loop)
                if pending:
                    loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))

        self._thread = threading.Thread(target=run, name="feishu-long-connection", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        thread, self._thread = self._thread, None
        if thread is None:
            return
        loop = self.sdk_loop()

        async def cancel_all() -> None:
            me = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not me:
                    task.cancel()

        if loop.is_running():
            asyncio.run_coroutine_threadsafe(cancel_all(), loop)
        thread.join(timeout)
        if thread.is_alive():
            log.warning("the Feishu long connection did not stop within %.0fs", timeout)


class FeishuChannel:
    name = CHANNEL

    def __init__(self, host: ChannelHost, settings: FeishuSettings, *, calls: Calls | None = None,
                 api: FeishuApi | None = None) -> None:
        self.host = host
        self.settings = settings
        self.calls = calls or Calls(Throttle())
        if self.calls.observe is None:
            self.calls.observe = host.count_call  # every Open API attempt shows in /metrics
        self.api = api or FeishuApi(settings.app_id, settings.app_secret, settings.domain,
                                    timeout=settings.request_timeout)
        self.stream_interval = settings.stream_interval
        self.renderer = FeishuRenderer()
        self.live = LiveSettings(first_chars=settings.first_chars, first_delay=settings.first_delay)
        self.allow = AllowList(settings.allow_from)
        self.pending_approvals = PendingApprovals()
        self.cardkit_refused = False
        """Set when CardKit refused a card for good: replies then stream by patching card messages."""
        self.bot_open_id: str | None = None
        self.ready = asyncio.Event()
        self.connection: LongConnection | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._receiving = False
        self._state = "stopped"
        self._setup: asyncio.Task[None] | None = None
        self._watch: asyncio.Task[None] | None = None
        self._open = OpenApprovals(host, self._open_records)
        self._downloads: aiohttp.ClientSession | None = None
        self._signs: WorkingSigns[FeishuOps] = WorkingSigns(host.spawn, lambda: WORKING_HANDOVER)
        """Working reactions shown while a message's files downloaded, by message, until a sink takes one."""
        self._pressing: set[str] = set()
        """The event ids of the presses being carried out here (a push of one again is answered ``RECEIVED``)."""
        self._telling: dict[str, asyncio.Task[bool]] = {}
        """The replies to unreadable messages being sent, by message id (a push of one again waits for it)."""
        self._ignored: set[str] = set()
        """The event types acknowledged and dropped so far (each is logged once)."""
        host.set_deciders(settings.allow_from)

    # ---- lifecycle -----------------------------------------------------------------------------

    def state(self) -> str:
        if self._receiving and self.connection is not None and not self.connection.alive:
            return ERROR  # the long connection gave up (a refused app secret, too many connections)
        return self._state

    async def start(self) -> None:
        """Begin receiving. The set-up calls (tenant token, the bot's identity) are retried in the background
        while they fail, with /healthz at "error"; the long connection opens once they succeed."""
        if self.settings.mode == "websocket" and LongConnection.sdk_loop().is_running():
            raise ChannelStartupError(
                "[channels.feishu] the long connection cannot start: another Feishu long connection runs in this "
                "process, or lark-oapi was first imported inside a running event loop")
        self._loop = asyncio.get_running_loop()
        self._receiving = True
        self._state = "starting"
        self._setup = self.host.spawn("feishu:setup", self._set_up())

    async def _set_up(self) -> None:
        failures = 0
        while self._receiving:
            try:
                self.bot_open_id = await self.calls.call(self.api.bot_open_id)
                await self.close_left_over()
                break
            except PlatformError as exc:
                delays = self.settings.setup_backoff
                delay = exc.retry_after or delays[min(failures, len(delays) - 1)]
                failures += 1
                self._state = ERROR
                log.error("Feishu set-up failed (%s); retrying in %.0fs", exc, delay)
                await asyncio.sleep(delay)
        if not self._receiving:
            return
        if self.settings.mode == "websocket":
            if not self._open_connection():
                return
            self._watch = self.host.spawn("feishu:watch", self._watch_connection())
        else:
            self._state = "webhook"
        self.ready.set()

    async def _watch_connection(self) -> None:
        """Open a new long connection when the current one has been down ``reconnect_timeout`` seconds.

        lark-oapi's client reconnects by itself, but gives up for good inside its own task when the address
        request answers what it takes for a client error (a rotated secret, too many connections) or when
        the server's reconnect count runs out, while ``start()`` goes on blocking: nothing would receive again,
        and only ``on_reconnecting`` was ever heard of it. A new client then starts from the beginning; one
        that cannot connect at all ends its thread, which ``state()`` reports, and is replaced in turn."""
        assert self._loop is not None
        down_since: float | None = None
        while self._receiving:
            await asyncio.sleep(self.settings.watch_interval)
            if self.state() not in ("reconnecting", ERROR):
                down_since = None
                continue
            now = self._loop.time()
            if down_since is None:
                down_since = now
            if now - down_since < self.settings.reconnect_timeout:
                continue
            log.error("the Feishu long connection has been down for %.0fs; opening a new one", now - down_since)
            down_since = None
            old, self.connection = self.connection, None
            if old is not None:
                await asyncio.to_thread(old.stop)
            if not self._receiving:
                return
            self._open_connection()

    def _open_connection(self) -> bool:
        """Start a new long connection; False (the state "error") when it cannot start."""
        self._state = "connecting"
        self.connection = self._connect()
        try:
            self.connection.start()
        except ChannelStartupError as exc:
            self._state = ERROR
            log.error("%s", exc)
            return False
        self._state = "connected"
        return True

    def _connect(self) -> LongConnection:
        loop = self._loop
        assert loop is not None

        def state(word: str) -> None:
            loop.call_soon_threadsafe(self._set_state, word)

        def make_client() -> Any:  # on the connection's thread (see LongConnection)
            builder = (lark.EventDispatcherHandler.builder("", "")
                       .register_p2_im_message_receive_v1(self._on_ws_message)
                       .register_p2_card_action_trigger(self._on_card_press))
            for event_type in IGNORED_EVENTS:
                builder.register_p2_customized_event(event_type, lambda _e, t=event_type: self._ignore(t))
            dispatcher = builder.build()
            client = lark.ws.Client(self.settings.app_id, self.settings.app_secret, event_handler=dispatcher,
                                    domain=self.settings.connection_domain or self.settings.domain,
                                    log_level=lark.LogLevel.ERROR)
            client.on_reconnecting = lambda: state("reconnecting")
            client.on_reconnected = lambda: state("connected")
            return client

        return LongConnection(make_client)

    def _set_state(self, word: str) -> None:
        if self._receiving:
            self._state = word

    async def stop(self) -> None:
        self._receiving = False
        for task in (self._setup, self._watch):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        self._setup = self._watch = None
        connection, self.connection = self.connection, None
        if connection is not None:
            await asyncio.to_thread(connection.stop)
        self._state = "stopped"

    async def close(self) -> None:
        """The download session (lark-oapi opens an HTTP client per request: nothing else to release)."""
        session, self._downloads = self._downloads, None
        if session is not None and not session.closed:
            await session.close()

    # ---- attachments (core.media.fetch.AttachmentSource) ---------------------------------------------

    async def fetch_attachment(self, item: MediaItem, target: TurnTarget) -> AsyncGenerator[bytes, None]:
        """The bytes of a resource of the user's message: an image (``type=image``: an image message, or an
        image in a post) or a file, voice message or video (``type=file``). Opening the download goes
        through the call policy (a rate limit waits out its reset, a 5xx is tried again); the body is
        streamed, and core stops reading at ``[media] max_bytes``."""
        message_id = FeishuContext.of(target).message_id
        kind: Literal["image", "file"] = "image" if item.kind == "photo" else "file"
        if self._downloads is None or self._downloads.closed:
            self._downloads = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(sock_connect=30, sock_read=60), trust_env=False)
        session = self._downloads
        try:
            chunks, first = await self.calls.call(
                lambda: self.api.open_resource(session, message_id, item.file_id, kind))
        except PlatformError as exc:
            raise FetchError(str(exc)) from None
        async with contextlib.aclosing(chunks):
            if first:
                yield first
            async for chunk in chunks:
                yield chunk

    # ---- delivery ------------------------------------------------------------------------------

    async def open_sink(self, target: TurnTarget) -> FeishuSink:
        ops = FeishuOps(self, Destination.of(target))
        sign = self._signs.take(ops.dest.reply_to or "")
        if sign is not None:  # shown while the message's files downloaded: this turn's until its card shows
            ops.adopt(sign)
        sink = FeishuSink(ops, self.renderer, self.calls, settings=self.live,
                          prompts=FeishuPrompts(self, target, ops), spawn=self.host.spawn)
        # the working sign (the card): the turn does not wait for it, and it waits a moment for the model's
        # request to leave first, as lark-oapi builds each request's HTTP client in the event loop
        sink.start_typing(delay=WORKING_SIGN_DELAY)
        return sink

    @contextlib.asynccontextmanager
    async def working(self, target: TurnTarget) -> AsyncIterator[None]:
        """The working reaction on the user's message while its files download, before its turn's sink opens
        (``ShowsWorking``): at once, not waited for, and left out while every request slot is taken (the
        downloads need them). Not the card: a turn may still end before it has one, and a card cannot be taken
        back without a trace. After the block the turn's sink takes it over (``open_sink``) and removes it once
        its card shows; one no sink took within ``WORKING_HANDOVER`` seconds is removed then."""
        dest = Destination.of(target)
        if dest.reply_to is None:
            yield
            return
        ops = FeishuOps(self, dest)

        async def show() -> None:
            if not self.api.busy:
                await self.calls.call(ops.react, scopes=ops.scopes, paced=False, retry=False)

        async with self._signs.showing(dest.reply_to, ops, show=show, take_down=ops.drop_reaction,
                                       name=f"feishu:working:{dest.chat_id}"):
            yield

    def chat_scope(self, dest: Destination) -> Scope:
        """A chat's budget: one call per ``stream_interval``, the end of a turn one sooner."""
        return Scope(dest.key, self.stream_interval, CHAT_BURST)

    async def send_plain(self, target: TurnTarget, text: str) -> None:
        """One ordinary reply (as post messages, split under Feishu's 30 KB; plain text if refused). Each part
        is one call under the policy, with its own uuid, so a retried part never posts twice. A reply to a
        user's message derives the uuid from that message and the part, so the same text sent again as the reply
        to the same message (a later try of an undelivered answer, the next start's) is answered by Feishu with
        the message already posted, within the hour it keeps a uuid. When a part fails after the first were
        sent, the SinkError carries the parts not sent (``unsent``)."""
        dest = Destination.of(target)
        ops = FeishuOps(self, dest)
        scopes = (self.chat_scope(dest),)
        sources = render.post_sources(text) if text.strip() else []
        for i, source in enumerate(sources):
            key = (hashlib.sha256(f"{dest.reply_to}\n{i}\n{source}".encode()).hexdigest()[:32]
                   if dest.reply_to else secrets.token_hex(16))
            try:
                try:
                    await self._post(ops, scopes, render.post_content(source), key)
                except PlatformError as exc:
                    if exc.kind != "format":
                        raise
                    await self._post(ops, scopes, render.plain_post_content(source), key + "p")
            except PlatformError as exc:  # the messages before this one are shown: only the rest is missing
                raise SinkError(str(exc), unsent="\n".join(sources[i:]) if i else None,
                                outcome_unknown=exc.outcome_unknown) from None

    async def _post(self, ops: FeishuOps, scopes: tuple[Scope, ...], content: str, key: str) -> None:
        await self.calls.call(lambda: ops.post("post", content, key), scopes=scopes)

    # ---- receiving -----------------------------------------------------------------------------

    def _on_ws_message(self, data: Any) -> None:
        """On the long connection's thread: the return is the ack, so return only once core has stored the
        message (or dropped it as not for core). Raising leaves it unacknowledged: Feishu pushes it again."""
        payload = json.loads(lark.JSON.marshal(data))
        loop = self._loop
        if loop is None or loop.is_closed():
            raise RuntimeError("the bridge is not running")
        stored: concurrent.futures.Future[bool] = concurrent.futures.Future()
        loop.call_soon_threadsafe(self._take, payload, stored)
        try:
            stored.result(self.settings.submit_wait)
        except concurrent.futures.TimeoutError:
            raise RuntimeError("core did not store the message in time; Feishu will push it again") from None

    def _take(self, payload: dict[str, Any], stored: concurrent.futures.Future[bool]) -> None:
        try:
            self.host.spawn("feishu:event", self._accept_pushed(payload, stored))
        except ShuttingDownError as exc:
            stored.set_exception(exc)

    async def _accept_pushed(self, payload: dict[str, Any], stored: concurrent.futures.Future[bool]) -> None:
        """A message from the long connection: its handler waits on ``stored`` to acknowledge it."""
        try:
            taken = await self.accept(payload)
        except BaseException as exc:
            if not stored.done():
                stored.set_exception(exc)
            if isinstance(exc, (AdmissionError, ShuttingDownError, NotTold)):
                log.info("a Feishu message could not be %s (%s); Feishu will push it again",
                         "answered" if isinstance(exc, NotTold) else "stored", type(exc).__name__)
                return
            raise
        if not stored.done():
            stored.set_result(taken)

    async def accept(self, payload: dict[str, Any]) -> bool:
        """Hand one ``im.message.receive_v1`` body to core. False when it is not for core (ours, not allowed,
        not addressed, nothing to answer, or a kind it cannot read, whose sender was told); raises
        AdmissionError / ShuttingDownError when core did not store it, NotTold when the sender of a message it
        cannot read was not told within ``submit_wait``."""
        message = read_message(payload, self.bot_open_id)
        if message is None or not self.allow.allows(message.sender):
            return False
        if message.chat_type == "group":
            policy = self.settings.group_policy
            if policy == "off" or (policy == "mention" and not message.mentioned_bot):
                return False
        if not message.readable:
            # never in a group unless it is addressed to the bot (under "all" too: not a word per shared card)
            if message.chat_type == "p2p" or message.mentioned_bot:
                await self._tell_unreadable(message)
            return False
        if not message.text.strip() and not message.media:
            return False
        # attachments go as media items: core downloads them in the turn (fetch_attachment)
        envelope = InboundEnvelope(
            channel=CHANNEL, chat_id=message.chat_id, sender_id=message.sender.open_id, content=message.text,
            media=message.media, reply_to=message.reply_to, thread=message.thread,
            event_id=f"msg:{message.message_id}",
            channel_context=self._context(message).wrap())
        await self.host.submit(envelope)
        return True

    async def _tell_unreadable(self, message: FeishuMessage) -> None:
        """Tell the sender of a message the bridge cannot read; raises NotTold when that failed or is still
        under way after ``submit_wait`` (the reply goes on, in a task of its own: a push of the message again
        waits for that one instead of sending a second)."""
        task = self._telling.get(message.message_id)
        if task is None:
            task = self.host.spawn("feishu:unreadable", self._tell(message))
            self._telling[message.message_id] = task

            def forget(done: asyncio.Task[bool], key: str = message.message_id) -> None:
                if self._telling.get(key) is done:
                    del self._telling[key]

            task.add_done_callback(forget)
        try:
            told = await asyncio.wait_for(asyncio.shield(task), self.settings.submit_wait)
        except TimeoutError:
            raise NotTold("the reply is still being sent") from None
        if not told:
            raise NotTold("the reply could not be sent")

    async def _tell(self, message: FeishuMessage) -> bool:
        """Reply ``UNREADABLE`` to ``message``; False when the reply could not be sent (and the next push of the
        message tries again). Within Feishu's hour the reply's uuid (derived from the message: ``send_plain``)
        makes a repeat post nothing, so the message is marked seen only once the reply was sent; a message
        older than that is told only when it was never marked, and marked first (nothing else would keep a
        second push from posting a second reply)."""
        key = f"unreadable:{message.message_id}"
        created = message.create_time_ms
        recent = created is None or time.time() - created / 1000 < UUID_REMEMBERED
        if not recent and not await self.host.mark_seen(key):
            return True  # told before
        kind = message.message_type if _MESSAGE_TYPE.match(message.message_type) else "unknown"
        log.info("a Feishu message of a kind the bridge cannot read (%s) in %s: its sender is told", kind,
                 message.chat_id)
        try:
            await self.send_plain(self._target_of(message), UNREADABLE.format(kind=kind))
        except SinkError as exc:
            log.warning("could not tell the sender of a %s message in %s that it cannot be read: %s", kind,
                        message.chat_id, exc)
            return not recent  # an old one is marked already: a push of it again would find it told
        if recent:
            await self.host.mark_seen(key)
        return True

    def _ignore(self, event_type: str) -> None:
        """An event the bridge does not handle, once lark-oapi checked it: acknowledged and dropped (on the SDK's
        thread or a webhook worker; the set is only added to)."""
        name = event_type if _EVENT_TYPE.match(event_type) else "unknown"
        if name in self._ignored:
            log.debug("a Feishu %s event, which the bridge does not handle, was ignored", name)
            return
        if len(self._ignored) < 256:
            self._ignored.add(name)
        log.info("Feishu pushes %s events, which the bridge does not handle: they are acknowledged and ignored "
                 "(unsubscribe from them in the developer console to stop them)", name)

    @staticmethod
    def _context(message: FeishuMessage) -> FeishuContext:
        return FeishuContext(chat_type=message.chat_type, message_id=message.message_id, thread_id=message.thread_id)

    def _target_of(self, message: FeishuMessage) -> TurnTarget:
        return TurnTarget(channel=CHANNEL, chat_id=message.chat_id, session_key=message.session_key(),
                          sender_id=message.sender.open_id,
                          channel_context=self._context(message).wrap())

    # ---- approvals -----------------------------------------------------------------------------

    def _on_card_press(self, data: P2CardActionTrigger) -> P2CardActionTriggerResponse:
        """On the SDK's thread (the long connection's, or a webhook worker): the answer is the ack's body, so
        wait for the bridge's decision, but never past Feishu's limit. An answer that comes later is not lost:
        the press goes on, and a card it would have carried is patched onto the message (``press``). So a press
        still being carried out then is answered ``RECEIVED``, not "try again": it counts (a second press would
        find the request decided). "Try again" is only for a press the bridge never took (its loop is gone)."""
        payload = json.loads(lark.JSON.marshal(data))
        loop = self._loop
        if loop is None or loop.is_closed():
            return P2CardActionTriggerResponse(approvals.toast("error", TRY_AGAIN))
        handoff = _Handoff()
        try:
            asyncio.run_coroutine_threadsafe(self.press(payload, handoff.give), loop)
        except RuntimeError:  # the loop closed meanwhile
            return P2CardActionTriggerResponse(approvals.toast("error", TRY_AGAIN))
        answer = handoff.take(self.settings.press_wait)
        if answer is None:
            log.warning("a Feishu card press was not answered within %.1fs: it goes on, and its card is patched "
                        "once it is decided", self.settings.press_wait)
            answer = approvals.toast("info", approvals.RECEIVED)
        return P2CardActionTriggerResponse(answer)

    async def press(self, payload: dict[str, Any],
                    hand_back: Callable[[dict[str, Any]], bool] | None = None) -> dict[str, Any]:
        """A ``card.action.trigger`` body → the callback's answer (a toast, and the decided card). ``hand_back``
        gives the answer to whoever waits for it, and says whether it was still waited for: a card the answer
        carried too late (or that no answer carried: ``hand_back`` False) is patched onto the message instead."""
        try:
            answer, entry = await self._press(payload)
        except Exception:
            log.exception("a Feishu card press could not be answered")
            answer, entry = approvals.toast("error", TRY_AGAIN), None
        in_time = hand_back(answer) if hand_back is not None else True
        if not in_time and entry is None and answer.get("toast", {}).get("type") in ("error", "warning"):
            # the user was told "received", and nothing will change on the card
            log.warning("a Feishu card press answered late came to nothing: %s", answer["toast"].get("content"))
        if entry is not None:
            await self._card_answered(entry, answer, in_time)
        return answer

    async def _press(self, payload: dict[str, Any]) -> tuple[dict[str, Any], PendingApproval | None]:
        """The answer to a press, and the request whose card the answer carries (None when it carries none).

        Feishu pushes a press again under the same event id when its answer did not reach it (late, or lost on
        the way). Pushed while it is still being carried out here, it is answered ``RECEIVED`` (the first one
        patches the card once decided). Pushed after it was carried out, its answer may have been lost with the
        card it carried, while this side believes the card shows it: so it is answered with the card as the
        request ended (the toast names the outcome when it was this press's), not with a bare toast that would
        leave the buttons live. A request still pending (the first try was refused, or failed) is decided as
        any press."""
        action = approvals.parse_card_action(payload)
        if action is None or action.approval is None:
            return {}, None
        if action.event_id is None:
            return await self._decide_press(action, repeated=False)
        if action.event_id in self._pressing:
            return approvals.toast("info", approvals.RECEIVED), None
        self._pressing.add(action.event_id)
        try:
            repeated = not await self.host.mark_seen(f"press:{action.event_id}")
            return await self._decide_press(action, repeated=repeated)
        finally:
            self._pressing.discard(action.event_id)

    async def _decide_press(self, action: approvals.CardAction,
                            repeated: bool) -> tuple[dict[str, Any], PendingApproval | None]:
        assert action.approval is not None
        decision = action.approval.decision
        who = action.operator
        decider = Decider(who.open_id, tuple(n for n in (who.user_id, who.union_id) if n), who.user_id or who.open_id)
        entry = self.pending_approvals.get(action.approval.ref)
        if repeated and entry is not None and entry.outcome is not None:
            return self._ended(entry, action), entry
        if entry is None:
            elsewhere = await self._find(action.approval.ref)
            if elsewhere is None or action.message_id not in (None, elsewhere.message_id):  # not that card's
                return approvals.toast("info", approvals.GONE), None
            if repeated and elsewhere.outcome is not None:
                return self._ended(elsewhere, action), elsewhere
            # posted by another process: decided where it is pending; that process's sink shows the outcome
            result = await self.host.decide(elsewhere.session_key, elsewhere.call_id, decision,
                                            decider, origin=elsewhere.origin)
            if result is DecideResult.REFUSED:
                return approvals.toast("warning", approvals.NOT_YOURS), None
            if result is DecideResult.NOT_PENDING:
                return self._gone(elsewhere), elsewhere
            return approvals.toast("success" if decision == "allow" else "info",
                                   approvals.ALLOWED if decision == "allow" else approvals.DENIED), None
        result = await self.host.decide(entry.session_key, entry.call_id, decision, decider,
                                        origin=entry.origin)
        if result is DecideResult.REFUSED:
            return approvals.toast("warning", approvals.NOT_YOURS), None
        if result is DecideResult.NOT_PENDING:
            return self._gone(entry), entry
        line = approvals.outcome_line(decision, who.user_id or who.open_id)
        entry.outcome = line
        entry.answering = True  # the card travels in the answer (``_card_answered``)
        card = approvals.decided_card(entry.ref, entry.tool_name, entry.arguments, entry.requested_by, line)
        kind: approvals.ToastKind = "success" if decision == "allow" else "info"
        return approvals.toast_with_card(kind, approvals.ALLOWED if decision == "allow" else approvals.DENIED,
                                         card), entry

    @classmethod
    def _ended(cls, entry: PendingApproval, action: approvals.CardAction) -> dict[str, Any]:
        """The answer to a press pushed again after it was carried out: its card as the request ended, with the
        toast the first answer had when this press decided it ("no longer pending" otherwise)."""
        assert action.approval is not None
        decision = action.approval.decision
        if entry.outcome != approvals.outcome_line(decision, action.operator.user_id or action.operator.open_id):
            return cls._gone(entry)
        card = approvals.decided_card(entry.ref, entry.tool_name, entry.arguments, entry.requested_by, entry.outcome)
        return approvals.toast_with_card("success" if decision == "allow" else "info",
                                         approvals.ALLOWED if decision == "allow" else approvals.DENIED, card)

    @staticmethod
    def _gone(entry: PendingApproval) -> dict[str, Any]:
        """A press on a request that is over: "no longer pending", and its card as it ended (the card pressed
        still showed buttons: an update that failed, or a press answered too late, left them)."""
        card = approvals.decided_card(entry.ref, entry.tool_name, entry.arguments, entry.requested_by,
                                      entry.outcome or approvals.ENDED)
        return approvals.toast_with_card("info", approvals.GONE, card)

    async def _card_answered(self, entry: PendingApproval, answer: dict[str, Any], in_time: bool) -> None:
        """The press's answer carried ``entry``'s card: shown, when it was handed back in time; patched onto the
        message otherwise. A request of this process's is forgotten once its card shows how it ended."""
        ours = self.pending_approvals.get(entry.ref) is entry
        shown = in_time
        card = (answer.get("card") or {}).get("data")
        if not in_time and isinstance(card, dict) and entry.message_id is not None:
            shown = await self._patch_card(entry.message_id, card, "show a press's outcome on its approval card")
        if not ours:
            return
        entry.answering = False
        if entry.outcome is not None:  # (a card answering a press on a request still ending says "ended")
            entry.shown = entry.shown or shown
        await self.save_open_approvals()

    async def _patch_card(self, message_id: str, card: dict[str, Any], what: str) -> bool:
        """Replace a card message; True once it shows ``card``, or no try could ever change it (the message is
        gone), False when a later try may (a 5xx, a timeout, a rate limit)."""
        try:
            await self.calls.call(lambda: self.api.patch_card(message_id, card))
        except PlatformError as exc:
            if exc.transient:
                log.warning("could not %s (%s): tried again later", what, exc)
                return False
            log.warning("could not %s: %s", what, exc)
        return True

    async def show_outcome(self, entry: PendingApproval, line: str) -> None:
        """An approval that ended without a press here (timed out, /stop, decided elsewhere), or whose press's
        outcome its card does not show yet: its card shows how, without buttons. Until a patch goes through the
        request stays in the open-requests record: a press on its card shows it, or the next start does."""
        if entry.message_id is None:
            return
        card = approvals.decided_card(entry.ref, entry.tool_name, entry.arguments, entry.requested_by, line)
        if await self._patch_card(entry.message_id, card, "mark an approval card as ended"):
            entry.shown = True
        await self.save_open_approvals()

    # Approvals do not outlive the process, but their cards would: ``channels.common.open_approvals``.

    async def save_open_approvals(self) -> None:
        await self._open.save()

    def _open_records(self) -> list[Record]:
        """What a restart needs to close a request, and a press in another process to decide it."""
        records = []
        for e in self.pending_approvals.open():
            record: Record = {"ref": e.ref, "session": e.session_key, "call": e.call_id, "tool": e.tool_name,
                              "arguments": e.arguments, "requested_by": e.requested_by}
            if e.origin:
                record["origin"] = list(e.origin)
            if e.outcome is not None:  # ended, its card not showing it yet: the next start shows how
                record["outcome"] = e.outcome
            if e.message_id is not None:  # shown: a restart can close it
                record["message_id"] = e.message_id
            elif e.dest is not None:  # being posted: a restart finds the card by the post's uuid
                record.update(key=e.key, chat=e.dest.chat_id, reply_to=e.dest.reply_to, at=round(e.asked_at))
            records.append(record)
        return records

    async def _find(self, ref: str) -> PendingApproval | None:
        """A request another process posted, from its record (None: unknown, or not shown yet)."""
        item = await self._open.find(lambda r: r.get("ref") == ref)
        if item is None or item.get("message_id") is None:
            return None
        try:
            origin = tuple(str(o) for o in item.get("origin") or ())
            outcome = item.get("outcome")
            return PendingApproval(ref, str(item["session"]), str(item["call"]), str(item["tool"]),
                                   str(item.get("arguments") or ""), item.get("requested_by"),
                                   message_id=str(item["message_id"]), origin=origin,
                                   outcome=None if outcome is None else str(outcome))
        except (KeyError, TypeError, ValueError):
            return None

    async def close_left_over(self) -> None:
        """Start-up: every approval card a previous process left with live buttons says the restart denied it
        (or how it ended, when it ended before its card could show it)."""
        await self._open.close_left_over(self._close)

    async def _close(self, item: Record) -> bool:
        outcome = item.get("outcome")
        card = approvals.decided_card(str(item["ref"]), str(item["tool"]), str(item["arguments"]),
                                      item.get("requested_by"), RESTARTED if outcome is None else str(outcome))
        if "message_id" in item:
            message_id: str | None = str(item["message_id"])
        else:
            try:
                message_id = await self._unsaved_card(item, card)
            except PlatformError as exc:
                log.warning("could not close an approval card left by the last run: %s", exc)
                return not exc.transient
        if message_id is None:
            return True
        return await self._patch_card(message_id, card, "close an approval card left by the last run")

    async def _unsaved_card(self, item: Record, card: dict[str, Any]) -> str | None:
        """The card of a request the last run was posting when it stopped (the post may have reached Feishu
        without its message id being saved). Sent again with the same uuid: Feishu answers a uuid it saw
        within the hour with that first message and posts nothing; if the first post never arrived, this
        posts the closed card itself, so the request is shown ended either way. Past the hour the uuid is
        forgotten and a second card could appear: such a record is dropped."""
        if time.time() - float(item["at"]) > UUID_REMEMBERED:
            log.warning("an approval card of the last run, posted over an hour ago, could not be found to close")
            return None
        ops = FeishuOps(self, Destination(str(item["chat"]), item.get("reply_to")))
        content = json.dumps(card, ensure_ascii=False)
        key = str(item["key"])
        return await self.calls.call(lambda: ops.post("interactive", content, key), scopes=ops.scopes,
                                     idempotent=True)

    # ---- webhook -------------------------------------------------------------------------------

    async def webhook(self, request: web.Request) -> web.Response:
        if not self._receiving:
            return web.json_response({"msg": "not ready"}, status=503)  # Feishu delivers it again
        cap = self.settings.max_body_bytes
        if (request.content_length or 0) > cap:
            return web.json_response({"msg": "too large"}, status=413)
        body = await request.content.read(cap + 1)
        if len(body) > cap:
            return web.json_response({"msg": "too large"}, status=413)
        key = self.settings.encrypt_key
        headers = request.headers
        if key:
            if any(h in headers for h in (LARK_REQUEST_TIMESTAMP, LARK_REQUEST_NONCE, LARK_REQUEST_SIGNATURE)) \
                    and not signed(headers, body, key, time.time()):
                return web.json_response({"msg": "rejected"}, status=401)
        elif (stamp := headers.get(LARK_REQUEST_TIMESTAMP)) is not None:
            try:
                fresh = abs(time.time() - float(stamp)) <= FRESHNESS
            except ValueError:
                fresh = False
            if not fresh:
                return web.json_response({"msg": "rejected"}, status=401)
        messages: list[dict[str, Any]] = []
        ignored: list[str] = []

        def on_message(data: Any) -> None:
            messages.append(json.loads(lark.JSON.marshal(data)))

        builder = (lark.EventDispatcherHandler.builder(key, self.settings.verification_token)
                   .register_p2_im_message_receive_v1(on_message)
                   .register_p2_card_action_trigger(self._on_card_press))
        kind = event_type(body, key)
        if kind is not None and kind[1] not in HANDLED_EVENTS:
            # lark-oapi answers an event without a handler 500, and Feishu would push it again for hours: a no-op
            # for its type, which runs only once lark-oapi's checks passed
            def ignore(_event: Any, name: str = kind[1]) -> None:
                ignored.append(name)
                self._ignore(name)

            register = builder.register_p2_customized_event if kind[0] == "p2" else builder.register_p1_customized_event
            register(kind[1], ignore)
        dispatcher = builder.build()
        raw = lark.RawRequest()
        raw.uri = request.path
        raw.headers = dict(request.headers)
        for name in (LARK_REQUEST_TIMESTAMP, LARK_REQUEST_NONCE, LARK_REQUEST_SIGNATURE):
            raw.headers[name] = request.headers.get(name, "")
        raw.body = body
        answer = await asyncio.to_thread(dispatcher.do, raw)
        if answer.status_code != 200:
            # a wrong token or signature, a body that does not decrypt: never echo lark-oapi's message (it can
            # quote the request)
            return web.json_response({"msg": "rejected"}, status=401)
        if ignored:
            return web.json_response({"msg": "ignored"})
        if messages and not self.ready.is_set():
            # the bot's own identity is not known yet (set-up still retrying): it could not tell a mention
            return web.json_response({"msg": "not ready"}, status=503)
        for payload in messages:
            try:
                await self.accept(payload)  # returns once core has stored it
            except (AdmissionError, ShuttingDownError, NotTold):
                return web.json_response({"msg": "busy"}, status=503)
        return web.Response(status=200, body=answer.content or b"{}", content_type="application/json")

    def routes(self, app: web.Application) -> None:
        app.router.add_post(WEBHOOK_PATH, self.webhook)


def event_type(body: bytes, encrypt_key: str) -> tuple[Literal["p1", "p2"], str] | None:
    """The schema and type of a webhook body, read before lark-oapi checks it (None when it cannot be read: lark-oapi
    then refuses it). Only to register a no-op for a type the bridge does not handle; nothing else trusts it."""
    try:
        outer = json.loads(body)
        encrypted = outer.get("encrypt")
        if encrypted:
            if not encrypt_key:
                return None
            outer = json.loads(AESCipher(encrypt_key).decrypt_str(encrypted))
        if outer.get("schema"):
            name = outer["header"]["event_type"]
            schema: Literal["p1", "p2"] = "p2"
        elif outer.get("uuid"):
            name = outer["event"]["type"]
            schema = "p1"
        else:
            return None
    except Exception:  # any body that does not decrypt or parse (lark-oapi refuses it)
        return None
    return (schema, name) if isinstance(name, str) and name else None


class _Handoff:
    """A press's answer, from the bridge's loop to the SDK thread waiting for it (``_on_card_press``): the
    answer is either taken in time, or the thread gave up first and the press knows it (``give`` False)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._answer: dict[str, Any] | None = None
        self._late = False

    def give(self, answer: dict[str, Any]) -> bool:
        """On the loop: hand ``answer`` back; False when the thread no longer waits for it."""
        with self._lock:
            if self._late:
                return False
            self._answer = answer
            self._ready.set()
            return True

    def take(self, timeout: float) -> dict[str, Any] | None:
        """On the SDK's thread: the answer, or None (and it is late from now on) when none came in time."""
        self._ready.wait(timeout)
        with self._lock:
            if self._answer is None:
                self._late = True
            return self._answer
