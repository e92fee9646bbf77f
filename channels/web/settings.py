"""``[web]``: the built-in web chat and the HTTP server every webhook-mode channel is served on.

A non-loopback ``host`` needs ``auth_token``: the chat and its API would otherwise be open to the network.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from channels.common.settings import Checks, Int, Secret, Section, is_loopback_host


class WebConfig(Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: Annotated[Int, Field(ge=1, le=65535)] = 8765
    auth_token: Secret = ""

    def check(self, checks: Checks) -> None:
        if not self.enabled:
            return
        if not self.host.strip():
            checks.add("host", "expected a host name or address (got empty)")
        elif not is_loopback_host(self.host):
            checks.require("auth_token", self.auth_token,
                           f"when web.host is not a loopback address (host is {self.host!r})")
