"""``allow_from`` on Telegram against someone trying to get around it, through the real aiogram client and the
fake Bot API: look-alike and spoofed usernames on other accounts, edits, and approval buttons pressed by
people the request is not for. The rule: only ids, and usernames Telegram vouches for, count — never a
display name, never a look-alike, never a username shaped like someone's id."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web

from channels.telegram.approvals import NOT_YOURS
from channels.telegram.channel import SECRET_HEADER, WEBHOOK_PATH
from tests.browser.server import RecordingTool, registry
from tests.fakes.openai_server import Text, ToolCalls
from tests.fakes.telegram import Shown
from tests.fakes.telegram.harness import TelegramHarness, telegram_harness

GROUP = -100777
ALICE = 777
ASK = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_T1"])
ALLOW, DENY = "✅ Allow", "❌ Deny"



@pytest.fixture
def tool():
    return RecordingTool("lookup", result="42 apples")


# (user id, username, first name): none of these is alice (id 777, @alice) or bob (@bob)
IMPOSTORS = [
    (999, "\u0430lice", "Alice"),       # Cyrillic а
    (999, "alice_", "Alice"),
    (999, "alice\u200b", "Alice"),      # a zero-width space
    (999, "xalice", "alice"),
    (999, None, "alice"),               # a display name is not a username
    (999, None, "@alice"),
    (999, "777", "Alice"),              # a "username" shaped like alice's id
    (-777, None, "Alice"),
    (7770, None, "Alice"),
]


@pytest.mark.parametrize("allow", [("777", "@bob"), ("@alice", "@bob")])
async def test_look_alike_and_spoofed_usernames_never_reach_the_model(tmp_path, fake_openai, tg, allow):
    fake_openai.script(Text("only for alice"))
    t = await telegram_harness(tmp_path, fake_openai, tg, allow_from=allow)
    try:
        for user_id, username, first in IMPOSTORS:
            update = tg.user_message(f"let me in as {username or first}", user_id=user_id, username=username)
            update["message"]["from"]["first_name"] = first
        # an edit of a message, even by the allowed user, is not a new message to answer
        tg.user_message("edited into a question", user_id=ALICE, username="alice", edited=True, message_id=1)
        await t.settle()
        assert fake_openai.requests == [] and tg.visible(555) == []
        tg.user_message("it is me", user_id=ALICE, username="alice")
        await t.settle()
        assert tg.visible(555) == ["only for alice"] and len(fake_openai.requests) == 1
    finally:
        await t.close()


async def approval_message(t: TelegramHarness, chat_id: int) -> Shown:
    await t.wait_for(lambda: [m for m in t.tg.messages(chat_id) if m.buttons])
    [msg] = [m for m in t.tg.messages(chat_id) if m.buttons]
    return msg


@pytest.mark.parametrize("allow", [("777", "@bob"), ("*",)])
async def test_approval_buttons_pressed_by_impostors_change_nothing(tmp_path, fake_openai, tg, tool, allow):
    fake_openai.script(ASK, Text("Counted."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool)}, group_policy="all",
                               allow_from=allow)
    try:
        tg.user_message("count my apples", chat_id=GROUP, chat_type="supergroup", user_id=ALICE, username="alice")
        msg = await approval_message(t, GROUP)
        before = (msg.text, msg.reply_markup, msg.edits)
        presses = []
        for user_id, username, _ in [*IMPOSTORS, (999, "mallory", "Mallory")]:
            presses.append(tg.press(GROUP, msg.message_id, ALLOW, user_id=user_id, username=username))
        await t.wait_for(lambda: all(tg.answers(p) for p in presses))
        for press in presses:
            [answer] = tg.answers(press)
            assert answer["text"] == NOT_YOURS, press["callback_query"]["from"]
        shown = tg.chats[GROUP][msg.message_id]
        assert (shown.text, shown.reply_markup, shown.edits) == before
        assert tool.calls == [] and len(fake_openai.requests) == 1  # still waiting

        mine = tg.press(GROUP, msg.message_id, ALLOW, user_id=ALICE, username="alice")
        await t.settle()
        assert [a.get("text") for a in tg.answers(mine)] == ["Allowed"]
        assert tool.calls == [{"query": "apples"}] and tg.visible(GROUP)[-1] == "Counted."
    finally:
        await t.close()


async def test_a_webhook_update_too_large_to_read_is_413_not_a_bad_request(tmp_path, fake_openai, tg):
    """The channel's own route, on an application without the bridge's body cap: a body over aiohttp's
    limit is refused as too large (Telegram then knows not to resend a smaller one), and nothing reaches core."""
    t = await telegram_harness(tmp_path, fake_openai, tg, mode="webhook",
                               webhook_url="https://bot.example.com/telegram/webhook", webhook_secret="s3cret")
    app = web.Application()
    t.channel.routes(app)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        update = tg.user_message("x" * (1024 * 1024 + 1), enqueue=False)
        async with aiohttp.ClientSession() as http:
            async with http.post(f"http://127.0.0.1:{runner.addresses[0][1]}{WEBHOOK_PATH}", json=update,
                                 headers={SECRET_HEADER: "s3cret"}) as resp:
                assert resp.status == 413
        assert fake_openai.requests == []
    finally:
        await t.close()
        await runner.cleanup()
