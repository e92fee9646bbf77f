"""Logging set-up: levels from the config, a filter that keeps secrets out of every log line, and the id of
the turn a record was logged for (``core.turn_log``) on every line logged inside a turn."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable
from typing import TextIO

from core.turn_log import TurnIdFilter

MASK = "***"
FORMAT = "%(asctime)s %(levelname)s %(name)s%(turn)s: %(message)s"
NOISY_LOGGERS = ("httpx", "httpcore", "httpx2", "httpcore2", "openai", "anthropic", "aiohttp.access")
"""Libraries that log every request at INFO: kept at WARNING unless the level asks for less."""


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
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    return redactor
