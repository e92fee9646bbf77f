"""``channels.common.open_approvals``: a record is forgotten only once its request is closed. A close that fails
(``close`` answers False) keeps the record — the last run's among this process's own, a dead process's under
that process's name — and it is tried again in the background (``RETRY``) and on the sweeps of a shared store,
until it succeeds; a record no close can read is dropped."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from channels.common import open_approvals
from channels.common.open_approvals import OpenApprovals, Record, state_name
from core.processes import Processes

T = TypeVar("T")


class Leases:
    """Process liveness as ``core.processes`` reads it: every process named in ``alive`` holds its lease."""

    def __init__(self, *, shared: bool, alive: set[str] = frozenset(), ttl: float = 60.0) -> None:
        self.shared, self.ttl, self.alive = shared, ttl, set(alive)
        self.claimed: set[str] = set()

    async def acquire(self, name: str) -> bool:
        if name.removeprefix("process:") in self.alive or name in self.claimed:
            return False
        self.claimed.add(name)
        return True

    async def release(self, name: str) -> None:
        self.claimed.discard(name)

    async def held_elsewhere(self, name: str) -> bool:
        return name.removeprefix("process:") in self.alive

    def holds(self, name: str) -> bool:
        return True


class State:
    """The channel's durable values, and supervised tasks (cancelled by ``close``)."""

    def __init__(self, leases: Leases, node: str = "me") -> None:
        self.values: dict[str, str] = {}
        self._processes = Processes(leases, node)  # type: ignore[arg-type]
        self.tasks: list[asyncio.Task[Any]] = []

    @property
    def channel(self) -> str:
        return "test"

    async def get_state(self, name: str) -> str | None:
        return self.values.get(name)

    async def set_state(self, name: str, value: str) -> None:
        self.values[name] = value

    async def state_names(self, prefix: str) -> list[str]:
        return sorted(n for n in self.values if n.startswith(prefix))

    async def delete_state(self, name: str) -> None:
        self.values.pop(name, None)

    @property
    def processes(self) -> Processes:
        return self._processes

    def spawn(self, name: str, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.append(task)
        return task

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


class Platform:
    """Requests as shown on a platform: ``live`` ids still show buttons; ``down`` makes every close fail."""

    def __init__(self, live: set[str]) -> None:
        self.live = set(live)
        self.down = True
        self.tries = 0

    async def close(self, item: Record) -> bool:
        self.tries += 1
        if "id" not in item:
            raise KeyError("id")  # a record no build can read
        if self.down:
            return False
        self.live.discard(str(item["id"]))
        return True


def records(state: State, name: str) -> list[Record] | None:
    raw = state.values.get(name)
    return None if raw is None else json.loads(raw)


async def wait_for(cond: Any, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture
def fast_retry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(open_approvals, "RETRY", (0.05, 0.05, 0.05), raising=False)


async def test_the_last_runs_request_whose_close_failed_stays_recorded_and_is_closed_on_a_later_try(fast_retry):
    state = State(Leases(shared=False), node="")
    mine = [{"id": "new"}]  # a request this run posted meanwhile
    state.values[state_name("")] = json.dumps([{"id": "old"}, {"tool": "unreadable"}])
    platform = Platform({"old", "new"})
    approvals = OpenApprovals(state, lambda: list(mine))
    try:
        await approvals.close_left_over(platform.close)
        assert platform.live == {"old", "new"}  # the close failed: its buttons are still live…
        assert records(state, state_name("")) == [{"id": "new"}, {"id": "old"}]  # …so it stays recorded
        await approvals.save()  # this run's own saves keep it too
        assert records(state, state_name("")) == [{"id": "new"}, {"id": "old"}]

        platform.down = False
        await wait_for(lambda: "old" not in platform.live)  # tried again in the background
        await wait_for(lambda: records(state, state_name("")) == [{"id": "new"}])
        assert platform.live == {"new"}  # this run's own request is never closed
    finally:
        await state.close()


async def test_a_close_that_keeps_failing_is_left_for_the_next_start(fast_retry):
    state = State(Leases(shared=False), node="")
    state.values[state_name("")] = json.dumps([{"id": "old"}])
    platform = Platform({"old"})
    approvals = OpenApprovals(state, list)
    try:
        await approvals.close_left_over(platform.close)
        await wait_for(lambda: platform.tries == 1 + len(open_approvals.RETRY))
        await asyncio.sleep(0.2)
        assert platform.tries == 1 + len(open_approvals.RETRY)  # bounded
        assert records(state, state_name("")) == [{"id": "old"}]
    finally:
        await state.close()
    platform.down = False
    state = State(Leases(shared=False), node="")
    state.values[state_name("")] = json.dumps([{"id": "old"}])
    try:
        await OpenApprovals(state, list).close_left_over(platform.close)  # the next start
        assert platform.live == set() and records(state, state_name("")) == []
    finally:
        await state.close()


async def test_a_dead_processs_requests_whose_close_failed_stay_under_its_name_until_closed(fast_retry):
    leases = Leases(shared=True, alive={"me", "other"}, ttl=60.0)
    state = State(leases, node="me")
    state.values[state_name("dead")] = json.dumps([{"id": "a"}, {"id": "b"}, {"tool": "unreadable"}])
    state.values[state_name("other")] = json.dumps([{"id": "c"}])
    platform = Platform({"a", "b", "c"})
    approvals = OpenApprovals(state, list)
    try:
        await approvals.close_left_over(platform.close)
        assert platform.live == {"a", "b", "c"}
        assert records(state, state_name("dead")) == [{"id": "a"}, {"id": "b"}]  # kept, not deleted
        assert leases.claimed == set()  # released: any live process may try again

        platform.down = False
        await wait_for(lambda: state_name("dead") not in state.values)
        assert platform.live == {"c"}  # a live process's requests are never touched
        assert records(state, state_name("other")) == [{"id": "c"}]
    finally:
        await state.close()
