"""TurnInputBuilder: the one place that assembles what the model is sent for a turn.

System prompt first, then the session's context (trimmed to the window), with the runtime context
appended to the last user message as its own block. Overflow recovery reuses the same assembly with a
smaller budget, so the prompt and runtime context are attached exactly once either way.

Attachments (``core.media``) ride on their user message: documents and transcripts as text blocks after the
user's words, images as image parts while the model takes images (``VisionPolicy``) and they fit the budget,
newest first, and while the request's image bytes stay within ``MAX_IMAGE_BYTES``; an older image that no
longer fits, or whose file expired, is described in one line instead. The images of the newest user message
are always shown (when the model takes images): they are what the user is asking about. After a context
overflow (or a request over the server's size limit, HTTP 413) only those are shown.
"""

from __future__ import annotations

import dataclasses
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from core.context_cache import ContextCache
from core.envelope import ReplyTo
from core.llm.provider import LLMImage, LLMMessage, LLMToolCall
from core.media.describe import image_description, mention, with_blocks
from core.messages import AttachmentRef, ChatMessage
from core.settings import CoreSettings
from core.store import Store

CHARS_PER_TOKEN = 4
"""A deliberately rough estimate; the model's own overflow error is the backstop (one recovery). It is far off
for some scripts (a Chinese character costs a token or two, not a quarter of one): an overflow whose error
says by how much the request was over teaches the builder the session's share of the budget (``fitted``)."""
MAX_FITTED_SESSIONS = 10_000
"""Sessions whose learnt window is remembered (an int each; the least recently fitted go first)."""
IMAGE_CHARS = 6400
"""What an image costs in the budget: about 1,600 tokens, the most Anthropic charges for one (OpenAI's
high-detail images cost less)."""

MAX_IMAGE_BYTES = 20_000_000
"""The most image bytes one request carries (base64 makes 20 MB about 27 MB: under Anthropic's 32 MB request
limit and OpenAI's 50 MB). Older images past it are described; the newest user message's are always shown."""

ImageLoader = Callable[[AttachmentRef], Awaitable[LLMImage | None]]


def estimate_tokens(message: ChatMessage | LLMMessage) -> int:
    """About four characters per token, tool-call arguments and attachment text included."""
    chars = len(message.content)
    if message.tool_calls:
        chars += sum(len(tc.name) + len(tc.arguments) for tc in message.tool_calls)
    if isinstance(message, ChatMessage) and message.source.attachments:
        chars += sum(len(a.text or "") + 100 for a in message.source.attachments)
    return chars // CHARS_PER_TOKEN + 1


@dataclass(frozen=True, slots=True)
class Summary:
    """A compaction summary: it stands for every context message with seq <= ``covers_through_seq``.
    ``attachments`` are those of the messages it stands for: the fact that they existed is never dropped."""

    text: str
    covers_through_seq: int
    attachments: tuple[AttachmentRef, ...] = ()

    def message(self) -> LLMMessage:
        text = f"[Summary of the earlier conversation]\n{self.text}"
        if self.attachments:
            text += f"\n[Attachments the user sent in that part of the conversation: {mention(self.attachments)}]"
        return LLMMessage("user", text)


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
    window_chars: int | None = None
    """The characters of context the model's window holds, when an overflow taught it for this session
    (``TurnInputBuilder.recover_after_overflow``): compaction measures against it, and its summary request
    keeps to it."""


