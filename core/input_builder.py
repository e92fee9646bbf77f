"""TurnInputBuilder: the one place that assembles what the model is sent for a turn.

System prompt first, then the session's context (trimmed to the window), with the runtime context
appended to the last user message as its own block. Overflow recovery reuses the same assembly with a
smaller budget, so the prompt and runtime context are attached exactly once either way.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from core.llm.provider import LLMMessage, LLMToolCall
from core.messages import ChatMessage
from core.settings import CoreSettings
from core.store import Store

CHARS_PER_TOKEN = 4
"""A deliberately rough estimate; the model's own overflow error is the backstop (one recovery)."""


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


class TurnInputBuilder:
    def __init__(self, store: Store, settings: CoreSettings) -> None:
        self._store = store
        self._settings = settings

    async def prepare(self, key: str, base_state_version: int, runtime: RuntimeContext) -> PreparedTurnInput:
        budget = int(self._settings.context_window * CHARS_PER_TOKEN * 0.75)
        return await self._build(key, base_state_version, runtime, budget, recovered=False)

    async def recover_after_overflow(self, prev: PreparedTurnInput) -> PreparedTurnInput:
        """The model said the prompt does not fit: rebuild with half the history budget."""
        return await self._build(prev.session_key, prev.base_state_version, prev.runtime, prev.budget_chars // 2,
                                 recovered=True)

    async def _build(self, key: str, base_state_version: int, runtime: RuntimeContext, budget: int, *,
                     recovered: bool) -> PreparedTurnInput:
        history = await self._store.context_messages(key, limit=self._settings.history_limit)
        messages = assemble(self._settings.system_prompt, history, runtime, budget)
        return PreparedTurnInput(key, messages, base_state_version, budget, runtime, recovered)


def assemble(system_prompt: str, history: list[ChatMessage], runtime: RuntimeContext,
             budget_chars: int) -> tuple[LLMMessage, ...]:
    """System prompt + the newest history that fits ``budget_chars`` + runtime context on the last user
    message. The newest user message is always kept."""
    converted = [_to_llm(m) for m in history if m.source.kind != "notice"]
    kept: list[LLMMessage] = []
    used = len(system_prompt)
    for msg in reversed(converted):
        size = len(msg.content) + sum(len(tc.arguments) for tc in msg.tool_calls)
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
    return (LLMMessage("system", system_prompt), *kept)


def _to_llm(m: ChatMessage) -> LLMMessage:
    if m.role == "assistant" and m.tool_calls:
        calls = tuple(LLMToolCall(tc.id, tc.name, tc.arguments) for tc in m.tool_calls)
        return LLMMessage("assistant", m.content, calls)
    if m.role == "tool":
        return LLMMessage("tool", m.content, tool_call_id=m.tool_call_id)
    role = m.role if m.role in ("user", "assistant") else "user"
    return LLMMessage(role, m.content)
