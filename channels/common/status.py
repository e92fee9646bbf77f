"""Compact status lines for the child sessions (``run_subagent``) of a turn being written.

A platform whose live reply is one edited message shows, under the text written so far, one line per
child that is still running: its profile and task, and what it does now (thinking, writing, a tool,
waiting for an approval). The children's own text never enters the chat there — their final answers reach
the parent's model, and the chat shows only the parent's final answer — so a turn that starts many
children cannot flood the chat. The lines go with the last streamed message only; the final reply has none.
"""

from __future__ import annotations

from core.snapshot import TurnSnapshot

MAX_LINES = 8
"""Children shown one by one; more running at once are counted in one last line."""
MAX_LINE = 120


def status_lines(snapshot: TurnSnapshot) -> str:
    """The lines for the running children of ``snapshot`` ("" when none runs)."""
    running = [c for c in snapshot.children if c.state == "running"]
    if not running:
        return ""
    lines = []
    for child in running[:MAX_LINES]:
        line = f"⏳ {child.label} · {child.step}"
        lines.append(line if len(line) <= MAX_LINE else line[:MAX_LINE - 1] + "…")
    if len(running) > MAX_LINES:
        lines.append(f"⏳ … and {len(running) - MAX_LINES} more subagents")
    return "\n".join(lines)
