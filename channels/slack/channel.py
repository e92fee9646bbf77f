"""SlackChannel: the Slack ``Channel`` (core.channel), working through its ``ChannelHost``.

Receiving goes through slack-bolt's ``AsyncApp`` with our own ``AsyncWebClient`` (``base_url = api_base``,
``retry_handlers=[]``: see ``channels.slack.client``), in one of two modes:

- Socket Mode: the SDK's async Socket Mode handler (``app_token``), which reconnects by itself; we only
  bound the first connection and watch ``is_connected`` for ``/healthz``;
- HTTP: ``POST /slack/events`` on the [web] server through bolt's aiohttp adapter, for events, interactivity
  (button presses) and slash commands alike. The SDK checks the signature and the 5-minute timestamp window
  (401 otherwise) and answers ``url_verification``.

Acknowledging: the app runs with ``process_before_response=True``, so an event is acknowledged (the Socket
Mode envelope ack, the HTTP 200) only after its listener returned, and the listener returns once core has
stored the message (``host.submit``, a local SQLite write, bounded well inside Slack's 3 seconds). The
turn itself runs afterwards. A message core could not store (shutting down, a failed write) makes the
listener fail, which answers 500 / leaves the envelope unacked, so Slack delivers it again. A button press's
listener returns at once: its dedupe mark and decision run afterwards, as a supervised task, with its platform
calls. A slash command is acknowledged once it is stored (bounded like a message), or with a word that it was
not taken; what it posts runs as supervised tasks.

Authorizing: bolt authorizes every request before its listener runs. Its single-workspace authorization
calls ``auth.test`` on the first request and keeps the answer, but every request that arrives before that
answer calls it again (a burst after a start: one call per event), and one that Slack refuses (a 429, any
``ok: false``) makes bolt acknowledge the event with an error text and drop it: the message was lost. So the
app is given an ``authorize`` function instead, answering from the identity the channel's own ``auth.test``
found before receiving began (``_identify``), with no call of its own; a request before that (HTTP mode, just
after a start) fails with 500, so Slack delivers it again. Bolt copies the client it is given for each
request and takes that request's token from the authorization, so it gets ours without the token (given
both, it would log that it ignores the token).

Several processes on one database need no leader here. In Socket Mode each process opens its own
connection, and Slack hands every event (and every button press or slash command) to one of an app's open
connections, at most 10 of them, sending it again when it is not acknowledged; in HTTP mode the load
balancer picks one process per request. Either way an event reaches one process, and a redelivery is
dropped by the dedupe below, whichever process it reaches.

Dedupe is durable and happens in core, atomically with storing the message: the envelope's ``event_id`` is
the message's ``(channel, ts)``. Every Slack ``event_id`` belongs to exactly one ``(channel, ts)``, so this
one key drops an HTTP retry (``X-Slack-Retry-Num``, same event_id), a Socket Mode redelivery, and the second
event of a channel mention (``app_mention`` and ``message`` carry different event_ids for the same message),
also after a restart. A press is remembered with ``host.mark_seen`` so a redelivered press is ignored.

What reaches core (``channels.slack.inbound`` says what an event is): DMs; in channels (``group_policy``)
an @mention, answered in a thread rooted at it, and later messages of a thread the bot has joined (kept as
channel state, so it survives a restart) under ``mention``, every message under ``all``, nothing under
``off``. A thread reply that arrives while the mention that opens its thread is still being taken (its
sender's ``users.info`` is slow) waits for that mention, within the same bound, and then reads the thread's
state (``_joining``); only within this process: one that reaches another process meanwhile is not addressed,
as it would be were the mention refused. ``allow_from`` (user ids or usernames) is checked for every message
that would reach core, before anything is stored. A username is matched through ``users.info``; only a
definite mismatch drops a message: when Slack does not say who the sender is (a 5xx, a 429, a timeout), the
event is left unacknowledged and Slack delivers it again, and a slash command is answered "could not be taken
just now; please try again". Commands are message text: ``/stop`` (or just ``stop``) in a DM, ``@bot stop``
in a thread; the four commands also work as Slack slash commands in a DM when the app registers them.

Files shared with a message travel as ``MediaItem``s; core downloads them during the turn through
``fetch_attachment`` (``core.media.fetch.AttachmentSource``). Meanwhile the chat shows the turn's thinking
indicator (``working``, ``core.channel.ShowsWorking``), which the turn's sink then takes over.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import re
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

from aiohttp import web
from slack_bolt.adapter.aiohttp import to_aiohttp_response, to_bolt_request
from slack_bolt.adapter.socket_mode.async_handler import AsyncSocketModeHandler
from slack_bolt.async_app import AsyncApp
from slack_bolt.authorization import AuthorizeResult
from slack_bolt.request.async_request import AsyncBoltRequest
from slack_sdk.web.async_client import AsyncWebClient

from channels.common.calls import Calls
from channels.common.download import stream_url
from channels.common.errors import PlatformError
from channels.common.live_sink import LiveSettings
from channels.common.open_approvals import RESTARTED, OpenApprovals, Record
from channels.common.splitter import split, utf16_len
from channels.common.throttle import Throttle
from channels.common.working_sign import WorkingSigns
from channels.slack.approvals import (
    ACTION_ALLOW,
    ACTION_DENY,
    BLOCK_ID,
    ApprovalAction,
    ApprovalPress,
    approval_text,
    decided_blocks,
    parse_press,
)
from channels.slack.client import SlackApi, error_code
from channels.slack.context import SlackContext
from channels.slack.inbound import CHANNEL, BotIdentity, SlackInbound, normalize
from channels.slack.posting import FindablePost, carries_button, carries_key, keyed
from channels.slack.render import PART_LIMIT, SlackRenderer, message_args
from channels.slack.sdk_log import LeftForRedelivery, sdk_logger
from channels.slack.settings import EVENTS_PATH, SlackConfig
from channels.slack.sink import Destination, PromptHandle, SlackOps, SlackPrompts, SlackSink
from core.agent.deciders import AllowEntries
from core.channel import ERROR, SinkError
from core.envelope import InboundEnvelope, MediaItem, ThreadRef, TurnTarget
from core.host import ChannelHost, Decider, DecideResult, ShuttingDownError
from core.media.fetch import FetchError
from core.router import COMMANDS

log = logging.getLogger(__name__)

_OPERATOR = SlackConfig()
NOT_YOURS = "Only the person who asked, or a user allowed to use this bot, can decide this."
GONE = "This request is no longer pending."
PRESS_NOT_TAKEN = "Your press could not be taken just now; please press again."
FILES_HOST = "files.slack.com"
COMMAND_NOT_TAKEN = "/{command} could not be taken just now; please try again."
CHANNEL_COMMAND_HINT = "In a channel, mention me in the reply's thread instead, e.g. <@{name}> {command}."
_INVALID_AUTH = frozenset({"invalid_auth", "not_authed", "account_inactive", "token_revoked",
                           "not_allowed_token_type"})
_USER_ID = re.compile(r"^[UW][A-Z0-9]{2,}$")
NO_SUCH_USER = frozenset({"user_not_found", "user_not_visible"})
"""``users.info`` errors that say who the user is, definitely: nobody this bot may know (so no names)."""
MAX_REMEMBERED = 1024
LOCATE_SKEW = 600.0
"""Seconds before our clock's time of a post that its message is looked for from (Slack's clock may differ)."""
LOCATE_PAGE = 200
LOCATE_PAGES = 5
"""A message being looked for is read from at most this many pages of the conversation, newest first."""


THINKING_PER_MINUTE = 20
"""Thinking indicators a workspace shows a minute at most: each is two calls of a tiered method (a reaction
added and removed, or a thread status set and cleared), and Slack's floor for ``reactions.remove`` is Tier 2
(20 a minute per workspace). When many conversations wait at once, the rest go without one."""


@dataclass(frozen=True, slots=True)
class SlackSettings:
    """What the channel runs with: the operator's ``[channels.slack]`` (defaults from its model) and the pacing
    of the first post and of reconnecting, which are not operator keys."""

    mode: Literal["socket", "http"] = _OPERATOR.mode
    allow_from: tuple[str, ...] = tuple(_OPERATOR.allow_from)
    group_policy: str = _OPERATOR.group_policy
    stream_transport: Literal["auto", "update", "native"] = _OPERATOR.stream_transport
    chat_interval: float = _OPERATOR.update_interval_ms / 1000
    workspace_interval: float = 60.0 / _OPERATOR.workspace_updates_per_minute
    workspace_updates: tuple[int, float] | None = (_OPERATOR.workspace_updates_per_minute, 60.0)
    """Slack's limit on ``chat.update`` for the workspace as it counts them: (calls, in seconds)."""
    first_chars: int = 24
    first_delay: float = 1.0
    thinking_delay: float = 0.25
    """Seconds a turn waits before it shows that it is thinking, and not at all if its first words are shown (or
    the turn ends) sooner: an indicator the answer replaces a moment later is two Web API calls for nothing."""
    thinking_interval: float = 60.0 / THINKING_PER_MINUTE
    """The least time between two thinking indicators in the workspace (see ``THINKING_PER_MINUTE``)."""
    working_handover: float = 5.0
    """Seconds the thinking indicator shown while a message's files downloaded waits for its turn's sink to take
    it over (the message is stored first, and refused files are reported) before it is cleared: a turn that
    ended there (the session moved, the bridge is stopping) leaves none behind."""
    submit_timeout: float = 2.5
    """Bound on storing one event, inside Slack's 3-second ack window."""
    connect_timeout: float = 10.0
    ping_interval: float = 10.0
    health_every: float = 2.0
    backoff: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)

    @classmethod
    def of(cls, config: SlackConfig) -> SlackSettings:
        return cls(mode=config.mode, allow_from=tuple(config.allow_from), group_policy=config.group_policy,
                   stream_transport=config.stream_transport, chat_interval=config.update_interval_ms / 1000,
                   workspace_interval=60.0 / config.workspace_updates_per_minute,
                   workspace_updates=(config.workspace_updates_per_minute, 60.0))


