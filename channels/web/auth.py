"""The web chat's access token: who holds it, what the login cookie carries, and how fast one may guess.

- The token (``[web] auth_token``) is sent as ``Authorization: Bearer`` by API clients or typed once into
  the login form. The form then sets a cookie that holds ``HMAC(cookie key, token)``, never the token: a
  copied cookie does not reveal the token, and changing the token signs every browser out. The cookie key
  is random, kept in the web channel's durable state (so a restart keeps people signed in).
- Wrong tokens are rate-limited per client address (an IPv6 client by its /64): a few free attempts, then
  one more every few seconds, answered 429 at once (nothing sleeps, no connection is held open). A client
  over its limit is refused before its token is compared, so it learns nothing. Someone guessing from
  another address cannot lock the real user out, and a browser that already holds the cookie is never
  throttled.

Written here rather than with a rate-limit package: the limit counts failures only and keys on the address
that :mod:`channels.web.guard` resolved through the trusted proxies.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import itertools
import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

COOKIE = "chatbridge_session"
COOKIE_MAX_AGE = 30 * 24 * 3600


def client_key(remote: str | None) -> str:
    """What rate limits and stream caps count per: the address, or its /64 for IPv6 (one host often has many)."""
    if not remote:
        return "local"
    try:
        ip = ipaddress.ip_address(remote)
    except ValueError:
        return remote
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class TokenCheck:
    """Compares presented credentials with the configured token (constant time)."""

    def __init__(self, token: str, cookie_key: bytes) -> None:
        self.token = token
        self._token = token.encode()
        digest = hmac.new(cookie_key, b"chatbridge web login\0" + self._token, hashlib.sha256).digest()
        self.cookie_value = base64.urlsafe_b64encode(digest).decode().rstrip("=")

    @property
    def required(self) -> bool:
        return bool(self.token)

    # Header values may carry undecodable bytes as surrogates; "surrogatepass" keeps them distinct bytes that
    # can never equal valid UTF-8 (where "replace" would turn them into "?", which could).
    def token_ok(self, presented: str) -> bool:
        return hmac.compare_digest(presented.encode("utf-8", "surrogatepass"), self._token)

    def cookie_ok(self, presented: str) -> bool:
        return bool(presented) and hmac.compare_digest(presented.encode("utf-8", "surrogatepass"),
                                                       self.cookie_value.encode())


class GuessLimiter:
    """Per-client budget of wrong tokens: ``burst`` at once, then one more every ``refill_seconds``.

    A client appears here only after a failure and leaves once its budget is full again, and the table is
    bounded (``max_clients``), so addresses that guess once cannot grow it without end."""

    def __init__(self, *, burst: int = 10, refill_seconds: float = 3.0, max_clients: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.burst = burst
        self.refill_seconds = refill_seconds
        self.max_clients = max_clients
        self._clock = clock
        self._spent: dict[str, tuple[float, float]] = {}  # client → (attempts spent, when counted)

    def _current(self, client: str, now: float) -> float:
        entry = self._spent.get(client)
        if entry is None:
            return 0.0
        spent, at = entry
        return max(0.0, spent - (now - at) / self.refill_seconds)

    def retry_after(self, client: str) -> float | None:
        """Seconds until ``client`` may try a token again, or None when it may now."""
        now = self._clock()
        spent = self._current(client, now)
        if spent == 0.0:
            self._spent.pop(client, None)
        if spent + 1 <= self.burst:
            return None
        return (spent + 1 - self.burst) * self.refill_seconds

    def failed(self, client: str) -> None:
        now = self._clock()
        spent = self._current(client, now) + 1
        self._spent.pop(client, None)
        self._spent[client] = (spent, now)  # re-inserted: the dict stays ordered by last failure
        excess = len(self._spent) - self.max_clients
        for key in list(itertools.islice(self._spent, max(0, excess))):
            del self._spent[key]  # the longest quiet ones
        if spent >= self.burst > spent - 1:  # once per burst, not per guess
            log.warning("web chat: repeated wrong access tokens from %s; slowing it down", client)

    def succeeded(self, client: str) -> None:
        self._spent.pop(client, None)

    def __len__(self) -> int:
        return len(self._spent)
