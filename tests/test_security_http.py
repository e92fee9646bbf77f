"""The bridge's HTTP server as ``chatbridge run`` starts it, against what an attacker on the network can send:
every route without the web token, oversized bodies on every route, the Telegram webhook without (or with a
wrong, or a replayed) secret, and a web client reaching for Telegram's conversations.

The routes are read from the application the bridge builds, so a route added later without being classified
here fails :func:`test_every_route_is_classified` (with every channel that has routes enabled: Telegram's webhook,
Slack's HTTP mode, Feishu's webhook). Slack's and Feishu's own request checks are tested with their channels
(``tests/test_slack_channel.py``, ``tests/test_feishu_edges.py``, ``tests/test_feishu_channel.py``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from bridge.app import build_channels, build_http_app, build_provider
from channels.telegram.channel import SECRET_HEADER
from core.runtime import ChatCore
from core.sqlite_store import SqliteStore
from tests.fakes.openai_server import Text, ToolCalls
from tests.fakes.telegram import FakeTelegram
from tests.support.bridge_process import AUTH, WEBHOOK_SECRET, RunningBridge, start_bridge, until

CHAT = 555
SID = "a1b2c3d4e5f6a7b8"

# (method, route as registered) → a concrete path to call it with
PROTECTED = {
    ("GET", "/"): "/",
    ("GET", "/api/sessions"): "/api/sessions",
    ("POST", "/api/sessions"): "/api/sessions",
    ("GET", "/api/events"): "/api/events",
    ("PATCH", "/api/sessions/{id}"): f"/api/sessions/{SID}",
    ("POST", "/api/sessions/{id}/messages"): f"/api/sessions/{SID}/messages",
    ("GET", "/api/sessions/{id}/history"): f"/api/sessions/{SID}/history",
    ("GET", "/api/sessions/{id}/stream"): f"/api/sessions/{SID}/stream",
    ("POST", "/api/sessions/{id}/stop"): f"/api/sessions/{SID}/stop",
    ("POST", "/api/sessions/{id}/approvals/{call_id}"): f"/api/sessions/{SID}/approvals/call_1",
    ("POST", "/api/sessions/{id}/attachments"): f"/api/sessions/{SID}/attachments",
    ("GET", "/api/sessions/{id}/attachments/{attachment_id}"): f"/api/sessions/{SID}/attachments/{'0' * 32}",
    ("GET", "/metrics"): "/metrics",
}
UPLOAD = ("POST", "/api/sessions/{id}/attachments")
"""Takes files up to [media] max_bytes, streamed under that limit (its own 413), not the 1 MiB cap."""
PUBLIC = {("GET", "/healthz"), ("GET", "/login"), ("POST", "/login"), ("GET", "/static/{filename}")}
"""Open by design: the health check (monitors), the sign-in form and the page's static files."""
OWN_SECRET = {("POST", "/telegram/webhook"), ("POST", "/slack/events"), ("POST", "/feishu/events")}
"""Called by the platform, with its own secret instead of the web token."""


ROUTED_CHANNELS = """
[channels.slack]
enabled = true
mode = "http"
bot_token = "xoxb-0000-routes-test"
signing_secret = "slack-signing-secret-routes"
api_base = "http://127.0.0.1:9/api/"
[channels.feishu]
enabled = true
mode = "webhook"
app_id = "cli_routes_test"
app_secret = "feishu-app-secret-routes"
encrypt_key = "feishu-encrypt-key-routes"
verification_token = "feishu-verification-routes"
domain = "http://127.0.0.1:9"
"""
"""The other channels that add routes to the web server, configured so that they do."""


@pytest.fixture
async def tg() -> AsyncIterator[FakeTelegram]:
    async with FakeTelegram(token="424242:AAF-tgSECRET_0123456789abcdefghijkl") as fake:
        yield fake


@pytest.fixture
async def bridge(tmp_path, fake_openai, tg) -> AsyncIterator[RunningBridge]:
    running = await start_bridge(tmp_path, fake_openai, tg)
    try:
        yield running
    finally:
        assert await running.close() == 0


def _routes(app: web.Application) -> set[tuple[str, str]]:
    out = set()
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        info = route.resource.get_info() if route.resource is not None else {}
        path = info.get("path") or info.get("formatter") or (info.get("prefix", "") + "/{filename}")
        out.add((route.method, path))
    return out


async def test_every_route_is_classified(tmp_path, fake_openai, tg) -> None:
    from tests.support.bridge_process import ENV, config_text
    from tests.support.ports import free_port

    path = tmp_path / "c.toml"
    path.write_text(config_text(tmp_path, fake_openai, tg, free_port(), extra=ROUTED_CHANNELS))
    from bridge.config import load_config

    config = load_config(path, env=ENV)
    core = ChatCore(store=SqliteStore(tmp_path / "unused.db"), provider=build_provider(config))  # never started
    channels: list = []
    app = build_http_app(channels, metrics=core.metrics, metrics_token=config.web.auth_token)
    channels.extend(build_channels(config, core, app))
    try:
        assert _routes(app) == set(PROTECTED) | PUBLIC | OWN_SECRET
    finally:
        for channel in channels:
            await channel.close()


