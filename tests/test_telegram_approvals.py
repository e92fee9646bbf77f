"""Tool approvals on Telegram through the real aiogram client and the fake Bot API: the inline keyboard under
an approval request, who may press it, the decision replacing the keyboard, late presses, and webhook mode."""

from __future__ import annotations

import aiohttp
import pytest

from channels.telegram.approvals import GONE, NOT_YOURS
from channels.telegram.channel import SECRET_HEADER
from tests.browser.server import registry
from tests.fakes.openai_server import Text, ToolCalls
from tests.fakes.telegram.harness import telegram_harness
from tests.support.telegram_approvals import ALLOW, ASK, DENY, REQUEST, approval_message, lookup_tool

GROUP = -100777


@pytest.fixture
def tool():
    return lookup_tool()


async def test_the_requester_allows_and_the_answer_arrives(tmp_path, fake_openai, tg, tool):
    fake_openai.script(ASK, Text("You have 42 apples."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool)})
    try:
        tg.user_message("how many apples do I have?")
        msg = await approval_message(t, 555)
        assert msg.text == REQUEST
        assert [label for label, _ in msg.buttons] == [ALLOW, DENY]
        assert all(len(data.encode()) <= 64 for _, data in msg.buttons)
        assert tool.calls == []

        press = tg.press(555, msg.message_id, ALLOW)
        await t.settle()
        assert tool.calls == [{"query": "apples"}]
        assert [a.get("text") for a in tg.answers(press)] == ["Allowed"]
        shown = tg.chats[555][msg.message_id]
        assert shown.buttons == []  # the decision replaced the keyboard
        assert shown.text == f"{REQUEST}\n\n✅ Allowed by Alice"
        assert tg.visible(555)[-1] == "You have 42 apples."
        assert fake_openai.requests[1]["messages"][-1]["content"] == "42 apples"
    finally:
        await t.close()


async def test_a_strangers_press_is_refused_and_changes_nothing(tmp_path, fake_openai, tg, tool):
    """allow_from "*": only the user who asked may decide; the request stays in the forum topic."""
    fake_openai.script(ASK, Text("Counted."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool)}, group_policy="all")
    try:
        tg.user_message("count my apples", chat_id=GROUP, chat_type="supergroup", thread_id=42)
        msg = await approval_message(t, GROUP)
        assert msg.thread_id == 42 and msg.reply_to is not None
        before = (msg.text, msg.reply_markup, msg.edits)

        stranger = tg.press(GROUP, msg.message_id, ALLOW, user_id=888, username="mallory")
        await t.wait_for(lambda: tg.answers(stranger))
        [answer] = tg.answers(stranger)
        assert answer["text"] == NOT_YOURS and answer["show_alert"] is True
        shown = tg.chats[GROUP][msg.message_id]
        assert (shown.text, shown.reply_markup, shown.edits) == before
        assert tool.calls == [] and len(fake_openai.requests) == 1  # still waiting for a decision

        mine = tg.press(GROUP, msg.message_id, ALLOW)
        await t.settle()
        assert [a.get("text") for a in tg.answers(mine)] == ["Allowed"]
        assert tool.calls == [{"query": "apples"}]
        assert tg.chats[GROUP][msg.message_id].buttons == []
        assert tg.visible(GROUP)[-1] == "Counted."
        assert tg.messages(GROUP)[-1].thread_id == 42
    finally:
        await t.close()


async def test_an_allowed_user_denies_and_the_model_hears_the_denial(tmp_path, fake_openai, tg, tool):
    """allow_from is a list: anyone on it may decide, not only the user who asked."""
    fake_openai.script(ASK, Text("Fine, I did not look."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool)}, group_policy="all",
                               allow_from=("alice", "@bob"))
    try:
        tg.user_message("count my apples", chat_id=GROUP, chat_type="supergroup")
        msg = await approval_message(t, GROUP)
        allow_data = msg.buttons[0][1]
        bob = tg.press(GROUP, msg.message_id, DENY, user_id=999, username="bob")
        await t.settle()
        assert [a.get("text") for a in tg.answers(bob)] == ["Denied"]
        assert tool.calls == []
        shown = tg.chats[GROUP][msg.message_id]
        assert shown.buttons == [] and shown.text.endswith("\n\n❌ Denied by Bob")
        assert fake_openai.requests[1]["messages"][-1]["content"] == "Tool call denied by user."
        assert tg.visible(GROUP)[-1] == "Fine, I did not look."

        # a second press on the old keyboard (a client that had not refreshed) decides nothing again
        late = tg.press(GROUP, msg.message_id, ALLOW, data=allow_data)
        await t.wait_for(lambda: tg.answers(late))
        assert [a.get("text") for a in tg.answers(late)] == ["Already denied."]
        assert tool.calls == [] and len(fake_openai.requests) == 2
    finally:
        await t.close()


async def test_a_press_after_the_turn_ended_is_answered_gracefully(tmp_path, fake_openai, tg, tool):
    fake_openai.script(ASK, Text("Nobody answered, so I did not look."))
    t = await telegram_harness(tmp_path, fake_openai, tg,
                               core={"tools": registry(tool), "approval_timeout": 0.3})
    try:
        tg.user_message("how many apples?")
        msg = await approval_message(t, 555)
        data = msg.buttons[0][1]
        await t.settle()  # the approval times out, the turn ends with the denial
        shown = tg.chats[555][msg.message_id]
        assert shown.buttons == [] and shown.text.endswith("\n\n⌛ Denied: nobody decided in time.")
        assert tg.visible(555)[-1] == "Nobody answered, so I did not look."

        late = tg.press(555, msg.message_id, ALLOW, data=data)
        unknown = tg.press(555, msg.message_id, ALLOW, data="ap:from-an-earlier-run:a")  # e.g. after a restart
        odd = tg.press(555, msg.message_id, ALLOW, data="something else")
        await t.settle()
        assert [a.get("text") for a in tg.answers(late)] == [GONE]
        assert [a.get("text") for a in tg.answers(unknown)] == [GONE]
        assert len(tg.answers(odd)) == 1
        assert tool.calls == [] and len(fake_openai.requests) == 2
    finally:
        await t.close()


