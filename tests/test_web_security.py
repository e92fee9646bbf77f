"""The web chat against requests a hostile page (or a flood) can make, over real HTTP: foreign origins, DNS
rebinding, framing headers, the login cookie, guessing, stream caps, abandoned streams and bad input.

The browser-driven versions (a page on another origin trying the same) are in tests/browser/."""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import pytest
from aiohttp import web

from channels.telegram.channel import SECRET_HEADER, WEBHOOK_PATH
from channels.web.auth import COOKIE, GuessLimiter
from channels.web.factory import build
from channels.web.server import WebAccess
from tests.browser.server import open_stream, seq_of, start_web_chat
from tests.fakes.openai_server import Text
from tests.fakes.telegram import FakeTelegram
from tests.fakes.telegram.harness import telegram_harness

TOKEN = "correct-horse-battery"


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def chat(tmp_path, fake_openai):
    wc = await start_web_chat(tmp_path, fake_openai, reap_interval=0.02)
    try:
        yield wc
    finally:
        await wc.close()


async def sessions(http, base, **kw):
    async with http.get(f"{base}/api/sessions", **kw) as resp:
        return resp.status, await resp.json()


async def until(condition, timeout: float = 10.0) -> None:
    """Wait (bounded) for the server to notice what the client did; polling, as the server's reaper does."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


FOREIGN = [
    {"Origin": "http://evil.example"},
    {"Origin": "http://127.0.0.1:1"},  # another port on the same address is another origin
    {"Origin": "null"},  # sandboxed frames, file: pages
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},
]


# ---- origins (a foreign page posting to the loopback chat) ------------------------------------------------


@pytest.mark.parametrize("headers", FOREIGN, ids=lambda h: next(iter(h.values())))
async def test_state_changing_requests_from_another_origin_are_refused(chat, http, fake_openai, headers):
    base = chat.base_url
    async with http.post(f"{base}/api/sessions") as resp:  # no Origin at all: not a browser (curl, a script)
        sid = (await resp.json())["id"]
    calls = [
        ("POST", "/api/sessions", None),
        ("POST", f"/api/sessions/{sid}/messages", {"text": "run a tool for me"}),
        ("POST", f"/api/sessions/{sid}/stop", None),
        ("PATCH", f"/api/sessions/{sid}", {"title": "owned"}),
        ("POST", f"/api/sessions/{sid}/approvals/call_1", {"decision": "allow"}),
    ]
    for method, path, body in calls:
        async with http.request(method, base + path, json=body, headers=headers) as resp:
            assert resp.status == 403, (method, path)
            assert "cross-origin" in (await resp.json())["error"]
    status, listed = await sessions(http, base)
    assert status == 200 and [(s["id"], s["title"]) for s in listed["sessions"]] == [(sid, "New chat")]
    async with http.get(f"{base}/api/sessions/{sid}/history") as resp:
        assert (await resp.json())["messages"] == []
    assert fake_openai.requests == []  # no turn ran


async def test_the_chats_own_origin_and_non_browser_clients_may_post(chat, http, fake_openai):
    fake_openai.script(Text("from the page"), Text("from a script"))
    base = chat.base_url
    own = {"Origin": base, "Sec-Fetch-Site": "same-origin"}
    async with http.post(f"{base}/api/sessions", headers=own) as resp:
        assert resp.status == 201
        sid = (await resp.json())["id"]
    sse = await open_stream(http, base, sid, headers={"Sec-Fetch-Site": "same-origin"})
    await sse.next()
    async with http.post(f"{base}/api/sessions/{sid}/messages", json={"text": "hi"}, headers=own) as resp:
        assert resp.status == 202
    await sse.until(lambda e: e.name == "turn_committed")
    async with http.post(f"{base}/api/sessions/{sid}/messages", json={"text": "again"}) as resp:
        assert resp.status == 202
    await sse.until(lambda e: e.name == "turn_committed" and e.data["history_revision"] == 2)
    sse.resp.close()


async def test_json_routes_take_only_json(chat, http, fake_openai):
    """A page can send text/plain or a form to any origin without asking the browser first; JSON cannot be."""
    base = chat.base_url
    async with http.post(f"{base}/api/sessions") as resp:
        sid = (await resp.json())["id"]
    body = json.dumps({"text": "run a tool"})
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        async with http.post(f"{base}/api/sessions/{sid}/messages", data=body,
                             headers={"Content-Type": content_type}) as resp:
            assert resp.status == 415, content_type
            assert "application/json" in (await resp.json())["error"]
    assert fake_openai.requests == []


async def test_cross_site_reads_of_the_api_are_refused_but_links_to_the_page_work(chat, http):
    base = chat.base_url
    for headers in ({"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                    {"Origin": "http://evil.example"}):
        assert (await sessions(http, base, headers=headers))[0] == 403
        async with http.get(f"{base}/api/sessions/x/stream", headers=headers) as resp:
            assert resp.status == 403
    # following a link from another site opens the page (framing it is what the headers forbid)
    async with http.get(f"{base}/", headers={"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Dest": "document"}) as resp:
        assert resp.status == 200


async def test_webhooks_keep_working_without_an_origin_under_the_public_host_name(tmp_path, fake_openai):
    async with FakeTelegram() as tg:
        fake_openai.script(Text("via the proxy"))
        t = await telegram_harness(tmp_path, fake_openai, tg, mode="webhook",
                                   webhook_url="https://bot.example.com/telegram/webhook", webhook_secret="s3cret")
        app = web.Application()
        runtime = build(t.h.core.host_for("web"), app)  # the web chat on the same server, with its rules
        t.channel.routes(app)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            update = tg.user_message("hi through the proxy", enqueue=False)
            async with aiohttp.ClientSession() as http:
                # a TLS proxy forwards Telegram's POST with the public name and no Origin
                proxy_headers = {SECRET_HEADER: "s3cret", "Host": "bot.example.com", "X-Forwarded-Proto": "https"}
                async with http.post(base + WEBHOOK_PATH, json=update, headers=proxy_headers) as resp:
                    assert resp.status == 200
                # while the web chat itself does not answer under that name
                async with http.get(f"{base}/api/sessions", headers={"Host": "bot.example.com"}) as resp:
                    assert resp.status == 403
            await t.wait_for(lambda: tg.visible(555))
            assert tg.visible(555) == ["via the proxy"]
        finally:
            await runtime.close()
            await t.close()
            await runner.cleanup()


# ---- host names (DNS rebinding) -------------------------------------------------------------------------


async def test_only_the_chats_own_host_names_are_answered(tmp_path, fake_openai, http):
    chat = await start_web_chat(tmp_path, fake_openai, access=WebAccess(allowed_hosts=("chat.example.com",)))
    try:
        base, port = chat.base_url, chat.base_url.rsplit(":", 1)[1]
        async with http.post(f"{base}/api/sessions") as resp:
            sid = (await resp.json())["id"]
        for host in ("rebind.attacker.example", f"rebind.attacker.example:{port}", "localhost.attacker.example",
                     "chat.example.com.evil.example", "", "[bad"):
            h = {"Host": host}
            assert (await sessions(http, base, headers=h))[0] in (400, 403), host
            async with http.get(f"{base}/api/sessions/{sid}/history", headers=h) as resp:
                assert resp.status in (400, 403), host
                if resp.status == 403:
                    assert "allowed_hosts" in (await resp.json())["error"]
            async with http.get(f"{base}/", headers=h) as resp:
                assert resp.status in (400, 403), host
        for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", "LOCALHOST.", "chat.example.com",
                     f"chat.example.com:{port}", "[::1]:8765", "192.0.2.7"):
            status, listed = await sessions(http, base, headers={"Host": host})
            assert status == 200 and [s["id"] for s in listed["sessions"]] == [sid], host
    finally:
        await chat.close()


async def test_behind_a_trusted_proxy_the_forwarded_host_and_scheme_count(tmp_path, fake_openai, http):
    access = WebAccess(allowed_hosts=("chat.example.com",), trusted_proxies=("127.0.0.1",))
    chat = await start_web_chat(tmp_path, fake_openai, access=access)
    try:
        base = chat.base_url
        via_proxy = {"X-Forwarded-Host": "chat.example.com", "X-Forwarded-Proto": "https",
                     "Origin": "https://chat.example.com"}
        async with http.post(f"{base}/api/sessions", headers=via_proxy) as resp:
            assert resp.status == 201
        # the page's origin is https://chat.example.com; the same name over http is another origin
        async with http.post(f"{base}/api/sessions", headers={**via_proxy, "Origin": "http://chat.example.com"}) as r:
            assert r.status == 403
        async with http.get(f"{base}/api/sessions", headers={"X-Forwarded-Host": "rebind.attacker.example"}) as r:
            assert r.status == 403
    finally:
        await chat.close()

    untrusted = await start_web_chat(tmp_path / "2", fake_openai, access=WebAccess(allowed_hosts=("chat.example.com",)))
    try:
        # without trusted_proxies the forwarded headers are the client's word only: not believed
        headers = {"X-Forwarded-Host": "chat.example.com", "X-Forwarded-Proto": "https",
                   "Origin": "https://chat.example.com"}
        async with http.post(f"{untrusted.base_url}/api/sessions", headers=headers) as resp:
            assert resp.status == 403
            assert "trusted_proxies" in (await resp.json())["error"]
    finally:
        await untrusted.close()


# ---- framing, cookie, guessing ----------------------------------------------------------------------------


async def test_pages_cannot_be_framed_and_load_only_their_own_resources(tmp_path, fake_openai, http):
    chat = await start_web_chat(tmp_path, fake_openai, auth_token=TOKEN)
    try:
        for path in ("/login", "/static/app.js", "/api/sessions"):
            async with http.get(chat.base_url + path) as resp:
                csp = resp.headers.get("Content-Security-Policy", "")
                assert resp.headers.get("X-Frame-Options") == "DENY", path
                assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp, path
                assert "unsafe-inline" not in csp
                assert resp.headers.get("X-Content-Type-Options") == "nosniff"
                assert resp.headers.get("Cross-Origin-Resource-Policy") == "same-origin"
    finally:
        await chat.close()


async def test_the_login_cookie_never_holds_the_token_and_is_secure_behind_https(tmp_path, fake_openai):
    access = WebAccess(auth_token=TOKEN, trusted_proxies=("127.0.0.1",), allowed_hosts=("chat.example.com",))
    chat = await start_web_chat(tmp_path, fake_openai, access=access)
    try:
        base = chat.base_url
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
            async with browser.post(f"{base}/login", data={"token": TOKEN}, allow_redirects=False) as resp:
                assert resp.status == 303
                cookie = resp.cookies[COOKIE]
            assert TOKEN not in cookie.value and len(cookie.value) >= 40
            assert cookie["httponly"] and cookie["samesite"] == "Strict" and not cookie["secure"]
            assert (await sessions(browser, base))[0] == 200  # the cookie signs the browser in
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
            https = {"X-Forwarded-Proto": "https", "X-Forwarded-Host": "chat.example.com",
                     "Origin": "https://chat.example.com"}
            async with browser.post(f"{base}/login", data={"token": TOKEN}, headers=https,
                                    allow_redirects=False) as resp:
                assert resp.status == 303 and resp.cookies[COOKIE]["secure"]
        # an old-style cookie holding the raw token (or anything else) is no longer a way in
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
            for name, value in (("chatbridge_token", TOKEN), (COOKIE, TOKEN)):
                browser.cookie_jar.update_cookies({name: value})
                assert (await sessions(browser, base))[0] == 401
    finally:
        await chat.close()

    # a different token (or another installation's key) makes the cookie worthless
    other = await start_web_chat(tmp_path / "2", fake_openai, access=WebAccess(auth_token=TOKEN + "-rotated"))
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
            browser.cookie_jar.update_cookies({COOKIE: cookie.value})
            assert (await sessions(browser, other.base_url))[0] == 401
    finally:
        await other.close()


async def test_wrong_tokens_are_slowed_down_per_address_without_locking_out_the_user(tmp_path, fake_openai):
    now = [0.0]
    access = WebAccess(auth_token=TOKEN, trusted_proxies=("127.0.0.1",))
    chat = await start_web_chat(tmp_path, fake_openai, access=access)
    chat.channel.server.guesses = GuessLimiter(burst=5, refill_seconds=2.0, clock=lambda: now[0])
    base = chat.base_url
    attacker = {"X-Forwarded-For": "203.0.113.9"}
    user = {"X-Forwarded-For": "198.51.100.7"}
    try:
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as signed_in, \
                aiohttp.ClientSession() as http:
            async with signed_in.post(f"{base}/login", data={"token": TOKEN}, headers=user) as resp:
                assert resp.status == 200
            statuses = []
            for i in range(300):
                async with http.post(f"{base}/login", data={"token": f"guess-{i}"}, headers=attacker,
                                     allow_redirects=False) as resp:
                    statuses.append(resp.status)
            assert statuses[:5] == [302] * 5 and set(statuses[5:]) == {429}
            # over the limit, even the right token is not tried: the answer reveals nothing
            async with http.post(f"{base}/login", data={"token": TOKEN}, headers=attacker,
                                 allow_redirects=False) as resp:
                assert resp.status == 429 and int(resp.headers["Retry-After"]) >= 1
                assert "Too many wrong tokens" in await resp.text()
            bearer = {**attacker, "Authorization": "Bearer nope"}
            assert (await sessions(http, base, headers=bearer))[0] == 429
            # the real user: signed in already, or signing in from their own address, is not affected
            assert (await sessions(signed_in, base, headers=user))[0] == 200
            assert (await sessions(http, base, headers={**user, "Authorization": f"Bearer {TOKEN}"}))[0] == 200
            # and the attacker gets one more try per refill period, not 300 a second
            now[0] += 2.0
            async with http.post(f"{base}/login", data={"token": "again"}, headers=attacker,
                                 allow_redirects=False) as resp:
                assert resp.status == 302
            async with http.post(f"{base}/login", data={"token": "and again"}, headers=attacker,
                                 allow_redirects=False) as resp:
                assert resp.status == 429
    finally:
        await chat.close()


async def test_undecodable_credentials_are_just_wrong(tmp_path, fake_openai):
    chat = await start_web_chat(tmp_path, fake_openai, auth_token=TOKEN)
    try:
        host, port = chat.base_url.removeprefix("http://").split(":")
        for header in (b"Authorization: Bearer \xff\xfe" + TOKEN.encode(), b"Cookie: chatbridge_session=\xff\xfe"):
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /api/sessions HTTP/1.1\r\nHost: 127.0.0.1\r\n" + header +
                         b"\r\nConnection: close\r\n\r\n")
            await writer.drain()
            status_line = await reader.readline()
            writer.close()
            assert status_line.split()[1] == b"401", (header, status_line)
    finally:
        await chat.close()


def test_the_guess_table_stays_bounded():
    limiter = GuessLimiter(burst=3, max_clients=100)
    for i in range(1000):
        limiter.failed(f"10.0.{i // 256}.{i % 256}")
    assert len(limiter) == 100


# ---- stream caps and abandoned streams ------------------------------------------------------------------


async def test_event_streams_are_capped_per_client_and_in_total(tmp_path, fake_openai, http):
    access = WebAccess(max_streams=3, max_streams_per_client=2, trusted_proxies=("127.0.0.1",))
    chat = await start_web_chat(tmp_path, fake_openai, access=access, reap_interval=0.02)
    server = chat.channel.server
    try:
        base = chat.base_url
        a1 = await open_stream(http, base, "s1")
        a2 = await open_stream(http, base, "s2")
        async with http.get(f"{base}/api/events") as resp:  # the session-list feed counts too
            assert resp.status == 503 and "this client" in (await resp.json())["error"]
        b1 = await open_stream(http, base, "s1", headers={"X-Forwarded-For": "198.51.100.7"})
        async with http.get(f"{base}/api/sessions/s3/stream", headers={"X-Forwarded-For": "198.51.100.8"}) as resp:
            assert resp.status == 503 and int(resp.headers["Retry-After"]) > 0
            assert "at most 3" in (await resp.json())["error"]
        # the rest of the chat still answers
        assert (await sessions(http, base))[0] == 200
        a1.resp.close()  # a slot is free again once the server notices
        await until(lambda: server.slots.open == 2)
        a3 = await open_stream(http, base, "s3")
        for s in (a2, a3, b1):
            s.resp.close()
        await until(lambda: server.slots.open == 0)
        assert server.slots.by_client == {}
    finally:
        await chat.close()


async def test_streams_that_were_opened_and_closed_leave_nothing_behind(chat, http):
    server, hub = chat.channel.server, chat.hub
    async with http.post(f"{chat.base_url}/api/sessions") as resp:
        used = (await resp.json())["id"]
    hub.stream(used).append("notice", {"text": "something worth replaying"})
    for round_ in range(5):
        opened = [await open_stream(http, chat.base_url, sid) for sid in
                  [used] * 5 + [f"r{round_}x{i}" for i in range(10)]]
        for s in opened:
            await s.next()
        for s in opened:
            s.resp.close()
        await until(lambda: not server.connections)
    assert server.slots.open == 0 and server.slots.by_client == {}
    assert hub.get(used) is not None and not hub.get(used).subscribers
    assert len(hub) == 1  # streams of ids that never carried an event are not kept
    async with http.get(f"{chat.base_url}/api/events") as resp:
        assert resp.status == 200
    await until(lambda: not server.connections)
    assert not chat.channel._feed


def test_the_accept_error_flood_is_logged_once_a_minute(caplog):
    """asyncio reports a full file-descriptor table through the loop's exception handler on every accept
    retry; the bridge's logging lets one through per minute and counts the rest."""
    from bridge.logs import ACCEPT_EXHAUSTED, RepeatLimiter

    now = [0.0]
    limiter = RepeatLimiter([ACCEPT_EXHAUSTED], interval=60, clock=lambda: now[0])
    asyncio_log = logging.getLogger("asyncio")
    installed = list(asyncio_log.filters)  # a run_app earlier in this process installed the real one
    for f in installed:
        asyncio_log.removeFilter(f)
    asyncio_log.addFilter(limiter)
    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.ERROR, logger="asyncio"):
            for _ in range(500):
                now[0] += 0.05
                loop.call_exception_handler({"message": ACCEPT_EXHAUSTED,
                                             "exception": OSError(24, "Too many open files")})
            loop.call_exception_handler({"message": "something else went wrong"})
            now[0] += 60
            loop.call_exception_handler({"message": ACCEPT_EXHAUSTED, "exception": OSError(24, "Too many")})
        texts = [r.getMessage() for r in caplog.records]
        assert sum(ACCEPT_EXHAUSTED in t for t in texts) == 2
        assert any("something else" in t for t in texts)
        assert "499 more like this" in texts[-1]
    finally:
        loop.close()
        asyncio_log.removeFilter(limiter)
        for f in installed:
            asyncio_log.addFilter(f)


