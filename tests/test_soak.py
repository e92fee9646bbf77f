"""Soak: a real ``chatbridge run`` with Telegram and the web chat under mixed traffic while the platform and
the model misbehave at random; nothing is lost, nothing is answered twice, memory stays flat.

The default run is short (``SOAK_SECONDS``, about 20 s of traffic); the long one is the same test with
``CHATBRIDGE_SOAK_SECONDS=600 pytest tests/test_soak.py``. Faults, chosen by a seeded generator: Telegram
answers 429 with ``retry_after`` or 5xx to a send, an edit or a typing call; the model answers 503 or 429
(then the request is tried again), or stops sending mid-reply (the silence bound ends the attempt); web
clients resend a message with the same ``client_id`` (a network retry). Every Telegram message is sent in a
group so that the bot's answers say which message they answer; the web chat's answers are read from the
history. RSS is read from ``/proc`` after a warm-up and at the end.
"""

from __future__ import annotations

import asyncio
import os
import random
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.fakes.openai_server import FakeOpenAI, Function, Hang, HttpError, Text, last_user_text
from tests.fakes.telegram import FakeTelegram
from tests.support.process import BridgeProcess
from tests.test_app import free_port

SOAK_SECONDS = float(os.environ.get("CHATBRIDGE_SOAK_SECONDS", "20"))
GROUPS = [-100100 - i for i in range(4)]
WEB_SESSIONS = 3
SEED = 1234


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram() as fake:
        yield fake


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
        ident = last_user_text(body).split("\n\n")[0].partition(" ")[2]
        if ident not in self.faulted and self.rng.random() < 0.25:
            self.faulted.add(ident)  # one fault per message, then it answers
            return self.rng.choice([HttpError.server(503), HttpError.rate_limit(0.1), Hang(5, after_text="Answ")])
        words = " ".join(f"w{i}" for i in range(self.rng.randint(5, 60)))
        return Text(f"Answer {words} **END** {ident}", chunk_size=5, delay=0.01)


async def test_mixed_traffic_with_faults_loses_nothing_and_answers_nothing_twice(
        tmp_path: Path, fake_openai: FakeOpenAI, tg: FakeTelegram) -> None:
    rng = random.Random(SEED)
    fake_openai.default = Function(Model(random.Random(SEED + 1)))
    port = free_port()
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

[channels.telegram]
enabled = true
token = "{tg.token}"
api_base = "{tg.base_url}"
edit_interval_ms = 100
group_policy = "all"
""")
    bridge = await BridgeProcess(config, tmp_path / "bridge.log").start()
    base = f"http://127.0.0.1:{port}"
    telegram_sent: dict[int, tuple[int, str]] = {}  # user message id → (chat, id)
    web_sent: dict[str, list[str]] = {}  # session → ids
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(500):
                try:
                    async with http.get(f"{base}/healthz") as resp:
                        if resp.status == 200 and (await resp.json())["channels"].get("telegram") == "polling":
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the bridge did not come up:\n" + bridge.log()[-3000:])
            sessions = []
            for _ in range(WEB_SESSIONS):
                async with http.post(f"{base}/api/sessions", json={}) as resp:
                    sessions.append((await resp.json())["id"])
            assert bridge.proc is not None
            rss_start = rss_kb(bridge.proc.pid)

            n = 0
            deadline = time.monotonic() + SOAK_SECONDS
            while time.monotonic() < deadline:
                n += 1
                ident = f"m{n}"
                if rng.random() < 0.6:
                    chat = rng.choice(GROUPS)
                    update = tg.user_message(f"say {ident}", chat_id=chat, chat_type="group")
                    telegram_sent[update["message"]["message_id"]] = (chat, ident)
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
                # the platform misbehaves for a moment: one failed call at a time (a blip, not an outage,
                # which the bounded retries are not meant to outlast)
                if rng.random() < 0.15 and all(f.times == 0 for f in tg.faults):
                    method = rng.choice(["sendMessage", "editMessageText", "sendChatAction"])
                    if rng.random() < 0.5:
                        tg.fail(method, status=429, description="Too Many Requests: retry after 1", retry_after=1)
                    else:
                        tg.fail(method, status=502, description="Bad Gateway")
                await asyncio.sleep(rng.uniform(0.05, 0.3))

            def telegram_endings() -> dict[str, list[str]]:
                found: dict[str, list[str]] = {ident: [] for _, ident in telegram_sent.values()}
                for chat in GROUPS:
                    for m in tg.messages(chat):
                        if m.deleted or m.reply_to not in telegram_sent:
                            continue
                        ident = telegram_sent[m.reply_to][1]
                        if re.search(rf"END {ident}$", m.text) and "**" not in m.text:
                            found[ident].append("answer")
                        elif m.text.startswith("⚠️"):
                            found[ident].append("notice")
                return found

            async def web_endings() -> dict[str, list[str]]:
                found: dict[str, list[str]] = {}
                for sid, idents in web_sent.items():
                    async with http.get(f"{base}/api/sessions/{sid}/history") as resp:
                        messages = (await resp.json())["messages"]
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
                ends = {**telegram_endings(), **await web_endings()}
                if all(ends.values()):
                    break
                await asyncio.sleep(0.5)
            await asyncio.sleep(1.0)  # anything shown twice would show by now
            ends = {**telegram_endings(), **await web_endings()}
            rss_end = rss_kb(bridge.proc.pid)
    finally:
        code = await bridge.stop()
    assert code == 0
    assert len(ends) == len(telegram_sent) + sum(map(len, web_sent.values())) > 20
    wrong = {ident: kinds for ident, kinds in ends.items() if kinds != ["answer"]}
    shown = [f"{chat} reply_to={m.reply_to} deleted={m.deleted}: {m.text[-60:]!r}" for chat in GROUPS
             for m in tg.messages(chat) if m.reply_to in telegram_sent and telegram_sent[m.reply_to][1] in wrong]
    sent_where = {ident: ("telegram" if any(i == ident for _, i in telegram_sent.values()) else "web")
                  for ident in wrong}
    assert wrong == {}, f"{sent_where}\n" + "\n".join(shown) + "\n" + bridge.log()[-3000:]
    assert "Traceback" not in bridge.log()
    print(f"soak: {len(ends)} messages in {SOAK_SECONDS:g}s; RSS {rss_start // 1024} MiB → {rss_end // 1024} MiB")
    assert rss_end < rss_start + 64 * 1024  # flat: no growth with traffic beyond caches' warm-up
