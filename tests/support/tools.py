"""What every test tool shares (``core.tools.base.Tool``): its spec and its own approval policy; a test tool
adds its ``run``."""

from __future__ import annotations

from typing import Any

from core.llm.provider import LLMToolSpec
from core.tools.base import ApprovalPolicy

QUERY: dict[str, Any] = {"type": "object", "properties": {"query": {"type": "string"}}}
"""Parameters of a tool taking one ``query`` string."""


class SpecTool:
    def __init__(self, spec: LLMToolSpec, approval: ApprovalPolicy | None = None) -> None:
        self._spec = spec
        self._approval = approval

    @property
    def spec(self) -> LLMToolSpec:
        return self._spec

    @property
    def approval(self) -> ApprovalPolicy | None:
        return self._approval
