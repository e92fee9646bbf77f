"""What a channel's HTTP route tells the bridge's server about its request bodies.

The bridge refuses every request body over its cap (1 MiB) before a handler runs. A route that takes larger
bodies on purpose — a file upload, streamed to disk under a limit of its own — is marked with
:func:`streams_own_body`, and the server leaves its body to it. The mark is an attribute on the handler, so a
channel declares it where the handler is written, and nothing under ``channels/`` imports the bridge.
"""

from __future__ import annotations

from typing import Any, TypeVar

F = TypeVar("F")

_MARK = "chatbridge_streams_own_body"


def streams_own_body(handler: F) -> F:
    """Mark ``handler`` as reading its body in pieces under a size limit of its own (answering 413 past it)."""
    setattr(handler, _MARK, True)
    return handler


def has_own_body_limit(handler: Any) -> bool:
    return bool(getattr(handler, _MARK, False))
