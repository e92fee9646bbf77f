"""``[web]``: the built-in web chat and the HTTP server every webhook-mode channel is served on.

A non-loopback ``host`` needs ``auth_token``: the chat and its API would otherwise be open to the network.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any

from pydantic import BeforeValidator, Field
from pydantic_core import PydanticCustomError

from channels.common.settings import Checks, Int, Secret, Section, is_loopback_host


def _host_entry(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    name = value.strip().lower().rstrip(".")
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    if not name or not re.fullmatch(r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?)*", name):
        raise PydanticCustomError(
            "host_name", "expected a host name such as \"chat.example.com\" (no scheme, port or path)")
    return name


def _network_entry(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return str(ipaddress.ip_network(value.strip(), strict=False))
    except ValueError:
        raise PydanticCustomError(
            "ip_network", "expected an IP address or network such as \"127.0.0.1\" or \"10.0.0.0/8\"") from None


class WebConfig(Section):
    enabled: bool = True
    host: str = "127.0.0.1"
    port: Annotated[Int, Field(ge=1, le=65535)] = 8765
    auth_token: Secret = ""
    allowed_hosts: list[Annotated[str, BeforeValidator(_host_entry)]] = Field(default_factory=list)
    """Host names the web chat answers besides loopback names, IP literals and ``host``."""
    trusted_proxies: list[Annotated[str, BeforeValidator(_network_entry)]] = Field(default_factory=list)
    """Addresses (or networks) whose X-Forwarded-Proto/-Host/-For headers are believed."""
    max_streams: Annotated[Int, Field(ge=1)] = 200
    max_streams_per_client: Annotated[Int, Field(ge=1)] = 20

    def check(self, checks: Checks) -> None:
        if not self.enabled:
            return
        if not self.host.strip():
            checks.add("host", "expected a host name or address (got empty)")
        elif not is_loopback_host(self.host):
            checks.require("auth_token", self.auth_token,
                           f"when web.host is not a loopback address (host is {self.host!r})")
        if self.max_streams_per_client > self.max_streams:
            checks.add("max_streams_per_client",
                       f"must not exceed web.max_streams ({self.max_streams}) (got {self.max_streams_per_client})")
