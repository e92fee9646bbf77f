"""A ``/stop`` or ``/new`` forwarded over the bus while the holder could not hear it, as real ``chatbridge run``
processes on the test cluster: each process reaches the database through a proxy of its own
(``tests/support/pgproxy.py``), so the test can cut the holder's listening connection off silently, send the
command to the other process, see (as a listener of its own) that the note went out while the holder was deaf,
and only then let the holder find out and listen again (the bus's gap, ``core.bus``). The chat must see the
command carried out all the same: the turn it was sent for ends as stopped, and a ``/new`` starts the new
conversation, instead of the reply streaming on.

Inside one process (``SessionFailover`` on the test cluster's store, with a bus that loses every note unless
the test delivers it): a forwarded ``/stop`` is carried out once, whoever finds it first — the holder after a
gap, its note arriving late or twice, another gap, the session's next reader between turns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg

from core.bus import Subscribers
from core.envelope import InboundEnvelope
from core.failover import NEW, STOP, SessionFailover
from core.leases import LocalLeases
from core.postgresql.bus import CHANNEL
from core.postgresql.store import PostgresqlStore
from core.settings import CoreSettings
from core.supervisor import TaskSupervisor
from tests.fakes.openai_server import FakeOpenAI, Function, Reply, Text
from tests.support.cluster import Cluster, asked, history, new_session, post
from tests.support.pgproxy import Link, PgProxy
from tests.support.postgres import PostgresCluster
from tests.support.process import wait_for

STOPPED = "⏹ Stopped."
LISTENING = f'LISTEN "{CHANNEL}"'  # (the pools' resets say UNLISTEN *)


class Overheard:
    """The bus's notes, as a listener of the test's own hears them (straight to the server, no proxy)."""

    def __init__(self) -> None:
        self.notes: list[tuple[str, dict[str, Any]]] = []

    def heard(self, _conn: Any, _pid: int, _channel: str, note: str) -> None:
        topic, _, payload = note.partition("\n")
        with contextlib.suppress(ValueError):
            self.notes.append((topic, json.loads(payload)))

    def sent(self, topic: str, key: str) -> bool:
        return any(t == topic and isinstance(n, dict) and n.get("key") == key for t, n in self.notes)


@contextlib.asynccontextmanager
async def overheard(dsn: str) -> AsyncIterator[Overheard]:
    ears = Overheard()
    conn = await asyncpg.connect(dsn)
    try:
        await conn.add_listener(CHANNEL, ears.heard)
        yield ears
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def two_processes(tmp_path: Path, fake: FakeOpenAI, postgres: PostgresCluster
                        ) -> AsyncIterator[tuple[Cluster, list[PgProxy], Overheard]]:
    """Two processes on one fresh database, each through its own proxy; and the test's own ear on the bus."""
    dsn = postgres.fresh_dsn()
    async with PgProxy(postgres.port) as p0, PgProxy(postgres.port) as p1, overheard(dsn) as ears:
        proxies = [p0, p1]
        cluster = Cluster(tmp_path, fake, [p.route(dsn) for p in proxies], 2)
        try:
            await cluster.start()
            yield cluster, proxies, ears
        finally:
            await cluster.stop()


def deafen(proxy: PgProxy) -> Link:
    """Cut the process's listening connection off without a word: it hears no note from now on, and does
    not know it yet (its heartbeat would find out within seconds; the test tells it sooner, ``listen_again``)."""
    [listening] = proxy.links_that_sent(LISTENING)
    listening.blackhole()
    return listening


async def listen_again(cluster: Cluster, i: int, proxy: PgProxy, listening: Link) -> None:
    """The note was sent while process ``i`` was deaf (it has not listened again meanwhile); now its listening
    connection breaks, so it listens again and reports the gap."""
    assert proxy.links_that_sent(LISTENING) == [listening], "the holder listened again before the note went out"
    listening.abort()
    await wait_for(lambda: "listening again" in cluster.bridges[i].log(), cluster.bridges,
                   what="the holder listening again")


def held_first(never: asyncio.Event) -> Callable[[dict[str, Any]], Awaitable[Reply]]:
    async def reply(body: dict[str, Any]) -> Reply:
        if asked(body) == "c0 first":  # streams a little, then never goes on: only a stop ends it
            return Text("c0 first is being answered", hold=never, hold_after=8)
        return Text(f"answer to {asked(body)}")
    return reply


