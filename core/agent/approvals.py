"""Approvals: one decision at a time, in tool-call order.

``ApprovalBroker`` (one per ChatCore) holds the pending "ask" decisions, each with the sender it was
requested for, so a channel can answer them through ``ChatCore.decide``; who may answer is the rule of
``core.agent.deciders``, checked here for every channel. ``ApprovalGate`` (one per model request) takes
each complete tool call in call order: policy ``deny`` (and unknown tools) block it with a synthetic
output; otherwise its arguments are checked against the tool's schema first — a call that does not fit
gets the reason as a failed output and is neither run nor offered for approval, so nobody approves
something other than what would run. Then ``auto`` allows it at once, ``ask`` publishes an approval
request showing every argument in full (``core.tools.arguments``) and waits for the user, the approval
timeout, or abort. While an earlier call waits, later ones queue behind it; the LLM stream never waits for
a decision.

One reply may hold any number of calls, and each "ask" call waits for a person: 300 of them would keep the chat
busy for hours, 300 "auto" ones would all run at once. So a gate takes at most ``MAX_CALLS_PER_REPLY`` calls of
its reply; each one beyond gets a failed output saying so (every call still gets exactly one output) and the
model can make them in its next request. The allowed tools of one reply run at most ``MAX_TOOLS_AT_ONCE`` at a
time (``core.agent.loop``); the others wait for a slot.

A stop of the turn (``/stop``, shutdown, a lost lease) closes its pending approvals at once, in the same step
(``ApprovalBroker.stop``, from the turn's cancel signal): a press that comes after it is answered "no longer
pending", and a decision that got in just before it never starts its tool (the round is being given up; a
tool started then would run outside it, to completion, its output thrown away). A request the chat could not
show (``ApprovalBroker.unshown``, told by the channel's sink) is denied at once with that reason, instead of
leaving the turn waiting for a press nobody can make.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from core.agent.deciders import NOBODY_ELSE, Decider, DecideResult, Deciders
from core.agent.events import ApprovalDecided, ApprovalRequested, CompleteToolCall, Decision, ToolOutput, TurnEvent
from core.agent.merge_queue import MergeQueue
from core.tools.arguments import InvalidArguments, arguments_text, rejection, shown_arguments
from core.tools.base import ApprovalPolicy, ToolRegistry

DENIED_BY_USER = "Tool call denied by user."
DENIED_BY_POLICY = "Tool call denied by policy."
DENIED_BY_TIMEOUT = "Tool call denied: nobody approved it in time."
DENIED_UNSHOWN = "Tool call denied: the approval request could not be shown in the chat, so nobody could approve it."

MAX_CALLS_PER_REPLY = 32
"""How many tool calls of one model reply are taken (decided, run); the rest get ``TOO_MANY_CALLS``."""
TOO_MANY_CALLS = (f"Tool call not run: more than {MAX_CALLS_PER_REPLY} tool calls in one reply; call fewer at "
                  "a time.")
MAX_TOOLS_AT_ONCE = 8
"""How many allowed tools of one model reply run at the same time."""

ASKED_IDS_PER_SESSION = 512
"""How many call ids of approval requests the broker remembers per session (``asked``)."""
ASKED_SESSIONS = 4096
"""How many sessions it remembers them for (the least recently asked are forgotten first)."""

Verdict = tuple[Decision, Decider]


@dataclass(slots=True)
class _Pending:
    future: asyncio.Future[Verdict]
    requested_by: str | None


class RequestUnshown(Exception):
    """The chat could not show the approval request (``ApprovalBroker.unshown``)."""


def _within(session_key: str, key: str) -> bool:
    """``key`` is ``session_key`` or one of its child sessions' (``run_subagent``, nested ones too)."""
    from core.agent.subagents import parent_of  # here: that module imports this one

    current: str | None = key
    while current is not None:
        if current == session_key:
            return True
        current = parent_of(current)
    return False


