"""The web channel over real HTTP: API, SSE ids/replay/resync, O(N) streaming, auth, busy, stop, titles."""

from __future__ import annotations

import asyncio
import random
import string

import aiohttp
import pytest

from channels.web.sse import StreamHub
from core.sqlite_store import SqliteStore
from core.store import StoreError
from tests.browser.server import new_session, open_stream, seq_of, start_web_chat
from tests.fakes.openai_server import Function, HttpError, Text, last_user_text
from tests.support.platforms import whole_history
from tests.support.ports import free_port


async def say(http, base, sid, text, client_id=None):
    body = {"text": text, **({"client_id": client_id} if client_id else {})}
    async with http.post(f"{base}/api/sessions/{sid}/messages", json=body) as resp:
        return resp.status, await resp.json()


def terminal_turn(ev) -> bool:
    return ev.name == "turn" and ev.data["state"] != "running"


async def test_fresh_stream_opens_with_task_state_and_ids_strictly_increase(chat, http, fake_openai):
    fake_openai.script(Text("Hello **there**, streamed in pieces.", chunk_size=3))
    sid = await new_session(http, chat.base_url)
    sse = await open_stream(http, chat.base_url, sid)
    first = await sse.next()
    assert first.name == "task_state" and first.data["turn"] is None
    assert (await say(http, chat.base_url, sid, "hi"))[0] == 202
    await sse.until(terminal_turn)  # core commits (turn_committed) before it shows the terminal state
    names = [e.name for e in sse.events]
    assert "turn" in names and "turn_committed" in names
    epochs = {seq_of(e.id)[0] for e in sse.events}
    seqs = [seq_of(e.id)[1] for e in sse.events[1:]]
    assert len(epochs) == 1
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert seq_of(sse.events[1].id)[1] > seq_of(first.id)[1]
    # increments add up to the reply; the committed delta carries the user's message and the answer
    text = ""
    for e in sse.events:
        if e.name == "turn":
            text = e.data["replace"] if "replace" in e.data else text
            text += e.data.get("append", "")
    assert text == "Hello **there**, streamed in pieces."
    committed = next(e for e in sse.events if e.name == "turn_committed")
    assert committed.data["history_revision"] == 1
    assert [(m["role"], m["content"]) for m in committed.data["messages"]] == [
        ("user", "hi"), ("assistant", "Hello **there**, streamed in pieces.")]
    async with http.get(f"{chat.base_url}/api/sessions/{sid}/history") as resp:
        hist = await resp.json()
    assert hist["history_revision"] == 1
    assert [m["id"] for m in hist["messages"]] == [m["id"] for m in committed.data["messages"]]
    assert {"id", "role", "content", "created_at"} <= set(hist["messages"][0])
    sse.resp.close()


async def test_last_event_id_replays_exactly_the_missed_events(chat, http, fake_openai):
    fake_openai.script(Text("one two three four five six seven eight nine ten", chunk_size=4, delay=0.01))
    sid = await new_session(http, chat.base_url)
    a = await open_stream(http, chat.base_url, sid)
    await a.next()
    await say(http, chat.base_url, sid, "count")
    await a.until(lambda e: e.name == "turn")
    resume_from = a.events[-1].id  # the client "disconnects" here (its Last-Event-ID)
    await a.until(lambda e: e.name == "turn_committed")
    await a.until(terminal_turn)
    missed = [e for e in a.events if e.id and seq_of(e.id)[1] > seq_of(resume_from)[1]]
    assert len(missed) >= 2

    b = await open_stream(http, chat.base_url, sid, last_event_id=resume_from)
    replayed = [await b.next() for _ in missed]
    assert [(e.id, e.name, e.data) for e in replayed] == [(e.id, e.name, e.data) for e in missed]
    # then the snapshot (DESIGN.md §6: missed events, then task_state, then live events): no turn running now
    state = await b.next()
    assert state.name == "task_state" and state.data["turn"] is None and state.data["approvals"] == []
    assert state.id == missed[-1].id
    # and nothing more: the next event on b is the next live one
    await say(http, chat.base_url, sid, "again")
    nxt = await b.next()
    assert nxt.name == "turn" and seq_of(nxt.id)[1] == seq_of(missed[-1].id)[1] + 1
    await b.until(terminal_turn)
    a.resp.close()
    b.resp.close()


