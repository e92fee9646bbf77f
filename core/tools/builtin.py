"""Built-in tools: ``current_time`` (harmless, auto-approved) and ``fetch_url`` (off unless enabled).

``fetch_url`` refuses every address that is not public (loopback, private, link-local, multicast, reserved,
unspecified). The check sits where a socket is created for the connection (the connector's socket
factory sees every address about to be connected to, whether it came from DNS or from an IP literal in
any spelling: full-width digits, ideographic full stops and the like are normalised by the URL library
into an ordinary address that the client connects to without resolving). Two earlier checks only make
the refusal clearer: the host of the URL object the client will use (after IDNA/NFKC normalisation), and
the resolver, which refuses a name as soon as any of its addresses is not public. Redirects are not
followed. The body is read until ``max_bytes`` or its end (a cut is marked); the whole fetch is bounded by
``timeout_seconds``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from core.llm.provider import LLMToolSpec
from core.tools.base import ApprovalPolicy, ToolContext

AddrInfo = tuple[int, int, int, str, tuple[Any, ...]]
"""One ``getaddrinfo`` entry: family, type, proto, canonname, sockaddr (what a socket factory is given)."""


class CurrentTime:
    @property
    def spec(self) -> LLMToolSpec:
        return LLMToolSpec("current_time", "The current date and time in UTC (ISO 8601).",
                           {"type": "object", "properties": {}, "additionalProperties": False})

    @property
    def approval(self) -> ApprovalPolicy | None:
        return "auto"

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        return time.strftime("%Y-%m-%dT%H:%M:%SZ (%A)", time.gmtime())


class FetchRefused(Exception):
    """The URL may not be fetched (scheme, address); the message is safe to show the model."""


def is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address):
        # an IPv6 address that carries an IPv4 one is as public as that address: IPv4-mapped, and 6to4
        # (2002::/16, which Python counts as global), whose relay delivers to the embedded address
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is not None:
            ip = embedded
    return not (ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast or ip.is_reserved
                or ip.is_unspecified or not ip.is_global)


def _allowed(address: str, allow_loopback: bool) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 scope id is not part of the address
    except ValueError:
        return False
    if is_public(str(ip)):
        return True
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return allow_loopback and ip.is_loopback


def connect_gate(*, allow_loopback: bool, refused: list[str]) -> Callable[[AddrInfo], socket.socket]:
    """The connector's socket factory: a socket only for a permitted address. A refused address is
    appended to ``refused`` (the connector reports every failed attempt as one connection error, so the
    caller looks there to tell a refusal from a network failure) and raises ``OSError`` before any
    connection is attempted."""

    def factory(addr_info: AddrInfo) -> socket.socket:
        family, type_, proto, _, sockaddr = addr_info
        address = str(sockaddr[0])
        if not _allowed(address, allow_loopback):
            refused.append(address)
            raise OSError(f"refusing to connect to {address}: not a public address")
        return socket.socket(family=family, type=type_, proto=proto)

    return factory


class _CheckedResolver(AbstractResolver):
    """Resolves like the system, then refuses the host if any address is not public."""

    def __init__(self, allow_loopback: bool) -> None:
        self._allow_loopback = allow_loopback

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_UNSPEC) -> list[ResolveResult]:
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(host, port, family=family, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise FetchRefused(f"cannot resolve {host}") from exc
        results: list[ResolveResult] = []
        for fam, _, proto, _, sockaddr in infos:
            address = str(sockaddr[0])
            if not _allowed(address, self._allow_loopback):
                raise FetchRefused(f"refusing to fetch {host}: {address} is not a public address")
            results.append(ResolveResult(hostname=host, host=address, port=int(sockaddr[1]), family=fam,
                                         proto=proto, flags=socket.AI_NUMERICHOST))
        if not results:
            raise FetchRefused(f"cannot resolve {host}")
        return results

    async def close(self) -> None:
        return None


class FetchUrl:
    MAX_BYTES = 200_000
    TIMEOUT_SECONDS = 15.0

    def __init__(self, *, max_bytes: int = MAX_BYTES, timeout_seconds: float = TIMEOUT_SECONDS,
                 allow_loopback: bool = False) -> None:
        """``allow_loopback`` exists for tests against a local server only; the config cannot set it."""
        self._max_bytes = max_bytes
        self._timeout = timeout_seconds
        self._allow_loopback = allow_loopback

    @property
    def spec(self) -> LLMToolSpec:
        return LLMToolSpec("fetch_url", "Fetch a public http(s) URL and return the start of its body as text.",
                           {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"],
                            "additionalProperties": False})

    @property
    def approval(self) -> ApprovalPolicy | None:
        return None  # the operator's default ([agent].approval)

    def _target(self, text: str) -> URL:
        """The URL object the client will use, its host already normalised (IDNA, NFKC)."""
        try:
            url = URL(text)
            host = url.host
        except (ValueError, UnicodeError):
            raise FetchRefused("not a valid URL") from None
        if url.scheme not in ("http", "https") or not host:
            raise FetchRefused("only http and https URLs with a host can be fetched")
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            return url  # a name: the resolver and the socket factory check every address it has
        if not _allowed(str(ip), self._allow_loopback):
            raise FetchRefused(f"refusing to fetch {host}: not a public address")
        return url

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        url = self._target(str(arguments.get("url", "")))
        refused: list[str] = []
        connector = aiohttp.TCPConnector(resolver=_CheckedResolver(self._allow_loopback), use_dns_cache=False,
                                         socket_factory=connect_gate(allow_loopback=self._allow_loopback,
                                                                     refused=refused))
        try:
            async with asyncio.timeout(self._timeout), \
                    aiohttp.ClientSession(connector=connector) as session, \
                    session.get(url, allow_redirects=False) as resp:
                body = await self._read(resp)
                cut = len(body) > self._max_bytes
                text = bytes(body[: self._max_bytes]).decode(resp.charset or "utf-8", errors="replace")
                head = f"HTTP {resp.status} {resp.content_type}"
                if resp.status in (301, 302, 303, 307, 308):
                    head += f" (redirect to {resp.headers.get('Location', '?')}, not followed)"
                tail = f"\n[cut at {self._max_bytes} bytes]" if cut else ""
                return f"{head}\n\n{text}{tail}"
        except TimeoutError:
            raise FetchRefused(f"no complete answer within {self._timeout:g}s") from None
        except aiohttp.InvalidURL:
            raise FetchRefused("not a valid URL") from None
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.__cause__, FetchRefused):
                raise exc.__cause__ from None
            if refused:
                raise FetchRefused(f"refusing to fetch {url.host}: {refused[0]} is not a public address") from None
            raise
        finally:
            await connector.close()

    async def _read(self, resp: aiohttp.ClientResponse) -> bytearray:
        """The body up to ``max_bytes + 1`` bytes (one more tells that it was cut): a single read returns
        only what has arrived so far, so read until the limit or the end."""
        body = bytearray()
        while len(body) <= self._max_bytes:
            chunk = await resp.content.read(self._max_bytes + 1 - len(body))
            if not chunk:
                break
            body += chunk
        return body
