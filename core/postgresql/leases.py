"""Session leases in the shared PostgreSQL database (``core.leases``), for several processes on one server.

One row per held lease in ``leases`` (``core.postgresql.schema``, step 2): the session key, the owner (a
random id per process) and ``expires_at`` on the server's clock, so the processes' own clocks never have to
agree. ``acquire`` is one upsert that takes the row only when it expired or is the caller's already;
``renew`` extends every lease this process holds in one statement, and the keys it no longer finds under its
owner are lost. This process also keeps, for each lease, a deadline on its own monotonic clock, taken
before the statement that granted or renewed it was sent: past it, ``holds`` says no even if the database
could not be reached to learn so, because by then another process may have taken the lease, and ``renew``
reports it lost. ``renew`` never waits past the first deadline: a statement still unanswered then (a
partition, a lock) is given up, without waiting for asyncpg to cancel it, so a holder cut off from the database
learns it lost its leases in time.

The leases use a small pool of their own, so a store pool busy with turns never delays a renewal. Its
statements have the store's deadline (``StoreBounds.command``, derived from the ttl) and its connections the
same TCP keepalives (``core.postgresql.bounds``), so a connection that died silently costs a StoreError, not a
hang; unlike the store's, they have no lock wait bound: each statement stands alone (never idle in a
transaction), and a renewal waiting for a row may wait until its deadline, which bounds it already.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import asyncpg

from core.postgresql.bounds import CONNECT_TIMEOUT, StoreBounds, keepalive_settings
from core.postgresql.errors import store_errors
from core.postgresql.glob import glob_to_regex
from core.store import StoreError

log = logging.getLogger(__name__)

T = TypeVar("T")

_ACQUIRE = (
    "INSERT INTO leases (name, owner, expires_at) VALUES ($1, $2, clock_timestamp() + make_interval(secs => $3))"
    " ON CONFLICT (name) DO UPDATE SET owner = EXCLUDED.owner, expires_at = EXCLUDED.expires_at"
    " WHERE leases.expires_at < clock_timestamp() OR leases.owner = EXCLUDED.owner RETURNING 1")

_RENEW = ("UPDATE leases SET expires_at = clock_timestamp() + make_interval(secs => $3)"
          " WHERE owner = $1 AND name = ANY($2::text[]) RETURNING name")

# Sessions with work and no live lease: waiting messages, or a turn left running. Subagent sessions
# (``exclude`` matches their keys) run inside their parent's turn and never hold a lease of their own: a
# subagent's turn left running counts for the conversation it ran in (its key with the child suffixes cut,
# $3), whose takeover closes it.
_ORPHANS = """
SELECT w.k FROM (
    SELECT session_key AS k FROM inbound WHERE envelope IS NOT NULL AND session_key IS NOT NULL
    UNION SELECT CASE WHEN $3::text IS NULL THEN session_key ELSE regexp_replace(session_key, $3, '') END
    FROM turns WHERE state = 'running'
) AS w
WHERE ($1::text IS NULL OR w.k !~ $1)
  AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.name = w.k AND l.expires_at >= clock_timestamp())
LIMIT $2"""


@dataclass(slots=True, eq=False)
class _Grant:
    """One grant of a lease by ``acquire``, renewed in place; given back and taken again, it is a new one."""

    deadline: float
    """On this process's monotonic clock, taken before the statement that granted or last renewed it."""


