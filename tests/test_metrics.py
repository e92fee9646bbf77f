"""``GET /metrics``: what an operator's Prometheus sees after real turns, read with prometheus_client's parser."""

from __future__ import annotations

import asyncio

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bridge.app import run_app
from bridge.config import load_config
from tests.fakes.openai_server import HttpError, Text
from tests.fakes.telegram.harness import telegram_harness
from tests.support.harness import make_harness
from tests.support.ports import free_port
from tests.test_app import write_config
from tests.test_telegram_redelivery import ANSWER as LONG_ANSWER
from tests.test_telegram_redelivery import retrying, undelivered

CHAT = 555
ANSWER = "The capital of France is **Paris**."
SHOWN = "The capital of France is Paris."
TOKEN = "metrics-test-token-0123456789"


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the exposition: (name, sorted labels) → value."""
    found = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            found[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return found


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, tuple(sorted(labels.items()))), 0.0)



async def test_a_turn_with_a_model_retry_a_429_and_a_fallback_is_counted(tmp_path, fake_openai, tg):
    hold = asyncio.Event()
    fake_openai.script(HttpError.server(503), Text(ANSWER, hold=hold, hold_after=30))
    # the reply is held until the preview shows, which waits out the 429's second: the model's silence bound
    # must outlast that, or the held reply times out and is retried (a second retry, another reply)
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"request_timeout": 30.0})
    try:
        tg.fail("sendMessage", status=429, description="Too Many Requests: retry after 1", retry_after=1)
        tg.fail("editMessageText", description="Bad Request: message to edit not found",
                when=lambda p: bool(p.get("entities")))
        tg.user_message("capital of France?")
        await t.wait_for(lambda: tg.messages(CHAT), timeout=10)  # the preview, to be finished by an edit
        hold.set()
        await t.settle()
        assert tg.visible(CHAT).count(SHOWN) == 1  # the fallback, once
        text = t.core.metrics.render().decode()
    finally:
        await t.close()
    assert value(text, "chatbridge_turns_total", outcome="completed") == 1
    assert value(text, "chatbridge_turn_duration_seconds_count") == 1
    assert value(text, "chatbridge_model_retries_total") == 1
    assert value(text, "chatbridge_fallbacks_total", channel="telegram") == 1
    assert value(text, "chatbridge_platform_calls_total", channel="telegram", result="rate_limited") == 1
    assert value(text, "chatbridge_platform_calls_total", channel="telegram", result="error") == 1  # the final edit
    # every answered call counts (a long poll still in flight when the metrics were read may not yet)
    ok = value(text, "chatbridge_platform_calls_total", channel="telegram", result="ok")
    answered = [c for c in tg.calls if c.status == 200]
    assert len([c for c in answered if c.method != "getUpdates"]) <= ok <= len(answered)
    assert value(text, "chatbridge_queue_depth") == 0 and value(text, "chatbridge_running_turns") == 0


async def test_the_queue_and_running_turns_show_while_a_reply_is_written(tmp_path, fake_openai, tg):
    hold = asyncio.Event()
    fake_openai.script(Text("slow", hold=hold))
    t = await telegram_harness(tmp_path, fake_openai, tg)
    try:
        tg.user_message("first")
        await t.wait_for(lambda: len(fake_openai.requests) == 1)
        tg.user_message("second")
        tg.user_message("third")
        await t.wait_for(lambda: value(t.core.metrics.render().decode(), "chatbridge_queue_depth") == 2)
        text = t.core.metrics.render().decode()
        assert value(text, "chatbridge_running_turns") == 1 and value(text, "chatbridge_active_sessions") == 1
        hold.set()
        await t.settle()
        text = t.core.metrics.render().decode()
        assert value(text, "chatbridge_turns_total", outcome="completed") == 3
        assert value(text, "chatbridge_queue_depth") == 0 and value(text, "chatbridge_running_turns") == 0
        # its worker waits a while for more (session_idle_seconds), but the session has nothing to do
        assert t.core.sessions.active_count == 1 and value(text, "chatbridge_active_sessions") == 0
    finally:
        await t.close()


async def test_model_retries_of_compaction_and_titles_are_counted(tmp_path, fake_openai):
    h = await make_harness(tmp_path, fake_openai, titles=True)
    try:
        fake_openai.script(Text("first answer"), HttpError.server(503), Text("A Title"))
        await h.say("first question")
        await h.wait_for(lambda: len(fake_openai.requests) == 3, timeout=10)  # the title, tried again
        await h.wait_for(lambda: value(h.core.metrics.render().decode(), "chatbridge_model_retries_total") == 1)
        fake_openai.script(HttpError.server(503), Text("SUMMARY"))
        await h.say("/compact")
        await h.settle()
        assert "Compacted" in h.platform.plain("c1")[-1] and len(fake_openai.requests) == 5
        assert value(h.core.metrics.render().decode(), "chatbridge_model_retries_total") == 2
    finally:
        await h.core.shutdown()


async def test_an_answer_sent_again_after_a_restart_counts_as_a_fallback(tmp_path, fake_openai, tg):
    """The final send timed out (it may have landed): nothing is sent then; the next start sends the answer as a
    plain message, which is a fallback like any other."""
    hold = asyncio.Event()
    fake_openai.script(Text(LONG_ANSWER, chunk_size=4, delay=0.01, hold=hold))
    t = await telegram_harness(tmp_path, fake_openai, tg, call_timeout=0.3,
                               core={"redelivery_delays": (0.05, 0.05, 0.05)})
    try:
        tg.fail("sendChatAction", status=403, description="Forbidden: bot was blocked by the user")
        fault = tg.fail("sendMessage", status=502, description="Bad Gateway", apply_first=True, hang=30.0,
                        times=1_000_000)
        tg.user_message("capital of France?")
        await t.release_after_typing(hold)
        await t.settle()
        await t.wait_for(lambda: not retrying(), timeout=10)
        assert len(await undelivered(t)) == 1
        first = value(t.core.metrics.render().decode(), "chatbridge_fallbacks_total", channel="telegram")
    finally:
        await t.close()
    fault.times = 0
    sends = tg.count("sendMessage")
    t = await telegram_harness(tmp_path, fake_openai, tg)  # the start sends it as a plain message
    try:
        await t.settle()
        await t.wait_for(lambda: tg.count("sendMessage") == sends + 1)
        again = value(t.core.metrics.render().decode(), "chatbridge_fallbacks_total", channel="telegram")
    finally:
        await t.close()
    assert (first, again) == (0, 1)


async def test_metrics_are_served_over_http_and_need_the_token_when_the_chat_has_one(tmp_path, fake_openai):
    fake_openai.script(Text("hello there"))
    port = free_port()
    path = write_config(tmp_path, f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
[llm]
provider = "openai"
model = "fake"
base_url = "{fake_openai.base_url}"
api_key = "k"
[web]
port = {port}
auth_token = "{TOKEN}"
""")
    stop = asyncio.Event()
    task = asyncio.create_task(run_app(load_config(path), config_path=str(path), stop=stop))
    base = f"http://127.0.0.1:{port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(200):  # listening first, then 503 "starting" until the channels are up
                try:
                    async with http.get(f"{base}/healthz") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("server did not come up")
            async with http.get(f"{base}/metrics") as resp:
                assert resp.status == 401 and TOKEN not in await resp.text()
            async with http.get(f"{base}/metrics", headers={"Authorization": "Bearer wrong"}) as resp:
                assert resp.status == 401
            async with http.post(f"{base}/api/sessions", headers=auth, json={}) as resp:
                sid = (await resp.json())["id"]
            async with http.post(f"{base}/api/sessions/{sid}/messages", headers=auth,
                                 json={"text": "hi", "client_id": "m1"}) as resp:
                assert resp.status == 202
            for _ in range(250):
                async with http.get(f"{base}/metrics", headers=auth) as resp:
                    assert resp.status == 200 and resp.content_type == "text/plain"
                    text = await resp.text()
                if value(text, "chatbridge_turns_total", outcome="completed") == 1:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the turn was not counted")
            assert "hi" not in [s[1] for s in samples(text)]  # nothing a user wrote is a label
            assert sid not in text
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0
