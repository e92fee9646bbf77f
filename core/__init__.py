"""Platform-neutral heart of chatbridge: envelopes, sessions, turns, delivery, storage, LLM providers.

Nothing in here imports from ``channels`` or ``bridge`` or interprets a platform key.
"""