async def test_a_replay_mid_turn_ends_with_the_turn_so_far_then_goes_live(chat, http, fake_openai):
    hold = asyncio.Event()
    fake_openai.script(Text("first part, then the rest", chunk_size=3, hold=hold, hold_after=11))
    sid = await new_session(http, chat.base_url)
    a = await open_stream(http, chat.base_url, sid)
    await a.next()
    await say(http, chat.base_url, sid, "go", client_id="c-7")
    first_turn = await a.until(lambda e: e.name == "turn")
    await a.until(lambda e: e.name == "turn" and "first part" in chat.hub.get(sid).live.text)
    b = await open_stream(http, chat.base_url, sid, last_event_id=first_turn.id)
    missed = [e for e in a.events if seq_of(e.id)[1] > seq_of(first_turn.id)[1]]
    assert [(await b.next()).id for _ in missed] == [e.id for e in missed]
    state = await b.next()
    assert state.name == "task_state" and state.id == a.events[-1].id
    assert state.data["turn"]["state"] == "running" and state.data["turn"]["client_id"] == "c-7"
    assert state.data["turn"]["text"].startswith("first part")
    hold.set()
    end = await b.until(lambda e: e.name == "turn" and e.data["state"] != "running")
    assert seq_of(end.id)[1] > seq_of(state.id)[1]
    a.resp.close()
    b.resp.close()


async def test_wrong_epoch_or_evicted_id_gets_resync_required_then_task_state(tmp_path, fake_openai, http):
    chat = await start_web_chat(tmp_path, fake_openai, hub=StreamHub(max_events=4))
    try:
        fake_openai.script(Text("a fairly long answer that takes several events to stream", chunk_size=2,
                                delay=0.005))
        sid = await new_session(http, chat.base_url)
        a = await open_stream(http, chat.base_url, sid)
        opening = await a.next()
        await say(http, chat.base_url, sid, "go")
        await a.until(terminal_turn)
        for _ in range(5):  # a loaded host may show a reply in fewer events: another turn adds more
            if len(a.events) > 6:
                break
            await say(http, chat.base_url, sid, "more")
            await a.until(terminal_turn)
        assert len(a.events) > 6  # more than the buffer holds
        epoch, _ = seq_of(opening.id)

        for stale in (f"{epoch}-1", f"other{epoch}-3", f"{epoch}-999999", "garbage"):
            b = await open_stream(http, chat.base_url, sid, last_event_id=stale)
            first, second = await b.next(), await b.next()
            assert first.name == "resync_required", stale
            assert second.name == "task_state"
            assert second.id == a.events[-1].id
            b.resp.close()
        # the newest buffered id still resumes
        c = await open_stream(http, chat.base_url, sid, last_event_id=a.events[-3].id)
        assert [(await c.next()).id for _ in range(2)] == [a.events[-2].id, a.events[-1].id]
        c.resp.close()
        a.resp.close()
        hub = chat.hub.get(sid)
        assert hub is not None and hub.buffered <= 4
    finally:
        await chat.close()


async def test_a_failed_turns_notice_is_in_its_delta_and_in_history(chat, http, fake_openai):
    fake_openai.script(HttpError.auth())
    sid = await new_session(http, chat.base_url)
    sse = await open_stream(http, chat.base_url, sid)
    await sse.next()
    await say(http, chat.base_url, sid, "hi")
    committed = await sse.until(lambda e: e.name == "turn_committed")
    end = await sse.until(terminal_turn)
    assert end.data["state"] == "failed"
    assert [(m["role"], m["kind"], m["content"]) for m in committed.data["messages"]] == [
        ("user", "user_input", "hi"), ("assistant", "notice", end.data["error"])]
    async with http.get(f"{chat.base_url}/api/sessions/{sid}/history") as resp:
        body = await resp.json()
    assert body["history_revision"] == committed.data["history_revision"] == 1
    assert [m["id"] for m in body["messages"]] == [m["id"] for m in committed.data["messages"]]
    sse.resp.close()


