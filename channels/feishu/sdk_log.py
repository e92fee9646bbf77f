"""lark-oapi's own log, written through the bridge's logging instead of past it.

lark-oapi logs to the logger named "Lark" (``lark_oapi.core.log``), and on import hangs a handler of its own
on it that prints every record to stdout. Those lines skip the root handler's filters (``bridge.logs``): the
secret masking and the turn id, and the product's format, so an app secret or a token in an SDK error would
reach stdout as it is. Taking that handler off leaves the records to propagate to the root handler like any
library's. The level is not ours to keep: every lark-oapi client sets it when it is built (the channel builds
them with ``LogLevel.ERROR``).
"""

from __future__ import annotations

import logging

import lark_oapi.core.log  # noqa: F401 - importing it adds the handler route_sdk_logging takes off

NAME = "Lark"


def route_sdk_logging() -> None:
    """Send lark-oapi's records to the root handlers only (idempotent; lark-oapi adds its handler once, on
    import, so one call after the import is enough)."""
    logger = logging.getLogger(NAME)
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
    logger.propagate = True
