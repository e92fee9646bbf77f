"""Built-in tools: ``current_time`` (harmless, auto-approved) and ``fetch_url`` (off unless enabled).

``fetch_url`` refuses every address that is not public: the host is resolved and each address is checked
(loopback, private, link-local, multicast, reserved, unspecified), and the connection is pinned to the
checked addresses so a second DNS answer cannot point it elsewhere. Redirects are not followed. The body
is cut at ``max_bytes`` and the whole fetch at ``timeout_seconds``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from core.llm.provider import LLMToolSpec
from core.tools.base import ApprovalPolicy, ToolContext


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
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not (ip.is_loopback or ip.is_private or ip.is_link_local or ip.is_multicast or ip.is_reserved
                or ip.is_unspecified or not ip.is_global)


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
            loopback = ipaddress.ip_address(address).is_loopback
            if not is_public(address) and not (self._allow_loopback and loopback):
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

    def _check_literal(self, host: str) -> None:
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return  # a name: the resolver checks every address it resolves to
        if not is_public(str(ip)) and not (self._allow_loopback and ip.is_loopback):
            raise FetchRefused(f"refusing to fetch {host}: not a public address")

    @property
    def spec(self) -> LLMToolSpec:
        return LLMToolSpec("fetch_url", "Fetch a public http(s) URL and return the start of its body as text.",
                           {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"],
                            "additionalProperties": False})

    @property
    def approval(self) -> ApprovalPolicy | None:
        return None  # the operator's default ([agent].approval)

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        url = str(arguments.get("url", ""))
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FetchRefused("only http and https URLs with a host can be fetched")
        self._check_literal(parts.hostname)  # aiohttp skips the resolver for IP literals
        connector = aiohttp.TCPConnector(resolver=_CheckedResolver(self._allow_loopback), use_dns_cache=False)
        try:
            async with asyncio.timeout(self._timeout), \
                    aiohttp.ClientSession(connector=connector) as session, \
                    session.get(url, allow_redirects=False) as resp:
                body = await resp.content.read(self._max_bytes + 1)
                cut = len(body) > self._max_bytes
                text = body[: self._max_bytes].decode(resp.charset or "utf-8", errors="replace")
                head = f"HTTP {resp.status} {resp.content_type}"
                if resp.status in (301, 302, 303, 307, 308):
                    head += f" (redirect to {resp.headers.get('Location', '?')}, not followed)"
                tail = f"\n[cut at {self._max_bytes} bytes]" if cut else ""
                return f"{head}\n\n{text}{tail}"
        except TimeoutError:
            raise FetchRefused(f"no complete answer within {self._timeout:g}s") from None
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.__cause__, FetchRefused):
                raise exc.__cause__ from None
            raise
        finally:
            await connector.close()
