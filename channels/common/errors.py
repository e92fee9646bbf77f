"""Errors channels raise: ``PlatformError`` from platform calls to the shared sink machinery, and
``ChannelStartupError`` when a channel cannot start with its configuration."""

from __future__ import annotations

from typing import Literal

ErrorKind = Literal["transient", "rate_limited", "not_found", "format", "unsupported", "permanent"]


class PlatformError(Exception):
    """A platform call failed. ``kind`` says what the shared machinery may do about it:

    - transient: 5xx, timeout, network — retry;
    - rate_limited: 429 — pause the scope (``scope``, else the call's first) for ``retry_after`` seconds,
      then repeat the target state;
    - not_found: the message to edit or delete is gone — never success;
    - format: the platform rejected the formatting — resend the same part as plain text;
    - unsupported: the platform refused a native stream here (feature off for this chat) — stream by
      sending and editing messages instead;
    - permanent: anything else that will not succeed on retry (forbidden, bad request).

    ``str(error)`` is safe to log: adapters strip tokens before raising.
    """

    def __init__(self, detail: str, *, kind: ErrorKind, retry_after: float | None = None,
                 outcome_unknown: bool = False, scope: str | None = None) -> None:
        super().__init__(detail)
        self.kind: ErrorKind = kind
        self.retry_after = retry_after
        self.outcome_unknown = outcome_unknown
        """The request may have been carried out (a timeout after sending)."""
        self.scope = scope
        """For a 429: the key of the throttle scope the platform limited (a method tier, the app)."""

    @property
    def transient(self) -> bool:
        return self.kind in ("transient", "rate_limited")


class ChannelStartupError(Exception):
    """A channel cannot start with this configuration; the message tells the operator what to change.

    Raised by a channel's factory or its ``start``; ``chatbridge run`` prints it and exits with status 3.
    Never put a secret in the message.
    """
