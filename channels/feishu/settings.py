"""``[channels.feishu]``: the operator's Feishu / Lark settings (DESIGN.md §6) and their rules.

``domain`` selects Feishu (https://open.feishu.cn), Lark (https://open.larksuite.com) or a test server.
Webhook mode needs the verification token and the [web] server, which serves ``/feishu/events``.
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


class FeishuConfig(ChannelSection):
    app_id: Annotated[str, env_default("FEISHU_APP_ID")] = ""
    app_secret: Annotated[Secret, env_default("FEISHU_APP_SECRET")] = ""
    domain: str = "https://open.feishu.cn"
    mode: Literal["websocket", "webhook"] = "websocket"
    verification_token: Secret = ""
    encrypt_key: Secret = ""
    allow_from: AllowFrom = Field(default_factory=allow_everyone)
    group_policy: GroupPolicy = "mention"

    def served_by_web(self) -> bool:
        return self.mode == "webhook"

    def check(self, checks: Checks) -> None:
        checks.require("app_id", self.app_id, "when channels.feishu.enabled = true")
        checks.require("app_secret", self.app_secret, "when channels.feishu.enabled = true")
        if self.mode == "webhook":
            checks.require("verification_token", self.verification_token, "in webhook mode")
        checks.url("domain", self.domain)
