"""Failures leaving the SQLite store: every one a ``StoreError`` that names the operation, never the data.

``StaleStateError`` (a conditional write found the session moved on) passes through unchanged.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import Iterator

from pydantic import ValidationError

from core.store import StoreError


@contextlib.contextmanager
def store_errors(op: str) -> Iterator[None]:
    """Translate sqlite/aiosqlite failures into StoreError; messages never carry stored content."""
    try:
        yield
    except StoreError:
        raise
    except sqlite3.Error as exc:  # aiosqlite re-exports sqlite3's exception classes
        raise StoreError(f"sqlite store: {op} failed ({type(exc).__name__}: {exc})") from exc
    except ValidationError:
        # The validation error would quote the offending row; keep it out of the message and the chain.
        raise StoreError(f"sqlite store: {op} read a malformed row") from None
    except OSError as exc:  # creating the database directory
        raise StoreError(f"sqlite store: {op} failed ({type(exc).__name__}: {exc})") from exc
    except (UnicodeEncodeError, UnicodeDecodeError) as exc:
        # A ValueError too, but not a connection problem: text that cannot be encoded (an unpaired
        # surrogate). Only the reason is kept: the error's own text quotes the offending character.
        raise StoreError(f"sqlite store: {op} failed (text that cannot be encoded: {exc.reason})") from None
    except ValueError as exc:  # aiosqlite: "Connection closed" / "no active connection"
        raise StoreError(f"sqlite store: {op} failed (connection unavailable)") from exc
