"""Approvals decided in one process for a turn another process runs.

The pending approvals of a turn live in memory, in the ``ApprovalBroker`` of the process running the turn.
When several processes share one store, a decision (a web chat POST, a platform button press) may arrive
at any of them. :class:`ApprovalRelay` decides it here when the approval is pending here; otherwise it asks
the other processes over the relay topic ``approvals`` and waits for the answer of the one holding it,
which decides it there, by its own rule of who may (``core.agent.deciders``), and answers DECIDED or
REFUSED. Processes that do not hold it stay silent, so a decision nobody holds (already decided, timed
out, the turn is over) — or one whose holder did not answer within ``timeout`` (it is gone, or its answer
was lost) — comes back NOT_PENDING after ``timeout``: the channel says the approval is no longer pending.
A holder that decided but whose answer was lost has still decided: the turn goes on, as the chat shows.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import Callable, Sequence
from typing import Any, Literal

from core.agent.deciders import Decider, DecideResult
from core.relay import Relay

log = logging.getLogger(__name__)

TOPIC = "approvals"
ANSWER_TIMEOUT = 2.0
"""Seconds to wait for the process holding an approval to answer a forwarded decision."""

Decision = Literal["allow", "deny"]
LocalDecide = Callable[[str, str, Decision, Decider | None, str | None, Sequence[str]], DecideResult]
"""(session key, tool call id, decision, decider, channel, origin) → the result in this process."""


class ApprovalRelay:
    def __init__(self, relay: Relay, decide_here: LocalDecide, *, timeout: float = ANSWER_TIMEOUT) -> None:
        self._relay = relay
        self._decide_here = decide_here
        self._timeout = timeout
        self._waiting: dict[str, asyncio.Future[DecideResult]] = {}
        self._unlisten = relay.listen(self._on_message, lambda: None)

    def close(self) -> None:
        self._unlisten()
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_result(DecideResult.NOT_PENDING)

    async def decide(self, session_key: str, tool_call_id: str, decision: Decision, decider: Decider | None,
                     channel: str | None, origin: Sequence[str]) -> DecideResult:
        """Ask the other processes to decide an approval that is not pending here (see the module docstring)."""
        ask_id = secrets.token_hex(8)
        fut: asyncio.Future[DecideResult] = asyncio.get_running_loop().create_future()
        self._waiting[ask_id] = fut
        try:
            self._relay.send(json.dumps({
                "ask": ask_id, "key": session_key, "call": tool_call_id, "decision": decision,
                "by": None if decider is None else [decider.id, list(decider.names), decider.shown],
                "channel": channel,
                "origin": list(origin)}, ensure_ascii=False))
            return await asyncio.wait_for(fut, self._timeout)
        except TimeoutError:
            return DecideResult.NOT_PENDING
        finally:
            self._waiting.pop(ask_id, None)

    def _on_message(self, sender: str, message: str) -> None:
        try:
            body = json.loads(message)
        except ValueError:
            log.warning("approvals relay: an unreadable message from process %s was ignored", sender)
            return
        if not isinstance(body, dict):
            return
        if "answer" in body:
            fut = self._waiting.get(str(body["answer"])) if body.get("to") == self._relay.node else None
            if fut is not None and not fut.done():
                try:
                    fut.set_result(DecideResult(body.get("result")))
                except ValueError:
                    fut.set_result(DecideResult.NOT_PENDING)
        elif "ask" in body:
            self._answer(sender, body)

    def _answer(self, sender: str, body: dict[str, Any]) -> None:
        try:
            decision = body["decision"]
            by = body["by"]
            decider = None if by is None else Decider(str(by[0]), tuple(str(n) for n in by[1]),
                                                      str(by[2]) if len(by) > 2 else "")
            origin = [str(o) for o in body.get("origin") or ()]
            if decision not in ("allow", "deny"):
                raise ValueError(decision)
            result = self._decide_here(str(body["key"]), str(body["call"]), decision, decider,
                                       body.get("channel"), origin)
        except (KeyError, TypeError, IndexError, ValueError):
            log.warning("approvals relay: a malformed decision from process %s was ignored", sender)
            return
        if result is DecideResult.NOT_PENDING:
            return  # not held here: the holder (if any) answers
        self._relay.send(json.dumps({"answer": body["ask"], "to": sender, "result": result.value}))
