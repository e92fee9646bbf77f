"""Inbound Feishu: one ``im.message.receive_v1`` event → a ``FeishuMessage``, parsed once, typed.

A pure function of the event body (the decrypted webhook JSON, or the long connection's payload) and the
bot's own open_id; it decides nothing about policy (allow lists, group policy, dedupe) and touches no I/O.

- Chats: ``p2p`` or ``group``; the message id, chat id, sender ids (open_id, user_id, union_id — user_id
  only when the app holds the employee-id scope).
- Text: ``text`` content and ``post`` content (title, text, links, @mentions, code blocks, emoji) flattened
  to plain text. Mentions arrive as ``@_user_1``, ``@_user_2``, ... in the text, with a ``mentions``
  list: each becomes ``@Name``; ``@_all`` becomes ``@all``; the bot's own mention is removed from the text
  and recorded in ``mentioned_bot`` (found by open_id, the only id Feishu gives a bot).
- Media: images, files, voice messages (``audio``) and videos (``media``), as message types of their own or
  as images and videos inside a post, become ``Attachment``s and travel as ``MediaItem``s (the key is what
  the message-resource API downloads). A sticker cannot be downloaded (Feishu hands out no sticker
  resources): it is the text ``[sticker]``. A location is its name (or address) and coordinates as text.
- Kinds of message nothing here can read (a forwarded conversation ``merge_forward``, a shared chat or
  contact, a card, a vote, a task, …): ``read_message`` gives them with ``readable`` False and no text, so the
  channel can tell the sender; ``normalize`` gives None for them. System messages are nobody's and give None.
- Threads: a message with a ``thread_id`` is in a thread (a topic group's topic, or a "reply in thread");
  its session is the thread's. ``root_id``/``parent_id`` of a plain quote reply only name the message
  answered (``reply_to``): the conversation stays the chat's. Feishu gives ``thread_id`` on every message
  of a thread, its first one included, so a thread keeps one session from its start.
- Our own messages (sender_type other than ``user``, or the bot's open_id) give None.

Dedupe keys: ``header.event_id`` (one delivery of an event) and ``message_id`` (Feishu documents that the
same message can be pushed again under a new event id, and recommends deduplicating on message_id).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from core.envelope import MediaItem, ReplyTo, ThreadRef

CHANNEL = "feishu"
ChatType = Literal["p2p", "group"]
_MEDIA_TYPES = ("image", "file", "audio", "media")
_MEDIA_KINDS = {"image": "photo", "file": "document", "audio": "voice", "media": "video"}
STICKER = "[sticker]"
LOCATION = "[location]"
NOBODYS = frozenset({"", "system"})
"""Message types that are no one's words (a system message: someone joined, the chat was renamed)."""
_PLACEHOLDER = re.compile(r"@_user_\d+|@_all")


@dataclass(frozen=True, slots=True)
class Sender:
    open_id: str
    user_id: str | None = None
    union_id: str | None = None

    def ids(self) -> tuple[str, ...]:
        """Every id this sender is known by (for ``allow_from``, which may list any of them)."""
        return tuple(i for i in (self.open_id, self.user_id, self.union_id) if i)


@dataclass(frozen=True, slots=True)
class Attachment:
    kind: str  # image | file | audio | media
    key: str
    """image_key or file_key (what the message-resource API downloads)."""
    name: str | None = None
    duration_ms: int | None = None

    def as_media(self) -> MediaItem:
        return MediaItem(kind=_MEDIA_KINDS.get(self.kind, "document"), file_id=self.key, file_name=self.name)


