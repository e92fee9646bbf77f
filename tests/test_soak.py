"""Soak: a real ``chatbridge run`` with Telegram, Slack, Feishu and the web chat under mixed traffic while the
platforms and the model misbehave at random; nothing is lost, nothing is answered twice, memory stays flat.

The default run is short (``SOAK_SECONDS``, about 20 s of traffic); the long one is the same test with
``CHATBRIDGE_SOAK_SECONDS=600 pytest tests/test_soak.py``. Faults, chosen by a seeded generator, one pending
per platform at a time: a send, an edit or a streaming call answered 429 with ``retry_after`` or 5xx, or its
connection dropped (Slack), or (once per platform in the short run, once a minute in the long one) left
hanging past the bridge's bound on a call (Slack, Feishu; ``CALL_TIMEOUT``, the channels'
``call_timeout_seconds``); the receiving side drops its
connection now and then (Slack's Socket Mode websocket, Feishu's long connection: both SDKs reconnect); an
event not acknowledged within three seconds is delivered again, as Slack and Feishu do, and now and then an
acknowledged one is too; the model answers 503 or 429 (then the request is tried again), or stops sending
mid-reply (the silence bound ends the attempt); web clients resend a message with the same ``client_id`` (a
network retry). How each platform shows which message an answer belongs to is in
``tests.support.platforms``; the web chat's answers are read from the history. RSS is read from ``/proc``
after a warm-up (one answer on every platform) and at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import aiohttp

from tests.fakes.openai_server import FakeOpenAI, Function, Hang, HttpError, Text, last_user_text
from tests.fakes.slack import FakeSlack
from tests.fakes.telegram import FakeTelegram
from tests.support.platforms import (
    Bridge,
    FeishuPlatform,
    Platform,
    SlackPlatform,
    TelegramPlatform,
    feishu_fakes,
    whole_history,
)
from tests.support.ports import free_port
from tests.support.process import BridgeProcess, wait_for

SOAK_SECONDS = float(os.environ.get("CHATBRIDGE_SOAK_SECONDS", "20"))
GROUPS = [-100100 - i for i in range(4)]
SLACK_CHANNELS = ("C0SOAK1", "C0SOAK2")
FEISHU_CHATS = ("oc_soak0001", "oc_soak0002", "oc_soak0003")
WEB_SESSIONS = 3
SEED = 1234
REDELIVER_AFTER = 3.0
"""Seconds without an acknowledgement after which Slack and Feishu deliver an event again."""
CALL_TIMEOUT = 10.0
"""The channels' ``call_timeout_seconds``: a hanging call is given up after this long, not the default 30 s
(the run waits each hang out in full). Far above what any call to a fake on this machine takes: a call cut
short that had landed could show a message twice."""



def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


class Model:
    """The fake model's behaviour per message: an answer ending ``END <id>``, after a fault for some."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.faulted: set[str] = set()

    def __call__(self, body: dict[str, Any]) -> Any:
        found = re.search(r"\bsay (\S+)", last_user_text(body).split("\n\n")[0])
        assert found is not None
        ident = found.group(1)
        if ident not in self.faulted and self.rng.random() < 0.25:
            self.faulted.add(ident)  # one fault per message, then it answers
            return self.rng.choice([HttpError.server(503), HttpError.rate_limit(0.1), Hang(5, after_text="Answ")])
        words = " ".join(f"w{i}" for i in range(self.rng.randint(5, 60)))
        return Text(f"Answer {words} **END** {ident}", chunk_size=5, delay=0.01)


async def platform_message(rng: random.Random, platform: Platform, ident: str) -> None:
    """A user's message on ``platform``: in one of its group chats, or (Slack) a new @mention thread or a
    reply in a thread the bot answers in."""
    if isinstance(platform, TelegramPlatform):
        await platform.say(ident, f"say {ident}", chat=rng.choice(GROUPS))
    elif isinstance(platform, FeishuPlatform):
        await platform.say(ident, f"say {ident}", chat=rng.choice(FEISHU_CHATS), wait=False)
    elif isinstance(platform, SlackPlatform):
        joined = [i for i in platform.heads.values()
                  if all(platform.acked(d) for d in platform.deliveries if d.ident == i)]
        if joined and rng.random() < 0.6:
            await platform.say(ident, f"say {ident}", head=rng.choice(joined), wait=False)
        else:
            await platform.say(ident, f"say {ident}", channel=rng.choice(SLACK_CHANNELS), wait=False)


async def platforms_redeliver(rng: random.Random, platforms: list[Platform]) -> None:
    """What Slack and Feishu do with events: deliver again those not acknowledged in time, and now and then
    one that was."""
    now = time.monotonic()
    for p in platforms:
        for d in p.deliveries:
            late = not p.acked(d) and now - d.sent_at > REDELIVER_AFTER
            if late or (p.acked(d) and d.retries == 0 and rng.random() < 0.002):
                with contextlib.suppress(AssertionError, TimeoutError, ConnectionError):
                    await p.redeliver(d, wait=False)


