"""Inbound Telegram: authorize and normalise one message into an InboundEnvelope.

- Private chats, groups, supergroups and forum topics; a forum topic is its own session (ThreadRef)
  and its replies go back into it (``message_thread_id``).
- ``allow_from`` is checked before anything reaches core: user ids or usernames (with or without "@"),
  "*" for everyone, an empty list for nobody.
- Groups follow ``group_policy``: ``mention`` answers only a message that mentions the bot (an @username
  mention entity, or a text mention of the bot) or replies to one of its messages, plus commands meant
  for it; ``all`` answers every message; ``off`` ignores groups. A command addressed to another bot
  (``/help@other_bot``) is never ours, under any policy and in private chats too: it is left out.
- Captions count as text; photos (the largest size Telegram offers), documents, audio, voice notes, video
  and video notes become MediaItems, which core downloads in the turn (``TelegramChannel.fetch_attachment``).
  A message with an attachment and no caption is answered too.
- An album (several messages sharing a ``media_group_id``) is one message to core, addressed when any of its
  parts is: ``album_part`` normalises each part, ``channels.telegram.albums`` collects and merges them.
- Edited messages are ignored: the original was answered already, and answering the edit would be a
  second reply to one message. (Their update_id still advances the polling offset.)
- The envelope's event_id is "<bot id>:<chat_id>:<message_id>", so core's durable dedupe drops a re-delivered
  update even after a restart, and never the message of another bot that uses the same database (message ids
  are numbered per chat as each bot sees it: two bots in one chat, or a token replaced, repeat them). A
  message stored before ids named the bot and delivered again after the upgrade (a crash between storing it
  and saving the offset, across the upgrade) is not recognised; the offset, taken over, keeps that to the
  last batch.
- A group upgraded to a supergroup gets a new chat id; ``migration`` reads the upgrade from Telegram's service
  message, and ``in_session_of`` has a message of the new chat go on in the group's session (its history, a
  /stop there stopping a reply begun in the group) while its reply goes to the new chat.
- The reply's destination (chat type, message id, forum topic) is typed here, once, as a
  ``TelegramContext`` that travels with the turn target.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from aiogram.types import Message, User

from channels.telegram.albums import ALBUM_ID, AlbumPart
from channels.telegram.context import TelegramContext
from core.envelope import InboundEnvelope, MediaItem, ReplyTo, ThreadRef
from core.router import parse_command

CHANNEL = "telegram"
GROUP_TYPES = ("group", "supergroup")


@dataclass(frozen=True, slots=True)
class BotIdentity:
    id: int
    username: str


_USERNAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{2,31}")


def vouched_username(user: User) -> str | None:
    """The user's @username when it has the form Telegram gives usernames (a letter, then letters, digits
    and underscores), else None. Only such a name is one Telegram vouches is this user's alone; anything
    else in the field (an update Telegram did not write) could be shaped like someone else's numeric id,
    which an allow list names too."""
    name = user.username
    return name if name and _USERNAME.fullmatch(name) else None


class AllowList:
    def __init__(self, entries: Iterable[str]) -> None:
        items = [str(e).strip() for e in entries]
        self.everyone = "*" in items
        self.ids = {e for e in items if e.lstrip("-").isdigit()}
        self.usernames = {e.lstrip("@").lower() for e in items if e != "*" and not e.lstrip("-").isdigit()}

    def allows(self, user: User) -> bool:
        if self.everyone:
            return True
        if str(user.id) in self.ids:
            return True
        username = vouched_username(user)
        return username is not None and username.lower() in self.usernames


def _entity_text(text: str, offset: int, length: int) -> str:
    """The part of ``text`` an entity covers (offsets in UTF-16 code units). Written here rather than with
    aiogram's ``MessageEntity.extract_from``, which raises on a lone surrogate in the text or on an entity
    that ends inside a surrogate pair: an update must never crash the receiving loop."""
    units = text.encode("utf-16-le", "surrogatepass")
    start = max(0, offset) * 2
    return units[start:start + max(0, length) * 2].decode("utf-16-le", "replace")


def _mentions_bot(message: Message, me: BotIdentity) -> bool:
    text = message.text or message.caption or ""
    for ent in message.entities or message.caption_entities or []:
        if ent.type == "mention":
            mention = _entity_text(text, ent.offset, ent.length)
            if mention.lstrip("@").lower() == me.username.lower():
                return True
        elif ent.type == "text_mention" and ent.user is not None and ent.user.id == me.id:
            return True
    return False


_ADDRESSED_COMMAND = re.compile(r"/\w+@(\S*)")


def _addressee(text: str) -> str | None:
    """The bot a leading command names (``/help@other_bot`` → "other_bot", read as core reads it: anything up
    to the first space), lower-cased as Telegram compares usernames; None for a command naming none."""
    words = text.strip().split(maxsplit=1)
    found = _ADDRESSED_COMMAND.fullmatch(words[0]) if words else None
    return found.group(1).lower() if found is not None else None


def _command_for_bot(message: Message, me: BotIdentity) -> bool:
    text = message.text or ""
    if parse_command(text.strip()) is None:
        return False
    name = _addressee(text)
    return name is None or name == me.username.lower()


def command_for_another_bot(text: str, me: BotIdentity) -> bool:
    """Whether ``text`` begins with a command addressed to a bot other than ours (``/help@other_bot``, with or
    without words after it). Core takes ``/new@<any name>`` for its own ``/new``, so such a message must not
    reach it."""
    name = _addressee(text)
    return name is not None and name != me.username.lower()


def addressed(message: Message, me: BotIdentity) -> bool:
    """Whether a group message is meant for the bot (``group_policy = "mention"``)."""
    reply = message.reply_to_message
    if reply is not None and reply.from_user is not None and reply.from_user.id == me.id:
        # a reply to the bot; but in a forum, every message "replies" to the topic's first message
        if not (message.is_topic_message and reply.message_id == message.message_thread_id):
            return True
    return _mentions_bot(message, me) or _command_for_bot(message, me)


def _strip_mention(text: str, me: BotIdentity) -> str:
    if not me.username:
        return text
    return re.sub(rf"@{re.escape(me.username)}\b", "", text, flags=re.IGNORECASE).strip()


def media_items(message: Message) -> list[MediaItem]:
    caption = message.caption
    items: list[MediaItem] = []
    if message.photo:
        best = max(message.photo, key=lambda p: p.width * p.height)
        items.append(MediaItem(kind="photo", file_id=best.file_id, mime_type="image/jpeg", size=best.file_size,
                               caption=caption))
    for kind, obj in (("document", message.document), ("audio", message.audio), ("video", message.video),
                      ("voice", message.voice), ("video", message.video_note)):
        if obj is not None:
            items.append(MediaItem(kind=kind, file_id=obj.file_id, mime_type=getattr(obj, "mime_type", None),
                                   file_name=getattr(obj, "file_name", None), size=obj.file_size, caption=caption))
    return items


def sender_name(user: User) -> str:
    name = " ".join(p for p in (user.first_name, user.last_name) if p)
    return name or (f"@{user.username}" if user.username else str(user.id))


def normalize(message: Message, me: BotIdentity, *, allow: AllowList, group_policy: str) -> InboundEnvelope | None:
    """The envelope for ``message``, or None when it must not reach core (unauthorised, not addressed,
    nothing to answer)."""
    prepared = prepare(message, me, allow=allow, group_policy=group_policy, only_addressed=True)
    return prepared[0] if prepared is not None else None


def album_part(message: Message, me: BotIdentity, *, allow: AllowList, group_policy: str) -> AlbumPart | None:
    """``message`` as one part of its album (``channels.telegram.albums``), or None when it must not reach core
    even as part of one (unauthorised, groups off, nothing in it). Whether the album is addressed to the bot is
    decided over all its parts: the mention is usually in the caption of the first only."""
    album_id = message.media_group_id
    prepared = prepare(message, me, allow=allow, group_policy=group_policy, only_addressed=False)
    if album_id is None or prepared is None:
        return None
    envelope, is_addressed = prepared
    return AlbumPart(chat_id=envelope.chat_id, album_id=album_id, message_id=message.message_id,
                     envelope=envelope, addressed=is_addressed)


def migration(message: Message) -> tuple[int, int] | None:
    """(the old chat id, the new one) when ``message`` is Telegram's notice that a group was upgraded to a
    supergroup (sent in both chats), else None."""
    if message.migrate_to_chat_id is not None:
        return message.chat.id, message.migrate_to_chat_id
    if message.migrate_from_chat_id is not None:
        return message.migrate_from_chat_id, message.chat.id
    return None


def in_session_of(envelope: InboundEnvelope, chat_id: str) -> InboundEnvelope:
    """``envelope``, answered in its own chat, in the session ``chat_id`` would have (the group its supergroup
    was upgraded from): core keys a session by the envelope's ``session_key`` when one is set."""
    return envelope.model_copy(update={"session_key": envelope.model_copy(update={"chat_id": chat_id}).key()})


