"""Feishu's side of the shared live sink: a CardKit streaming card, message operations, approval cards.

A reply streams into a **CardKit card entity** (JSON 2.0, ``streaming_mode`` on), sent by ``card_id`` as a
reply to the user's message. ``CardStream`` is the sink's native stream: every push writes the markdown
element's whole content (Feishu types the difference when the old text is a prefix of the new) with the
card's next ``sequence`` — one counter per card, shared by every card operation, strictly increasing, a
fresh number for every attempt — and a ``uuid`` per operation, so a repeated operation is a no-op. The card
also shows the turn's tool activity and pending approvals under the answer (``shows_activity``). Pushes are
paced by the chat's throttle scope (``stream_interval_ms``, 0.5 s: latest snapshot wins); every message
sent also takes a slot of the app's send budget (``app_sends_per_second``, shared by all chats), waited for
inside the call with ``Calls.pace`` so that a long queue for it never times the call out; the app's rate
limit on a send (99991400, ``x-ogw-ratelimit-reset``) pauses that budget, so every chat's sends wait it out.

Size: the sink splits the reply with this platform's measure (JSON bytes of the card markdown, at most
``render.CARD_PART_BYTES``). When the unfinished tail outgrows one card, the shared sink sends the finished
part as a new message; here that ``send`` **freezes the streaming card** instead: it gets the finished
part as its final content, ``streaming_mode`` is closed, and the next push opens a new card below it.
Nothing is truncated, and the cards read in order.

The card is opened a moment after the turn starts (``WORKING_SIGN_DELAY``; with the first text if that comes
sooner), showing "…": it is the turn's working sign (the typing indicator of ``LiveSink``), and the answer
streams into it. Under load, when every request slot of the API is
taken (``FeishuApi.busy``), a push of new text is left out rather than queued behind them, and so is opening
the card: the next push or the end shows newer text anyway (a change of tool activity still goes through). A
finished part with no card open to take it (a reply that ended before any push got a slot) is sent as one
JSON card message: one call, where a card entity would take two.

The end: ``close`` writes the final content and closes ``streaming_mode`` in one ``batch_update`` call (also
after /stop and a model failure: the terminal snapshot carries the notice; also after Feishu closed the card's
streaming itself, whose "[…]" summary would stay in the chat list otherwise). A card that holds no part of the
final answer (it showed only "…", tool activity, or text a retried request did not write again) is recalled,
as a stale preview is. If the
close fails for good, the shared sink's fallback sends what the ledger says is missing (the card's part
included: the card is not in the ledger); the card is then closed showing only a short "answer below" note when
it can still be edited (``FeishuSink``), so none of its words show twice, or, when nothing is missing (a recall
that kept failing), only ended as it stands. An aborted sink (core
gave up waiting for the end, shutdown, the session moved to another process) leaves the card's content as it
is and ends its streaming in one call of its own, so it never stays looking live.

Feishu refuses a content update on a card whose streaming is closed (300309; 200850 after its 10-minute
limit): the card is then updated by replacing its element, and the rest of the answer goes into it.

Where CardKit is refused (card creation refused for good: no ``cardkit:card:write`` scope, a private
deployment without CardKit), the stream reports ``unsupported`` and the sink streams by sending and
patching plain JSON card messages instead. Parts rendered plain (after Feishu rejected the card markdown)
are sent as ``text`` messages.

Message sends carry the API's ``uuid`` (the reconciler's idempotency key for that send), so a retried send
never posts twice. Where CardKit is refused, the working sign is a reaction on the user's message (removed at
the end).

While a message's files download, before its turn's sink opens, the working sign is that reaction too
(``channels.common.working_sign``, ``FeishuChannel.working``): no card is opened for a turn that may still end
there. The sink takes it over (``FeishuOps.adopt``): it is removed once the turn's card shows, or at the end
where there is none.

Approval requests are separate card messages (Feishu does not let a callback update a streaming card):
``FeishuPrompts`` posts them; the channel answers presses (``channels.feishu.channel``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from channels.common.calls import outside_bound
from channels.common.errors import PlatformError
from channels.common.ledger import Part
from channels.common.live_sink import LiveSink
from channels.common.ops import Capabilities, NativeStream, TextChange
from channels.common.status import status_lines
from channels.common.throttle import Scope
from channels.common.working_sign import WorkingSign
from channels.feishu import approvals, render
from channels.feishu.api import RATE_LIMITED, code_of
from channels.feishu.context import FeishuContext
from core.channel import SinkError
from core.envelope import TurnTarget
from core.host import ShuttingDownError
from core.snapshot import ApprovalRequest, TurnSnapshot

if TYPE_CHECKING:
    from channels.feishu.channel import FeishuChannel

log = logging.getLogger(__name__)

ANSWER = "answer"
"""The element_id of a card's markdown element."""
WORKING_EMOJI = "Typing"
PLACEHOLDER = "…"
ANSWER_BELOW = "_(The answer continues in the message below.)_"
STREAMING_CLOSED = (300309, 200850)
"""Content updates refused because streaming_mode is off (closed, or Feishu's 10-minute timeout)."""
_PLAIN = ("plain",)


