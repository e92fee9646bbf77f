"""The agent loop inside one turn: typed turn events, the merge queue, approvals and tool execution."""
