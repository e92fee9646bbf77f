"""A conversation in a script that costs more tokens than the builder's estimate (four characters a token).

A Chinese character is a token or two, not a quarter of one, so such a chat outgrows the model's window long
before the estimate says so. The overflow error says by how much ("maximum context length is 2000 tokens.
However, your messages resulted in 4100 tokens"): the one recovery rebuilds the input to fit that, and the
session's later turns are built to fit it from the start. Before, the recovery only halved the budget, still
too much, and every later message was answered "no longer fits" until /new.
"""

from __future__ import annotations

from typing import Any

from core.llm.provider import ProviderError, ProviderErrorKind, window_share
from core.tools.base import ToolRegistry
from tests.fakes.openai_server import Text, ToolCalls
from tests.support.harness import make_harness
from tests.test_agent_loop import ScriptTool

ZH = "今天天气很好，我们去公园散步吧。"  # 16 characters
WINDOW = 2000  # tokens
TOKENS_PER_CHAR = 2.0  # the fake model's price: the window holds 1,000 characters; the estimate says 6,000


def refused(fake) -> int:  # type: ignore[no-untyped-def]
    """Requests the fake model refused for their size."""
    return sum(1 for body in fake.requests if fake.tokens(body) > WINDOW)


async def test_a_chat_in_a_dense_script_is_answered_after_it_outgrows_the_window(tmp_path, fake_openai):
    fake_openai.window = (WINDOW, TOKENS_PER_CHAR)
    h = await make_harness(tmp_path, fake_openai, context_window=WINDOW)
    questions = [f"问题{i}：" + ZH * 12 for i in range(1, 8)]  # about 200 characters each
    for i, question in enumerate(questions, 1):
        fake_openai.script(Text(f"回答{i}" + ZH * 2))
        await h.say(question)
        await h.settle()
        shown = h.platform.visible("c1")
        assert shown[-1] == f"回答{i}" + ZH * 2, f"message {i} was answered {shown[-1]!r}"
        last = fake_openai.requests[-1]["messages"]
        assert last[-1]["content"].startswith(question)  # the newest message is always what the model reads
    assert not any("no longer fits" in text for text in h.platform.visible("c1"))
    # the chat outgrew the window once; the turns after it were built to fit it
    assert refused(fake_openai) == 1
    await h.core.shutdown()


async def test_an_overflow_after_a_tool_result_leaves_room_for_the_result(tmp_path, fake_openai):
    """The request the window refused carried this turn's tool call and result, which are sent again after the
    rebuilt history: the history is cut to what fits beside them, not to the whole window."""
    async def lookup(args: dict[str, Any]) -> str:
        return "result " * 64  # 448 characters

    tools = ToolRegistry(default_policy="auto")
    tools.add(ScriptTool("lookup", lookup))
    fake_openai.window = (WINDOW, TOKENS_PER_CHAR)
    h = await make_harness(tmp_path, fake_openai, context_window=WINDOW, tools=tools)
    for i in range(1, 4):
        fake_openai.script(Text(f"answer {i}"))
        await h.say(f"question {i}: " + "x" * 190)
        await h.settle()
    fake_openai.script(ToolCalls([("lookup", "{}")]), Text("found it"))
    await h.say("look it up")
    await h.settle()
    assert h.platform.visible("c1")[-1] == "found it"
    retried = fake_openai.requests[-1]["messages"]
    assert retried[-1]["content"] == "result " * 64  # the tool result went along again
    assert refused(fake_openai) == 1
    await h.core.shutdown()


def test_the_sizes_are_read_from_each_servers_wording():
    cases = {
        "local model: Requested tokens (2048) exceed context window of 1024": 0.5,
        "This model's maximum context length is 8192 tokens. However, your messages resulted in 16384 tokens.": 0.5,
        "This model's maximum context length is 4096 tokens. However, you requested 8192 tokens "
        "(7000 in the messages, 1192 in the completion).": 0.5,
        "prompt is too long: 400,000 tokens > 200,000 maximum": 0.5,
        "request (2000 tokens) exceeds the available context size (1000 tokens), try increasing it": 0.5,
    }
    for message, share in cases.items():
        assert window_share(message) == share, message
        assert ProviderError(ProviderErrorKind.CONTEXT_OVERFLOW, message).window_share == share
    assert window_share("the input is too long") is None
    assert window_share("maximum context length is 8192 tokens. However, you requested 100 tokens") is None
    assert ProviderError(ProviderErrorKind.BAD_REQUEST, next(iter(cases))).window_share is None
