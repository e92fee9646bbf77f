"""While a message's files download, before its turn has a live reply, Slack shows the turn's thinking indicator
(``SlackChannel.working``): the real SlackChannel (slack_sdk, slack-bolt) against the fake Slack, whose
``files.info`` a test holds, the real core and its media store. The turn's sink takes the indicator over (one
indicator, one clear), and none is left behind by the answer, a failed download or a /stop."""

from __future__ import annotations

import asyncio

from tests.fakes.openai_server import Text
from tests.fakes.slack.harness import slack_harness
from tests.support.media import jpeg

DM = "D0ALICE"
THINKING = {"hourglass_flowing_sand": ["U0BOT"]}


async def photo_downloading(t, fake_slack) -> str:
    """A DM with a photo, delivered; returns its ts once the thinking reaction shows on it (``files.info``
    held by the test, or failing)."""
    shared = fake_slack.add_file("F0PHOTO", "IMG_0001.jpg", "image/jpeg", jpeg())
    asked = fake_slack.user_message("what is this?", files=[shared], subtype="file_share")
    await t.deliver(asked)
    ts = asked["event"]["ts"]
    await t.wait_for(lambda: fake_slack.message(DM, ts).reactions == THINKING)
    return ts


async def test_a_dm_shows_the_thinking_reaction_while_its_photo_downloads_and_not_after(
        tmp_path, fake_openai, fake_slack):
    held = fake_slack.hold("files.info")
    fake_openai.script(Text("a red square"))
    t = await slack_harness(tmp_path, fake_openai, fake_slack)
    try:
        ts = await photo_downloading(t, fake_slack)
        await t.wait_for(lambda: fake_slack.count("files.info") == 1)
        assert fake_openai.requests == [] and fake_slack.visible(DM) == []  # still downloading
        held.set()
        await t.settle()
        assert fake_slack.visible(DM) == ["a red square"]
        assert not fake_slack.message(DM, ts).reactions  # gone with the answer
        # the turn took the download's indicator over: one shown, one cleared
        assert fake_slack.count("reactions.add") == 1 and fake_slack.count("reactions.remove") == 1
    finally:
        held.set()
        await t.close()


async def test_a_thread_shows_the_thinking_status_while_its_file_downloads_and_clears_it(
        tmp_path, fake_openai, fake_slack):
    fake_openai.script(Text("Hello."), Text("A photo."))
    t = await slack_harness(tmp_path, fake_openai, fake_slack)
    try:
        mention, _ = fake_slack.mention("hi")
        await t.deliver(mention)
        await t.settle()
        thread = mention["event"]["ts"]
        before = len(fake_slack.statuses)
        held = fake_slack.hold("files.info")
        shared = fake_slack.add_file("F0PHOTO", "IMG_0001.jpg", "image/jpeg", jpeg())
        await t.deliver(fake_slack.user_message("and this?", channel="C0GENERAL", thread_ts=thread, files=[shared],
                                                subtype="file_share"))
        await t.wait_for(lambda: len(fake_slack.statuses) > before)
        assert [s["status"] for s in fake_slack.statuses[before:]] == ["is thinking…"]
        assert fake_slack.statuses[before]["thread_ts"] == thread
        assert len(fake_openai.requests) == 1  # the photo is still downloading
        held.set()
        await t.settle()
        assert fake_slack.visible("C0GENERAL", thread_ts=thread)[-1] == "A photo."
        # set once (the turn took it over) and cleared at the end
        assert [s["status"] for s in fake_slack.statuses[before:]] == ["is thinking…", ""]
    finally:
        fake_slack.hold("files.info").set()
        await t.close()


async def test_a_failed_download_leaves_no_thinking_reaction(tmp_path, fake_openai, fake_slack):
    held = fake_slack.hold("files.info")
    fake_slack.fail("files.info", error="file_not_found", times=10)
    t = await slack_harness(tmp_path, fake_openai, fake_slack)
    try:
        ts = await photo_downloading(t, fake_slack)
        held.set()
        await t.settle()
        note, answer = fake_slack.visible(DM)
        assert note.startswith("⚠️ IMG_0001.jpg") and answer == "ok"
        assert not fake_slack.message(DM, ts).reactions
    finally:
        held.set()
        await t.close()


async def test_a_stop_during_the_download_leaves_no_thinking_reaction(tmp_path, fake_openai, fake_slack):
    held = fake_slack.hold("files.info")
    t = await slack_harness(tmp_path, fake_openai, fake_slack)
    try:
        ts = await photo_downloading(t, fake_slack)
        await t.deliver(fake_slack.user_message("stop"))
        await t.settle()
        assert fake_openai.requests == []  # stopped before the model was asked
        assert fake_slack.visible(DM)  # the stopped reply says so
        assert not fake_slack.message(DM, ts).reactions
    finally:
        held.set()
        await asyncio.sleep(0)
        await t.close()


async def test_a_shutdown_during_the_download_leaves_no_thinking_reaction(tmp_path, fake_openai, fake_slack):
    """The turn ends in its download (the next start answers the message): no sink ever takes the indicator
    over, and it is cleared all the same."""
    held = fake_slack.hold("files.info")
    t = await slack_harness(tmp_path, fake_openai, fake_slack)
    try:
        ts = await photo_downloading(t, fake_slack)
        await t.wait_for(lambda: fake_slack.count("files.info") == 1)
        await t.close()
        assert fake_slack.visible(DM) == [] and fake_openai.requests == []  # left to the next start
        assert not fake_slack.message(DM, ts).reactions
        assert fake_slack.count("reactions.remove") == 1
    finally:
        held.set()
        await t.close()
