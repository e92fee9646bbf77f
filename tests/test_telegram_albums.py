"""Albums: photos a user sends together (Telegram: one message per photo, sharing a ``media_group_id``, the
caption on the first only) are one message to the model and get one answer, in private chats and in groups
where only the caption mentions the bot; a part is kept durably before Telegram is told it arrived, so a
crash loses nothing, and a part delivered again never makes a second answer.

The real chain (SQLite, the OpenAI SDK against the fake LLM) and the real Telegram channel (aiogram) against
the fake Bot API; the album's window runs on a clock the test moves (``StepClock``), so nothing here depends
on how fast the machine is. Assertions are what the chat shows and what the model was sent."""

from __future__ import annotations

import asyncio

import aiohttp

from channels.common.throttle import Clock
from channels.telegram.channel import SECRET_HEADER
from core.sqlite_store import SqliteStore
from core.store import StoreError
from tests.fakes.openai_server import Text, image_parts, last_user_text
from tests.fakes.telegram import FakeTelegram
from tests.fakes.telegram.harness import TelegramHarness, telegram_harness
from tests.support.media import jpeg

CHAT = 555
GROUP = -100777
WINDOW = 1.0
MAX_WAIT = 3.0
PHOTOS = {"p1": jpeg(1280, 960), "p2": jpeg(960, 1280), "p3": jpeg(800, 600), "p4": jpeg(600, 800)}


class StepClock(Clock):
    """Virtual time that moves only when the test calls ``advance``; a sleeper wakes once it has passed."""

    def __init__(self) -> None:
        self.t = 0.0
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self.t

    async def sleep(self, seconds: float) -> None:
        entry = (self.t + max(0.0, seconds), asyncio.get_running_loop().create_future())
        if entry[0] <= self.t:
            await asyncio.sleep(0)
            return
        self._sleepers.append(entry)
        try:
            await entry[1]
        finally:
            self._sleepers.remove(entry)

    @property
    def asleep(self) -> int:
        return sum(1 for _, f in self._sleepers if not f.done())

    def advance(self, seconds: float) -> None:
        self.t += seconds
        for due, woken in self._sleepers:
            if due <= self.t and not woken.done():
                woken.set_result(None)


async def harness(tmp_path, fake_openai, tg: FakeTelegram, clock: Clock, **kw) -> TelegramHarness:
    for file_id, data in PHOTOS.items():
        if file_id not in tg.files:
            tg.add_file(file_id, data)
    return await telegram_harness(tmp_path, fake_openai, tg, album_clock=clock, album_window=WINDOW,
                                  album_max_wait=MAX_WAIT, **kw)


def album(tg: FakeTelegram, group: str, caption: str | None, *photos: str, chat_id: int = CHAT,
          chat_type: str = "private", caption_entities: list[dict] | None = None) -> list[dict]:
    """The messages Telegram delivers for one album: one per photo, the caption on the first."""
    return [tg.user_message(caption=caption if i == 0 else None, photo=photo, chat_id=chat_id, chat_type=chat_type,
                            entities=caption_entities if i == 0 else None, extra={"media_group_id": group})
            for i, photo in enumerate(photos)]


def new_images(body: dict) -> list[tuple[str, bytes]]:
    """The images of a request's last user message: those the user just sent (earlier ones are history)."""
    last = [m for m in body["messages"] if m["role"] == "user"][-1]
    return image_parts({"messages": [last]})


async def stored_parts(t: TelegramHarness) -> list[str]:
    return await t.channel.host.state_names("album:")


async def test_an_album_in_a_private_chat_is_one_turn_with_every_photo_and_the_caption(tmp_path, fake_openai, tg):
    fake_openai.script(Text("The second one."))
    clock = StepClock()
    t = await harness(tmp_path, fake_openai, tg, clock)
    try:
        album(tg, "13", "which of these is best?", "p1", "p2", "p3")
        await t.wait_for(t.consumed)  # all three fetched and confirmed to Telegram
        clock.advance(WINDOW)  # a second without another part: the album is complete
        await t.settle()
        [request] = fake_openai.requests
        assert image_parts(request) == [("image/jpeg", PHOTOS[p]) for p in ("p1", "p2", "p3")]
        assert last_user_text(request).startswith("which of these is best?")
        assert tg.visible(CHAT) == ["The second one."]
        assert await stored_parts(t) == []  # handed over: nothing left behind
    finally:
        await t.close()


