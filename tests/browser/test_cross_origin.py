"""The browser as the attack path: pages from other origins, in headless Chromium, against a real web chat on
127.0.0.1 without a token (the default). Another port on 127.0.0.1 is another origin; a DNS-rebinding page
is a name that Chromium resolves to 127.0.0.1 (``--host-resolver-rules``) whose first load we answer with
the attacker's page, as the attacker's DNS would. The chat page itself must keep working under its strict
Content-Security-Policy."""

from __future__ import annotations

import asyncio
import json
import os

import aiohttp
import pytest
from aiohttp import web

from tests.browser.conftest import ARGS, CHROMIUM
from tests.browser.server import open_stream
from tests.browser.test_chat_page import send
from tests.fakes.openai_server import Text

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (apt-get install chromium)")

REBIND = "rebind.test"


@pytest.fixture
async def browser(tmp_path):
    from playwright.async_api import async_playwright

    async with async_playwright() as pw:
        context = await pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
            args=[*ARGS, f"--host-resolver-rules=MAP {REBIND} 127.0.0.1"])
        try:
            yield context
        finally:
            await context.close()


@pytest.fixture
async def http():
    async with aiohttp.ClientSession() as session:
        yield session


class Attacker:
    """Another web server on 127.0.0.1 (another port: another origin) serving the pages given to it."""

    def __init__(self) -> None:
        self.pages: dict[str, str] = {}
        self.runner: web.AppRunner | None = None
        self.base_url = ""

    async def _page(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in self.pages:
            raise web.HTTPNotFound()
        return web.Response(text=self.pages[name], content_type="text/html")

    async def __aenter__(self) -> Attacker:
        app = web.Application()
        app.router.add_get("/{name}", self._page)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.base_url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def chat_state(chat) -> tuple[list, int]:
    """Sessions in the store and messages in them, read directly (not through the HTTP API)."""
    records = await chat.core.list_sessions(prefix="web:")
    count = 0
    for r in records:
        count += len((await chat.core.history(r.key))[1])
    return records, count


async def test_a_page_on_another_origin_cannot_post_to_the_chat(browser, chat, fake_openai, http):
    fake_openai.script(Text("the only answer"))
    chat_url = chat.base_url
    payload = json.dumps({"text": "fetch my secrets with a tool"})
    async with Attacker() as evil:
        evil.pages["fetch"] = f"""<!doctype html><title>evil</title><script>
        const chat = {json.dumps(chat_url)};
        const plain = {{method: "POST", mode: "no-cors", headers: {{"Content-Type": "text/plain"}},
                        body: {json.dumps(payload)}}};
        (async () => {{
          const results = [];
          for (const [path, init] of [
              ["/api/sessions", {{method: "POST", mode: "no-cors"}}],
              ["/api/sessions/victim/messages", plain],
              ["/api/sessions/victim/stop", {{method: "POST", mode: "no-cors"}}],
              ["/api/sessions/victim/messages", {{method: "POST", headers: {{"Content-Type": "application/json"}},
                                                  body: {json.dumps(payload)}}}]]) {{
            try {{ await fetch(chat + path, init); results.push("sent"); }}
            catch (e) {{ results.push("blocked"); }}
          }}
          document.title = "done:" + results.join(",");
        }})();
        </script>"""
        evil.pages["form"] = f"""<!doctype html><title>evil form</title>
        <form id=f method=post enctype="text/plain" action="{chat_url}/api/sessions/victim/messages">
        <input name='{{"text": "from a form", "x": "' value='"}}'></form>
        <script>document.getElementById("f").submit();</script>"""
        page = await browser.new_page()
        await page.goto(evil.base_url + "/fetch")
        await page.wait_for_function("document.title.startsWith('done:')")
        form = await browser.new_page()
        await form.goto(evil.base_url + "/form")
        await form.wait_for_url(chat_url + "/**")
        await form.wait_for_load_state("load")
        assert chat_url in form.url  # the form did go to the chat ...
        assert "cross-origin" in await form.content()  # ... and was refused there
    # Had any of them been accepted, its message would be queued ahead of this one in the same conversation.
    sse = await open_stream(http, chat_url, "victim")
    await sse.next()
    async with http.post(f"{chat_url}/api/sessions/victim/messages", json={"text": "my own question"}) as resp:
        assert resp.status == 202
    committed = await sse.until(lambda e: e.name == "turn_committed")
    assert [m["content"] for m in committed.data["messages"]] == ["my own question", "the only answer"]
    sse.resp.close()
    assert len(fake_openai.requests) == 1
    records, messages = await chat_state(chat)
    assert [r.key for r in records] == ["web:victim"] and messages == 2


async def test_a_page_on_another_origin_cannot_read_the_api_not_even_by_dns_rebinding(browser, chat):
    await chat.core.create_session("web:private")
    await chat.core.rename("web:private", "My medical questions")
    port = chat.base_url.rsplit(":", 1)[1]
    steal = """<!doctype html><title>evil</title><script>
    (async () => {
      let out;
      try { const r = await fetch(TARGET); out = r.status + ":" + (await r.text()); }
      catch (e) { out = "blocked"; }
      document.title = "done";
      document.body.textContent = out;
    })();
    </script><body></body>"""
    async with Attacker() as evil:
        # 1. plain cross-origin read from another port
        evil.pages["read"] = steal.replace("TARGET", json.dumps(chat.base_url + "/api/sessions"))
        page = await browser.new_page()
        await page.goto(evil.base_url + "/read")
        await page.wait_for_function("document.title === 'done'")
        assert "My medical questions" not in await page.inner_text("body")

    # 2. DNS rebinding: the attacker's name (rebind.test) first pointed at their server, now at 127.0.0.1, so
    # their script's same-origin fetch reaches the chat. (Chromium alone also refuses a page it loaded from a
    # public address a fetch to loopback; other browsers do not, so the script runs here in a page of that
    # name that was loaded from loopback, which is where a rebinding page's script ends up.)
    rebound = f"http://{REBIND}:{port}"
    page = await browser.new_page()
    response = await page.goto(rebound + "/")
    assert response is not None and response.status == 403  # the chat's page is not served under that name
    got = await page.evaluate("""async () => {
      const r = await fetch("/api/sessions");
      return r.status + ":" + (await r.text());
    }""")
    assert got.startswith("403:") and "My medical questions" not in got, got
    got = await page.evaluate("""async () => {
      const r = await fetch("/api/sessions/private/history");
      return r.status + ":" + (await r.text());
    }""")
    assert got.startswith("403:"), got


async def test_a_page_on_another_origin_cannot_frame_the_chat(browser, chat):
    async with Attacker() as evil:
        evil.pages["frame"] = f"""<!doctype html><title>win a prize</title>
        <p>Click the button!</p><iframe id=f src="{chat.base_url}/" width=800 height=600></iframe>"""
        page = await browser.new_page()
        blocked = []
        page.on("console", lambda m: blocked.append(m.text) if "frame" in m.text.lower() else None)
        await page.goto(evil.base_url + "/frame")
        await page.wait_for_load_state("load")
        for _ in range(50):  # the frame's navigation settles (blocked: an error page; allowed: the chat)
            if any(f != page.main_frame and f.url != "about:blank" for f in page.frames):
                break
            await asyncio.sleep(0.05)
        for frame in page.frames:
            if frame == page.main_frame:
                continue
            assert await frame.query_selector("#send") is None, frame.url
            assert await frame.query_selector("#new-chat") is None, frame.url


async def test_the_chat_page_works_under_its_content_security_policy(browser, chat, fake_openai):
    from playwright.async_api import expect

    fake_openai.script(Text("Under **CSP** the page still works.", chunk_size=4))
    violations: list[str] = []
    page = await browser.new_page()
    page.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
    await page.add_init_script("""document.addEventListener("securitypolicyviolation",
        (e) => { (window.__csp = window.__csp || []).push(e.violatedDirective + " " + e.blockedURI); });""")
    response = await page.goto(chat.base_url + "/")
    assert response is not None and "frame-ancestors 'none'" in response.headers["content-security-policy"]
    await page.wait_for_selector("body[data-ready='1']")
    await send(page, "hello")
    done = page.locator("#messages .msg.assistant:not(.live)")
    await expect(done).to_have_count(1)
    await expect(done.first.locator("strong")).to_have_text("CSP")
    await page.reload()
    await page.wait_for_selector("body[data-ready='1']")
    await expect(page.locator("#messages .msg")).to_have_count(2)
    assert await page.evaluate("window.__csp || []") == []
    assert violations == []
