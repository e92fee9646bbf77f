"""``[channels.slack]``: the operator's Slack settings (DESIGN.md §6) and their rules.

Socket Mode needs the app-level token; HTTP mode needs the signing secret and the [web] server, which
serves ``/slack/events`` (events, interactivity and slash commands on one route). ``chatbridge check`` and
``chatbridge run`` refuse a file without them, naming the key.
"""

from __future__ import annotations

from typing import Annotated, Literal

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

EVENTS_PATH = "/slack/events"


class SlackConfig(ChannelSection):
    bot_token: Annotated[Secret, env_default("SLACK_BOT_TOKEN")] = ""
    app_token: Annotated[Secret, env_default("SLACK_APP_TOKEN")] = ""
    signing_secret: Secret = ""
    mode: Literal["socket", "http"] = "socket"
    api_base: str = "https://slack.com/api/"
    allow_from: AllowFrom = Field(default_factory=allow_everyone)
    group_policy: GroupPolicy = "mention"
    stream_transport: Literal["auto", "update", "native"] = "auto"
    update_interval_ms: Annotated[Int, Field(ge=100)] = 1000
    workspace_updates_per_minute: Annotated[Int, Field(ge=1)] = 50

    def served_by_web(self) -> bool:
        return self.mode == "http"

    def check(self, checks: Checks) -> None:
        checks.require("bot_token", self.bot_token, "when channels.slack.enabled = true")
        _shape(checks, "bot_token", self.bot_token, "xoxb-", "the Bot User OAuth Token (OAuth & Permissions)")
        if self.mode == "socket":
            checks.require("app_token", self.app_token, "in socket mode")
            _shape(checks, "app_token", self.app_token, "xapp-", "an app-level token (Basic Information)")
        else:
            checks.require("signing_secret", self.signing_secret, "in http mode")
        checks.url("api_base", self.api_base)


def _shape(checks: Checks, key: str, value: str, prefix: str, what: str) -> None:
    """A token pasted into the wrong key (never echoed: it is a secret)."""
    if value.strip() and not checks.unset_variables(key) and not value.strip().startswith(prefix):
        checks.add(key, f"expected {what}, which starts with {prefix!r}")
