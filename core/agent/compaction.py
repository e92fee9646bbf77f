"""Compaction: when a session's context nears the model's window, an LLM summary replaces its older part.

The summary request runs on the old context; its output is never streamed to the user (only the
compaction_begin / token_usage / compaction_end events are on the turn's stream). The summary is
persisted with the turn (a message with source kind "summary" and ``extra.covers_through_seq``);
TurnInputBuilder then starts every context from the newest summary plus the messages after it.
"""

from __future__ import annotations

from collections.abc import Callable

from core.agent.events import CompactionBegin, CompactionEnd, TokenUsage, TurnEvent
from core.input_builder import (
    CHARS_PER_TOKEN,
    PreparedTurnInput,
    Summary,
    TurnInputBuilder,
    estimate_tokens,
    summary_of,
)
from core.llm.provider import LLMMessage, LLMProvider, LLMRequest, ProviderError, TextDelta, Usage
from core.llm.retry import counting, retry_policy
from core.llm.silence import bounded
from core.media.describe import mention
from core.messages import ChatMessage, MessageSource, NewMessage
from core.settings import CoreSettings

SUMMARY_PROMPT = (
    "You compress conversations. Summarize the conversation below so that it can replace it as context: "
    "keep facts, decisions, names, numbers, files the user attached, open questions and what the user wants. "
    "Write plain prose, at most a few paragraphs; do not address the user.")


class Compactor:
    def __init__(self, provider: LLMProvider, builder: TurnInputBuilder, settings: CoreSettings, *,
                 on_model_retry: Callable[[], None] | None = None) -> None:
        self._provider = provider
        self._builder = builder
        self._settings = settings
        self._on_model_retry = on_model_retry
        """Told of each summary request tried again (the metrics' model retries)."""

    def needed(self, prepared: PreparedTurnInput) -> bool:
        """The context passed ``compaction_threshold`` of the window: ``context_window``, or the smaller window
        an overflow taught for the session (a script the estimate undercounts, ``PreparedTurnInput.window_chars``),
        where the oldest messages would otherwise be trimmed away without a summary."""
        window = self._settings.context_window
        if prepared.window_chars is not None:
            window = min(window, prepared.window_chars // CHARS_PER_TOKEN)
        return prepared.context_tokens > self._settings.compaction_threshold * window

    async def maybe_compact(self, prepared: PreparedTurnInput,
                            emit: Callable[[TurnEvent], None]) -> tuple[PreparedTurnInput, Summary | None]:
        """Compact when the context is near the window: returns the input to use and the summary to commit."""
        if not self.needed(prepared):
            return prepared, None
        history = list(prepared.history)
        last_user = max((i for i, m in enumerate(history) if m.role == "user"), default=None)
        older = history[:last_user] if last_user is not None else []
        if not older:
            return prepared, None
        emit(CompactionBegin(len(older)))
        try:
            text, usage = await self.summarize(prepared.summary, older, window_chars=prepared.window_chars)
        except ProviderError:
            emit(CompactionEnd("failed"))
            return prepared, None  # the builder's trimming still keeps the request inside the window
        if usage is not None:
            emit(TokenUsage(usage.prompt_tokens, usage.completion_tokens))
        summary = summary_of(text, prepared.summary, older)
        emit(CompactionEnd("completed"))
        return await self._builder.with_summary(prepared, summary), summary

    async def summarize(self, previous: Summary | None, messages: list[ChatMessage], *,
                        window_chars: int | None = None) -> tuple[str, Usage | None]:
        """A summary of ``previous`` and ``messages``. With ``window_chars`` (the session's learnt window) the
        request keeps to three quarters of it: the earlier summary and the newest messages that fit; older ones
        are left out, as the turn's own input would have left them."""
        lines = [f"[Earlier summary]\n{previous.text}"] if previous is not None else []
        for m in messages:
            if m.role == "tool":
                lines.append(f"tool result ({m.tool_call_id}): {m.content[:2000]}")
            elif m.tool_calls:
                calls = "; ".join(f"{tc.name}({tc.arguments})" for tc in m.tool_calls)
                lines.append(f"{m.role}: {m.content}\n(called tools: {calls})")
            elif m.source.attachments:
                lines.append(f"{m.role}: {m.content}\n(attached: {mention(m.source.attachments)})")
            else:
                lines.append(f"{m.role}: {m.content}")
        if window_chars is not None:
            lines = _newest_that_fit(lines, int(window_chars * 0.75) - len(SUMMARY_PROMPT),
                                     keep_first=previous is not None)
        request = LLMRequest(messages=(LLMMessage("system", SUMMARY_PROMPT), LLMMessage("user", "\n\n".join(lines))),
                             max_tokens=self._settings.max_output_tokens, model=self._settings.model)
        usage: Usage | None = None
        text = ""
        async for attempt in retry_policy(self._settings.retry_delays, on_retry=counting(self._on_model_retry)):
            with attempt:
                parts: list[str] = []
                async for event in bounded(self._provider.stream(request), self._settings.request_timeout):
                    if isinstance(event, TextDelta):
                        parts.append(event.text)
                    elif isinstance(event, Usage):
                        usage = event
                text = "".join(parts).strip()
        return text, usage


def _newest_that_fit(lines: list[str], room: int, *, keep_first: bool) -> list[str]:
    """The first line when ``keep_first`` (the earlier summary), then the newest lines within ``room``
    characters in all (at least one of them)."""
    head = lines[:1] if keep_first else []
    used = sum(len(line) + 2 for line in head)
    kept: list[str] = []
    for line in reversed(lines[len(head):]):
        if kept and used + len(line) + 2 > room:
            break
        kept.append(line)
        used += len(line) + 2
    return head + kept[::-1]


def summary_message(summary: Summary, turn_id: str | None) -> NewMessage:
    return NewMessage(role="assistant", content=summary.text,
                      source=MessageSource(kind="summary", turn_id=turn_id, attachments=summary.attachments,
                                           extra={"covers_through_seq": summary.covers_through_seq}))


__all__ = ["Compactor", "estimate_tokens", "summary_message"]
