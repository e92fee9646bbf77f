"""What every channel shares: the live sink (``live_sink``) over a platform's message operations and
rendering (``ops``), the ledger of what a chat shows and its reconciler, splitting under a platform's limit
(UTF-16 units, characters or bytes), pacing in scopes with 429 pauses (``throttle``), and the one call
policy every platform call goes through (``calls``)."""
