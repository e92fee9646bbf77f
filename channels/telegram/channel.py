"""TelegramChannel: the Telegram ``Channel`` (core.channel), working through its ``ChannelHost``.

Receiving: long polling with the update offset kept as the channel's durable state, per bot
(``offset:<bot id>``: update ids are numbered per bot, so another bot on the same database starts from its own),
so a restart neither replays nor loses updates; or a webhook on the web server's ``/telegram/webhook`` with the
secret-token header checked in constant time. Either way each update goes through the adapter (authorize,
normalise) and ``host.submit``, which returns once core has stored the message; only then is the update
acknowledged (the offset saved, the webhook answered 200). A message core could not store is not
acknowledged, so Telegram delivers it again; core's durable dedupe on "<bot id>:<chat_id>:<message_id>" makes
a re-delivered update harmless. The messages of an album are kept by ``channels.telegram.albums`` (durably,
before they are acknowledged) and reach core as one. The updates of one polled batch are handed over chat by
chat at once (each chat's in order), so a burst is stored together; the batch is acknowledged up to its first update
core did not take. An update our own code fails on unexpectedly (a shape it does not expect, a
bug) is logged and skipped — acknowledged like a handled one — so one bad update neither ends the receiving
of those after it nor comes back forever. An update aiogram cannot read whole (a field of a kind newer than
it) is read without that field, and one whose message cannot be read at all is skipped the same way
(``channels.telegram.updates``): it neither holds up the batch it came in nor is refused to a webhook. A
webhook request that comes before the set-up knows who the bot is gets 503, so Telegram sends it again. A
store that fails for a moment does not end the polling: an offset that could not be read is read again, one
that could not be saved is saved with the next batch. A callback query (a press
on an approval button) goes to ``ApprovalButtons`` instead (see ``channels.telegram.approvals``).

Several processes on one database: Telegram hands a bot's updates to one ``getUpdates`` caller at a time,
so only the process leading ``polling:<bot id>`` (``host.lead``, ``core.leadership``) polls; the others
stand by (``state()`` "standby", healthy) and one of them takes over when the leader goes away, reading the
offset the leader last saved. The offset is saved only after core stored the batch, so the new leader
fetches again at most the last batch, and core's dedupe drops what the old one stored. A leader that loses
its lead is cancelled at once, mid-poll. Webhook mode needs no leader: Telegram posts each update once, to
whichever process the load balancer picks; every process registers the webhook at start, and one that stops
leaves it registered for the others (a single process deletes it). Sending works in every process.

The polling loop is ours rather than aiogram's Dispatcher because the offset must be persisted only after
an update was handed to core, and the Dispatcher keeps its offset in memory.

Attachments: the channel is an ``AttachmentSource`` (``core.media.fetch``): core asks it, during the turn,
for the bytes of a photo, document or voice note; it resolves the file with ``getFile`` and streams
``<api_base>/file/bot<token>/<file_path>`` (a self-hosted Bot API server in ``--local`` mode keeps files on
its own disk and serves no such URL: those are reported as not downloadable). Redirects are followed only
on the Bot API server's host; the token never appears in an error.

A group upgraded to a supergroup: Telegram gives the supergroup a new chat id, and tells of it by a service
message in each chat, and by answering a call to the old id with the new one (``TelegramClient``). Either way
the channel keeps the move as durable state (``migrated:<new chat id>`` holding the old id), loaded at every
start before anything is received: the new chat's messages go on in the group's session (the same history,
a /stop there stopping a reply begun in the group), and their replies go to the new chat. A service message
whose move could not be kept is not acknowledged (Telegram delivers it again).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp
from aiogram import Bot
from aiogram.methods import (
    DeleteWebhook,
    GetFile,
    GetMe,
    GetUpdates,
    SendChatAction,
    SendMessage,
    SetMyCommands,
    SetWebhook,
)
from aiogram.types import BotCommand, Update
from aiohttp import web

from channels.common.calls import Calls
from channels.common.download import stream_url
from channels.common.errors import PlatformError
from channels.common.live_sink import LiveSettings, LiveSink
from channels.common.splitter import split_text
from channels.common.throttle import Clock, Throttle
from channels.telegram import render
from channels.telegram.adapter import (
    CHANNEL,
    AllowList,
    BotIdentity,
    album_part,
    in_album,
    in_session_of,
    migration,
    normalize,
)
from channels.telegram.albums import Albums
from channels.telegram.approvals import ApprovalButtons
from channels.telegram.client import TelegramClient
from channels.telegram.settings import WEBHOOK_PATH, TelegramConfig
from channels.telegram.sink import Destination, TelegramOps, TelegramPrompts, entities
from channels.telegram.updates import NotAnUpdate, read_update
from core.channel import ERROR, SinkError
from core.envelope import InboundEnvelope, MediaItem, TurnTarget
from core.host import AdmissionError, ChannelHost, ShuttingDownError
from core.leadership import Lead, run_as_leader
from core.media.fetch import FetchError
from core.router import COMMANDS

log = logging.getLogger(__name__)

_OPERATOR = TelegramConfig()
SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"
LEGACY_OFFSET_KEY = "offset"
"""Where builds before offsets were kept per bot kept the one offset of whichever bot polled: taken over once."""


def offset_key(bot_id: int) -> str:
    """The channel state holding the polling offset of the bot ``bot_id``: update ids are numbered per bot, so
    another bot's offset (a token replaced, another config on the same database) would skip its updates."""
    return f"offset:{bot_id}"