@dataclass(frozen=True, slots=True)
class FeishuMessage:
    event_id: str | None
    message_id: str
    chat_id: str
    chat_type: ChatType
    sender: Sender
    message_type: str
    text: str
    """The words with mentions resolved and the bot's own mention removed (attachments not included)."""
    mentioned_bot: bool
    mentions_all: bool
    root_id: str | None = None
    parent_id: str | None = None
    thread_id: str | None = None
    attachments: tuple[Attachment, ...] = ()
    create_time_ms: int | None = None
    readable: bool = True
    """False for a user's message of a kind this bridge cannot read (``message_type`` says which)."""

    @property
    def thread(self) -> ThreadRef | None:
        return ThreadRef(thread_id=self.thread_id) if self.thread_id else None

    @property
    def reply_to(self) -> ReplyTo | None:
        """The message this one answers, when it quotes one (a thread's first message answers none)."""
        return ReplyTo(message_id=self.parent_id) if self.parent_id else None

    def session_key(self) -> str:
        """One session per p2p chat and per group, and per thread where the message is in a thread."""
        base = f"{CHANNEL}:{self.chat_id}"
        return f"{base}:{self.thread_id}" if self.thread_id else base

    def dedupe_keys(self) -> tuple[str, ...]:
        keys = [f"{CHANNEL}:msg:{self.message_id}"]
        if self.event_id:
            keys.insert(0, f"{CHANNEL}:event:{self.event_id}")
        return tuple(keys)

    @property
    def media(self) -> tuple[MediaItem, ...]:
        return tuple(a.as_media() for a in self.attachments)


@dataclass(frozen=True, slots=True)
class _Mention:
    key: str
    name: str
    open_id: str | None


