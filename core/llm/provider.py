"""The provider protocol: one request in, a stream of typed events out.

Every provider (OpenAI-compatible, Anthropic, local) maps its wire format onto these events and its
failures onto ``ProviderError`` kinds, so retries and presentation are decided once, in core. The events
that carry model text are where it enters core: they make it sound (``core.text``) as they are built, so no
provider can hand on a string that cannot be stored or sent.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Literal, Protocol

from core.text import sound_text

DEFAULT_REQUEST_TIMEOUT = 60.0
"""Seconds to wait for a model's answer to start, and then for each next streamed chunk."""
DEFAULT_MAX_OUTPUT_TOKENS = 1024
"""Output tokens asked for when the operator sets no ``max_output_tokens`` and the API needs a number."""


@dataclass(frozen=True, slots=True)
class LLMToolSpec:
    name: str
    description: str
    parameters: dict[str, Any]


@dataclass(frozen=True, slots=True)
class LLMToolCall:
    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class LLMImage:
    """An image for the model (a user message's attachment), and the words that stand for it where images
    cannot go (a provider or model without vision, a rejected request)."""

    media_type: str
    """One of ``core.media.sniff.IMAGE_TYPES``."""
    data: bytes
    description: str

    def __repr__(self) -> str:  # never a megabyte of bytes in a log line
        return f"LLMImage({self.media_type}, {len(self.data)} bytes, {self.description!r})"


@dataclass(frozen=True, slots=True)
class LLMMessage:
    role: Literal["system", "user", "assistant", "tool"]
    content: str
    tool_calls: tuple[LLMToolCall, ...] = ()
    tool_call_id: str | None = None
    images: tuple[LLMImage, ...] = ()
    """Shown to the model after ``content`` (user messages only)."""

    def described(self) -> LLMMessage:
        """This message with its images replaced by their descriptions (appended to the text)."""
        if not self.images:
            return self
        words = "\n".join(image.description for image in self.images)
        return LLMMessage(self.role, f"{self.content}\n\n{words}" if self.content else words, self.tool_calls,
                          self.tool_call_id)


def has_images(messages: tuple[LLMMessage, ...]) -> bool:
    return any(m.images for m in messages)


def without_images(messages: tuple[LLMMessage, ...]) -> tuple[LLMMessage, ...]:
    """``messages`` with every image replaced by its description."""
    return tuple(m.described() for m in messages)


@dataclass(frozen=True, slots=True)
class LLMRequest:
    messages: tuple[LLMMessage, ...]
    tools: tuple[LLMToolSpec, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    model: str | None = None
    """Overrides the provider's configured model for this request (a subagent profile's ``model``);
    providers that run one fixed model in-process (``local``) ignore it."""


# ---- stream events -------------------------------------------------------------------------------


@dataclass(slots=True)
class TextDelta:
    """Not frozen, like every event built once per streamed token (see ``core.agent.events``): nothing changes
    it once made."""

    text: str

    def __post_init__(self) -> None:
        self.text = sound_text(self.text)


@dataclass(slots=True)
class ReasoningDelta:
    text: str

    def __post_init__(self) -> None:
        self.text = sound_text(self.text)


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A fragment of a streamed tool call; fragments with the same index belong together."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", sound_text(self.arguments))
        if self.id is not None:
            object.__setattr__(self, "id", sound_text(self.id))
        if self.name is not None:
            object.__setattr__(self, "name", sound_text(self.name))


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class StreamEnd:
    finish_reason: str | None = None


ProviderEvent = TextDelta | ReasoningDelta | ToolCallDelta | Usage | StreamEnd


class ProviderErrorKind(Enum):
    AUTH = "auth"  # bad key / forbidden: never retried
    TIMEOUT = "timeout"  # no answer (or no next chunk) within the request timeout
    TRANSIENT = "transient"  # 5xx, connection errors
    RATE_LIMIT = "rate_limit"  # 429
    QUOTA = "quota"  # the provider account's credit or budget is used up: never retried, the operator must act
    MALFORMED = "malformed"  # a chunk we could not parse
    CONTEXT_OVERFLOW = "context_overflow"  # the prompt does not fit the model's window
    BAD_REQUEST = "bad_request"  # other 4xx: not retried
    UNAVAILABLE = "unavailable"  # provider cannot run here (e.g. missing optional package)


RETRYABLE_KINDS = frozenset(
    {ProviderErrorKind.TIMEOUT, ProviderErrorKind.TRANSIENT, ProviderErrorKind.RATE_LIMIT, ProviderErrorKind.MALFORMED}
)


@dataclass(eq=False)
class ProviderError(Exception):
    """A provider failure. ``detail`` is for logs (secrets already removed); never shown in a chat."""

    kind: ProviderErrorKind
    detail: str = ""
    retry_after: float | None = None
    status: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return f"{self.kind.value}: {self.detail}" if self.detail else self.kind.value

    @property
    def retryable(self) -> bool:
        return self.kind in RETRYABLE_KINDS

    @property
    def window_share(self) -> float | None:
        """For a context overflow whose message gives the sizes: the share of the refused prompt the model's
        window holds (its limit over the tokens asked for), below 1; None when the message does not say."""
        return window_share(self.detail) if self.kind is ProviderErrorKind.CONTEXT_OVERFLOW else None


_OVERFLOW_SIZES = (
    # (pattern, group of the tokens asked for, group of the window); the wordings servers use today
    (re.compile(r"requested tokens \((\d+)\) exceed context window of (\d+)"), 1, 2),  # llama-cpp-python
    (re.compile(r"maximum context length is (\d+) tokens.*?(?:resulted in|requested) (\d+) tokens"), 2, 1),  # OpenAI
    (re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum"), 1, 2),  # Anthropic
    (re.compile(r"request \((\d+) tokens\) exceeds the available context size \((\d+) tokens\)"), 1, 2),  # llama-server
)


def window_share(message: str) -> float | None:
    """The window over the prompt's tokens, read from an overflow error's wording (see ``_OVERFLOW_SIZES``).
    Token counts come only from the model's side: a rough character estimate (``core.input_builder``) can be
    far off for some scripts (a Chinese character is one token or more, not a quarter of one)."""
    text = message.lower().replace(",", "")
    for pattern, asked_group, window_group in _OVERFLOW_SIZES:
        found = pattern.search(text)
        if found is not None:
            asked, window = int(found.group(asked_group)), int(found.group(window_group))
            return window / asked if 0 < window < asked else None
    return None


class LLMProvider(Protocol):
    """One attempt per ``stream`` call; retries are the caller's policy (``core.llm.retry``)."""

    name: str

    def stream(self, request: LLMRequest) -> AsyncIterator[ProviderEvent]:
        """Yield events for one model request; raise ProviderError on failure."""
        ...

    async def aclose(self) -> None: ...
