"""What the Telegram approval tests share: a model that asks to run ``lookup`` on apples (a tool that answers
"42 apples"), the request Telegram then shows, its buttons, and how a test finds the message that shows them."""

from __future__ import annotations

from tests.browser.server import RecordingTool
from tests.fakes.openai_server import ToolCalls
from tests.fakes.telegram import FakeTelegram, Shown
from tests.fakes.telegram.harness import TelegramHarness

ASK = ToolCalls([("lookup", '{"query": "apples"}')], ids=["call_T1"])
REQUEST = '🔧 Approval needed: lookup\nquery="apples"'
ALLOW, DENY = "✅ Allow", "❌ Deny"


def lookup_tool() -> RecordingTool:
    return RecordingTool("lookup", result="42 apples")


def with_keyboard(tg: FakeTelegram, chat_id: int) -> list[Shown]:
    """The messages in ``chat_id`` that show live buttons."""
    return [m for m in tg.messages(chat_id) if m.buttons]


async def approval_message(t: TelegramHarness, chat_id: int) -> Shown:
    """The one message in ``chat_id`` that shows buttons, once it is there."""
    await t.wait_for(lambda: with_keyboard(t.tg, chat_id))
    [msg] = with_keyboard(t.tg, chat_id)
    return msg
