"""Downloading a platform's file over HTTP for ``core.media.fetch``: streamed, redirects kept on the platform.

A channel's ``fetch_attachment`` resolves the file with its API (Telegram ``getFile``, Slack ``files.info``;
Feishu's message-resource endpoint is the file's URL itself) and hands the URL to :func:`stream_url`, which
yields the body in chunks. A redirect is followed only to one of ``allowed_hosts`` (the platform's own), at
most ``MAX_REDIRECTS`` times, so a file URL can never send the bot token, or the download, to another host.
Any answer but 200 is a ``FetchError``; no error text carries the URL (it may hold a token). One that may
well succeed if asked again (429 with its ``Retry-After``, 408, 5xx, a broken connection or a body cut short)
is marked ``transient``: core fetches it again (``core.media.intake``). A platform whose
refusals carry a business code in a JSON body (Feishu's message resources) passes ``refusal``: it is given
the status, the headers and at most ``ERROR_BODY`` bytes of the body, and returns the exception to raise.

aiohttp's own redirect handling would follow any host; this loop exists to refuse the others.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, Callable, Collection, Mapping
from urllib.parse import urljoin, urlsplit

import aiohttp

from core.media.fetch import FetchError

CHUNK = 64 * 1024
MAX_REDIRECTS = 3
ERROR_BODY = 64 * 1024
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


async def stream_url(session: aiohttp.ClientSession, url: str, *, allowed_hosts: Collection[str],
                     headers: Mapping[str, str] | None = None,
                     refusal: Callable[[int, Mapping[str, str], bytes], Exception] | None = None,
                     ) -> AsyncGenerator[bytes, None]:
    """The body of ``url`` in chunks (an async generator: close it to abandon the download)."""
    hosts = {h.lower() for h in allowed_hosts}
    for _ in range(MAX_REDIRECTS + 1):
        host = (urlsplit(url).hostname or "").lower()
        if host not in hosts:
            raise FetchError(f"refused to download from {host or 'a URL without a host'}: not the platform's host")
        try:
            async with session.get(url, headers=dict(headers or {}), allow_redirects=False) as response:
                if response.status in _REDIRECTS:
                    url = urljoin(url, response.headers.get("Location", ""))
                    continue
                if response.status != 200 and refusal is not None:
                    raise refusal(response.status, dict(response.headers), await _head(response))
                if response.status != 200:
                    raise FetchError(f"the file download answered HTTP {response.status}",
                                     too_large=response.status == 413, transient=_transient(response.status),
                                     retry_after=_retry_after(response.headers) if response.status == 429
                                     else None)
                async for chunk in response.content.iter_chunked(CHUNK):
                    yield chunk
                return
        except aiohttp.ClientError as exc:  # refused, reset, cut short (ClientPayloadError), a read timeout
            raise FetchError(f"the file download failed: {type(exc).__name__}", transient=True) from None
    raise FetchError(f"more than {MAX_REDIRECTS} redirects")


def _transient(status: int) -> bool:
    return status in (408, 429) or status >= 500


def _retry_after(headers: Mapping[str, str]) -> float | None:
    """``Retry-After`` in seconds (the HTTP-date form is not used by the platforms: it counts as absent)."""
    try:
        value = float(headers.get("Retry-After", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


async def _head(response: aiohttp.ClientResponse) -> bytes:
    """At most ``ERROR_BODY`` bytes of an error answer's body."""
    body = b""
    while len(body) < ERROR_BODY:
        part = await response.content.read(ERROR_BODY - len(body))
        if not part:
            break
        body += part
    return body
