"""Several ``chatbridge run`` processes on one PostgreSQL database, as real processes against the test cluster
and the fake model, talking to them over the web chat's HTTP API (which any process accepts):

- three processes, 100 conversations, messages posted to random processes: a conversation's model requests
  never overlap (each one sees every earlier message answered), every message is answered exactly once;
- a process starting while another answers keeps its hands off that turn (no interrupted notice);
- SIGKILL of the process holding a streaming turn: another one takes the conversation over after the lease
  expires, the interrupted notice is shown once, the messages that waited are answered, nothing twice.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import aiohttp

from core.failures import TurnFailurePresenter
from tests.fakes.openai_server import FakeOpenAI, Function, Reply, Text, last_user_text
from tests.support.postgres import PostgresCluster
from tests.support.process import BridgeProcess, postgresql_config, wait_for
from tests.test_app import free_port
from tests.test_postgresql_process import get_json

LEASE_SECONDS = 2
NOTICE = TurnFailurePresenter().interrupted_by_restart()


class Cluster:
    def __init__(self, tmp_path: Path, fake: FakeOpenAI, dsn: str, count: int) -> None:
        self.ports = [free_port() for _ in range(count)]
        self.bridges = [BridgeProcess(postgresql_config(tmp_path / f"p{i}", dsn=dsn, llm=fake.base_url,
                                                        port=self.ports[i], api_key=f"sk-p{i}", pool_size=4,
                                                        store=f"lease_seconds = {LEASE_SECONDS}"),
                                      tmp_path / f"p{i}.log") for i in range(count)]

    def base(self, i: int) -> str:
        return f"http://127.0.0.1:{self.ports[i]}"

    async def start(self, *which: int) -> None:
        for i in which or range(len(self.bridges)):
            await self.bridges[i].start()
        for i in which or range(len(self.bridges)):
            async def up(i: int = i) -> bool:
                return bool(await get_json(f"{self.base(i)}/healthz"))
            await wait_for(up, self.bridges, timeout=90)

    async def stop(self) -> None:
        for bridge in self.bridges:
            if bridge.proc is not None:
                await bridge.stop()

    def clean(self, *which: int) -> None:
        for i in which:
            log = self.bridges[i].log()
            assert "ERROR" not in log and "Traceback" not in log, log[-4000:]


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


def asked(body: dict[str, Any]) -> str:
    """The message a model request answers (without the runtime context the turn appends to it)."""
    return last_user_text(body).split("\n\n[Runtime context]")[0]


def conversation_of(text: str) -> str:
    return text.split()[0]


class SerialModel:
    """Answers ``answer to <text>`` after a short pause, and records what a conversation's requests saw."""

    def __init__(self) -> None:
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
            await asyncio.sleep(0.02)
        finally:
            self.running[conversation] -= 1
        return Text(f"answer to {text}", chunk_size=64)


