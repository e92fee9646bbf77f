"""A reply shows exactly once on a page that opens (a second tab, a reload, a resync) while its turn is between
core's commit and the turn's terminal ``turn`` event: there the stream's ``task_state`` still shows the turn
running while the history already holds its answer. Each test holds the turn in that window (the web sink's
close waits) and holds the page's own requests, to force one order of "history fetched" and "stream opened";
headless Chromium against a real web chat."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest

from channels.web.channel import WebStream
from tests.browser.conftest import CHROMIUM
from tests.browser.test_chat_page import send
from tests.fakes.openai_server import Text

pytestmark = pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                reason=f"{CHROMIUM} is absent (apt-get install chromium)")

ANSWER = "Exactly one copy of this answer, please."
WAIT = 10.0  # seconds: every wait of these tests is bounded


class CommitWindow:
    """Holds every turn after core committed it and before its terminal ``turn`` event is in the stream."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        close = WebStream.close

        async def held_close(stream: WebStream, snapshot: Any, part: Any) -> str | None:
            self.entered.set()
            await self.release.wait()
            return await close(stream, snapshot, part)

        monkeypatch.setattr(WebStream, "close", held_close)


@pytest.fixture
def window(monkeypatch):
    w = CommitWindow(monkeypatch)
    yield w
    w.release.set()


class Gate:
    """Holds a page's first request to a route until opened (later ones pass). ``fetch_first``: the request
    reaches the server at once and only its answer is held (an answer from before the commit, delivered
    late)."""

    def __init__(self, *, fetch_first: bool = False) -> None:
        self.open = asyncio.Event()
        self.asked = asyncio.Event()
        self._fetch_first = fetch_first
        self._used = False

    async def __call__(self, route: Any) -> None:
        if self._used:
            await route.continue_()
            return
        self._used = True
        if self._fetch_first:
            response = await route.fetch()
            self.asked.set()
            await self.open.wait()
            await route.fulfill(response=response)
        else:
            self.asked.set()
            await self.open.wait()
            await route.continue_()


async def wait(event: asyncio.Event) -> None:
    await asyncio.wait_for(event.wait(), WAIT)


async def history_texts(http: Any, base: str, sid: str) -> list[str]:
    async with http.get(f"{base}/api/sessions/{sid}/history") as resp:
        return [m["content"] for m in (await resp.json())["messages"] if m["role"] == "assistant"]


async def until_js(page: Any, expression: str) -> None:
    await page.wait_for_function("() => " + expression, timeout=WAIT * 1000)


async def second_tab(browser: Any, url: str, **gates: Gate) -> Any:
    """A tab on ``url`` whose history (``history=``) or stream (``stream=``) request is held by a gate."""
    page = await browser.new_page()
    if "history" in gates:
        await page.route("**/api/sessions/*/history*", gates["history"])
    if "stream" in gates:
        await page.route("**/api/sessions/*/stream*", gates["stream"])
    await page.goto(url)
    return page


async def shows_the_answer_once_from_history(page: Any) -> None:
    from playwright.async_api import expect

    await expect(page.locator("#messages .msg.assistant")).to_have_count(1)
    await expect(page.locator("#messages .msg.assistant:not(.live)")).to_have_text([ANSWER])
    await expect(page.locator("#live .msg")).to_have_count(0)
    await expect(page.locator("#stop")).to_be_hidden()


async def asking_tab(browser: Any, base: str) -> tuple[Any, str]:
    """A tab that opens a new conversation and sends the question; (the page, its session id)."""
    page = await browser.new_page()
    await page.goto(base + "/")
    await page.wait_for_selector("body[data-ready='1']", timeout=WAIT * 1000)
    sid = await page.evaluate("window.chatbridge.app.session")
    await send(page, "question")
    return page, sid


async def answer_committed_and_held(window: CommitWindow, http: Any, base: str, sid: str) -> None:
    await wait(window.entered)
    assert await history_texts(http, base, sid) == [ANSWER]  # committed; the terminal event is held


