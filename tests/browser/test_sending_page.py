"""Sending on the chat page in headless Chromium: a message is never lost and never answered twice.

A POST whose answer is lost is sent again with the same client_id (the server answers "duplicate"); one that
keeps failing stays on the page as "not sent" with Resend (the same client_id) and Edit; a "busy" answer or a
/new that dropped a queued message leaves it "not queued" with its notice shown once. Also: out-of-order full
history fetches, a queued message whose text repeats an earlier one, and an approval whose answer was lost.
Faults are injected with Playwright routes that hold or drop exactly the request a test names."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest

from tests.browser.conftest import CHROMIUM
from tests.browser.server import RecordingTool, registry, start_web_chat
from tests.browser.test_chat_page import open_page, send
from tests.fakes.openai_server import Text, ToolCalls

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (apt-get install chromium)")

WAIT = 10.0  # seconds: every wait of these tests is bounded
BUSY = "was not queued"  # in core's busy notice
FAST_RETRIES = "window.chatbridge.app.sendRetryDelays = [20, 20, 20]"
# Counts the page's history requests and their answers once handled (a timer after the answer's handlers).
COUNT_HISTORY = """
window.__hist = { asked: 0, done: 0 };
const realFetch = window.fetch;
window.fetch = function (url, init) {
  const p = realFetch.apply(this, arguments);
  if (!String(url).includes("/history")) return p;
  window.__hist.asked++;
  const count = () => setTimeout(() => { window.__hist.done++; }, 0);
  return p.then((r) => { const json = r.json.bind(r); r.json = () => json().finally(count); return r; },
                (e) => { count(); throw e; });
};
"""


async def history(http: Any, base: str, sid: str) -> dict[str, Any]:
    async with http.get(f"{base}/api/sessions/{sid}/history") as resp:
        return dict(await resp.json())


async def user_texts(http: Any, base: str, sid: str) -> list[str]:
    return [m["content"] for m in (await history(http, base, sid))["messages"] if m["role"] == "user"]


async def record_posts(page: Any) -> list[tuple[int, str]]:
    """(status, body) of every message POST answer the page gets from now on (until another route takes over)."""
    answers: list[tuple[int, str]] = []

    async def passed_on(route: Any) -> None:
        resp = await route.fetch()
        answers.append((resp.status, await resp.text()))
        await route.fulfill(response=resp)

    await page.route("**/messages", passed_on)
    return answers


async def until(predicate: Any, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + WAIT
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"not in time: {what}"
        await asyncio.sleep(0.02)


async def test_a_message_whose_answer_was_lost_is_sent_again_and_answered_once(browser, chat, fake_openai, http):
    from playwright.async_api import expect

    hold = asyncio.Event()  # the reply waits: its commit cannot tell the page before the retry does
    fake_openai.script(Text("reply one", chunk_size=3, hold=hold, hold_after=3), Text("reply two", chunk_size=3))
    page = await open_page(browser, chat.base_url + "/")
    await page.evaluate(FAST_RETRIES)
    sid = await page.evaluate("window.chatbridge.app.session")
    bodies: list[dict[str, Any]] = []
    posts: list[tuple[int, str]] = []

    async def store_then_drop(route: Any) -> None:
        bodies.append(json.loads(route.request.post_data))
        resp = await route.fetch()  # the server stores it ...
        if len(bodies) == 1:
            await route.abort("connectionreset")  # ... and the page never sees the answer
        else:
            posts.append((resp.status, await resp.text()))
            await route.fulfill(response=resp)

    await page.route("**/messages", store_then_drop)
    await send(page, "important question")
    await until(lambda: posts, "the second POST's answer")
    assert len(bodies) == 2 and bodies[0]["client_id"] == bodies[1]["client_id"]  # sent again, same id
    assert posts == [(202, '{"status": "duplicate"}')]
    hold.set()
    await expect(page.locator("#messages .msg.assistant:not(.live)")).to_have_text(["reply one"])
    await expect(page.locator(".msg.user.pending, .msg.user.unsent")).to_have_count(0)
    await expect(page.locator(".notice")).to_have_count(0)  # no "Not sent"
    assert await user_texts(http, chat.base_url, sid) == ["important question"]


async def test_a_message_that_cannot_be_sent_stays_with_resend_and_edit(browser, chat, fake_openai, http, tmp_path):
    from playwright.async_api import expect

    fake_openai.script(Text("summary: fine", chunk_size=3))
    report = tmp_path / "report.txt"
    report.write_text("quarterly numbers\n" * 10)
    page = await open_page(browser, chat.base_url + "/")
    await page.evaluate(FAST_RETRIES)
    sid = await page.evaluate("window.chatbridge.app.session")
    await page.set_input_files("#files", str(report))
    await expect(page.locator("#outgoing .chip:not(.uploading)")).to_have_count(1)

    failed: list[str] = []

    async def refuse(route: Any) -> None:  # the network, then the bridge shutting down
        failed.append(json.loads(route.request.post_data)["client_id"])
        if len(failed) == 1:
            await route.abort("connectionfailed")
        else:
            await route.fulfill(status=503, content_type="application/json",
                                body='{"error": "the bridge is shutting down; send the message again in a minute"}')

    await page.route("**/messages", refuse)
    await send(page, "please summarise the attached report")
    unsent = page.locator(".msg.user.unsent")
    await expect(unsent).to_have_count(1)
    await expect(unsent).to_contain_text("please summarise the attached report")
    await expect(unsent).to_contain_text("Not sent: the bridge is shutting down")
    await expect(unsent.locator(".attachments")).to_contain_text("report.txt")
    assert len(failed) == 4 and len(set(failed)) == 1  # the first try and three more, one client_id

    # Edit: the text and the file go back into the composer
    await unsent.locator("button.edit").click()
    await expect(unsent).to_have_count(0)
    assert await page.input_value("#input") == "please summarise the attached report"
    await expect(page.locator("#outgoing .chip")).to_contain_text("report.txt")

    # sent again, it fails again; Resend once the bridge is back sends it with the same client_id
    await page.press("#input", "Enter")
    await expect(unsent).to_have_count(1)
    await page.unroute("**/messages")
    ids: list[str] = []
    await page.route("**/messages", lambda r: (ids.append(json.loads(r.request.post_data)["client_id"]),
                                               asyncio.ensure_future(r.continue_()))[1])
    await unsent.locator("button.resend").click()
    await expect(page.locator("#messages .msg.assistant:not(.live)")).to_have_text(["summary: fine"])
    await expect(page.locator(".msg.user.pending, .msg.user.unsent")).to_have_count(0)
    assert ids == [failed[-1]]
    assert await user_texts(http, chat.base_url, sid) == ["please summarise the attached report"]
    assert [a["name"] for a in (await history(http, chat.base_url, sid))["messages"][0]["attachments"]] \
        == ["report.txt"]


@pytest.fixture
async def one_waiting(tmp_path, fake_openai):
    """A web chat whose session queue holds one waiting message: the next one is answered busy."""
    wc = await start_web_chat(tmp_path, fake_openai, queue_capacity=1)
    try:
        yield wc
    finally:
        await wc.close()


async def running_and_one_queued(page: Any, fake_openai: Any, hold: asyncio.Event, *replies: str) -> None:
    from playwright.async_api import expect

    fake_openai.script(Text("first reply, held here then done", chunk_size=4, hold=hold, hold_after=12),
                       *(Text(r, chunk_size=3) for r in replies))
    posts = await record_posts(page)
    await send(page, "msg A")
    await expect(page.locator("#live .msg.assistant.live")).to_contain_text("first reply")
    await send(page, "msg B")
    await until(lambda: len(posts) == 2, "B queued")
    assert posts[1] == (202, '{"status": "queued"}')


async def test_a_busy_answer_whose_notice_was_missed_leaves_the_message_not_queued(browser, one_waiting,
                                                                                   fake_openai, http):
    from playwright.async_api import expect

    chat = one_waiting
    hold = asyncio.Event()
    page = await open_page(browser, chat.base_url + "/")
    sid = await page.evaluate("window.chatbridge.app.session")
    await running_and_one_queued(page, fake_openai, hold, "second reply", "third reply")
    # the stream is away (its busy notice will never reach the page): the POST's answer alone tells
    await page.evaluate("window.chatbridge.app.stream.close()")
    await send(page, "msg C")
    unsent = page.locator(".msg.user.unsent")
    await expect(unsent).to_have_count(1)
    await expect(unsent).to_contain_text("msg C")
    await expect(unsent).to_contain_text(BUSY)
    await expect(page.locator(".msg.user.pending")).to_have_text(["msg A", "msg B"])  # running, queued

    hold.set()
    await page.evaluate(f"window.chatbridge.openSession({json.dumps(sid)})")  # the stream is back
    await expect(page.locator("#messages .msg.assistant:not(.live)")).to_have_count(2)
    await expect(page.locator(".msg.user.pending")).to_have_count(0)
    await expect(unsent).to_have_count(1)  # C still waits for its Resend
    await unsent.locator("button.resend").click()
    await expect(page.locator("#messages .msg.assistant:not(.live)")).to_have_count(3)
    await expect(page.locator(".msg.user.pending, .msg.user.unsent")).to_have_count(0)
    assert await user_texts(http, chat.base_url, sid) == ["msg A", "msg B", "msg C"]


async def test_a_busy_notice_shows_once_on_the_message_it_refused(browser, one_waiting, fake_openai):
    from playwright.async_api import expect

    chat = one_waiting
    hold = asyncio.Event()
    page = await open_page(browser, chat.base_url + "/")
    await running_and_one_queued(page, fake_openai, hold, "second reply")
    posts = await record_posts(page)
    await send(page, "msg C")
    await until(lambda: posts, "C's answer")
    assert posts == [(202, '{"status": "busy"}')]
    unsent = page.locator(".msg.user.unsent")
    await expect(unsent).to_have_count(1)
    await expect(unsent).to_contain_text("msg C")
    await expect(page.locator("#messages", has_text=BUSY)).to_have_count(1)
    # the notice comes on the stream too (before the replies that follow it there): shown once, in the message
    hold.set()
    await expect(page.locator("#messages .msg.assistant:not(.live)")).to_have_count(2)
    await expect(page.locator(".notice", has_text=BUSY)).to_have_count(0)
    assert (await page.locator("#messages").inner_text()).count(BUSY) == 1


async def test_a_message_queued_before_new_is_shown_as_not_answered(browser, one_waiting, fake_openai):
    from playwright.async_api import expect

    chat = one_waiting
    hold = asyncio.Event()
    page = await open_page(browser, chat.base_url + "/")
    await running_and_one_queued(page, fake_openai, hold, "fresh answer")
    await send(page, "/new")
    hold.set()
    await expect(page.locator(".notice", has_text="Started a new conversation")).to_have_count(1)
    unsent = page.locator(".msg.user.unsent")
    await expect(unsent).to_have_count(1)
    await expect(unsent).to_contain_text("msg B")
    await expect(unsent).to_contain_text("Not answered")
    await expect(page.locator(".msg.user.pending")).to_have_count(0)
    await unsent.locator("button.resend").click()  # into the new conversation
    await expect(page.locator("#messages .msg.assistant:not(.live)", has_text="fresh answer")).to_have_count(1)
    await expect(page.locator(".msg.user.pending, .msg.user.unsent")).to_have_count(0)


async def test_a_queued_message_shows_after_a_reload_and_in_another_tab_once(browser, chat, fake_openai, http,
                                                                             tmp_path):
    """A message queued behind a running reply is not in the history yet: a reload, another tab and a
    reconnect of the tab that sent it all show it (greyed, with its file) from ``task_state``'s ``queued``,
    once, and it is answered once."""
    from playwright.async_api import expect

    hold = asyncio.Event()
    notes = tmp_path / "notes.txt"
    notes.write_text("some notes\n")
    page = await open_page(browser, chat.base_url + "/")
    sid = await page.evaluate("window.chatbridge.app.session")
    fake_openai.script(Text("first reply, held here then done", chunk_size=4, hold=hold, hold_after=12),
                       Text("second reply", chunk_size=3))
    posts = await record_posts(page)
    await send(page, "msg A")
    await expect(page.locator("#live .msg.assistant.live")).to_contain_text("first reply")
    await page.set_input_files("#files", str(notes))
    await expect(page.locator("#outgoing .chip:not(.uploading)")).to_have_count(1)
    await send(page, "msg B")
    await until(lambda: len(posts) == 2, "B queued")
    assert posts[1] == (202, '{"status": "queued"}')

    pending = ".msg.user.pending"
    other = await open_page(browser, f"{chat.base_url}/#{sid}")  # another tab
    await expect(other.locator(pending)).to_have_text(["msg B📎 notes.txt (11 bytes)"])
    await expect(other.locator(pending + " .attachments a.file")).to_have_text(["📎 notes.txt (11 bytes)"])
    await page.evaluate(f"window.chatbridge.openSession({json.dumps(sid)})")  # the sender's stream reconnects
    await expect(page.locator("#messages .msg.user:not(.pending)")).to_have_text(["msg A"])
    await expect(page.locator(pending)).to_have_count(1)  # its own entry, matched by client_id
    await expect(page.locator(pending)).to_contain_text("msg B")
    await page.reload()
    await page.wait_for_selector("body[data-ready='1']")
    await expect(page.locator("#live .msg.assistant.live")).to_contain_text("first reply")
    await expect(page.locator(pending)).to_have_count(1)
    await expect(page.locator(pending)).to_contain_text("msg B")

    hold.set()
    for p in (page, other):
        await expect(p.locator("#messages .msg.assistant:not(.live)")).to_have_text(
            ["first reply, held here then done", "second reply"])
        await expect(p.locator(".msg.user.pending, .msg.user.unsent")).to_have_count(0)
        await expect(p.locator("#messages .msg.user")).to_have_count(2)
        await expect(p.locator("#messages .msg.user").nth(1)).to_contain_text("msg B")
    assert await user_texts(http, chat.base_url, sid) == ["msg A", "msg B"]


async def test_an_older_full_fetch_answering_last_does_not_hide_the_reply(browser, chat, fake_openai, http):
    from playwright.async_api import expect

    hold = asyncio.Event()
    fake_openai.script(Text("THE REPLY that must stay on screen", chunk_size=4, hold=hold, hold_after=8))
    page = await browser.new_page()
    await page.add_init_script(COUNT_HISTORY)
    await page.goto(chat.base_url + "/")
    await page.wait_for_selector("body[data-ready='1']")
    sid = await page.evaluate("window.chatbridge.app.session")
    await send(page, "question")
    await expect(page.locator("#live .msg.assistant.live")).to_contain_text("THE REP")

    asked, release = asyncio.Event(), asyncio.Event()
    held: list[Any] = []

    async def first_held(route: Any) -> None:
        if held:
            await route.continue_()
            return
        held.append(route)
        response = await route.fetch()  # the server's answer as of now: before the commit
        asked.set()
        await release.wait()  # ... delivered late
        await route.fulfill(response=response)

    await page.route("**/history*", first_held)
    chat.hub.get(sid).resync()  # a full fetch, held
    await asyncio.wait_for(asked.wait(), WAIT)
    hold.set()
    await expect(page.locator("#stop")).to_be_hidden()  # the turn ended (its commit came before)
    assert (await history(http, chat.base_url, sid))["history_revision"] == 1
    stream = chat.hub.get(sid)
    stream.resync()  # another reason for a full fetch while the first is on its way
    stream.append("session_title", {"session_id": sid, "title": "after the second resync"})
    await expect(page.locator("#title")).to_have_text("after the second resync")  # the resync was handled
    # every history request but the held one is answered (a second fetch, where the page makes one)
    await page.wait_for_function("() => window.__hist.done === window.__hist.asked - 1", timeout=WAIT * 1000)
    release.set()
    await page.wait_for_function("() => window.__hist.asked >= 2 && window.__hist.done === window.__hist.asked",
                                 timeout=WAIT * 1000)
    await expect(page.locator("#messages .msg.assistant:not(.live)")).to_have_text(
        ["THE REPLY that must stay on screen"])
    assert await page.evaluate("window.chatbridge.app.mirror.revision") == 1
    await expect(page.locator("#live .msg")).to_have_count(0)


async def test_the_mirror_refuses_a_full_answer_older_than_what_it_holds(browser, chat):
    page = await open_page(browser, chat.base_url + "/")
    result = await page.evaluate("""() => {
        const msg = (i) => ({id: "m" + i});
        const m = new window.chatbridge.HistoryMirror();
        const r = {};
        r.newer = m.loadFull("s1", 2, [msg(1), msg(2)], false);
        r.older = m.loadFull("s1", 1, [msg(1)], false);
        r.held = [m.revision, m.messages.map((x) => x.id)];
        r.same = m.loadFull("s1", 2, [msg(1), msg(2)], false);
        r.otherSession = m.loadFull("s2", 0, [], false);
        return r;
    }""")
    assert result == {"newer": True, "older": False, "held": [2, ["m1", "m2"]], "same": True, "otherSession": True}


async def test_a_queued_message_repeating_an_earlier_text_stays_after_a_full_fetch(browser, chat, fake_openai,
                                                                                   http):
    from playwright.async_api import expect

    hold = asyncio.Event()
    fake_openai.script(Text("first yes answer", chunk_size=3), Text("held answer", chunk_size=3, hold=hold,
                                                                    hold_after=4),
                       Text("second yes answer", chunk_size=3))
    page = await open_page(browser, chat.base_url + "/")
    sid = await page.evaluate("window.chatbridge.app.session")
    posts = await record_posts(page)
    await send(page, "yes")
    await expect(page.locator("#messages .msg.assistant:not(.live)")).to_have_count(1)
    await send(page, "something long")
    await expect(page.locator("#live .msg.assistant.live")).to_contain_text("held")
    await send(page, "yes")  # queued behind the held turn
    await until(lambda: len(posts) == 3, "the queued message's answer")
    await page.evaluate("window.chatbridge.fullFetch()")  # what a reconnect or a resync does
    await expect(page.locator(".msg.user.pending")).to_have_text(["yes"])
    hold.set()
    await expect(page.locator("#messages .msg.assistant:not(.live)")).to_have_count(3)
    await expect(page.locator(".msg.user.pending")).to_have_count(0)
    assert await user_texts(http, chat.base_url, sid) == ["yes", "something long", "yes"]
    await expect(page.locator("#messages .msg.user")).to_have_text(["yes", "something long", "yes"])


ASK = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_P1"])


@pytest.fixture
def tool():
    return RecordingTool("lookup", result="42 apples")


@pytest.fixture
async def with_tool(tmp_path, fake_openai, tool):
    wc = await start_web_chat(tmp_path, fake_openai, tools=registry(tool))
    try:
        yield wc
    finally:
        await wc.close()


async def test_a_decision_whose_answer_was_lost_is_not_offered_again(browser, with_tool, fake_openai, tool):
    from playwright.async_api import expect

    hold = asyncio.Event()
    fake_openai.script(ASK, Text("You have 42 apples.", chunk_size=4, hold=hold, hold_after=8))
    page = await open_page(browser, with_tool.base_url + "/")
    await send(page, "How many apples?")
    await expect(page.locator("#live .approval")).to_have_count(1)
    answers: list[int] = []

    async def record_then_drop(route: Any) -> None:
        resp = await route.fetch()
        answers.append(resp.status)
        if len(answers) == 1:
            await route.abort("connectionreset")
        else:
            await route.fulfill(response=resp)

    await page.route("**/approvals/**", record_then_drop)
    await page.click("#live .approval button.allow")
    await until(lambda: len(answers) == 2, "the decision sent again")
    assert answers == [200, 404]  # recorded the first time; the second finds it decided
    await expect(page.locator("#live .msg.assistant.live")).to_contain_text("You have")
    hold.set()
    await expect(page.locator("#messages .msg.assistant:not(.live)").last).to_contain_text("42 apples")
    await expect(page.locator(".notice", has_text="was not recorded")).to_have_count(0)
    assert tool.calls == [{"query": "apples"}]
