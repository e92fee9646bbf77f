"""Several real ``chatbridge run`` processes on one PostgreSQL database, for the tests and the benchmark that
run them (``tests/test_postgresql_*.py``, ``tests/bench/cluster.py``): the processes and their configs, the
web chat's HTTP API and event stream as a browser uses them, and a fake model that notes whether a
conversation's requests ever overlapped.

Process ``i`` talks to the fake model with the API key ``sk-p<i>``, so the key of a model request tells which
process sent it (``Cluster.sender``).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from tests.browser.server import Event, SSEClient, seq_of
from tests.fakes.openai_server import FakeOpenAI, Reply, Text, last_user_text
from tests.support.ports import free_port
from tests.support.process import BridgeProcess, get_json, postgresql_config, wait_for

LEASE_SECONDS = 2
STARTUP = 180.0
"""Seconds a process may take to answer ``/healthz`` and to receive: a bound on a hang, generous because three
processes starting at once on a loaded machine start slowly, not wrongly (90 s was once not enough)."""


class Cluster:
    """``count`` processes on the database at ``dsn`` (one connection string for all, or one per process:
    the database roles of their own), each with its own data_dir under ``root`` and its own web port;
    ``extra`` (config sections) and ``titles`` go into every config, ``lease_seconds`` into ``[store]``."""

    def __init__(self, root: Path, fake: FakeOpenAI, dsn: str | Sequence[str], count: int, *, extra: str = "",
                 titles: bool = False, lease_seconds: float = LEASE_SECONDS) -> None:
        self.fake = fake
        self.ports = [free_port() for _ in range(count)]
        dsns = [dsn] * count if isinstance(dsn, str) else list(dsn)
        assert len(dsns) == count
        self.bridges = [BridgeProcess(postgresql_config(root / f"p{i}", dsn=dsns[i], llm=fake.base_url,
                                                        port=self.ports[i], api_key=f"sk-p{i}", pool_size=4,
                                                        titles=titles, store=f"lease_seconds = {lease_seconds}",
                                                        extra=extra),
                                      root / f"p{i}.log") for i in range(count)]

    def base(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    async def start(self, *which: int) -> None:
        """Start the processes ``which`` (all by default) and wait until each answers ``/healthz``."""
        for i in which or range(len(self.bridges)):
            await self.bridges[i].start()
        for i in which or range(len(self.bridges)):
            async def up(i: int = i) -> bool:
                return bool(await get_json(f"{self.base(i)}/healthz"))
            await wait_for(up, self.bridges, timeout=STARTUP, what=f"process {i} up")

    async def receiving(self, channel: str, state: str) -> None:
        """Until every process's ``/healthz`` shows ``channel`` in ``state`` (it receives: a webhook is
        refused with 503 until then)."""
        async def shown() -> bool:
            healths = [await get_json(f"{self.base(i)}/healthz") for i in range(len(self.bridges))]
            return all(h and h["channels"].get(channel) == state for h in healths)
        await wait_for(shown, self.bridges, timeout=STARTUP, what=f"{channel} {state} in every process")

    async def stop(self) -> None:
        for bridge in self.bridges:
            if bridge.proc is not None:
                await bridge.stop()

    def clean(self, *which: int) -> None:
        """The logs of the processes ``which`` hold no error."""
        for i in which:
            log = self.bridges[i].log()
            assert "ERROR" not in log and "Traceback" not in log, log[-4000:]

    def sender(self, request: int) -> int:
        """The process that sent the fake model's ``request``-th request."""
        return int(self.fake.auth_headers[request].removeprefix("Bearer sk-p"))

    async def kill_until(self, i: int, taken_over: Callable[[], bool], timeout: float = 60) -> float:
        """SIGKILL process ``i``, wait until ``taken_over``; the seconds from the kill to when it was seen."""
        await self.bridges[i].kill()
        killed = time.monotonic()
        await wait_for(taken_over, self.bridges, timeout=timeout, what="taken over after the SIGKILL")
        return time.monotonic() - killed

    async def wait_answered(self, sid: str, messages: int, on: int = 0, timeout: float = 30) -> None:
        """Until the history of web session ``sid`` (read on process ``on``) holds ``messages`` messages and
        an answer to each (at least: what more it holds is for the caller to check)."""
        async def complete() -> bool:
            return len(await history(self.base(on), sid)) >= 2 * messages
        await wait_for(complete, self.bridges, timeout=timeout, what=f"{sid} answered")


