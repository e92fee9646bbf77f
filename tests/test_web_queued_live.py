"""Two tabs of one session over real HTTP: a message queued from one (or by an API client) reaches the other
tab's open stream at once, as a ``message_queued`` event, and once; a notice is marked for its sender only
when it answers that sender alone. (A ``/new`` sent without a client id: tests/test_web_message_ids.py.)"""

from __future__ import annotations

import asyncio

from channels.web.sse import StreamHub
from tests.browser.server import new_session, open_stream, start_web_chat
from tests.fakes.openai_server import Text


async def say(http, base, sid, text, client_id=None):
    body = {"text": text, **({"client_id": client_id} if client_id else {})}
    async with http.post(f"{base}/api/sessions/{sid}/messages", json=body) as resp:
        return resp.status, await resp.json()


async def test_a_message_queued_in_one_tab_reaches_the_other_tabs_stream_at_once_and_once(tmp_path, fake_openai,
                                                                                          http):
    chat = await start_web_chat(tmp_path, fake_openai, queue_capacity=2)
    try:
        hold = asyncio.Event()
        fake_openai.script(Text("slow answer", chunk_size=3, hold=hold, hold_after=6), Text("answer two"))
        sid = await new_session(http, chat.base_url)
        tab_a = await open_stream(http, chat.base_url, sid)
        tab_b = await open_stream(http, chat.base_url, sid)
        assert (await tab_a.next()).name == (await tab_b.next()).name == "task_state"
        assert await say(http, chat.base_url, sid, "one", "m1") == (202, {"status": "queued"})
        await tab_b.until(lambda e: e.name == "turn" and e.data.get("client_id") == "m1")
        # tab A sends while the reply is being written: tab B is told before anything else happens
        assert await say(http, chat.base_url, sid, "two", "m2") == (202, {"status": "queued"})
        queued = await tab_b.until(lambda e: e.name != "turn")
        assert (queued.name, queued.data) == ("message_queued", {"session_id": sid, "text": "two",
                                                                 "attachments": [], "client_id": "m2"})
        hold.set()
        await tab_b.until(lambda e: e.name == "turn" and e.data.get("client_id") == "m2")
        await tab_b.until(lambda e: e.name == "turn" and e.data["state"] != "running"
                          and chat.hub.get(sid).live.client_id == "m2")
        # each told once (m1 too: queued for the moment before its turn began)
        assert [e.data["client_id"] for e in tab_b.events if e.name == "message_queued"] == ["m1", "m2"]
        # a reconnect replays it once and lists it no more: its turn began
        again = await open_stream(http, chat.base_url, sid, last_event_id=tab_b.events[0].id)
        replayed = [await again.next() for _ in range(len(tab_b.events))]
        assert [e.data["client_id"] for e in replayed if e.name == "message_queued"] == ["m1", "m2"]
        assert replayed[-1].name == "task_state" and replayed[-1].data["queued"] == []
        for sse in (tab_a, tab_b, again):
            sse.resp.close()
    finally:
        await chat.close()


async def test_a_busy_notice_and_a_commands_answer_are_marked_for_their_sender_only(tmp_path, fake_openai, http):
    """A stream does not know which tab it feeds: the page keeps a ``sender_only`` notice only when it sent
    the message the notice names."""
    chat = await start_web_chat(tmp_path, fake_openai, queue_capacity=1)
    try:
        hold = asyncio.Event()
        fake_openai.script(Text("slow", hold=hold), Text("second"))
        sid = await new_session(http, chat.base_url)
        tab = await open_stream(http, chat.base_url, sid)
        await tab.next()
        assert await say(http, chat.base_url, sid, "one", "m1") == (202, {"status": "queued"})
        await tab.until(lambda e: e.name == "turn")
        assert await say(http, chat.base_url, sid, "two", "m2") == (202, {"status": "queued"})
        assert await say(http, chat.base_url, sid, "three", "m3") == (202, {"status": "busy"})
        busy = await tab.until(lambda e: e.name == "notice")
        assert (busy.data["client_id"], busy.data.get("sender_only")) == ("m3", True)
        assert await say(http, chat.base_url, sid, "/help", "h1") == (202, {"status": "command"})
        answer = await tab.until(lambda e: e.name == "notice")
        assert (answer.data["client_id"], answer.data.get("sender_only")) == ("h1", True)
        assert await say(http, chat.base_url, sid, "/help") == (202, {"status": "command"})  # an API client
        answer = await tab.until(lambda e: e.name == "notice")
        assert answer.data["client_id"] is None and "sender_only" not in answer.data  # no tab to tell apart
        hold.set()
        tab.resp.close()
    finally:
        await chat.close()


def test_a_message_queued_through_another_process_is_listed_until_its_new_drops_it():
    """With several processes, a page that connects to one of them lists what the others queued."""
    stream = StreamHub().stream("s1")
    stream.apply_remote("message_queued", {"session_id": "s1", "text": "two", "attachments": [], "client_id": "m2"})
    stream.apply_remote("message_queued", {"session_id": "s1", "text": "three", "attachments": [], "client_id": "m3"})
    assert stream.task_state_data()["queued"] == [{"text": "two", "attachments": [], "client_id": "m2"},
                                                  {"text": "three", "attachments": [], "client_id": "m3"}]
    stream.apply_remote("notice", {"text": "new conversation", "client_id": None, "at": 0.0, "dropped": ["m2"]})
    assert [q["client_id"] for q in stream.task_state_data()["queued"]] == ["m3"]
