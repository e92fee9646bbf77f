"""Runtime knobs core needs, as plain values. The bridge maps the operator config onto these.

These defaults are the only ones: the operator config takes its defaults for the same knobs from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from core.llm.provider import DEFAULT_REQUEST_TIMEOUT

DEFAULT_RETRY_DELAYS: tuple[float, ...] = (2.0, 4.0, 8.0, 16.0, 30.0)


@dataclass(frozen=True, slots=True)
class SubagentProfile:
    """One ``[[agent.subagents.profiles]]`` entry: how a child session started with this profile runs."""

    name: str
    system_prompt: str | None = None
    """None: the parent's system prompt."""
    tools: tuple[str, ...] | None = None
    """The tools the child may call (built-in and MCP names); None: every tool the parent has."""
    max_turns: int | None = None
    """Model requests of the child's turn; None: ``[agent] max_turns``."""
    model: str | None = None
    """The model the child's requests name; None: ``[llm] model``."""


@dataclass(frozen=True, slots=True)
class SubagentSettings:
    enabled: bool = False
    max_depth: int = 1
    """How deep children may nest: 1 lets a conversation start children that cannot start their own."""
    max_concurrent: int = 4
    """``run_subagent`` calls running at once within one turn; one more is refused with a tool error."""
    profiles: tuple[SubagentProfile, ...] = ()


@dataclass(frozen=True, slots=True)
class CoreSettings:
    system_prompt: str = "You are a helpful assistant."
    max_turns: int = 20
    """Model requests per user message (each round of tool calls costs one)."""
    approval_timeout: float = 600.0
    """A tool call nobody approves within this many seconds is denied."""
    compaction_threshold: float = 0.75
    """Compact the context (an LLM summary) when its estimate passes this share of context_window."""
    queue_capacity: int = 32
    resume_max_age: float = 900.0
    """A message accepted but not yet answered when the bridge stopped is answered after the restart if it is
    at most this many seconds old; an older one gets a notice asking to send it again."""
    session_idle_seconds: float = 300.0
    """A session worker with nothing to do for this long exits; the session then costs only its row."""
    context_window: int = 32_768
    """Model context window in tokens; history is trimmed to fit (about 4 characters per token)."""
    retry_delays: tuple[float, ...] = DEFAULT_RETRY_DELAYS
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    max_output_tokens: int | None = None
    temperature: float | None = None
    sink_open_timeout: float = 15.0
    """Bound on opening a turn's sink; also the grace the delivery wait adds after a platform pause."""
    delivery_wait_timeout: float = 120.0
    """How long a finished turn waits for its sink to show it (stretched by platform pauses)."""
    redelivery_delays: tuple[float, ...] = (5.0, 15.0, 30.0, 60.0, 120.0, 300.0)
    """A terminal message neither the sink nor its fallback could show is sent again after each of these
    pauses (one try each) until the platform takes it; then it waits for the next start (``core.redelivery``)."""
    dedupe_ttl_seconds: float = 48 * 3600.0
    shutdown_timeout: float = 10.0
    titles: bool = True
    title_timeout: float = 30.0
    history_limit: int = 200
    vision: Literal["auto"] | bool = "auto"
    """Images to the model as image parts: "auto" follows the model's known capability (``core.media.vision``)."""
    media_max_bytes: int = 20_000_000
    """Per attachment; a larger one is refused (described to the model, the user told), never kept."""
    media_max_files: int = 10
    """Attachments read per message; the rest are described."""
    media_keep_seconds: float = 168 * 3600.0
    """Stored attachment files expire after this long."""
    media_max_pixels: int = 50_000_000
    """An image with more pixels is refused unopened (decompression bombs)."""
    media_text_chars: int = 20_000
    """Characters of document text (text files, PDFs) one message gives the model; a cut is marked."""
    media_fetch_timeout: float = 120.0
    """Seconds to download all of one message's attachments from its platform together (or to transcribe one)."""
    media_sweep_interval: float = 3600.0
    """Seconds between two passes that delete expired attachment files."""
    model: str | None = None
    """The model every request of these turns names; None: the provider's own (``[llm] model``). A
    subagent profile's ``model`` sets it for its child sessions."""
    subagents: SubagentSettings = field(default_factory=SubagentSettings)
