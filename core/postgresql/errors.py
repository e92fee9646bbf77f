"""Failures leaving the PostgreSQL store: every one a ``StoreError`` that names the operation, never the data.

``StaleStateError`` (a conditional write found the session moved on) and ``UnknownMessageError`` (bad
input) pass through unchanged. Every exception asyncpg raises becomes a StoreError: its internal protocol
errors on a connection the server dropped under it too, and any class this module does not name. A server
error in the data exception class (SQLSTATE 22…) may quote the offending value, so only its class and code
are kept; other server errors name constraints and tables, not values, and keep their message.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import asyncpg
from pydantic import ValidationError

from core.store import StoreError


@contextlib.contextmanager
def store_errors(op: str) -> Iterator[None]:
    """Translate asyncpg and connection failures into StoreError; messages never carry stored content."""
    try:
        yield
    except StoreError:
        raise
    except asyncpg.PostgresError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, (UnicodeEncodeError, UnicodeDecodeError)):  # asyncpg's DataError wraps it
            raise StoreError(f"postgresql store: {op} failed (text that cannot be encoded: {cause.reason})") from None
        code = str(getattr(exc, "sqlstate", "") or "")
        if code.startswith("22"):
            raise StoreError(f"postgresql store: {op} failed ({type(exc).__name__}, SQLSTATE {code})") from None
        raise StoreError(f"postgresql store: {op} failed ({type(exc).__name__}: {exc})") from None
    except asyncpg.InterfaceError as exc:  # a closed pool or connection, a misused one
        raise StoreError(f"postgresql store: {op} failed (connection unavailable: {type(exc).__name__})") from None
    except asyncpg.InternalClientError as exc:
        # asyncpg's protocol state on a connection the server dropped under it (e.g. "cannot switch to state
        # 12; another operation is in progress" once the server's goodbye was read but not yet the hang-up):
        # the connection is lost like any other; asyncpg drops it when it goes back to the pool.
        raise StoreError(f"postgresql store: {op} failed (connection unusable: {type(exc).__name__})") from None
    except ValidationError:
        # The validation error would quote the offending row; keep it out of the message and the chain.
        raise StoreError(f"postgresql store: {op} read a malformed row") from None
    except (UnicodeEncodeError, UnicodeDecodeError) as exc:
        # Text that cannot be encoded (an unpaired surrogate): only the reason, never the character.
        raise StoreError(f"postgresql store: {op} failed (text that cannot be encoded: {exc.reason})") from None
    except OSError as exc:  # the server cannot be reached
        raise StoreError(f"postgresql store: {op} failed (cannot reach the server: "
                         f"{exc.strerror or type(exc).__name__})") from None
    except TimeoutError:
        raise StoreError(f"postgresql store: {op} failed (the server did not answer in time)") from None
    except Exception as exc:
        if not _from_asyncpg(exc):
            raise
        # any other exception class of asyncpg's (a client configuration or feature error, or one a later
        # version adds): a store failure all the same; its class only, as its message may quote a value
        raise StoreError(f"postgresql store: {op} failed ({type(exc).__name__})") from None


def _from_asyncpg(exc: BaseException) -> bool:
    module = type(exc).__module__
    return module == "asyncpg" or module.startswith("asyncpg.")