async def test_after_a_crash_a_resyncing_client_finds_the_restart_notice_in_history(tmp_path, fake_openai, http):
    from core.messages import MessageSource, NewMessage
    from core.sqlite_store import SqliteStore

    store = SqliteStore(tmp_path / "chat.db")  # what the killed process left: a message and its running turn
    await store.open()
    target = '{"channel":"web","chat_id":"s1","session_key":"web:s1","channel_context":{"data":{}}}'
    await store.append_message("web:s1", NewMessage(role="user", content="tell me", source=MessageSource(
        kind="user_input", from_channel="web", turn_id="t1")), begin_turn=("t1", target))
    await store.close()

    chat = await start_web_chat(tmp_path, fake_openai)
    try:
        sse = await open_stream(http, chat.base_url, "s1", last_event_id="0a1b2c3dx1-17")  # the old process's id
        assert [(await sse.next()).name for _ in range(2)] == ["resync_required", "task_state"]
        assert sse.events[1].data["turn"] is None
        async with http.get(f"{chat.base_url}/api/sessions/s1/history") as resp:
            body = await resp.json()
        assert body["history_revision"] == 1
        assert [(m["kind"], m["content"]) for m in body["messages"]] == [
            ("user_input", "tell me"), ("notice", chat.core.presenter.interrupted_by_restart())]
        sse.resp.close()
    finally:
        await chat.close()


async def test_history_pages_backwards_with_before_and_limit(chat, http, fake_openai):
    fake_openai.default = Text("answer")
    sid = await new_session(http, chat.base_url)
    sse = await open_stream(http, chat.base_url, sid)
    await sse.next()
    for i in range(6):
        await say(http, chat.base_url, sid, f"question {i}")
        await sse.until(terminal_turn)
    base = f"{chat.base_url}/api/sessions/{sid}/history"

    async with http.get(base) as resp:  # the default page holds all twelve
        body = await resp.json()
    assert body["history_revision"] == 6 and body["has_more"] is False
    everything = body["messages"]
    assert len(everything) == 12

    pages, before = [], None
    while True:
        query = {"limit": "5", **({"before": before} if before else {})}
        async with http.get(base, params=query) as resp:
            assert resp.status == 200
            body = await resp.json()
        pages.insert(0, body["messages"])
        if not body["has_more"]:
            break
        before = body["messages"][0]["id"]
    assert [len(p) for p in pages] == [2, 5, 5]
    assert [m["id"] for p in pages for m in p] == [m["id"] for m in everything]
    # the suites' reader of a whole conversation (the soak's outgrow one page) pages the same way
    assert await whole_history(http, chat.base_url, sid, page_size=5) == everything

    other = await new_session(http, chat.base_url)
    for query in ({"limit": "0"}, {"limit": "1001"}, {"limit": "ten"}, {"limit": "²"}, {"limit": "9" * 5000},
                  {"before": "not an id!"}, {"before": "0" * 32}):
        async with http.get(base, params=query) as resp:
            assert resp.status == 400, query
            assert "error" in await resp.json()
    async with http.get(f"{chat.base_url}/api/sessions/{other}/history",
                        params={"before": everything[3]["id"]}) as resp:
        assert resp.status == 400  # a message of another conversation
    async with http.get(base, params={"limit": "1000"}) as resp:
        assert resp.status == 200
    sse.resp.close()


async def test_a_20000_character_reply_costs_less_than_four_times_its_length(chat, http, fake_openai):
    rng = random.Random(7)
    reply = "".join(rng.choice(string.ascii_letters + "  \n") for _ in range(20_000))
    fake_openai.script(Text(reply, chunk_size=8))
    sid = await new_session(http, chat.base_url)
    sse = await open_stream(http, chat.base_url, sid)
    await sse.next()
    await say(http, chat.base_url, sid, "write a lot")
    await sse.until(terminal_turn, timeout=60)
    assert any(e.name == "turn_committed" for e in sse.events)
    text = ""
    for e in sse.events:
        if e.name == "turn":
            text = e.data["replace"] if "replace" in e.data else text
            text += e.data.get("append", "")
    assert text == reply
    assert sse.nbytes < 4 * 20_000, sse.nbytes
    print("bytes on the wire for 20,000 characters:", sse.nbytes)
    sse.resp.close()