def uuid_for(key: str) -> str:
    """An idempotency key within Feishu's 50 characters (the same key always gives the same uuid)."""
    return key if len(key) <= 50 else hashlib.sha256(key.encode()).hexdigest()[:40]


def streaming_card(content: str) -> dict[str, Any]:
    config = {"streaming_mode": True, "update_multi": True, "summary": {"content": "[…]"},
              "streaming_config": {"print_strategy": "fast"}}
    return {"schema": "2.0", "config": config,
            "body": {"elements": [{"tag": "markdown", "element_id": ANSWER, "content": content or PLACEHOLDER}]}}


def static_card(content: str) -> dict[str, Any]:
    """A card message sent as JSON (when CardKit is not available)."""
    return {"schema": "2.0", "config": {"update_multi": True},
            "body": {"elements": [{"tag": "markdown", "element_id": ANSWER, "content": content or PLACEHOLDER}]}}


def activity(snapshot: TurnSnapshot) -> str:
    """Tool activity, pending approvals and running subagents, as lines under the answer while the turn runs."""
    icons = {"awaiting_approval": "⏳", "running": "⚙️", "done": "✅", "failed": "⚠️", "denied": "⛔"}
    lines = []
    for tool in snapshot.tools:
        status = str(tool.status)
        what = "waiting for approval (see the card below)" if status == "awaiting_approval" else status
        lines.append(f"{icons.get(status, '•')} `{tool.name}` {what}")
    children = status_lines(snapshot)
    if children:
        lines.append(children)
    return "\n".join(lines)


class FeishuRenderer:
    """Card markdown while streaming and at the end alike (the model's Markdown renders as written)."""

    def stream_part(self, source: str) -> Part:
        return Part(text=render.card_markdown(source), source=source)

    def final_part(self, source: str) -> Part:
        return Part(text=render.card_markdown(source), source=source)

    def plain_part(self, source: str) -> Part:
        return Part(text=source, source=source, formatting=_PLAIN)


@dataclass(frozen=True, slots=True)
class Destination:
    chat_id: str
    reply_to: str | None
    """The user's message every reply quotes (None for a target without one)."""

    @property
    def key(self) -> str:
        return f"chat:{self.chat_id}"

    @classmethod
    def of(cls, target: TurnTarget) -> Destination:
        try:
            reply_to: str | None = FeishuContext.of(target).message_id
        except ValueError:
            reply_to = None
        return cls(target.chat_id, reply_to)


@dataclass(slots=True)
class CardState:
    """One card entity of a reply: what it shows and its operation counter."""

    card_id: str
    content: str
    sequence: int = 0
    message_id: str | None = None
    send_key: str = field(default_factory=lambda: secrets.token_hex(16))
    streaming: bool = True
    """Content updates are accepted (False once the card was closed, by us or by Feishu)."""
    ended: bool = False
    """The card's streaming was ended by us (``CLOSED``: also its "[…]" summary dropped)."""

    def next(self) -> tuple[int, str]:
        self.sequence += 1
        return self.sequence, secrets.token_hex(12)


