from typing import Any

import pytest

from core.llm.provider import LLMToolSpec
from core.tools.base import ApprovalPolicy, ToolContext, ToolRegistry
from tests.support.tools import SpecTool


class Echo(SpecTool):
    def __init__(self, name: str, approval: ApprovalPolicy | None = None) -> None:
        super().__init__(LLMToolSpec(name, "echo", {"type": "object", "properties": {}}), approval)

    async def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        return str(arguments)


def test_policy_order_is_override_then_tool_then_default():
    reg = ToolRegistry("ask", overrides={"b": "deny"})
    reg.extend([Echo("a"), Echo("b", "auto"), Echo("c", "auto")])
    assert reg.policy("a") == "ask"
    assert reg.policy("b") == "deny"
    assert reg.policy("c") == "auto"
    assert reg.policy("nope") == "deny"


def test_denied_tools_are_not_offered_to_the_model():
    reg = ToolRegistry("deny")
    reg.extend([Echo("x"), Echo("y", "auto")])
    assert [s.name for s in reg.specs()] == ["y"]


def test_duplicate_names_are_refused():
    reg = ToolRegistry()
    reg.add(Echo("a"))
    with pytest.raises(ValueError):
        reg.add(Echo("a"))
