"""Posting a message Slack may have posted already: a repeat looks for it first.

``chat.postMessage`` takes no idempotency key. A try that failed in a way that leaves open whether Slack
carried it out (a timeout, a broken connection, ``internal_error`` / ``fatal_error``, which Slack documents as
"some aspect of the operation may have succeeded", a 500 or 504, an answer that cannot be read) would show the
message twice if it were simply made again. So every reply message carries a key in its metadata
(``metadata``: ``chatbridge_message`` with the key), and the next try of such a post first reads the
conversation (``SlackChannel.locate``) for a message carrying that key (or, for an approval request, its
buttons): found, its ts is the answer; not found, it is posted. With this the call policy may repeat a post
like any idempotent call, and the reconciler may count on a repeated key being answered with the message first
posted (``Capabilities.idempotent_sends``).

What remains: a post Slack carries out after the look found nothing (a slow write behind a gateway's 504)
shows twice; a conversation the app cannot read (a history scope missing) gets the post again, as without a
key (logged).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from slack_sdk.errors import SlackApiError

from channels.slack.client import maybe_carried_out

if TYPE_CHECKING:
    from channels.slack.channel import SlackChannel

EVENT_TYPE = "chatbridge_message"
"""The ``event_type`` of the metadata every reply message carries."""

Match = Callable[[dict[str, Any]], bool]


def keyed(key: str) -> dict[str, Any]:
    """The metadata that makes a post findable by ``key``."""
    return {"event_type": EVENT_TYPE, "event_payload": {"key": key}}


def carries_key(key: str) -> Match:
    """Whether a message (as ``conversations.history`` gives it with its metadata) carries ``key``."""

    def match(message: dict[str, Any]) -> bool:
        metadata = message.get("metadata")
        if not isinstance(metadata, dict) or metadata.get("event_type") != EVENT_TYPE:
            return False
        payload = metadata.get("event_payload")
        return isinstance(payload, dict) and payload.get("key") == key

    return match


def carries_button(value: str) -> Match:
    """Whether a message has an approval button carrying ``value`` (an ``ApprovalAction``'s encoding)."""

    def match(message: dict[str, Any]) -> bool:
        return any(isinstance(element, dict) and element.get("value") == value
                   for block in message.get("blocks") or ()
                   if isinstance(block, dict) and block.get("type") == "actions"
                   for element in block.get("elements") or ())

    return match


class FindablePost:
    """One message's post, tried as often as the call policy likes: a try after one that may have been carried
    out looks in the conversation first."""

    def __init__(self, channel: SlackChannel, conversation: str, thread_ts: str | None, match: Match,
                 since: float | None = None) -> None:
        """``since``: when the first try was sent (``time.time()``), where the look starts; by default the
        time of the first try."""
        self._channel = channel
        self._conversation = conversation
        self._thread_ts = thread_ts
        self._match = match
        self._since = since
        self.unsure = False
        """A try was cut off or failed on Slack's side after it may have been carried out."""

    async def post(self, call: Callable[[], Awaitable[Any]]) -> Any:
        """One try: the message's ts in ``{"ts": …}`` when an earlier try is found in the conversation, else
        ``call()`` (the slack_sdk post) and its answer. Raises what ``call`` raises."""
        if self._since is None:
            self._since = time.time()
        if self.unsure:
            found = await self._channel.locate(self._conversation, self._thread_ts, self._match, self._since)
            if found is not None:
                self.unsure = False
                return {"ts": found}
        self.unsure = True  # until Slack answers (a try cut off, or an answer lost, leaves it so)
        try:
            result = await call()
        except SlackApiError as exc:
            self.unsure = maybe_carried_out(exc)  # refused (an error, a 429): nothing was posted
            raise
        self.unsure = False
        return result
