"""TurnInputBuilder.assemble: what the model is sent."""

from core.input_builder import RuntimeContext, assemble
from core.messages import ChatMessage, MessageSource, ToolCall


def msg(seq, role, content, **kw):
    kind = {"user": "user_input", "assistant": "assistant", "tool": "tool"}[role]
    return ChatMessage(id=f"m{seq}", session_key="s", seq=seq, role=role, content=content,
                       source=MessageSource(kind=kind), received_at=0.0, created_at=0.0, **kw)


RT = RuntimeContext(channel="test", now=0.0)


def test_system_prompt_first_and_runtime_block_on_the_last_user_message_only():
    out = assemble("SYS", [msg(1, "user", "a"), msg(2, "assistant", "b"), msg(3, "user", "c")], RT, 10_000)
    assert [m.role for m in out] == ["system", "user", "assistant", "user"]
    assert out[0].content == "SYS"
    assert out[1].content == "a"
    assert out[3].content.startswith("c\n\n[Runtime context]\n")
    assert sum("[Runtime context]" in m.content for m in out) == 1


def test_budget_keeps_the_newest_messages_and_always_the_last_user_message():
    history = [msg(i, "user" if i % 2 else "assistant", "x" * 100) for i in range(1, 11)]
    history.append(msg(11, "user", "y" * 500))
    out = assemble("SYS", history, RT, 250)
    assert len(out) == 2 and out[1].content.startswith("y" * 500)


def test_a_cut_never_leaves_a_tool_result_without_its_call():
    history = [
        msg(1, "user", "u" * 300),
        msg(2, "assistant", "", tool_calls=(ToolCall(id="c1", name="t", arguments="{}"),)),
        msg(3, "tool", "result " * 10, tool_call_id="c1"),
        msg(4, "assistant", "done"),
        msg(5, "user", "next"),
    ]
    out = assemble("S", history, RT, 100)
    assert out[1].role != "tool"
    assert [m.role for m in out][-1] == "user"


def test_a_cut_starts_the_history_at_a_user_message():
    history = [
        msg(1, "user", "u" * 300),
        msg(2, "assistant", "", tool_calls=(ToolCall(id="c1", name="t", arguments="{}"),)),
        msg(3, "tool", "result", tool_call_id="c1"),
        msg(4, "assistant", "an answer whose question was cut off"),
        msg(5, "user", "next"),
    ]
    out = assemble("S", history, RT, 120)
    assert [m.role for m in out] == ["system", "user"]  # the call, its result and the answer went with the question
    assert out[1].content.startswith("next")
