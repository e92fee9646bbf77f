"""Event and callback bodies exactly as Feishu pushes them (schema 2.0), for the webhook sender and the long
connection fake alike.

- ``message_event``: ``im.message.receive_v1`` — p2p or group, text or ``post`` content (or any raw
  ``message_type``/``content``), @mentions (``@_user_N`` keys in the text, a ``mentions`` list), thread
  replies (``root_id``/``parent_id``/``thread_id``), the sender's open_id/user_id/union_id.
- ``card_action_event``: ``card.action.trigger`` — a button press with its callback ``value``, the operator
  and the card's message and chat.
- ``url_verification``: the challenge Feishu sends when the request URL is saved.

``header.token`` carries the app's verification token; ``header.event_id`` is unique unless given (a
redelivery repeats it).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

DEFAULT_USER = "ou_user0000000000000000000000000001"


@dataclass(frozen=True)
class Mention:
    """Someone @mentioned in a message: ``key`` is the placeholder in the text (``@_user_1``)."""

    name: str
    open_id: str
    user_id: str | None = None
    union_id: str | None = None


def header(event_type: str, *, token: str, app_id: str, event_id: str | None = None,
           tenant_key: str = "tenant_0001", create_time: str | None = None) -> dict[str, Any]:
    return {"event_id": event_id or secrets.token_hex(16), "event_type": event_type,
            "create_time": create_time or str(int(time.time() * 1000)), "token": token, "app_id": app_id,
            "tenant_key": tenant_key}


def _ids(open_id: str, user_id: str | None, union_id: str | None) -> dict[str, str]:
    ids = {"open_id": open_id}
    if user_id:
        ids["user_id"] = user_id
    if union_id:
        ids["union_id"] = union_id
    return ids


def text_content(text: str) -> str:
    return json.dumps({"text": text}, ensure_ascii=False)


def post_content(title: str, paragraphs: list[list[dict[str, Any]]]) -> str:
    """A received ``post``: as Feishu delivers it, the content has ``title`` and ``content`` at the top."""
    return json.dumps({"title": title, "content": paragraphs}, ensure_ascii=False)


def message_event(text: str | None = None, *, token: str, app_id: str, chat_id: str = "oc_group0001",
                  chat_type: str = "group", message_id: str | None = None, event_id: str | None = None,
                  sender_open_id: str = DEFAULT_USER, sender_user_id: str | None = "u_alice",
                  sender_union_id: str | None = "on_alice", sender_type: str = "user",
                  mentions: list[Mention] | None = None, message_type: str = "text", content: str | None = None,
                  root_id: str | None = None, parent_id: str | None = None, thread_id: str | None = None,
                  create_time: str | None = None) -> dict[str, Any]:
    """``im.message.receive_v1``. ``text`` may hold ``@_user_N`` placeholders for ``mentions``."""
    now = create_time or str(int(time.time() * 1000))
    message: dict[str, Any] = {
        "message_id": message_id or f"om_{secrets.token_hex(16)}", "create_time": now, "update_time": now,
        "chat_id": chat_id, "chat_type": chat_type, "message_type": message_type,
        "content": content if content is not None else text_content(text or "")}
    if root_id:
        message["root_id"] = root_id
    if parent_id:
        message["parent_id"] = parent_id
    if thread_id:
        message["thread_id"] = thread_id
    if mentions:
        message["mentions"] = [{"key": f"@_user_{i}", "id": _ids(m.open_id, m.user_id, m.union_id), "name": m.name,
                                "tenant_key": "tenant_0001"} for i, m in enumerate(mentions, start=1)]
    return {"schema": "2.0",
            "header": header("im.message.receive_v1", token=token, app_id=app_id, event_id=event_id),
            "event": {"sender": {"sender_id": _ids(sender_open_id, sender_user_id, sender_union_id),
                                 "sender_type": sender_type, "tenant_key": "tenant_0001"},
                      "message": message}}


def card_action_event(value: Any, *, token: str, app_id: str, message_id: str, chat_id: str,
                      operator_open_id: str = DEFAULT_USER, operator_user_id: str | None = "u_alice",
                      operator_union_id: str | None = "on_alice", event_id: str | None = None,
                      tag: str = "button", name: str | None = None) -> dict[str, Any]:
    """``card.action.trigger``: a press on a card's callback button carrying ``value``."""
    ids = _ids(operator_open_id, operator_user_id, operator_union_id)
    action: dict[str, Any] = {"value": value, "tag": tag}
    if name:
        action["name"] = name
    # the callback's create_time is in microseconds (unlike events)
    head = header("card.action.trigger", token=token, app_id=app_id, event_id=event_id,
                  create_time=str(int(time.time() * 1_000_000)))
    return {"schema": "2.0", "header": head,
            "event": {"operator": {"tenant_key": "tenant_0001", **ids},
                      "token": f"c-{secrets.token_hex(20)}", "action": action, "host": "im_message",
                      "context": {"open_message_id": message_id, "open_chat_id": chat_id}}}


def url_verification(*, token: str, challenge: str | None = None) -> dict[str, Any]:
    return {"challenge": challenge or secrets.token_urlsafe(12), "token": token, "type": "url_verification"}