async def test_two_clients_on_one_session_see_the_same_stream(chat, http, fake_openai):
    fake_openai.script(Text("shared answer for both tabs", chunk_size=3, delay=0.005))
    sid = await new_session(http, chat.base_url)
    a = await open_stream(http, chat.base_url, sid)
    b = await open_stream(http, chat.base_url, sid)
    ta, tb = await a.next(), await b.next()
    assert ta.name == tb.name == "task_state" and ta.id == tb.id
    await say(http, chat.base_url, sid, "both")
    await a.until(lambda e: e.name == "turn_committed")
    await a.until(terminal_turn)
    for _ in a.events[1:]:
        await b.next()
    assert [(e.id, e.name, e.data) for e in a.events] == [(e.id, e.name, e.data) for e in b.events]
    a.resp.close()
    b.resp.close()


async def test_a_client_joining_mid_turn_gets_the_turn_so_far_then_increments(chat, http, fake_openai):
    hold = asyncio.Event()
    fake_openai.script(Text("first half|second half", chunk_size=4, hold=hold, hold_after=10))
    sid = await new_session(http, chat.base_url)
    a = await open_stream(http, chat.base_url, sid)
    await a.next()
    await say(http, chat.base_url, sid, "go", client_id="c-1")
    await a.until(lambda e: e.name == "turn" and "first half" in chat.hub.get(sid).live.text)
    late = await open_stream(http, chat.base_url, sid)
    state = await late.next()
    assert state.name == "task_state"
    assert state.data["turn"]["state"] == "running" and state.data["turn"]["client_id"] == "c-1"
    text = state.data["turn"]["text"]
    assert text.startswith("first half")
    hold.set()
    while True:
        e = await late.next()
        if e.name == "turn":
            text = e.data.get("replace", text) + e.data.get("append", "")
            if e.data["state"] != "running":
                break
    assert text == "first half|second half"
    a.resp.close()
    late.resp.close()


async def test_busy_is_202_with_a_notice_and_duplicates_are_not_run_twice(tmp_path, fake_openai, http):
    chat = await start_web_chat(tmp_path, fake_openai, queue_capacity=1)
    try:
        hold = asyncio.Event()
        fake_openai.script(Text("slow", hold=hold), Text("second"))
        sid = await new_session(http, chat.base_url)
        sse = await open_stream(http, chat.base_url, sid)
        await sse.next()
        assert await say(http, chat.base_url, sid, "one", "m1") == (202, {"status": "queued"})
        await sse.until(lambda e: e.name == "turn")
        assert await say(http, chat.base_url, sid, "two", "m2") == (202, {"status": "queued"})
        assert await say(http, chat.base_url, sid, "two", "m2") == (202, {"status": "duplicate"})
        status, body = await say(http, chat.base_url, sid, "three", "m3")
        assert (status, body) == (202, {"status": "busy"})
        notice = await sse.until(lambda e: e.name == "notice")
        assert notice.data["client_id"] == "m3"
        assert "working on your earlier messages" in notice.data["text"]
        hold.set()
        await sse.until(lambda e: e.name == "turn_committed" and e.data["history_revision"] == 2)
        async with http.get(f"{chat.base_url}/api/sessions/{sid}/history") as resp:
            hist = await resp.json()
        assert [m["content"] for m in hist["messages"]] == ["one", "slow", "two", "second"]
        sse.resp.close()
    finally:
        await chat.close()


class FailingAppendStore(SqliteStore):
    """Storing the user's message at the start of a turn fails while ``fail_appends`` is above zero."""

    fail_appends = 0

    async def append_message(self, key, message, **kw):  # type: ignore[override]
        if self.fail_appends:
            self.fail_appends -= 1
            raise StoreError("sqlite store: append_message failed (OperationalError: disk I/O error)")
        return await super().append_message(key, message, **kw)