async def test_mixed_traffic_with_faults_loses_nothing_and_answers_nothing_twice(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram, fake_slack: FakeSlack) -> None:
    rng = random.Random(SEED)
    fake_openai.default = Function(Model(random.Random(SEED + 1)))
    port = free_port()
    async with feishu_fakes("websocket") as (feishu, conn, origin):
        platforms: list[Platform] = [
            TelegramPlatform(tg, GROUPS), SlackPlatform(fake_slack, "socket", port, channels=SLACK_CHANNELS),
            FeishuPlatform(feishu, "websocket", port, chats=FEISHU_CHATS, conn=conn, origin=origin)]
        for p in platforms:
            p.call_timeout = CALL_TIMEOUT
        bridge = Bridge(platforms, port)
        config = tmp_path / "chatbridge.toml"
        config.write_text(f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
shutdown_timeout = 5

[llm]
provider = "openai"
model = "fake-model"
base_url = "{fake_openai.base_url}"
api_key = "sk-test"
request_timeout = 1
retry_delays = [0.05, 0.1, 0.2]

[agent]
titles = false

[web]
port = {port}
{bridge.config()}""")
        process = await BridgeProcess(config, tmp_path / "bridge.log").start()
        base = f"http://127.0.0.1:{port}"
        web_sent: dict[str, list[str]] = {}  # session → ids
        timeouts = {p.name: max(1, int(SOAK_SECONDS // 60)) for p in platforms}
        faults: list[str] = []
        try:
            await wait_for(bridge.up, process, timeout=180, what="all channels up")  # a loaded machine starts slowly
            async with aiohttp.ClientSession() as http:
                sessions = []
                for _ in range(WEB_SESSIONS):
                    async with http.post(f"{base}/api/sessions", json={}) as resp:
                        sessions.append((await resp.json())["id"])
                # warm-up: one answer on every platform and on the web, then the first RSS reading
                for p in platforms:
                    await platform_message(rng, p, f"warm{p.name}")
                async with http.post(f"{base}/api/sessions/{sessions[0]}/messages",
                                     json={"text": "say warmweb", "client_id": "warmweb"}) as resp:
                    assert (await resp.json())["status"] == "queued"
                web_sent[sessions[0]] = ["warmweb"]
                await wait_for(bridge.settled, process, timeout=120, what="the warm-up answers")
                assert process.proc is not None
                rss_start = rss_kb(process.proc.pid)

                n = 0
                deadline = time.monotonic() + SOAK_SECONDS
                while time.monotonic() < deadline:
                    n += 1
                    ident = f"m{n}"
                    if rng.random() < 0.75:
                        with contextlib.suppress(AssertionError, TimeoutError):  # no connection: redelivered later
                            await platform_message(rng, rng.choice(platforms), ident)
                    else:
                        sid = rng.choice(sessions)
                        body = {"text": f"say {ident}", "client_id": ident}
                        async with http.post(f"{base}/api/sessions/{sid}/messages", json=body) as resp:
                            status = (await resp.json())["status"]
                        if status == "queued":
                            web_sent.setdefault(sid, []).append(ident)
                            if rng.random() < 0.2:  # a client retrying: never a second answer
                                async with http.post(f"{base}/api/sessions/{sid}/messages", json=body) as resp:
                                    assert (await resp.json())["status"] == "duplicate"
                    # the platforms misbehave for a moment: one failed call at a time per platform (a blip, not
                    # an outage, which the bounded retries are not meant to outlast)
                    for p in platforms:
                        if rng.random() < 0.06:
                            hang = timeouts[p.name] > 0 and rng.random() < 0.3
                            injected = p.fault(rng, timeout=hang)
                            if injected:
                                timeouts[p.name] -= "timeout" in injected
                                faults.append(injected)
                        if rng.random() < 0.01:
                            poked = await p.poke(rng)
                            if poked:
                                faults.append(poked)
                    await platforms_redeliver(rng, platforms)
                    await asyncio.sleep(rng.uniform(0.05, 0.3))

                async def web_endings() -> dict[str, list[str]]:
                    found: dict[str, list[str]] = {}
                    for sid, idents in web_sent.items():
                        messages = await whole_history(http, base, sid)
                        for ident in idents:
                            found[ident] = []
                        current = None
                        for m in messages:
                            if m["role"] == "user":
                                current = m["content"].partition(" ")[2]
                            elif m["role"] == "assistant" and m["content"] and current in found:
                                found[current].append("answer" if m["kind"] != "notice" else "notice")
                    return found

                settle_by = time.monotonic() + 240  # generous: a loaded machine answers slowly, not wrongly
                while time.monotonic() < settle_by:
                    # settled, and every event acknowledged: an event delivered again late in the run (or
                    # Telegram's last batch, acknowledged by the next poll) may still be on its way
                    if bridge.settled() and bridge.confirmed() and all((await web_endings()).values()):
                        break
                    await platforms_redeliver(rng, platforms)
                    await asyncio.sleep(0.5)
                web = await web_endings()
                rss_end = rss_kb(process.proc.pid)
        finally:
            code = await process.stop()  # an orderly stop: after it, nothing more can be shown
        assert code == 0
        ends = {**{f"{p.name}:{i}": k for p in platforms for i, k in p.endings().items()},
                **{f"web:{i}": k for i, k in web.items()}}
        per_platform = {p.name: len(p.idents) for p in platforms} | {"web": len(web)}
        assert min(per_platform.values()) > 3, per_platform
        wrong = {ident: kinds for ident, kinds in ends.items() if kinds != ["answer"]}
        assert wrong == {}, f"{wrong}\n{bridge.describe()}\n{process.log()[-3000:]}"
        unconfirmed = {p.name: [str(d.ref) for d in p.deliveries if not p.acked(d)][-5:]
                       for p in platforms if not p.confirmed()}
        assert unconfirmed == {}, unconfirmed  # every event acknowledged in the end
        assert "Traceback" not in process.log()
        print(f"soak: {len(ends)} messages ({per_platform}) in {SOAK_SECONDS:g}s with {len(faults)} platform "
              f"faults; RSS {rss_start // 1024} MiB → {rss_end // 1024} MiB")
        assert rss_end < rss_start + 64 * 1024  # flat: no growth with traffic beyond caches' warm-up
