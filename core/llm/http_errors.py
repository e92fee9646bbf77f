"""Helpers the HTTP-based providers share for turning SDK failures into safe ProviderErrors."""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Mapping
from typing import Any

from core.llm.provider import ProviderError, ProviderErrorKind

MAX_DETAIL = 500
_BEARER = re.compile(r"(Bearer\s+)[A-Za-z0-9._~+/=-]+", re.IGNORECASE)


class Redactor:
    """Removes the API key (and bearer tokens, and any extra patterns) from text bound for logs."""

    def __init__(self, api_key: str, *patterns: re.Pattern[str]) -> None:
        self._api_key = api_key
        self._patterns = (_BEARER, *patterns)

    def __call__(self, text: str) -> str:
        if self._api_key:
            text = text.replace(self._api_key, "***")
        for pattern in self._patterns:
            text = pattern.sub(r"\1***", text)
        return text if len(text) <= MAX_DETAIL else text[:MAX_DETAIL] + "…"


def refused(exc: BaseException) -> bool:
    """True when a connection was refused somewhere in ``exc``'s cause chain (some transports report a
    refused connection as a connect timeout)."""
    seen: BaseException | None = exc
    for _ in range(8):  # a short cause chain; bounded in case of cycles
        if seen is None:
            return False
        if isinstance(seen, ConnectionError):
            return True
        if isinstance(getattr(seen, "os_error", None), ConnectionError):  # aiohttp's ClientConnectorError
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def out_of_quota(status: int | None, *marks: object) -> bool:
    """An account whose credit or budget is used up: a 402 (DeepSeek, OpenRouter) or OpenAI's
    ``insufficient_quota`` among ``marks`` (an error's code or type; OpenAI sends it as a 429). No wait ends it,
    so it is not a rate limit to retry."""
    return status == 402 or any(str(mark or "").lower() == "insufficient_quota" for mark in marks)


def retry_after(headers: Mapping[str, str]) -> float | None:
    """Seconds from ``retry-after-ms`` / ``retry-after`` (delta-seconds or an HTTP date)."""
    raw_ms = headers.get("retry-after-ms")
    if raw_ms:
        try:
            return max(0.0, float(raw_ms) / 1000.0)
        except ValueError:
            pass
    raw = headers.get("retry-after")
    if not raw:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(raw)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, when.timestamp() - time.time())


def sdk_error(kind: ProviderErrorKind, exc: BaseException, redact: Redactor, *, status: int | None = None,
              retry_after: float | None = None, message: str | None = None,
              extra: Mapping[str, str] | None = None) -> ProviderError:
    """A ProviderError for an SDK exception: type, HTTP status and message, redacted, for logs only."""
    text = message or getattr(exc, "message", None) or str(exc) or type(exc).__name__
    prefix = f"{type(exc).__name__}" + (f" (HTTP {status})" if status is not None else "")
    details: dict[str, Any] = {"exception": type(exc).__name__}
    request_id = getattr(exc, "request_id", None)
    if isinstance(request_id, str):
        details["request_id"] = request_id
    for name, value in (extra or {}).items():
        details[name] = redact(value)
    return ProviderError(kind, redact(f"{prefix}: {text}"), retry_after=retry_after, status=status, extra=details)
