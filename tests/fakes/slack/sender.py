"""Sends Events API and interactivity requests to an app's HTTP endpoint, signed the way Slack signs them.

Slack signs ``v0:{X-Slack-Request-Timestamp}:{raw body}`` with HMAC-SHA256 under the app's signing secret and
sends ``X-Slack-Signature: v0=<hex>``; a retry carries ``X-Slack-Retry-Num`` and ``X-Slack-Retry-Reason``
(``http_timeout``, ``http_error``, ``connection_failed``, ...). Event bodies are JSON; interactivity payloads
(``block_actions``) are form-encoded as ``payload=<json>``; slash commands are plain form fields.

The signature is computed here with ``hmac`` on purpose (not with slack_sdk's ``SignatureVerifier``): the fake
must not share code with the side it checks.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import urlencode

import aiohttp

Signature = Literal["valid", "bad", "missing"]


def sign(secret: str, timestamp: str, body: bytes) -> str:
    base = b"v0:" + timestamp.encode() + b":" + body
    return "v0=" + hmac.new(secret.encode(), base, hashlib.sha256).hexdigest()


@dataclass
class Sent:
    status: int
    text: str
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.text)


class EventSender:
    def __init__(self, url: str, signing_secret: str, *, timeout: float = 10.0) -> None:
        self.url = url
        self.signing_secret = signing_secret
        self.timeout = timeout
        self.sent: list[tuple[dict[str, str], bytes]] = []

    async def post(self, body: bytes, content_type: str, *, signature: Signature = "valid",
                   timestamp: int | None = None, retry_num: int | None = None,
                   retry_reason: str | None = None) -> Sent:
        """POST ``body`` as Slack would. ``timestamp`` (unix seconds) defaults to now; an old one stands for a
        replayed request. ``signature="bad"`` signs with a wrong secret, ``"missing"`` sends no signature."""
        ts = str(int(time.time()) if timestamp is None else timestamp)
        headers = {"Content-Type": content_type, "X-Slack-Request-Timestamp": ts,
                   "User-Agent": "Slackbot 1.0 (+https://api.slack.com/robots)"}
        if signature == "valid":
            headers["X-Slack-Signature"] = sign(self.signing_secret, ts, body)
        elif signature == "bad":
            headers["X-Slack-Signature"] = sign(self.signing_secret + "-wrong", ts, body)
        if retry_num is not None:
            headers["X-Slack-Retry-Num"] = str(retry_num)
            headers["X-Slack-Retry-Reason"] = retry_reason or "http_timeout"
        self.sent.append((headers, body))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)) as session, \
                session.post(self.url, data=body, headers=headers) as resp:
            return Sent(resp.status, await resp.text(), dict(resp.headers))

    async def event(self, payload: dict[str, Any], **kw: Any) -> Sent:
        """An Events API request (``event_callback`` or ``url_verification``)."""
        return await self.post(json.dumps(payload).encode(), "application/json", **kw)

    async def url_verification(self, challenge: str = "3eZbrw1aBm2rZgRNFdxV2595E9CY3gmdALWMmHkvFXO7tYXAYM8P",
                               **kw: Any) -> Sent:
        return await self.event({"token": "fake-verification-token", "challenge": challenge,
                                 "type": "url_verification"}, **kw)

    async def interaction(self, payload: dict[str, Any], **kw: Any) -> Sent:
        """An interactivity request (``block_actions`` ...): form-encoded ``payload=<json>``."""
        body = urlencode({"payload": json.dumps(payload)}).encode()
        return await self.post(body, "application/x-www-form-urlencoded", **kw)

    async def command(self, fields: dict[str, str], **kw: Any) -> Sent:
        """A slash command: its fields form-encoded."""
        return await self.post(urlencode(fields).encode(), "application/x-www-form-urlencoded", **kw)