class FeishuOps:
    """``MessageOps`` for one destination."""

    def __init__(self, channel: FeishuChannel, dest: Destination) -> None:
        self.channel = channel
        self.api = channel.api
        self.dest = dest
        self.capabilities = Capabilities(limit=render.CARD_PART_BYTES, unit="bytes", measure=render.card_measure,
                                         can_delete=True, idempotent_sends=True, native_stream=True)
        self.scopes: tuple[Scope, ...] = (channel.chat_scope(dest),)
        self.send_scopes = (Scope("app:send", 1 / channel.settings.app_sends_per_second),)
        """The app's budget of sends, shared by every chat (taken when a send goes out, retries included)."""
        self.cards: dict[str, CardState] = {}
        """Messages that show a card entity (by message id)."""
        self.kinds: dict[str, str] = {}
        """message id → "card" (JSON card message) | "text"."""
        self.current: CardStream | None = None
        self.reaction: str | None = None
        self._reacted = False
        self._earlier: WorkingSign[FeishuOps] | None = None
        """The working sign shown for this turn before its sink opened, until the card or the end takes it."""

    def adopt(self, sign: WorkingSign[FeishuOps]) -> None:
        """Take over the reaction ``sign`` shows, or is on its way to show: removed once this turn's card shows
        (``card_shown``), or at its end."""
        self._earlier = sign

    async def take_over(self) -> None:
        """The adopted working reaction, once its call landed, becomes this turn's (``reaction``)."""
        sign, self._earlier = self._earlier, None
        if sign is None:
            return
        async with outside_bound():  # the sign's own call, bounded by the call policy: not this attempt's wait
            await sign.landed.wait()
        if self.reaction is None:
            self.reaction = sign.ops.reaction

    async def post(self, msg_type: str, content: str, key: str) -> str:
        d = self.dest
        try:
            return await self._send(d.chat_id, msg_type, content, key, d.reply_to)
        except PlatformError as exc:
            if exc.kind != "not_found" or not d.reply_to:
                raise
            # the user's message was recalled meanwhile: the reply goes to the chat itself
            return await self._send(d.chat_id, msg_type, content, key, None)

    async def _send(self, chat_id: str, msg_type: str, content: str, key: str, reply_to: str | None) -> str:
        """One send in a slot of the app's budget (waited for outside the call's bound, once the request has its
        turn to go out); the app's rate limit (99991400) pauses every send of the app, not only this chat's."""
        try:
            return await self.api.send(chat_id, msg_type, content, uuid_for(key), reply_to=reply_to,
                                       pace=lambda: self.channel.calls.pace(self.send_scopes))
        except PlatformError as exc:
            if code_of(exc) == RATE_LIMITED:
                exc.scope = self.send_scopes[0].key
            raise

    async def send(self, part: Part, key: str) -> str:
        stream = self.current
        if stream is not None and stream.card is not None and part.formatting != _PLAIN \
                and not self.channel.cardkit_refused:
            try:
                return await stream.freeze(part)  # the streaming card becomes this finished part
            except PlatformError as exc:
                if exc.kind != "unsupported":
                    raise
        if part.formatting == _PLAIN:
            message_id = await self.post("text", json.dumps({"text": part.text}, ensure_ascii=False), key)
            self.kinds[message_id] = "text"
        else:
            message_id = await self.post("interactive", json.dumps(static_card(part.text), ensure_ascii=False), key)
            self.kinds[message_id] = "card"
        return message_id

    async def edit(self, message_id: str, part: Part) -> None:
        card = self.cards.get(message_id)
        if card is not None:
            await set_card(self.api, card, part.text, close=True)
        elif self.kinds.get(message_id) == "text":
            await self.api.update(message_id, "text", json.dumps({"text": part.text}, ensure_ascii=False))
        else:
            await self.api.patch_card(message_id, static_card(part.text))

    async def delete(self, message_id: str) -> None:
        try:
            await self.api.delete(message_id)
        except PlatformError as exc:
            if exc.kind != "not_found":
                raise

    async def typing(self) -> None:
        """The working sign, once per turn: the reply's streaming card, opened showing "…" (the card the
        answer streams into, so it costs no call of its own); where CardKit is not available, a reaction on the
        user's message instead (a reply works without it: its failure is only logged)."""
        await self.take_over()
        if self._reacted:
            return
        self._reacted = True
        stream = self.current
        if stream is not None and not self.channel.cardkit_refused:
            if self.api.busy:
                return  # every request slot is taken: they go to answers; the card opens with a later push
            try:
                await stream.open_now()
                return
            except PlatformError as exc:
                if exc.kind != "unsupported":
                    raise
        await self.react()

    async def react(self) -> None:
        """The working reaction on the user's message, unless it shows one already (a reply works without it:
        its failure is only logged)."""
        if self.reaction is not None or not self.dest.reply_to:
            return
        try:
            self.reaction = await self.api.react(self.dest.reply_to, WORKING_EMOJI)
        except PlatformError as exc:
            log.info("could not add the working reaction: %s", exc)

    def card_shown(self) -> None:
        """The turn's card is in the chat: it is the working sign now, so a reaction adopted from the downloads
        (``adopt``) goes, without the card's call waiting for that."""
        if self._earlier is None and self.reaction is None:
            return
        with contextlib.suppress(ShuttingDownError):  # shutting down: the end of the turn removes it
            self.channel.host.spawn("feishu:unreact", self.drop_reaction())

    async def drop_reaction(self) -> None:
        """Remove the working reaction (a failure leaves it: logged, never raised)."""
        await self.take_over()
        if self.reaction is None:
            return
        try:
            await self.channel.calls.call(self.unreact, scopes=self.scopes, paced=False, retry=False)
        except PlatformError as exc:
            log.info("could not remove the working reaction: %s", exc)

    async def unreact(self) -> None:
        reaction, self.reaction = self.reaction, None
        if reaction is not None and self.dest.reply_to:
            await self.api.unreact(self.dest.reply_to, reaction)

    def stream(self) -> NativeStream | None:
        if self.channel.cardkit_refused:
            return None
        self.current = CardStream(self)
        return self.current


