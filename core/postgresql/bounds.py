"""How long a connection of the PostgreSQL store may keep anyone waiting, derived from the session lease TTL.

A connection can die without a word: a NAT or a firewall forgets an idle mapping, the server fails over, the
network partitions. Unbounded, a store call on such a connection waits until the operating system gives up
(about 15 minutes of TCP retransmissions), and — worse — a process cut off in the middle of a transaction
leaves its row locks held on the server until the server notices: two hours of TCP keepalive idle by
default, with ``idle_in_transaction_session_timeout`` and ``lock_timeout`` off. The conversation those rows
belong to is frozen for every process, also for the one that takes its lease over once the TTL ran out.

``StoreBounds.for_lease(ttl)`` bounds both ends of every connection of the store's pool; ``ttl`` is the
session lease TTL (``[store] lease_seconds``). With the default ttl of 10 s the values are 2.5 s idle in a
transaction, 5 s of lock wait, 10 s per statement, 20 s for a pooled connection, 40 s for close, and the
server drops a client that stopped answering within about 5 s.

On the server (``server_settings``, sent with each connection's startup):

- ``idle_in_transaction_session_timeout`` = ttl / 4, at least 2.5 s (``MIN_IDLE_IN_TRANSACTION``), at most
  10 s. A transaction of the store never waits on anything but its own statements, so one idle that long has
  lost its client: the server ends that session and its row locks go with it, before the cut-off process's
  leases expire (ttl, when it is 10 s or more) and another process takes its conversations over.
- ``lock_timeout`` = ttl / 2, at most 20 s, at least twice the above. Longer than the above, so a write queued
  behind a cut-off transaction outlasts it and then goes on instead of failing; and a cut-off session that was
  itself waiting for a lock is ended within lock_timeout + idle_in_transaction (3/4 ttl), still before the ttl
  (for a ttl of 10 s or more; a shorter one gets 7.5 s).
- TCP keepalives after ``server_timeout / 3`` idle, then every ``server_timeout / 9``, 3 probes (a silent
  client is found out in about 2/3 ``server_timeout``), and ``tcp_user_timeout`` = ``server_timeout``: data the
  client stops acknowledging ends the session. ``server_timeout`` = ttl / 2, at most 30 s (the leader's
  connection uses 30 s, ``core.postgresql.leader``). This is what ends a session cut off in the middle of a
  request — after a Parse and before its Sync, or within a message —, where the server waits for the rest in
  no state the two timeouts above watch, its locks held: below the ttl too. The keepalives also keep the NAT
  mappings of idle pooled connections alive, the usual way such a connection dies silently in the first
  place.

In this process (asyncpg):

- ``command`` (``command_timeout``, per statement) = lock_timeout + 5 s: longer than the longest lock wait, so
  a statement waiting for a lock ends with the server's own error on a connection that stays usable; a
  statement unanswered past it is on a dead connection: asyncpg tries to cancel it (for at most one more
  ``command``), then drops the connection.
- ``acquire`` (``Pool.acquire(timeout=…)``, also the budget for resetting it on release) = CONNECT_TIMEOUT +
  command: a busy pooled connection comes free within the bound of the statement it runs, a new one connects
  within CONNECT_TIMEOUT.
- ``close``: how long ``close`` waits for the operations under way before it gives up on them and terminates
  the pool (they fail with StoreError) = acquire + 2 × command: one operation's connection and statement,
  and the rollback of a statement that timed out.

The migration at ``open`` is not bounded this way (``migration_settings``): a step on a large table may take
long, and the processes that start meanwhile wait for its advisory lock.
"""

from __future__ import annotations

from dataclasses import dataclass

CONNECT_TIMEOUT = 10.0
"""Seconds to connect (TCP, TLS, startup and authentication)."""

MIN_IDLE_IN_TRANSACTION = 2.5
"""Seconds a transaction may wait between two of its statements, however short the lease: the wait is the
event loop's to resume the coroutine, which takes that long only on a process far behind (a shorter bound
would end sound transactions of a loaded process; the lease's own bounds then take longer than ``ttl``)."""

_STATEMENT_MARGIN = 5.0
"""Seconds a statement may take beyond its lock wait: ours do milliseconds of work; this is room for a slow
server."""


def _ms(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def keepalive_settings(server_timeout: float) -> dict[str, str]:
    """Server-side TCP settings that make the server drop a client it cannot reach within about
    ``server_timeout`` seconds (keepalives for an idle connection, the user timeout for unacknowledged data)."""
    return {
        "tcp_keepalives_idle": str(max(1, int(server_timeout / 3))),
        "tcp_keepalives_interval": str(max(1, int(server_timeout / 9))),
        "tcp_keepalives_count": "3",
        "tcp_user_timeout": str(max(1, int(server_timeout * 1000))),
    }


@dataclass(frozen=True, slots=True)
class StoreBounds:
    """The bounds of the store's connections (see the module docstring); ``for_lease`` derives them."""

    idle_in_transaction: float
    lock_wait: float
    command: float
    acquire: float
    close: float
    server_timeout: float

    @classmethod
    def for_lease(cls, ttl: float) -> StoreBounds:
        idle = min(max(ttl / 4, MIN_IDLE_IN_TRANSACTION), 10.0)
        lock = max(min(ttl / 2, 20.0), 2 * idle)
        command = lock + _STATEMENT_MARGIN
        acquire = CONNECT_TIMEOUT + command
        return cls(idle_in_transaction=idle, lock_wait=lock, command=command, acquire=acquire,
                   close=acquire + 2 * command, server_timeout=min(ttl / 2, 30.0))

    def server_settings(self, application_name: str) -> dict[str, str]:
        """The settings every pooled connection starts with."""
        return {
            "application_name": application_name,
            "idle_in_transaction_session_timeout": _ms(self.idle_in_transaction),
            "lock_timeout": _ms(self.lock_wait),
            **keepalive_settings(self.server_timeout),
        }

    def migration_settings(self) -> dict[str, str]:
        """The settings of the connection that migrates at ``open``: no lock wait or idle bound (a step may be
        long, and the others wait for it), but the same keepalives."""
        return {
            "application_name": "chatbridge migration",
            "idle_in_transaction_session_timeout": "0",
            "lock_timeout": "0",
            **keepalive_settings(self.server_timeout),
        }
