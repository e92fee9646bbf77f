"""Tools the agent may call: the Tool protocol, the registry, built-in tools and MCP servers."""