async def test_a_stop_while_waiting_removes_the_keyboard(tmp_path, fake_openai, tg, tool):
    fake_openai.script(ASK)
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool)})
    try:
        tg.user_message("how many apples?")
        msg = await approval_message(t, 555)
        tg.user_message("/stop")
        await t.settle()
        await t.wait_for(lambda: not tg.chats[555][msg.message_id].buttons)
        assert tg.chats[555][msg.message_id].text.endswith("\n\n⏹ The reply was stopped before a decision.")
        assert tool.calls == []
    finally:
        await t.close()


async def test_webhook_mode_delivers_the_press(tmp_path, fake_openai, tg, tool):
    fake_openai.script(ASK, Text("Via webhook: 42 apples."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(tool)}, mode="webhook",
                               webhook_url="https://bot.example.com/telegram/webhook", webhook_secret="s3cret")
    url = await t.serve_webhook()
    try:
        async with aiohttp.ClientSession() as http:
            async def deliver(update: dict) -> None:
                async with http.post(url, json=update, headers={SECRET_HEADER: "s3cret"}) as resp:
                    assert resp.status == 200

            await deliver(tg.user_message("how many apples?", enqueue=False))
            msg = await approval_message(t, 555)
            stranger = tg.press(555, msg.message_id, ALLOW, user_id=888, username="mallory", enqueue=False)
            await deliver(stranger)
            await t.wait_for(lambda: tg.answers(stranger))
            assert tg.answers(stranger)[0]["show_alert"] is True and tool.calls == []
            press = tg.press(555, msg.message_id, ALLOW, enqueue=False)
            await deliver(press)
            await t.wait_for(lambda: tg.answers(press))
            await t.h.settle()
        assert tool.calls == [{"query": "apples"}]
        assert tg.chats[555][msg.message_id].buttons == []
        assert tg.visible(555)[-1] == "Via webhook: 42 apples."
        assert tg.count("getUpdates") == 0
    finally:
        await t.close()


# ---- what will run is shown, within Telegram's limit ---------------------------------------------------

FETCH_SCHEMA = {"type": "object", "properties": {"note": {"type": "string"}, "url": {"type": "string"}},
                "required": ["url"]}


def utf16(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


async def test_a_long_decoy_is_shortened_and_the_url_is_shown_first_in_full(tmp_path, fake_openai, tg):
    import json

    from tests.test_tool_arguments import StrictTool

    fetch = StrictTool("fetch_url", schema=FETCH_SCHEMA, approval="ask")
    decoy = "a harmless weather lookup, nothing to see here " * 200  # ~9,600 characters
    url = "http://169.254.169.254/latest/meta-data/iam/security-credentials/admin?" + "q" * 200
    fake_openai.script(ToolCalls([("fetch_url", json.dumps({"note": decoy, "url": url}))], ids=["call_L"]),
                       Text("Done."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(fetch)})  # type: ignore[arg-type]
    try:
        tg.user_message("what is the weather?")
        msg = await approval_message(t, 555)
        assert [m.message_id for m in tg.messages(555) if "fetch_url" in m.text] == [msg.message_id]  # one message
        lines = msg.text.split("\n")
        assert lines[:2] == ["🔧 Approval needed: fetch_url", f"url={json.dumps(url)}"]
        assert lines[2].startswith('note="a harmless weather lookup') and lines[2].endswith(
            "more characters not shown)")
        assert utf16(msg.text) <= 4096
        tg.press(555, msg.message_id, DENY)
        await t.settle()
        shown = tg.chats[555][msg.message_id]
        assert shown.text.startswith(msg.text) and shown.text.endswith("❌ Denied by Alice")
        assert fetch.calls == []
    finally:
        await t.close()


async def test_a_key_argument_longer_than_a_message_is_split_never_cut(tmp_path, fake_openai, tg):
    import json

    from tests.test_tool_arguments import StrictTool

    fetch = StrictTool("fetch_url", schema=FETCH_SCHEMA, approval="ask")
    url = "https://example.org/?" + "&".join(f"k{i}=v{i}" for i in range(1500))  # ~12,000 characters
    fake_openai.script(ToolCalls([("fetch_url", json.dumps({"url": url}))], ids=["call_S"]), Text("Fetched."))
    t = await telegram_harness(tmp_path, fake_openai, tg, core={"tools": registry(fetch)})  # type: ignore[arg-type]
    try:
        tg.user_message("fetch it")
        msg = await approval_message(t, 555)
        parts = [m for m in tg.messages(555) if "fetch_url" in m.text]
        assert len(parts) >= 3 and parts[-1].message_id == msg.message_id  # the keyboard is under the last
        assert all(utf16(p.text) <= 4096 for p in parts)
        assert parts[0].text.startswith("🔧 Approval needed: fetch_url\nurl=")
        assert all(p.text.startswith("🔧 fetch_url, continued:\n") for p in parts[1:])
        joined = parts[0].text + "".join(p.text.split("\n", 1)[1] for p in parts[1:])
        assert joined == f"🔧 Approval needed: fetch_url\nurl={json.dumps(url)}"  # nothing dropped
        tg.press(555, msg.message_id, ALLOW)
        await t.settle()
        assert fetch.calls == [{"url": url}]
        assert tg.chats[555][msg.message_id].text.endswith("✅ Allowed by Alice")
    finally:
        await t.close()
