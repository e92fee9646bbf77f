"""What a channel hands to core: one normalised inbound message, and where its reply goes.

Every string in an envelope is made sound as it is built (``core.text``): a platform or a browser may send
an unpaired surrogate (a JSON ``"\\ud800"``), which would otherwise make the message impossible to store.
"""

from __future__ import annotations

import time
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue

from core.text import sound_text, sound_value

Text = Annotated[str, AfterValidator(sound_text)]


class ChannelContext(BaseModel):
    """Opaque, JSON-serialisable platform data.

    Only the originating channel reads ``data``: it writes its own typed context here once, when it
    normalises a message, and reads the same type back from a turn target (``channels.common.context``).
    Core stores it and hands it back unchanged with the turn target or an error reply, so a reply target
    survives a restart.
    """

    model_config = ConfigDict(frozen=True)

    data: Annotated[dict[str, JsonValue], AfterValidator(sound_value)] = Field(default_factory=dict)


class ReplyTo(BaseModel):
    """The platform message this one answers (a quote or reply), if any."""

    model_config = ConfigDict(frozen=True)

    message_id: Text
    text: Text | None = None
    """The replied-to message's text (or caption), when the platform hands it over: the model is shown it."""
    sender_id: Text | None = None
    sender_name: Text | None = None
    from_bot: bool = False
    """The replied-to message is the bot's own (an earlier answer)."""


class ThreadRef(BaseModel):
    """A thread or forum topic inside a chat; part of the session key."""

    model_config = ConfigDict(frozen=True)

    thread_id: Text


class MediaItem(BaseModel):
    """One attachment of a message, as its platform describes it. Core downloads it in the turn through the
    channel's ``core.media.fetch.AttachmentSource``; ``mime_type``, ``file_name`` and ``size`` are the
    platform's claims (a declared size over the cap spares the download; the type is sniffed from the bytes)."""

    model_config = ConfigDict(frozen=True)

    kind: Text  # photo | document | audio | voice | video | other
    file_id: Text
    mime_type: Text | None = None
    file_name: Text | None = None
    size: int | None = None
    caption: Text | None = None
    attachment_id: Text | None = None
    """Already stored by core (a web upload, ``SessionHost.upload``): nothing to download."""


class InboundEnvelope(BaseModel):
    """One normalised, authorised message from a channel."""

    model_config = ConfigDict(frozen=True)

    channel: Text
    chat_id: Text
    sender_id: Text
    content: Text
    received_at: float = Field(default_factory=time.time)
    sender_name: Text | None = None
    media: tuple[MediaItem, ...] = ()
    reply_to: ReplyTo | None = None
    thread: ThreadRef | None = None
    event_id: Text | None = None
    """Platform-unique id for dedupe (e.g. Telegram update_id); None disables dedupe."""
    session_key: Text | None = None
    """Explicit session key (the web chat names sessions itself); default derives from chat and thread."""
    channel_context: ChannelContext = Field(default_factory=ChannelContext)

    def key(self) -> str:
        if self.session_key:
            return self.session_key
        base = f"{self.channel}:{self.chat_id}"
        return f"{base}:{self.thread.thread_id}" if self.thread else base

    def target(self) -> TurnTarget:
        return TurnTarget(
            channel=self.channel,
            chat_id=self.chat_id,
            session_key=self.key(),
            sender_id=self.sender_id,
            reply_to=self.reply_to,
            thread=self.thread,
            channel_context=self.channel_context,
        )


class TurnTarget(BaseModel):
    """Where the reply of one turn goes. Persisted with the turn, so it survives a crash."""

    model_config = ConfigDict(frozen=True)

    channel: str
    chat_id: str
    session_key: str
    sender_id: str | None = None
    reply_to: ReplyTo | None = None
    thread: ThreadRef | None = None
    channel_context: ChannelContext = Field(default_factory=ChannelContext)