class PostgresqlLeases:
    """``SessionLeases`` on the shared database (see the module docstring)."""

    shared = True

    def __init__(self, dsn: str, *, ttl: float = 10.0, exclude_glob: str | None = None,
                 bounds: StoreBounds | None = None) -> None:
        """``bounds``: the connections' bounds (see the module docstring), derived from ``ttl`` unless given."""
        self._dsn = dsn
        self._ttl = ttl
        self._bounds = bounds if bounds is not None else StoreBounds.for_lease(ttl)
        self._exclude = glob_to_regex(exclude_glob) if exclude_glob is not None else None
        # a child's key is its parent's plus what the glob's leading * does not cover, once per level
        self._child_suffix = f"({glob_to_regex(exclude_glob[1:])[1:-1]})+$" \
            if exclude_glob is not None and exclude_glob.startswith("*") else None
        self.owner = uuid.uuid4().hex
        self._held: dict[str, _Grant] = {}
        """key -> its grant: past the grant's deadline, the lease may belong to someone else."""
        self._pool: asyncpg.Pool | None = None

    def __repr__(self) -> str:  # the connection string may hold a password
        return f"PostgresqlLeases(owner={self.owner}, dsn=***)"

    @property
    def ttl(self) -> float:
        return self._ttl

    async def open(self) -> None:
        if self._pool is not None:
            return
        with store_errors("leases"):
            try:
                self._pool = await asyncpg.create_pool(
                    self._dsn, min_size=1, max_size=3, timeout=CONNECT_TIMEOUT, command_timeout=self._bounds.command,
                    server_settings={"application_name": "chatbridge leases",
                                     **keepalive_settings(self._bounds.server_timeout)})
            except ValueError as exc:
                raise StoreError(f"postgresql leases: open failed (the connection string is not usable: "
                                 f"{type(exc).__name__})") from None

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        held, self._held = list(self._held), {}
        if pool is None:
            return
        try:
            if held:
                with store_errors("release leases"):
                    await pool.execute("DELETE FROM leases WHERE owner = $1", self.owner)
        finally:
            try:
                with store_errors("close leases"):
                    await asyncio.wait_for(pool.close(), self._bounds.close)  # terminates the pool past it
            except StoreError as exc:
                log.warning("closing the session leases' connections: %s", exc)

    def _connected(self) -> asyncpg.Pool:
        if self._pool is None:
            raise StoreError("postgresql leases: used while closed")
        return self._pool

    async def acquire(self, key: str) -> bool:
        pool = self._connected()
        deadline = time.monotonic() + self._ttl
        with store_errors("acquire lease"):
            granted = await pool.fetchval(_ACQUIRE, key, self.owner, self._ttl)
        if granted is None:
            self._held.pop(key, None)
            return False
        self._held[key] = _Grant(deadline)
        return True

    async def release(self, key: str) -> None:
        if self._held.pop(key, None) is None:
            return
        with store_errors("release lease"):
            await self._connected().execute("DELETE FROM leases WHERE name = $1 AND owner = $2", key, self.owner)

    async def held_elsewhere(self, key: str) -> bool:
        with store_errors("read lease"):
            return bool(await self._connected().fetchval(
                "SELECT 1 FROM leases WHERE name = $1 AND owner <> $2 AND expires_at >= clock_timestamp()",
                key, self.owner))

    def holds(self, key: str) -> bool:
        grant = self._held.get(key)
        return grant is not None and time.monotonic() < grant.deadline

    def remaining(self) -> float:
        if not self._held:
            return self._ttl
        return max(0.0, min(g.deadline for g in self._held.values()) - time.monotonic())

    async def renew(self) -> list[str]:
        if not self._held:
            return []
        # what a renewal finds speaks only for the grants it was sent for: a lease given back and taken again
        # meanwhile (an idle conversation's next message) is a new grant, which the row it missed says
        # nothing about
        sent = dict(self._held)
        keys = list(sent)
        deadline = time.monotonic() + self._ttl

        async def renewal() -> list[asyncpg.Record]:
            with store_errors("renew leases"):
                return cast(list[asyncpg.Record], await self._connected().fetch(_RENEW, self.owner, keys, self._ttl))

        try:
            # a slow answer is still good until the first lease's deadline, and worthless after it
            found = await _answer_by(self.remaining(), renewal())
        except (StoreError, TimeoutError) as exc:
            log.warning("renewing the session leases failed: %s", str(exc) or "no answer in time")
            now = time.monotonic()
            lost = [k for k, grant in sent.items() if self._held.get(k) is grant and grant.deadline <= now]
        else:
            renewed = {str(r[0]) for r in found}
            for key in renewed:
                if self._held.get(key) is sent[key]:
                    sent[key].deadline = deadline
            lost = [k for k, grant in sent.items() if k not in renewed and self._held.get(k) is grant]
        for key in lost:
            del self._held[key]
        return lost

    async def orphans(self, *, limit: int) -> list[str]:
        with store_errors("orphaned sessions"):
            found = await self._connected().fetch(_ORPHANS, self._exclude, limit, self._child_suffix)
        return [str(r[0]) for r in found]


async def _answer_by(timeout: float, operation: Coroutine[Any, Any, T]) -> T:
    """``operation``'s result, or TimeoutError once ``timeout`` seconds passed — then without waiting for it to
    unwind: a statement given up on a dead connection is cancelled, and asyncpg takes up to the pool's command
    timeout more to cancel it (and to drop the connection), which a deadline cannot afford. It unwinds on its
    own, bounded."""
    task = asyncio.ensure_future(operation)
    try:
        await asyncio.wait({task}, timeout=max(timeout, 0.0))
    finally:
        if not task.done():  # past the deadline, or the caller cancelled
            task.cancel()
            task.add_done_callback(_forget)
    if not task.done():
        raise TimeoutError
    return task.result()


def _forget(task: asyncio.Task[Any]) -> None:
    if not task.cancelled():
        task.exception()  # a failure of a statement given up on: nobody waits for it any more
