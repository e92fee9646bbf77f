"""Built-in tools. Nothing here leaves the machine: refusals are checked before any connection, and the
size/time limits run against a local aiohttp server with loopback allowed through the test-only flag."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from core.tools.base import ToolContext
from core.tools.builtin import CurrentTime, FetchRefused, FetchUrl, is_public

CTX = ToolContext("k", "t", "c")


@pytest.fixture
async def local_site() -> AsyncIterator[tuple[str, asyncio.Event]]:
    release = asyncio.Event()

    async def big(_: web.Request) -> web.Response:
        return web.Response(text="a" * 5000)

    async def small(_: web.Request) -> web.Response:
        return web.Response(text="hello")

    async def slow(_: web.Request) -> web.Response:
        await release.wait()
        return web.Response(text="late")

    app = web.Application()
    app.router.add_get("/big", big)
    app.router.add_get("/small", small)
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", release
    release.set()
    await runner.cleanup()


async def test_current_time_is_auto_approved_and_answers():
    tool = CurrentTime()
    assert tool.approval == "auto"
    assert "T" in await tool.run({}, CTX)


@pytest.mark.parametrize("url", ["http://127.0.0.1/", "http://10.1.2.3/", "http://169.254.169.254/latest",
                                 "http://[::1]:8080/", "http://192.168.0.1/", "http://localhost/",
                                 "http://[::ffff:127.0.0.1]/", "file:///etc/passwd", "ftp://example.org/"])
async def test_fetch_url_refuses_non_public_addresses(url):
    with pytest.raises(FetchRefused):
        await FetchUrl().run({"url": url}, CTX)


def test_public_address_check():
    assert not is_public("127.0.0.1") and not is_public("10.0.0.1") and not is_public("169.254.1.1")
    assert not is_public("::1") and not is_public("fe80::1") and not is_public("100.64.0.1")
    assert is_public("93.184.216.34")


async def test_fetch_url_limits_size_against_a_local_server(local_site):
    base, _ = local_site
    tool = FetchUrl(max_bytes=100, allow_loopback=True)
    out = await tool.run({"url": f"{base}/big"}, CTX)
    assert out.startswith("HTTP 200") and "a" * 100 in out and "a" * 101 not in out and "cut at 100 bytes" in out
    assert out.endswith("hello") is False
    assert (await tool.run({"url": f"{base}/small"}, CTX)).endswith("hello")
    with pytest.raises(FetchRefused):  # the flag allows loopback only, still nothing private
        await tool.run({"url": "http://10.0.0.1/"}, CTX)


async def test_fetch_url_gives_up_after_its_timeout(local_site):
    base, _ = local_site
    with pytest.raises(FetchRefused, match="no complete answer"):
        await FetchUrl(timeout_seconds=0.2, allow_loopback=True).run({"url": f"{base}/slow"}, CTX)