class ApprovalBroker:
    """Pending approvals of every session, keyed by (session key, tool call id)."""

    def __init__(self) -> None:
        self._pending: dict[tuple[str, str], _Pending] = {}
        self._stopped: set[str] = set()
        """Sessions whose turn is being stopped (``stop``): nothing of theirs is decided any more."""
        self._asked: OrderedDict[str, dict[str, None]] = OrderedDict()
        """The call ids approval requests were opened for, per session (``asked``), most recent last."""

    def open(self, session_key: str, call_id: str, requested_by: str | None = None) -> asyncio.Future[Verdict]:
        fut: asyncio.Future[Verdict] = asyncio.get_running_loop().create_future()
        self._pending[(session_key, call_id)] = _Pending(fut, requested_by)
        ids = self._asked.pop(session_key, None) or {}
        ids[call_id] = None
        if len(ids) > ASKED_IDS_PER_SESSION:
            del ids[next(iter(ids))]
        self._asked[session_key] = ids
        if len(self._asked) > ASKED_SESSIONS:
            self._asked.popitem(last=False)
        return fut

    def close(self, session_key: str, call_id: str, future: asyncio.Future[Verdict] | None = None) -> None:
        """Forget the pending approval (only if it is still ``future``'s, when given)."""
        pending = self._pending.get((session_key, call_id))
        if pending is not None and (future is None or pending.future is future):
            del self._pending[(session_key, call_id)]

    def asked(self, session_key: str) -> Collection[str]:
        """The call ids this process opened approval requests for in ``session_key`` (the latest
        ``ASKED_IDS_PER_SESSION``): buttons showing them may still be pressed somewhere."""
        return self._asked.get(session_key, {}).keys()

    def stop(self, session_key: str) -> None:
        """The turn of ``session_key`` is being stopped: close its pending approvals and its subagents' now, so a
        press from here on is answered NOT_PENDING, and nothing they ask later is decided (until ``resume``).
        The waiting gates see it when their task is cancelled, a moment later (``ApprovalGate._ask``)."""
        self._stopped.add(session_key)
        for key in [k for k in self._pending if _within(session_key, k[0])]:
            del self._pending[key]

    def resume(self, session_key: str) -> None:
        """The stopped turn of ``session_key`` is over: its next one asks again."""
        self._stopped = {k for k in self._stopped if not _within(session_key, k)}

    def stopped(self, session_key: str) -> bool:
        """Whether ``session_key``, or a session it is a child of, is being stopped."""
        return any(_within(k, session_key) for k in self._stopped)

    def unshown(self, session_key: str, call_id: str) -> bool:
        """The chat could not show this pending request: deny it now (its gate gives the call the reason).
        False when it is not pending (decided, timed out, stopped meanwhile)."""
        pending = self._pending.pop((session_key, call_id), None)
        if pending is None or pending.future.done():
            return False
        pending.future.set_exception(RequestUnshown())
        return True

    def decide(self, session_key: str, call_id: str, decision: Decision, decided_by: Decider | str | None,
               deciders: Deciders = NOBODY_ELSE) -> DecideResult:
        """Resolve a pending approval if ``decided_by`` may decide it (``core.agent.deciders``)."""
        pending = self._pending.get((session_key, call_id))
        if pending is None or pending.future.done():
            return DecideResult.NOT_PENDING
        decider = Decider.of(decided_by)
        if decider is None or not deciders.may_decide(decider, pending.requested_by):
            return DecideResult.REFUSED
        del self._pending[(session_key, call_id)]
        pending.future.set_result((decision, decider))
        return DecideResult.DECIDED

    def pending(self, session_key: str) -> list[str]:
        return [call_id for (key, call_id) in self._pending if key == session_key]


