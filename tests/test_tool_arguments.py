"""Tool-call arguments: checked against the tool's schema before anyone is asked, and shown in full.

End to end through the fake OpenAI server and the real SDK: a call that does not fit its schema never runs
and is never offered for approval, and the model is told why; an approval request carries every argument
in full, the ones the tool requires first."""

from __future__ import annotations

import json
from typing import Any

from core.agent.events import TurnEvent
from core.events import TurnStarted
from core.llm.provider import LLMToolSpec
from core.snapshot import ShownArgument
from core.tools.arguments import ArgumentChecker, InvalidArguments, shown_arguments, visible
from core.tools.base import ApprovalPolicy, ToolContext, ToolRegistry
from core.tools.builtin import FetchUrl
from tests.fakes.openai_server import Text, ToolCalls
from tests.support.harness import make_harness
from tests.support.tools import SpecTool
from tests.test_agent_loop import KEY, record_turn_events

STRICT = {"type": "object", "properties": {"url": {"type": "string"}, "note": {"type": "string"}},
          "required": ["url"], "additionalProperties": False}


class StrictTool(SpecTool):
    def __init__(self, name: str = "fetch", schema: dict[str, Any] | None = None,
                 approval: ApprovalPolicy | None = None) -> None:
        super().__init__(LLMToolSpec(name, "a strict tool", schema or STRICT), approval)
        self.calls: list[dict[str, Any]] = []

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        self.calls.append(arguments)
        return "ran"


def tool_messages(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [(m["tool_call_id"], m["content"]) for m in body["messages"] if m.get("role") == "tool"]


async def test_an_extra_argument_is_rejected_before_approval_and_the_model_hears_why(tmp_path, fake_openai):
    for policy in ("ask", "auto"):
        tool = StrictTool(approval=policy)
        tools = ToolRegistry(default_policy="ask")
        tools.add(tool)
        args = json.dumps({"url": "https://example.org/", "secret_override": "x"})
        fake_openai.script(ToolCalls([("fetch", args)], ids=["call_X"]), Text("Sorry."))
        h = await make_harness(tmp_path / policy, fake_openai, tools=tools)
        events: list[TurnEvent] = record_turn_events(h)
        await h.say("fetch it")
        await h.settle()
        assert tool.calls == []  # never ran
        assert not any(e.kind in ("approval_request", "approval_decision") for e in events)  # never offered
        [(call_id, output)] = tool_messages(fake_openai.requests[-1])
        assert call_id == "call_X"
        assert output.startswith("Tool call rejected: the arguments do not match the parameters of fetch")
        assert "'secret_override' was unexpected" in output and "did not run" in output
        [outcome] = [e for e in events if e.kind == "tool_call_output"]
        assert outcome.status == "failed"  # type: ignore[union-attr]
        await h.core.shutdown()
        fake_openai.requests.clear()


async def test_a_wrong_type_or_a_missing_required_argument_is_rejected(tmp_path, fake_openai):
    tool = StrictTool(approval="auto")
    tools = ToolRegistry(default_policy="ask")
    tools.add(tool)
    fake_openai.script(ToolCalls([("fetch", '{"url": 42}'), ("fetch", '{"note": "no url"}'),
                                  ("fetch", '{"url": "https://ok.example/"}')], ids=["c1", "c2", "c3"]),
                       Text("Done."))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    await h.say("go")
    await h.settle()
    assert tool.calls == [{"url": "https://ok.example/"}]  # only the valid call ran
    outputs = dict(tool_messages(fake_openai.requests[-1]))
    assert "url: 42 is not of type 'string'" in outputs["c1"]
    assert "'url' is a required property" in outputs["c2"]
    assert outputs["c3"] == "ran"
    await h.core.shutdown()


async def test_the_approval_request_shows_the_url_first_and_every_argument_in_full(tmp_path, fake_openai):
    """A long decoy argument ahead of the URL: the request still shows the URL first, and nothing is cut."""
    decoy = "harmless weather lookup " * 40  # ~1000 characters
    tool = FetchUrl()  # the real built-in: its schema forbids additional properties, so widen it here
    strict = StrictTool("fetch_url", schema={**tool.spec.parameters, "properties": {
        "note": {"type": "string"}, "url": {"type": "string"}}})
    tools = ToolRegistry(default_policy="ask")
    tools.add(strict)
    url = "http://169.254.169.254/latest/meta-data/iam/security-credentials/?" + "x" * 300
    fake_openai.script(ToolCalls([("fetch_url", json.dumps({"note": decoy, "url": url}))], ids=["call_U"]),
                       Text("ok"))
    h = await make_harness(tmp_path, fake_openai, tools=tools)
    events = record_turn_events(h)
    await h.say("weather?")
    await h.wait_for(lambda: any(e.kind == "approval_request" for e in events))
    started = next(e for e in h.events if isinstance(e, TurnStarted))
    [pending] = started.controller.snapshot.approvals
    assert pending.arguments == (ShownArgument("url", json.dumps(url), True),
                                 ShownArgument("note", json.dumps(decoy), False))
    assert pending.arguments_summary == f"url={json.dumps(url)}\nnote={json.dumps(decoy)}"
    assert h.core.decide(KEY, "call_U", "deny", "u1")
    await h.settle()
    await h.core.shutdown()


def test_shown_arguments_escape_what_would_not_show_as_itself() -> None:
    shown = shown_arguments({"path": "a\u202etxt.exe", "mode": "x\u2028y"},
                            {"type": "object", "required": ["path"]})
    assert shown == (ShownArgument("path", '"a\\u202etxt.exe"', True), ShownArgument("mode", '"x\\u2028y"', False))
    assert visible("plain text, 中文 ✓") == "plain text, 中文 ✓"


def test_an_invalid_schema_still_requires_a_json_object() -> None:
    checker = ArgumentChecker("broken", {"type": "no-such-type"})
    assert checker.parse('{"a": 1}') == {"a": 1}
    for bad in ("[1]", "{not json"):
        try:
            checker.parse(bad)
        except InvalidArguments:
            continue
        raise AssertionError(f"{bad!r} was accepted")
