"""Where a Feishu message came from, typed once when it is normalised and kept with the turn target.

``message_id`` is the user's message: every reply quotes it (which also keeps a reply inside the thread the
message is in) and the "working" reaction goes on it. ``chat_type`` tells a p2p chat from a group.
"""

from __future__ import annotations

from typing import Literal

from channels.common.context import TypedContext


class FeishuContext(TypedContext):
    chat_type: Literal["p2p", "group"]
    message_id: str
    thread_id: str | None = None
