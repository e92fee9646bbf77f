"""Who may talk to the web chat: forwarded headers, host names, origins and the response headers of its pages.

The web chat listens on loopback without a token by default, so any web page the user visits can aim
requests at it. This module holds the rules that keep such a page out (DESIGN.md §6):

- **Forwarded headers** (``X-Forwarded-Proto``, ``-Host``, ``-For``) count only when the connection comes
  from an address in ``[web] trusted_proxies``; otherwise anyone could claim https or another address.
- **Host names**: a request is answered only when its host is a loopback name, the bind address, an IP
  literal or one of ``[web] allowed_hosts``. A DNS-rebinding page reaches us under its own name (its DNS
  later points at 127.0.0.1) and is refused here; an IP literal involves no DNS, so it cannot be rebound.
- **Origins**: a state-changing request (any method but GET/HEAD/OPTIONS) must come from the chat's own
  origin (``Origin``, or when a browser sends none, ``Sec-Fetch-Site``); an API read must not come from
  another site. A client that sends neither header is not a browser (curl, scripts) and has no ambient
  credentials for a foreign page to borrow, so it passes.
- **Response headers**: the pages cannot be framed (``frame-ancestors 'none'``, ``X-Frame-Options``), load
  scripts, styles and images only from this server, and API answers cannot be embedded by other sites.

These rules apply to the web chat's own paths only (:func:`is_chat_path`). Webhooks (``/telegram/webhook``
and the like) are called server to server through a proxy under the public host name, without an Origin,
and carry their own secrets; ``/healthz`` is read by monitors under whatever name they use.

Written here rather than taken from a middleware package: the checks are scoped to some paths of an
application shared with the webhooks, and aiohttp's public ``Request.clone`` already does the heavy part.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from aiohttp import web

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})

# The page and the login form load everything from /static; model output never brings its own resources
# (an <img src=https://...> in a reply would otherwise leak the conversation through the URL).
CONTENT_SECURITY_POLICY = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "font-src 'self'; connect-src 'self'; form-action 'self'; base-uri 'none'; "
                           "frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Resource-Policy": "same-origin",
    "Cross-Origin-Opener-Policy": "same-origin",
}


def is_chat_path(path: str) -> bool:
    """The web chat's own routes: the page, the login form, its static files and the API."""
    return path in ("/", "/login") or path.startswith(("/api/", "/static/"))


def host_name(host: str) -> str | None:
    """The lower-case name in a ``Host`` header value (port and IPv6 brackets removed), None if garbled."""
    try:
        name = urlsplit("//" + host.strip()).hostname
    except ValueError:  # a port that is not a number, an unclosed bracket
        return None
    return name.rstrip(".") if name else None


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


def _authority(scheme: str, host: str) -> tuple[str, int] | None:
    try:
        parts = urlsplit(f"{scheme}://{host.strip()}")
        name, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not name:
        return None
    return name.rstrip("."), port if port is not None else _default_port(scheme)


@dataclass(frozen=True)
class Forwarded:
    """What the request looks like from the browser's side: its scheme, host and address."""

    scheme: str
    host: str
    remote: str | None


