"""SessionLeases: which process runs a session's worker.

A session's turns must run one after the other (DESIGN.md §2), so its worker runs in exactly one process
at a time: the one holding the session's lease. ``SessionManager`` acquires the lease before its worker
serves anything and releases it when the worker exits; a worker that cannot get it hands its messages
(stored already) to the holder. ``ChatCore`` renews every held lease in one call every ``ttl / 3``.

A held lease is *lost* — the process can no longer prove it holds it — in exactly two cases:

- a renewal reached the database and the lease is no longer this process's (another process took it after
  it expired, or it is gone): lost at once;
- no renewal succeeded for ``ttl`` seconds, counted on this process's monotonic clock from the moment the
  last successful grant or renewal was *sent* (so never later than the expiry the database recorded): the
  database unreachable, the connection killed, the statement failing or hanging. Past that moment another
  process may take the lease, so it is lost then, whatever the database would say once reachable again.
  A failed renewal before that moment loses nothing: the next one may succeed.

A lost lease stops its session here at once: the running turn is abandoned (it commits and delivers
nothing more; the new holder closes it with its interrupted notice) and nothing more is started
(``SessionManager.lost``).

``LocalLeases`` is the embedded case, one process per database (SQLite): every lease is granted at once,
never lost, and costs no write. ``core.postgresql.leases`` keeps them in the shared database, for several
processes on one PostgreSQL server (``shared``): there a lease ends at its expiry unless renewed, so a
process that died leaves its sessions to the others after at most ``ttl`` seconds, and ``orphans`` lists
the sessions that have work (waiting messages, a turn left running) and no live lease, for a sweeper to
take over.
"""

from __future__ import annotations

from typing import Protocol


class SessionLeases(Protocol):
    @property
    def shared(self) -> bool:
        """True when other processes may hold leases: one may be refused, lost, or left by a dead holder."""
        ...

    @property
    def ttl(self) -> float:
        """Seconds a lease lasts past its last renewal."""
        ...

    async def open(self) -> None: ...

    async def close(self) -> None:
        """Release every lease this process holds, so the others take the sessions over at once."""
        ...

    async def acquire(self, key: str) -> bool:
        """Take ``key``'s lease (or renew it when held already); False when another live process holds it."""
        ...

    async def release(self, key: str) -> None: ...

    async def held_elsewhere(self, key: str) -> bool:
        """Whether another live process holds ``key``'s lease now (read only)."""
        ...

    def holds(self, key: str) -> bool:
        """Whether this process still holds ``key``'s lease (acquired, and renewed within its ttl)."""
        ...

    def remaining(self) -> float:
        """Seconds until the first held lease is lost unless renewed (``ttl`` when none is held)."""
        ...

    async def renew(self) -> list[str]:
        """Extend every held lease; returns the keys lost (see the module docstring). Returns by the time the
        first held lease would be lost, whatever the database does."""
        ...

    async def orphans(self, *, limit: int) -> list[str]:
        """Sessions with work and no live lease (waiting inbound messages, or a turn left running, its own or
        one of its subagents'); at most ``limit``."""
        ...


class LocalLeases:
    """One process per database: every lease is granted, nothing is written, nothing is ever orphaned."""

    shared = False

    def __init__(self, ttl: float = 10.0) -> None:
        self._ttl = ttl

    @property
    def ttl(self) -> float:
        return self._ttl

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def acquire(self, key: str) -> bool:
        return True

    async def release(self, key: str) -> None:
        return None

    async def held_elsewhere(self, key: str) -> bool:
        return False

    def holds(self, key: str) -> bool:
        return True

    def remaining(self) -> float:
        return self._ttl

    async def renew(self) -> list[str]:
        return []

    async def orphans(self, *, limit: int) -> list[str]:
        return []