class AllowList:
    """``allow_from``: Slack user ids (U…/W…), usernames (with or without "@"), "*" for everyone."""

    def __init__(self, entries: Iterable[str]) -> None:
        items = [str(e).strip() for e in entries]
        self.everyone = "*" in items
        self.ids = {e for e in items if _USER_ID.match(e)}
        self.names = {e.lstrip("@").lower() for e in items if e != "*" and e not in self.ids}


class UserUnknownError(LeftForRedelivery):
    """Whether a user is in ``allow_from`` could not be decided (``users.info`` failed): their event is left
    unacknowledged (Slack delivers it again), their slash command answered "please try again"."""


def command_text(text: str, *, addressed: bool) -> str:
    """``/stop`` stays a command; a message that is just a command word (``stop``, ``help``) is one too when it
    was addressed to the bot (a DM, or ``@bot stop``): Slack's composer treats a leading "/" as a slash
    command, so people write the bare word."""
    word = text.strip()
    if addressed and word.lstrip("/").lower() in COMMANDS and " " not in word:
        return "/" + word.lstrip("/").lower()
    return text


class SlackChannel:
    name = CHANNEL

    def __init__(self, host: ChannelHost, client: AsyncWebClient, settings: SlackSettings, *, app_token: str = "",
                 signing_secret: str = "", calls: Calls | None = None) -> None:
        self.host = host
        self.settings = settings
        self.calls = calls or Calls(Throttle())
        if self.calls.observe is None:
            # every Web API attempt of the channel's shows in /metrics (not the SDK's own apps.connections.open)
            self.calls.observe = host.count_call
        self.api = SlackApi(client, self.calls, chat_interval=settings.chat_interval,
                            workspace_interval=settings.workspace_interval,
                            thinking_interval=settings.thinking_interval, updates=settings.workspace_updates)
        self.renderer = SlackRenderer()
        self.live = LiveSettings(first_chars=settings.first_chars, first_delay=settings.first_delay)
        self.allow = AllowList(settings.allow_from)
        self.app_token = app_token
        self.me: BotIdentity | None = None
        self.stream_refused = False
        """The workspace refused chat.startStream: stream by updates from now on."""
        self.status_refused = False
        """Slack refused assistant.threads.setStatus: show "thinking" as a reaction from now on."""
        self._signs: WorkingSigns[SlackOps] = WorkingSigns(host.spawn, lambda: self.settings.working_handover)
        """Thinking indicators shown while a message's files downloaded, by message, until a sink takes one."""
        self.prompts_by_call: OrderedDict[ApprovalAction, PromptHandle] = OrderedDict()
        self.handler: AsyncSocketModeHandler | None = None
        self.ready = asyncio.Event()
        self._names: dict[str, tuple[str, ...]] = {}
        self._joining: dict[str, list[asyncio.Event]] = {}
        """Threads a mention is being taken in (by their state key), until it was stored or dropped."""
        self._state = "stopped"
        self._receiving = False
        self._task: asyncio.Task[None] | None = None
        self._open = OpenApprovals(host, self._open_records)
        # its ids and usernames apart: a username spelled like an allowed id (``u0bob``) decides nothing
        host.set_deciders(AllowEntries(ids=frozenset(self.allow.ids), names=frozenset(self.allow.names)))

        async def authorize(enterprise_id: str | None, user_id: str | None) -> AuthorizeResult:
            # a plain function: bolt passes arguments by the names it reads off the signature, and would take a
            # bound method's ``self`` for one of them
            return self._authorization(enterprise_id, user_id)

        self.app = AsyncApp(client=_without_token(client), authorize=authorize, signing_secret=signing_secret,
                            request_verification_enabled=settings.mode == "http",
                            process_before_response=True, logger=sdk_logger())
        self.app.event("message")(self._on_event)
        self.app.event("app_mention")(self._on_event)
        self.app.action(ACTION_ALLOW)(self._on_press)
        self.app.action(ACTION_DENY)(self._on_press)
        self.app.command(re.compile(r"^/(" + "|".join(COMMANDS) + r")$"))(self._on_command)

    # ---- delivery ------------------------------------------------------------------------------

    def _destination(self, target: TurnTarget) -> Destination:
        return Destination.of(target, thread_dm=self.settings.stream_transport == "native")

    async def open_sink(self, target: TurnTarget) -> SlackSink:
        dest = self._destination(target)
        native = (self.settings.stream_transport != "update" and not self.stream_refused
                  and dest.thread_ts is not None)
        ops = SlackOps(self, dest, native=native)
        sign = self._signs.take(_message_key(dest))
        if sign is not None:  # shown while the message's files downloaded: this turn's indicator from now on
            ops.adopt(sign)
        sink = SlackSink(ops, self.renderer, self.calls, settings=self.live,
                         prompts=SlackPrompts(self, target, dest), spawn=self.host.spawn)
        # the thinking status (or reaction) is set beside the turn, so the model is asked without waiting for
        # this round trip, and only if nothing is shown within thinking_delay; refused (not in the channel,
        # archived, no access), the turn shows only its final
        sink.start_typing(delay=self.settings.thinking_delay)
        return sink

    @contextlib.asynccontextmanager
    async def working(self, target: TurnTarget) -> AsyncIterator[None]:
        """The thinking indicator while a message's files download, before its turn's sink opens
        (``ShowsWorking``): the sink's own (a thread status or a reaction), shown at once under the same workspace
        budget (no room: none), not waited for. After the block the turn's sink takes it over (``open_sink``),
        clearing it at the turn's end; one no sink took within ``working_handover`` is cleared then."""
        dest = self._destination(target)
        ops = SlackOps(self, dest, native=False)

        async def show() -> None:
            await self.calls.call(ops.typing, scopes=ops.scopes, paced=False, retry=False)

        async def take_down() -> None:
            if ops.thinking is not None:
                await ops.clear_thinking()

        async with self._signs.showing(_message_key(dest), ops, show=show, take_down=take_down,
                                       name=f"slack:working:{dest.channel}"):
            yield

    async def send_plain(self, target: TurnTarget, text: str) -> None:
        """One ordinary message (split if long, Markdown rendered, plain mrkdwn if the block is refused). Each
        part is one paced call under the call policy, which waits out a 429 pause however long. When a part
        fails after the first were sent, the SinkError carries the parts not sent (``unsent``)."""
        dest = self._destination(target)
        client = self.api.client
        chunks = [c.text for c in split(text, PART_LIMIT, utf16_len) if c.text.strip()] if text.strip() else []
        for i, chunk in enumerate(chunks):
            key = uuid.uuid4().hex
            post = FindablePost(self, dest.channel, dest.thread_ts, carries_key(key))
            try:
                for part in (self.renderer.final_part(chunk), self.renderer.plain_part(chunk)):
                    try:
                        await self.api.call("chat.postMessage", functools.partial(post.post, functools.partial(
                            client.chat_postMessage, channel=dest.channel, thread_ts=dest.thread_ts,
                            unfurl_links=False, unfurl_media=False, metadata=keyed(key), **message_args(part))),
                            channel=dest.channel)
                        break
                    except PlatformError as exc:
                        if exc.kind != "format" or not part.formatting:
                            raise
            except PlatformError as exc:  # the messages before this one are shown: only the rest is missing
                raise SinkError(str(exc), unsent="\n".join(chunks[i:]) if i else None,
                                outcome_unknown=exc.outcome_unknown) from None

    async def show_decision(self, entry: PromptHandle, ts: str | None = None, *, again: bool = False) -> bool:
        """Update an approval message to show how it ended (no buttons): ``entry``'s message, or the one at ``ts``
        (a press names it). It answers a press, so it goes at once (honouring a 429 pause, without waiting for a
        pace slot). An update that failed leaves the request in the open-requests record, still showing its
        buttons: a press on them (``again``: whatever was shown before), the approval's end in the reply
        (``SlackPrompts.ended``) or the next start shows it again."""
        if entry.ts is None:
            entry.ts = ts  # a press says where the message is, before its post's answer did
        ts = ts or entry.ts
        if ts is None:
            return False
        async with entry.showing:
            if entry.shown and ts == entry.ts and not again:
                return True
            shown = await self._update_approval(entry.dest.channel, ts, entry.tool_name, entry.outcome_blocks())
            if shown and ts == entry.ts:
                entry.shown = True
        await self._save_open()
        return shown

    async def _update_approval(self, channel: str, ts: str, tool_name: str, blocks: list[dict[str, Any]]) -> bool:
        """True once the message shows ``blocks``, or no try could ever change it (it is gone, the channel
        archived); False when a later try may (a 5xx, a timeout, a 429, a token the operator may fix)."""
        client = self.api.client
        try:
            await self.api.call("chat.update", lambda: client.chat_update(
                channel=channel, ts=ts, text=approval_text(tool_name), blocks=blocks),
                channel=channel, paced=False)
        except PlatformError as exc:
            if exc.transient or error_code(exc) in _INVALID_AUTH:
                log.warning("could not show the approval outcome in %s (%s): its buttons stay until it is shown",
                            channel, exc)
                return False
            log.info("could not show the approval outcome in %s: %s", channel, exc)
        return True

    # ---- approvals a restart must close (``channels.common.open_approvals``) ----------------------

    async def save_prompts(self) -> None:
        await self._save_open()

    async def _save_open(self) -> None:
        await self._open.save()

    def _open_records(self) -> list[Record]:
        # ``ts`` is None while the post is on its way: ``value`` (what its buttons carry) and ``at`` find it. A
        # request that ended stays while its message may still show the buttons (the update failed): with how
        # it ended, which the next start shows instead of the restart
        records = []
        for e in self.prompts_by_call.values():
            if e.outcome is None:
                records.append(_record(e))
            elif not e.shown and e.ts is not None:
                records.append({**_record(e), "outcome": e.outcome, "by": e.by, "line": e.line, "label": e.label})
        return records

    async def _close_left_over(self) -> None:
        await self._open.close_left_over(self._close)

    async def _close(self, item: Record) -> bool:
        """Show that a request left open ended (``RESTARTED``, or how it ended before its update failed); True
        once it shows it, or it was never shown."""
        channel, tool, arguments = str(item["channel"]), str(item["tool"]), str(item.get("arguments") or "")
        ts = item.get("ts")
        if ts is None:  # the bridge stopped while posting it: shown or not, only the conversation can tell
            thread_ts = item.get("thread_ts")
            try:
                ts = await self.locate_prompt(channel, None if thread_ts is None else str(thread_ts),
                                              str(item["value"]), float(item["at"]), strict=True)
            except PlatformError as exc:
                log.warning("could not look in %s for an approval request being posted when the bridge stopped "
                            "(%s): tried again later", channel, exc)
                return False
            if ts is None:
                log.info("an approval request of %s was being posted when the bridge stopped and is not in %s: "
                         "it was never shown", tool, channel)
                return True
        outcome = item.get("outcome")
        label = None if item.get("label") is None else str(item["label"])
        if outcome in ("allowed", "denied"):
            by = item.get("by")
            blocks = decided_blocks(tool, arguments, outcome, None if by is None else str(by), label=label)
        else:
            line = item.get("line")
            blocks = decided_blocks(tool, arguments, "ended", line=RESTARTED if line is None else str(line),
                                    label=label)
        return await self._update_approval(channel, str(ts), tool, blocks)

    async def locate_prompt(self, channel: str, thread_ts: str | None, value: str, at: float, *,
                            strict: bool = False) -> str | None:
        """The ts of the approval message whose buttons carry ``value``, posted at about ``at`` (see ``locate``)."""
        return await self.locate(channel, thread_ts, carries_button(value), at, strict=strict)

    async def locate(self, channel: str, thread_ts: str | None, match: Callable[[dict[str, Any]], bool],
                     at: float, *, strict: bool = False) -> str | None:
        """The ts of a message of the bot's that ``match`` recognises, posted at about ``at`` in ``channel`` (in the
        thread ``thread_ts``), read from the conversation with its metadata (the history scopes the app has for
        its events); None when it is not there, or cannot be read (logged; ``strict``: raises PlatformError)."""
        client = self.api.client
        method = "conversations.replies" if thread_ts is not None else "conversations.history"
        read = client.conversations_replies if thread_ts is not None else client.conversations_history
        # Slack's ts is its own clock: ten minutes either side of ours is room for any skew
        args: dict[str, Any] = {"channel": channel, "oldest": f"{at - LOCATE_SKEW:.6f}", "limit": LOCATE_PAGE,
                                "inclusive": True, "include_all_metadata": True}
        if thread_ts is not None:
            args["ts"] = thread_ts
        for _ in range(LOCATE_PAGES):
            try:
                page = await self.api.call(method, functools.partial(read, **args), channel=channel, paced=False)
            except PlatformError as exc:
                if strict:
                    raise
                log.warning("could not look in %s for a message that may have been posted (%s): it is posted "
                            "(again)", channel, exc)
                return None
            for message in page.get("messages") or ():
                if isinstance(message, dict) and match(message):
                    return str(message["ts"])
            cursor = (page.get("response_metadata") or {}).get("next_cursor")
            if not page.get("has_more") or not cursor:
                return None
            args["cursor"] = cursor
        return None

    # ---- lifecycle -----------------------------------------------------------------------------

    def state(self) -> str:
        return self._state

    async def start(self) -> None:
        """Begin receiving. Set-up that fails for a reason that may pass (Slack unreachable) is retried in the
        background, so the rest of the bridge starts regardless; /healthz shows "error" meanwhile. A token
        Slack rejects is reported the same way (the operator may fix the app without a restart)."""
        self._receiving = True
        self._state = "starting"
        self._task = self.host.spawn("slack:receive", self._receive())

    def _authorization(self, enterprise_id: str | None, user_id: str | None) -> AuthorizeResult:
        """Bolt's authorization of one request (see the module docstring): the bot as ``auth.test`` named it."""
        me = self.me
        if me is None:
            raise RuntimeError("Slack request before auth.test answered; Slack will deliver it again")
        return AuthorizeResult(enterprise_id=enterprise_id, team_id=me.team_id, bot_user_id=me.user_id,
                               bot_id=me.bot_id, bot_token=self.api.client.token, user_id=user_id)

    async def _identify(self) -> None:
        client = self.api.client
        auth = await self.api.call("auth.test", lambda: client.auth_test())
        self.me = BotIdentity(user_id=str(auth["user_id"]), bot_id=auth.get("bot_id"), team_id=auth.get("team_id"))
        self.api.team_id = str(auth.get("team_id") or "")

    async def _receive(self) -> None:
        failures = 0
        while self._receiving and self.me is None:
            try:
                await self._identify()
            except PlatformError as exc:
                delay = self._delay(failures)
                failures += 1
                self._state = ERROR
                hint = " (check [channels.slack] bot_token)" if error_code(exc) in _INVALID_AUTH else ""
                log.error("Slack auth.test failed (%s)%s; retrying in %.0fs", exc, hint, delay)
                await asyncio.sleep(delay)
        await self._close_left_over()
        if self.settings.mode == "http":
            self._state = "serving"
            self.ready.set()
            return
        failures = 0
        while self._receiving:
            try:
                if self.handler is None:  # made inside the running loop: the SDK starts tasks as it is built
                    self.handler = AsyncSocketModeHandler(self.app, self.app_token,
                                                          ping_interval=self.settings.ping_interval)
                async with asyncio.timeout(self.settings.connect_timeout):
                    await self.handler.connect_async()  # type: ignore[no-untyped-call]
                break
            except Exception as exc:  # the SDK raises what aiohttp and the Web API raise
                delay = self._delay(failures)
                failures += 1
                self._state = ERROR
                log.error("Slack Socket Mode connection failed (%s); retrying in %.0fs", type(exc).__name__, delay)
                await self._close_handler()
                await asyncio.sleep(delay)
        self._state = "connected"
        self.ready.set()
        await self._watch()

    async def _watch(self) -> None:
        """/healthz: the SDK reconnects by itself; a socket down for several checks in a row is an error."""
        down = 0
        while self._receiving and self.handler is not None:
            await asyncio.sleep(self.settings.health_every)
            if not self._receiving or self.handler is None:
                return
            connected = await self.handler.client.is_connected()
            down = 0 if connected else down + 1
            self._state = "connected" if connected else ("reconnecting" if down < 3 else ERROR)

    def _delay(self, failures: int) -> float:
        delays = self.settings.backoff
        return delays[min(failures, len(delays) - 1)]

    async def _close_handler(self) -> None:
        handler, self.handler = self.handler, None
        if handler is not None:
            with contextlib.suppress(Exception):
                await handler.close_async()  # type: ignore[no-untyped-call]

    async def stop(self) -> None:
        self._receiving = False
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await self._close_handler()
        self._state = "stopped"

    async def close(self) -> None:
        session = self.api.client.session
        if session is not None and not session.closed:
            await session.close()

    # ---- attachments (core.media.fetch.AttachmentSource) ---------------------------------------------

    async def fetch_attachment(self, item: MediaItem, target: TurnTarget) -> AsyncGenerator[bytes, None]:
        """The bytes of a file shared in one of this channel's messages: ``files.info`` for its private download
        URL, then that URL with the bot token (scope ``files:read``). The token is sent only to Slack's file
        host, or to the host of ``api_base`` (a test server), never along a redirect elsewhere."""
        client = self.api.client
        try:
            info = await self.api.call("files.info", lambda: client.files_info(file=item.file_id))
        except PlatformError as exc:
            raise FetchError(str(exc)) from None
        file = info.get("file") or {}
        url = str(file.get("url_private_download") or file.get("url_private") or "")
        if not url:
            raise FetchError("files.info answered without a download URL")
        hosts = {FILES_HOST, urlsplit(str(client.base_url)).hostname or FILES_HOST}
        session = client.session
        if session is None or session.closed:
            raise FetchError("the channel is closed")
        async for chunk in stream_url(session, url, allowed_hosts=hosts,
                                      headers={"Authorization": f"Bearer {client.token}"}):
            yield chunk

    def routes(self, app: web.Application) -> None:
        app.router.add_post(EVENTS_PATH, self.http_events)

    async def http_events(self, request: web.Request) -> web.Response:
        """``POST /slack/events``: bolt's aiohttp adapter (nothing may read the body before it)."""
        if not self._receiving:
            return web.Response(status=503)  # Slack retries it
        response = await self.app.async_dispatch(await to_bolt_request(request))
        return await to_aiohttp_response(response)

    # ---- receiving -----------------------------------------------------------------------------

    async def _on_event(self, body: dict[str, Any], request: AsyncBoltRequest) -> None:
        """One ``message`` / ``app_mention`` event; returns once core stored it (or it was dropped). Raising
        leaves it unacknowledged, so Slack delivers it again."""
        if self.me is None:
            raise RuntimeError("Slack event before auth.test answered; Slack will deliver it again")
        inbound = normalize(body, self.me)
        if inbound.kind is None or inbound.user is None:
            log.debug("Slack event ignored: %s", inbound.ignore)
            return
        async with asyncio.timeout(self.settings.submit_timeout):
            if not await self._addressed(inbound):
                return
            joins = inbound.channel_type != "im" and inbound.reply_thread_ts is not None
            with self._taking(inbound.channel, inbound.reply_thread_ts) if joins else contextlib.nullcontext():
                envelope = self._envelope(inbound)
                if envelope is None:
                    return
                # who the sender is could not be learned (users.info failed): UserUnknownError leaves the event
                # unacknowledged, so Slack delivers it again and the next try may learn it
                if not await self._allowed(inbound.user):
                    return
                if joins and inbound.reply_thread_ts:
                    # the bot answers in this thread: later messages in it need no mention
                    await self.host.set_state(_thread_key(inbound.channel, inbound.reply_thread_ts), "joined")
                retry = request.headers.get("x-slack-retry-num")
                result = await self.host.submit(envelope)
                log.debug("Slack message %s:%s (retry %s): %s", inbound.channel, inbound.ts, retry, result.value)

    @contextlib.contextmanager
    def _taking(self, channel: str, thread_ts: str | None) -> Iterator[None]:
        """While a message that joins a thread is being taken (its sender checked, the thread marked, the message
        stored): a reply in that thread arriving meanwhile waits for it (``_addressed``), rather than reading the
        thread's state before the mention wrote it and dropping the reply. Released once the mention is stored,
        so the reply comes after it; or refused, or failed (the reply then finds no state, as before)."""
        key = _thread_key(channel, thread_ts or "")
        done = asyncio.Event()
        self._joining.setdefault(key, []).append(done)
        try:
            yield
        finally:
            done.set()
            waiting = self._joining.get(key, [])
            if done in waiting:
                waiting.remove(done)
            if not waiting:
                self._joining.pop(key, None)

    async def _allowed(self, user: str) -> bool:
        """Whether ``allow_from`` lets ``user`` in. False only for a definite mismatch; raises UserUnknownError
        when the answer depends on the user's names and Slack did not say them (``_user_names``)."""
        allow = self.allow
        if allow.everyone or user in allow.ids:
            return True
        if not allow.names:
            return False
        return any(n.lower() in allow.names for n in await self._user_names(user))

    async def _user_names(self, user: str) -> tuple[str, ...]:
        """The user's username (``users.info``'s ``name``, remembered): unique in the workspace and not theirs
        to change. Never the display name, which any member may set to anyone else's username (and which the
        core's approval check, reading a press's ``username``, does not see either). A user Slack does not know has
        none; any other failure (a 5xx, a 429, a timeout, a refusal such as a missing ``users:read``) raises
        UserUnknownError: not knowing who someone is never means they are not allowed."""
        cached = self._names.get(user)
        if cached is not None:
            return cached
        client = self.api.client
        try:
            info = await self.api.call("users.info", lambda: client.users_info(user=user), retry=False)
        except PlatformError as exc:
            if error_code(exc) in NO_SUCH_USER:
                log.info("users.info: Slack does not know %s (%s)", user, error_code(exc))
                return ()
            log.warning("could not learn who Slack user %s is, for allow_from (%s): their message is not dropped "
                        "(an event is left for Slack to deliver again)", user, exc)
            raise UserUnknownError(f"users.info failed for {user}: {exc}") from None
        data = info.get("user") or {}
        names = (str(data["name"]),) if data.get("name") else ()
        if len(self._names) >= MAX_REMEMBERED:
            self._names.pop(next(iter(self._names)))
        self._names[user] = names
        return names

    async def _addressed(self, inbound: SlackInbound) -> bool:
        if inbound.kind == "dm":
            return True
        policy = self.settings.group_policy
        if policy == "off":
            return False
        if policy == "all" or inbound.kind == "mention":
            return True
        if inbound.kind == "thread_reply" and inbound.thread_ts:
            key = _thread_key(inbound.channel, inbound.thread_ts)
            if await self.host.get_state(key) is not None:
                return True
            joining = list(self._joining.get(key, ()))
            if not joining:
                return False
            # the mention that opens this thread is still being taken here: wait for it (within the caller's
            # submit bound), then the thread's state says whether it was taken
            for done in joining:
                await done.wait()
            return await self.host.get_state(key) is not None
        return False

    def _envelope(self, inbound: SlackInbound) -> InboundEnvelope | None:
        assert inbound.user is not None
        text = command_text(inbound.text, addressed=inbound.kind in ("dm", "mention"))
        if not text.strip() and not inbound.files:
            return None
        thread = inbound.thread_id
        ctx = SlackContext(channel_type=inbound.channel_type, ts=inbound.ts, thread_ts=inbound.reply_thread_ts,
                           user=inbound.user, team_id=inbound.team_id)
        return InboundEnvelope(
            channel=CHANNEL, chat_id=inbound.channel, sender_id=inbound.user, content=text,
            media=inbound.files, thread=ThreadRef(thread_id=thread) if thread else None,
            event_id=f"{inbound.channel}:{inbound.ts}", channel_context=ctx.wrap())

    async def _on_press(self, ack: Any, body: dict[str, Any]) -> None:
        """A press on Allow / Deny. What answers Slack is this listener returning (``process_before_response``),
        so it returns at once: its dedupe mark, the decision and the platform calls run as a supervised task
        (``_press``), and a slow disk cannot hold the answer past Slack's 3 seconds (an HTTP press would show
        Slack's error though it was carried out; a Socket Mode one would come again). When the process is
        shutting down nothing can run it: the listener fails, so Slack shows its error (HTTP) or delivers the
        press again (Socket Mode) rather than hearing that it was taken."""
        press = parse_press(body)
        if press is not None:
            try:
                self.host.spawn("slack:press", self._press(press, body))
            except ShuttingDownError:
                log.warning("a press on an approval in %s came as the bridge was stopping: not taken",
                            press.channel_id)
                raise LeftForRedelivery("a press while shutting down") from None
        await ack()

    async def _press(self, press: ApprovalPress, body: dict[str, Any]) -> None:
        """A press, after it was acknowledged: at most one decision; what it shows runs supervised. A press that
        could not be taken (the store failed) is logged, and the presser told to press again."""
        try:
            action_ts = next((str(a.get("action_ts") or "") for a in body.get("actions") or []), "")
            if not await self.host.mark_seen(f"press:{press.message_ts}:{press.user_id}:{action_ts}"):
                return  # a redelivered press
            decider = Decider(press.user_id, (press.user_name,) if press.user_name else (), press.user_name or "")
            result = await self.host.decide(press.action.session_key, press.action.call_id, press.decision,
                                            decided_by=decider, origin=press.action.origin)
        except Exception as exc:
            log.warning("a press on an approval in %s could not be taken (%s): the user was told to press again",
                        press.channel_id, exc, exc_info=exc)
            self._spawn("slack:press-not-taken", self._ephemeral(press.channel_id, press.user_id, press.thread_ts,
                                                                 PRESS_NOT_TAKEN))
            return
        entry = self.prompts_by_call.get(press.action)
        posted_here = entry is not None
        if entry is None:
            entry = self._handle_for(press, body)
        if result is DecideResult.REFUSED:
            self._spawn("slack:not-yours", self._ephemeral(press.channel_id, press.user_id, press.thread_ts,
                                                           NOT_YOURS))
            return
        if result is DecideResult.NOT_PENDING:
            self._spawn("slack:gone", self._ephemeral(press.channel_id, press.user_id, press.thread_ts, GONE))
            # the pressed message still shows buttons (its outcome update failed, or never came): show how the
            # request ended on it, whatever was shown before. Not while this process's live sink has yet to say
            # how it ended (it timed out a moment ago): the sink shows that, with its line ("nobody decided in
            # time"), which a bare "ended" shown first would keep off the message for good
            waits_for_sink = posted_here and entry is not None and entry.outcome is None and entry.sink_ends
            if entry is not None and _shows_buttons(body) and not waits_for_sink:
                self._spawn("slack:approval-ended", self._show_ended(entry, press, posted_here))
            return
        outcome: Literal["allowed", "denied"] = "allowed" if press.decision == "allow" else "denied"
        # decided in another process (the one running the turn): its sink, which posted the buttons, shows
        # the outcome, once
        if entry is not None and posted_here:
            entry.decided(outcome, by=press.user_id)
            self._spawn("slack:approval-decided", self.show_decision(entry, press.message_ts))

    async def _show_ended(self, entry: PromptHandle, press: ApprovalPress, posted_here: bool) -> None:
        """A press on a request that is no longer pending: its message shows how it ended — as decided here, or
        as the record of the process that posted it says (an outcome it could not show yet), else "ended"."""
        if not posted_here:
            item = await self._open.find(lambda r: r.get("outcome") is not None
                                         and ApprovalAction.decode(r.get("value")) == press.action)
            if item is not None:
                by, line, label = item.get("by"), item.get("line"), item.get("label")
                entry.arguments, entry.label = str(item.get("arguments") or ""), None if label is None else str(label)
                entry.decided(str(item["outcome"]), by=None if by is None else str(by),
                              line=None if line is None else str(line))
        entry.decided("ended")
        await self.show_decision(entry, press.message_ts, again=True)

    def remember_prompt(self, action: ApprovalAction, handle: PromptHandle) -> None:
        """The approval messages this process posted, by what they decide (call ids are the model's and need
        not be unique across sessions, nor between a turn and its subagents)."""
        self.prompts_by_call[action] = handle
        while len(self.prompts_by_call) > MAX_REMEMBERED:
            self.prompts_by_call.popitem(last=False)

    @staticmethod
    def _handle_for(press: ApprovalPress, body: dict[str, Any]) -> PromptHandle | None:
        """An approval message this process did not post (before a restart): enough to update it."""
        if press.channel_id is None or press.message_ts is None:
            return None
        ctx = SlackContext(channel_type="im" if press.channel_id.startswith("D") else "channel",
                           ts=press.message_ts, thread_ts=press.thread_ts)
        text = str((body.get("message") or {}).get("text") or "")
        tool = text.removeprefix(approval_text(""))
        return PromptHandle(Destination(press.channel_id, press.thread_ts, ctx), press.action, tool, "",
                            ts=press.message_ts)

    async def _ephemeral(self, channel: str | None, user: str, thread_ts: str | None, text: str) -> None:
        if channel is None:
            return
        client = self.api.client
        try:
            await self.api.call("chat.postEphemeral", lambda: client.chat_postEphemeral(
                channel=channel, user=user, text=text, thread_ts=thread_ts), channel=channel, paced=False)
        except PlatformError as exc:
            log.info("could not answer a press in %s: %s", channel, exc)

    def _spawn(self, name: str, coro: Any) -> None:
        try:
            self.host.spawn(name, coro)
        except ShuttingDownError:
            coro.close()

    async def _on_command(self, ack: Any, body: dict[str, Any], respond: Any) -> None:
        """A slash command (/stop, /new, /help, /compact): a DM's conversation gets it as a command message;
        elsewhere a slash command cannot name the thread it is meant for, so it gets a hint instead. Slack never
        sends a slash command again: it is acknowledged once it is stored, or with a word to the user that it was
        not taken (the store failed or was too slow), never dropped silently."""
        command = str(body.get("command") or "").lstrip("/")
        channel = str(body.get("channel_id") or "")
        user = str(body.get("user_id") or "")
        try:
            async with asyncio.timeout(self.settings.submit_timeout):
                if not user or not await self._allowed(user):
                    await ack()
                    return
                if not channel.startswith("D"):
                    await ack()
                    name = self.me.user_id if self.me else "bot"
                    self._spawn("slack:command-hint",
                                respond(CHANNEL_COMMAND_HINT.format(name=name, command=command)))
                    return
                ctx = SlackContext(channel_type="im", ts=str(body.get("trigger_id") or ""), user=user,
                                   team_id=str(body.get("team_id") or "") or None)
                await self.host.submit(InboundEnvelope(
                    channel=CHANNEL, chat_id=channel, sender_id=user, content=f"/{command}",
                    event_id=f"command:{body.get('trigger_id') or ''}", channel_context=ctx.wrap()))
        except Exception as exc:  # the store failed or was slow (TimeoutError): say so, Slack will not send it again
            log.warning("a /%s command could not be taken (%s): the user was told to try again", command,
                        type(exc).__name__)
            await ack(COMMAND_NOT_TAKEN.format(command=command))
            return
        await ack()