async def test_an_album_mentioning_the_bot_in_its_caption_is_answered_whole_in_a_group(tmp_path, fake_openai, tg):
    fake_openai.script(Text("Both are cats."))
    clock = StepClock()
    t = await harness(tmp_path, fake_openai, tg, clock)  # group_policy = "mention"
    try:
        at = f"@{tg.username}"
        ignored = album(tg, "20", "look at our holiday", "p4", "p4", chat_id=GROUP, chat_type="supergroup")
        parts = album(tg, "21", f"{at} compare these", "p1", "p2", "p3", chat_id=GROUP, chat_type="supergroup",
                      caption_entities=[{"type": "mention", "offset": 0, "length": len(at)}])
        await t.wait_for(t.consumed)
        clock.advance(WINDOW)
        await t.settle()
        [request] = fake_openai.requests  # the album not meant for the bot is not answered
        assert image_parts(request) == [("image/jpeg", PHOTOS[p]) for p in ("p1", "p2", "p3")]
        assert last_user_text(request).startswith("compare these")
        [answer] = tg.messages(GROUP)
        assert answer.text == "Both are cats."
        assert answer.reply_to == parts[0]["message"]["message_id"]  # quotes the album's first message
        assert ignored and await stored_parts(t) == []
    finally:
        await t.close()


async def test_parts_in_separate_batches_join_while_they_come_within_the_window_up_to_the_bound(
        tmp_path, fake_openai, tg):
    fake_openai.script(Text("four photos"), Text("and a fifth"))
    clock = StepClock()
    t = await harness(tmp_path, fake_openai, tg, clock)
    try:
        photos = ["p1", "p2", "p3", "p4"]
        for i, photo in enumerate(photos):  # a part every 0.9 s, each fetched on its own
            tg.user_message(caption="four" if i == 0 else None, photo=photo, extra={"media_group_id": "7"})
            await t.wait_for(t.consumed)
            await t.wait_for(lambda: clock.asleep == 1)  # the album waits for its next part
            assert fake_openai.requests == [] and t.channel.albums.parts(str(CHAT)) == i + 1
            clock.advance(0.9 * WINDOW)
        # at 3.6 s, 0.9 s after the fourth part but past the bound (3 s after the first), the album is
        # handed over with the four parts it has
        await t.settle()
        [request] = fake_openai.requests
        assert image_parts(request) == [("image/jpeg", PHOTOS[p]) for p in photos]
        assert last_user_text(request).startswith("four")
        # a fifth part after that: its album was answered already, so it is answered as a follow-up, its photo
        # with it
        tg.user_message(photo="p1", extra={"media_group_id": "7"})
        await t.wait_for(t.consumed)
        clock.advance(WINDOW)
        await t.settle()
        assert [new_images(r) for r in fake_openai.requests[1:]] == [[("image/jpeg", PHOTOS["p1"])]]
        assert tg.visible(CHAT) == ["four photos", "and a fifth"]
        assert await stored_parts(t) == []
    finally:
        await t.close()


async def test_a_message_after_an_album_is_answered_after_it_without_waiting_for_the_window(
        tmp_path, fake_openai, tg):
    fake_openai.script(Text("the album"), Text("the question"))
    clock = StepClock()  # never moved: the next message alone ends the album
    t = await harness(tmp_path, fake_openai, tg, clock)
    try:
        album(tg, "30", "my garden", "p1", "p2")
        tg.user_message("what should I plant?")
        await t.settle()
        first, second = fake_openai.requests
        assert image_parts(first) == [("image/jpeg", PHOTOS["p1"]), ("image/jpeg", PHOTOS["p2"])]
        assert last_user_text(first).startswith("my garden")
        assert last_user_text(second).startswith("what should I plant?")
        assert tg.visible(CHAT) == ["the album", "the question"]
    finally:
        await t.close()