async def test_a_client_id_counts_as_seen_only_once_its_message_was_accepted(tmp_path, fake_openai, http):
    """Resending a message answered busy, "could not be saved" or refused at shutdown, with the same
    client_id, gets it answered; only an accepted message makes its client_id a duplicate."""
    hold = asyncio.Event()
    fake_openai.script(Text("slow", hold=hold))
    fake_openai.default = Function(lambda body: Text("echo: " + last_user_text(body).split("\n\n")[0]))
    store = FailingAppendStore(tmp_path / "chat.db")
    chat = await start_web_chat(tmp_path, fake_openai, queue_capacity=1, store=store)
    try:
        sid = await new_session(http, chat.base_url)
        sse = await open_stream(http, chat.base_url, sid)
        await sse.next()
        assert await say(http, chat.base_url, sid, "one", "m1") == (202, {"status": "queued"})
        await sse.until(lambda e: e.name == "turn")
        assert await say(http, chat.base_url, sid, "two", "m2") == (202, {"status": "queued"})
        assert await say(http, chat.base_url, sid, "busy one", "m3") == (202, {"status": "busy"})
        hold.set()
        await sse.until(lambda e: e.name == "turn_committed" and e.data["history_revision"] == 2)
        assert await say(http, chat.base_url, sid, "busy one", "m3") == (202, {"status": "queued"})
        await sse.until(lambda e: e.name == "turn_committed" and e.data["history_revision"] == 3)
        store.fail_appends = 1
        assert await say(http, chat.base_url, sid, "unsaved", "m4") == (202, {"status": "queued"})
        await sse.until(lambda e: e.name == "notice" and "could not be saved" in e.data["text"])
        assert await say(http, chat.base_url, sid, "unsaved", "m4") == (202, {"status": "queued"})
        await sse.until(lambda e: e.name == "turn_committed" and e.data["history_revision"] == 4)
        sse.resp.close()
    finally:
        await chat.close()
    chat = await start_web_chat(tmp_path, fake_openai, queue_capacity=1)
    try:
        chat.core.router.close()  # shutting down: refused
        status, body = await say(http, chat.base_url, sid, "at shutdown", "m5")
        assert status == 503 and "shutting down" in body["error"]
    finally:
        await chat.close()
    chat = await start_web_chat(tmp_path, fake_openai, queue_capacity=1)
    try:
        sse = await open_stream(http, chat.base_url, sid)
        await sse.next()
        assert await say(http, chat.base_url, sid, "at shutdown", "m5") == (202, {"status": "queued"})
        assert await say(http, chat.base_url, sid, "at shutdown", "m5") == (202, {"status": "duplicate"})
        await sse.until(lambda e: e.name == "turn_committed" and e.data["history_revision"] == 5)
        sse.resp.close()
        async with http.get(f"{chat.base_url}/api/sessions/{sid}/history") as resp:
            hist = await resp.json()
        assert [m["content"] for m in hist["messages"]] == [
            "one", "slow", "two", "echo: two", "busy one", "echo: busy one", "unsaved", "echo: unsaved",
            "at shutdown", "echo: at shutdown"]
    finally:
        await chat.close()


async def test_stop_endpoint_and_typed_commands_go_through_core(chat, http, fake_openai):
    hold = asyncio.Event()
    fake_openai.script(Text("partial answer that never ends", hold=hold, hold_after=8))
    sid = await new_session(http, chat.base_url)
    sse = await open_stream(http, chat.base_url, sid)
    await sse.next()
    await say(http, chat.base_url, sid, "start")
    await sse.until(lambda e: e.name == "turn" and e.data.get("append"))
    async with http.post(f"{chat.base_url}/api/sessions/{sid}/stop") as resp:
        assert resp.status == 200 and (await resp.json()) == {"stopped": True}
    end = await sse.until(terminal_turn)
    assert end.data["state"] == "cancelled" and "Stopped" in end.data["error"]
    hold.set()
    assert (await say(http, chat.base_url, sid, "/help"))[1] == {"status": "command"}
    notice = await sse.until(lambda e: e.name == "notice")
    assert "/stop" in notice.data["text"]
    sse.resp.close()


