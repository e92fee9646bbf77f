"""Logging set-up: levels from the config, a filter that keeps secrets out of every log line, the id of the
turn a record was logged for (``core.turn_log``) on every line logged inside a turn, and a filter that keeps a
repeating event-loop error from flooding the log."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterable
from typing import TextIO

from core.turn_log import TurnIdFilter

MASK = "***"
FORMAT = "%(asctime)s %(levelname)s %(name)s%(turn)s: %(message)s"
NOISY_LOGGERS = ("httpx", "httpcore", "httpx2", "httpcore2", "openai", "anthropic", "aiohttp.access")
"""Libraries that log every request at INFO: kept at WARNING unless the level asks for less."""

# asyncio's accept loop reports a full file-descriptor table through the loop's exception handler, which
# logs it to the "asyncio" logger with a traceback, and retries every second per listening socket: under
# a connection flood that is megabytes of identical tracebacks a minute.
ACCEPT_EXHAUSTED = "socket.accept() out of system resource"


class SecretRedactor(logging.Filter):
    """Replaces every configured secret value in a record's rendered message (and traceback) by ***."""

    def __init__(self, secrets: Iterable[str]) -> None:
        super().__init__()
        self._secrets = sorted({s for s in secrets if s}, key=len, reverse=True)

    def redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, MASK)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._secrets:
            return True
        message = record.getMessage()
        if record.exc_info:
            message = f"{message}\n{logging.Formatter().formatException(record.exc_info)}"
            record.exc_info = None
            record.exc_text = None
        record.msg = self.redact(message)
        record.args = None
        return True


class RepeatLimiter(logging.Filter):
    """Lets one record whose message starts with one of ``prefixes`` through per ``interval`` seconds; the next
    one let through says how many were held back in between."""

    def __init__(self, prefixes: Iterable[str], interval: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._prefixes = tuple(prefixes)
        self._interval = interval
        self._clock = clock
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        prefix = next((p for p in self._prefixes if message.startswith(p)), None)
        if prefix is None:
            return True
        now = self._clock()
        last = self._last.get(prefix)
        if last is not None and now - last < self._interval:
            self._held[prefix] = self._held.get(prefix, 0) + 1
            return False
        self._last[prefix] = now
        held = self._held.pop(prefix, 0)
        if held and last is not None:
            record.msg = f"{message}\n({held} more like this in the last {now - last:.0f} s were not logged)"
            record.args = None
        return True


def configure_logging(level: str, secrets: Iterable[str], stream: TextIO | None = None) -> SecretRedactor:
    """Replace the root handlers with one writing to ``stream`` (stderr) for the rest of the process."""
    redactor = SecretRedactor(secrets)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(TurnIdFilter())
    handler.addFilter(redactor)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    asyncio_log = logging.getLogger("asyncio")
    for old_filter in [f for f in asyncio_log.filters if isinstance(f, RepeatLimiter)]:
        asyncio_log.removeFilter(old_filter)
    asyncio_log.addFilter(RepeatLimiter([ACCEPT_EXHAUSTED]))
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return redactor
