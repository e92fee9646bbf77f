"""Processes: which of the chatbridge processes sharing one store are alive.

Something a process leaves on the platform and only it can act on (approval buttons, whose pending
decisions live in its memory) has to be closed by another process once it is gone, and never while it
lives. So each process is alive while it holds the lease ``process:<id>`` (``core.leases``): taken when it
starts, renewed with its session leases, released when it stops, and past its expiry (on the database
server's clock) once it died without stopping. ``alive`` reads that lease; ``claim`` takes a dead
process's lease for a while, so that of several live processes exactly one cleans up after it.

Alone on its database (``LocalLeases``) a process has the id ``""``, and every other id is dead: what it
finds under one was left by an earlier run.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from core.leases import SessionLeases

log = logging.getLogger(__name__)

PREFIX = "process:"


class Processes:
    def __init__(self, leases: SessionLeases, node: str) -> None:
        """``node``: this process's name among those sharing the store (``ChatCore.node``)."""
        self._leases = leases
        self.id = node if leases.shared else ""
        """This process's id ("" when it is alone on its database)."""

    @property
    def shared(self) -> bool:
        """Whether other processes may share the store (and die while this one lives)."""
        return self._leases.shared

    @property
    def ttl(self) -> float:
        """Seconds a dead process may still count as alive."""
        return self._leases.ttl

    async def announce(self) -> None:
        """Start (or, after the lease was lost, resume) counting as alive."""
        if self.shared and not await self._leases.acquire(PREFIX + self.id):
            log.warning("this process's liveness is held by another process (id %s)", self.id)

    async def renewed(self, lost: Sequence[str]) -> None:
        """After each lease renewal (``lost``: the leases it found lost): take this process's liveness again
        when it does not hold it — it lapsed just now, or it lapsed earlier and another process had claimed
        it to clean up after this one, until that claim ended."""
        if not self.shared or self._leases.holds(PREFIX + self.id):
            return
        if PREFIX + self.id in lost:
            log.warning("this process's liveness lapsed (the database was out of reach); taking it again")
        await self.announce()

    async def alive(self, process: str) -> bool:
        """Whether the process ``process`` is alive (this one always is)."""
        if process == self.id:
            return True
        return await self._leases.held_elsewhere(PREFIX + process)

    async def claim(self, process: str) -> bool:
        """Take a dead process's place to clean up after it: True for one caller at a time (until
        ``unclaim``), False while ``process`` lives or another process claimed it."""
        if process == self.id:
            return False
        return await self._leases.acquire(PREFIX + process)

    async def unclaim(self, process: str) -> None:
        await self._leases.release(PREFIX + process)
