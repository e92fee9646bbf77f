"""Approvals at the edges: a press in the instant of /stop, what the model is told about calls a stop left
unstarted, a request the chat could not show, and a model that repeats tool call ids.

Each race is forced, not waited for: a decision and the stop are made in the same loop step (no await
between them), tools are held on events, and every wait is bounded.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from channels.common.calls import CallPolicy, Calls
from channels.common.errors import PlatformError
from channels.common.ledger import Part
from channels.common.live_sink import LiveSettings, LiveSink
from channels.common.ops import Capabilities, PlainRenderer
from channels.common.throttle import Scope, Throttle
from core.agent.approvals import DENIED_BY_USER, DENIED_UNSHOWN
from core.agent.deciders import DecideResult
from core.agent.events import ApprovalRequested, Forwarded, SessionMeta
from core.agent.loop import ABORTED_TOOL_OUTPUT, NOT_RUN_TOOL_OUTPUT
from core.agent.merge_queue import MergeQueue
from core.controller import TurnController
from core.envelope import TurnTarget
from core.llm.provider import LLMToolSpec
from core.snapshot import ApprovalRequest
from core.tools.base import ApprovalPolicy, ToolContext, ToolRegistry
from tests.fakes.openai_server import Function, Text, ToolCalls
from tests.support.channel import TestChannel
from tests.support.harness import Harness, make_harness
from tests.support.subagents import CHILD_WORDS, COUNTER, FINAL, counter_route, first_user_text
from tests.support.tools import QUERY, SpecTool

ASK_LOOKUP = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_S1"])


class HeldTool(SpecTool):
    """A tool that records when it starts and runs until ``release`` is set."""

    def __init__(self, name: str = "lookup", result: str = "42 apples", approval: ApprovalPolicy = "ask",
                 *, held: bool = True) -> None:
        super().__init__(LLMToolSpec(name, f"the {name} test tool", QUERY), approval)
        self.result = result
        self.started: list[dict[str, Any]] = []
        self.finished: list[dict[str, Any]] = []
        self.release = asyncio.Event()
        if not held:
            self.release.set()

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        self.started.append(arguments)
        await self.release.wait()
        self.finished.append(arguments)
        return self.result


def registry(*tools: HeldTool) -> ToolRegistry:
    reg = ToolRegistry(default_policy="ask")
    reg.extend(tools)
    return reg


def session_key(h: Harness) -> str:
    return h.channel.envelope("x").key()


def tool_messages(request: dict[str, Any]) -> dict[str, str]:
    """The tool outputs a model request carries, by call id."""
    return {m["tool_call_id"]: m["content"] for m in request["messages"] if m.get("role") == "tool"}


def called_ids(request: dict[str, Any]) -> list[str]:
    return [c["id"] for m in request["messages"] if m.get("role") == "assistant" for c in m.get("tool_calls") or ()]


async def stored_tool_outputs(h: Harness, key: str) -> dict[str | None, str]:
    _, history = await h.core.history(key)
    return {m.tool_call_id: m.content for m in history if m.role == "tool"}


async def a_few_loop_steps(n: int = 20) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


# ---- H1: a press in the instant of /stop --------------------------------------------------------------------


async def test_a_press_after_the_stop_signal_in_the_same_step_is_not_pending_and_runs_nothing(tmp_path, fake_openai):
    tool = HeldTool()
    fake_openai.script(ASK_LOOKUP, Text("after"))
    h = await make_harness(tmp_path, fake_openai, tools=registry(tool))
    key = session_key(h)
    try:
        await h.say("apples?")
        await h.wait_for(lambda: h.core.approvals.pending(key) == ["call_S1"])
        await h.store.bump_generation(key)  # SessionManager.stop, step 1
        h.core.sessions.cancel_running(key)  # step 2: the cancel signal is set ...
        # ... and a press is handled before the turn's task has run its cancellation (no await in between)
        answer = h.core.decide(key, "call_S1", "allow", decided_by="u1", channel="test")
        assert answer is DecideResult.NOT_PENDING  # the channel answers "no longer pending"
        await h.settle()
        tool.release.set()
        await a_few_loop_steps()
        assert tool.started == []
        assert h.platform.visible("c1")[-1].endswith("⏹ Stopped.")
        assert (await stored_tool_outputs(h, key))["call_S1"] == NOT_RUN_TOOL_OUTPUT
    finally:
        await h.core.shutdown()


async def test_a_press_decided_in_the_same_step_as_the_stop_never_starts_the_tool(tmp_path, fake_openai):
    """The press lands first, the stop in the same step: on 3.11 ``wait_for`` hands the gate the decision
    although its task is being cancelled. The tool must not start after the round was given up."""
    tool = HeldTool()
    fake_openai.script(ASK_LOOKUP, Text("after"))
    h = await make_harness(tmp_path, fake_openai, tools=registry(tool))
    key = session_key(h)
    try:
        await h.say("apples?")
        await h.wait_for(lambda: h.core.approvals.pending(key) == ["call_S1"])
        await h.store.bump_generation(key)
        assert h.core.decide(key, "call_S1", "allow", decided_by="u1", channel="test") is DecideResult.DECIDED
        h.core.sessions.cancel_running(key)  # the same step
        await h.settle()
        await a_few_loop_steps()
        assert tool.started == [], "the tool was started after the stop, outside the turn"
        tool.release.set()
        await a_few_loop_steps()
        assert tool.finished == []
        assert h.platform.visible("c1")[-1].endswith("⏹ Stopped.")
        assert (await stored_tool_outputs(h, key))["call_S1"] == NOT_RUN_TOOL_OUTPUT
    finally:
        tool.release.set()
        await h.core.shutdown()


async def test_a_press_on_a_subagents_request_after_the_stop_signal_is_not_pending(tmp_path, fake_openai):
    tool = HeldTool()
    fake_openai.default = Function(counter_route)
    h = await make_harness(tmp_path, fake_openai, tools=registry(tool), subagents=COUNTER)
    key = session_key(h)
    try:
        await h.say("count the apples")
        await h.wait_for(lambda: any(k != key for k, _ in h.core.approvals._pending))
        [(child, call_id)] = list(h.core.approvals._pending)
        origin = (child,)
        await h.store.bump_generation(key)
        h.core.sessions.cancel_running(key)  # the parent's stop: the child's own stop comes a few steps later
        answer = h.core.decide(key, call_id, "allow", decided_by="u1", channel="test", origin=origin)
        assert answer is DecideResult.NOT_PENDING
        await h.settle()
        tool.release.set()
        await a_few_loop_steps()
        assert tool.started == []
        assert (await stored_tool_outputs(h, child))[call_id] == NOT_RUN_TOOL_OUTPUT
    finally:
        tool.release.set()
        await h.core.shutdown()


async def test_a_closed_merge_queue_takes_no_producer():
    ran: list[str] = []
    queue: MergeQueue[str] = MergeQueue(lambda item: None,
                                        lambda name, coro: asyncio.get_running_loop().create_task(coro))

    async def producer() -> None:
        ran.append("ran")

    await queue.cancel()
    late = producer()
    assert queue.add_producer("late", late) is None
    await a_few_loop_steps()
    assert ran == []
    assert late.cr_frame is None  # closed, not left to warn that it was never awaited


# ---- M1: what the model is told about calls a stop left unstarted -------------------------------------------


async def test_a_call_stopped_while_waiting_for_approval_reads_as_not_run(tmp_path, fake_openai):
    tool = HeldTool()
    fake_openai.script(ASK_LOOKUP, Text("second answer"))
    h = await make_harness(tmp_path, fake_openai, tools=registry(tool))
    key = session_key(h)
    try:
        await h.say("apples?")
        await h.wait_for(lambda: h.core.approvals.pending(key) == ["call_S1"])
        assert await h.core.stop(key)
        await h.settle()
        await h.say("again?")
        await h.settle()
        assert tool_messages(fake_openai.requests[-1]) == {"call_S1": NOT_RUN_TOOL_OUTPUT}
        assert "stopped the turn" in NOT_RUN_TOOL_OUTPUT and "not run" in NOT_RUN_TOOL_OUTPUT
        assert (await stored_tool_outputs(h, key))["call_S1"] == NOT_RUN_TOOL_OUTPUT
        assert tool.started == []
    finally:
        await h.core.shutdown()


async def test_a_call_stopped_while_running_still_reads_as_aborted(tmp_path, fake_openai):
    tool = HeldTool(approval="auto")
    fake_openai.script(ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_R1"]), Text("second answer"))
    h = await make_harness(tmp_path, fake_openai, tools=registry(tool))
    key = session_key(h)
    try:
        await h.say("apples?")
        await h.wait_for(lambda: tool.started)
        assert await h.core.stop(key)
        await h.settle()
        await h.say("again?")
        await h.settle()
        assert tool_messages(fake_openai.requests[-1]) == {"call_R1": ABORTED_TOOL_OUTPUT}
    finally:
        tool.release.set()
        await h.core.shutdown()


# ---- H4: a request the chat could not show -------------------------------------------------------------------


class Chat:
    capabilities = Capabilities(limit=None)
    scopes = (Scope("chat", 0.0),)

    def __init__(self) -> None:
        self.shown: dict[str, str] = {}

    async def send(self, part: Part, key: str) -> str:
        mid = str(len(self.shown) + 1)
        self.shown[mid] = part.text
        return mid

    async def edit(self, message_id: str, part: Part) -> None:
        self.shown[message_id] = part.text

    async def delete(self, message_id: str) -> None:
        self.shown.pop(message_id, None)

    async def typing(self) -> None:
        return None

    def stream(self) -> None:
        return None


class BrokenPrompts:
    """Approval prompts whose post fails (as after the call policy's retries)."""

    def __init__(self) -> None:
        self.posted: list[ApprovalRequest] = []
        self.unsure = False
        """Fail as a post that may have been carried out (no answer in time)."""

    async def post(self, session_key: str, request: ApprovalRequest) -> Any:
        self.posted.append(request)
        if self.unsure:
            raise PlatformError("no answer within 10s", kind="transient", outcome_unknown=True)
        raise PlatformError("Bad Gateway", kind="transient")

    async def ended(self, handle: Any, line: str) -> None:
        raise AssertionError("nothing was posted, nothing to mark")


class PromptingChannel(TestChannel):
    """A channel on the shared live sink, with approval prompts."""

    def __init__(self) -> None:
        super().__init__("prompting")
        self.chat = Chat()
        self.prompts = BrokenPrompts()

    async def open_sink(self, target: TurnTarget) -> LiveSink:  # type: ignore[override]
        def spawn(name: str, coro: Any) -> asyncio.Task[None]:
            return asyncio.get_running_loop().create_task(coro, name=f"sink:{name}")

        return LiveSink(self.chat, PlainRenderer(), Calls(Throttle(), CallPolicy(timeout=None)),
                        settings=LiveSettings(first_chars=0, first_delay=0.0), prompts=self.prompts, spawn=spawn)


async def test_a_request_that_could_not_be_shown_is_denied_at_once_and_the_model_told_why(tmp_path, fake_openai):
    tool = HeldTool(held=False)
    fake_openai.script(ASK_LOOKUP, Text("I could not ask you, so I did not look."))
    h = await make_harness(tmp_path, fake_openai, tools=registry(tool), start=False, approval_timeout=600.0)
    channel = PromptingChannel()
    h.core.add_channel(channel)
    await h.core.start()
    envelope = channel.envelope("apples?")
    try:
        await h.core.submit(envelope)
        # at once, not after the 600 s approval timeout
        await h.wait_for(lambda: len(fake_openai.requests) == 2 and h.core.sessions.idle(), timeout=10)
        assert [r.call_id for r in channel.prompts.posted] == ["call_S1"]
        assert tool_messages(fake_openai.requests[1]) == {"call_S1": DENIED_UNSHOWN}
        assert "could not be shown in the chat" in DENIED_UNSHOWN
        assert tool.started == []
        assert (await stored_tool_outputs(h, envelope.key()))["call_S1"] == DENIED_UNSHOWN
        assert list(channel.chat.shown.values()) == ["I could not ask you, so I did not look."]
    finally:
        await h.core.shutdown()


async def test_a_request_whose_post_may_have_shown_stays_pending(tmp_path, fake_openai):
    tool = HeldTool(held=False)
    fake_openai.script(ASK_LOOKUP, Text("You have 42 apples."))
    h = await make_harness(tmp_path, fake_openai, tools=registry(tool), start=False, approval_timeout=600.0)
    channel = PromptingChannel()
    channel.prompts.unsure = True
    h.core.add_channel(channel)
    await h.core.start()
    envelope = channel.envelope("apples?")
    key = envelope.key()
    try:
        await h.core.submit(envelope)
        await h.wait_for(lambda: channel.prompts.posted)
        await a_few_loop_steps()
        assert h.core.approvals.pending(key) == ["call_S1"]  # it may show: a press on it still decides it
        assert h.core.decide(key, "call_S1", "allow", decided_by="u1", channel="prompting") is DecideResult.DECIDED
        await h.wait_for(lambda: len(fake_openai.requests) == 2 and h.core.sessions.idle(), timeout=10)
        assert tool_messages(fake_openai.requests[1]) == {"call_S1": "42 apples"}
    finally:
        await h.core.shutdown()


async def test_a_subagents_request_that_could_not_be_shown_is_denied_in_the_child(tmp_path, fake_openai):
    tool = HeldTool(held=False)
    fake_openai.default = Function(counter_route)
    h = await make_harness(tmp_path, fake_openai, tools=registry(tool), start=False, approval_timeout=600.0,
                           subagents=COUNTER)
    channel = PromptingChannel()
    h.core.add_channel(channel)
    await h.core.start()
    try:
        await h.core.submit(channel.envelope("count the apples"))
        await h.wait_for(lambda: len(fake_openai.requests) == 4 and h.core.sessions.idle(), timeout=10)
        [request] = channel.prompts.posted
        assert request.call_id == "call_C" and len(request.origin) == 1
        child_requests = [r for r in fake_openai.requests if first_user_text(r).startswith("TASK")]
        assert tool_messages(child_requests[-1]) == {"call_C": DENIED_UNSHOWN}
        assert tool.started == []
        assert list(channel.chat.shown.values()) == [FINAL]
        assert CHILD_WORDS not in channel.chat.shown.values()
    finally:
        await h.core.shutdown()


def test_only_a_pending_request_of_the_turn_is_reported_unshown():
    c = TurnController("t", "s")
    told: list[tuple[str, tuple[str, ...]]] = []
    remove = c.on_unshown(lambda call_id, origin: told.append((call_id, origin)))
    c.apply(ApprovalRequested("call_1", "lookup", "query=\"a\"", "u1"))
    c.apply(Forwarded(("s-sub-0123456789ab",), SessionMeta("s-sub-0123456789ab", "s", None, "task", "call_p")))
    c.apply(Forwarded(("s-sub-0123456789ab",), ApprovalRequested("call_1", "lookup", "query=\"b\"", "u1")))
    c.approval_unshown("call_9")  # not pending
    c.approval_unshown("call_1", ("s-sub-other0000000",))  # not this turn's
    c.approval_unshown("call_1", ("s-sub-0123456789ab",))
    c.approval_unshown("call_1")
    assert told == [("call_1", ("s-sub-0123456789ab",)), ("call_1", ())]
    remove()
    c.approval_unshown("call_1")
    assert len(told) == 2


# ---- H10: a model that repeats tool call ids -----------------------------------------------------------------


@pytest.mark.parametrize("new_between", [False, True], ids=["same-conversation", "after-new"])
async def test_a_press_on_an_earlier_request_never_decides_a_later_call_with_the_same_id(tmp_path, fake_openai,
                                                                                        new_between):
    """With ``/new`` between them the earlier call is no longer in the context, but its button may still be
    pressed in the chat: its id is not given to the later call either."""
    lookup, wipe = HeldTool("lookup", held=False), HeldTool("wipe", "wiped", held=False)
    fake_openai.script(ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_0"]), Text("ok, not looked."),
                       ToolCalls([("wipe", '{"query": "everything"}')], ids=["call_0"]), Text("not wiped."))
    h = await make_harness(tmp_path, fake_openai, tools=registry(lookup, wipe))
    key = session_key(h)
    try:
        await h.say("how many apples?")
        await h.wait_for(lambda: h.core.approvals.pending(key) == ["call_0"])
        assert h.core.decide(key, "call_0", "deny", decided_by="u1", channel="test") is DecideResult.DECIDED
        await h.settle()
        if new_between:
            await h.say("/new")
            await h.settle()
        await h.say("now wipe it")
        await h.wait_for(lambda: h.core.approvals.pending(key))
        [new_id] = h.core.approvals.pending(key)
        assert new_id != "call_0"
        # an Allow on the old request's button (another device that still shows it) decides nothing
        assert h.core.decide(key, "call_0", "allow", decided_by="u1", channel="test") is DecideResult.NOT_PENDING
        await a_few_loop_steps()
        assert wipe.started == [] and h.core.approvals.pending(key) == [new_id]
        assert h.core.decide(key, new_id, "deny", decided_by="u1", channel="test") is DecideResult.DECIDED
        await h.settle()
        assert wipe.started == [] and lookup.started == []
        last = fake_openai.requests[-1]
        earlier = {} if new_between else {"call_0": DENIED_BY_USER}  # after /new the old call is not in the context
        assert called_ids(last) == [*earlier, new_id]  # what the model is sent back agrees with itself
        assert tool_messages(last) == {**earlier, new_id: DENIED_BY_USER}
        assert await stored_tool_outputs(h, key) == {"call_0": DENIED_BY_USER, new_id: DENIED_BY_USER}
    finally:
        await h.core.shutdown()
