"""TurnInputBuilder: the one place that assembles what the model is sent for a turn.

System prompt first, then the session's context (trimmed to the window), with the runtime context
appended to the last user message as its own block. Overflow recovery reuses the same assembly with a
smaller budget, so the prompt and runtime context are attached exactly once either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from core.context_cache import ContextCache
from core.llm.provider import LLMMessage, LLMToolCall
from core.messages import ChatMessage
from core.settings import CoreSettings
from core.store import Store

CHARS_PER_TOKEN = 4
"""A deliberately rough estimate; the model's own overflow error is the backstop (one recovery)."""


def estimate_tokens(message: ChatMessage | LLMMessage) -> int:
    """About four characters per token, tool-call arguments included."""
    chars = len(message.content)
    if message.tool_calls:
        chars += sum(len(tc.name) + len(tc.arguments) for tc in message.tool_calls)
    return chars // CHARS_PER_TOKEN + 1


@dataclass(frozen=True, slots=True)
class Summary:
    """A compaction summary: it stands for every context message with seq <= ``covers_through_seq``."""

    text: str
    covers_through_seq: int

    def message(self) -> LLMMessage:
        return LLMMessage("user", f"[Summary of the earlier conversation]\n{self.text}")


@dataclass(frozen=True, slots=True)
class RuntimeContext:
    channel: str
    sender_name: str | None = None
    now: float = field(default_factory=time.time)

    def block(self) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.now))
        lines = ["[Runtime context]", f"Current time: {stamp}", f"Channel: {self.channel}"]
        if self.sender_name:
            lines.append(f"Sender: {self.sender_name}")
        return "\n".join(lines)


@dataclass(frozen=True, slots=True)
class PreparedTurnInput:
    session_key: str
    messages: tuple[LLMMessage, ...]
    base_state_version: int
    budget_chars: int
    runtime: RuntimeContext
    recovered: bool = False
    history: tuple[ChatMessage, ...] = ()
    """The context messages after the summary (untrimmed), in seq order."""
    summary: Summary | None = None
    context_tokens: int = 0
    """Estimate of the whole untrimmed context (system prompt, summary, history); compaction reads it."""


class TurnInputBuilder:
    def __init__(self, store: Store, settings: CoreSettings) -> None:
        self._store = store
        self._settings = settings

    async def prepare(self, key: str, base_state_version: int, runtime: RuntimeContext,
                      cache: ContextCache | None = None) -> PreparedTurnInput:
        """The turn's input from the session's context at ``base_state_version``: from ``cache`` when it
        holds that version, else from the store (and then into ``cache``)."""
        history = cache.get(base_state_version) if cache is not None else None
        if history is None:
            version, history = await self._store.context_messages(key, limit=self._settings.history_limit)
            if cache is not None:
                cache.put(version, history)
        summary = newest_summary(history)
        covered = summary.covers_through_seq if summary is not None else 0
        rest = tuple(m for m in history if m.seq > covered and m.source.kind not in ("summary", "notice"))
        budget = int(self._settings.context_window * CHARS_PER_TOKEN * 0.75)
        return self._build(key, base_state_version, runtime, budget, rest, summary, recovered=False, cache=cache)

    async def recover_after_overflow(self, prev: PreparedTurnInput) -> PreparedTurnInput:
        """The model said the prompt does not fit: rebuild with half the history budget."""
        return self._build(prev.session_key, prev.base_state_version, prev.runtime, prev.budget_chars // 2,
                           prev.history, prev.summary, recovered=True)

    async def with_summary(self, prev: PreparedTurnInput, summary: Summary) -> PreparedTurnInput:
        """The same input, starting from a fresh compaction summary (not persisted yet)."""
        rest = tuple(m for m in prev.history if m.seq > summary.covers_through_seq)
        return self._build(prev.session_key, prev.base_state_version, prev.runtime, prev.budget_chars,
                           rest, summary, recovered=prev.recovered)

    def _build(self, key: str, base_state_version: int, runtime: RuntimeContext, budget: int,
               rest: tuple[ChatMessage, ...], summary: Summary | None, *, recovered: bool,
               cache: ContextCache | None = None) -> PreparedTurnInput:
        convert = _to_llm if cache is None else lambda m: cache.converted(m, _to_llm)
        messages = assemble(self._settings.system_prompt, list(rest), runtime, budget, summary, convert)
        tokens = (len(self._settings.system_prompt) // CHARS_PER_TOKEN
                  + (estimate_tokens(summary.message()) if summary is not None else 0)
                  + sum(estimate_tokens(m) for m in rest))
        return PreparedTurnInput(key, messages, base_state_version, budget, runtime, recovered,
                                 rest, summary, tokens)


def newest_summary(history: list[ChatMessage]) -> Summary | None:
    for m in reversed(history):
        if m.source.kind == "summary":
            covers = m.source.extra.get("covers_through_seq")
            return Summary(m.content, int(covers) if isinstance(covers, int) else m.seq)
    return None


def assemble(system_prompt: str, history: list[ChatMessage], runtime: RuntimeContext,
             budget_chars: int, summary: Summary | None = None,
             convert: Callable[[ChatMessage], LLMMessage] | None = None) -> tuple[LLMMessage, ...]:
    """System prompt + the compaction summary (if any) + the newest history that fits ``budget_chars`` +
    runtime context on the last user message. The newest user message is always kept. ``convert`` turns
    a stored message into its model form (default: ``_to_llm``; a session's ContextCache memoises it)."""
    to_llm = convert or _to_llm
    converted = [to_llm(m) for m in history if m.source.kind not in ("notice", "summary")]
    kept: list[LLMMessage] = []
    head = (LLMMessage("system", system_prompt), *((summary.message(),) if summary is not None else ()))
    used = sum(len(m.content) for m in head)
    for msg in reversed(converted):
        size = len(msg.content)
        if msg.tool_calls:
            size += sum(len(tc.arguments) for tc in msg.tool_calls)
        if kept and used + size > budget_chars:
            break
        kept.append(msg)
        used += size
    kept.reverse()
    # A tool result must follow its assistant tool call; drop orphans left at the cut.
    while kept and kept[0].role == "tool":
        kept.pop(0)
    for i in range(len(kept) - 1, -1, -1):
        if kept[i].role == "user":
            m = kept[i]
            kept[i] = LLMMessage("user", f"{m.content}\n\n{runtime.block()}")
            break
    return (*head, *kept)


def _to_llm(m: ChatMessage) -> LLMMessage:
    if m.role == "assistant" and m.tool_calls:
        calls = tuple(LLMToolCall(tc.id, tc.name, tc.arguments) for tc in m.tool_calls)
        return LLMMessage("assistant", m.content, calls)
    if m.role == "tool":
        return LLMMessage("tool", m.content, tool_call_id=m.tool_call_id)
    role = m.role if m.role in ("user", "assistant") else "user"
    return LLMMessage(role, m.content)
