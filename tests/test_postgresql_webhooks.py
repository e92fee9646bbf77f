"""Slack's HTTP Events API and Feishu's webhook across three real ``chatbridge run`` processes on one PostgreSQL
database: any process accepts an event, as behind a load balancer. Every event goes to a random process, and
the platform delivers it again to a DIFFERENT process (Slack's retry with ``X-Slack-Retry-Num``; Feishu's
redelivery of the same event, and its push of the same message under a new event id) while the first may
still be storing it; Slack also sends a channel mention twice (``app_mention`` and ``message``), to two
processes here. What the user sees: every message answered once, in its conversation; what the model was
sent: a conversation's requests never overlap, each one after the previous answer.
"""

from __future__ import annotations

import asyncio
import random
import re
from pathlib import Path
from typing import Any

from tests.fakes.feishu import FakeFeishu, WebhookSender
from tests.fakes.feishu.events import Mention
from tests.fakes.openai_server import FakeOpenAI, Function
from tests.fakes.slack import EventSender, FakeSlack
from tests.support.cluster import Cluster, SerialModel, asked
from tests.support.postgres import PostgresCluster
from tests.support.process import wait_for

PROCESSES = 3
CONVERSATIONS = 12
FEISHU_TOKEN = "vt_cluster_verification_token"
FEISHU_KEY = "ek_cluster_encrypt_key"
LEASE_SECONDS = 10
"""The default: nothing here dies, and no process should lose a lease because the machine is busy."""


def elsewhere(rng: random.Random, than: int) -> int:
    """A process other than ``than``."""
    return rng.choice([i for i in range(PROCESSES) if i != than])


def said(text: str) -> str:
    """``c<n> m<k>``, wherever the platform put it in the text."""
    found = re.search(r"\bc\d+ m\d+\b", text)
    assert found is not None, text
    return found.group(0)


def assert_serial(model: SerialModel, fake: FakeOpenAI, messages: list[str]) -> None:
    """The model was asked each message once, and a conversation's requests came one after the other, each
    seeing the earlier messages answered."""
    assert sorted(said(asked(r)) for r in fake.requests) == sorted(messages)
    assert model.overlaps == []
    for n in range(CONVERSATIONS):
        assert model.seen[f"c{n}"] == [(1, 0), (2, 1)], (n, model.seen[f"c{n}"])
    # Which process runs a conversation is whichever stored its first copy first: no spread is promised (under
    # load one process may take them all). Every message went to two different processes at least, so copies
    # reached a process that did not run the conversation either way.


async def test_slack_http_events_to_any_process_each_message_answered_once_serially(
        tmp_path: Path, fake_openai: FakeOpenAI, fake_slack: FakeSlack, postgres: PostgresCluster) -> None:
    model = SerialModel(pause=0.3)
    fake_openai.default = Function(model.answer)
    slack = fake_slack
    slack.add_channel("C0GENERAL", "channel")
    cluster = Cluster(tmp_path, fake_openai, postgres.fresh_dsn(), PROCESSES, lease_seconds=LEASE_SECONDS,
                      extra=f"""
[channels.slack]
enabled = true
mode = "http"
bot_token = "{slack.bot_token}"
signing_secret = "{slack.signing_secret}"
api_base = "{slack.base_url}"
update_interval_ms = 100
workspace_updates_per_minute = 6000
""")  # the workspace's update budget is not this test's point (test_slack_channel.py paces it): 24 answers at
    # the default 50 a minute would take most of a minute when one process runs them all
    senders = [EventSender(f"{cluster.base(i)}/slack/events", slack.signing_secret, timeout=30)
               for i in range(PROCESSES)]
    rng = random.Random(1601)
    statuses: list[int] = []

    async def deliver(body: dict[str, Any], to: int, retry: int | None = None) -> None:
        statuses.append((await senders[to].event(body, retry_num=retry)).status)

    def twice(body: dict[str, Any]) -> list[Any]:
        """The event to one process, and Slack's retry of it (no ack in time, it thinks) to another."""
        first = rng.randrange(PROCESSES)
        return [deliver(body, first), deliver(body, elsewhere(rng, first), retry=1)]

    try:
        await cluster.start()
        await cluster.receiving("slack", "serving")
        # each conversation begins with an @mention in the channel: Slack sends it as app_mention and as
        # message, here to two processes, and retries app_mention on the third
        threads: list[str] = []
        first: list[Any] = []
        for n in range(CONVERSATIONS):
            as_mention, as_message = slack.mention(f"c{n} m0")
            threads.append(as_message["event"]["ts"])
            mention_to, retry_to, message_to = rng.sample(range(PROCESSES), 3)
            first += [deliver(as_mention, mention_to), deliver(as_mention, retry_to, retry=1),
                      deliver(as_message, message_to)]
        await asyncio.gather(*first)
        assert statuses == [200] * len(first)  # stored (or known) wherever each landed: Slack retries nothing
        # the next message of each thread, while its first may still be answered
        await asyncio.gather(*(call for n, ts in enumerate(threads)
                               for call in twice(slack.user_message(f"c{n} m1", channel="C0GENERAL",
                                                                    thread_ts=ts))))
        assert statuses == [200] * len(statuses)

        def answers(ts: str) -> list[str]:
            return [m.shown for m in slack.messages("C0GENERAL", thread_ts=ts)
                    if not m.streaming and any(b.get("type") == "markdown" for b in m.blocks)]

        def all_answered() -> bool:
            return all(len(answers(ts)) >= 2 for ts in threads) and not any(model.running.values())
        await wait_for(all_answered, cluster.bridges, timeout=120, what="every thread answered twice")
        await asyncio.sleep(1.0)  # a second answer to anything, or a late turn, would show by now
        for n, ts in enumerate(threads):
            assert [said(text) for text in answers(ts)] == [f"c{n} m0", f"c{n} m1"], answers(ts)
            assert len(slack.messages("C0GENERAL", thread_ts=ts)) == 2  # nothing else shown in the thread
            assert all(text.startswith("answer to") for text in answers(ts)), answers(ts)
        assert slack.messages("C0GENERAL", thread_ts=None) == []  # nothing answered outside its thread
        assert_serial(model, fake_openai, [f"c{n} m{k}" for n in range(CONVERSATIONS) for k in range(2)])
        cluster.clean(*range(PROCESSES))
    finally:
        await cluster.stop()