async def test_stream_first_then_history_after_the_commit(browser, chat, fake_openai, window, http):
    """task_state (turn running) arrives first, the history (with the answer) after it."""
    fake_openai.script(Text(ANSWER, chunk_size=4))
    a, sid = await asking_tab(browser, chat.base_url)
    await answer_committed_and_held(window, http, chat.base_url, sid)

    history = Gate()
    b = await second_tab(browser, f"{chat.base_url}/#{sid}", history=history)
    await wait(history.asked)
    await until_js(b, "window.chatbridge && window.chatbridge.app.live !== null")  # the task_state
    assert await b.evaluate("window.chatbridge.app.live.state") == "running"
    history.open.set()
    await b.wait_for_selector("body[data-ready='1']", timeout=WAIT * 1000)
    await shows_the_answer_once_from_history(b)

    window.release.set()  # the terminal event settles the turn
    await until_js(b, "window.chatbridge.app.live === null")
    await shows_the_answer_once_from_history(b)
    await shows_the_answer_once_from_history(a)


async def test_history_first_then_the_stream_after_the_commit(browser, chat, fake_openai, window, http):
    """The history (with the answer) is loaded first; the stream's task_state (turn running) comes after."""
    fake_openai.script(Text(ANSWER, chunk_size=4))
    _, sid = await asking_tab(browser, chat.base_url)
    await answer_committed_and_held(window, http, chat.base_url, sid)

    stream = Gate()
    b = await second_tab(browser, f"{chat.base_url}/#{sid}", stream=stream)
    await b.wait_for_selector("body[data-ready='1']", timeout=WAIT * 1000)  # the history is loaded
    await wait(stream.asked)
    await shows_the_answer_once_from_history(b)
    stream.open.set()
    await until_js(b, "window.chatbridge.app.live !== null")  # the task_state: the turn still running
    assert await b.evaluate("window.chatbridge.app.live.state") == "running"
    await shows_the_answer_once_from_history(b)

    window.release.set()
    await until_js(b, "window.chatbridge.app.live === null")
    await shows_the_answer_once_from_history(b)


async def test_history_before_the_commit_and_the_stream_after_it(browser, chat, fake_openai, window, http):
    """The history is fetched while the turn runs, the stream opens after the commit (its delta is not sent
    to a fresh connection): the terminal event has the page fetch the history again, where the answer is."""
    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, hold=hold, hold_after=12))
    a, sid = await asking_tab(browser, chat.base_url)
    await a.locator("#live .msg.assistant.live").wait_for(timeout=WAIT * 1000)

    stream = Gate()
    b = await second_tab(browser, f"{chat.base_url}/#{sid}", stream=stream)
    await b.wait_for_selector("body[data-ready='1']", timeout=WAIT * 1000)  # history without the answer
    await wait(stream.asked)
    hold.set()
    await answer_committed_and_held(window, http, chat.base_url, sid)
    stream.open.set()
    await until_js(b, "window.chatbridge.app.live !== null")  # task_state: running
    window.release.set()
    await until_js(b, "window.chatbridge.app.live === null")
    # the page fetched its history again: the answer is there now, not in a live bubble
    assert await b.evaluate("window.chatbridge.app.mirror.messages.map((m) => m.content)") == ["question", ANSWER]
    await shows_the_answer_once_from_history(b)
    await shows_the_answer_once_from_history(a)


async def test_a_history_answer_from_before_the_commit_that_arrives_after_the_end(browser, chat, fake_openai,
                                                                                  window, http):
    """The history request is answered before the commit but that answer reaches the page only after the
    terminal event: the reply is not lost (it is fetched again), and not shown twice."""
    from playwright.async_api import expect

    hold = asyncio.Event()
    fake_openai.script(Text(ANSWER, chunk_size=4, hold=hold, hold_after=12))
    a, sid = await asking_tab(browser, chat.base_url)
    await a.locator("#live .msg.assistant.live").wait_for(timeout=WAIT * 1000)

    history, stream = Gate(fetch_first=True), Gate()
    b = await second_tab(browser, f"{chat.base_url}/#{sid}", history=history, stream=stream)
    await wait(history.asked)  # answered by the server: no answer in it yet
    await wait(stream.asked)
    hold.set()
    await answer_committed_and_held(window, http, chat.base_url, sid)
    stream.open.set()
    await until_js(b, "window.chatbridge && window.chatbridge.app.live !== null")  # task_state: running
    window.release.set()
    await until_js(b, "window.chatbridge.app.live.state !== 'running'")  # the terminal event
    await expect(b.locator("#messages .msg.assistant")).to_have_count(1)  # the live bubble, until the history
    history.open.set()  # the stale answer arrives
    await b.wait_for_selector("body[data-ready='1']", timeout=WAIT * 1000)
    await until_js(b, "window.chatbridge.app.live === null")
    await shows_the_answer_once_from_history(b)
