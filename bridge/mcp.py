"""The operator's ``[[agent.mcp_servers]]`` mapped onto core's MCP client, for ``run`` and ``check``."""

from __future__ import annotations

import logging

from bridge.config import AppConfig
from channels.common.masking import mask
from core.tools.mcp import McpManager, McpServerConfig, RestartPolicy

log = logging.getLogger("chatbridge.mcp")


def server_configs(config: AppConfig) -> list[McpServerConfig]:
    return [
        McpServerConfig(
            name=entry.name,
            command=entry.command,
            args=tuple(entry.args),
            env=dict(entry.env),
            url=entry.url,
            approval=entry.approval,
            startup_timeout=float(entry.startup_timeout_seconds),
            call_timeout=float(entry.call_timeout_seconds),
        )
        for entry in config.agent.mcp_servers
    ]


def _scrub(text: str, config: AppConfig) -> str:
    for secret in config.secret_values():
        text = text.replace(secret, "***")
    return text


def _manager(config: AppConfig, restart: RestartPolicy | None = None) -> McpManager:
    """A manager whose servers' stderr lines are masked as every other text the operator sees: the config's
    secret values (an MCP server's ``env`` values among them) and whatever looks like a credential."""
    secrets = config.secret_values()
    return McpManager(restart=restart, redact=lambda line: mask(line, secrets))


def mcp_manager(config: AppConfig, *, restart: RestartPolicy | None = None) -> McpManager:
    """The manager ``start_mcp_servers`` starts the servers in (made first, so that a start cut short by a
    signal can still be closed through it)."""
    return _manager(config, restart)


async def start_mcp_servers(config: AppConfig, *, restart: RestartPolicy | None = None,
                            manager: McpManager | None = None) -> McpManager:
    """Start every configured server (each bounded by its start-up timeout) in ``manager`` (default: a new
    one); log one line per server.

    A server that fails is logged and left out; the others' tools are in ``manager.tools()``, and each of
    them is brought back whenever it goes away (``restart``, default ``RestartPolicy()``).
    """
    manager = manager or _manager(config, restart)
    configs = server_configs(config)
    if not configs:
        return manager
    await manager.start(configs)
    for status in manager.statuses:
        if status.ok:
            log.info("MCP server %s (%s): %d tools: %s", status.name, status.target, len(status.tools),
                     ", ".join(status.tools) or "(none)")
        else:
            log.error("MCP server %s (%s) failed to start, its tools are unavailable: %s", status.name,
                      _scrub(status.target, config), _scrub(status.error or "", config))
    return manager


async def check_mcp_servers(config: AppConfig) -> tuple[list[str], bool]:
    """Start each configured server, list its tools, close it: report lines for ``chatbridge check``
    and whether every server started."""
    configs = server_configs(config)
    if not configs:
        return [], True
    manager = _manager(config)
    try:
        await manager.start(configs)
    finally:
        await manager.aclose()
    lines = ["MCP servers:"]
    failed = 0
    for status in manager.statuses:
        if status.ok:
            tools = ", ".join(status.tools) or "(none)"
            lines.append(f"  {status.name} ({status.target}): OK, {len(status.tools)} tools: {tools}")
        else:
            failed += 1
            lines.append(f"  {status.name} ({status.target}): FAILED: {status.error}")
    if failed:
        lines.append(f"{failed} of {len(configs)} MCP servers failed to start: `chatbridge run` would go on "
                     "without their tools (exit status 1)")
    else:
        lines.append(f"all {len(configs)} MCP servers started")
    return [_scrub(line, config) for line in lines], failed == 0