async def test_a_stop_sent_while_the_holder_could_not_hear_it_still_stops_the_turn(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    fake_openai.default = Function(held_first(asyncio.Event()))
    async with two_processes(tmp_path, fake_openai, postgres) as (cluster, proxies, ears), \
            aiohttp.ClientSession() as http:
        sid = await new_session(http, cluster.base(0))
        await post(http, cluster.base(0), sid, "c0 first")
        await wait_for(lambda: len(fake_openai.requests) == 1, cluster.bridges)
        holder = cluster.sender(0)
        other = cluster.base(1 - holder)
        listening = deafen(proxies[holder])
        await post(http, other, sid, "/stop")
        await wait_for(lambda: ears.sent(STOP, f"web:{sid}"), cluster.bridges, what="the stop note")
        await listen_again(cluster, holder, proxies[holder], listening)

        async def stopped() -> bool:
            shown = await history(other, sid)
            return bool(shown) and shown[-1][0] == "assistant" and shown[-1][1].endswith(STOPPED)
        await wait_for(stopped, cluster.bridges, timeout=30, what="the turn stopped")
        shown = await history(other, sid)
        assert [text for _, text in shown].count(STOPPED) == 1  # stopped once, nothing more said
        # the conversation goes on as usual
        await post(http, other, sid, "c0 second")

        async def answered() -> bool:
            return (await history(other, sid))[len(shown):] == [("user", "c0 second"),
                                                               ("assistant", "answer to c0 second")]
        await wait_for(answered, cluster.bridges, timeout=30)
        assert [asked(r) for r in fake_openai.requests] == ["c0 first", "c0 second"]
        cluster.clean(0, 1)


async def test_a_new_sent_while_the_holder_could_not_hear_it_still_stops_the_turn_and_starts_afresh(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    fake_openai.default = Function(held_first(asyncio.Event()))
    async with two_processes(tmp_path, fake_openai, postgres) as (cluster, proxies, ears), \
            aiohttp.ClientSession() as http:
        sid = await new_session(http, cluster.base(0))
        await post(http, cluster.base(0), sid, "c0 first")
        await wait_for(lambda: len(fake_openai.requests) == 1, cluster.bridges)
        holder = cluster.sender(0)
        other = cluster.base(1 - holder)
        listening = deafen(proxies[holder])
        await post(http, other, sid, "c0 second")  # waits for the holder: the /new ends it unanswered
        await post(http, other, sid, "/new")
        await wait_for(lambda: ears.sent(NEW, f"web:{sid}"), cluster.bridges, what="the /new note")
        await listen_again(cluster, holder, proxies[holder], listening)

        async def stopped() -> bool:
            return any(text.endswith(STOPPED) for _, text in await history(other, sid))
        await wait_for(stopped, cluster.bridges, timeout=30, what="the turn stopped")
        await post(http, other, sid, "c0 third")

        async def answered() -> bool:
            return ("assistant", "answer to c0 third") in await history(other, sid)
        await wait_for(answered, cluster.bridges, timeout=30)
        assert [asked(r) for r in fake_openai.requests] == ["c0 first", "c0 third"]  # "c0 second" went with /new
        assert [m["role"] for m in fake_openai.requests[1]["messages"]] == ["system", "user"]  # a new conversation
        cluster.clean(0, 1)



# ---- inside one process: a stored /stop is carried out once, whoever finds it first ---------------------------


class Deaf:
    """A bus on which every note is lost unless the test delivers it (``hear``), and gaps come when it says."""

    def __init__(self) -> None:
        self.subscribers = Subscribers()
        self.sent: list[tuple[str, str]] = []

    async def open(self) -> None:
        return None

    async def close(self) -> None:
        return None

    async def publish(self, topic: str, payload: str) -> None:
        self.sent.append((topic, payload))

    def subscribe(self, topic: str, callback: Callable[[str], None]) -> Callable[[], None]:
        return self.subscribers.add(topic, callback)

    def on_gap(self, callback: Callable[[], None]) -> Callable[[], None]:
        return self.subscribers.add_gap(callback)

    def hear(self, topic: str, payload: str) -> None:
        self.subscribers.deliver(topic, payload)

    def gap(self) -> None:
        self.subscribers.gap()


class Leases(LocalLeases):
    shared = True

    def __init__(self, elsewhere: bool) -> None:
        super().__init__(ttl=3600)
        self.elsewhere = elsewhere

    async def held_elsewhere(self, key: str) -> bool:
        return self.elsewhere


KEY = "web:s1"


class Holder:
    """What the holder's ``SessionManager`` and ``ChatCore`` are to ``SessionFailover``: it serves ``KEY``."""

    def __init__(self) -> None:
        self.stops: list[InboundEnvelope] = []

    def holds(self, key: str) -> bool:
        return key == KEY

    async def stop_here(self, envelope: InboundEnvelope) -> None:
        self.stops.append(envelope)


@dataclasses.dataclass
class World:
    sender: SessionFailover
    """The failover of the process that received the /stop (it does not hold the session)."""
    served: SessionFailover
    """The holder's."""
    sent: Deaf
    heard: Deaf
    holder: Holder
    store: PostgresqlStore

    @staticmethod
    async def settled() -> None:
        """Until what the failovers started on a note or a gap (``command…`` tasks) has finished."""
        started = [t for t in asyncio.all_tasks() if t.get_name().startswith("command")]
        if started:
            await asyncio.wait_for(asyncio.gather(*started), 10)  # a bound on a hang, never a measure


@contextlib.asynccontextmanager
async def world(postgres: PostgresCluster) -> AsyncIterator[World]:
    store = PostgresqlStore(postgres.fresh_dsn())
    await store.open()
    supervisor = TaskSupervisor()
    holder = Holder()
    made: list[SessionFailover] = []
    try:
        buses = [Deaf(), Deaf()]
        for bus, elsewhere in zip(buses, (True, False), strict=True):
            failover = SessionFailover(store=store, leases=Leases(elsewhere), settings=CoreSettings(),
                                       supervisor=supervisor, recovery=holder, bus=bus)  # type: ignore[arg-type]
            failover.sessions = holder  # type: ignore[assignment]
            await failover.start()
            made.append(failover)
        await made[1].take(KEY)
        yield World(made[0], made[1], buses[0], buses[1], holder, store)
    finally:
        for failover in made:
            failover.close()
        await supervisor.shutdown(5)
        await store.close()


STOP_COMMAND = InboundEnvelope(channel="web", chat_id="s1", sender_id="u1", content="/stop")


async def test_a_stop_whose_note_was_lost_is_carried_out_after_the_gap_and_only_once(
        postgres: PostgresCluster) -> None:
    async with world(postgres) as w:
        assert await w.sender.forward_stop(KEY, STOP_COMMAND)
        [(topic, note)] = w.sent.sent
        await w.settled()
        assert topic == STOP and w.holder.stops == []  # the note is lost: nothing happens yet
        w.heard.gap()
        await w.settled()
        assert w.holder.stops == [STOP_COMMAND]
        # the lost note after all, twice; another gap; the session's next reader: none of them stops again
        w.heard.hear(topic, note)
        w.heard.hear(topic, note.replace('"id": "', '"id": "again-'))
        w.heard.gap()
        await w.settled()
        assert await w.served.waiting(KEY) == []
        assert w.holder.stops == [STOP_COMMAND]
        assert await w.store.waiting_inbound(key=KEY) == []


async def test_a_stop_the_holder_never_heard_is_answered_once_by_the_sessions_next_reader(
        postgres: PostgresCluster) -> None:
    async with world(postgres) as w:
        assert await w.sender.forward_stop(KEY, STOP_COMMAND)  # its note is lost, and no gap is reported
        # the turn ended meanwhile, and the worker reads the session's stored messages: the stop is answered
        # there (the holder's stop_here: "nothing runs"), never queued as a message
        assert await w.served.waiting(KEY) == []
        assert w.holder.stops == [STOP_COMMAND]
        w.heard.gap()
        w.heard.hear(*w.sent.sent[0])
        await w.settled()
        assert w.holder.stops == [STOP_COMMAND]
        assert await w.store.waiting_inbound(key=KEY) == []