def _map(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _str(value: Any) -> str | None:
    return str(value) if isinstance(value, str | int) and str(value) else None


def _whole(value: Any) -> int | None:
    """A whole number from a JSON number or a string of ASCII digits; None for anything else. Python's json
    reads ``NaN``, ``Infinity`` and ``1e400`` as floats ``int`` refuses, and ``str.isdigit`` is true for
    digits ``int`` refuses ("²")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if math.isfinite(value) else None
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


def _mentions(message: Mapping[str, Any]) -> list[_Mention]:
    found = []
    raw_mentions = message.get("mentions")
    for raw in raw_mentions if isinstance(raw_mentions, list) else []:
        if not isinstance(raw, Mapping):
            continue
        ids = _map(raw.get("id"))
        found.append(_Mention(str(raw.get("key", "")), str(raw.get("name") or ""), _str(ids.get("open_id"))))
    return found


def _resolve(text: str, mentions: list[_Mention], bot_open_id: str | None) -> str:
    by_key = {m.key: m for m in mentions}

    def replace(match: re.Match[str]) -> str:
        key = match.group(0)
        if key == "@_all":
            return "@all"
        mention = by_key.get(key)
        if mention is None:
            return key
        if bot_open_id and mention.open_id == bot_open_id:
            return ""
        return f"@{mention.name}" if mention.name else ""

    resolved = _PLACEHOLDER.sub(replace, text)
    # removing the bot's mention leaves doubled spaces and a leading space: tidy each line
    return "\n".join(re.sub(r"[ \t]{2,}", " ", line).strip() for line in resolved.split("\n")).strip()


def _post_text(content: Mapping[str, Any], attachments: list[Attachment]) -> str:
    """A received post (``{"title", "content": [[node, …], …]}``) as plain text; a post sent in several
    languages (``{"zh_cn": {…}}``) uses its first one."""
    body: Mapping[str, Any] = content
    if "content" not in content:
        body = _map(next((v for v in content.values() if isinstance(v, Mapping)), None))
    lines: list[str] = []
    title = _str(body.get("title"))
    if title:
        lines.append(title)
    paragraphs = body.get("content")
    for paragraph in paragraphs if isinstance(paragraphs, list) else []:
        if not isinstance(paragraph, list):
            continue
        line = ""
        for node in paragraph:
            if not isinstance(node, Mapping):
                continue
            tag = node.get("tag")
            if tag in ("text", "md"):
                line += str(node.get("text", ""))
            elif tag == "a":
                text, href = str(node.get("text") or ""), str(node.get("href") or "")
                line += f"[{text}]({href})" if text and href and text != href else (href or text)
            elif tag == "at":
                user = str(node.get("user_id") or "")
                line += user if user.startswith("@_") else f"@{node.get('user_name') or user}"
            elif tag == "code_block":
                lang = str(node.get("language") or "").lower()
                line += f"\n```{lang}\n{node.get('text', '')}\n```\n"
            elif tag == "emotion":
                line += f":{node.get('emoji_type', '')}:"
            elif tag == "hr":
                line += "---"
            elif tag == "img" and node.get("image_key"):
                attachments.append(Attachment("image", str(node["image_key"])))
            elif tag == "media" and node.get("file_key"):
                attachments.append(Attachment("media", str(node["file_key"]), _str(node.get("file_name"))))
        lines.append(line)
    return "\n".join(lines)


def _location_text(content: Mapping[str, Any]) -> str | None:
    """A shared location (``{"name", "longitude", "latitude"}``, an ``address`` in some clients) as one line of
    text; None when it carries neither a place nor coordinates."""
    place = ", ".join(dict.fromkeys(p for p in (_str(content.get("name")), _str(content.get("address"))) if p))
    lat, lon = _coordinate(content.get("latitude")), _coordinate(content.get("longitude"))
    where = f"latitude {lat}, longitude {lon}" if lat is not None and lon is not None else ""
    if not place and not where:
        return None
    if place and where:
        return f"{LOCATION} {place} ({where})"
    return f"{LOCATION} {place or where}"


def _coordinate(value: Any) -> str | None:
    """A latitude or longitude as Feishu gives it (a string or a number), if it is a finite number."""
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        return None
    try:
        number = float(value)
    except ValueError:
        return None
    return str(value).strip() if math.isfinite(number) else None


def normalize(event: Mapping[str, Any], bot_open_id: str | None) -> FeishuMessage | None:
    """The message in an ``im.message.receive_v1`` body (``{"schema": "2.0", "header", "event"}``), or None
    when it is not a user's message this bridge can read."""
    message = read_message(event, bot_open_id)
    return message if message is not None and message.readable else None


def read_message(event: Mapping[str, Any], bot_open_id: str | None) -> FeishuMessage | None:
    """The message in an ``im.message.receive_v1`` body, or None when it is not a user's message (ours, a
    system message, another event, a body without the ids). A user's message of a kind this bridge cannot read
    comes with ``readable`` False and no text."""
    header, body = _map(event.get("header")), _map(event.get("event"))
    if header and header.get("event_type") not in (None, "im.message.receive_v1"):
        return None
    sender, message = _map(body.get("sender")), _map(body.get("message"))
    ids = _map(sender.get("sender_id"))
    open_id = _str(ids.get("open_id"))
    message_id, chat_id = _str(message.get("message_id")), _str(message.get("chat_id"))
    # a chat that is not one to one is a group, whatever Feishu names its kind ("topic_group" for a group of
    # topics, and any kind added later): its messages are answered under the group policy, not dropped
    kind = message.get("chat_type")
    if not open_id or not message_id or not chat_id or not isinstance(kind, str) or not kind:
        return None
    chat_type: ChatType = "p2p" if kind == "p2p" else "group"
    if sender.get("sender_type", "user") != "user" or (bot_open_id and open_id == bot_open_id):
        return None
    message_type = str(message.get("message_type") or "")
    try:
        content = json.loads(str(message.get("content") or "{}"))
    except ValueError:
        content = {}
    content = _map(content)
    attachments: list[Attachment] = []
    readable = True
    location = _location_text(content) if message_type == "location" else None
    if message_type in NOBODYS:
        return None
    if message_type == "text":
        raw_text = str(content.get("text") or "")
    elif message_type == "post":
        raw_text = _post_text(content, attachments)
    elif message_type == "sticker":
        raw_text = STICKER
    elif message_type in _MEDIA_TYPES:
        raw_text = ""
        key = _str(content.get("image_key") if message_type == "image" else content.get("file_key"))
        if key:
            attachments.append(Attachment(message_type, key, _str(content.get("file_name")),
                                          _whole(content.get("duration"))))
    elif location is not None:
        raw_text = location
    else:  # forwarded conversations, shares, cards, votes, …: nothing a model could answer
        raw_text, readable = "", False
    mentions = _mentions(message)
    create_time = message.get("create_time")
    return FeishuMessage(
        event_id=_str(header.get("event_id")), message_id=message_id, chat_id=chat_id, chat_type=chat_type,
        sender=Sender(open_id, _str(ids.get("user_id")), _str(ids.get("union_id"))),
        message_type=message_type, text=_resolve(raw_text, mentions, bot_open_id),
        mentioned_bot=bool(bot_open_id) and any(m.open_id == bot_open_id for m in mentions),
        mentions_all="@_all" in raw_text,
        root_id=_str(message.get("root_id")), parent_id=_str(message.get("parent_id")),
        thread_id=_str(message.get("thread_id")), attachments=tuple(attachments),
        create_time_ms=_whole(create_time), readable=readable)
