"""OpenAI's reasoning models (o1, o3, gpt-5...) refuse ``max_tokens`` and take the output limit only as
``max_completion_tokens``: the refused request is made again at once with it, and the provider sends it from the
start afterwards, so a chat makes one refused request in all. Other servers keep getting ``max_tokens``."""

from __future__ import annotations

from core.events import SessionTitleChanged
from tests.fakes.openai_server import Text
from tests.support.harness import make_harness
from tests.test_metrics import value


def limits(requests: list[dict[str, object]]) -> list[dict[str, object]]:
    """The output limit each request carried, by the parameter it went as."""
    return [{k: r[k] for k in ("max_tokens", "max_completion_tokens") if k in r} for r in requests]


async def test_a_model_that_refuses_max_tokens_answers_and_titles_with_one_refusal_in_all(tmp_path, fake_openai):
    fake_openai.refuse_max_tokens = True
    fake_openai.script(Text("Paris is the capital."), Text("Capital of France"), Text("About two million."))
    h = await make_harness(tmp_path, fake_openai, max_output_tokens=300, titles=True)
    try:
        await h.say("capital of France?")
        await h.settle()
        assert h.platform.visible("c1") == ["Paris is the capital."]
        await h.wait_for(lambda: any(isinstance(e, SessionTitleChanged) for e in h.events))
        await h.say("how many people live there?")
        await h.settle()
        assert h.platform.visible("c1") == ["Paris is the capital.", "About two million."]
        assert (await h.store.get_session("test:c1")).title == "Capital of France"
        # the first turn refused, then made again at once; the title and the next turn ask right from the start
        assert limits(fake_openai.requests) == [
            {"max_tokens": 300}, {"max_completion_tokens": 300}, {"max_completion_tokens": 32},
            {"max_completion_tokens": 300}]
        assert fake_openai.requests[2]["messages"][0]["content"].startswith("Give this conversation a short title")
        # the request made again is part of the same attempt, not a retry
        assert value(h.core.metrics.render().decode(), "chatbridge_model_retries_total") == 0
    finally:
        await h.core.shutdown()


async def test_a_server_that_takes_max_tokens_keeps_getting_it(tmp_path, fake_openai):
    fake_openai.script(Text("Paris is the capital."), Text("Capital of France"))
    h = await make_harness(tmp_path, fake_openai, max_output_tokens=300, titles=True)
    try:
        await h.say("capital of France?")
        await h.settle()
        await h.wait_for(lambda: any(isinstance(e, SessionTitleChanged) for e in h.events))
        assert h.platform.visible("c1") == ["Paris is the capital."]
        assert limits(fake_openai.requests) == [{"max_tokens": 300}, {"max_tokens": 32}]
    finally:
        await h.core.shutdown()


async def test_without_max_output_tokens_the_title_is_the_request_made_again(tmp_path, fake_openai):
    fake_openai.refuse_max_tokens = True
    fake_openai.script(Text("Paris is the capital."), Text("Capital of France"))
    h = await make_harness(tmp_path, fake_openai, titles=True)
    try:
        await h.say("capital of France?")
        await h.settle()
        await h.wait_for(lambda: len(fake_openai.requests) == 3)
        await h.wait_for(lambda: any(isinstance(e, SessionTitleChanged) for e in h.events))
        assert h.platform.visible("c1") == ["Paris is the capital."]
        assert (await h.store.get_session("test:c1")).title == "Capital of France"
        assert limits(fake_openai.requests) == [{}, {"max_tokens": 32}, {"max_completion_tokens": 32}]
    finally:
        await h.core.shutdown()
