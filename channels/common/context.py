"""Typed channel context: a channel's own description of where a message came from and where its reply goes.

A channel parses a platform event once, when it normalises it, into its :class:`TypedContext` subclass
(Telegram: chat type, message id, forum topic; Slack: channel, ts, thread_ts; ...) and stores it in the
envelope with ``wrap()``. Core keeps it as opaque JSON with the turn target, so a reply target survives a
restart; the channel reads it back with ``of(target)``. Nothing downstream re-parses a free dict or guesses
a chat type from an id.

A context model must keep reading what earlier versions of the channel wrote (rows of turns that were
running when the process stopped): add fields with defaults, never rename or drop one without a reader
for the old shape.
"""

from __future__ import annotations

from typing import Self

from pydantic import BaseModel, ConfigDict

from core.envelope import ChannelContext, TurnTarget


class TypedContext(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    def wrap(self) -> ChannelContext:
        """The envelope's ``channel_context`` for this value (JSON data; unset optional fields left out)."""
        return ChannelContext(data=self.model_dump(mode="json", exclude_none=True))

    @classmethod
    def of(cls, target: TurnTarget) -> Self:
        """Read the context back from a turn target (raises ValidationError when it is not this type)."""
        return cls.model_validate(target.channel_context.data)
