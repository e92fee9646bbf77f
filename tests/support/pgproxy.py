"""A TCP proxy in front of the test PostgreSQL server, for network faults at the protocol level.

Clients connect to the proxy (``route(dsn)`` points a connection string at it); each client connection is a
``Link`` to a connection of its own to the server. The proxy forwards bytes both ways unchanged, and reads
the client's side as PostgreSQL frontend messages (the untyped startup packets, then typed messages) to
record the SQL of every simple Query and Parse message (``Link.statements``), so a test can tell the
connections apart by what they ran (``links_that_sent``).

The faults, on one link:

- ``Link.blackhole()``: a silent partition (a NAT that forgot the mapping, a failover, a cable pulled). From
  then on every byte either way is read and dropped, and neither side is closed: the client hears nothing,
  not even a reset, and the server only finds out through its own timeouts and keepalives.
- ``cut_after(fragment)``: the next connection that runs a statement containing ``fragment`` is blackholed
  right after the server got the whole request (the Query, or the Sync after the statement's Bind): the
  server runs it and answers into the void; inside a transaction it then sits idle in it, its locks held.
  (Cut between a Parse and its Sync instead, the server would wait for the rest of the request, in no idle
  state its timeouts watch: only TCP — the answer it sent staying unacknowledged — ends that on a real
  network. This proxy acknowledges everything it drops, so it can only fake the silence, not that.)
- ``Link.hide_hangup``: when the server ends the connection, what it sent before it (its goodbye, e.g. the
  FATAL error of ``pg_terminate_backend``) reaches the client, the hang-up does not: the client's side stays
  open and silent, as if the network lost the FIN.

A client that closes its side is passed on to the server (and the other way round) unless the link is
blackholed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

_PROTOCOL_3 = 196608  # the startup packet's version code; SSL, GSS and cancel requests carry others


class _FrontendReader:
    """Splits what a client sends into messages; ``feed`` yields ``(sql, complete)``: ``complete`` False for
    each statement as it is sent (a Query, or a Parse), True once a request that runs it is complete (the
    Query itself, or the Sync after its Bind), so the server runs it now."""

    def __init__(self) -> None:
        self._buffer = b""
        self._started = False
        self._prepared: dict[bytes, str] = {}
        self._bound: list[str] = []

    def feed(self, data: bytes) -> Iterator[tuple[str, bool]]:
        self._buffer += data
        while True:
            if not self._started:  # untyped: int32 length (itself included), int32 code
                if len(self._buffer) < 8:
                    return
                length = int.from_bytes(self._buffer[:4], "big")
                if len(self._buffer) < length:
                    return
                code = int.from_bytes(self._buffer[4:8], "big")
                self._buffer = self._buffer[length:]
                self._started = code == _PROTOCOL_3
                continue
            if len(self._buffer) < 5:  # typed: a type byte, int32 length (itself included), the body
                return
            kind, length = self._buffer[:1], int.from_bytes(self._buffer[1:5], "big")
            if len(self._buffer) < 1 + length:
                return
            body, self._buffer = self._buffer[5:1 + length], self._buffer[1 + length:]
            if kind == b"Q":  # Query: the SQL, NUL-terminated
                sql = body.rstrip(b"\x00").decode(errors="replace")
                yield sql, False
                yield sql, True
            elif kind == b"P":  # Parse: the statement's name, NUL, the SQL, NUL, parameter types
                name, sql_bytes, _ = body.split(b"\x00", 2)
                self._prepared[name] = sql_bytes.decode(errors="replace")
                yield self._prepared[name], False
            elif kind == b"B":  # Bind: the portal's name, NUL, the statement's name, NUL, …
                statement = body.split(b"\x00", 2)[1]
                self._bound.append(self._prepared.get(statement, ""))
            elif kind == b"S":  # Sync: what was bound since the last one runs now
                for sql in self._bound:
                    yield sql, True
                self._bound.clear()


class Link:
    """One client connection through the proxy and its connection to the server."""

    def __init__(self, client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
                 server: tuple[asyncio.StreamReader, asyncio.StreamWriter]) -> None:
        self._client_reader, self._client_writer = client
        self._server_reader, self._server_writer = server
        self._reader = _FrontendReader()
        self.statements: list[str] = []
        """The SQL the client sent, in order (what reached the proxy, blackholed or not)."""
        self.blackholed = False
        self.hide_hangup = False
        self.server_hung_up = asyncio.Event()
        """Set once the server ended its side (whatever the client was told)."""

    def blackhole(self) -> None:
        """Drop every byte either way from now on, closing nothing (a silent partition)."""
        self.blackholed = True

    def sent(self, fragment: str) -> bool:
        return any(fragment in sql for sql in self.statements)

    def abort(self) -> None:
        for writer in (self._client_writer, self._server_writer):
            writer.transport.abort()

    async def forward(self, cut: Callable[[str], bool]) -> None:
        """Pass bytes both ways until both sides are done; ``cut(sql)`` says whether to blackhole the link
        once the message carrying ``sql`` went out to the server."""
        await asyncio.gather(self._client_to_server(cut), self._server_to_client())

    async def _client_to_server(self, cut: Callable[[str], bool]) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await self._client_reader.read(65536):
                if self.blackholed:
                    continue
                cutting = False
                for sql, complete in self._reader.feed(data):
                    if complete:
                        cutting = cut(sql) or cutting
                    else:
                        self.statements.append(sql)
                self._server_writer.write(data)
                await self._server_writer.drain()
                if cutting:
                    self.blackhole()
            if not self.blackholed:  # the client hung up: pass it on
                self._server_writer.close()

    async def _server_to_client(self) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await self._server_reader.read(65536):
                if self.blackholed:
                    continue
                self._client_writer.write(data)
                await self._client_writer.drain()
        self.server_hung_up.set()
        if self.hide_hangup:
            self.blackhole()
        if not self.blackholed:  # the server hung up: pass it on
            self._client_writer.close()


class PgProxy:
    """See the module docstring. ``async with PgProxy(server_port) as proxy:`` starts and stops it."""

    def __init__(self, server_port: int, *, server_host: str = "127.0.0.1") -> None:
        self._server = (server_host, server_port)
        self._listener: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._cuts: list[str] = []
        self.links: list[Link] = []
        self.port = 0

    async def __aenter__(self) -> PgProxy:
        self._listener = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = int(self._listener.sockets[0].getsockname()[1])
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    def route(self, dsn: str) -> str:
        """``dsn`` with its host and port replaced by the proxy's."""
        parts = urlsplit(dsn)
        userinfo = parts.netloc.rpartition("@")[0]
        netloc = f"{userinfo}@127.0.0.1:{self.port}" if userinfo else f"127.0.0.1:{self.port}"
        return urlunsplit(parts._replace(netloc=netloc))

    def links_that_sent(self, fragment: str) -> list[Link]:
        return [link for link in self.links if link.sent(fragment)]

    def cut_after(self, fragment: str) -> None:
        """Blackhole the next link that sends a statement containing ``fragment``, right after the server got
        it (once per call)."""
        self._cuts.append(fragment)

    def blackhole_all(self) -> None:
        """Every connection made so far falls silent; new ones still get through."""
        for link in self.links:
            link.blackhole()

    async def close(self) -> None:
        """Stop accepting and end every connection both ways (an abort: a reset, not a silence)."""
        if self._listener is not None:
            self._listener.close()
        for link in self.links:
            link.abort()
        if self._tasks:  # with both sides aborted, each link's forwarding ends at once
            await asyncio.wait(set(self._tasks))
        if self._listener is not None:
            await self._listener.wait_closed()
            self._listener = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            try:
                server = await asyncio.open_connection(*self._server)
            except OSError:
                writer.transport.abort()
                return
            link = Link((reader, writer), server)
            self.links.append(link)
            if self._listener is None or not self._listener.is_serving():  # closing already
                link.abort()
            await link.forward(self._cut)
        finally:
            self._tasks.discard(task)

    def _cut(self, sql: str) -> bool:
        for fragment in self._cuts:
            if fragment in sql:
                self._cuts.remove(fragment)
                return True
        return False
