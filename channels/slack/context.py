"""Where a Slack message came from, typed once when the event is normalised and kept with the turn target.

``channel`` is the conversation, ``ts`` the user's message (the reaction that shows "thinking" goes on it),
``thread_ts`` the thread the reply goes into (None: the top level of a DM), ``user`` and ``team_id`` the
recipient a native stream outside a DM must name.
"""

from __future__ import annotations

from channels.common.context import TypedContext


class SlackContext(TypedContext):
    channel_type: str
    ts: str
    thread_ts: str | None = None
    user: str | None = None
    team_id: str | None = None

    @property
    def dm(self) -> bool:
        return self.channel_type == "im"
