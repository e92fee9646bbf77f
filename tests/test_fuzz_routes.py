"""Fuzzing the HTTP routes over real HTTP: the web API's JSON bodies (messages, rename, approvals) and path
segments on the real web chat, and the Telegram webhook on the real channel — each served by aiohttp on
127.0.0.1, with a real core, SQLite and the fake model behind it.

The property, per request: an answer within a bound (no hung handler), never a 5xx, a 4xx that says what
was wrong (the web API's ``{"error": ...}``), or a correct result; and afterwards the chat still answers and
every conversation settles (no worker left stuck by what it was sent)."""

from __future__ import annotations

import asyncio
import json
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from channels.telegram.channel import SECRET_HEADER, WEBHOOK_PATH
from tests.browser.server import start_web_chat
from tests.fakes.openai_server import Text
from tests.fakes.telegram import FakeTelegram
from tests.fakes.telegram.harness import telegram_harness
from tests.support.fuzz import drive, edge_text, fuzz_fields, in_thread, json_body, json_like, text
from tests.test_fuzz_inbound import tg_message

ROUTES = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))

well_formed = st.fixed_dictionaries(
    {"text": st.one_of(text, edge_text.map(lambda t: "hi " + t)), "title": text,
     "decision": st.sampled_from(["allow", "deny", "ALLOW", "", "allow\x00"])},
    optional={"client_id": st.one_of(st.sampled_from(["m1", "a" * 64, "a" * 65, "../x", ""]), text)})
"""Bodies a client might mean: every field there, with hostile values."""
body_values = st.one_of(
    well_formed, well_formed, well_formed,
    fuzz_fields({"text": text, "client_id": text, "title": text, "decision": text}),
    json_like(),
)
raw_bodies = st.one_of(
    body_values.map(json_body),
    st.integers(50, 100_000).map(lambda d: b'{"text": ' + b"[" * d + b"]" * d + b"}"),  # nested past any parser
    st.binary(max_size=200),
    st.sampled_from([b"", b"{", b'{"text": "\xff\xfe"}', b'{"text": NaN}', b'{"text": "a"}' * 2, b"\x00" * 10,
                     b'{"text": "' + b"\\ud800" * 10 + b'"}', b'\xef\xbb\xbf{"text": "bom"}']),
)
segments = st.one_of(st.just("s1"), st.just("s1"), st.just("call_1"),
                     st.sampled_from(["s" * 64, "s" * 65, "..", "%2F", "web:s1", "telegram:555"]),
                     edge_text.filter(bool))


async def test_web_api_bodies_and_paths_never_crash_or_hang(tmp_path, fake_openai):
    fake_openai.default = Text("fine")
    chat = await start_web_chat(tmp_path, fake_openai)
    loop = asyncio.get_running_loop()
    statuses: dict[int, int] = {}
    try:
        async with aiohttp.ClientSession() as http:
            base = chat.base_url

            async def one(method: str, path: str, body: bytes, content_type: str) -> None:
                async with http.request(method, base + path, data=body,
                                        headers={"Content-Type": content_type}) as resp:
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                    assert resp.status < 500, (method, path, body[:200], resp.status, await resp.text())
                    # every refusal of ours says why; a 404 may also be the router's (no such path)
                    if resp.status >= 400 and (resp.status != 404 or resp.content_type == "application/json"):
                        payload = await resp.json()
                        assert isinstance(payload.get("error"), str) and payload["error"], payload

            async def check(sid: str, call_id: str, body: bytes, route: int, content_type: str) -> None:
                # a lone surrogate goes out as the bytes it would be in UTF-8: an invalid sequence in the path
                sid_path, call_path = (quote(s.encode("utf-8", "surrogatepass"), safe="") for s in (sid, call_id))
                method, path = [("POST", f"/api/sessions/{sid_path}/messages"), ("PATCH", f"/api/sessions/{sid_path}"),
                                ("POST", f"/api/sessions/{sid_path}/approvals/{call_path}")][route]
                await one(method, path, body, content_type)

            accepted = example(sid="s1", call_id="c1", body=b'{"text": "hi \\u202e\\u0000"}', route=0,
                               content_type="application/json")  # one that must be accepted, every run
            test = ROUTES(accepted(given(sid=segments, call_id=segments, body=raw_bodies, route=st.integers(0, 2),
                                content_type=st.sampled_from(["application/json", "application/json; charset=latin-1",
                                                              "text/plain"]))(drive(loop, check))))
            await in_thread(test)
            async with http.get(f"{base}/api/sessions") as resp:
                assert resp.status == 200
            await chat_settles(chat)
    finally:
        await chat.close()
    assert set(statuses) <= {200, 202, 400, 404, 413, 415}, statuses
    assert sum(statuses.values()) >= 50 and {202, 400} <= set(statuses), statuses  # the examples did run