def _record(entry: PromptHandle) -> Record:
    return {"channel": entry.dest.channel, "thread_ts": entry.dest.thread_ts, "ts": entry.ts,
            "tool": entry.tool_name, "arguments": entry.arguments, "value": entry.action.encode(),
            "at": entry.posted_at}


def _shows_buttons(body: dict[str, Any]) -> bool:
    """Whether the pressed message, as the press carries it, still shows the approval buttons (assumed when the
    press does not carry it)."""
    message = body.get("message")
    if not isinstance(message, dict) or not isinstance(message.get("blocks"), list):
        return True
    return any(isinstance(b, dict) and (b.get("block_id") == BLOCK_ID or b.get("type") == "actions")
               for b in message["blocks"])


def _message_key(dest: Destination) -> str:
    """The user's message a turn answers (its working sign's key)."""
    return f"{dest.channel}:{dest.ctx.ts}"


def _thread_key(channel: str, thread_ts: str) -> str:
    return f"thread:{channel}:{thread_ts}"


def _without_token(client: AsyncWebClient) -> AsyncWebClient:
    """``client`` as bolt gets it: the same address, session, timeout and (no) retries, without the token, which
    bolt takes from each request's authorization (see the module docstring)."""
    return AsyncWebClient(base_url=client.base_url, session=client.session, timeout=client.timeout,
                          retry_handlers=list(client.retry_handlers), logger=client.logger)
