"""A conversation in a script that costs more tokens than the builder's estimate (four characters a token).

A Chinese character is a token or two, not a quarter of one, so such a chat outgrows the model's window long
before the estimate says so. The overflow error says by how much ("maximum context length is 2000 tokens.
However, your messages resulted in 4100 tokens"): the one recovery rebuilds the input to fit that, and the
session's later turns are built to fit it from the start. Before, the recovery only halved the budget, still
too much, and every later message was answered "no longer fits" until /new.
"""

from __future__ import annotations

from typing import Any

from core.agent.compaction import SUMMARY_PROMPT
from core.llm.provider import ProviderError, ProviderErrorKind, window_share
from core.tools.base import ToolRegistry
from tests.fakes.openai_server import Function, Reply, Text, ToolCalls, last_user_text
from tests.support.harness import make_harness
from tests.support.media import jpeg
from tests.test_agent_loop import ScriptTool
from tests.test_vision_refusals import Files, photo

ZH = "今天天气很好，我们去公园散步吧。"  # 16 characters
WINDOW = 2000  # tokens
TOKENS_PER_CHAR = 2.0  # the fake model's price: the window holds 1,000 characters; the estimate says 6,000


def refused(fake, window: int = WINDOW) -> int:  # type: ignore[no-untyped-def]
    """Requests the fake model refused for their size."""
    return sum(1 for body in fake.requests if fake.tokens(body) > window)


def answering(body: dict[str, Any]) -> Reply:
    """The fake model: "回答N…" to "问题N：…", a summary to a summary request."""
    if body["messages"][0]["content"] == SUMMARY_PROMPT:
        return Text("摘要")
    return Text(last_user_text(body).split("：")[0].replace("问题", "回答") + ZH * 2)


async def test_a_chat_in_a_dense_script_is_answered_after_it_outgrows_the_window(tmp_path, fake_openai):
    fake_openai.default = Function(answering)
    fake_openai.window = (WINDOW, TOKENS_PER_CHAR)
    h = await make_harness(tmp_path, fake_openai, context_window=WINDOW)
    questions = [f"问题{i}：" + ZH * 12 for i in range(1, 8)]  # about 200 characters each
    for i, question in enumerate(questions, 1):
        await h.say(question)
        await h.settle()
        shown = h.platform.visible("c1")
        assert shown[-1] == f"回答{i}" + ZH * 2, f"message {i} was answered {shown[-1]!r}"
        last = fake_openai.requests[-1]["messages"]
        assert last[-1]["content"].startswith(question)  # the newest message is always what the model reads
    assert not any("no longer fits" in text for text in h.platform.visible("c1"))
    # the chat outgrew the window once; the turns after it (and their summaries) were built to fit it
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


async def test_a_new_context_starts_from_the_full_window_again(tmp_path, fake_openai):
    """What taught the window stays behind after /new: the new conversation is not held to it."""
    fake_openai.default = Function(answering)
    fake_openai.window = (WINDOW, TOKENS_PER_CHAR)
    h = await make_harness(tmp_path, fake_openai, context_window=WINDOW)
    for i in range(1, 6):
        await h.say(f"问题{i}：" + ZH * 12)
        await h.settle()
    assert refused(fake_openai) == 1  # the window was learnt
    await h.say("/new")
    await h.settle()
    fake_openai.window = (WINDOW, 0.25)  # the new conversation is in a script the estimate reads right
    notes = [f"note {i}: " + "lorem ipsum " * 40 for i in range(4)]  # ~490 characters each: 2,000 in all
    for note in notes:
        await h.say(note)
        await h.settle()
    sent = texts(fake_openai.requests[-1])
    assert all(note in sent for note in notes)  # the whole new conversation, not the learnt 1,000 characters
    await h.core.shutdown()


def texts(body: dict[str, Any]) -> str:
    """Every text a request carried."""
    out = []
    for m in body["messages"]:
        content = m.get("content")
        out += [content] if isinstance(content, str) else [p.get("text") or "" for p in content or ()]
    return "\n".join(out)


async def test_an_overflow_from_images_does_not_leave_the_chat_a_tiny_window(tmp_path, fake_openai):
    """Photos count in the model's token count: the window learnt from an overflow they caused counts them
    too. Before, it counted the text alone, learnt a window of a hundred characters, and every later message
    was sent with nothing of the conversation before it."""
    fake_openai.window = (4000, 0.25)  # four characters a token, as the estimate says
    fake_openai.image_tokens = 1500
    photos = {f"p{i}": jpeg(64, 64, (i * 60, 0, 0)) for i in range(3)}
    h = await make_harness(tmp_path, fake_openai, start=False, context_window=4000)
    chat = Files()
    chat.files.update(photos)
    h.core.add_channel(chat)
    await h.core.start()

    async def say(text: str, **kw: Any) -> None:
        await h.core.submit(chat.envelope(text, chat_id="alice", **kw))
        await h.settle()

    await say("My name is Alice and my code word is PAPAYA.")
    await say("compare these three photos", media=tuple(m for fid in photos for m in photo(fid)))
    for i in range(4):
        await say(f"note {i}: " + "lorem ipsum " * 30)
    await say("what is my code word?")
    # the photos alone are over the window: refused once more with them (the newest message's are shown after
    # an overflow), then taken with them described
    assert refused(fake_openai, 4000) == 2
    assert "PAPAYA" in texts(fake_openai.requests[-1])  # the conversation is still what the model reads
    assert not any("no longer fits" in text for text in chat.platform.visible("alice"))
    await h.core.shutdown()


async def test_a_chat_in_a_dense_script_is_compacted_within_its_window(tmp_path, fake_openai):
    """Compaction measures against the window an overflow taught, not the estimate's: the oldest messages are
    summarised, not trimmed away unsaid, and the summary request itself fits the window."""
    def model(body: dict[str, Any]) -> Reply:
        if body["messages"][0]["content"] == SUMMARY_PROMPT:
            return Text("小明的暗号是木瓜。")
        return Text("好的")

    fake_openai.default = Function(model)
    fake_openai.window = (WINDOW, TOKENS_PER_CHAR)
    h = await make_harness(tmp_path, fake_openai, context_window=WINDOW)
    await h.say("我叫小明，我的暗号是木瓜。" + ZH * 10)
    await h.settle()
    for i in range(1, 8):
        await h.say(f"问题{i}：" + ZH * 12)
        await h.settle()
    summaries = [body for body in fake_openai.requests if body["messages"][0]["content"] == SUMMARY_PROMPT]
    assert summaries, "the conversation was never summarised"
    assert all(fake_openai.tokens(body) <= WINDOW for body in summaries)
    assert "小明的暗号是木瓜" in texts(fake_openai.requests[-1])
    assert h.platform.visible("c1") == ["好的"] * 8
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
