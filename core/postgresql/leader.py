"""Leadership across processes on one PostgreSQL database: a session-level advisory lock per name, held on
a connection of its own.

Why an advisory lock and not a row with a heartbeat and an expiry: the lock belongs to the database
session, so it is released the moment the holder's connection ends — a process that crashes or is killed
loses it as soon as the server sees its connection close, with no expiry to wait out and no clock to trust
— and a waiter blocked in ``pg_advisory_lock`` is granted it in that same moment. A row lease would need a
heartbeat, an expiry long enough to ride out a slow heartbeat, and would then hand over only after it.

- ``acquire(name)`` opens a dedicated connection (never one of the store's pool: a session lock would
  stick to whatever borrowed that connection next) and blocks in ``pg_advisory_lock`` on a 64-bit key
  derived from the name. The wait is sliced by ``lock_timeout`` (``wait_slice``): each slice that ends
  without the lock proves the connection still works, and the next slice starts at once. A connection
  that fails is replaced under a tenacity policy (backoff up to ``retry_max_wait``), for as long as the
  caller waits. A waiter that is cancelled drops its connection, so it can never end up holding the lock
  unawares.
- ``Lead.watch`` probes the connection every ``check_interval`` seconds (``SELECT 1`` within
  ``check_timeout``) and returns as soon as a probe fails or the connection is gone: the holder then stops
  receiving. The server releases the lock of a holder it can no longer reach only after its TCP keepalive
  or user timeout (set on this connection to about ``server_timeout`` seconds), which is longer than the
  holder takes to notice, so a holder cut off from the database has stopped before anyone else can lead.
- ``release`` closes the connection, which ends the session and with it the lock.

The connection must be a real database session: behind a pooler in transaction mode (PgBouncer's
``pool_mode = transaction``) a session lock is meaningless. Names are hashed into the key and never
carry secrets; the key, not the connection string, is what logs show.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging

import asyncpg
import tenacity

from core.postgresql.bounds import CONNECT_TIMEOUT
from core.postgresql.errors import store_errors
from core.store import StoreError

log = logging.getLogger(__name__)

_KEY_PREFIX = b"chatbridge leader\x00"


def lock_key(name: str) -> int:
    """The signed 64-bit advisory lock key of ``name`` (a hash: the name itself never reaches the server)."""
    digest = hashlib.sha256(_KEY_PREFIX + name.encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


class PostgresqlLead:
    """One held name: the connection that holds its lock (``core.leadership.Lead``)."""

    def __init__(self, name: str, conn: asyncpg.Connection, *, check_interval: float, check_timeout: float) -> None:
        self._name = name
        self._conn = conn
        self._check_interval = check_interval
        self._check_timeout = check_timeout

    @property
    def name(self) -> str:
        return self._name

    async def watch(self) -> None:
        while True:
            if self._conn.is_closed():
                log.warning("the database connection holding the lead of %s is closed", self._name)
                return
            try:
                await self._conn.fetchval("SELECT 1", timeout=self._check_timeout)
            except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError) as exc:
                log.warning("the database connection holding the lead of %s failed (%s)", self._name,
                            type(exc).__name__)
                return
            await asyncio.sleep(self._check_interval)

    async def release(self) -> None:
        conn = self._conn
        if conn.is_closed():
            return
        try:
            await asyncio.wait_for(conn.close(), self._check_timeout)
        except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError):
            conn.terminate()
        except asyncio.CancelledError:
            conn.terminate()
            raise


class PostgresqlLeadership:
    """``core.leadership.Leadership`` over the PostgreSQL database at ``dsn`` (see the module docstring)."""

    shared = True

    def __init__(self, dsn: str, *, wait_slice: float = 5.0, check_interval: float = 2.0,
                 check_timeout: float = 5.0, server_timeout: float = 30.0, retry_max_wait: float = 10.0) -> None:
        self._dsn = dsn
        self._wait_slice = wait_slice
        self._check_interval = check_interval
        self._check_timeout = check_timeout
        self._server_timeout = server_timeout
        self._retry_max_wait = retry_max_wait

    def __repr__(self) -> str:  # the connection string may hold a password
        return "PostgresqlLeadership(dsn=***)"

    async def acquire(self, name: str) -> PostgresqlLead:
        def waiting(state: tenacity.RetryCallState) -> None:
            failure = state.outcome.exception() if state.outcome is not None else None
            delay = state.next_action.sleep if state.next_action is not None else 0.0
            log.warning("waiting for the lead of %s: %s; trying again in %.1fs", name, failure, delay)

        policy = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(StoreError),
            wait=tenacity.wait_exponential(multiplier=0.5, max=self._retry_max_wait),
            before_sleep=waiting, reraise=True)
        async for attempt in policy:
            with attempt:
                return await self._wait_for_lock(name)
        raise AssertionError("unreachable: the policy retries until it succeeds")  # pragma: no cover

    async def _wait_for_lock(self, name: str) -> PostgresqlLead:
        key = lock_key(name)
        server = self._server_timeout
        settings = {
            "application_name": "chatbridge leader",
            "lock_timeout": f"{int(self._wait_slice * 1000)}ms",
            "statement_timeout": "0",
            "idle_in_transaction_session_timeout": "0",
            # a holder the server cannot reach keeps the lock this long at least: longer than it takes the
            # holder to notice (check_interval + check_timeout)
            "tcp_keepalives_idle": str(max(1, int(server / 3))),
            "tcp_keepalives_interval": str(max(1, int(server / 9))),
            "tcp_keepalives_count": "3",
            "tcp_user_timeout": str(int(server * 1000)),
        }
        with store_errors(f"leader lock of {name}"):
            conn = await asyncpg.connect(self._dsn, timeout=CONNECT_TIMEOUT, server_settings=settings)
        try:
            with store_errors(f"leader lock of {name}"):
                while True:
                    try:
                        await conn.execute("SELECT pg_advisory_lock($1)", key,
                                           timeout=self._wait_slice + self._check_timeout)
                        break
                    except asyncpg.LockNotAvailableError:
                        continue  # another process leads; the connection answered, so wait on
        except BaseException:
            conn.terminate()  # never keep a connection that might hold the lock without our knowing
            raise
        log.info("leading %s (lock key %d)", name, key)
        return PostgresqlLead(name, conn, check_interval=self._check_interval, check_timeout=self._check_timeout)