class TurnInputBuilder:
    def __init__(self, store: Store, settings: CoreSettings, *, images: ImageLoader | None = None,
                 vision: Callable[[], bool] | None = None) -> None:
        self._store = store
        self._settings = settings
        self._images = images
        self._vision = vision or (lambda: False)
        self._fitted: OrderedDict[str, int] = OrderedDict()
        """How many characters of a session's context the model's window holds, learnt from an overflow that
        said its size: later turns are built to fit it instead of overflowing again (each losing a request to
        it). Kept in this process."""

    def forget_window(self, key: str) -> None:
        """The session starts a new context (/new): what taught its window is no longer sent, so its turns are
        built to the full budget again (the next overflow, if any, teaches a new one)."""
        self._fitted.pop(key, None)

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
        fitted = self._fitted.get(key)
        if fitted is not None:
            budget = min(budget, int(fitted * 0.75))
        return await self._build(key, base_state_version, runtime, budget, rest, summary, recovered=False,
                                 cache=cache, window=fitted)

    async def recover_after_overflow(self, prev: PreparedTurnInput, window_share: float | None = None,
                                     refused: tuple[LLMMessage, ...] = ()) -> PreparedTurnInput:
        """The model said the prompt does not fit (or the request was over the server's size limit): rebuild
        with half the history budget, showing only the newest user message's images.

        When the error said how much of the prompt the window holds (``window_share``, from
        ``ProviderError.window_share``), the window is that share of the refused request's characters
        (``refused``: this input and the turn's requests so far, which are sent again after it): the input is
        rebuilt to fill three quarters of it with them, as ``prepare`` leaves room for the answer, and the
        session's later turns are built to fit the same window."""
        budget = prev.budget_chars // 2
        window = prev.window_chars
        if window_share is not None:
            sent = _chars(refused or prev.messages)
            window = int(sent * window_share)
            budget = max(1, min(budget, int(window * 0.75) - max(0, sent - _chars(prev.messages))))
            self._fitted[prev.session_key] = window
            self._fitted.move_to_end(prev.session_key)
            if len(self._fitted) > MAX_FITTED_SESSIONS:
                self._fitted.popitem(last=False)
        return await self._build(prev.session_key, prev.base_state_version, prev.runtime, budget,
                                 prev.history, prev.summary, recovered=True, window=window)

    async def with_summary(self, prev: PreparedTurnInput, summary: Summary) -> PreparedTurnInput:
        """The same input, starting from a fresh compaction summary (not persisted yet)."""
        rest = tuple(m for m in prev.history if m.seq > summary.covers_through_seq)
        return await self._build(prev.session_key, prev.base_state_version, prev.runtime, prev.budget_chars,
                                 rest, summary, recovered=prev.recovered, window=prev.window_chars)

    async def _build(self, key: str, base_state_version: int, runtime: RuntimeContext, budget: int,
                     rest: tuple[ChatMessage, ...], summary: Summary | None, *, recovered: bool,
                     cache: ContextCache | None = None, window: int | None = None) -> PreparedTurnInput:
        convert = _to_llm if cache is None else lambda m: cache.converted(m, _to_llm)
        shown: dict[int, tuple[AttachmentRef, ...]] = {}
        vision = self._images is not None and self._vision()
        messages = assemble(self._settings.system_prompt, list(rest), runtime, budget, summary, convert,
                            shown=shown if vision else None)
        if shown:
            messages = await self._with_images(messages, shown, 0 if recovered else MAX_IMAGE_BYTES)
        tokens = (len(self._settings.system_prompt) // CHARS_PER_TOKEN
                  + (estimate_tokens(summary.message()) if summary is not None else 0)
                  + sum(estimate_tokens(m) for m in rest))
        return PreparedTurnInput(key, messages, base_state_version, budget, runtime, recovered,
                                 rest, summary, tokens, window)

    async def _with_images(self, messages: tuple[LLMMessage, ...], shown: dict[int, tuple[AttachmentRef, ...]],
                           cap: int) -> tuple[LLMMessage, ...]:
        """Load the images ``assemble`` chose, newest first; one whose file is gone (expired) is described
        instead, and so is an older one past ``cap`` image bytes (the newest user message's are always shown)."""
        assert self._images is not None
        out = list(messages)
        newest_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=-1)
        total = 0
        for index in sorted(shown, reverse=True):
            images: list[LLMImage] = []
            missing: list[str] = []
            for ref in shown[index]:
                image = await self._images(ref)
                if image is None:
                    missing.append(image_description(ref, gone=True))
                elif index != newest_user and total + len(image.data) > cap:
                    missing.append(image.description)
                else:
                    total += len(image.data)
                    images.append(image)
            m = out[index]
            content = "\n\n".join(part for part in (m.content, *missing) if part)
            out[index] = dataclasses.replace(m, content=content, images=tuple(images))
        return tuple(out)


def _chars(messages: tuple[LLMMessage, ...]) -> int:
    """What ``assemble`` counts of a request: its texts and tool-call arguments, and ``IMAGE_CHARS`` an image
    (the error's token count includes the images: leaving them out would learn a window far too small)."""
    return sum(len(m.content) + sum(len(tc.arguments) for tc in m.tool_calls) + IMAGE_CHARS * len(m.images)
               for m in messages)


def summary_of(text: str, previous: Summary | None, messages: list[ChatMessage]) -> Summary:
    """A new summary standing for ``messages`` (and for what ``previous`` stood for)."""
    attachments = (*(previous.attachments if previous is not None else ()),
                   *(a for m in messages if m.source.kind != "summary" for a in m.source.attachments))
    return Summary(text, messages[-1].seq, attachments)


def newest_summary(history: list[ChatMessage]) -> Summary | None:
    for m in reversed(history):
        if m.source.kind == "summary":
            covers = m.source.extra.get("covers_through_seq")
            return Summary(m.content, int(covers) if isinstance(covers, int) else m.seq, m.source.attachments)
    return None