CLOSED: dict[str, Any] = {"streaming_mode": False, "summary": {"content": ""}}
"""The card settings that end a card's streaming (and drop the "[…]" summary it showed in the chat list)."""


def replace_and_close(content: str) -> list[dict[str, Any]]:
    """The ``batch_update`` actions that show ``content`` for good and end the card's streaming, in one call."""
    element = {"tag": "markdown", "element_id": ANSWER, "content": content}
    return [{"action": "update_element", "params": {"element_id": ANSWER, "element": element}}, *END]


END: list[dict[str, Any]] = [{"action": "partial_update_setting", "params": {"settings": {"config": CLOSED}}}]
"""The ``batch_update`` action that ends a card's streaming and leaves its content as it is."""


async def end_card(api: Any, card: CardState) -> None:
    """End ``card``'s streaming as it stands (an aborted reply: what it shows stays, and no longer looks live)."""
    if card.ended:
        return
    seq, op = card.next()
    await api.card_batch(card.card_id, END, seq, op)
    card.streaming, card.ended = False, True


async def set_card(api: Any, card: CardState, content: str, *, close: bool) -> None:
    """Make ``card`` show ``content`` (and, with ``close``, end its streaming). Each step is skipped once done,
    so a repeated call after a failure does only what is left; every attempt takes a new sequence. Closing a
    streaming card is one ``batch_update``: the element replaced with the final content and streaming ended
    together (a CardKit card's end costs one call, whatever it showed before; also after Feishu closed its
    streaming itself, which leaves the "[…]" summary in the chat list)."""
    content = content or PLACEHOLDER
    if close and not card.ended:
        seq, op = card.next()
        await api.card_batch(card.card_id, replace_and_close(content), seq, op)
        card.content, card.streaming, card.ended = content, False, True
        return
    if card.content != content:
        if card.streaming:
            seq, op = card.next()
            try:
                await api.card_content(card.card_id, ANSWER, content, seq, op)
            except PlatformError as exc:
                if code_of(exc) not in STREAMING_CLOSED:
                    raise
                card.streaming = False  # Feishu closed it (10-minute limit): replace the element instead
        if card.streaming is False and card.content != content:
            seq, op = card.next()
            element = {"tag": "markdown", "element_id": ANSWER, "content": content}
            await api.card_batch(card.card_id, [{"action": "update_element",
                                                 "params": {"element_id": ANSWER, "element": element}}], seq, op)
        card.content = content


