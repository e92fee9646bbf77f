"""How the web chat names its sessions, and the typed context of a message sent from the page.

A web session's key is ``"web:<session id>"``; the page may send a ``client_id`` with a message, which makes
a resend idempotent (the envelope's event_id) and lets the page match the reply's events to its message.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from channels.common.context import TypedContext

CHANNEL = "web"
KEY_PREFIX = CHANNEL + ":"


def session_key(session_id: str) -> str:
    return KEY_PREFIX + session_id


def session_id_of(key: str) -> str | None:
    return key[len(KEY_PREFIX):] if key.startswith(KEY_PREFIX) else None


def page_id(key: str) -> str:
    """The id the page knows a session by (a subagent's too); a key of another channel stays as it is."""
    return session_id_of(key) or key


def message_view(view: dict[str, Any], client_ids: Mapping[str, str] | None = None) -> dict[str, Any]:
    """A history message for the page: the child session a ``run_subagent`` result names, by its id; a user
    message with the ``client_id`` its page sent it with (``client_ids``: turn id → client id), or null."""
    if view.get("role") == "user":
        view = {**view, "client_id": (client_ids or {}).get(view.get("turn_id") or "")}
    child = view.get("subagent")
    if isinstance(child, dict) and isinstance(child.get("session_key"), str):
        child = dict(child)
        child["session_id"] = page_id(child.pop("session_key"))
        view = {**view, "subagent": child}
    return view


class WebContext(TypedContext):
    client_id: str | None = None
    command_id: str | None = None
    """Set by the server on a ``/new``, whose client may have sent no client id: its notice finds by it the
    messages the command left unanswered (``SessionStream.dropped_by``)."""