async def chat_settles(chat: Any, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not chat.core.sessions.idle():
        assert asyncio.get_running_loop().time() < deadline, "a conversation never settled"
        await asyncio.sleep(0.05)


# ---- the Telegram webhook -------------------------------------------------------------------------------

tg_updates = st.one_of(
    st.builds(lambda uid, m, kind: {"update_id": uid, kind: m}, st.integers(min_value=0, max_value=2**40),
              tg_message, st.sampled_from(["message", "edited_message", "channel_post"])),
    st.builds(lambda uid, data, who: {"update_id": uid, "callback_query": {
        "id": "q1", "from": {"id": who, "is_bot": False, "first_name": "M"}, "chat_instance": "c", "data": data}},
        st.integers(0, 2**31), st.one_of(text, st.sampled_from(["a:", "a:ref:allow", "x" * 64])),
        st.sampled_from([777, 888])),
    json_like(),
)


async def test_telegram_webhook_bodies_never_crash_or_hang(tmp_path, fake_openai):
    """Any body with the right secret gets 200 (handled or ignored), 400 (not an update) or 413 (over the
    size limit); never a 5xx, which Telegram would answer by sending the same update again and again."""
    fake_openai.default = Text("fine")
    async with FakeTelegram() as tg:
        t = await telegram_harness(tmp_path, fake_openai, tg, mode="webhook", group_policy="all",
                                   webhook_url="https://bot.example.com/telegram/webhook", webhook_secret="s3cret")
        app = web.Application()
        t.channel.routes(app)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}{WEBHOOK_PATH}"
        loop = asyncio.get_running_loop()
        try:
            async with aiohttp.ClientSession() as http:

                async def check(body: Any, raw: bool) -> None:
                    data = body if raw else json_body(body)
                    async with http.post(url, data=data, headers={SECRET_HEADER: "s3cret",
                                                                  "Content-Type": "application/json"}) as resp:
                        assert resp.status in (200, 400, 413), (data[:300], resp.status)

                test = ROUTES(given(body=st.one_of(tg_updates, st.binary(max_size=100)), raw=st.booleans())(
                    drive(loop, lambda body, raw: check(body, isinstance(body, bytes)))))
                await in_thread(test)
                # still receiving: a normal message is answered
                update = tg.user_message("still there?", chat_id=4242, enqueue=False)
                async with http.post(url, json=update, headers={SECRET_HEADER: "s3cret"}) as resp:
                    assert resp.status == 200
                await t.wait_for(lambda: tg.visible(4242) == ["fine"], timeout=20)
        finally:
            await t.close()
            await runner.cleanup()


async def test_a_poison_update_does_not_stop_polling(tmp_path, fake_openai):
    """A group message whose mention entity covers a lone surrogate (or ends inside a surrogate pair) is read
    like any other; the updates after it are still fetched and answered."""
    fake_openai.default = Text("fine")
    async with FakeTelegram() as tg:
        t = await telegram_harness(tmp_path, fake_openai, tg, group_policy="mention")
        try:
            for body in ("\ud800 @chatbridge_test_bot", "😀@chatbridge_test_bot"):
                update = tg.user_message(body, chat_id=-100123, chat_type="supergroup",
                                         entities=[{"type": "mention", "offset": 1, "length": 20}])
                assert json.loads(json.dumps(update))  # sent as \\ud800 on the wire, as Telegram would escape it
            tg.user_message("and then this", chat_id=4242)
            await t.wait_for(lambda: tg.visible(4242) == ["fine"], timeout=20)
        finally:
            await t.close()