async def test_three_processes_serve_every_conversation_serially_and_answer_each_message_once(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    model = SerialModel()
    fake_openai.default = Function(model.answer)
    cluster = Cluster(tmp_path, fake_openai, postgres.fresh_dsn(), 3)
    rng = random.Random(16)
    conversations, per_conversation = 100, 2
    try:
        await cluster.start()
        async with aiohttp.ClientSession() as http:
            sids = [await new_session(http, cluster.base(rng.randrange(3))) for _ in range(conversations)]
            posts = [(sid, f"c{n} m{m}") for m in range(per_conversation) for n, sid in enumerate(sids)]
            await asyncio.gather(*(post(http, cluster.base(rng.randrange(3)), sid, text) for sid, text in posts))

        async def all_answered() -> bool:
            return len(fake_openai.requests) >= len(posts) and not any(model.running.values())
        await wait_for(all_answered, cluster.bridges, timeout=180)
        for n, sid in enumerate(sids):
            async def complete(sid: str = sid) -> bool:
                return len(await history(cluster.base(0), sid)) == 2 * per_conversation
            await wait_for(complete, cluster.bridges)
            shown = await history(cluster.base(rng.randrange(3)), sid)
            asked = sorted(text for role, text in shown if role == "user")
            assert asked == [f"c{n} m{m}" for m in range(per_conversation)]
            assert sorted(text for role, text in shown if role == "assistant") == [f"answer to {t}" for t in asked]
            # one turn after the other: the k-th request saw the k-1 earlier messages answered
            assert model.seen[f"c{n}"] == [(k, k - 1) for k in range(1, per_conversation + 1)]
        assert model.overlaps == []
        assert len(fake_openai.requests) == len(posts)  # nothing answered twice
        assert len({p for p in fake_openai.auth_headers}) == 3  # every process served some
        cluster.clean(0, 1, 2)
    finally:
        await cluster.stop()


async def test_a_process_starting_beside_a_running_turn_leaves_it_alone(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    hold = asyncio.Event()
    fake_openai.script(Text("the answer, in the end", hold=hold, hold_after=4))
    cluster = Cluster(tmp_path, fake_openai, postgres.fresh_dsn(), 2)
    try:
        await cluster.start(0)
        async with aiohttp.ClientSession() as http:
            sid = await new_session(http, cluster.base(0))
            await post(http, cluster.base(0), sid, "c0 question")
        await wait_for(lambda: len(fake_openai.requests) == 1, cluster.bridges)
        await cluster.start(1)  # its start-up must not close the turn process 0 is streaming
        hold.set()

        async def answered() -> bool:
            return len(await history(cluster.base(1), sid)) >= 2
        await wait_for(answered, cluster.bridges)
        assert await history(cluster.base(1), sid) == [("user", "c0 question"),
                                                      ("assistant", "the answer, in the end")]
        cluster.clean(0, 1)
    finally:
        await cluster.stop()


async def test_sigkill_of_the_holder_moves_the_conversation_to_another_process(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    never = asyncio.Event()
    model = SerialModel()

    async def reply(body: dict[str, Any]) -> Reply:
        if asked(body) == "c0 first":
            return Text("cut off in the middle of the answer", hold=never, hold_after=8)
        return await model.answer(body)

    fake_openai.default = Function(reply)
    cluster = Cluster(tmp_path, fake_openai, postgres.fresh_dsn(), 3)
    try:
        await cluster.start()
        async with aiohttp.ClientSession() as http:
            sid = await new_session(http, cluster.base(0))
            await post(http, cluster.base(0), sid, "c0 first")
            await wait_for(lambda: len(fake_openai.requests) == 1, cluster.bridges)
            holder = int(fake_openai.auth_headers[0].removeprefix("Bearer sk-p"))
            others = [i for i in range(3) if i != holder]
            for i, text in zip(others, ("c0 second", "c0 third"), strict=True):  # stored, waiting for the holder
                await post(http, cluster.base(i), sid, text)
        await asyncio.sleep(0.5)  # what a live holder would do meanwhile: nothing (its turn is held)
        assert len(fake_openai.requests) == 1
        await cluster.bridges[holder].kill()
        killed = time.monotonic()

        async def taken_over() -> bool:
            return len(fake_openai.requests) >= 2
        await wait_for(taken_over, cluster.bridges, timeout=60)
        took = time.monotonic() - killed

        async def answered() -> bool:
            return len(await history(cluster.base(others[0]), sid)) >= 6
        await wait_for(answered, cluster.bridges, timeout=60)
        shown = await history(cluster.base(others[1]), sid)
        assert shown[:2] == [("user", "c0 first"), ("assistant", NOTICE)]
        assert sorted(shown[2:]) == sorted([("user", "c0 second"), ("assistant", "answer to c0 second"),
                                            ("user", "c0 third"), ("assistant", "answer to c0 third")])
        assert [text for _, text in shown].count(NOTICE) == 1
        assert sorted(asked(r) for r in fake_openai.requests) == ["c0 first", "c0 second", "c0 third"]
        assert model.overlaps == []
        cluster.clean(*others)
        print(f"\ntaken over {took:.2f} s after the SIGKILL (lease {LEASE_SECONDS} s)")
    finally:
        await cluster.stop()


async def test_stop_and_new_sent_to_another_process_reach_the_holder(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    never = asyncio.Event()

    async def reply(body: dict[str, Any]) -> Reply:
        if asked(body) in ("c0 first", "c0 second", "c0 fifth"):
            return Text(f"{asked(body)} is being answered", hold=never, hold_after=8)
        return Text(f"answer to {asked(body)}")

    fake_openai.default = Function(reply)
    cluster = Cluster(tmp_path, fake_openai, postgres.fresh_dsn(), 2)
    try:
        await cluster.start()
        async with aiohttp.ClientSession() as http:
            sid = await new_session(http, cluster.base(0))
            await post(http, cluster.base(0), sid, "c0 first")
            await wait_for(lambda: len(fake_openai.requests) == 1, cluster.bridges)
            holder = int(fake_openai.auth_headers[0].removeprefix("Bearer sk-p"))
            other = cluster.base(1 - holder)
            await post(http, other, sid, "/stop")

            async def stopped() -> bool:
                shown = await history(other, sid)
                return bool(shown) and shown[-1] == ("assistant", "⏹ Stopped.")
            await wait_for(stopped, cluster.bridges)

            await post(http, cluster.base(holder), sid, "c0 second")
            await wait_for(lambda: len(fake_openai.requests) == 2, cluster.bridges)
            assert int(fake_openai.auth_headers[1].removeprefix("Bearer sk-p")) == holder
            await post(http, other, sid, "c0 third")  # waits for the holder: /new ends it unanswered
            await post(http, other, sid, "/new")

            async def second_stopped() -> bool:
                shown = await history(other, sid)
                return [text for _, text in shown].count("⏹ Stopped.") == 2
            await wait_for(second_stopped, cluster.bridges)
            await post(http, other, sid, "c0 fourth")
            await wait_for(lambda: len(fake_openai.requests) == 3, cluster.bridges)
            await post(http, cluster.base(holder), sid, "c0 fifth")  # held like the first
            await wait_for(lambda: len(fake_openai.requests) == 4, cluster.bridges)
            elsewhere = cluster.base(1 - int(fake_openai.auth_headers[3].removeprefix("Bearer sk-p")))
            async with http.post(f"{elsewhere}/api/sessions/{sid}/stop") as resp:  # the web chat's stop button
                assert (await resp.json())["stopped"] is True

            async def third_stopped() -> bool:
                return [text for _, text in await history(elsewhere, sid)].count("⏹ Stopped.") == 3
            await wait_for(third_stopped, cluster.bridges)
        fresh = fake_openai.requests[2]
        assert asked(fresh) == "c0 fourth"
        assert [m["role"] for m in fresh["messages"]] == ["system", "user"]  # a new conversation
        assert "c0 third" not in [asked(r) for r in fake_openai.requests]
        cluster.clean(0, 1)
    finally:
        await cluster.stop()
