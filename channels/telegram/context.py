"""Where a Telegram message came from, typed once by the adapter and kept with the turn target.

``chat_type`` decides how a reply is shown (drafts in private chats, quoting the user's message in groups),
``message_id`` is the message a group reply quotes, ``topic_id`` the forum topic replies go back into.

Turn targets written before the context was typed hold ``{"chat_type", "message_id"}`` only; their forum
topic is the target's thread (``ThreadRef``), which is where ``of`` takes it from for them.
"""

from __future__ import annotations

from typing import Literal, Self

from channels.common.context import TypedContext
from core.envelope import TurnTarget

ChatType = Literal["private", "group", "supergroup", "channel"]


class TelegramContext(TypedContext):
    chat_type: ChatType
    message_id: int
    topic_id: int | None = None

    @classmethod
    def of(cls, target: TurnTarget) -> Self:
        ctx = super().of(target)
        if ctx.topic_id is None and target.thread is not None and "topic_id" not in target.channel_context.data:
            return ctx.model_copy(update={"topic_id": int(target.thread.thread_id)})  # an older row
        return ctx

    @property
    def private(self) -> bool:
        return self.chat_type == "private"