# ---- the web token on every route ----------------------------------------------------------------------


async def test_every_protected_route_needs_the_token_also_the_event_streams_and_metrics(tmp_path, fake_openai, tg):
    # behind a trusted proxy, so that each client below has its own address (wrong tokens are limited per
    # address, and the last client must not be limited by the others' guesses)
    bridge = await start_bridge(tmp_path, fake_openai, tg, web='trusted_proxies = ["127.0.0.1"]')
    http, base = bridge.http, bridge.base
    try:
        await _refused_everywhere(http, base, fake_openai)
    finally:
        assert await bridge.close() == 0


async def _refused_everywhere(http, base, fake_openai) -> None:
    for i, ((method, _), path) in enumerate(PROTECTED.items()):
        body = {"text": "hi", "title": "t", "decision": "allow"} if method in ("POST", "PATCH") else None
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {AUTH['Authorization']}"},
                        {"Authorization": AUTH["Authorization"].lower()}, {"Cookie": "chatbridge_session=forged"}):
            headers = {**headers, "X-Forwarded-For": f"203.0.113.{i}"}
            async with http.request(method, base + path, json=body, headers=headers, allow_redirects=False) as r:
                if path == "/":
                    assert r.status == 302 and r.headers["Location"] == "/login", (path, headers)
                else:
                    assert r.status == 401, (method, path, headers, r.status)
                    assert "text/event-stream" not in r.headers.get("Content-Type", "")
    # nothing was created, sent or decided
    assert fake_openai.requests == []
    async with http.get(f"{base}/api/sessions", headers={"Authorization": AUTH["Authorization"],
                                                          "X-Forwarded-For": "198.51.100.1"}) as resp:
        assert resp.status == 200 and (await resp.json())["sessions"] == []


async def test_with_the_token_every_protected_route_answers(bridge):
    http, base = bridge.http, bridge.base
    for (method, _), path in PROTECTED.items():
        body = {"text": "hi", "title": "t", "decision": "allow"} if method in ("POST", "PATCH") else None
        async with http.request(method, base + path, json=body, headers=AUTH, allow_redirects=False) as resp:
            assert resp.status not in (401, 403, 429), (method, path, resp.status)
            if path.endswith(("/stream", "/events")):
                assert resp.headers["Content-Type"].startswith("text/event-stream")


# ---- body size ------------------------------------------------------------------------------------------

BIG = 1024 * 1024 + 1


async def _chunks(total: int) -> AsyncIterator[bytes]:
    sent = 0
    while sent < total:
        piece = min(64 * 1024, total - sent)
        yield b"{" + b" " * (piece - 1) if sent == 0 else b" " * piece
        sent += piece


async def test_an_oversized_body_is_refused_on_every_route_and_nothing_is_processed(bridge, fake_openai):
    http, base, tg = bridge.http, bridge.base, bridge.tg
    routes = {**{k: v for k, v in PROTECTED.items() if k[0] != "GET" and k != UPLOAD},
              ("POST", "/login"): "/login", ("POST", "/telegram/webhook"): "/telegram/webhook"}
    update = tg.user_message("x" * (BIG + 10), enqueue=False)
    for (method, _), path in routes.items():
        headers = {**AUTH, "Content-Type": "application/json", SECRET_HEADER: WEBHOOK_SECRET}
        if path == "/login":
            headers["Content-Type"] = "application/x-www-form-urlencoded"
        body = json.dumps(update).encode() if path.startswith("/telegram") else b'{"text": "' + b"a" * BIG + b'"}'
        async with http.request(method, base + path, data=body, headers=headers, allow_redirects=False) as resp:
            assert resp.status == 413, (method, path, resp.status)
        async with http.request(method, base + path, data=_chunks(BIG), headers=headers,
                                allow_redirects=False) as resp:  # no Content-Length: the size shows only as read
            assert resp.status == 413, ("chunked", method, path, resp.status)
        multipart = {**headers, "Content-Type": "multipart/form-data; boundary=x"}  # any kind of body
        async with http.request(method, base + path, data=_chunks(BIG), headers=multipart,
                                allow_redirects=False) as resp:
            assert resp.status == 413, ("chunked multipart", method, path, resp.status)
    async with http.get(f"{base}/api/sessions", headers=AUTH) as resp:
        assert (await resp.json())["sessions"] == []  # POST /api/sessions created nothing
    assert fake_openai.requests == [] and tg.visible(CHAT) == []
    async with http.post(f"{base}/api/sessions", headers=AUTH, json={}) as resp:  # a normal one still works
        assert resp.status == 201


# ---- the Telegram webhook secret ------------------------------------------------------------------------


