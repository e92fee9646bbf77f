"""A turn that ends without an answer keeps its terminal notice in history (kind "notice").

The notice is what its chat was shown (a failure, "Stopped", a restart) and reaches history clients in the
turn's own revision, so a page that reloads or resyncs after a restart still shows it. It is for people
only: the model never receives it, and persisting it never makes a chat show anything twice.
"""

from __future__ import annotations

from core.messages import MessageSource, NewMessage
from core.sqlite_store import SqliteStore
from core.store import StoreError
from tests.fakes.openai_server import HttpError, Text
from tests.support.harness import make_harness

AUTH_TEXT = "The model provider rejected the bridge's credentials"


def sent_texts(request: dict) -> str:
    return "\n".join(str(m.get("content")) for m in request["messages"])


async def test_a_failed_turn_keeps_its_notice_in_history_and_the_model_never_sees_it(tmp_path, fake_openai):
    fake_openai.script(HttpError.auth(), Text("second answer"))
    h = await make_harness(tmp_path, fake_openai)
    await h.say("first question")
    await h.settle()
    [shown] = h.platform.visible("c1")
    assert AUTH_TEXT in shown and h.platform.plain("c1") == []  # shown once, live
    revision, history = await h.core.history("test:c1")
    assert [(m.role, m.source.kind) for m in history] == [("user", "user_input"), ("assistant", "notice")]
    assert history[1].content == shown and history[1].source.turn_id == history[0].source.turn_id
    # the notice arrives in the turn's one revision, with the user's message
    [commit] = h.commits("test:c1")
    assert commit.history_revision == revision == 1
    assert [m.id for m in commit.messages] == [m.id for m in history]

    await h.say("second question")
    await h.settle()
    assert AUTH_TEXT not in sent_texts(fake_openai.requests[-1])
    assert "first question" in sent_texts(fake_openai.requests[-1])
    assert [c.history_revision for c in h.commits("test:c1")] == [1, 2]
    await h.core.shutdown()


async def test_a_failed_turn_whose_sink_failed_falls_back_once_and_keeps_the_notice(tmp_path, fake_openai):
    fake_openai.script(HttpError.auth())
    h = await make_harness(tmp_path, fake_openai)
    h.channel.fail_open = True
    await h.say("hi")
    await h.settle()
    [plain] = h.platform.plain("c1")
    assert AUTH_TEXT in plain
    assert len(h.platform.visible("c1")) == 1
    _, history = await h.core.history("test:c1")
    assert [m.source.kind for m in history] == ["user_input", "notice"]
    await h.core.shutdown()


EMPTY_TEXT = "The model finished without writing an answer"


async def test_an_answer_without_a_word_is_told_once_and_kept_as_a_notice_the_model_never_sees(
        tmp_path, fake_openai):
    fake_openai.script(Text("   "), Text("second answer"))  # whitespace is no answer either
    h = await make_harness(tmp_path, fake_openai)
    await h.say("first question")
    await h.settle()
    [shown] = h.platform.visible("c1")
    assert EMPTY_TEXT in shown and h.platform.plain("c1") == []  # shown once, live, as the final
    _, history = await h.core.history("test:c1")
    assert [(m.role, m.source.kind) for m in history] == [
        ("user", "user_input"), ("assistant", "assistant"), ("assistant", "notice")]
    assert history[2].content == shown

    await h.say("second question")
    await h.settle()
    assert h.platform.visible("c1")[-1] == "second answer"
    assert EMPTY_TEXT not in sent_texts(fake_openai.requests[-1])
    await h.core.shutdown()


class AnswersCannotBeSaved(SqliteStore):
    """Fails every commit that carries anything but bridge notices (e.g. a disk error on a large answer)."""

    async def commit_turn(self, key, messages, **kw):  # type: ignore[override]
        if any(m.source.kind != "notice" for m in messages):
            raise StoreError("disk I/O error")
        return await super().commit_turn(key, messages, **kw)


async def test_an_answer_that_could_not_be_saved_still_leaves_its_notice(tmp_path, fake_openai):
    fake_openai.script(Text("an answer that will not fit"))
    h = await make_harness(tmp_path, fake_openai, store=AnswersCannotBeSaved(tmp_path / "db"))
    await h.say("hi")
    await h.settle()
    [shown] = h.platform.visible("c1")  # the live message ends in the failure, not as a completed answer
    _, history = await h.core.history("test:c1")
    assert [m.source.kind for m in history] == ["user_input", "notice"]
    notice = history[1].content
    assert "could not be saved" in notice and shown.endswith(notice)
    [commit] = h.commits("test:c1")
    assert [m.content for m in commit.messages] == ["hi", notice]
    assert h.platform.plain("c1") == []
    await h.core.shutdown()


async def test_a_turn_interrupted_by_a_crash_leaves_its_notice_in_history_once(tmp_path, fake_openai):
    store = SqliteStore(tmp_path / "chat.db")
    await store.open()
    target = '{"channel":"test","chat_id":"c9","session_key":"test:c9"}'
    await store.append_message("test:c9", NewMessage(role="user", content="are you there?",
                                                     source=MessageSource(kind="user_input", turn_id="t-crashed")),
                               begin_turn=("t-crashed", target))
    await store.close()  # the process died here, mid-answer

    fake_openai.script(Text("yes"))
    h = await make_harness(tmp_path, fake_openai)
    [told] = h.platform.plain("c9")
    assert "restarted" in told
    revision, history = await h.core.history("test:c9")
    # one revision covers the unanswered message and the notice (the web page's delivery of it is in
    # tests/test_web.py and tests/browser/test_restart_page.py)
    assert [(m.source.kind, m.content) for m in history] == [("user_input", "are you there?"), ("notice", told)]
    assert revision == 1

    await h.say("hello again", chat_id="c9")
    await h.settle()
    assert told not in sent_texts(fake_openai.requests[-1])
    assert "are you there?" in sent_texts(fake_openai.requests[-1])
    await h.core.shutdown()

    h2 = await make_harness(tmp_path, fake_openai)  # a second restart has nothing left to report
    assert h2.platform.plain("c9") == []
    assert (await h2.core.history("test:c9"))[0] == 2
    await h2.core.shutdown()
