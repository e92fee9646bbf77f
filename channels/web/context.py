"""How the web chat names its sessions, and the typed context of a message sent from the page.

A web session's key is ``"web:<session id>"``; the page may send a ``client_id`` with a message, which makes
a resend idempotent (the envelope's event_id) and lets the page match the reply's events to its message.
"""

from __future__ import annotations

from channels.common.context import TypedContext

CHANNEL = "web"
KEY_PREFIX = CHANNEL + ":"


def session_key(session_id: str) -> str:
    return KEY_PREFIX + session_id


def session_id_of(key: str) -> str | None:
    return key[len(KEY_PREFIX):] if key.startswith(KEY_PREFIX) else None


class WebContext(TypedContext):
    client_id: str | None = None
