"""AgentLoop: the model requests and tool rounds of one turn.

Each model request is one round with its own MergeQueue. Producers: the stream driver (one request
through the retry ladder, assembling provider deltas into partial/complete messages), the approval
worker, and every allowed tool. The loop is the single consumer: it hands each event, in the queue's
total order, to ``emit`` (the TurnController and the trace) and records tool outputs as they arrive;
the queue calls it from the producer's task, so a streamed token costs no extra task switch.
A round with tool calls ends when its stream, its approvals and its tools are all done; the next
request then carries the outputs in call order. ``max_turns`` bounds the requests of one user message.

A reply cut off before the model finished it (its output limit, a content filter: ``CUT_OFF``) may end inside
a tool call. Such a call is not what the model meant (an empty or half-written argument list), so it is neither
run nor offered for approval: it gets one failed output saying so, and the turn ends there with the cut-off
notice. Asking the model again would only have it write the same long call into the same limit.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from core.agent.approvals import MAX_TOOLS_AT_ONCE, ApprovalBroker, ApprovalGate
from core.agent.events import (
    CompleteReasoning,
    CompleteText,
    CompleteToolCall,
    Forwarded,
    Notice,
    PartialReasoning,
    PartialText,
    PartialToolCall,
    PartialToolOutput,
    RequestBegin,
    RequestEnd,
    RequestStatus,
    SessionMeta,
    SubagentEnded,
    TokenUsage,
    ToolOutput,
    TurnEvent,
)
from core.agent.merge_queue import MergeQueue, Spawn
from core.cancel_signal import CancelSignal
from core.llm.provider import (
    LLMMessage,
    LLMProvider,
    LLMRequest,
    LLMToolCall,
    ProviderError,
    ProviderErrorKind,
    ProviderEvent,
    ReasoningDelta,
    StreamEnd,
    TextDelta,
    ToolCallDelta,
    Usage,
    has_images,
    without_images,
)
from core.llm.retry import retry_policy
from core.llm.silence import bounded
from core.media.vision import says_no_vision
from core.retrying import run_with_retries
from core.settings import CoreSettings
from core.text import sound_text
from core.tools.base import ToolContext, ToolRegistry

log = logging.getLogger(__name__)

MAX_TOOL_OUTPUT_CHARS = 16_000
EMPTY_TOOL_OUTPUT = "[no output]"
ABORTED_TOOL_OUTPUT = "Tool call aborted: the user stopped the turn before it finished."
NOT_RUN_TOOL_OUTPUT = "Tool call denied: the user stopped the turn before it ran; it was not run."
"""The output of a call the stop left waiting (for approval, behind one, or for a slot to run in): it never
started."""
FAILED_TOOL_OUTPUT = "Tool call aborted: the turn failed (an error, not the user) before it finished."
NOT_RUN_FAILED_TOOL_OUTPUT = "Tool call not run: the turn failed (an error, not the user) before it ran."
"""The outputs of calls a failure (the model's stream, the loop) cut off or left waiting: the model must not be
told that the user stopped them."""


def normalize_output(text: str, limit: int = MAX_TOOL_OUTPUT_CHARS) -> str:
    """Empty output becomes '[no output]'; output over ``limit`` keeps its head and says what was cut.
    Every tool output enters the turn here, so this is where it is made sound (``core.text``)."""
    text = sound_text(text)
    if not text.strip():
        return EMPTY_TOOL_OUTPUT
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n[… {len(text) - limit} more characters truncated]"


@dataclass(slots=True)
class Round:
    """What one model request produced: its text, its committed tool calls and their outputs."""

    request_no: int
    calls: list[CompleteToolCall] = field(default_factory=list)
    outputs: dict[str, ToolOutput] = field(default_factory=dict)
    pieces: list[str] = field(default_factory=list)
    """The answer text of the current attempt, as streamed (joined on demand: linear in its length)."""
    subagents: dict[str, SubagentEnded] = field(default_factory=dict)
    """The child session each ``run_subagent`` call of this round ran, by call id (kept with its result)."""
    finish_reason: str | None = None
    """Why the model stopped writing (``StreamEnd``): "stop", "length", "content_filter", …"""
    started: set[str] = field(default_factory=set)
    """The calls whose tool was started (allowed, and run): one without an output was cut off while running."""
    failed: bool = False
    """The round was ended by a failure (not by a stop): what its calls lack is the failure's doing."""
    cut: set[str] = field(default_factory=set)
    """The calls the reply's cut-off left incomplete (``cut_call_output``): not run, and the turn ends here."""

    @property
    def text(self) -> str:
        if len(self.pieces) > 1:
            self.pieces[:] = ["".join(self.pieces)]
        return self.pieces[0] if self.pieces else ""

    def output_for(self, call_id: str) -> str:
        """The call's output; for one the stop (or a failure) left without any, whether it was cut off while
        running or never started (left waiting for approval or a slot: the stop denied it)."""
        out = self.outputs.get(call_id)
        if out is not None:
            return out.output
        if self.failed:
            return FAILED_TOOL_OUTPUT if call_id in self.started else NOT_RUN_FAILED_TOOL_OUTPUT
        return ABORTED_TOOL_OUTPUT if call_id in self.started else NOT_RUN_TOOL_OUTPUT

    def messages(self) -> list[LLMMessage]:
        """The round as model context: the assistant's calls, then one output per call in call order."""
        if not self.calls:
            return [LLMMessage("assistant", self.text)] if self.text else []
        calls = tuple(LLMToolCall(c.call_id, c.name, c.arguments) for c in self.calls)
        return [LLMMessage("assistant", self.text, calls),
                *(LLMMessage("tool", self.output_for(c.call_id), tool_call_id=c.call_id) for c in self.calls)]


CUT_OFF = {"length": "it reached the model's output limit",
           "model_context_window_exceeded": "the conversation filled the model's context window",
           "content_filter": "the provider's content filter stopped it",
           "refusal": "the model declined to go on"}
"""Stop reasons that end an answer before the model finished it, and how the notice words each."""


def cut_off_reason(finish_reason: str | None, max_output_tokens: int | None = None) -> str | None:
    """Why an answer ended before the model finished it; None when it finished."""
    why = CUT_OFF.get(finish_reason or "")
    if why is not None and finish_reason == "length" and max_output_tokens is not None:
        why += f" (max_output_tokens = {max_output_tokens})"
    return why


def cut_off_notice(finish_reason: str | None, max_output_tokens: int | None) -> str | None:
    """The notice after an answer the model did not finish (None when it finished): the chat and the history
    say that the text above it is not the whole answer."""
    why = cut_off_reason(finish_reason, max_output_tokens)
    return None if why is None else f"The answer was cut off: {why}. Send another message to continue."


def cut_call_output(finish_reason: str | None, max_output_tokens: int | None) -> str | None:
    """The one output of a call still incomplete when the reply was cut off (None when it was not): the model
    is told the call was not run, and why."""
    why = cut_off_reason(finish_reason, max_output_tokens)
    return None if why is None else f"Tool call not run: the reply was cut off before this call was complete; {why}."


def request_status(err: ProviderError) -> RequestStatus:
    if err.kind is ProviderErrorKind.TIMEOUT:
        return "timeout"
    if err.kind is ProviderErrorKind.MALFORMED:
        return "malformed"
    if err.kind is ProviderErrorKind.AUTH:
        return "auth"
    return "failed"


Recover = Callable[[ProviderError, tuple[LLMMessage, ...]], Awaitable[tuple[LLMMessage, ...]]]
"""Rebuilds a turn's base input after a context overflow, given the error and the refused request."""


class AgentLoop:
    def __init__(self, *, provider: LLMProvider, tools: ToolRegistry, broker: ApprovalBroker,
                 settings: CoreSettings, session_key: str, turn_id: str, requested_by: str | None,
                 emit: Callable[[TurnEvent], None], spawn: Spawn, depth: int = 0,
                 on_model_retry: Callable[[], None] | None = None,
                 images_rejected: Callable[..., None] | None = None,
                 cancel: CancelSignal | None = None) -> None:
        self._provider = provider
        self._tools = tools
        self._broker = broker
        self._settings = settings
        self._key = session_key
        self._turn_id = turn_id
        self._requested_by = requested_by
        self._emit = emit
        self._spawn = spawn
        self._depth = depth
        self._cancel = cancel
        self._images_rejected = images_rejected
        self._on_model_retry = on_model_retry
        self.rounds: list[Round] = []
        self.notice: str | None = None
        """Set when the loop stopped on max_turns, or the last answer was cut off (the notice the user saw)."""
        self._can_recover = False
        """Whether a context overflow of the current request is met by rebuilding the input (``run``)."""
        self._used_ids: set[str] = set()
        """The tool call ids of the context and of this turn (``_unique_call_id``)."""

    async def run(self, base: tuple[LLMMessage, ...],
                  recover: Recover | None = None) -> None:
        """Run requests until the model answers without tool calls (or max_turns). ProviderError propagates
        (after at most one overflow recovery through ``recover``, which rebuilds the base context; it is given
        the overflow error, whose wording may say by how much the request was over, and the refused request).

        A request with images that the model refuses (a 400) is made again with images described in words:
        first those before the newest message with images (an older unreadable image; the user's new photo still
        shown), then all of them; the descriptions stay with this request. When one is taken,
        ``images_rejected(session_key, unsupported=...)`` is told (the vision policy: ``unsupported`` when the
        error said the model takes no images at all, ``core.media.vision.says_no_vision``). A request with
        images still too large after the overflow recovery is made once more with them all described."""
        recovered = False
        described = 0  # 1: the images before the newest message with images are described; 2: all are
        refused: ProviderError | None = None  # the first refusal of a request with images (a 400)
        self._note_ids(base)
        while True:
            request_no = len(self.rounds) + 1
            messages = base + tuple(m for r in self.rounds for m in r.messages())
            rnd = Round(request_no)
            self._can_recover = not recovered and recover is not None
            try:
                await self._request(rnd, messages)
            except ProviderError as exc:
                if self._recovers(exc, rnd) and recover is not None:
                    recovered = True
                    log.info("context overflow in %s; rebuilding the input once", self._key)
                    base = await recover(exc, messages)
                    self._note_ids(base)
                    base = _describe(base, described)
                    continue
                if described < 2 and has_images(messages) and not rnd.calls and not rnd.text and (
                        exc.kind is ProviderErrorKind.BAD_REQUEST
                        or (exc.kind is ProviderErrorKind.CONTEXT_OVERFLOW and recovered)):
                    if exc.kind is ProviderErrorKind.BAD_REQUEST and refused is None:
                        refused = exc
                    no_vision = says_no_vision(exc.detail)
                    described = 2 if described or no_vision or not _older_images(base) else 1
                    log.info("the model refused a request with images in %s (%s); asking again with %s images "
                             "described", self._key, exc, "all" if described == 2 else "the older")
                    base = _describe(base, described)
                    continue
                if rnd.calls or rnd.text:
                    rnd.failed = True
                    self.rounds.append(rnd)
                raise
            except BaseException as exc:
                if rnd.calls or rnd.text:
                    rnd.failed = not isinstance(exc, asyncio.CancelledError)
                    self.rounds.append(rnd)  # abort: what was committed enters the next context
                raise
            self.rounds.append(rnd)
            if refused is not None and self._images_rejected is not None:
                # the same request with images described was taken: they were the problem
                self._images_rejected(self._key, unsupported=says_no_vision(refused.detail))
                self._images_rejected = None
            if not rnd.calls or rnd.cut:  # a cut call is not asked for again: the limit would cut it again
                cut = cut_off_notice(rnd.finish_reason, self._settings.max_output_tokens)
                if cut is not None:
                    self.notice = cut
                    self._emit(Notice(cut))
                return
            if request_no >= self._settings.max_turns:
                self.notice = (f"I stopped after {request_no} model requests for this message (the limit is "
                               f"max_turns = {self._settings.max_turns}). Send another message to continue.")
                self._emit(Notice(self.notice))
                return

    def _note_ids(self, messages: tuple[LLMMessage, ...]) -> None:
        for m in messages:
            self._used_ids.update(c.id for c in m.tool_calls)
            if m.tool_call_id is not None:
                self._used_ids.add(m.tool_call_id)

    def _unique_call_id(self, call_id: str) -> str:
        """``call_id``, or a new id for the call when the provider repeated one already used in this session.

        Some providers and servers number their calls per response ("call_0") and so repeat ids across requests
        and turns. An approval is decided by (session, call id): a button of an earlier request still shown
        somewhere (another device, a failed update) would then decide a later, different call. So a repeated id
        (in the context, in this turn, or asked for approval in this session by this process: ``/new`` and
        compaction drop old calls from the context, not their buttons from the chat) is replaced here, before
        anything shows it, by one made unique with this turn's id. Everything after uses it: the events, the
        approval, the stored history and what the model is sent back (the model only needs the ids of a call
        and of its output to agree). Ids the provider did not repeat are kept as they are."""
        used = self._used_ids
        asked = self._broker.asked(self._key)
        if call_id in used or call_id in asked:
            base = f"{call_id}_{self._turn_id[:8]}"
            candidate, n = base, 1
            while candidate in used or candidate in asked:
                n += 1
                candidate = f"{base}_{n}"
            log.info("the model repeated tool call id %r in %s; using %r", call_id, self._key, candidate)
            call_id = candidate
        used.add(call_id)
        return call_id

    def _recovers(self, err: ProviderError, rnd: Round) -> bool:
        """Whether ``run`` makes the request again on a rebuilt input after ``err`` (what it streamed is then
        taken back, as before a retry)."""
        return err.kind is ProviderErrorKind.CONTEXT_OVERFLOW and self._can_recover and not rnd.calls

    # ---- one request ---------------------------------------------------------------------------

    async def _request(self, rnd: Round, messages: tuple[LLMMessage, ...]) -> None:
        emit = self._emit

        def consume(event: TurnEvent) -> None:
            if event.partial:  # a streamed fragment (most events): nothing of the round to record
                emit(event)
                return
            if isinstance(event, ToolOutput):
                rnd.outputs[event.call_id] = event
            elif isinstance(event, SubagentEnded):
                rnd.subagents[event.call_id] = event
            elif isinstance(event, Forwarded) and isinstance(event.event, SessionMeta) and len(event.origin) == 1:
                # a child began: until it reports how it ended, a stop of this turn is how it ends
                meta = event.event
                rnd.subagents[meta.call_id] = SubagentEnded(meta.call_id, meta.session_key, meta.profile, meta.task,
                                                            "cancelled", "stopped")
            emit(event)

        queue: MergeQueue[TurnEvent] = MergeQueue(consume, self._spawn)
        slots = asyncio.Semaphore(MAX_TOOLS_AT_ONCE)

        def start_tool(call: CompleteToolCall) -> None:
            queue.add_producer(f"turn:{self._turn_id}:tool:{call.call_id}", self._execute(call, queue, rnd, slots))

        gate = ApprovalGate(queue=queue, tools=self._tools, broker=self._broker, session_key=self._key,
                            requested_by=self._requested_by, timeout=self._settings.approval_timeout,
                            start_tool=start_tool)
        request = LLMRequest(messages=messages, tools=self._tools.specs(),
                             max_tokens=self._settings.max_output_tokens, temperature=self._settings.temperature,
                             model=self._settings.model)
        queue.add_producer(f"turn:{self._turn_id}:model", self._drive(rnd, request, queue, gate))
        try:
            await queue.join()
        finally:
            await queue.cancel()  # abort or failure: stop the stream, the approvals and running tools

    async def _drive(self, rnd: Round, request: LLMRequest, queue: MergeQueue[TurnEvent],
                     gate: ApprovalGate) -> None:
        """The stream producer: one model request through the retry ladder."""
        attempt_no = 0
        usage: Usage | None = None

        async def on_retry(err: ProviderError, attempt: int, sleep: float) -> None:
            if self._on_model_retry is not None:
                self._on_model_retry()
            queue.push(RequestEnd(request_status(err), attempt, sleep))

        async def one_attempt() -> bool:
            """One try of the request; True when it ended early keeping calls that already ran."""
            nonlocal attempt_no, usage
            attempt_no += 1
            rnd.pieces.clear()
            queue.push(RequestBegin(rnd.request_no, attempt_no))
            asm = _Assembler(queue.push, rnd, gate, f"call_{self._turn_id[:8]}_{rnd.request_no}",
                             self._unique_call_id, self._used_ids.discard)
            try:
                async for event in bounded(self._provider.stream(request), self._settings.request_timeout):
                    asm.feed(event)
            except ProviderError as err:
                asm.abandon()
                if rnd.calls and err.retryable:
                    # Calls already run: keep them, end this request here; the next one continues.
                    queue.push(RequestEnd(request_status(err), attempt_no))
                    return True
                raise
            asm.finish(cut_call_output(asm.finish_reason, self._settings.max_output_tokens))
            usage = asm.usage
            rnd.finish_reason = asm.finish_reason
            return False

        try:
            ended_early = await run_with_retries(
                lambda: retry_policy(self._settings.retry_delays, on_retry=on_retry), one_attempt)
        except ProviderError as err:
            # a request made again on a rebuilt input (a context overflow) takes back what it streamed
            queue.push(RequestEnd(request_status(err), attempt_no, 0.0 if self._recovers(err, rnd) else None))
            raise
        if ended_early:
            return
        if usage is not None:
            queue.push(TokenUsage(usage.prompt_tokens, usage.completion_tokens))
        queue.push(RequestEnd("completed", attempt_no))

    async def _execute(self, call: CompleteToolCall, queue: MergeQueue[TurnEvent], rnd: Round,
                       slots: asyncio.Semaphore) -> None:
        """A tool producer: runs one allowed call; whatever happens, the call gets exactly one output.
        Built-in tools return their whole text at once, so the output's fragments come at completion.

        At most ``MAX_TOOLS_AT_ONCE`` tools of a round run at once (``slots``); the others wait for a slot, and
        count as started only once they have one (one stopped while it waited was not run)."""
        status: str = "done"
        tool = self._tools.get(call.name)
        async with slots:
            rnd.started.add(call.call_id)
            try:
                if tool is None:
                    raise LookupError(f"no tool named {call.name!r}")
                args = json.loads(call.arguments) if call.arguments.strip() else {}
                if not isinstance(args, dict):
                    raise ValueError("arguments must be a JSON object")
                text = await tool.run(args, ToolContext(self._key, self._turn_id, call.call_id, self._requested_by,
                                                        self._depth, queue.push, self._cancel))
                text = normalize_output(str(text))
            except Exception as exc:
                status = "failed"
                text = normalize_output(f"Tool failed: {type(exc).__name__}: {exc}")
        queue.push(PartialToolOutput("start", call.call_id))
        queue.push(PartialToolOutput("delta", call.call_id, text))
        queue.push(PartialToolOutput("stop", call.call_id))
        queue.push(ToolOutput(call.call_id, call.name, text, "done" if status == "done" else "failed"))


@dataclass(slots=True)
class _CallBuffer:
    index: int
    call_id: str
    name: str
    arguments: str = ""


class _Assembler:
    """Turns one attempt's provider deltas into partial/complete events. Text and reasoning segments
    close when another kind of content starts. A tool call completes as soon as its arguments parse as
    a JSON object (a closed object cannot grow into another valid one), so its approval and execution
    start while the stream goes on, even when a server interleaves the fragments of parallel calls;
    anything still open completes when the stream ends (``finish``), unless the reply was cut off."""

    def __init__(self, push: Callable[[TurnEvent], None], rnd: Round, gate: ApprovalGate, id_prefix: str,
                 unique: Callable[[str], str] = str, unused: Callable[[str], None] = lambda _: None) -> None:
        """``unique`` gives a new call its id (``AgentLoop._unique_call_id``); ``unused`` takes back the id of a
        call the failed attempt abandoned (its retry streams it again)."""
        self._push = push
        self._rnd = rnd
        self._gate = gate
        self._id_prefix = id_prefix
        self._unique = unique
        self._unused = unused
        self._segment: str | None = None  # "text" | "reasoning"
        self._parts: list[str] = []
        self._calls: dict[int, _CallBuffer] = {}
        self._done: set[int] = set()
        self.usage: Usage | None = None
        self.finish_reason: str | None = None

    def feed(self, event: ProviderEvent) -> None:
        if isinstance(event, TextDelta):
            if event.text:
                if self._segment != "text":
                    self._open("text")
                self._parts.append(event.text)
                self._rnd.pieces.append(event.text)
                self._push(PartialText("delta", event.text))
        elif isinstance(event, ReasoningDelta):
            if event.text:
                self._open("reasoning")
                self._parts.append(event.text)
                self._push(PartialReasoning("delta", event.text))
        elif isinstance(event, ToolCallDelta):
            self._close_segment()
            self._tool_delta(event)
        elif isinstance(event, Usage):
            self.usage = event
        elif isinstance(event, StreamEnd):
            self.finish_reason = event.finish_reason

    def finish(self, cut: str | None = None) -> None:
        """The stream ended. ``cut``: the output for calls still open when the reply was cut off
        (``cut_call_output``); their arguments are not whole (an empty list may be an unwritten one), so each
        is committed with that as its one output, and is neither run nor offered for approval."""
        self._close_segment()
        for index in sorted(self._calls):
            self._complete(index, cut)

    def abandon(self) -> None:
        """The attempt failed: close open fragments (stop) without a complete message."""
        if self._segment == "text":
            self._push(PartialText("stop"))
        elif self._segment == "reasoning":
            self._push(PartialReasoning("stop"))
        self._segment = None
        for buf in self._calls.values():
            self._push(PartialToolCall("stop", buf.call_id, buf.name))
            self._unused(buf.call_id)
        self._calls.clear()

    def _open(self, kind: str) -> None:
        if self._segment == kind:
            return
        self._close_segment()
        for index in sorted(self._calls):
            self._complete(index)
        self._segment = kind
        self._parts = []
        self._push(PartialText("start") if kind == "text" else PartialReasoning("start"))

    def _close_segment(self) -> None:
        if self._segment is None:
            return
        whole = "".join(self._parts)
        if self._segment == "text":
            self._push(PartialText("stop"))
            self._push(CompleteText(whole))
        else:
            self._push(PartialReasoning("stop"))
            self._push(CompleteReasoning(whole))
        self._segment = None
        self._parts = []

    def _tool_delta(self, event: ToolCallDelta) -> None:
        if event.index in self._done:
            if event.arguments.strip():
                log.warning("ignoring a fragment for tool call %d after its arguments were complete", event.index)
            return
        buf = self._calls.get(event.index)
        if buf is None:
            buf = _CallBuffer(event.index, self._unique(event.id or f"{self._id_prefix}_{event.index}"),
                              event.name or "")
            self._calls[event.index] = buf
            self._push(PartialToolCall("start", buf.call_id, buf.name))
        elif event.name and not buf.name:
            buf.name = event.name
        if event.arguments:
            buf.arguments += event.arguments
            self._push(PartialToolCall("delta", buf.call_id, buf.name, event.arguments))
            if _is_json_object(buf.arguments):
                self._complete(event.index)

    def _complete(self, index: int, cut: str | None = None) -> None:
        buf = self._calls.pop(index)
        self._done.add(index)
        self._push(PartialToolCall("stop", buf.call_id, buf.name))
        call = CompleteToolCall(buf.call_id, buf.name, buf.arguments)
        self._push(call)
        self._rnd.calls.append(call)
        if cut is None:
            self._gate.submit(call)
        else:
            self._rnd.cut.add(call.call_id)
            self._push(ToolOutput(call.call_id, call.name, cut, "failed"))


def _older_images(messages: tuple[LLMMessage, ...]) -> bool:
    """Whether a message before the newest one with images has images too."""
    return sum(1 for m in messages if m.images) > 1


def _describe(messages: tuple[LLMMessage, ...], step: int) -> tuple[LLMMessage, ...]:
    """``messages`` with images described: none (step 0), all but the newest message's (1), all (2)."""
    if step >= 2:
        return without_images(messages)
    if step == 1:
        newest = max(i for i, m in enumerate(messages) if m.images) if has_images(messages) else -1
        return tuple(m if i == newest else m.described() for i, m in enumerate(messages))
    return messages


def _is_json_object(text: str) -> bool:
    if not text.rstrip().endswith("}"):
        return False  # cheap pre-check: most fragments end mid-object
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
