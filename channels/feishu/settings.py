"""``[channels.feishu]``: the operator's Feishu / Lark settings (DESIGN.md §6) and their rules.

``domain`` selects Feishu (``"feishu"`` or https://open.feishu.cn), Lark (``"lark"`` or
https://open.larksuite.com) or another Open Platform origin (a private deployment, a test server): an
``https://host[:port]`` origin without a path; plain ``http://`` only for a loopback address, as lark-oapi
itself accepts it.

Webhook mode needs the [web] server, which serves ``/feishu/events``, the event subscription's
verification token, and its encrypt key: with the key Feishu encrypts every body and signs every request
(``X-Lark-Signature``), and the signature is what proves a request comes from Feishu, so a webhook without
it is refused rather than left open to anyone who learns the token.
"""

from __future__ import annotations

from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field

from channels.common.settings import (
    AllowFrom,
    ChannelSection,
    Checks,
    GroupPolicy,
    Int,
    Secret,
    allow_everyone,
    env_default,
    is_loopback_host,
)

WEBHOOK_PATH = "/feishu/events"
DOMAINS = {"feishu": "https://open.feishu.cn", "lark": "https://open.larksuite.com"}


def domain_problem(value: str) -> str | None:
    """Why ``value`` cannot be a ``domain`` (None when it can)."""
    if value.strip().lower() in DOMAINS:
        return None
    try:
        parts = urlsplit(value.strip())
        host = parts.hostname or ""
    except ValueError:
        return 'expected "feishu", "lark" or an https:// origin such as "https://open.feishu.cn"'
    if parts.scheme not in ("http", "https") or not host:
        return 'expected "feishu", "lark" or an https:// origin such as "https://open.feishu.cn"'
    if parts.path.strip("/") or parts.query or parts.fragment:
        return "expected an origin without a path (such as \"https://open.feishu.cn\")"
    if parts.scheme == "http" and not is_loopback_host(host):
        return "http:// is accepted only for a loopback address; use https://"
    return None


class FeishuConfig(ChannelSection):
    app_id: Annotated[str, env_default("FEISHU_APP_ID")] = ""
    app_secret: Annotated[Secret, env_default("FEISHU_APP_SECRET")] = ""
    domain: str = "https://open.feishu.cn"
    mode: Literal["websocket", "webhook"] = "websocket"
    verification_token: Secret = ""
    encrypt_key: Secret = ""
    allow_from: AllowFrom = Field(default_factory=allow_everyone)
    group_policy: GroupPolicy = "mention"
    stream_interval_ms: Annotated[Int, Field(ge=100)] = 500
    max_body_bytes: Annotated[Int, Field(ge=4096, le=1024 * 1024)] = 1024 * 1024
    """At most the web server's own cap on every request body (1 MiB)."""

    def served_by_web(self) -> bool:
        return self.mode == "webhook"

    def base_url(self) -> str:
        """The Open Platform origin every API call (and the long connection's endpoint) goes to."""
        value = self.domain.strip()
        return DOMAINS.get(value.lower(), value.rstrip("/"))

    def check(self, checks: Checks) -> None:
        checks.require("app_id", self.app_id, "when channels.feishu.enabled = true")
        checks.require("app_secret", self.app_secret, "when channels.feishu.enabled = true")
        problem = domain_problem(self.domain)
        if problem:
            checks.add("domain", problem)
        if self.mode == "webhook":
            checks.require("verification_token", self.verification_token, "in webhook mode")
            checks.require("encrypt_key", self.encrypt_key,
                           "in webhook mode: set an Encrypt Key on the Encryption Strategy page of the app, so "
                           "that Feishu signs every request")