async def test_the_webhook_refuses_a_missing_or_wrong_secret_and_answers_a_replay_once(bridge, fake_openai):
    http, tg = bridge.http, bridge.tg
    fake_openai.script(Text("answered once"))
    update = tg.user_message("hello via webhook", enqueue=False)
    for headers in ({}, {SECRET_HEADER: ""}, {SECRET_HEADER: "wrong"}, {SECRET_HEADER: WEBHOOK_SECRET.lower()},
                    {SECRET_HEADER: WEBHOOK_SECRET[:-1]}, {SECRET_HEADER: WEBHOOK_SECRET + "x"},
                    {SECRET_HEADER: f" {WEBHOOK_SECRET}x"}, {"X-Telegram-Bot-Api-Secret": WEBHOOK_SECRET},
                    {"Authorization": f"Bearer {WEBHOOK_SECRET}"}):
        async with http.post(bridge.webhook, json=update, headers=headers) as resp:
            assert resp.status == 401, headers
    async with http.post(f"{bridge.webhook}?secret_token={WEBHOOK_SECRET}", json=update) as resp:
        assert resp.status == 401
    await asyncio.sleep(0.2)
    assert fake_openai.requests == [] and tg.visible(CHAT) == []
    for _ in range(3):  # Telegram redelivers; an eavesdropper replays: answered once
        async with http.post(bridge.webhook, json=update, headers={SECRET_HEADER: WEBHOOK_SECRET}) as resp:
            assert resp.status == 200
    await until(lambda: tg.visible(CHAT) == ["answered once"])
    await asyncio.sleep(0.3)
    answers = [r for r in fake_openai.requests if str(r["messages"][-1]["content"]).startswith("hello via webhook")]
    assert tg.visible(CHAT) == ["answered once"] and len(answers) == 1  # (the other request is the title's)


# ---- the web chat cannot reach another channel's conversations ----------------------------------------


async def test_a_web_client_cannot_read_or_decide_a_telegram_conversation(tmp_path, fake_openai, tg):
    """A Telegram turn waits for approval; the web API, token in hand, can neither list, read, stream, stop,
    rename nor decide it, however the Telegram session is spelled."""
    bridge = await start_bridge(tmp_path, fake_openai, tg, extra="[agent.fetch_url]\nenabled = true\n")
    http, base = bridge.http, bridge.base
    try:
        # a loopback URL: fetch_url refuses it before connecting, should anything ever let the call run
        fake_openai.script(ToolCalls([("fetch_url", '{"url": "http://127.0.0.1:9/private"}')], ids=["call_tg"]),
                           Text("done"))
        update = tg.user_message("a private question", enqueue=False)
        async with http.post(bridge.webhook, json=update, headers={SECRET_HEADER: WEBHOOK_SECRET}) as resp:
            assert resp.status == 200
        await until(lambda: any(m.buttons for m in tg.messages(CHAT)))
        [request] = [m for m in tg.messages(CHAT) if m.buttons]
        async with http.get(f"{base}/api/sessions", headers=AUTH) as resp:
            assert (await resp.json())["sessions"] == []
        for sid in ("telegram:555", "telegram%3A555", "..%2Ftelegram:555", "555", "telegram", "%2E%2E"):
            for method, path, body in (("GET", f"/api/sessions/{sid}/history", None),
                                       ("POST", f"/api/sessions/{sid}/stop", None),
                                       ("PATCH", f"/api/sessions/{sid}", {"title": "owned"}),
                                       ("POST", f"/api/sessions/{sid}/approvals/call_tg", {"decision": "allow"})):
                async with http.request(method, base + path, json=body, headers=AUTH) as resp:
                    if resp.status == 200:
                        got = await resp.json()
                        assert "private question" not in json.dumps(got), (method, path)
                        assert got.get("stopped") in (None, False), (method, path, got)
                    else:
                        assert resp.status in (400, 404), (method, path, resp.status)
            async with http.get(f"{base}/api/sessions/{sid}/stream", headers=AUTH) as resp:
                if resp.status == 200:
                    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
                    first += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
                    assert b"private" not in first and b"call_tg" not in first
        async with http.get(f"{base}/api/sessions", headers=AUTH) as resp:
            assert all("private" not in s["title"] for s in (await resp.json())["sessions"])
        # the Telegram request is still pending, its buttons live, the tool never ran
        await asyncio.sleep(0.2)
        assert tg.chats[CHAT][request.message_id].buttons == request.buttons
        assert len(fake_openai.requests) == 1
        press = tg.press(CHAT, request.message_id, "❌ Deny", enqueue=False)
        async with http.post(bridge.webhook, json=press, headers={SECRET_HEADER: WEBHOOK_SECRET}) as resp:
            assert resp.status == 200
        await until(lambda: tg.visible(CHAT)[-1] == "done")
    finally:
        assert await bridge.close() == 0


async def test_a_file_larger_than_the_body_cap_still_uploads_up_to_the_media_limit(bridge):
    """The upload route streams its body under [media] max_bytes (20 MB by default), past the 1 MiB cap."""
    from tests.test_web_media import upload

    async with bridge.http.post(f"{bridge.base}/api/sessions", headers=AUTH, json={}) as resp:
        sid = (await resp.json())["id"]
    status, body = await upload(bridge.http, bridge.base, sid, b"%PDF-" + b"x" * (3 * 1024 * 1024), "big.bin",
                                headers=AUTH)
    assert status == 201, body