class CardStream:
    """The unfinished tail of a reply in a CardKit streaming card (with the turn's tool activity)."""

    shows_activity = True

    def __init__(self, ops: FeishuOps) -> None:
        self._ops = ops
        self.card: CardState | None = None
        self._opening = asyncio.Lock()
        self._status = ""
        """The tool activity the card shows."""
        self._source = ""
        """The Markdown of the reply the card shows (its content also has the activity lines)."""

    async def _open(self, content: str) -> CardState:
        ops = self._ops
        if ops.channel.cardkit_refused:  # refused for good already (this turn's working sign asked)
            raise PlatformError("CardKit refused", kind="unsupported")
        try:
            card_id = await ops.api.create_card(streaming_card(content))
        except PlatformError as exc:
            if exc.transient or exc.kind == "not_found":
                raise
            if exc.kind != "format":  # one reply's content Feishu would not render says nothing of the next
                ops.channel.cardkit_refused = True
            raise PlatformError(f"CardKit refused: {exc}", kind="unsupported") from None
        self.card = CardState(card_id, content or PLACEHOLDER)
        return self.card

    async def _ready(self, content: str) -> CardState:
        """The card shown in the chat, opened and sent first if that has not happened yet (one at a time: the
        working sign and the first push never open two). A send whose outcome was unknown is repeated with
        the same uuid, so it never posts the card twice."""
        async with self._opening:
            card = self.card or await self._open(content)
            if card.message_id is None:
                payload = json.dumps({"type": "card", "data": {"card_id": card.card_id}})
                card.message_id = await self._ops.post("interactive", payload, card.send_key)
                self._ops.cards[card.message_id] = card
                self._ops.card_shown()
            return card

    async def open_now(self) -> None:
        """Show the card before any text (the turn's working sign)."""
        await self._ready("")

    async def _show(self, content: str) -> None:
        card = await self._ready(content)
        if card.content != (content or PLACEHOLDER):
            await set_card(self._ops.api, card, content, close=False)

    async def push(self, snapshot: TurnSnapshot, text: str, change: TextChange | None) -> None:
        status = activity(snapshot)
        card = self.card
        if self._ops.api.busy and status == self._status and (card is None or card.message_id is not None):
            # every request slot is taken: this update would only wait behind them and be superseded by the
            # next one (or the end), so it is left out, opening the card included; a change of tool activity
            # still goes through
            return
        answer = render.card_markdown(text) if text.strip() else ""
        await self._show(f"{answer}\n\n{status}".strip() if status else answer)
        self._status = status
        self._source = text

    async def freeze(self, part: Part) -> str:
        """The open card shows ``part`` for good; the next push opens a new card."""
        card = await self._ready(part.text)
        await set_card(self._ops.api, card, part.text, close=True)
        self.card, self._source = None, ""
        assert card.message_id is not None
        return card.message_id

    async def close(self, snapshot: TurnSnapshot, part: Part | None) -> str | None:
        card = self.card
        if card is None:
            return None  # nothing was shown: the sink sends the part as a message
        card = await self._ready(card.content)
        message_id = card.message_id
        if part is None:
            # nothing of the final answer belongs here (the card showed only "…", tool activity, or text a retried
            # request did not write again): the card is removed, as a stale preview is
            await self._remove(card)
            self.card = None
            return None
        if part.formatting == _PLAIN:
            # the card markdown was refused: the card keeps what it showed, closed; the plain part is sent
            await set_card(self._ops.api, card, card.content, close=True)
            self.card = None
            return None
        await set_card(self._ops.api, card, part.text, close=True)
        self.card = None  # finished: a part sent after it gets a card of its own
        return message_id

    async def _remove(self, card: CardState) -> None:
        """Recall the card's message; where Feishu refuses, end its streaming as it stands instead (it then
        shows what it showed, no longer live)."""
        assert card.message_id is not None
        try:
            await self._ops.delete(card.message_id)
        except PlatformError as exc:
            if exc.transient:
                raise
            log.info("could not remove a card with no part of the answer (%s); closing it instead", exc)
            await end_card(self._ops.api, card)
        self._ops.cards.pop(card.message_id, None)

    def leftover(self) -> tuple[str, Part] | None:
        card = self.card
        if card is None or card.message_id is None:
            return None
        return card.message_id, Part(text=card.content, source=self._source)

    async def note_below(self) -> None:
        """After the final update failed for good: one try to close the card with a pointer to the fallback.
        The card's own text goes: it is not in the ledger, so the fallback sends its part in full, and what
        the card showed would read twice (a retried request's words, or the beginning of the answer). Where
        Feishu refuses that too (the card can no longer be changed), the card's message is recalled; only
        when the recall is refused as well does the card stay as it stands. A card whose own post never got an
        answer (it may be in the chat) is closed all the same: the call goes to the card, not to its message."""
        card = self.card
        if card is None or card.ended:
            return
        text = ANSWER_BELOW
        seq, op = card.next()
        actions = replace_and_close(text)  # one call that does not depend on the streaming update that just failed
        try:
            await self._ops.api.card_batch(card.card_id, actions, seq, op)
        except PlatformError as exc:
            if card.message_id is None:
                log.info("could not close a card whose post got no answer (%s)", exc)
                return
            log.info("could not close the card with a note (%s); recalling it", exc)
            try:
                await self._ops.delete(card.message_id)
            except PlatformError as recall:
                log.warning("could not recall the card either (%s): its words stay above the answer", recall)
                return
            self._ops.cards.pop(card.message_id, None)
            self.card = None
            return
        card.content, card.streaming = text, False


