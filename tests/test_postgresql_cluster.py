"""Several ``chatbridge run`` processes on one PostgreSQL database, as real processes against the test cluster
and the fake model, talking to them over the web chat's HTTP API (which any process accepts):

- three processes, 100 conversations, messages posted to random processes: a conversation's model requests
  never overlap (each one sees every earlier message answered), every message is answered exactly once;
  a browser on one process follows 20 of the conversations over SSE and sees every turn of each (turns the
  other processes run too) stream and commit once, one turn after the other, in the order of the history,
  under monotonic event ids;
- a process starting while another answers keeps its hands off that turn (no interrupted notice);
- SIGKILL of the process holding a streaming turn: another one takes the conversation over after the lease
  expires, the interrupted notice is shown once, the messages that waited are answered, nothing twice.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Any

import aiohttp

from core.failures import TurnFailurePresenter
from tests.browser.server import open_stream
from tests.fakes.openai_server import FakeOpenAI, Function, Reply, Text
from tests.support.cluster import (
    LEASE_SECONDS,
    Cluster,
    Follower,
    SerialModel,
    asked,
    assert_monotonic,
    history,
    new_session,
    post,
)
from tests.support.postgres import PostgresCluster
from tests.support.process import wait_for

NOTICE = TurnFailurePresenter().interrupted_by_restart()


async def test_three_processes_serve_every_conversation_serially_and_answer_each_message_once(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    model = SerialModel()
    fake_openai.default = Function(model.answer)
    cluster = Cluster(tmp_path, fake_openai, postgres.fresh_dsn(), 3)
    rng = random.Random(16)
    conversations, per_conversation = 100, 2
    followers: dict[int, Follower] = {}
    try:
        await cluster.start()
        async with aiohttp.ClientSession() as http, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as browser:
            sids = [await new_session(http, cluster.base(rng.randrange(3))) for _ in range(conversations)]
            # a browser on process 0 follows every fifth conversation, wherever its turns run (20 streams: as
            # many as the web server lets one client open)
            for n in range(0, conversations, 5):
                followers[n] = Follower(await open_stream(browser, cluster.base(0), sids[n]))
            for follower in followers.values():
                await follower.until(lambda e: e.name == "task_state")
            posts = [(sid, f"c{n} m{m}") for m in range(per_conversation) for n, sid in enumerate(sids)]
            await asyncio.gather(*(post(http, cluster.base(rng.randrange(3)), sid, text) for sid, text in posts))

            async def all_answered() -> bool:
                return len(fake_openai.requests) >= len(posts) and not any(model.running.values())
            await wait_for(all_answered, cluster.bridges, timeout=180)
            for n, sid in enumerate(sids):
                await cluster.wait_answered(sid, per_conversation)
                shown = await history(cluster.base(rng.randrange(3)), sid)
                said = sorted(text for role, text in shown if role == "user")
                assert said == [f"c{n} m{m}" for m in range(per_conversation)]
                assert sorted(text for role, text in shown if role == "assistant") == [
                    f"answer to {t}" for t in said]
                # one turn after the other: the k-th request saw the k-1 earlier messages answered
                assert model.seen[f"c{n}"] == [(k, k - 1) for k in range(1, per_conversation + 1)]
                if n in followers:
                    await assert_followed(followers[n], shown, per_conversation)
        assert model.overlaps == []
        assert len(fake_openai.requests) == len(posts)  # nothing answered twice
        assert len({p for p in fake_openai.auth_headers}) == 3  # every process served some
        ran_by = {asked(r): cluster.sender(i) for i, r in enumerate(fake_openai.requests)}
        # the browser on process 0 saw turns every process ran
        assert {ran_by[f"c{n} m{m}"] for n in followers for m in range(per_conversation)} == {0, 1, 2}
        cluster.clean(0, 1, 2)
    finally:
        for follower in followers.values():
            await follower.close()
        await cluster.stop()


async def assert_followed(follower: Follower, shown: list[tuple[str, str]], turns: int) -> None:
    """The browser saw each of the conversation's ``turns`` turns stream and commit, one after the other, in
    the order of its history, each once, under monotonic ids."""
    last = -1
    for _ in range(turns):
        last = await follower.until(lambda e: e.name == "turn_committed", after=last + 1)
    events = follower.events
    assert_monotonic(events)
    assert [e.name for e in events if e.name not in ("turn", "turn_committed", "message_queued")] == ["task_state"], \
        events
    queued = [e.data["client_id"] for e in events if e.name == "message_queued"]
    assert len(queued) == len(set(queued)), queued  # a message waiting behind a reply is announced once
    committed = [e.data for e in events if e.name == "turn_committed"]
    assert [(m["role"], m["content"]) for c in committed for m in c["messages"]] == shown
    # which turn each event belongs to: every event of one turn (its progress, its commit, its end) comes
    # before the next turn's first
    belongs: list[str] = []
    text: dict[str, str] = {}
    state: dict[str, str] = {}
    for e in events:
        if e.name == "turn":
            turn = e.data["turn_id"]
            text[turn] = e.data["replace"] if "replace" in e.data else text[turn] + e.data.get("append", "")
            state[turn] = e.data["state"]
            belongs.append(turn)
        elif e.name == "turn_committed":
            (turn,) = {m["turn_id"] for m in e.data["messages"]}
            belongs.append(turn)
    blocks = [turn for i, turn in enumerate(belongs) if i == 0 or belongs[i - 1] != turn]
    assert len(text) == turns and blocks == list(text), "\n".join(repr((e.name, e.id, e.data)) for e in events)
    assert [{m["turn_id"] for m in c["messages"]} for c in committed] == [{turn} for turn in text]
    assert [text[turn] for turn in text] == [content for role, content in shown if role == "assistant"]
    assert set(state.values()) == {"completed"}


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

        await cluster.wait_answered(sid, 1, on=1)
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
            holder = cluster.sender(0)
            others = [i for i in range(3) if i != holder]
            for i, text in zip(others, ("c0 second", "c0 third"), strict=True):  # stored, waiting for the holder
                await post(http, cluster.base(i), sid, text)
        await asyncio.sleep(0.5)  # what a live holder would do meanwhile: nothing (its turn is held)
        assert len(fake_openai.requests) == 1
        took = await cluster.kill_until(holder, lambda: len(fake_openai.requests) >= 2)

        await cluster.wait_answered(sid, 3, on=others[0], timeout=60)
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
            holder = cluster.sender(0)
            other = cluster.base(1 - holder)
            await post(http, other, sid, "/stop")

            async def stopped() -> bool:
                shown = await history(other, sid)
                return bool(shown) and shown[-1] == ("assistant", "⏹ Stopped.")
            await wait_for(stopped, cluster.bridges)

            await post(http, cluster.base(holder), sid, "c0 second")
            await wait_for(lambda: len(fake_openai.requests) == 2, cluster.bridges)
            assert cluster.sender(1) == holder
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
            elsewhere = cluster.base(1 - cluster.sender(3))
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
