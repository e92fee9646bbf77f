"""``fetch_url`` against every way of spelling a non-public address, beyond the forms in
tests/test_builtin_tools.py: IPv4 short, octal, hex and decimal forms, IPv4-mapped, -compatible and 6to4
IPv6, names that resolve to private addresses, and redirects.

Nothing here touches the network. Names are resolved by a stub of the system resolver on the test's event
loop (``loop.getaddrinfo``: numeric forms as the C library reads them, ``inet_aton``; a few names mapped to
chosen addresses; any other name fails), and every connection the event loop is asked to make is checked
first: one to an address that is not loopback fails the test instead of being made. Loopback forms are
fetched from a loopback server that records every request — it must receive none."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from core.tools.base import ToolContext
from core.tools.builtin import FetchRefused, FetchUrl

CTX = ToolContext("k", "t", "c")

STUB_NAMES = {
    "internal.example": ["10.0.0.5"],
    "metadata.example": ["169.254.169.254"],
    "mixed.example": ["93.184.216.34", "127.0.0.1"],  # one public, one loopback: refused as a whole
    "mapped.example": ["::ffff:127.0.0.1"],
    "v6.example": ["fd00::1"],
    "sixtofour.example": ["2002:7f00:1::1"],  # 6to4 of 127.0.0.1
    "local.example": ["127.0.0.1"],
}


@pytest.fixture
async def offline(monkeypatch) -> AsyncIterator[list[Any]]:
    """The resolver stub and the connection check, on this test's loop; yields the addresses connected to."""
    loop = asyncio.get_running_loop()
    connected: list[Any] = []

    async def getaddrinfo(host: Any, port: Any, *, family: int = 0, type: int = 0, proto: int = 0,
                          flags: int = 0) -> list[tuple[Any, ...]]:
        name = host.decode() if isinstance(host, bytes) else str(host)
        try:
            addresses = [str(ipaddress.ip_address(name.split("%", 1)[0]))]
        except ValueError:
            try:
                addresses = [socket.inet_ntoa(socket.inet_aton(name))]  # 127.1, 0177.0.0.1, 0x7f000001, ...
            except OSError:
                addresses = STUB_NAMES.get(name.rstrip(".").lower(), [])
        if not addresses:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (resolver stub)")
        out = []
        for a in addresses:
            fam = socket.AF_INET6 if ":" in a else socket.AF_INET
            sockaddr = (a, int(port or 0), 0, 0) if fam == socket.AF_INET6 else (a, int(port or 0))
            out.append((fam, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", sockaddr))
        return out

    real_connect = loop.sock_connect

    async def sock_connect(sock: socket.socket, address: Any) -> None:
        ip = ipaddress.ip_address(str(address[0]).split("%", 1)[0])
        mapped = getattr(ip, "ipv4_mapped", None)
        connected.append(address[0])
        if not (ip.is_loopback or (mapped is not None and mapped.is_loopback)):
            raise AssertionError(f"the test was about to connect to {address[0]}")
        await real_connect(sock, address)

    monkeypatch.setattr(loop, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(loop, "sock_connect", sock_connect)
    yield connected


@pytest.fixture
async def site() -> AsyncIterator[tuple[int, list[str]]]:
    """A loopback server that records every request; /redirect-* answer with redirects."""
    seen: list[str] = []

    async def any_path(request: web.Request) -> web.StreamResponse:
        seen.append(request.path)
        port = request.url.port
        targets = {"/redirect-local": f"http://127.0.0.1:{port}/secret", "/redirect-private": "http://10.0.0.1/",
                   "/redirect-metadata": "http://169.254.169.254/latest/meta-data/",
                   "/redirect-relative": "/secret"}
        if request.path in targets:
            raise web.HTTPFound(targets[request.path])
        return web.Response(text="loopback secret")

    app = web.Application()
    app.router.add_get("/{tail:.*}", any_path)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    s = web.TCPSite(runner, "127.0.0.1", 0)
    await s.start()
    yield runner.addresses[0][1], seen
    await runner.cleanup()


LOOPBACK_FORMS = ["127.1", "127.0.1", "0177.0.0.1", "0177.1", "0x7f000001", "0x7f.1", "017700000001",
                  "127.000.000.001", "0", "0.0.0.0", "[::]", "[::ffff:7f00:1]", "[0:0:0:0:0:ffff:127.0.0.1]",
                  "[::ffff:127.0.0.1]", "[::127.0.0.1]", "evil.example@127.0.0.1", "LOCAL.EXAMPLE", "local.example.",
                  "mapped.example", "mixed.example"]


@pytest.mark.parametrize("host", LOOPBACK_FORMS)
async def test_every_spelling_of_this_machine_is_refused_before_a_request_is_sent(offline, site, host):
    port, seen = site
    with pytest.raises(FetchRefused):
        await FetchUrl().run({"url": f"http://{host}:{port}/secret"}, CTX)
    assert seen == []  # nothing reached the loopback server
    assert offline == []  # no connection was even started


PRIVATE = ["http://10.0.0.5/", "http://012.0.0.5/", "http://167772165/", "http://0xa000005/", "http://10.5/",
           "http://172.16.0.1/", "http://192.168.1.1/", "http://100.64.0.1/", "http://198.18.0.1/",
           "http://169.254.169.254/latest/meta-data/", "http://[fd00::1]/", "http://[fe80::1%25eth0]/",
           "http://[::ffff:10.0.0.5]/", "http://[::ffff:a00:5]/", "http://[::a00:5]/", "http://[64:ff9b::a00:5]/",
           "http://[2002:a00:5::1]/", "http://[2002:7f00:1::1]/", "http://[ff02::1]/", "http://224.0.0.1/",
           "http://255.255.255.255/", "http://240.0.0.1/", "http://internal.example/", "http://metadata.example/",
           "http://v6.example/", "http://sixtofour.example/", "http://unknown.example/",
           "http://internal.example:80@evil.example/", "https://10.0.0.5:443/"]


@pytest.mark.parametrize("url", PRIVATE)
async def test_every_private_address_form_is_refused_without_connecting(offline, url):
    with pytest.raises(FetchRefused):
        await FetchUrl().run({"url": url}, CTX)
    assert offline == []


@pytest.mark.parametrize("path", ["/redirect-local", "/redirect-private", "/redirect-metadata", "/redirect-relative"])
async def test_redirects_are_reported_not_followed(offline, site, path):
    port, seen = site
    # loopback allowed (the test-only flag) so that the first request reaches the local server at all
    out = await FetchUrl(allow_loopback=True).run({"url": f"http://127.0.0.1:{port}{path}"}, CTX)
    assert out.startswith("HTTP 302") and "not followed" in out
    assert seen == [path]  # the redirect's target was never requested
    assert offline == ["127.0.0.1"]
