"""Platform-neutral helpers every channel sink shares: splitting, the message ledger and its reconciler,
per-chat throttling and 429 pauses, and retries of transient platform errors."""
