"""The web chat's event streams at the HTTP level: a session stream that carries the conversation-list feed
too (``?feed=1``, the page's one connection), and what a client that stops reading may cost: its queue is cut
off past the replay buffer's bytes, and its connection is closed once it takes no data for the write timeout
(a raw socket that never reads)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable

from channels.web.sse import BATCH_BYTES, HEARTBEAT, StreamHub, Subscriber
from tests.browser.server import SSEClient, WebChat, new_session, open_stream, start_web_chat

WAIT = 10.0
BIG = "x" * 20_000


async def until(pred: Callable[[], bool], timeout: float = WAIT) -> None:
    """Wait (bounded) for the server to get where the test needs it; polling, as the server's reaper does."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not pred():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


# ---- ?feed=1 ------------------------------------------------------------------------------------------


async def test_a_session_stream_with_feed_1_carries_the_conversation_list_feed_without_ids(chat, http):
    sid = await new_session(http, chat.base_url)
    resp = await http.get(f"{chat.base_url}/api/sessions/{sid}/stream?feed=1")
    assert resp.status == 200
    both = SSEClient(resp)
    plain = await open_stream(http, chat.base_url, sid)
    first = await both.next()
    assert first.name == "task_state" and (await plain.next()).name == "task_state"
    other = await new_session(http, chat.base_url)  # created elsewhere: a feed event
    created = await both.until(lambda e: e.name != "task_state")
    assert created.name == "session_created" and created.data["session_id"] == other
    assert created.id is None  # a feed event leaves the session stream's Last-Event-ID alone
    chat.hub.stream(sid).append("notice", {"text": "marker", "client_id": None, "at": 0})
    assert (await both.next()).data["text"] == "marker"
    # without the parameter a session stream carries its session's events only
    assert (await plain.next()).data["text"] == "marker"
    assert [e.name for e in plain.events] == ["task_state", "notice"]
    both.resp.close()
    plain.resp.close()
    await until(lambda: not chat.channel._feed)  # the connection leaves the feed with the stream


# ---- what a connection's pump takes at once ------------------------------------------------------------