async def test_feishu_webhook_events_to_any_process_each_message_answered_once_serially(
        tmp_path: Path, fake_openai: FakeOpenAI, postgres: PostgresCluster) -> None:
    model = SerialModel(pause=0.3)
    fake_openai.default = Function(model.answer)
    rng = random.Random(1602)
    async with FakeFeishu() as feishu:
        cluster = Cluster(tmp_path, fake_openai, postgres.fresh_dsn(), PROCESSES, lease_seconds=LEASE_SECONDS,
                          extra=f"""
[channels.feishu]
enabled = true
app_id = "{feishu.app_id}"
app_secret = "{feishu.app_secret}"
domain = "{feishu.base_url}"
mode = "webhook"
verification_token = "{FEISHU_TOKEN}"
encrypt_key = "{FEISHU_KEY}"
stream_interval_ms = 100
""")
        senders = [WebhookSender(f"{cluster.base(i)}/feishu/events", FEISHU_TOKEN, feishu.app_id, FEISHU_KEY)
                   for i in range(PROCESSES)]
        mention = [Mention(feishu.bot_name, feishu.bot_open_id)]
        statuses: list[int] = []
        sent: dict[str, str] = {}  # the user's message id -> what it says

        async def deliver(body: dict[str, Any], to: int) -> None:
            statuses.append((await senders[to].send(body)).status)

        def message(chat: str, text: str) -> list[Any]:
            """A user's message to one process, and Feishu's delivery of it again to another: the same event
            (no ack within 3 s, it thinks), or every other time the same message under a new event id."""
            msg = feishu.user_message(chat, text)
            sent[msg.message_id] = text
            bodies = [senders[0].message(f"@_user_1 {text}", chat_id=chat, message_id=msg.message_id,
                                         mentions=mention)]
            if len(sent) % 2:
                bodies.append(bodies[0])
            else:
                bodies.append(senders[0].message(f"@_user_1 {text}", chat_id=chat, message_id=msg.message_id,
                                                 mentions=mention))
                assert bodies[1]["header"]["event_id"] != bodies[0]["header"]["event_id"]
            first = rng.randrange(PROCESSES)
            return [deliver(bodies[0], first), deliver(bodies[1], elsewhere(rng, first))]

        chats = [f"oc_cluster{n:04d}" for n in range(CONVERSATIONS)]
        try:
            await cluster.start()
            await cluster.receiving("feishu", "webhook")
            for chat in chats:
                feishu.chat(chat)
            # both messages of every conversation at once, each to two processes
            await asyncio.gather(*(call for n, chat in enumerate(chats) for k in range(2)
                                   for call in message(chat, f"c{n} m{k}")))
            assert statuses == [200] * len(statuses) and len(statuses) == 4 * CONVERSATIONS

            def answers(chat: str) -> list[tuple[str, str]]:
                """(the message it quotes, its text) for each finished reply in ``chat``."""
                return [(sent[m.parent_id], feishu.text_of(m)) for m in feishu.shown(chat)
                        if m.parent_id in sent and not streaming(m)]

            def streaming(m: Any) -> bool:
                card = feishu.card_of(m)
                return card is not None and card.streaming

            def all_answered() -> bool:
                return all(len(answers(chat)) >= 2 for chat in chats) and not any(model.running.values())
            await wait_for(all_answered, cluster.bridges, timeout=120, what="every chat answered twice")
            await asyncio.sleep(1.0)  # a second answer to anything, or a late turn, would show by now
            for n, chat in enumerate(chats):
                shown = answers(chat)
                assert len(feishu.shown(chat)) == 2  # nothing else shown in the chat
                assert sorted(quoted for quoted, _ in shown) == [f"c{n} m0", f"c{n} m1"], shown
                assert all(said(text) == quoted and text.startswith("answer to") for quoted, text in shown), shown
            assert_serial(model, fake_openai, [f"c{n} m{k}" for n in range(CONVERSATIONS) for k in range(2)])
            cluster.clean(*range(PROCESSES))
        finally:
            await cluster.stop()
