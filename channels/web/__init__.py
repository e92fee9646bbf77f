"""The built-in web chat: HTTP API, SSE streams with replay, and the chat page (static files, no build step)."""
