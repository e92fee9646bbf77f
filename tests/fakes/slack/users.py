"""What Slack users do, as the payloads Slack sends an app: messages, mentions, edits, button presses, commands.

Each action also changes what ``FakeSlack`` stores (a user's message is in its channel, so threads, reactions
and ``conversations.replies`` see it). The payloads are handed to the Socket Mode fake or the HTTP sender.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tests.fakes.slack.server import FakeSlack, Message


class UserActions:
    def user_message(self: FakeSlack, text: str, *, channel: str = "D0ALICE", user: str = "U0ALICE",
                     thread_ts: str | None = None, files: list[dict[str, Any]] | None = None,
                     subtype: str | None = None, event_type: str = "message") -> dict[str, Any]:
        """A user writes ``text``: the message is stored in the channel (so conversations.replies and reactions
        see it) and the Events API ``event_callback`` body for it is returned."""
        if channel not in self.channel_types:
            raise KeyError(f"unknown channel {channel}; add_channel() it first")
        from tests.fakes.slack.server import Message  # the store's type; server.py imports this module

        message = Message(channel, self.next_ts(), text, [], user=user, thread_ts=thread_ts, subtype=subtype,
                          files=list(files or []))
        self.channels[channel][message.ts] = message
        return self.event_callback(self._user_event(message, event_type))

    def mention(self: FakeSlack, text: str, *, channel: str = "C0GENERAL", user: str = "U0ALICE",
                thread_ts: str | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """A user mentions the bot in a channel. Slack delivers TWO events for the one message, each with its
        own event_id: ``app_mention`` and (with ``message.channels``) ``message``. Returns both, in that order."""
        text = text if f"<@{self.bot_user_id}>" in text else f"<@{self.bot_user_id}> {text}"
        as_message = self.user_message(text, channel=channel, user=user, thread_ts=thread_ts)
        ts = as_message["event"]["ts"]
        as_mention = self.event_callback(self._user_event(self.channels[channel][ts], "app_mention"))
        return as_mention, as_message

    def bot_echo(self: FakeSlack, message: Message) -> dict[str, Any]:
        """The ``message`` event Slack sends an app for one of its own posts."""
        event = {**message.as_event_message(), "channel": message.channel, "event_ts": message.ts,
                 "channel_type": self.channel_types[message.channel], "app_id": self.app_id,
                 "bot_profile": {"id": self.bot_id, "app_id": self.app_id, "name": self.bot_name}}
        return self.event_callback(event)

    def edit_event(self: FakeSlack, channel: str, ts: str, new_text: str) -> dict[str, Any]:
        """A user edits their message: the ``message_changed`` event."""
        message = self.channels[channel][ts]
        previous = message.as_event_message()
        message.text = new_text
        return self.event_callback({
            "type": "message", "subtype": "message_changed", "channel": channel, "hidden": True,
            "ts": self.next_ts(), "event_ts": self.next_ts(), "channel_type": self.channel_types[channel],
            "message": {**message.as_event_message(), "edited": {"user": message.user, "ts": self.next_ts()}},
            "previous_message": previous})

    def event_callback(self: FakeSlack, event: dict[str, Any]) -> dict[str, Any]:
        return {"token": "fake-verification-token", "team_id": self.team_id, "api_app_id": self.app_id,
                "event": event, "type": "event_callback", "event_id": self.next_event_id(),
                "event_time": int(time.time()), "authorizations": [
                    {"enterprise_id": None, "team_id": self.team_id, "user_id": self.bot_user_id, "is_bot": True,
                     "is_enterprise_install": False}],
                "is_ext_shared_channel": False, "event_context": f"4-{self.next_event_id()}"}

    def _user_event(self: FakeSlack, message: Message, event_type: str) -> dict[str, Any]:
        event: dict[str, Any] = {"type": event_type, "user": message.user, "text": message.text, "ts": message.ts,
                                 "channel": message.channel, "event_ts": message.ts, "team": self.team_id,
                                 "client_msg_id": f"cm-{message.ts}",
                                 "blocks": [{"type": "rich_text", "block_id": "b1", "elements": [
                                     {"type": "rich_text_section",
                                      "elements": [{"type": "text", "text": message.text}]}]}]}
        if event_type == "message":
            event["channel_type"] = self.channel_types[message.channel]
        if message.thread_ts:
            event["thread_ts"] = message.thread_ts
            parent = self.channels[message.channel].get(message.thread_ts)
            if parent is not None and parent.user:
                event["parent_user_id"] = parent.user
        if message.subtype:
            event["subtype"] = message.subtype
        if message.files:
            event["files"] = message.files
        return event

    def press(self: FakeSlack, message: Message, button: str, *, user: str = "U0ALICE") -> dict[str, Any]:
        """A user presses the button labelled ``button`` under one of the bot's messages: the ``block_actions``
        interactivity payload (its ``response_url`` posts land in ``responses``)."""
        for block in message.blocks:
            for element in block.get("elements") or []:
                if element.get("type") == "button" and (element.get("text") or {}).get("text") == button:
                    action = {"type": "button", "action_id": element.get("action_id"),
                              "block_id": block.get("block_id"), "text": element.get("text"),
                              "value": element.get("value"), "action_ts": self.next_ts()}
                    if element.get("style"):
                        action["style"] = element["style"]
                    break
            else:
                continue
            break
        else:
            raise KeyError(f"no button {button!r} on message {message.ts}")
        profile = self.users[user]
        container: dict[str, Any] = {"type": "message", "message_ts": message.ts, "channel_id": message.channel,
                                     "is_ephemeral": False}
        if message.thread_ts:
            container["thread_ts"] = message.thread_ts
        return {"type": "block_actions", "api_app_id": self.app_id, "token": "fake-verification-token",
                "user": {"id": user, "username": profile["name"], "name": profile["name"], "team_id": self.team_id},
                "team": {"id": self.team_id, "domain": self.team_domain}, "container": container,
                "trigger_id": f"tr-{self.next_ts()}", "channel": {"id": message.channel, "name": message.channel},
                "message": {**message.as_event_message(), "bot_id": self.bot_id},
                "response_url": self.response_url(), "actions": [action], "state": {"values": {}},
                "is_enterprise_install": False, "enterprise": None}

    def slash_command(self: FakeSlack, command: str, text: str = "", *, channel: str = "D0ALICE",
                      user: str = "U0ALICE") -> dict[str, str]:
        """The fields Slack sends for a slash command (form fields over HTTP, the payload over Socket Mode)."""
        return {"token": "fake-verification-token", "team_id": self.team_id, "team_domain": self.team_domain,
                "channel_id": channel, "channel_name": channel, "user_id": user, "user_name": self.users[user]["name"],
                "command": command, "text": text, "api_app_id": self.app_id, "is_enterprise_install": "false",
                "response_url": self.response_url(), "trigger_id": f"tr-{self.next_ts()}"}