def assemble(system_prompt: str, history: list[ChatMessage], runtime: RuntimeContext,
             budget_chars: int, summary: Summary | None = None,
             convert: Callable[[ChatMessage], LLMMessage] | None = None, *,
             shown: dict[int, tuple[AttachmentRef, ...]] | None = None) -> tuple[LLMMessage, ...]:
    """System prompt + the compaction summary (if any) + the newest history that fits ``budget_chars`` +
    runtime context on the last user message. The newest user message is always kept. ``convert`` turns
    a stored message into its model form (default: ``_to_llm``; a session's ContextCache memoises it).

    Images: with ``shown`` (the model takes images), the images that fit the budget, newest first (those
    of the newest user message always), are recorded in it by the index of their message in the result,
    for the caller to load; every other image is described in its message's text."""
    to_llm = convert or _to_llm
    converted = [(m, to_llm(m)) for m in history if m.source.kind not in ("notice", "summary")]
    kept: list[LLMMessage] = []
    pictured: list[tuple[AttachmentRef, ...]] = []
    head = (LLMMessage("system", system_prompt), *((summary.message(),) if summary is not None else ()))
    used = sum(len(m.content) for m in head)
    newest_user = True
    for stored, msg in reversed(converted):
        size = len(msg.content)
        if msg.tool_calls:
            size += sum(len(tc.arguments) for tc in msg.tool_calls)
        if kept and used + size > budget_chars:
            break
        refs = stored.source.attachments
        images = tuple(a for a in refs if a.kind == "image" and not a.note) if refs and stored.role == "user" else ()
        chosen: tuple[AttachmentRef, ...] = ()
        if images and shown is not None:
            cost = IMAGE_CHARS * len(images)
            if newest_user or used + size + cost <= budget_chars:
                chosen = images
                size += cost
        if images and not chosen:
            words = "\n".join(image_description(a) for a in images)
            msg = dataclasses.replace(msg, content=f"{msg.content}\n\n{words}" if msg.content else words)
            size = len(msg.content)
        if stored.role == "user":
            newest_user = False
        kept.append(msg)
        pictured.append(chosen)
        used += size
    kept.reverse()
    pictured.reverse()
    # A tool result must follow its assistant tool call; drop orphans left at the cut. Without a summary before
    # it, the kept history also starts with a user message: an answer whose question was cut off tells the model
    # little, and some APIs and chat templates (Anthropic's, Gemma's, Mistral's) refuse a conversation that
    # starts with the assistant. The newest user message is kept, so one is always left.
    while kept and (kept[0].role == "tool" or (kept[0].role == "assistant" and summary is None
                                               and any(m.role == "user" for m in kept))):
        kept.pop(0)
        pictured.pop(0)
    for i in range(len(kept) - 1, -1, -1):
        if kept[i].role == "user":
            m = kept[i]
            kept[i] = dataclasses.replace(m, content=f"{m.content}\n\n{runtime.block()}" if m.content
                                          else runtime.block())
            break
    if shown is not None:
        shown.update({len(head) + i: refs for i, refs in enumerate(pictured) if refs})
    return (*head, *kept)


QUOTE_CHARS = 1000
"""How much of a replied-to message's text is kept with the reply (the model is shown it, cut with "…")."""


def quote_extra(reply: ReplyTo | None) -> dict[str, Any]:
    """What a user message stores of the message it replies to (``MessageSource.extra``): the quoted text, cut
    to ``QUOTE_CHARS``, and whose it is; nothing when the platform did not hand the text over."""
    if reply is None or not reply.text:
        return {}
    text = reply.text if len(reply.text) <= QUOTE_CHARS else reply.text[:QUOTE_CHARS].rstrip() + "…"
    author = "you" if reply.from_bot else reply.sender_name
    return {"quote": text, **({"quote_from": author} if author else {})}


def with_quote(content: str, extra: dict[str, Any]) -> str:
    """``content`` preceded by the line saying what it replies to (a user's reply to a message): "is that
    right?" means little to the model without it."""
    quote = extra.get("quote")
    if not isinstance(quote, str):
        return content
    author = extra.get("quote_from")
    whose = "your message" if author == "you" else (str(author) if author else "a message")
    return f'[In reply to {whose}: "{quote}"]\n{content}'


def _to_llm(m: ChatMessage) -> LLMMessage:
    if m.role == "assistant" and m.tool_calls:
        calls = tuple(LLMToolCall(tc.id, tc.name, tc.arguments) for tc in m.tool_calls)
        return LLMMessage("assistant", m.content, calls)
    if m.role == "tool":
        return LLMMessage("tool", m.content, tool_call_id=m.tool_call_id)
    role = m.role if m.role in ("user", "assistant") else "user"
    content = with_quote(m.content, m.source.extra) if m.source.kind == "user_input" else m.content
    if m.source.attachments:
        return LLMMessage(role, with_blocks(content, m.source.attachments))
    return LLMMessage(role, content)