# ---- the web chat's HTTP API, as the page uses it ----------------------------------------------------------


async def new_session(http: aiohttp.ClientSession, base: str) -> str:
    async with http.post(f"{base}/api/sessions") as resp:
        assert resp.status == 201
        return str((await resp.json())["id"])


async def post(http: aiohttp.ClientSession, base: str, sid: str, text: str) -> None:
    body = {"text": text, "client_id": text.replace(" ", "-").replace("/", "cmd-")}  # a retry is stored once
    async with http.post(f"{base}/api/sessions/{sid}/messages", json=body) as resp:
        assert resp.status == 202, await resp.text()


async def history(base: str, sid: str) -> list[tuple[str, str]]:
    body = await get_json(f"{base}/api/sessions/{sid}/history")
    return [(m["role"], m["content"]) for m in body["messages"]] if body else []


class Follower:
    """Reads one SSE connection in the background, noting when each event arrived."""

    def __init__(self, client: SSEClient) -> None:
        self.client = client
        self.arrived: list[tuple[float, Event]] = []
        self.changed = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._read())

    async def _read(self) -> None:
        while True:
            ev = await self.client.next(timeout=120)
            self.arrived.append((time.monotonic(), ev))
            self.changed.set()

    @property
    def events(self) -> list[Event]:
        return [ev for _, ev in self.arrived]

    async def until(self, pred: Any, after: int = 0, timeout: float = 30.0) -> int:
        """The index of the first event from ``after`` on that satisfies ``pred`` (bounded wait)."""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    for i, ev in enumerate(self.events[after:], after):
                        if pred(ev):
                            return i
                    if self.task.done():  # the stream ended (or broke): nothing more will come
                        self.task.result()
                    self.changed.clear()
                    await self.changed.wait()
        except TimeoutError:
            seen = "\n".join(f"{e.id} {e.name} {str(e.data)[:200]}" for e in self.events[after:])
            raise AssertionError(f"no such event in {timeout} s; the stream showed:\n{seen}") from None

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.client.resp.close()


def assert_monotonic(events: list[Event]) -> None:
    """The ids of one connection's events: one epoch, each one more than the one before."""
    ids = [seq_of(e.id) for e in events if e.id is not None]
    assert len({epoch for epoch, _ in ids}) == 1, ids
    assert [seq for _, seq in ids] == list(range(ids[0][1], ids[0][1] + len(ids))), ids


# ---- the fake model --------------------------------------------------------------------------------------


def asked(body: dict[str, Any]) -> str:
    """The message a model request answers (without the runtime context the turn appends to it)."""
    return last_user_text(body).split("\n\n[Runtime context]")[0]


CONVERSATION = re.compile(r"\bc\d+\b")


def conversation_of(text: str) -> str:
    """Messages are written ``c<conversation> m<message>``, wherever the platform puts them in the text."""
    found = CONVERSATION.search(text)
    assert found is not None, text
    return found.group(0)


class SerialModel:
    """Answers ``answer to <text>`` after a short pause, and records what a conversation's requests saw."""

    def __init__(self, pause: float = 0.02) -> None:
        self.pause = pause
        self.running: dict[str, int] = {}
        self.overlaps: list[str] = []
        self.seen: dict[str, list[tuple[int, int]]] = {}
        """conversation -> (user messages, assistant answers) in each of its requests, in order."""

    async def answer(self, body: dict[str, Any]) -> Reply:
        text = asked(body)
        conversation = conversation_of(text)
        if self.running.get(conversation):
            self.overlaps.append(text)
        self.running[conversation] = self.running.get(conversation, 0) + 1
        messages = body["messages"]
        self.seen.setdefault(conversation, []).append(
            (sum(1 for m in messages if m["role"] == "user"), sum(1 for m in messages if m["role"] == "assistant")))
        try:
            await asyncio.sleep(self.pause)
        finally:
            self.running[conversation] -= 1
        return Text(f"answer to {text}", chunk_size=64)
