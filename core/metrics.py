"""What ``GET /metrics`` shows: counters and gauges of one core, in Prometheus' text format.

Kept in a registry of the core's own (not prometheus_client's process-wide default), so two cores in one
process (the tests run many) never share or collide on a metric. Everything is counted where it happens:

- turns by how they ended and their duration (``turn_log.turn_scope`` reports both when a turn ends);
- plain fallbacks, sent when a turn's live delivery failed, once the platform took them (``core.redelivery``);
- model requests retried (the agent loop's retry ladder), and transcriptions retried (``core.media.transcribe``,
  on the same ladder but kept apart: the transcription endpoint is often not the model's server);
- platform calls and the 429s among them, per channel (each attempt, through ``ChannelHost.count_call``);
- queued messages, sessions with a worker and turns running, read when scraped.

Labels are closed sets (outcome words, channel names), never user or session ids, so a busy bridge does not
grow its metrics without bound, and nothing a user wrote ever appears in them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CallResult = Literal["ok", "rate_limited", "error"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

# From a quick answer to a long agent run with tools; turns past 10 minutes land in +Inf.
TURN_BUCKETS = (0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.turns = Counter("chatbridge_turns", "Turns by how they ended.", ["outcome"], registry=r)
        self.turn_seconds = Histogram("chatbridge_turn_duration_seconds",
                                      "Time from a turn's start (its message stored) to its end.",
                                      buckets=TURN_BUCKETS, registry=r)
        self.fallbacks = Counter("chatbridge_fallbacks",
                                 "Plain fallback messages sent because live delivery of a turn failed.",
                                 ["channel"], registry=r)
        self.model_retries = Counter("chatbridge_model_retries", "Model requests tried again after a failure.",
                                     registry=r)
        self.transcription_retries = Counter("chatbridge_transcription_retries",
                                             "Transcription requests tried again after a failure.", registry=r)
        self.platform_calls = Counter("chatbridge_platform_calls",
                                      "Attempts of calls to chat platforms, by result (a retry is an attempt).",
                                      ["channel", "result"], registry=r)
        self.queue_depth = Gauge("chatbridge_queue_depth", "Accepted messages waiting for their turn.",
                                 registry=r)
        self.active_sessions = Gauge("chatbridge_active_sessions",
                                     "Sessions with a worker (running a turn or with messages waiting).",
                                     registry=r)
        self.running_turns = Gauge("chatbridge_running_turns", "Turns being answered now.", registry=r)

    def watch(self, *, queue_depth: Callable[[], float], active_sessions: Callable[[], float],
              running_turns: Callable[[], float]) -> None:
        """Read the gauges from these functions whenever the metrics are scraped."""
        self.queue_depth.set_function(queue_depth)
        self.active_sessions.set_function(active_sessions)
        self.running_turns.set_function(running_turns)

    def turn_ended(self, outcome: str, seconds: float) -> None:
        """``outcome`` as the turn's log line has it ("completed", "failed (provider)"): counted by its word."""
        self.turns.labels(outcome.split(" ", 1)[0]).inc()
        self.turn_seconds.observe(seconds)

    def platform_call(self, channel: str, result: CallResult) -> None:
        self.platform_calls.labels(channel, result).inc()

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
