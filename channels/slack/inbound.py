"""Inbound Slack: one Events API event → the few facts the channel needs, as a pure function.

``normalize(body, bot)`` reads an ``event_callback`` body (the same over Socket Mode and HTTP) and returns a
``SlackInbound``: what kind of message it is, where it was written, the user's text with the bot's mention
stripped and Slack's markup made readable, the thread, attached files as ``MediaItem``s, and — when the message
must not reach core — why (``ignore``). Authorisation, group policy and dedupe storage are the channel's; this
module only says what the event is.

Rules (Slack's event shapes, and DESIGN.md §4):
- kinds: ``dm`` (an ``im``), ``mention`` (the bot is @-mentioned; ``app_mention`` or a ``message`` whose text
  has ``<@BOT>``), ``thread_reply`` (a reply in a thread without a mention: answered only in a thread the
  bot has joined), ``channel_message`` (anything else in a channel or group DM);
- ignored: the bot's own messages, other bots' messages (``bot_id`` or ``bot_message``), hidden events, and
  subtypes that are not new user input (edits ``message_changed``, ``message_deleted``, joins/leaves, topic
  changes, ...). Kept subtypes: ``file_share``, ``thread_broadcast``, ``me_message``;
- ignored too: any event carrying ``edited``. Editing a message sends ``message_changed`` (a subtype, above),
  and editing one that mentions the bot also sends a new ``app_mention`` with the original ts and an
  ``edited`` field. The original was answered already (edits are not answered, as in Telegram's channel;
  a mention added by an edit neither), and the ``(channel, ts)`` dedupe catches such an event only within
  its TTL: an old message edited would be answered a second time;
- one session per DM and per thread. A DM's top level is one session (replies go to the top level); a
  message in a thread belongs to that thread's session; a channel message starts a thread rooted at itself,
  and is answered there (``reply_thread_ts``);
- dedupe keys: the envelope's ``event_id`` and ``(channel, ts)``. Slack delivers a channel mention twice —
  ``app_mention`` and ``message``, with different event_ids — and both normalise to the same
  ``(channel, ts)``, so the second is dropped however the two arrive.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from core.envelope import MediaItem

CHANNEL = "slack"

Kind = Literal["dm", "mention", "thread_reply", "channel_message"]

USER_INPUT_SUBTYPES = frozenset({"file_share", "thread_broadcast", "me_message"})
_LINK = re.compile(r"<([^<>|]+)(?:\|([^<>]*))?>")


@dataclass(frozen=True, slots=True)
class BotIdentity:
    """Who the bot is in this workspace (from ``auth.test``)."""

    user_id: str
    bot_id: str | None = None
    team_id: str | None = None


@dataclass(frozen=True, slots=True)
class SlackInbound:
    kind: Kind | None
    """None when the event is ignored."""
    ignore: str | None
    """Why the event must not reach core (``"own_message"``, ``"bot_message"``, ``"subtype:<x>"``, ...)."""
    channel: str
    channel_type: str
    """``im``, ``mpim``, ``channel`` or ``group``."""
    user: str | None
    text: str
    """The user's words: the bot mention stripped, links and entities made readable."""
    ts: str
    thread_ts: str | None
    """The thread the message is in (None at the top level)."""
    mentions_bot: bool
    event_id: str | None
    team_id: str | None
    files: tuple[MediaItem, ...] = ()
    parent_user_id: str | None = None

    @property
    def reply_thread_ts(self) -> str | None:
        """Where the answer goes: the message's thread; a new thread under a channel message; the DM's top
        level for a top-level DM message."""
        if self.thread_ts:
            return self.thread_ts
        return None if self.channel_type == "im" else self.ts

    @property
    def thread_id(self) -> str | None:
        """The thread part of the session (``ThreadRef.thread_id``): the reply thread."""
        return self.reply_thread_ts

    @property
    def session_key(self) -> str:
        """``slack:<channel>`` for a DM's top level, ``slack:<channel>:<thread ts>`` for a thread (the key an
        ``InboundEnvelope`` with ``chat_id=channel`` and ``thread=ThreadRef(thread_id)`` derives)."""
        thread = self.thread_id
        return f"{CHANNEL}:{self.channel}:{thread}" if thread else f"{CHANNEL}:{self.channel}"

    @property
    def dedupe_keys(self) -> tuple[str, ...]:
        """Keys under which this message is remembered as handled: any one seen before means "drop"."""
        keys = [f"{CHANNEL}:msg:{self.channel}:{self.ts}"]
        if self.event_id:
            keys.insert(0, f"{CHANNEL}:event:{self.event_id}")
        return tuple(keys)


