"""The ClusterBus of processes sharing one PostgreSQL database: LISTEN/NOTIFY.

Every note travels on one NOTIFY channel of the database (``chatbridge``) as ``topic`` + newline +
payload, so a process listens once, on one dedicated connection, and subscribing is local bookkeeping that
cannot race a note. PostgreSQL delivers a notification to every listening connection of the database, the
sender's own process included, in commit order; one process publishes through one connection at a time,
so its notes arrive in the order it sent them.

When the listening connection is lost, the bus connects again (a tenacity backoff, for as long as it is
open) and then reports a gap (``on_gap``): notes sent meanwhile are gone, and subscribers read the store
again. A connection can also die without a word (a NAT forgetting it, a failover, a partition): a listener
only receives, so nothing it does would ever fail. A heartbeat therefore asks it ``SELECT 1`` every
``heartbeat_interval`` seconds; one not answered within ``heartbeat_timeout`` drops the connection, which
counts as lost like any other (connect again, then the gap). A missed note is thus noticed within about
``heartbeat_interval + heartbeat_timeout`` (5 + 5 s by default; notes are hints and the store is read again,
so that is slow only for live updates). Both connections carry server-side TCP keepalives
(``core.postgresql.bounds``), so the server, too, drops a client it cannot reach within ``server_timeout``.

A publish that fails, or is not answered within ``send_timeout``, drops its connection and is tried again
(twice) on a new one: one dead connection never holds up the publishes queued behind it. A note may therefore
arrive twice (the server may have sent the first before its answer was lost), which subscribers tolerate
(notes are hints; the store holds the facts).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import asyncpg
import tenacity

from core.bus import BusError, Callback, Subscribers, Unsubscribe, check_note
from core.postgresql.bounds import CONNECT_TIMEOUT, keepalive_settings

log = logging.getLogger(__name__)

CHANNEL = "chatbridge"
_LOST = (OSError, TimeoutError, asyncpg.InterfaceError, asyncpg.InternalClientError,
         asyncpg.PostgresConnectionError)


class PostgresqlBus:
    """``ClusterBus`` over LISTEN/NOTIFY on the database at ``dsn`` (see the module docstring)."""

    def __init__(self, dsn: str, *, reconnect_wait_max: float = 5.0, heartbeat_interval: float = 5.0,
                 heartbeat_timeout: float = 5.0, send_timeout: float = 5.0, server_timeout: float = 30.0) -> None:
        self._dsn = dsn
        self._reconnect_wait_max = reconnect_wait_max
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat_timeout = heartbeat_timeout
        self._send_timeout = send_timeout
        self._server_timeout = server_timeout
        self._subscribers = Subscribers()
        self._listener: asyncpg.Connection | None = None
        self._sender: asyncpg.Connection | None = None
        self._send_lock = asyncio.Lock()
        self._reconnecting: asyncio.Task[None] | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._open = False

    def __repr__(self) -> str:  # the connection string may hold a password
        return "PostgresqlBus(dsn=***)"

    async def open(self) -> None:
        """Start listening; raises BusError when the server cannot be reached."""
        try:
            await self._listen()
        except (*_LOST, asyncpg.PostgresError, ValueError) as exc:
            raise BusError(f"postgresql bus: cannot listen ({type(exc).__name__})") from None
        self._open = True
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat(), name="bus:heartbeat")

    async def close(self) -> None:
        self._open = False
        for task in (self._heartbeat, self._reconnecting):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._heartbeat = self._reconnecting = None
        for conn in (self._listener, self._sender):
            if conn is not None and not conn.is_closed():
                try:
                    await conn.close(timeout=2)
                except Exception:  # already going away: nothing left to release
                    conn.terminate()
        self._listener = self._sender = None

    async def publish(self, topic: str, payload: str) -> None:
        check_note(topic, payload)
        if not self._open:
            raise BusError("postgresql bus: not open")
        note = f"{topic}\n{payload}"
        try:
            async for attempt in tenacity.AsyncRetrying(
                    stop=tenacity.stop_after_attempt(3),
                    wait=tenacity.wait_exponential(multiplier=0.05, max=0.5), reraise=True):
                with attempt:
                    async with self._send_lock:
                        await self._send(note)
        except Exception as exc:  # only ever our own note: nothing in the error quotes stored data
            raise BusError(f"postgresql bus: publishing on {topic!r} failed ({type(exc).__name__})") from None

    def subscribe(self, topic: str, callback: Callback) -> Unsubscribe:
        return self._subscribers.add(topic, callback)

    def on_gap(self, callback: Callable[[], None]) -> Unsubscribe:
        return self._subscribers.add_gap(callback)

    def _settings(self, role: str) -> dict[str, str]:
        return {"application_name": f"chatbridge bus {role}", **keepalive_settings(self._server_timeout)}

    async def _send(self, note: str) -> None:
        conn = self._sender
        if conn is None or conn.is_closed():
            conn = self._sender = await asyncpg.connect(self._dsn, timeout=CONNECT_TIMEOUT,
                                                        server_settings=self._settings("sender"))
        try:
            await conn.execute("SELECT pg_notify($1, $2)", CHANNEL, note, timeout=self._send_timeout)
        except BaseException:
            # A connection the server dropped can fail in several ways (closed, silent past send_timeout, or
            # asyncpg still reading the server's goodbye: an internal state error); none of them is worth
            # keeping the connection for, nor one whose send was interrupted.
            conn.terminate()
            self._sender = None
            raise

    async def _listen(self) -> None:
        conn = await asyncpg.connect(self._dsn, timeout=CONNECT_TIMEOUT, server_settings=self._settings("listener"))
        try:
            async with asyncio.timeout(self._heartbeat_timeout):
                await conn.add_listener(CHANNEL, self._notified)
        except BaseException:
            conn.terminate()
            raise
        conn.add_termination_listener(self._lost)
        self._listener = conn

    def _notified(self, _conn: Any, _pid: int, _channel: str, note: str) -> None:
        topic, sep, payload = note.partition("\n")
        if sep:
            self._subscribers.deliver(topic, payload)

    def _lost(self, conn: Any) -> None:
        if not self._open or conn is not self._listener or self._reconnecting is not None:
            return
        log.warning("postgresql bus: the listening connection was lost; connecting again")
        self._listener = None
        self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect(), name="bus:reconnect")

    async def _beat(self) -> None:
        """Prove the listening connection alive every ``heartbeat_interval``; drop it when it does not answer
        (``_lost`` then connects again and reports the gap)."""
        while True:
            await asyncio.sleep(self._heartbeat_interval)
            conn = self._listener
            if conn is None or conn.is_closed():
                continue  # lost already: the reconnection is under way
            try:
                await conn.fetchval("SELECT 1", timeout=self._heartbeat_timeout)
            except Exception as exc:  # whatever it is, this connection cannot be trusted to deliver notes
                log.warning("postgresql bus: the listening connection did not answer its heartbeat (%s)",
                            type(exc).__name__)
                conn.terminate()
                self._lost(conn)

    async def _reconnect(self) -> None:
        try:
            async for attempt in tenacity.AsyncRetrying(
                    retry=tenacity.retry_if_exception_type(Exception),  # listening again is all that matters
                    wait=tenacity.wait_exponential(multiplier=0.1, max=self._reconnect_wait_max), reraise=True):
                with attempt:
                    await self._listen()
        finally:
            self._reconnecting = None
        log.info("postgresql bus: listening again; notes sent meanwhile were missed")
        self._subscribers.gap()
