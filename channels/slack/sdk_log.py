"""The logger slack-bolt and its Socket Mode client write to, and what it keeps of their failures.

slack_sdk logs a failed listener with its traceback (``logger.exception``). One failure is not a bug of
anyone's: answering an envelope on a connection that is closing (Slack, or the network, dropped the socket
while the acknowledgement was on its way). Slack delivers an unacknowledged envelope again and the durable
dedupe answers it once, so that failure is one warning line, without the traceback an operator would read as
a crash. So is a listener that failed on purpose to leave its event for Slack to deliver again
(``LeftForRedelivery``: the channel logged why already). Every other failure keeps its traceback.
"""

from __future__ import annotations

import logging

import aiohttp

NAME = "chatbridge.slack.bolt"


class LeftForRedelivery(Exception):
    """Raised by a listener to leave its event unacknowledged, so that Slack delivers it again: an expected
    condition the channel has logged, not a bug."""


class ConnectionDrops(logging.Filter):
    """A record whose exception is a dropped connection, or ``LeftForRedelivery``, becomes a warning without its
    traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, (ConnectionError, aiohttp.ClientConnectionError, LeftForRedelivery)):
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


def sdk_logger() -> logging.Logger:
    """The logger to hand slack-bolt (``AsyncApp(logger=...)``), with ``ConnectionDrops`` on it once."""
    logger = logging.getLogger(NAME)
    if not any(isinstance(f, ConnectionDrops) for f in logger.filters):
        logger.addFilter(ConnectionDrops())
    return logger