class FeishuSink(LiveSink):
    """The shared live sink with Feishu's two extras: a working reaction (where CardKit is not available) is
    removed at the end, and a card whose final update failed is closed with an "answer below" note before the
    fallback (when there is one: a card holding no part of the answer whose recall failed is only ended as it
    stands).
    The working sign is opened with ``start_typing``: what is shown next, and the end, wait for it."""

    ops: FeishuOps

    async def finish(self, snapshot: TurnSnapshot) -> None:
        try:
            await super().finish(snapshot)
        except SinkError:
            current = self.ops.current
            if current is not None and self.undelivered(snapshot):
                await current.note_below()  # core's fallback sends what is missing, below the card
            elif current is not None and current.card is not None and not current.card.ended:
                await self._end_card(current.card)  # nothing will follow: the card only stops looking live
            raise
        finally:
            await self._end_reaction()

    async def abort(self) -> None:
        stream = self.ops.current
        card = stream.card if stream is not None else None
        await super().abort()  # the card stays in the chat and counts for what it shows
        if card is not None and not card.ended:
            if self._spawn("feishu:end-card", self._end_card(card)) is None:  # shutting down: end it now
                await self._end_card(card)
        await self._end_reaction()

    async def _end_card(self, card: CardState) -> None:
        """An aborted reply's card stops looking live: its streaming is ended, its content left as it is (a call
        the abort cut off carries a lower sequence, so Feishu refuses it if it arrives later)."""
        try:
            await self.calls.call(lambda: end_card(self.ops.api, card), scopes=self.ops.scopes, paced=False,
                                  retry=False)
        except PlatformError as exc:
            log.info("could not end the streaming of an aborted reply's card: %s", exc)

    async def _end_reaction(self) -> None:
        await self.ops.take_over()
        if self.ops.reaction is None:
            return
        if self._spawn("feishu:unreact", self.ops.drop_reaction()) is None:  # shutting down: remove it now
            await self.ops.drop_reaction()


