"""A test channel: a fake chat platform that records what a user would see, with injectable faults.

``FakePlatform`` keeps the messages visible in each chat (sent, edited, deleted). ``TestChannel`` is a
real Channel whose sink follows a turn by editing one message in place, and which can be told to fail at
open, fail the final update, hang, or hold the final update for platform pauses (which it reports, as a
channel does, so that core's wait stretches with them).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field

from core.channel import SinkError, TurnFeed
from core.envelope import InboundEnvelope, TurnTarget
from core.snapshot import TurnSnapshot


@dataclass
class Shown:
    message_id: int
    chat_id: str
    text: str
    kind: str  # "live" (a sink's message) or "plain"
    edits: int = 0


@dataclass
class FakePlatform:
    messages: dict[int, Shown] = field(default_factory=dict)
    log: list[tuple[str, str, str]] = field(default_factory=list)  # (action, chat_id, text)
    _ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def send(self, chat_id: str, text: str, kind: str) -> int:
        mid = next(self._ids)
        self.messages[mid] = Shown(mid, chat_id, text, kind)
        self.log.append(("send", chat_id, text))
        return mid

    def edit(self, mid: int, text: str) -> None:
        msg = self.messages[mid]
        if msg.text != text:
            msg.text = text
            msg.edits += 1
            self.log.append(("edit", msg.chat_id, text))

    def visible(self, chat_id: str) -> list[str]:
        return [m.text for m in self.messages.values() if m.chat_id == chat_id]

    def plain(self, chat_id: str) -> list[str]:
        return [m.text for m in self.messages.values() if m.chat_id == chat_id and m.kind == "plain"]


def render(snap: TurnSnapshot) -> str:
    text = snap.text
    if snap.error:
        text = f"{text}\n\n{snap.error}" if text else snap.error
    return text or "…"


class TestSink:
    def __init__(self, channel: TestChannel, target: TurnTarget) -> None:
        self.channel = channel
        self.target = target
        self.message_id: int | None = None
        self.updates: list[int] = []
        self.finish_calls = 0
        self.aborted = False
        self.paused = 0.0

    async def _show(self, text: str) -> None:
        if self.message_id is None:
            self.message_id = self.channel.platform.send(self.target.chat_id, text, "live")
        else:
            self.channel.platform.edit(self.message_id, text)

    async def follow(self, turn: TurnFeed) -> None:
        """Show the newest snapshot after each change (at most one per ``update_delay``: latest wins)."""
        shown = 0
        while not self.aborted:
            snapshot = turn.snapshot
            if snapshot.terminal:
                return
            if snapshot.version == shown:
                await turn.changed()
                continue
            if self.channel.update_delay:
                await asyncio.sleep(self.channel.update_delay)
                snapshot = turn.snapshot
                if snapshot.terminal:
                    return
            shown = snapshot.version
            self.updates.append(shown)
            await self._show(render(snapshot))

    async def finish(self, snapshot: TurnSnapshot) -> None:
        self.finish_calls += 1
        ch = self.channel
        if ch.hang_finish:
            await asyncio.sleep(3600)
        if ch.finish_fail:
            raise SinkError("message to edit not found")
        while ch.finish_pauses > 0:  # the platform says "429: retry later": the channel waits it out
            ch.finish_pauses -= 1
            self.paused += ch.pause_seconds
            await asyncio.sleep(ch.pause_seconds)
        await self._show(render(snapshot))

    def paused_seconds(self) -> float:
        return self.paused

    async def abort(self) -> None:
        self.aborted = True

    def undelivered(self, snapshot: TurnSnapshot) -> str | None:
        return None

    def final_in_doubt(self) -> bool:
        return False


class TestChannel:
    __test__ = False  # not a pytest class

    def __init__(self, name: str = "test", platform: FakePlatform | None = None) -> None:
        self.name = name
        self.platform = platform or FakePlatform()
        self.sinks: list[TestSink] = []
        self.fail_open = False
        self.hang_open = False
        self.finish_fail = False
        self.hang_finish = False
        self.update_delay = 0.0
        self.plain_fail = False
        self.finish_pauses = 0
        self.pause_seconds = 0.0
        self._state = "ready"

    # receiving is the test's business (it submits envelopes itself): the lifecycle only records itself
    async def start(self) -> None:
        self._state = "ready"

    async def stop(self) -> None:
        self._state = "stopped"

    async def close(self) -> None:
        self._state = "closed"

    def state(self) -> str:
        return self._state

    async def open_sink(self, target: TurnTarget) -> TestSink:
        if self.hang_open:
            await asyncio.sleep(3600)
        if self.fail_open:
            raise SinkError("cannot open")
        sink = TestSink(self, target)
        self.sinks.append(sink)
        return sink

    async def send_plain(self, target: TurnTarget, text: str) -> None:
        if self.plain_fail:
            raise SinkError("plain send failed")
        self.platform.send(target.chat_id, text, "plain")

    def envelope(self, text: str, *, chat_id: str = "c1", sender_id: str = "u1", **kw: object) -> InboundEnvelope:
        return InboundEnvelope(channel=self.name, chat_id=chat_id, sender_id=sender_id, content=text, **kw)  # type: ignore[arg-type]
