"""``[channels.slack]``: the operator's Slack settings (DESIGN.md §6) and their rules.

Socket Mode needs the app-level token; HTTP mode needs the signing secret and the [web] server, which
serves ``/slack/events``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from channels.common.settings import (
    AllowFrom,
    ChannelSection,
    Checks,
    GroupPolicy,
    Secret,
    allow_everyone,
    env_default,
)


class SlackConfig(ChannelSection):
    bot_token: Annotated[Secret, env_default("SLACK_BOT_TOKEN")] = ""
    app_token: Annotated[Secret, env_default("SLACK_APP_TOKEN")] = ""
    signing_secret: Secret = ""
    mode: Literal["socket", "http"] = "socket"
    api_base: str = "https://slack.com/api/"
    allow_from: AllowFrom = Field(default_factory=allow_everyone)
    group_policy: GroupPolicy = "mention"

    def served_by_web(self) -> bool:
        return self.mode == "http"

    def check(self, checks: Checks) -> None:
        checks.require("bot_token", self.bot_token, "when channels.slack.enabled = true")
        if self.mode == "socket":
            checks.require("app_token", self.app_token, "in socket mode")
        else:
            checks.require("signing_secret", self.signing_secret, "in http mode")
        checks.url("api_base", self.api_base)