def in_album(message: Message) -> bool:
    """Whether ``message`` is one of an album's, to be collected with the others (``channels.telegram.albums``)."""
    album_id = message.media_group_id
    return album_id is not None and ALBUM_ID.fullmatch(album_id) is not None


def prepare(message: Message, me: BotIdentity, *, allow: AllowList, group_policy: str,
            only_addressed: bool) -> tuple[InboundEnvelope, bool] | None:
    """The envelope for ``message`` and whether it is addressed to the bot (always, outside groups and under
    ``group_policy = "all"``); None when it must not reach core whoever it is addressed to, and, with
    ``only_addressed``, when it is not addressed to the bot."""
    user = message.from_user
    chat = message.chat
    if user is None or user.is_bot or chat.type == "channel":
        return None
    if not allow.allows(user):
        return None
    text = message.text if message.text is not None else (message.caption or "")
    if command_for_another_bot(text, me):
        # A command for another bot (``/new@other_bot``) is that bot's business, whatever the group policy: in
        # a group with several bots its user expects only that bot to act, and our bot to stay silent, as it
        # does for any message not meant for it. Passing it on as plain text instead would have our model
        # answer a command it was not sent (and core would still read ``/new@...`` as its own /new). In a
        # private chat with our bot no other bot reads it, but it is still not addressed to us: left out too.
        return None
    is_addressed = True
    if chat.type in GROUP_TYPES:
        if group_policy == "off":
            return None
        is_addressed = group_policy != "mention" or addressed(message, me)
        if only_addressed and not is_addressed:
            return None
        text = _strip_mention(text, me)
    media = media_items(message)
    if not text.strip() and not media:
        return None
    topic = message.message_thread_id if message.is_topic_message and message.message_thread_id else None
    thread = ThreadRef(thread_id=str(topic)) if topic else None
    reply_to = None
    reply = message.reply_to_message
    if reply is not None and not (thread is not None and reply.message_id == message.message_thread_id):
        author = reply.from_user
        reply_to = ReplyTo(message_id=str(reply.message_id), text=reply.text or reply.caption,
                           sender_id=str(author.id) if author else None,
                           sender_name=sender_name(author) if author else None,
                           from_bot=author is not None and author.id == me.id)
    envelope = InboundEnvelope(
        channel=CHANNEL, chat_id=str(chat.id), sender_id=str(user.id), content=text,
        sender_name=sender_name(user), media=tuple(media), reply_to=reply_to, thread=thread,
        event_id=f"{me.id}:{chat.id}:{message.message_id}",
        channel_context=TelegramContext.model_validate(
            {"chat_type": chat.type, "message_id": message.message_id, "topic_id": topic}).wrap())
    return envelope, is_addressed
