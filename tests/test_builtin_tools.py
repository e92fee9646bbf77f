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


# ---- every spelling of an address is checked where the connection is made --------------------------------


@pytest.fixture
async def loopback_counter() -> AsyncIterator[tuple[int, list[str]]]:
    """A loopback server that records every request it receives (none may arrive)."""
    seen: list[str] = []

    async def any_path(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.Response(text="loopback secret")

    app = web.Application()
    app.router.add_get("/{tail:.*}", any_path)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield runner.addresses[0][1], seen
    await runner.cleanup()


@pytest.mark.parametrize("host", ["１２７.０.０.１", "127。0。0。1", "①②⑦.⓪.⓪.①", "１２７。０。０。１",
                                  "127.0.0.1.", "2130706433", "0x7f.0.0.1", "ＬＯＣＡＬＨＯＳＴ"])
async def test_fetch_url_refuses_loopback_in_any_spelling_and_never_connects(loopback_counter, host):
    port, seen = loopback_counter
    with pytest.raises(FetchRefused):
        await FetchUrl().run({"url": f"http://{host}:{port}/secret"}, CTX)
    assert seen == []  # the request never reached the loopback server


def test_the_connect_gate_refuses_every_non_public_address():
    import socket

    from core.tools.builtin import connect_gate

    refused: list[str] = []
    gate = connect_gate(allow_loopback=False, refused=refused)
    for address in ("127.0.0.1", "10.1.2.3", "169.254.169.254", "::1", "::ffff:127.0.0.1", "0.0.0.0"):
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with pytest.raises(OSError):
            gate((family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", (address, 80)))
    assert refused == ["127.0.0.1", "10.1.2.3", "169.254.169.254", "::1", "::ffff:127.0.0.1", "0.0.0.0"]
    loopback_ok = connect_gate(allow_loopback=True, refused=refused)
    loopback_ok((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("127.0.0.1", 80))).close()
    with pytest.raises(OSError):
        loopback_ok((socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", ("10.0.0.1", 80)))


# ---- the body is read to max_bytes or its end ------------------------------------------------------------


@pytest.fixture
async def chunked_site() -> AsyncIterator[str]:
    """Pages sent in pieces with a pause between them, so a single read sees only the first piece."""

    async def page(request: web.Request) -> web.StreamResponse:
        size = int(request.query["size"])
        resp = web.StreamResponse(headers={"Content-Type": "text/plain; charset=utf-8"})
        await resp.prepare(request)
        sent = 0
        while sent < size:
            piece = min(16_384, size - sent)
            await resp.write(b"x" * piece)
            sent += piece
            await asyncio.sleep(0.01)
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/page", page)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


async def test_fetch_url_returns_the_whole_page_up_to_max_bytes(chunked_site):
    tool = FetchUrl(max_bytes=200_000, allow_loopback=True)
    out = await tool.run({"url": f"{chunked_site}/page?size=153000"}, CTX)
    head, _, body = out.partition("\n\n")
    assert head == "HTTP 200 text/plain"
    assert body == "x" * 153_000  # all of it, and no cut marker


async def test_fetch_url_cuts_a_longer_page_at_max_bytes_and_says_so(chunked_site):
    tool = FetchUrl(max_bytes=50_000, allow_loopback=True)
    out = await tool.run({"url": f"{chunked_site}/page?size=120000"}, CTX)
    body = out.partition("\n\n")[2]
    assert body == "x" * 50_000 + "\n[cut at 50000 bytes]"
