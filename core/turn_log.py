"""Which turn a log record belongs to, and the one INFO line each turn leaves in the log.

``ConversationExecutor.execute`` runs every turn inside :func:`turn_scope`. The scope sets a context
variable that every task spawned inside the turn inherits (asyncio copies the context when it creates a
task: the sink, the flusher, the title job, the tools), so :class:`TurnIdFilter` can stamp the turn id on
each record logged for that turn, wherever it is logged from. When the turn ends, one INFO line says which
turn, in which session, how long it took and how it ended.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

log = logging.getLogger("core.turn")

_CURRENT: ContextVar[str | None] = ContextVar("chatbridge_turn_id", default=None)


def current_turn_id() -> str | None:
    """The id of the turn the calling code runs for, or None outside any turn."""
    return _CURRENT.get()


@dataclass(slots=True)
class TurnOutcome:
    """How the turn ended, as the executor reports it: completed, cancelled, stale, failed (kind)."""

    outcome: str = "failed"
    cut: str | None = None
    """How the turn had ended when the process stopped waiting for its delivery (shutdown), if it had."""


@contextmanager
def turn_scope(turn_id: str, session_key: str,
               on_end: Callable[[str, float], None] | None = None) -> Iterator[TurnOutcome]:
    """Runs one turn; ``on_end(outcome, seconds)`` is told how it ended (the metrics count it)."""
    token = _CURRENT.set(turn_id)
    started = time.monotonic()
    result = TurnOutcome()
    try:
        yield result
    except asyncio.CancelledError:
        # the process stopped waiting for it (shutdown past its bound): before it ended, or while its end
        # was on its way to the chat (then the executor says how it ended and what the chat shows)
        result.outcome = result.cut or "abandoned"
        raise
    except Exception:
        result.outcome = "crashed"
        raise
    finally:
        seconds = time.monotonic() - started
        log.info("turn %s in %s: %s after %.2fs", turn_id, session_key, result.outcome, seconds)
        if on_end is not None:
            on_end(result.outcome, seconds)
        _CURRENT.reset(token)


class TurnIdFilter(logging.Filter):
    """Sets ``record.turn_id`` (None outside a turn) and ``record.turn`` (" turn=<id>" or "") for formats."""

    def filter(self, record: logging.LogRecord) -> bool:
        turn_id = current_turn_id()
        record.turn_id = turn_id
        record.turn = f" turn={turn_id}" if turn_id else ""
        return True