def readable(text: str, bot_user_id: str | None = None) -> str:
    """Slack message markup → plain text: ``<url|label>`` → ``label (url)``, ``<@U1>`` → ``@U1``,
    ``<#C1|general>`` → ``#general``, ``<!here>`` → ``@here``, entities unescaped; the bot's own mention
    removed."""
    def link(m: re.Match[str]) -> str:
        target, label = m.group(1), m.group(2)
        if target.startswith("@"):
            return "" if bot_user_id and target[1:] == bot_user_id else f"@{label or target[1:]}"
        if target.startswith("#"):
            return f"#{label or target[1:]}"
        if target.startswith("!"):
            name = target[1:].split("^", 1)[0]
            return f"@{label or name}"
        if label and label != target and label != target.removeprefix("mailto:"):
            return f"{label} ({target})"
        return label or target
    out = _LINK.sub(link, text)
    out = html.unescape(out)
    return re.sub(r"[ \t]{2,}", " ", out).strip()


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _media(files: Any) -> tuple[MediaItem, ...]:
    items = []
    for f in files if isinstance(files, list) else []:
        if not isinstance(f, Mapping):
            continue
        mime = str(f.get("mimetype") or "") or None
        kind = "document"
        if mime:
            head = mime.split("/", 1)[0]
            kind = {"image": "photo", "audio": "audio", "video": "video"}.get(head, "document")
        size = f.get("size")
        items.append(MediaItem(kind=kind, file_id=str(f.get("id") or ""), mime_type=mime,
                               file_name=str(f.get("name") or f.get("title") or "") or None,
                               size=int(size) if isinstance(size, int) else None))
    return tuple(items)


def normalize(body: Mapping[str, Any], bot: BotIdentity) -> SlackInbound:
    """What the ``event_callback`` ``body`` is (see the module docstring). A body or event of the wrong shape
    (not an object) is ignored as ``incomplete`` rather than raised on: a signed request is Slack's, but a
    crash here would only make Slack send it again and again."""
    body = _map(body)
    event = _map(body.get("event"))
    etype = str(event.get("type") or "")
    channel = str(event.get("channel") or "")
    channel_type = str(event.get("channel_type") or _channel_type(channel))
    user = event.get("user")
    raw_text = str(event.get("text") or "")
    subtype = event.get("subtype")
    thread_ts = event.get("thread_ts") or None
    ts = str(event.get("ts") or event.get("event_ts") or "")
    mentions = f"<@{bot.user_id}" in raw_text or etype == "app_mention"

    def result(kind: Kind | None, ignore: str | None, text: str = "") -> SlackInbound:
        return SlackInbound(kind=kind, ignore=ignore, channel=channel, channel_type=channel_type,
                            user=str(user) if user else None, text=text, ts=ts,
                            thread_ts=str(thread_ts) if thread_ts else None, mentions_bot=mentions,
                            event_id=str(body.get("event_id") or "") or None,
                            team_id=str(body.get("team_id") or event.get("team") or "") or None,
                            files=_media(event.get("files")),
                            parent_user_id=str(event.get("parent_user_id") or "") or None)

    if etype not in ("message", "app_mention"):
        return result(None, f"event:{etype or 'unknown'}")
    if (user is not None and str(user) == bot.user_id) or (bot.bot_id and event.get("bot_id") == bot.bot_id):
        return result(None, "own_message")
    if event.get("bot_id") or subtype == "bot_message" or event.get("bot_profile"):
        return result(None, "bot_message")
    if subtype and (not isinstance(subtype, str) or subtype not in USER_INPUT_SUBTYPES):
        return result(None, f"subtype:{str(subtype)[:40]}")  # a garbled one is not user input either
    if event.get("edited"):
        return result(None, "edited")
    if event.get("hidden"):
        return result(None, "hidden")
    if not user or not channel or not ts:
        return result(None, "incomplete")
    text = readable(raw_text, bot.user_id)
    if not text and not _media(event.get("files")):
        return result(None, "empty")
    if channel_type == "im":
        kind: Kind = "dm"
    elif mentions:
        kind = "mention"
    elif thread_ts:
        kind = "thread_reply"
    else:
        kind = "channel_message"
    return result(kind, None, text)


def _channel_type(channel: str) -> str:
    # app_mention events carry no channel_type; Slack's id prefixes tell DMs apart
    if channel.startswith("D"):
        return "im"
    if channel.startswith("G"):
        return "group"
    return "channel"
