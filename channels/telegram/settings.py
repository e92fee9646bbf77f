"""``[channels.telegram]``: the operator's Telegram settings and the rules only Telegram knows.

Webhook mode needs both ``webhook_url`` (the public https:// address Telegram posts to) and
``webhook_secret`` (sent back in a header with every update, in the alphabet Telegram accepts for it);
``chatbridge check`` refuses a file without them, as ``chatbridge run`` does.
"""

from __future__ import annotations

import re
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
)

WEBHOOK_PATH = "/telegram/webhook"
_SECRET_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,256}$")  # Bot API setWebhook: secret_token


class TelegramConfig(ChannelSection):
    token: Annotated[Secret, env_default("TELEGRAM_BOT_TOKEN")] = ""
    api_base: str = "https://api.telegram.org"
    mode: Literal["polling", "webhook"] = "polling"
    webhook_url: str = ""
    webhook_secret: Secret = ""
    allow_from: AllowFrom = Field(default_factory=allow_everyone)
    group_policy: GroupPolicy = "mention"
    edit_interval_ms: Annotated[Int, Field(ge=100)] = 1000
    stream_transport: Literal["auto", "edit", "draft"] = "auto"

    def served_by_web(self) -> bool:
        return self.mode == "webhook"

    def check(self, checks: Checks) -> None:
        checks.require("token", self.token, "when channels.telegram.enabled = true")
        checks.url("api_base", self.api_base)
        if self.mode != "webhook":
            return
        checks.require("webhook_url", self.webhook_url,
                       f"in webhook mode: the public https:// address of {WEBHOOK_PATH} on the [web] server")
        if self.webhook_url.strip() and not checks.unset_variables("webhook_url"):
            checks.url("webhook_url", self.webhook_url)
            if _scheme(self.webhook_url) == "http":
                checks.add("webhook_url", "Telegram posts webhooks only to https:// addresses "
                                          f"(got {self.webhook_url!r})")
        checks.require("webhook_secret", self.webhook_secret,
                       "in webhook mode: a random string Telegram sends back with every update "
                       "(e.g. the output of `openssl rand -hex 32`)")
        if self.webhook_secret.strip() and not _SECRET_TOKEN.match(self.webhook_secret):
            checks.add("webhook_secret", "expected 1 to 256 characters from A-Z, a-z, 0-9, _ and - "
                                         "(what Telegram accepts as a secret token)")


def _scheme(url: str) -> str:
    try:
        return urlsplit(url).scheme
    except ValueError:
        return ""
