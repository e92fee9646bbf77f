"""Core's delivery wait runs out (DESIGN.md §2, rules 2 and 3): the platform holds the final update longer
than ``delivery_wait_timeout``. The sink is aborted and leaves the chat as it is; the one plain fallback
carries only what the chat does not show yet, and nothing when it shows the whole answer already.

Each test drives the real chain and the real channel against its platform's fake, which holds the call
(a hang longer than the wait; the client gives up on it when the sink is aborted, so it is never carried
out), and asserts what the chat shows: the answer exactly once, nothing missing.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from channels.slack.render import safe_mrkdwn
from tests.fakes.feishu import FakeFeishu
from tests.fakes.feishu.harness import CHAT as FEISHU_CHAT
from tests.fakes.openai_server import Text
from tests.fakes.slack.harness import slack_harness
from tests.fakes.telegram.harness import telegram_harness

TG_CHAT = 555
FORMATTED = "The capital of France is **Paris**, a city on the Seine."
PLAIN = "Paris is the capital of France and its largest city, a port on the river Seine for centuries."
BEGINNING = 30
"""The model holds after these characters of PLAIN until the test lets it go on."""
HELD = 60.0
"""How long the fake holds a call: longer than any test, shorter than nothing (the client gives up first)."""
WAIT = {"delivery_wait_timeout": 0.5}


def squash(text: str) -> str:
    return re.sub(r"\s+", "", text)



# ---- Telegram -------------------------------------------------------------------------------------------


async def test_telegram_a_preview_that_shows_the_whole_answer_gets_no_fallback_when_the_wait_runs_out(
        tmp_path, fake_openai, tg):
    # The preview shows the whole answer (as its Markdown source); the formatted final edit is held past the
    # delivery wait. The preview stays, so nothing of the answer is missing: no fallback.
    hold = asyncio.Event()
    fake_openai.script(Text(FORMATTED, chunk_size=4, delay=0.01, hold=hold, hold_after=len(FORMATTED)))
    t = await telegram_harness(tmp_path, fake_openai, tg, core=WAIT, call_timeout=30)
    try:
        tg.fail("editMessageText", hang=HELD, when=lambda p: bool(p.get("entities")))
        tg.user_message("capital of France?")
        await t.wait_for(lambda: tg.visible(TG_CHAT) == [FORMATTED])
        hold.set()
        await t.settle()
        assert tg.visible(TG_CHAT) == [FORMATTED]
        assert tg.count("sendMessage") == 1  # the preview; no fallback
    finally:
        await t.close()


async def test_telegram_a_preview_that_shows_the_beginning_gets_only_the_rest_when_the_wait_runs_out(
        tmp_path, fake_openai, tg):
    # The preview shows the first words; every later edit is held past the delivery wait. The fallback
    # sends what the preview lacks, not the whole answer again.
    hold = asyncio.Event()
    fake_openai.script(Text(PLAIN, chunk_size=4, delay=0.01, hold=hold, hold_after=BEGINNING))
    t = await telegram_harness(tmp_path, fake_openai, tg, core=WAIT, call_timeout=30)
    try:
        tg.user_message("capital of France?")
        await t.wait_for(lambda: tg.visible(TG_CHAT) == [PLAIN[:BEGINNING]])
        [preview] = tg.visible(TG_CHAT)
        tg.fail("editMessageText", hang=HELD, times=100)
        hold.set()
        await t.settle()
        shown = tg.visible(TG_CHAT)
        assert shown[0] == preview and len(shown) == 2, shown
        assert squash("".join(shown)) == squash(PLAIN)  # every word once
    finally:
        await t.close()


# ---- Feishu ---------------------------------------------------------------------------------------------


def card_texts(fake: FakeFeishu) -> list[str]:
    return fake.texts(FEISHU_CHAT)


def updates_the_answer(call: Any) -> bool:
    """A card operation that changes the answer's text (not one that only ends the card's streaming)."""
    return "update_element" in str((call.body or {}).get("actions", ""))


async def test_feishu_a_card_that_shows_the_whole_answer_gets_no_fallback_when_the_wait_runs_out(
        feishu_bridge, fake_openai, fake_feishu):
    # The streaming card shows the whole answer; the final update (its content and the end of its streaming, in
    # one call) is held past the delivery wait. The aborted sink still ends the card's streaming as it stands.
    hold = asyncio.Event()
    fake_openai.script(Text(FORMATTED, chunk_size=4, delay=0.01, hold=hold, hold_after=len(FORMATTED)))
    t = await feishu_bridge(core=WAIT, call_timeout=30)
    held = fake_feishu.fail("card.batch_update", hang=HELD, times=100, when=updates_the_answer)
    await t.say("capital of France?")
    await t.wait_for(lambda: card_texts(fake_feishu) == [FORMATTED])
    hold.set()
    await t.settle()
    assert card_texts(fake_feishu) == [FORMATTED]
    assert fake_feishu.count("message.reply") == 1  # the card; no fallback
    assert held.hits == 1  # the final update was held
    await t.wait_for(lambda: not any(c.streaming for c in fake_feishu.cards.values()))  # ended as it stands
    assert card_texts(fake_feishu) == [FORMATTED]


async def test_feishu_a_card_that_shows_the_beginning_gets_only_the_rest_when_the_wait_runs_out(
        feishu_bridge, fake_openai, fake_feishu):
    # The card shows the first words; every later update of its text is held past the delivery wait.
    hold = asyncio.Event()
    fake_openai.script(Text(PLAIN, chunk_size=4, delay=0.01, hold=hold, hold_after=BEGINNING))
    t = await feishu_bridge(core=WAIT, call_timeout=30)
    await t.say("capital of France?")
    await t.wait_for(lambda: card_texts(fake_feishu) == [PLAIN[:BEGINNING]])
    [card] = card_texts(fake_feishu)
    fake_feishu.fail("element.content", hang=HELD, times=100)
    fake_feishu.fail("card.batch_update", hang=HELD, times=100, when=updates_the_answer)
    hold.set()
    await t.settle()
    shown = card_texts(fake_feishu)
    assert shown[0] == card and len(shown) == 2, shown
    assert squash("".join(shown)) == squash(PLAIN)  # every word once
    await t.wait_for(lambda: not any(c.streaming for c in fake_feishu.cards.values()))  # ended as it stands
    assert card_texts(fake_feishu) == shown


# ---- Slack ----------------------------------------------------------------------------------------------


async def test_slack_a_preview_that_shows_the_whole_answer_gets_no_fallback_when_the_wait_runs_out(
        tmp_path, fake_openai, fake_slack):
    # Streaming by updates: the preview shows the whole answer as mrkdwn; the final update (the Markdown
    # block) is held past the delivery wait.
    hold = asyncio.Event()
    fake_openai.script(Text(FORMATTED, chunk_size=4, delay=0.01, hold=hold, hold_after=len(FORMATTED)))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, core=WAIT, call_timeout=30)
    try:
        fake_slack.fail("chat.update", hang=HELD, when=lambda p: bool(p.get("blocks")), times=100)
        await t.deliver(fake_slack.user_message("capital of France?"))
        await t.wait_for(lambda: fake_slack.visible("D0ALICE") == [safe_mrkdwn(FORMATTED)])
        hold.set()
        await t.settle()
        assert fake_slack.visible("D0ALICE") == [safe_mrkdwn(FORMATTED)]
        assert fake_slack.count("chat.postMessage") == 1  # the preview; no fallback
    finally:
        await t.close()


async def test_slack_a_native_stream_that_shows_the_beginning_gets_only_the_rest_when_the_wait_runs_out(
        tmp_path, fake_openai, fake_slack):
    # A native stream shows the first words; every later call on its message is held past the delivery
    # wait. The stream's message stays, and the fallback below it carries the rest.
    hold = asyncio.Event()
    fake_openai.script(Text(PLAIN, chunk_size=4, delay=0.01, hold=hold, hold_after=BEGINNING))
    t = await slack_harness(tmp_path, fake_openai, fake_slack, core=WAIT, call_timeout=30, stream_transport="native")
    try:
        body = fake_slack.user_message("capital of France?")
        thread = body["event"]["ts"]
        await t.deliver(body)
        await t.wait_for(lambda: fake_slack.visible("D0ALICE", thread_ts=thread) == [PLAIN[:BEGINNING]])
        [streamed] = fake_slack.visible("D0ALICE", thread_ts=thread)
        for method in ("chat.appendStream", "chat.stopStream", "chat.update"):  # the live append or the end
            fake_slack.fail(method, hang=HELD, times=100)
        hold.set()
        await t.settle()
        shown = fake_slack.visible("D0ALICE", thread_ts=thread)
        assert shown[0] == streamed and len(shown) == 2, shown
        assert squash("".join(shown)) == squash(PLAIN)  # every word once
    finally:
        await t.close()