class FeishuPrompts:
    """``ApprovalPrompts``: one approval card message per request, replying to the user's message."""

    def __init__(self, channel: FeishuChannel, target: TurnTarget, ops: FeishuOps) -> None:
        self._channel = channel
        self._target = target
        self._ops = ops

    async def post(self, session_key: str, request: ApprovalRequest) -> Any:
        asker = f"subagent {request.label}" if request.label else request.requested_by or self._target.sender_id
        entry = self._channel.pending_approvals.register(
            session_key, request.call_id, request.tool_name, request.arguments_summary, asker,
            origin=request.origin, dest=self._ops.dest)
        card = approvals.approval_card(entry.ref, entry.tool_name, entry.arguments, entry.requested_by)
        content = json.dumps(card, ensure_ascii=False)
        await self._channel.save_open_approvals()  # findable by a press that reaches another process
        try:
            entry.message_id = await self._channel.calls.call(
                lambda: self._ops.post("interactive", content, entry.key), scopes=self._ops.scopes, idempotent=True)
        except Exception:
            entry.outcome = "ended"  # never shown with its buttons: nothing to find or close
            await self._channel.save_open_approvals()
            raise
        await self._channel.save_open_approvals()
        return entry

    async def ended(self, handle: Any, line: str) -> None:
        entry: PendingApproval = handle
        if entry.outcome is None:
            entry.outcome = line
            await self._channel.show_outcome(entry, line)
        elif not entry.shown and not entry.answering:  # a press's outcome its card does not show yet
            await self._channel.show_outcome(entry, entry.outcome)


@dataclass(slots=True)
class PendingApproval:
    ref: str
    session_key: str
    call_id: str
    tool_name: str
    arguments: str
    requested_by: str | None
    key: str = field(default_factory=lambda: secrets.token_hex(16))
    message_id: str | None = None
    outcome: str | None = None
    """How it ended (the card's outcome line), once it did."""
    shown: bool = False
    """Its card shows the outcome (the press's answer carried it in time, or a patch went through): until then
    the card may still show live buttons, so the request stays in the open-requests record."""
    answering: bool = False
    """A press decided it and its answer (which carries the decided card) is on its way."""
    origin: tuple[str, ...] = ()
    """A subagent's request (``run_subagent``): the child sessions it came through; a decision names them."""
    dest: Destination | None = None
    """Where its card is posted (with ``key``, a restart can find a card whose message id was never saved)."""
    asked_at: float = field(default_factory=time.time)


class PendingApprovals:
    """This process's approval requests by the short ``ref`` their buttons carry (call ids never travel to the
    client; another process finds them by ``ref`` in the open-requests record, ``channels.common.open_approvals``)."""

    def __init__(self, limit: int = 1000) -> None:
        self._by_ref: dict[str, PendingApproval] = {}
        self._limit = limit

    def register(self, session_key: str, call_id: str, tool_name: str, arguments: str,
                 requested_by: str | None, *, origin: tuple[str, ...] = (),
                 dest: Destination | None = None) -> PendingApproval:
        if len(self._by_ref) >= self._limit:  # forget the oldest: a press on it is answered "no longer pending"
            self._by_ref.pop(next(iter(self._by_ref)))
        entry = PendingApproval(secrets.token_hex(6), session_key, call_id, tool_name, arguments, requested_by,
                                origin=origin, dest=dest)
        self._by_ref[entry.ref] = entry
        return entry

    def get(self, ref: str) -> PendingApproval | None:
        return self._by_ref.get(ref)

    def open(self) -> list[PendingApproval]:
        """Requests whose cards may show live buttons: not ended (shown with their buttons, or about to be), or
        ended while their card does not show it yet."""
        return [e for e in self._by_ref.values()
                if e.outcome is None or (not e.shown and e.message_id is not None)]