class RequestGuard:
    def __init__(self, *, bind_host: str = "127.0.0.1", allowed_hosts: Iterable[str] = (),
                 trusted_proxies: Iterable[str] = ()) -> None:
        bind = host_name(bind_host) or bind_host.strip().lower()
        self.allowed_hosts = frozenset({*LOOPBACK_NAMES, bind, *(h.strip().lower().rstrip(".")
                                                                 for h in allowed_hosts)})
        self.trusted_proxies = tuple(ipaddress.ip_network(p.strip(), strict=False) for p in trusted_proxies)

    # ---- forwarded headers ------------------------------------------------------------------------

    def _trusted(self, address: str | None) -> bool:
        if not address or not self.trusted_proxies:
            return False
        try:
            ip = ipaddress.ip_address(address.strip().strip("[]"))
        except ValueError:
            return False
        return any(ip in net for net in self.trusted_proxies)

    def forwarded(self, request: web.Request) -> Forwarded:
        """Scheme, host and client address, taking X-Forwarded-* only from a trusted proxy.

        The proxy next to us must *set* ``X-Forwarded-Proto`` and ``X-Forwarded-Host`` to what the browser
        used; with several values the last one counts (it was written by that proxy; earlier ones may come
        from the client). ``X-Forwarded-For`` is read from the right, skipping trusted proxies."""
        if not self._trusted(request.remote):
            return Forwarded(request.scheme, request.host, request.remote)

        def last(header: str) -> str | None:
            values = [v.strip() for v in request.headers.get(header, "").split(",") if v.strip()]
            return values[-1] if values else None

        proto = (last("X-Forwarded-Proto") or "").lower()
        scheme = proto if proto in ("http", "https") else request.scheme
        host = last("X-Forwarded-Host") or request.host
        remote = request.remote
        for hop in reversed([v.strip() for v in request.headers.get("X-Forwarded-For", "").split(",")]):
            if not hop:
                continue
            try:
                ipaddress.ip_address(hop.strip("[]"))
            except ValueError:
                break  # garbled: keep the last address we could believe
            remote = hop.strip("[]")
            if not self._trusted(remote):
                break
        return Forwarded(scheme, host, remote)

    def effective(self, request: web.Request) -> web.Request:
        """``request`` as seen from the browser's side (a clone when a trusted proxy forwarded it)."""
        seen = self.forwarded(request)
        if (seen.scheme, seen.host, seen.remote) == (request.scheme, request.host, request.remote):
            return request
        if seen.remote is None:
            return request.clone(scheme=seen.scheme, host=seen.host)
        return request.clone(scheme=seen.scheme, host=seen.host, remote=seen.remote)

    # ---- host names and origins -------------------------------------------------------------------

    def host_allowed(self, host: str) -> bool:
        name = host_name(host)
        if name is None:
            return False
        if name in self.allowed_hosts:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True  # an IP literal: no DNS involved, nothing to rebind

    @staticmethod
    def own_origin(request: web.Request) -> str:
        return f"{request.scheme}://{request.host}"

    def same_origin(self, request: web.Request) -> bool:
        """True when a browser sent this request from the chat's own page (or no browser sent it)."""
        origin = request.headers.get("Origin")
        if origin is not None:
            parts = urlsplit(origin.strip())
            if parts.scheme not in ("http", "https") or parts.path or parts.query or not parts.netloc:
                return False  # "null" (sandboxed frames, file: pages) and anything odd
            theirs = _authority(parts.scheme, parts.netloc)
            ours = _authority(request.scheme, request.host)
            return parts.scheme == request.scheme and theirs is not None and theirs == ours
        site = request.headers.get("Sec-Fetch-Site")
        if site is not None:
            return site.strip().lower() in ("same-origin", "none")
        return True

    def check(self, request: web.Request) -> str | None:
        """Why ``request`` (already :meth:`effective`) is refused, or None when it may go on."""
        if not self.host_allowed(request.host):
            return (f"host {request.host!r} is not one of this chat's names; if you reach it through a proxy "
                    "under that name, add it to [web] allowed_hosts")
        if request.method not in SAFE_METHODS:
            if not self.same_origin(request):
                return self._foreign(request)
        elif request.path.startswith("/api/"):
            site = (request.headers.get("Sec-Fetch-Site") or "").strip().lower()
            if site in ("cross-site", "same-site") or not self.same_origin(request):
                return self._foreign(request)
        return None

    def _foreign(self, request: web.Request) -> str:
        origin = request.headers.get("Origin")
        sent = f"from {origin!r}" if origin is not None else "from another site"
        hint = ("; behind a TLS proxy, list the proxy's address in [web] trusted_proxies"
                if origin and origin.startswith("https:") and request.scheme == "http" else "")
        return f"cross-origin request refused: {sent}, not {self.own_origin(request)!r}{hint}"


def add_security_headers(request: web.Request, response: web.StreamResponse) -> None:
    """For ``app.on_response_prepare``: every answer of the web chat carries :data:`SECURITY_HEADERS`."""
    if is_chat_path(request.path):
        for name, value in SECURITY_HEADERS.items():
            response.headers.setdefault(name, value)