async def test_sessions_list_rename_and_title_event(chat, http):
    sid = await new_session(http, chat.base_url)
    sse = await open_stream(http, chat.base_url, sid)
    await sse.next()
    async with http.patch(f"{chat.base_url}/api/sessions/{sid}", json={"title": "Trip plans"}) as resp:
        assert resp.status == 200
    ev = await sse.until(lambda e: e.name == "session_title")
    assert ev.data == {"session_id": sid, "title": "Trip plans"}
    async with http.get(f"{chat.base_url}/api/sessions") as resp:
        listed = (await resp.json())["sessions"]
    assert {"id": sid, "title": "Trip plans"}.items() <= next(s for s in listed if s["id"] == sid).items()
    async with http.patch(f"{chat.base_url}/api/sessions/{sid}", json={"title": "  "}) as resp:
        assert resp.status == 400
    async with http.post(f"{chat.base_url}/api/sessions/bad%20id/messages", json={"text": "x"}) as resp:
        assert resp.status in (400, 404)
    async with http.post(f"{chat.base_url}/api/sessions/{sid}/messages", data=b"not json",
                         headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 400
    sse.resp.close()


async def test_a_closed_router_answers_503_with_a_clear_error(chat, http):
    sid = await new_session(http, chat.base_url)
    chat.core.router.close()
    status, body = await say(http, chat.base_url, sid, "hello?")
    assert status == 503 and "shutting down" in body["error"]


async def test_with_a_token_requests_without_it_get_401(tmp_path, fake_openai, http):
    chat = await start_web_chat(tmp_path, fake_openai, auth_token="s3cret-token")
    try:
        base = chat.base_url
        async with http.get(f"{base}/api/sessions") as resp:
            assert resp.status == 401
        async with http.get(f"{base}/api/sessions", headers={"Authorization": "Bearer wrong"}) as resp:
            assert resp.status == 401
        async with http.get(f"{base}/api/sessions/x/stream") as resp:
            assert resp.status == 401
        async with http.get(f"{base}/", allow_redirects=False) as resp:
            assert resp.status == 302 and resp.headers["Location"] == "/login"
        async with http.get(f"{base}/api/sessions", headers={"Authorization": "Bearer s3cret-token"}) as resp:
            assert resp.status == 200
        # the login form sets a cookie that then authorises the page and the API
        async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:  # IP host
            async with browser.post(f"{base}/login", data={"token": "nope"}, allow_redirects=False) as resp:
                assert resp.status == 302 and "failed" in resp.headers["Location"]
            async with browser.post(f"{base}/login", data={"token": "s3cret-token"}) as resp:
                assert resp.status == 200 and "<title>chatbridge</title>" in await resp.text()
            async with browser.get(f"{base}/api/sessions") as resp:
                assert resp.status == 200
    finally:
        await chat.close()


async def test_page_and_static_files_are_served_without_a_token_on_loopback(chat, http):
    async with http.get(f"{chat.base_url}/") as resp:
        assert resp.status == 200 and "/static/app.js" in await resp.text()
    for name in ("app.js", "style.css"):
        async with http.get(f"{chat.base_url}/static/{name}") as resp:
            assert resp.status == 200 and len(await resp.read()) > 500


def test_idle_streams_are_reclaimed_but_not_while_listened_to_or_running():
    now = [0.0]
    hub = StreamHub(idle_seconds=60, clock=lambda: now[0])
    quiet, listened = hub.stream("quiet"), hub.stream("listened")
    sub = listened.subscribe(10)
    quiet.append("notice", {"text": "x"})
    first_epoch = quiet.epoch
    now[0] = 59
    assert hub.reclaim_idle() == []
    now[0] = 61
    assert hub.reclaim_idle() == ["quiet"]
    assert hub.get("quiet") is None and hub.get("listened") is not None
    listened.unsubscribe(sub)
    now[0] = 200
    assert hub.reclaim_idle() == ["listened"]
    # a stream created again has a new epoch, so an old Last-Event-ID resyncs instead of matching new seqs
    again = hub.stream("quiet")
    assert again.epoch != first_epoch and again.replay_since(f"{first_epoch}-1") is None


def test_replay_buffer_is_bounded_by_bytes():
    hub = StreamHub(max_events=1000, max_bytes=2000)
    s = hub.stream("s")
    for i in range(100):
        s.append("notice", {"text": "x" * 100, "i": i})
    assert s.buffered_bytes <= 2000 and 0 < s.buffered < 100
    assert s.replay_since(f"{s.epoch}-1") is None
    assert len(s.replay_since(f"{s.epoch}-{s.seq - 3}") or []) == 3


async def test_health_reports_the_web_channel_and_close_ends_open_streams(chat, http):
    assert chat.channel.state() == "serving"
    sid = await new_session(http, chat.base_url)
    sse = await open_stream(http, chat.base_url, sid)
    await sse.next()
    await chat.channel.stop()
    await chat.channel.close()
    with pytest.raises(EOFError):
        await sse.next()
    assert chat.channel.state() == "closed"


async def test_the_web_channels_background_work_ends_with_the_cores_bounded_shutdown(chat):
    def alive() -> list[str]:
        return [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("web:") and not t.done()]

    assert sorted(alive()) == ["web:end-abandoned-streams", "web:reclaim-idle-streams"]
    await chat.channel.stop()
    assert await chat.core.shutdown() == []
    assert alive() == []  # supervised: reclaimed by the core's shutdown, not left to the channel's close
    await chat.channel.close()
    assert chat.channel.state() == "closed"


def test_run_refuses_a_non_loopback_bind_without_a_token(tmp_path, capsys):
    from bridge.cli import main

    cfg = tmp_path / "c.toml"
    cfg.write_text('[llm]\nprovider = "local"\n[web]\nhost = "0.0.0.0"\n')
    assert main(["run", "-c", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "web.auth_token" in err and "loopback" in err


async def test_run_app_serves_the_page_and_api_with_the_token(tmp_path, fake_openai):
    from bridge.app import run_app
    from bridge.config import load_config

    port = free_port()
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"""
[bridge]
data_dir = "{tmp_path / 'data'}"
[llm]
provider = "openai"
model = "fake"
base_url = "{fake_openai.base_url}"
[web]
port = {port}
auth_token = "tok-123"
""")
    stop = asyncio.Event()
    task = asyncio.create_task(run_app(load_config(cfg), config_path=str(cfg), stop=stop))
    base = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(200):  # the server listens before the web channel has started ("ready")
                try:
                    async with http.get(f"{base}/healthz") as resp:
                        if (await resp.json())["channels"] == {"web": "serving"}:
                            break
                except aiohttp.ClientConnectionError:
                    pass
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the web channel did not start serving")
            async with http.post(f"{base}/api/sessions") as resp:
                assert resp.status == 401
            auth = {"Authorization": "Bearer tok-123"}
            async with http.post(f"{base}/api/sessions", headers=auth) as resp:
                sid = (await resp.json())["id"]
            sse = await open_stream(http, base, sid, headers=auth)
            await sse.next()
            async with http.post(f"{base}/api/sessions/{sid}/messages", json={"text": "hi"}, headers=auth) as resp:
                assert resp.status == 202
            committed = await sse.until(lambda e: e.name == "turn_committed")
            assert [m["content"] for m in committed.data["messages"]] == ["hi", "ok"]
            sse.resp.close()
    finally:
        stop.set()
        assert await asyncio.wait_for(task, 15) == 0


async def test_an_idle_stream_carries_heartbeat_comments(tmp_path, fake_openai, http):
    chat = await start_web_chat(tmp_path, fake_openai)
    chat.channel.server.heartbeat = 0.05
    try:
        sid = await new_session(http, chat.base_url)
        sse = await open_stream(http, chat.base_url, sid)
        await sse.next()
        received = b""
        async with asyncio.timeout(10):
            while b": keep-alive\n\n" not in received:
                received += await sse.resp.content.readany()
        assert b"event:" not in received  # comments only, no made-up events
        sse.resp.close()
    finally:
        await chat.close()