MOVED_PREFIX = "migrated:"
"""Channel state ``migrated:<new chat id>``: the id of the group the supergroup was upgraded from."""


STANDBY = "standby"
"""The state of a polling channel while another process sharing the database polls its bot."""
ALLOWED_UPDATES = ("message", "edited_message", "callback_query")
BOT_SENDS_PER_SECOND = 23.0
"""New messages a second over all chats. Telegram's Bots FAQ allows a bot "not more than 30 messages per
second or so" before it answers 429, without saying over which span it counts them. After the bridge's event
loop was held up, the throttle lets the sends whose slots passed meanwhile leave together, up to ``catch_up``
(a quarter of a second) of them and the one due, so one second may see the pace times 1.25, plus one: 23
keeps that within 30 even counted over any one second (``tests/test_telegram_send_pacing.py``). Paced at 27, a
thousand chats streaming at once drew 429s on the bot's budget (``tests.bench.e2e``)."""


@dataclass(frozen=True, slots=True)
class TelegramSettings:
    """What the channel runs with: the operator's ``[channels.telegram]`` (defaults from its model, so each
    is defined once) and the pacing of the first post and of polling, which are not operator keys."""

    mode: Literal["polling", "webhook"] = _OPERATOR.mode
    webhook_url: str = _OPERATOR.webhook_url
    webhook_secret: str = _OPERATOR.webhook_secret
    allow_from: tuple[str, ...] = tuple(_OPERATOR.allow_from)
    group_policy: str = _OPERATOR.group_policy
    edit_interval: float = _OPERATOR.edit_interval_ms / 1000
    stream_transport: Literal["auto", "edit", "draft"] = _OPERATOR.stream_transport
    first_chars: int = 24
    """Nothing is posted before the answer has this many characters..."""
    first_delay: float = 1.0
    """...or this many seconds have passed since the turn began."""
    typing_delay: float = 0.25
    """Seconds a turn waits before it shows "typing…", and not at all if its first words are shown (or the
    turn ends) sooner: an indicator the answer replaces a moment later is a Bot API call for nothing, and a
    quarter of a second is not a wait anyone sees."""
    bot_sends_per_second: float = BOT_SENDS_PER_SECOND
    poll_timeout: int = 25
    poll_backoff: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)
    album_window: float = 1.0
    """An album (photos sent together) is complete once none of its messages has come for this many seconds
    (``channels.telegram.albums``)..."""
    album_max_wait: float = 5.0
    """...and at the latest this many seconds after its first one."""

    @classmethod
    def of(cls, config: TelegramConfig) -> TelegramSettings:
        return cls(mode=config.mode, webhook_url=config.webhook_url, webhook_secret=config.webhook_secret,
                   allow_from=tuple(config.allow_from), group_policy=config.group_policy,
                   edit_interval=config.edit_interval_ms / 1000, stream_transport=config.stream_transport)


