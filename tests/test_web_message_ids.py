"""Which page message is which, over real HTTP: a user message in history and in its ``turn_committed`` delta
names the ``client_id`` it was sent with, and the notice of a ``/new`` names the queued messages it left
unanswered (``dropped``), so the page can tell its messages apart by id, never by text."""

from __future__ import annotations

import asyncio

import pytest

from tests.browser.server import new_session, open_stream, start_web_chat
from tests.fakes.openai_server import Text


async def say(http, base, sid, text, client_id=None):
    body = {"text": text, **({"client_id": client_id} if client_id else {})}
    async with http.post(f"{base}/api/sessions/{sid}/messages", json=body) as resp:
        return resp.status, await resp.json()


async def test_user_messages_carry_their_client_id_in_history_and_delta(chat, http, fake_openai):
    fake_openai.script(Text("first yes", chunk_size=3), Text("second yes", chunk_size=3), Text("anon"))
    sid = await new_session(http, chat.base_url)
    sse = await open_stream(http, chat.base_url, sid)
    await sse.next()
    for revision, (text, cid) in enumerate([("yes", "cid-1"), ("yes", "cid-2"), ("no id", None)], start=1):
        assert await say(http, chat.base_url, sid, text, cid) == (202, {"status": "queued"})
        delta = await sse.until(lambda e, r=revision: e.name == "turn_committed" and e.data["history_revision"] == r)
        user = [m for m in delta.data["messages"] if m["role"] == "user"]
        assert [(m["content"], m["client_id"]) for m in user] == [(text, cid)]
    async with http.get(f"{chat.base_url}/api/sessions/{sid}/history") as resp:
        hist = await resp.json()
    assert [(m["content"], m.get("client_id", "absent")) for m in hist["messages"]] == [
        ("yes", "cid-1"), ("first yes", "absent"), ("yes", "cid-2"), ("second yes", "absent"),
        ("no id", None), ("anon", "absent")]
    sse.resp.close()


@pytest.mark.parametrize("new_id", ["n1", None], ids=["from_a_tab", "from_an_api_client"])
async def test_the_notice_of_new_names_the_messages_it_left_unanswered(tmp_path, fake_openai, http, new_id):
    """Sent with a client id or without one, the notice of a ``/new`` names the queued messages it dropped, and
    for every tab (not ``sender_only``): each drops them."""
    chat = await start_web_chat(tmp_path, fake_openai, queue_capacity=2)
    try:
        hold = asyncio.Event()
        fake_openai.script(Text("slow answer that /new stops", chunk_size=3, hold=hold, hold_after=6),
                           Text("after new"))
        sid = await new_session(http, chat.base_url)
        sse = await open_stream(http, chat.base_url, sid)
        await sse.next()
        assert await say(http, chat.base_url, sid, "one", "m1") == (202, {"status": "queued"})
        await sse.until(lambda e: e.name == "turn")
        assert await say(http, chat.base_url, sid, "two", "m2") == (202, {"status": "queued"})
        assert await say(http, chat.base_url, sid, "three", "m3") == (202, {"status": "queued"})
        assert await say(http, chat.base_url, sid, "/new", new_id) == (202, {"status": "command"})
        hold.set()
        notice = await sse.until(lambda e: e.name == "notice" and "not answered" in e.data["text"])
        assert notice.data["client_id"] == new_id
        assert notice.data["dropped"] == ["m2", "m3"]
        assert "sender_only" not in notice.data
        # a message sent after /new is answered, and a later notice names nothing
        assert await say(http, chat.base_url, sid, "four", "m4") == (202, {"status": "queued"})
        await sse.until(lambda e: e.name == "turn_committed" and any(m["content"] == "after new"
                                                                     for m in e.data["messages"]))
        assert await say(http, chat.base_url, sid, "/help", "h1") == (202, {"status": "command"})
        help_notice = await sse.until(lambda e: e.name == "notice" and e.data["client_id"] == "h1")
        assert "dropped" not in help_notice.data
        sse.resp.close()
    finally:
        await chat.close()


async def test_task_state_lists_the_messages_queued_until_their_turn_begins(tmp_path, fake_openai, http):
    chat = await start_web_chat(tmp_path, fake_openai, queue_capacity=3)
    try:
        hold, hold_two = asyncio.Event(), asyncio.Event()
        fake_openai.script(Text("slow answer", chunk_size=3, hold=hold, hold_after=6),
                           Text("answer two", chunk_size=3, hold=hold_two, hold_after=3), Text("after new"))
        sid = await new_session(http, chat.base_url)
        sse = await open_stream(http, chat.base_url, sid)
        first = await sse.next()
        assert first.name == "task_state" and first.data["queued"] == []
        assert await say(http, chat.base_url, sid, "one", "m1") == (202, {"status": "queued"})
        await sse.until(lambda e: e.name == "turn")
        assert await say(http, chat.base_url, sid, "two", "m2") == (202, {"status": "queued"})
        assert await say(http, chat.base_url, sid, "three", "m3") == (202, {"status": "queued"})
        assert await say(http, chat.base_url, sid, "no id") == (202, {"status": "queued"})  # nothing to match
        reload = await open_stream(http, chat.base_url, sid)
        state = await reload.next()
        assert state.name == "task_state" and state.data["turn"]["client_id"] == "m1"
        assert state.data["queued"] == [{"text": "two", "attachments": [], "client_id": "m2"},
                                        {"text": "three", "attachments": [], "client_id": "m3"}]
        reload.resp.close()
        hold.set()  # m2's turn begins: it is no longer queued
        await sse.until(lambda e: e.name == "turn" and e.data.get("client_id") == "m2")
        reload = await open_stream(http, chat.base_url, sid)
        state = await reload.next()
        assert [q["client_id"] for q in state.data["queued"]] == ["m3"]
        reload.resp.close()
        # a /new leaves the waiting ones unanswered: listed no more, even before its notice
        assert await say(http, chat.base_url, sid, "/new", "n1") == (202, {"status": "command"})
        reload = await open_stream(http, chat.base_url, sid)
        state = await reload.next()
        assert state.data["queued"] == []
        reload.resp.close()
        hold_two.set()
        notice = await sse.until(lambda e: e.name == "notice" and e.data["client_id"] == "n1")
        assert notice.data["dropped"] == ["m3"]
        sse.resp.close()
    finally:
        await chat.close()
