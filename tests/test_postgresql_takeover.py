"""Taking a conversation over, as real ``chatbridge run`` processes on the test cluster:

- from a process that is alive but lost its lease: each process connects as a database role of its own, so
  the test can make one holder's lease renewals fail (``REVOKE UPDATE ON leases``) while its turn streams
  and everything else it does still works. The chat must end up showing exactly one terminal outcome: the
  other process's interrupted notice, never the answer as well; a subagent the turn was running is left to
  the new holder too (its history ends with the same notice, not a stop of its own);
- from a killed process whose turn was running a subagent: the child's turn is closed with the parent's;
- a message stored before the database had leases (schema version 1) is answered once processes share it;
- a ``/new`` forwarded to a holder that was just killed is applied, in its place, by the process that
  takes the conversation over.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg

from channels.web.context import CHANNEL, WebContext, session_key
from core.envelope import InboundEnvelope
from core.failures import TurnFailurePresenter
from core.postgresql.schema import migrate
from core.postgresql.store import PostgresqlStore
from tests.fakes.openai_server import FakeOpenAI, Function, Reply, Text, ToolCalls
from tests.support.cluster import LEASE_SECONDS, Cluster, asked, history, new_session, post
from tests.support.postgres import USER, PostgresCluster
from tests.support.process import wait_for
from tests.test_subagents import is_child, subagent

NOTICE = TurnFailurePresenter().interrupted_by_restart()


async def roles(postgres: PostgresCluster, count: int) -> list[str]:
    """A fresh database (migrated) and ``count`` login roles that may use it; their connection strings."""
    dsn = postgres.fresh_dsn()
    store = PostgresqlStore(dsn)  # creates the tables, as their owner
    await store.open()
    await store.close()
    names = [f"r_{uuid.uuid4().hex[:10]}" for _ in range(count)]
    conn = await asyncpg.connect(dsn)
    try:
        for name in names:
            await conn.execute(f"CREATE ROLE {name} LOGIN")
            await conn.execute(f"GRANT CREATE, USAGE ON SCHEMA public TO {name}")
            await conn.execute(f"GRANT ALL ON ALL TABLES IN SCHEMA public TO {name}")
            await conn.execute(f"GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {name}")
    finally:
        await conn.close()
    return [dsn.replace(f"//{USER}@", f"//{name}@", 1) for name in names]


async def as_owner(dsn: str, statement: str) -> None:
    conn = await asyncpg.connect(re.sub(r"//r_[0-9a-f]+@", f"//{USER}@", dsn))
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


def turn_ended(log: str, sid: str) -> str | None:
    """How the turn in web session ``sid`` ended, as its process logged it (None while it runs)."""
    found = re.search(rf"turn [0-9a-f]+ in web:{re.escape(sid)}: (.+?) after ", log)
    return found.group(1) if found else None


def child_cut_off() -> Function:
    """A model whose reply starts a subagent, whose own reply stops half-way and never goes on."""
    never = asyncio.Event()

    async def reply(body: dict[str, Any]) -> Reply:
        if is_child(body):
            return Text("the child's findings, cut off", hold=never, hold_after=6)
        return ToolCalls([subagent("TASK look it up")], ids=["call_S"])

    return Function(reply)


async def test_a_holder_whose_lease_renewals_fail_stops_its_turn_and_the_new_holder_closes_it_once(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    release = asyncio.Event()

    async def reply(body: dict[str, Any]) -> Reply:
        if asked(body) == "c0 first":
            return Text("the answer that must not appear beside the notice", hold=release, hold_after=8)
        return Text(f"answer to {asked(body)}")

    fake_openai.default = Function(reply)
    dsns = await roles(postgres, 2)
    processes = Cluster(tmp_path, fake_openai, dsns, 2)
    try:
        await processes.start()
        async with aiohttp.ClientSession() as http:
            sid = await new_session(http, processes.base(0))
            await post(http, processes.base(0), sid, "c0 first")
        await wait_for(lambda: len(fake_openai.requests) == 1, processes.bridges)
        holder = int(fake_openai.auth_headers[0].removeprefix("Bearer sk-p"))
        other = 1 - holder
        role = re.search(r"//(r_[0-9a-f]+)@", dsns[holder])
        assert role is not None
        # the holder's heartbeat statement fails from now on; its turn streams on, held by the model
        await as_owner(dsns[holder], f"REVOKE UPDATE ON leases FROM {role.group(1)}")
        revoked = time.monotonic()

        async def holder_gave_up() -> bool:
            return turn_ended(processes.bridges[holder].log(), sid) is not None
        await wait_for(holder_gave_up, processes.bridges, what="the holder ends its turn")
        gave_up = time.monotonic() - revoked

        async def taken_over() -> bool:
            return ("assistant", NOTICE) in await history(processes.base(other), sid)
        await wait_for(taken_over, processes.bridges, what="the other process closes the interrupted turn")
        took = time.monotonic() - revoked
        release.set()  # what the model would still send reaches nobody
        async with aiohttp.ClientSession() as http:
            await post(http, processes.base(holder), sid, "c0 second")  # the conversation goes on

        async def answered() -> bool:
            return len(await history(processes.base(holder), sid)) >= 4
        await wait_for(answered, processes.bridges)
        assert await history(processes.base(holder), sid) == [
            ("user", "c0 first"), ("assistant", NOTICE), ("user", "c0 second"), ("assistant", "answer to c0 second")]
        assert turn_ended(processes.bridges[holder].log(), sid) == "abandoned (the session moved to another process)"
        assert int(fake_openai.auth_headers[1].removeprefix("Bearer sk-p")) == other
        print(f"\nrenewals failing from t=0 (lease {LEASE_SECONDS} s): the holder stopped its turn at {gave_up:.2f} s,"
              f" the notice was in the history at {took:.2f} s")
    finally:
        await processes.stop()


async def test_a_subagent_left_running_by_a_killed_holder_is_closed_with_its_parent(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    fake_openai.default = child_cut_off()
    dsn = postgres.fresh_dsn()
    processes = Cluster(tmp_path, fake_openai, dsn, 2, extra="[agent.subagents]\nenabled = true\n")
    try:
        await processes.start()
        async with aiohttp.ClientSession() as http:
            sid = await new_session(http, processes.base(0))
            await post(http, processes.base(0), sid, "c0 first")
        await wait_for(lambda: len(fake_openai.requests) == 2, processes.bridges)  # the parent's, the child's
        holder = int(fake_openai.auth_headers[0].removeprefix("Bearer sk-p"))
        other = 1 - holder
        await processes.bridges[holder].kill()

        async def taken_over() -> bool:
            return ("assistant", NOTICE) in await history(processes.base(other), sid)
        await wait_for(taken_over, processes.bridges, timeout=60, what="the takeover")
        conn = await asyncpg.connect(dsn)
        try:
            [child] = [r[0] for r in await conn.fetch("SELECT key FROM sessions WHERE key LIKE $1",
                                                      f"web:{sid}-sub-%")]
            running = await conn.fetch("SELECT session_key FROM turns WHERE state = 'running'")
        finally:
            await conn.close()
        assert running == []  # neither the parent's turn nor the child's is left running
        assert await history(processes.base(other), child.removeprefix("web:")) == [
            ("user", "TASK look it up"), ("assistant", NOTICE)]  # the child's own history says so too
        assert [text for _, text in await history(processes.base(other), sid)].count(NOTICE) == 1
    finally:
        await processes.stop()


async def test_a_message_waiting_from_before_sessions_had_leases_is_answered_once_several_processes_run(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    """A database at schema version 1 (one process, no leases) with a message stored and not yet answered:
    the processes started on it migrate it, and one of them answers the message."""
    fake_openai.default = Function(lambda body: Text(f"answer to {asked(body)}"))
    dsn = postgres.fresh_dsn()
    sid = secrets.token_hex(8)
    envelope = InboundEnvelope(channel=CHANNEL, chat_id=sid, session_key=session_key(sid), sender_id="web-user",
                               content="c0 waiting", event_id="c0-waiting",
                               channel_context=WebContext(client_id="c0-waiting").wrap())
    conn = await asyncpg.connect(dsn)
    try:
        assert await migrate(conn, target=1) == 1
        await conn.execute("INSERT INTO inbound (channel, event_id, envelope, admitted_at, expires_at)"
                           " VALUES ($1, $2, $3, $4, $5)", CHANNEL, "c0-waiting", envelope.model_dump_json(),
                           time.time(), time.time() + 3600)
    finally:
        await conn.close()
    processes = Cluster(tmp_path, fake_openai, dsn, 2)
    try:
        await processes.start()

        async def answered() -> bool:
            return len(await history(processes.base(0), sid)) >= 2
        await wait_for(answered, processes.bridges, what="the waiting message is answered")
        assert await history(processes.base(1), sid) == [("user", "c0 waiting"), ("assistant", "answer to c0 waiting")]
        assert [asked(r) for r in fake_openai.requests] == ["c0 waiting"]
    finally:
        await processes.stop()


async def test_new_forwarded_to_a_holder_killed_at_that_moment_is_applied_by_the_next_holder(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    never = asyncio.Event()

    async def reply(body: dict[str, Any]) -> Reply:
        if asked(body) == "c0 first":
            return Text("cut off in the middle of the answer", hold=never, hold_after=8)
        return Text(f"answer to {asked(body)}")

    fake_openai.default = Function(reply)
    dsn = postgres.fresh_dsn()
    # a lease long enough that the /new surely reaches the other process while the dead holder's lease lasts
    processes = Cluster(tmp_path, fake_openai, dsn, 2, lease_seconds=6)
    try:
        await processes.start()
        async with aiohttp.ClientSession() as http:
            sid = await new_session(http, processes.base(0))
            await post(http, processes.base(0), sid, "c0 first")
            await wait_for(lambda: len(fake_openai.requests) == 1, processes.bridges)
            holder = int(fake_openai.auth_headers[0].removeprefix("Bearer sk-p"))
            other = 1 - holder
            await post(http, processes.base(other), sid, "c0 second")  # waits for the holder: /new ends it
            await processes.bridges[holder].kill()
            await post(http, processes.base(other), sid, "/new")  # forwarded to the holder, which is gone

            async def taken_over() -> bool:
                return ("assistant", NOTICE) in await history(processes.base(other), sid)
            await wait_for(taken_over, processes.bridges, timeout=60, what="the takeover")
            await post(http, processes.base(other), sid, "c0 third")

            async def answered() -> bool:
                return ("assistant", "answer to c0 third") in await history(processes.base(other), sid)
            await wait_for(answered, processes.bridges, timeout=60)
        assert [asked(r) for r in fake_openai.requests] == ["c0 first", "c0 third"]  # "c0 second" went with /new
        assert [m["role"] for m in fake_openai.requests[1]["messages"]] == ["system", "user"]  # a new conversation
        assert await history(processes.base(other), sid) == [
            ("user", "c0 first"), ("assistant", NOTICE), ("user", "c0 third"), ("assistant", "answer to c0 third")]
    finally:
        await processes.stop()


async def test_a_subagent_of_a_turn_whose_holder_lost_the_lease_is_left_to_the_new_holder_too(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    fake_openai.default = child_cut_off()
    dsns = await roles(postgres, 2)
    processes = Cluster(tmp_path, fake_openai, dsns, 2, extra="[agent.subagents]\nenabled = true\n")
    try:
        await processes.start()
        async with aiohttp.ClientSession() as http:
            sid = await new_session(http, processes.base(0))
            await post(http, processes.base(0), sid, "c0 first")
        await wait_for(lambda: len(fake_openai.requests) == 2, processes.bridges)  # the parent's, the child's
        holder = int(fake_openai.auth_headers[0].removeprefix("Bearer sk-p"))
        other = 1 - holder
        role = re.search(r"//(r_[0-9a-f]+)@", dsns[holder])
        assert role is not None
        await as_owner(dsns[holder], f"REVOKE UPDATE ON leases FROM {role.group(1)}")

        async def taken_over() -> bool:
            return ("assistant", NOTICE) in await history(processes.base(other), sid)
        await wait_for(taken_over, processes.bridges, what="the takeover")

        async def holder_gave_up() -> bool:
            return turn_ended(processes.bridges[holder].log(), sid) is not None
        await wait_for(holder_gave_up, processes.bridges, what="the holder ends its turn")
        assert turn_ended(processes.bridges[holder].log(), sid) == "abandoned (the session moved to another process)"
        conn = await asyncpg.connect(dsns[other])
        try:
            [child] = [r[0] for r in await conn.fetch("SELECT key FROM sessions WHERE key LIKE $1",
                                                      f"web:{sid}-sub-%")]
        finally:
            await conn.close()
        # the child's history ends as its parent's does: with the new holder's notice, not a stop of its own
        assert await history(processes.base(other), child.removeprefix("web:")) == [
            ("user", "TASK look it up"), ("assistant", NOTICE)]
    finally:
        await processes.stop()