class TelegramChannel:
    name = CHANNEL

    def __init__(self, host: ChannelHost, bot: Bot, settings: TelegramSettings, *, calls: Calls | None = None,
                 limit: int = render.MESSAGE_LIMIT, album_clock: Clock | None = None) -> None:
        self.host = host
        self.bot = bot
        self.settings = settings
        self.calls = calls or Calls(Throttle())
        if self.calls.observe is None:
            self.calls.observe = host.count_call  # every Bot API attempt shows in /metrics
        self.client = TelegramClient(bot, self.calls, chat_interval=settings.edit_interval,
                                     bot_sends_per_second=settings.bot_sends_per_second)
        self.limit = limit
        self.renderer = render.TelegramRenderer(limit)
        self.live = LiveSettings(first_chars=settings.first_chars, first_delay=settings.first_delay)
        self.allow = AllowList(settings.allow_from)
        self.approval_buttons = ApprovalButtons(self)
        self.offset_key = offset_key(bot.id)
        self.albums = Albums(host, bot.id, window=settings.album_window, max_wait=settings.album_max_wait,
                             clock=album_clock)
        self.moved_from: dict[int, int] = {}
        """Supergroups upgraded from groups: the new chat id, the old one (whose session goes on)."""
        self._moves_kept: set[int] = set()
        self.client.on_move = self._on_move
        self.client.on_poll_failure = self.albums.pause
        self.me: BotIdentity | None = None
        self.drafts_rejected = False
        self._state = "stopped"
        self._poller: asyncio.Task[None] | None = None
        self._receiving = False
        self.ready = asyncio.Event()
        self._downloads: aiohttp.ClientSession | None = None

    # ---- delivery ------------------------------------------------------------------------------

    async def open_sink(self, target: TurnTarget) -> LiveSink:
        dest = Destination.of(target)
        transport = self.settings.stream_transport
        draft = dest.chat_type == "private" and transport != "edit" and not self.drafts_rejected
        sink = LiveSink(TelegramOps(self, dest, draft=draft), self.renderer, self.calls,
                        settings=self.live, prompts=TelegramPrompts(self, target, dest),
                        spawn=self.host.spawn, send_scopes=(self.client.sends,))
        sink.start_typing(delay=self.settings.typing_delay)  # the model request does not wait for it
        return sink

    @contextlib.asynccontextmanager
    async def working(self, target: TurnTarget) -> AsyncIterator[None]:
        """"typing…" while a message's attachments download, before its turn's sink opens (``ShowsWorking``):
        at once, then every ``typing_every`` seconds (Telegram shows it about five), ended with the block. A
        call that fails is logged and the next one tried; nothing waits for them."""
        dest = Destination.of(target)
        action = SendChatAction(chat_id=dest.chat_id, action="typing", message_thread_id=dest.thread_id)

        async def show() -> None:
            while True:
                try:
                    await self.client.call(action, chat=dest.key, paced=False, retry=False)
                except PlatformError as exc:
                    log.debug("typing… could not be shown in a chat: %s", exc)
                await asyncio.sleep(self.live.typing_every)

        try:
            sign: asyncio.Task[None] | None = self.host.spawn(f"telegram:working:{dest.key}", show())
        except ShuttingDownError:  # no sign then; the downloads go on
            sign = None
        try:
            yield
        finally:
            if sign is not None:
                sign.cancel()

    async def send_plain(self, target: TurnTarget, text: str) -> None:
        """One ordinary message (split if long, Markdown rendered as entities, plain if rejected). Each part
        is one paced call under the call policy, which waits out a 429 pause however long. When a part
        fails after the first were sent, the SinkError carries the parts not sent (``unsent``)."""
        dest = Destination.of(target)
        chunks = split_text(text, self.limit) if text.strip() else []
        for i, chunk in enumerate(chunks):
            part = render.format_markdown(chunk, self.limit)
            reply = dest.reply() if i == 0 else None
            try:
                try:
                    await self.client.call(SendMessage(
                        chat_id=dest.chat_id, text=part.text, entities=entities(part), parse_mode=None,
                        message_thread_id=dest.thread_id, reply_parameters=reply), chat=dest.key)
                except PlatformError as exc:
                    if exc.kind != "format":
                        raise
                    await self.client.call(SendMessage(
                        chat_id=dest.chat_id, text=chunk, parse_mode=None, message_thread_id=dest.thread_id,
                        reply_parameters=reply), chat=dest.key)
            except PlatformError as exc:  # the messages before this one are shown: only the rest is missing
                raise SinkError(str(exc), unsent="\n".join(chunks[i:]) if i else None,
                                outcome_unknown=exc.outcome_unknown) from None

    # ---- lifecycle -----------------------------------------------------------------------------

    def state(self) -> str:
        return self._state

    async def start(self) -> None:
        """Begin receiving. Set-up calls that fail (Telegram unreachable, bad token) are retried in the
        background with backoff, so the rest of the bridge starts regardless; /healthz shows "error"."""
        self._receiving = True
        self._state = "starting"
        self._poller = self.host.spawn("telegram:receive", self._receive())

    async def _setup(self) -> None:
        me = await self.client.call(GetMe())
        assert me is not None
        self.me = BotIdentity(me.id, me.username or "")
        await self.client.call(SetMyCommands(commands=[
            BotCommand(command=name, description=text) for name, text in COMMANDS.items()]))
        if self.settings.mode == "webhook":
            await self.client.call(SetWebhook(
                url=self.settings.webhook_url, secret_token=self.settings.webhook_secret,
                allowed_updates=list(ALLOWED_UPDATES)))
        else:  # getUpdates answers 409 while a webhook is set
            await self.client.call(DeleteWebhook(drop_pending_updates=False))

    async def _receive(self) -> None:
        failures = 0
        while self._receiving:
            try:
                await self._setup()
                await self.approval_buttons.close_left_over()
                break
            except PlatformError as exc:
                delay = self._backoff(exc, failures)
                failures += 1
                self._state = ERROR
                log.error("Telegram set-up failed (%s); retrying in %.0fs", exc, delay)
                await asyncio.sleep(delay)
        await self._load_moves()
        await self._recover_albums()
        self._state = self.settings.mode
        self.ready.set()
        if self.settings.mode == "polling":
            await run_as_leader(self._await_lead, self._poll, on_change=self._on_lead)

    async def _load_moves(self) -> None:
        """Read the groups upgraded to supergroups, before anything is received: a message of the new chat
        handled without it would start a session of its own. A store that fails is read again."""
        failures = 0
        while self._receiving:
            try:
                for name in await self.host.state_names(MOVED_PREFIX):
                    value = await self.host.get_state(name)
                    if value is None:
                        continue
                    try:
                        new, old = int(name[len(MOVED_PREFIX):]), int(value)
                    except ValueError:
                        log.error("a kept Telegram group upgrade (%s) cannot be read and is skipped", name)
                        continue
                    self.moved_from[new] = old
                    self.client.moved[old] = new
                    self._moves_kept.add(new)
                return
            except Exception as exc:
                delay = self.settings.poll_backoff[min(failures, len(self.settings.poll_backoff) - 1)]
                failures += 1
                self._state = ERROR
                log.error("could not read the Telegram group upgrades (%s); retrying in %.0fs", exc, delay)
                await asyncio.sleep(delay)

    async def remember_move(self, old: int, new: int) -> None:
        """The group ``old`` is now the supergroup ``new``: its messages go on in the group's session, in this
        run and (once the write is done) every later one. Raises what the store raises."""
        old = self.moved_from.get(old, old)  # a group that moved before keeps its first session
        self.moved_from[new] = old
        self.client.moved.setdefault(old, new)
        if new not in self._moves_kept:
            await self.host.set_state(f"{MOVED_PREFIX}{new}", str(old))
            self._moves_kept.add(new)

    async def _on_move(self, old: int, new: int) -> None:
        """A call found the group upgraded (``TelegramClient.on_move``). A write that fails leaves the move
        known to this run; the service message, when it comes, tries again."""
        try:
            await self.remember_move(old, new)
        except Exception as exc:
            log.warning("could not keep a Telegram group's upgrade to a supergroup: %s", exc)

    def _in_session(self, envelope: InboundEnvelope) -> InboundEnvelope:
        """``envelope`` in the session of the group its chat was upgraded from, if it was."""
        try:
            old = self.moved_from.get(int(envelope.chat_id))
        except ValueError:
            return envelope
        return envelope if old is None else in_session_of(envelope, str(old))

    async def _recover_albums(self) -> None:
        """Hand over the albums a previous run stored but did not hand over. A store that fails here leaves
        them stored for the next start: receiving starts regardless."""
        try:
            await self.albums.recover()
        except Exception as exc:
            log.warning("could not look for Telegram albums left stored (%s); looking again at the next start",
                        exc)

    async def _await_lead(self) -> Lead:
        """Telegram serves a bot's updates to one poller at a time (a second ``getUpdates`` ends the first
        with 409 Conflict), so of the processes sharing a database only the one leading this bot polls."""
        self._state = STANDBY
        return await self.host.lead(f"polling:{self.bot.id}")

    def _on_lead(self, leading: bool) -> None:
        self._state = "polling" if leading else STANDBY
        if leading:
            log.info("Telegram: this process polls for bot %d", self.bot.id)

    def _backoff(self, exc: PlatformError, failures: int) -> float:
        delays = self.settings.poll_backoff
        return exc.retry_after or delays[min(failures, len(delays) - 1)]

    async def stop(self) -> None:
        self._receiving = False
        poller, self._poller = self._poller, None
        if poller is not None:
            poller.cancel()
            with contextlib.suppress(BaseException):
                await poller
        await self.albums.close()  # what was collected goes to core now (or stays stored for the next start)
        if self.settings.mode == "webhook" and self.ready.is_set() and not self.host.shared:
            # deleted when this is the only process; processes sharing a database keep receiving through it
            try:
                await self.client.call(DeleteWebhook(drop_pending_updates=False))
            except PlatformError as exc:
                log.warning("could not delete the Telegram webhook: %s", exc)
        self._state = "stopped"

    async def close(self) -> None:
        await self.bot.session.close()
        await self.client.close()
        if self._downloads is not None:
            await self._downloads.close()

    # ---- attachments ---------------------------------------------------------------------------

    async def fetch_attachment(self, item: MediaItem, target: TurnTarget) -> AsyncGenerator[bytes, None]:
        """The bytes of a file of one of this channel's messages (``core.media.fetch.AttachmentSource``)."""
        try:
            file = await self.client.call(GetFile(file_id=item.file_id))
        except PlatformError as exc:
            raise FetchError(str(exc), too_large="too big" in str(exc).lower()) from None
        if file is None or not file.file_path:
            raise FetchError("getFile answered without a file_path")
        if file.file_path.startswith("/"):
            raise FetchError("the Bot API server keeps this file on its own disk (--local mode)")
        url = self.bot.session.api.file_url(self.bot.token, file.file_path)
        if self._downloads is None:
            self._downloads = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(sock_connect=30, sock_read=60), trust_env=False)
        async for chunk in stream_url(self._downloads, url, allowed_hosts={urlsplit(url).hostname or ""}):
            yield chunk

    # ---- receiving -----------------------------------------------------------------------------

    async def _poll(self) -> None:
        stored: str | None = None
        """The offset as the store last took it."""
        offset: int | None = None
        loaded = False
        failures = 0
        timeout = self.settings.poll_timeout
        while self._receiving:
            if not loaded:
                try:
                    stored = await self._load_offset()
                except Exception as exc:  # the store failed for a moment: polling starts once it answers
                    delay = self.settings.poll_backoff[min(failures, len(self.settings.poll_backoff) - 1)]
                    failures += 1
                    self._state = ERROR
                    log.error("could not read the Telegram update offset (%s); retrying in %.0fs", exc, delay)
                    await asyncio.sleep(delay)
                    continue
                offset = int(stored) if stored else None
                loaded = True
            try:
                updates = await self.client.call(
                    GetUpdates(offset=offset, timeout=timeout,
                               allowed_updates=list(ALLOWED_UPDATES)),
                    request_timeout=timeout + 10)
            except PlatformError as exc:
                delay = self._backoff(exc, failures)
                failures += 1
                self._state = ERROR if failures > 2 else "polling"
                log.warning("Telegram getUpdates failed (%s); retrying in %.0fs", exc, delay)
                self.albums.pause()  # the rest of an album may be waiting at Telegram meanwhile
                await asyncio.sleep(delay)
                continue
            failures = 0
            self._state = "polling"
            if not updates:
                self.albums.resume()
                continue
            outcome, unconfirmed = await self._hand_over(updates)
            if outcome == "refused":
                self.albums.pause()  # until the batch is fetched again (parts of an album among it)
            else:
                self.albums.resume()
            confirmed = [u for u in updates if unconfirmed is None or u.update_id < unconfirmed]
            if confirmed:
                offset = confirmed[-1].update_id + 1
            if offset is not None and str(offset) != stored:
                # persisted once per batch, after every update before it was stored: a crash before this
                # re-fetches the batch, and core's dedupe drops what it stored already. A write that fails
                # changes nothing else: the next getUpdates confirms the batch all the same, and the offset
                # is written with the next batch (a restart before then fetches this one again, as above)
                try:
                    await self.host.set_state(self.offset_key, str(offset))
                    stored = str(offset)
                except Exception as exc:
                    log.warning("could not save the Telegram update offset (%s); saving it with the next batch",
                                exc)
            if outcome == "closing":
                return
            if outcome == "refused":
                delay = self.settings.poll_backoff[0]
                log.warning("a Telegram update could not be stored; fetching it again in %.0fs", delay)
                await asyncio.sleep(delay)

    async def _load_offset(self) -> str | None:
        """This bot's saved offset. A database written before offsets were per bot holds one under
        ``LEGACY_OFFSET_KEY``, which is most likely this bot's (a bridge upgraded with its token unchanged): the
        first bot to poll after the upgrade takes it over and removes it, so that no other bot ever starts
        from it. Raises what the store raises (read again later)."""
        stored = await self.host.get_state(self.offset_key)
        if stored is not None:
            return stored
        legacy = await self.host.get_state(LEGACY_OFFSET_KEY)
        if legacy is not None:
            await self.host.set_state(self.offset_key, legacy)
            await self.host.delete_state(LEGACY_OFFSET_KEY)
            log.info("Telegram: the update offset saved before offsets were per bot is now bot %d's", self.bot.id)
        return legacy

    async def _hand_over(self, updates: list[Update]) -> tuple[str, int | None]:
        """Hand one batch of updates to core: each chat's in order, different chats' at once, so that core
        stores the messages of a burst together (one write for many) rather than one after another. Returns
        how it went ("handled", "closing" or "refused") and the first update that must be fetched again:
        the first one core did not take (shutting down, or it could not be stored), or None. Updates after
        that one that core did take come again too, and its dedupe drops them."""
        lanes: dict[object, list[Update]] = {}
        for update in updates:
            lanes.setdefault(_chat_of(update), []).append(update)

        async def lane(chat_updates: list[Update]) -> tuple[int, str] | None:
            for update in chat_updates:
                try:
                    if not await self._handle_or_skip(update):
                        return update.update_id, "closing"  # shutting down: fetched again
                except AdmissionError:
                    return update.update_id, "refused"  # not stored: fetched again
            return None

        if len(lanes) == 1:
            results = [await lane(updates)]
        else:
            results = await asyncio.gather(*(lane(chat_updates) for chat_updates in lanes.values()))
        stopped = min((r for r in results if r is not None), default=None)
        return ("handled", None) if stopped is None else (stopped[1], stopped[0])

    async def _handle_or_skip(self, update: Update) -> bool:
        """``handle_update``, except that an update our code fails on unexpectedly (a shape it does not
        expect, a bug) is logged and skipped: it is acknowledged like a handled one, so it is neither fetched
        again forever nor allowed to end the receiving of every update after it. Whatever it had handed to
        core before failing stays there, and core's dedupe keeps it from being answered twice."""
        try:
            return await self.handle_update(update)
        except AdmissionError:
            raise
        except Exception as exc:
            log.error("a Telegram update (update_id %d) could not be handled and is skipped: %s", update.update_id,
                      self.client.scrub(f"{type(exc).__name__}: {exc}"))
            log.debug("the failure of Telegram update %d", update.update_id, exc_info=True)
            return True

    async def handle_update(self, update: Update) -> bool:
        """Hand one update to core. False when core no longer accepts input (shutting down); AdmissionError
        when core could not store the message. Either way the update must not be acknowledged."""
        if update.callback_query is not None:
            await self.approval_buttons.on_press(update.callback_query)  # always answers the query
            return True
        message = update.message
        if message is None:
            return True  # edited messages and other update kinds are ignored (see adapter)
        moved = migration(message)
        if moved is not None:  # a group upgraded to a supergroup: nothing to answer, but the move is kept
            try:
                await self.remember_move(*moved)
            except Exception as exc:
                log.error("a Telegram group's upgrade to a supergroup could not be kept: %s", exc)
                raise AdmissionError("the upgrade could not be kept") from exc
            return True
        if self.me is None:
            return False  # not receiving yet (the webhook answers 503 before set-up is done)
        policy = self.settings.group_policy
        try:
            if in_album(message):  # collected with the rest of its album, and kept durably before it is confirmed
                part = album_part(message, self.me, allow=self.allow, group_policy=policy)
                if part is not None:
                    await self.albums.add(dataclasses.replace(part, envelope=self._in_session(part.envelope)))
                return True
            envelope = normalize(message, self.me, allow=self.allow, group_policy=policy)
            if envelope is None:
                return True
            await self.albums.flush_chat(envelope.chat_id)  # an album sent before this message goes first
            await self.host.submit(self._in_session(envelope))
        except ShuttingDownError:
            return False
        return True

    async def webhook(self, request: web.Request) -> web.Response:
        expected = self.settings.webhook_secret
        given = request.headers.get(SECRET_HEADER, "")
        if not expected or not hmac.compare_digest(given.encode(), expected.encode()):
            return web.Response(status=401)
        if not self._receiving or not self.ready.is_set():
            return web.Response(status=503)  # stopping, or not yet knowing who the bot is: delivered again later
        try:
            data: Any = await request.json()
        except web.HTTPRequestEntityTooLarge:
            return web.Response(status=413)  # over the server's body limit: nothing was read into core
        except Exception:  # not JSON, or not in a charset it names
            return web.Response(status=400)
        try:
            update = read_update(data, self.bot)  # without any field aiogram cannot read (channels.telegram.updates)
        except NotAnUpdate:
            return web.Response(status=400)
        if update.callback_query is not None:  # a button press: answered in its own task
            try:
                self.host.spawn(f"telegram:update:{update.update_id}", self.handle_update(update))
            except ShuttingDownError:
                return web.Response(status=503)
            return web.Response(status=200)
        try:
            accepted = await self._handle_or_skip(update)  # returns once core has stored the message
        except AdmissionError:
            accepted = False
        # 200 only for what core keeps: anything else Telegram delivers again later
        return web.Response(status=200 if accepted else 503)

    def routes(self, app: web.Application) -> None:
        app.router.add_post(WEBHOOK_PATH, self.webhook)


def _chat_of(update: Update) -> object:
    """The chat an update belongs to, as far as the order of handling goes (updates of other kinds and button
    presses without their message: each in an order of its own)."""
    message = update.message
    if message is not None:
        return message.chat.id
    return ("update", update.update_id)
