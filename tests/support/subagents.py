"""The model's side of a turn that hands one task to a subagent, as each platform's subagent test scripts it:
the parent runs the ``counter`` profile on ``TASK``, the child calls the ``lookup`` tool (which asks for
approval) and answers, then the parent gives the final answer."""

from __future__ import annotations

import json
from typing import Any

from core.settings import SubagentProfile, SubagentSettings
from tests.fakes.openai_server import Text, ToolCalls

TASK = "TASK count apples"
CHILD_WORDS = "The lookup says 42 apples."
"""The child's answer: the parent reads it; the chat never shows it."""
FINAL = "There are 42 apples."
"""The parent's answer."""
COUNTER = SubagentSettings(enabled=True, profiles=(SubagentProfile("counter", tools=("lookup",)),))
"""Subagents on, with the ``counter`` profile, which may use ``lookup``."""


def first_user_text(body: dict[str, Any]) -> str:
    """The first user message of a model request: a child's task in a child's request."""
    return str(next(m["content"] for m in body["messages"] if m["role"] == "user"))


def counter_route(body: dict[str, Any]) -> Text | ToolCalls:
    """The model's reply to each request of the turn (``Function(counter_route)``)."""
    tool_results = [m for m in body["messages"] if m["role"] == "tool"]
    if not first_user_text(body).startswith("TASK"):
        if tool_results:
            return Text(FINAL)
        return ToolCalls([("run_subagent", json.dumps({"task": TASK, "profile": "counter"}))], ids=["call_P"])
    if tool_results:
        return Text(CHILD_WORDS)
    return ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_C"])