def test_run_logging_throttles_the_accept_error():
    from bridge.logs import RepeatLimiter, configure_logging

    configure_logging("info", [])
    configure_logging("info", [])
    assert sum(isinstance(f, RepeatLimiter) for f in logging.getLogger("asyncio").filters) == 1


# ---- bad input ----------------------------------------------------------------------------------------


async def test_deeply_nested_json_is_a_400_on_every_json_route(chat, http):
    base = chat.base_url
    async with http.post(f"{base}/api/sessions") as resp:
        sid = (await resp.json())["id"]
    nested = b"[" * 100_000 + b"]" * 100_000
    deep_object = b'{"text": ' + nested + b"}"
    for method, path in (("POST", f"/api/sessions/{sid}/messages"), ("PATCH", f"/api/sessions/{sid}"),
                         ("POST", f"/api/sessions/{sid}/approvals/call_1")):
        for body in (nested, deep_object):
            async with http.request(method, base + path, data=body,
                                    headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 400, path
                assert (await resp.json())["error"] == "expected a JSON object"


@pytest.mark.parametrize("suffix", ["²", "٣", "9" * 5000, "-1", " 1", "1e3"])
async def test_a_garbled_last_event_id_is_unknown_and_resyncs(chat, http, suffix):
    async with http.post(f"{chat.base_url}/api/sessions") as resp:
        sid = (await resp.json())["id"]
    chat.hub.stream(sid).append("notice", {"text": "one"})
    epoch = chat.hub.stream(sid).epoch
    for last in (f"{epoch}-{suffix}", suffix):
        if not last.strip():
            continue
        sse = await open_stream(http, chat.base_url, sid, headers={"Last-Event-ID": last})
        first, second = await sse.next(), await sse.next()
        assert first.name == "resync_required", last
        assert second.name == "task_state" and seq_of(second.id) == (epoch, 1)
        sse.resp.close()


# ---- wiring from the config ---------------------------------------------------------------------------


async def started_core(data_dir, fake_openai):
    """One life of the process: a started core on ``data_dir`` (SQLite, the fake model)."""
    from core.llm.openai_provider import OpenAIProvider
    from core.runtime import ChatCore
    from core.sqlite_store import SqliteStore

    core = ChatCore(store=SqliteStore(data_dir / "chat.db"), provider=OpenAIProvider(
        model="m", base_url=fake_openai.base_url, api_key="k"))
    await core.start()
    return core


async def test_the_config_keys_reach_the_server_and_sign_ins_survive_a_restart(tmp_path, fake_openai):
    from bridge.config import load_config
    from channels.web.factory import create

    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
[web]
auth_token = "{TOKEN}"
allowed_hosts = ["chat.example.com"]
trusted_proxies = ["10.0.0.0/8"]
max_streams = 40
max_streams_per_client = 4
""")
    cfg = load_config(cfg_path, env={})
    cookies = []
    for _ in range(2):  # two lives of the process with the same data directory
        core = await started_core(tmp_path / "data", fake_openai)
        channel = create(cfg.web, core.host_for("web"), web.Application())
        server = channel.server
        assert server.guard.host_allowed("chat.example.com:443") and not server.guard.host_allowed("evil.example")
        assert (server.slots.total, server.slots.per_client) == (40, 4)
        await channel.start()  # loads (or, the first time, creates) the durable cookie key
        cookies.append(server.tokens.cookie_value)
        await channel.stop()
        await core.shutdown()
        await channel.close()
    assert cookies[0] == cookies[1] and TOKEN not in cookies[0]


def test_the_stream_cap_stays_under_the_open_file_limit(caplog):
    resource = pytest.importorskip("resource")
    from channels.web.factory import stream_cap_for_open_files

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        assert stream_cap_for_open_files(100) == 100
        with caplog.at_level(logging.WARNING):
            assert stream_cap_for_open_files(300) == 128
        assert "open-file limit 256" in caplog.text
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_until_the_durable_cookie_key_is_loaded_the_chat_answers_503_not_a_cookie_that_dies(
        tmp_path, fake_openai):
    """The server listens before the web channel starts (webhooks need it): in that moment a login would get a
    cookie signed with a key about to be replaced, and a good cookie would be refused. The chat says it is
    starting instead; once the channel has started, a login's cookie is the one that survives restarts."""
    from aiohttp.test_utils import TestClient, TestServer

    from bridge.config import load_config
    from channels.web.factory import create

    cfg_path = tmp_path / "c.toml"
    cfg_path.write_text(f'[bridge]\ndata_dir = "{tmp_path / "data"}"\n[web]\nauth_token = "{TOKEN}"\n')
    cfg = load_config(cfg_path, env={})
    cookies = []
    for _ in range(2):  # two lives of the process with the same data directory
        core = await started_core(tmp_path / "data", fake_openai)
        app = web.Application()
        channel = create(cfg.web, core.host_for("web"), app)
        async with TestClient(TestServer(app), cookie_jar=aiohttp.CookieJar(unsafe=True)) as client:
            for method, path, kw in (("POST", "/login", {"data": {"token": TOKEN}}),
                                     ("GET", "/", {}),
                                     ("GET", "/api/sessions", {"headers": {"Authorization": f"Bearer {TOKEN}"}})):
                resp = await client.request(method, path, allow_redirects=False, **kw)
                assert (resp.status, resp.headers.get("Retry-After")) == (503, "1"), path
                assert "starting" in (await resp.json())["error"]
                assert COOKIE not in resp.cookies
            assert (await client.get("/static/app.js")).status == 200  # the page's files are no secret
            await channel.start()
            resp = await client.post("/login", data={"token": TOKEN}, allow_redirects=False)
            assert resp.status == 303
            cookies.append(resp.cookies[COOKIE].value)
            assert (await client.get("/api/sessions")).status == 200  # the cookie signs the browser in
        await channel.stop()
        await core.shutdown()
        await channel.close()
    assert cookies[0] == cookies[1]