async def test_an_album_confirmed_to_telegram_survives_a_crash_before_it_was_handed_over(
        tmp_path, fake_openai, tg):
    fake_openai.script(Text("answered after the restart"))
    clock = StepClock()
    t = await harness(tmp_path, fake_openai, tg, clock)
    try:
        album(tg, "40", "three photos", "p1", "p2", "p3")
        await t.wait_for(t.consumed)  # confirmed: Telegram will not deliver them again
        assert len(await stored_parts(t)) == 3
        for task in asyncio.all_tasks():  # the process dies before the window has passed
            if task.get_name().startswith("telegram:album:"):
                task.cancel()
        await t.wait_for(lambda: not t.channel.albums.pending)
    finally:
        await t.close()
    assert fake_openai.requests == []

    clock = StepClock()
    t = await harness(tmp_path, fake_openai, tg, clock)
    try:
        await t.wait_for(lambda: clock.asleep == 1)  # found in the store: handed over after the bound
        clock.advance(MAX_WAIT)
        await t.settle()
        [request] = fake_openai.requests
        assert image_parts(request) == [("image/jpeg", PHOTOS[p]) for p in ("p1", "p2", "p3")]
        assert last_user_text(request).startswith("three photos")
        assert tg.visible(CHAT) == ["answered after the restart"]
        assert await stored_parts(t) == []
    finally:
        await t.close()


async def test_a_part_delivered_again_never_makes_a_second_answer(tmp_path, fake_openai, tg):
    fake_openai.script(Text("one answer"), Text("a second answer"))
    clock = StepClock()
    t = await harness(tmp_path, fake_openai, tg, clock)
    try:
        parts = album(tg, "50", "two photos", "p1", "p2")
        await t.wait_for(t.consumed)
        clock.advance(WINDOW)
        await t.settle()
        assert tg.visible(CHAT) == ["one answer"]
        # Telegram delivers the second part again (its message id, a new update id)
        tg.user_message(photo="p2", message_id=parts[1]["message"]["message_id"], extra={"media_group_id": "50"})
        await t.wait_for(t.consumed)
        clock.advance(WINDOW)
        await t.settle()
    finally:
        await t.close()
    # ...and once more after a restart
    tg.user_message(caption="two photos", photo="p1", message_id=parts[0]["message"]["message_id"],
                    extra={"media_group_id": "50"})
    clock = StepClock()
    t = await harness(tmp_path, fake_openai, tg, clock)
    try:
        await t.wait_for(t.consumed)
        clock.advance(WINDOW)
        await t.settle()
        assert tg.visible(CHAT) == ["one answer"] and len(fake_openai.requests) == 1
        assert await stored_parts(t) == []
    finally:
        await t.close()