def summarize_arguments(arguments: str, limit: int = 200) -> str:
    """A short, readable one-line form of a call's JSON arguments (for buttons and tool activity)."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        text = arguments
    else:
        if isinstance(parsed, dict):
            text = ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in parsed.items())
        else:
            text = json.dumps(parsed, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class ApprovalGate:
    def __init__(self, *, queue: MergeQueue[TurnEvent], tools: ToolRegistry, broker: ApprovalBroker,
                 session_key: str, requested_by: str | None, timeout: float,
                 start_tool: Callable[[CompleteToolCall], None]) -> None:
        self._queue = queue
        self._tools = tools
        self._broker = broker
        self._key = session_key
        self._requested_by = requested_by
        self._timeout = timeout
        self._start_tool = start_tool
        self._backlog: deque[CompleteToolCall] = deque()
        self._busy = False
        self._taken = 0

    def submit(self, call: CompleteToolCall) -> None:
        """Take a complete tool call (called in call order by the stream driver)."""
        self._taken += 1
        if self._taken > MAX_CALLS_PER_REPLY:
            self._queue.push(ToolOutput(call.call_id, call.name, TOO_MANY_CALLS, "failed"))
            return
        policy = self._tools.policy(call.name)
        if policy != "deny" and not self._arguments_fit(call):
            return
        if not self._busy and policy != "ask":
            self._settle(call, policy, None)  # nothing waits ahead of it: decide now, in stream order
            return
        self._backlog.append(call)
        if not self._busy:
            self._busy = True
            if self._queue.add_producer(f"approvals:{call.call_id}", self._work()) is None:
                self._busy = False  # the round is over (closed): nothing is decided any more

    async def _work(self) -> None:
        try:
            while self._backlog and not self._broker.stopped(self._key):
                call = self._backlog.popleft()
                policy = self._tools.policy(call.name)
                if policy == "ask":
                    await self._ask(call)
                else:
                    self._settle(call, policy, None)
        finally:
            self._busy = False

    def _arguments_fit(self, call: CompleteToolCall) -> bool:
        """Check the call against its tool's schema; a call that does not fit gets its failed output here."""
        checker = self._tools.checker(call.name)
        if checker is None:
            return True  # an unknown tool is denied by policy
        try:
            checker.parse(call.arguments)
        except InvalidArguments as exc:
            self._queue.push(ToolOutput(call.call_id, call.name, rejection(call.name, str(exc)), "failed"))
            return False
        return True

    async def _ask(self, call: CompleteToolCall) -> None:
        if self._broker.stopped(self._key):
            return  # the turn is being stopped: nothing more is asked (the abort denies what is left)
        checker = self._tools.checker(call.name)
        shown = shown_arguments(checker.parse(call.arguments), checker.schema) if checker is not None else ()
        self._queue.push(ApprovalRequested(call.call_id, call.name, arguments_text(shown), self._requested_by,
                                           shown))
        fut = self._broker.open(self._key, call.call_id, self._requested_by)
        try:
            decision, decider = await asyncio.wait_for(fut, self._timeout)
        except TimeoutError:
            self._queue.push(ApprovalDecided(call.call_id, "deny", "timeout"))
            self._queue.push(ToolOutput(call.call_id, call.name, DENIED_BY_TIMEOUT, "denied"))
            return
        except RequestUnshown:
            self._queue.push(ApprovalDecided(call.call_id, "deny", "unshown"))
            self._queue.push(ToolOutput(call.call_id, call.name, DENIED_UNSHOWN, "denied"))
            return
        finally:
            self._broker.close(self._key, call.call_id, fut)
        # A decision made in the same step as the stop: on 3.11 ``wait_for`` then returns it instead of raising
        # the cancellation. The round is being given up: starting the tool now would run it outside it.
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise asyncio.CancelledError
        if self._broker.stopped(self._key):
            return  # a subagent's turn whose parent is being stopped: its own stop follows
        self._queue.push(ApprovalDecided(call.call_id, decision, "user", decider.id, decider.shown))
        if decision == "allow":
            self._start_tool(call)
        else:
            self._queue.push(ToolOutput(call.call_id, call.name, DENIED_BY_USER, "denied"))

    def _settle(self, call: CompleteToolCall, policy: ApprovalPolicy, decided_by: str | None) -> None:
        if policy == "auto":
            self._queue.push(ApprovalDecided(call.call_id, "allow", "policy", decided_by))
            self._start_tool(call)
        else:
            self._queue.push(ApprovalDecided(call.call_id, "deny", "policy", decided_by))
            self._queue.push(ToolOutput(call.call_id, call.name, DENIED_BY_POLICY, "denied"))