async def test_events_waiting_together_leave_in_one_write_up_to_the_batch_bound_then_the_end():
    sub = Subscriber(max_pending=100)
    for name in ("a", "b", "c"):
        sub.push(f"event: {name}\n\n".encode())
    assert await sub.next() == b"event: a\n\nevent: b\n\nevent: c\n\n"
    assert sub.pending_bytes == 0
    big = b"x" * (BATCH_BYTES // 2 + 1)
    for _ in range(3):
        sub.push(big)
    assert await sub.next() == big + big  # past the bound: the third waits for the next write
    sub.push(b"last\n\n")
    sub.close()
    assert await sub.next() == big + b"last\n\n"  # what was queued before the end still goes
    assert await sub.next() is None
    assert await sub.next() is None


async def test_an_idle_connection_gets_a_heartbeat_from_the_once_a_second_pass(chat, http):
    server = chat.channel.server
    server.heartbeat = 0.0
    sid = await new_session(http, chat.base_url)
    sse = await open_stream(http, chat.base_url, sid)
    await sse.next()
    await subscribed(chat, sid)
    assert server.reap_closed() == 0  # nobody left: nothing ended, a heartbeat queued
    async with asyncio.timeout(WAIT):
        received = b""
        while HEARTBEAT not in received:
            received += await sse.resp.content.readany()
    sse.resp.close()


# ---- a client that stops reading ----------------------------------------------------------------------


def stalled_reader(base_url: str, sid: str) -> socket.socket:
    """A raw connection that asks for the session's stream and then never reads."""
    port = int(base_url.rsplit(":", 1)[1])
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(f"GET /api/sessions/{sid}/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    return s


async def subscribed(chat: WebChat, sid: str) -> Subscriber:
    await until(lambda: (s := chat.hub.get(sid)) is not None and len(s.subscribers) == 1)
    stream = chat.hub.get(sid)
    assert stream is not None
    return next(iter(stream.subscribers))


def queued_bytes(sub: Subscriber) -> int:
    return sum(len(b) for b in list(sub.queue._queue) if b)


async def read_to_the_end(sock: socket.socket) -> bytes:
    """Everything the server sends on ``sock`` until it closes the connection (bounded wait)."""
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    chunks = []
    async with asyncio.timeout(WAIT):
        while True:
            try:
                chunk = await loop.sock_recv(sock, 1 << 20)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


async def test_a_reader_that_stops_reading_is_cut_off_past_the_replay_buffers_bytes(tmp_path, fake_openai, http):
    hub = StreamHub(max_bytes=256 * 1024)  # the replay buffer; a subscriber may hold no more than that
    chat = await start_web_chat(tmp_path, fake_openai, hub=hub)
    sock = None
    try:
        sid = await new_session(http, chat.base_url)
        sock = stalled_reader(chat.base_url, sid)
        sub = await subscribed(chat, sid)
        stream = chat.hub.stream(sid)
        appended = 0
        while not sub.overflowed and appended < 2500:  # 50 MB at most (the count bound, 5000, stays far)
            stream.append("notice", {"text": BIG, "client_id": None, "at": appended})
            appended += 1
            if appended % 10 == 0:
                await asyncio.sleep(0)  # the connection takes what the sockets' buffers hold
        assert sub.overflowed, f"{appended} events ({queued_bytes(sub) / 1e6:.1f} MB) waiting and not cut off"
        assert queued_bytes(sub) <= hub.max_bytes
        stream.append("notice", {"text": BIG, "client_id": None, "at": -1})
        assert queued_bytes(sub) <= hub.max_bytes  # nothing more is queued for it
        assert list(sub.queue._queue)[-1] is None  # its connection ends once its pump gets there
        # the reader wakes up: it gets what was queued, then the end of its connection, and reconnects with
        # the last id it got: a replay of what it missed, or a resync
        received = await read_to_the_end(sock)
        assert received.endswith(b"\r\n0\r\n\r\n")  # the last chunk: the response ended
        last = received.rsplit(b"\nid: ", 1)[1].split(b"\n", 1)[0].decode()
        again = await open_stream(http, chat.base_url, sid, last_event_id=last)
        first = await again.next()
        assert first.name in ("notice", "resync_required")
        again.resp.close()
    finally:
        if sock is not None:
            sock.close()
        await chat.close()


async def test_a_connection_that_takes_no_data_for_the_write_timeout_is_closed(chat, http):
    server = chat.channel.server
    server.write_timeout = 0.5
    server.max_pending_bytes = 64 * 1024 * 1024  # not cut off by its queue's bytes: its pump stays in a write
    sid = await new_session(http, chat.base_url)
    other = await new_session(http, chat.base_url)
    fast = await open_stream(http, chat.base_url, other)
    await fast.next()
    sock = stalled_reader(chat.base_url, sid)
    try:
        await subscribed(chat, sid)
        stream = chat.hub.stream(sid)
        for i in range(500):  # 10 MB: far past what the sockets' buffers take
            stream.append("notice", {"text": BIG, "client_id": None, "at": i})
            if i % 10 == 0:
                await asyncio.sleep(0)
        # the pump is stuck in a write: within the timeout (and a check's step) the server hangs up
        await until(lambda: not stream.subscribers and server.slots.open == 1)
        assert server.slots.by_client == {"127.0.0.1": 1}
        await read_to_the_end(sock)  # the client sees its connection end
        # the other session's stream was never held up
        chat.hub.stream(other).append("notice", {"text": "still flowing", "client_id": None, "at": 0})
        assert (await fast.until(lambda e: e.name == "notice")).data["text"] == "still flowing"
    finally:
        sock.close()
        fast.resp.close()