class FailingAlbumWrites(SqliteStore):
    """The first write of an album part fails (a locked database)."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.failed: list[str] = []

    async def set_channel_state(self, channel: str, name: str, value: str) -> None:
        if name.startswith("album:") and not self.failed:
            self.failed.append(name)
            raise StoreError("sqlite store: set_channel_state failed (OperationalError: database is locked)")
        await super().set_channel_state(channel, name, value)


async def test_a_part_that_could_not_be_stored_is_not_confirmed_and_joins_its_album_when_fetched_again(
        tmp_path, fake_openai, tg):
    fake_openai.script(Text("all three"))
    store = FailingAlbumWrites(tmp_path / "chat.db")
    clock = StepClock()
    t = await harness(tmp_path, fake_openai, tg, clock, core={"store": store})
    try:
        parts = album(tg, "60", "three photos", "p1", "p2", "p3")
        await t.wait_for(t.consumed)
        assert store.failed
        # the batch was not confirmed from the part that was not stored on: all of it was fetched again
        offsets = [int(c.params.get("offset") or 0) for c in tg.calls if c.method == "getUpdates"]
        assert offsets[:3] == [0, 0, parts[-1]["update_id"] + 1]
        clock.advance(WINDOW)
        await t.settle()
        [request] = fake_openai.requests
        assert image_parts(request) == [("image/jpeg", PHOTOS[p]) for p in ("p1", "p2", "p3")]
        assert tg.visible(CHAT) == ["all three"]
    finally:
        await t.close()


async def test_an_album_by_webhook_is_one_answer(tmp_path, fake_openai, tg):
    fake_openai.script(Text("via webhook"))
    clock = StepClock()
    t = await harness(tmp_path, fake_openai, tg, clock, mode="webhook",
                      webhook_url="https://bot.example.com/telegram/webhook", webhook_secret="s3cret")
    url = await t.serve_webhook()
    try:
        parts = [tg.user_message(caption="by webhook" if i == 0 else None, photo=p, enqueue=False,
                                 extra={"media_group_id": "70"}) for i, p in enumerate(("p1", "p2"))]
        async with aiohttp.ClientSession() as http:
            for update in parts:  # each answered 200 once it is stored
                async with http.post(url, json=update, headers={SECRET_HEADER: "s3cret"}) as resp:
                    assert resp.status == 200
        assert len(await stored_parts(t)) == 2
        clock.advance(WINDOW)
        await t.settle()
        [request] = fake_openai.requests
        assert image_parts(request) == [("image/jpeg", PHOTOS["p1"]), ("image/jpeg", PHOTOS["p2"])]
        assert tg.visible(CHAT) == ["via webhook"]
    finally:
        await t.close()


async def test_the_rest_of_an_album_delayed_past_the_window_reaches_the_model_and_a_redelivery_does_not(
        tmp_path, fake_openai, tg):
    fake_openai.script(Text("one photo so far"), Text("and two more"), Text("a third answer"))
    clock = StepClock()
    t = await harness(tmp_path, fake_openai, tg, clock)
    try:
        first = tg.user_message(caption="what are these?", photo="p1", extra={"media_group_id": "80"})
        await t.wait_for(lambda: t.channel.albums.parts(str(CHAT)) == 1)
        await t.wait_for(lambda: clock.asleep == 1)
        clock.advance(WINDOW)  # Telegram holds the rest of the album back until after the window
        await t.settle()
        rest = [tg.user_message(photo=p, extra={"media_group_id": "80"}) for p in ("p2", "p3")]
        await t.wait_for(t.consumed)
        clock.advance(WINDOW)
        await t.settle()
        # every photo reached the model: the late ones as a follow-up message of their own
        assert [new_images(r) for r in fake_openai.requests] == [
            [("image/jpeg", PHOTOS["p1"])], [("image/jpeg", PHOTOS["p2"]), ("image/jpeg", PHOTOS["p3"])]]
        assert last_user_text(fake_openai.requests[0]).startswith("what are these?")
        assert tg.visible(CHAT) == ["one photo so far", "and two more"]
        # Telegram delivers parts of either group again: duplicates, not answered
        tg.user_message(photo="p3", message_id=rest[1]["message"]["message_id"], extra={"media_group_id": "80"})
        tg.user_message(caption="what are these?", photo="p1", message_id=first["message"]["message_id"],
                        extra={"media_group_id": "80"})
        await t.wait_for(t.consumed)
        clock.advance(WINDOW)
        await t.settle()
        assert len(fake_openai.requests) == 2 and tg.visible(CHAT) == ["one photo so far", "and two more"]
        assert await stored_parts(t) == []
    finally:
        await t.close()


async def test_late_parts_of_an_album_that_mentioned_the_bot_are_answered_in_a_group(tmp_path, fake_openai, tg):
    fake_openai.script(Text("the first"), Text("the others"))
    clock = StepClock()
    t = await harness(tmp_path, fake_openai, tg, clock)  # group_policy = "mention": only the caption mentions it
    try:
        at = f"@{tg.username}"
        album(tg, "81", f"{at} compare these", "p1", chat_id=GROUP, chat_type="supergroup",
              caption_entities=[{"type": "mention", "offset": 0, "length": len(at)}])
        await t.wait_for(t.consumed)
        clock.advance(WINDOW)
        await t.settle()
        late = album(tg, "81", None, "p2", "p3", chat_id=GROUP, chat_type="supergroup")
        await t.wait_for(t.consumed)
        clock.advance(WINDOW)
        await t.settle()
        assert [new_images(r) for r in fake_openai.requests] == [
            [("image/jpeg", PHOTOS["p1"])], [("image/jpeg", PHOTOS["p2"]), ("image/jpeg", PHOTOS["p3"])]]
        answers = tg.messages(GROUP)
        assert [m.text for m in answers] == ["the first", "the others"]
        assert answers[1].reply_to == late[0]["message"]["message_id"]  # quotes the first late photo
    finally:
        await t.close()


async def test_a_part_refused_by_webhook_and_posted_again_after_the_window_is_not_lost(tmp_path, fake_openai, tg):
    fake_openai.script(Text("the first photo"), Text("the second photo"))
    store = FailingSecondAlbumWrite(tmp_path / "chat.db")
    clock = StepClock()
    t = await harness(tmp_path, fake_openai, tg, clock, core={"store": store}, mode="webhook",
                      webhook_url="https://bot.example.com/telegram/webhook", webhook_secret="s3cret")
    url = await t.serve_webhook()
    try:
        parts = [tg.user_message(caption="two photos" if i == 0 else None, photo=p, enqueue=False,
                                 extra={"media_group_id": "82"}) for i, p in enumerate(("p1", "p2"))]
        async with aiohttp.ClientSession() as http:
            async def post(update: dict) -> int:
                async with http.post(url, json=update, headers={SECRET_HEADER: "s3cret"}) as resp:
                    return resp.status

            assert [await post(u) for u in parts] == [200, 503]  # the second could not be stored
            clock.advance(WINDOW)  # Telegram posts it again only later: the album was handed over meanwhile
            await t.settle()
            assert await post(parts[1]) == 200
        clock.advance(WINDOW)
        await t.settle()
        assert [new_images(r) for r in fake_openai.requests] == [[("image/jpeg", PHOTOS["p1"])],
                                                                 [("image/jpeg", PHOTOS["p2"])]]
        assert tg.visible(CHAT) == ["the first photo", "the second photo"]
    finally:
        await t.close()


class FailingSecondAlbumWrite(SqliteStore):
    """The first write of the second album part fails (a locked database)."""

    def __init__(self, path) -> None:
        super().__init__(path)
        self.names: list[str] = []

    async def set_channel_state(self, channel: str, name: str, value: str) -> None:
        if name.startswith("album:") and name not in self.names:
            self.names.append(name)
            if len(self.names) == 2:
                raise StoreError("sqlite store: set_channel_state failed (OperationalError: database is locked)")
        await super().set_channel_state(channel, name, value)


async def test_an_album_is_not_ended_by_its_window_while_getupdates_fails(tmp_path, fake_openai, tg):
    fake_openai.script(Text("three photos"), Text("unused"))
    clock = StepClock()
    t = await harness(tmp_path, fake_openai, tg, clock, poll_backoff=(0.01,))
    try:
        first = tg.user_message(caption="what are these?", photo="p1", extra={"media_group_id": "83"})
        failing = True
        tg.fail("getUpdates", status=429, description="Too Many Requests: retry after 0", retry_after=0, times=10**6,
                when=lambda p: failing and int(p.get("offset") or 0) > first["update_id"])
        await t.wait_for(lambda: t.channel.albums.parts(str(CHAT)) == 1)
        await t.wait_for(lambda: tg.count("getUpdates") >= 3)  # failing, over and over
        await t.wait_for(lambda: clock.asleep == 1)
        clock.advance(2 * WINDOW)  # no part for two windows, but Telegram could not be asked for them
        await t.wait_for(lambda: clock.asleep == 1)
        assert fake_openai.requests == [] and t.channel.albums.parts(str(CHAT)) == 1
        for photo in ("p2", "p3"):
            tg.user_message(photo=photo, extra={"media_group_id": "83"})
        failing = False
        await t.wait_for(t.consumed)
        clock.advance(WINDOW)
        await t.settle()
        [request] = fake_openai.requests  # one answer, about all three
        assert new_images(request) == [("image/jpeg", PHOTOS[p]) for p in ("p1", "p2", "p3")]
        assert tg.visible(CHAT) == ["three photos"]
    finally:
        failing = False
        await t.close()
