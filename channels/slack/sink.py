"""Slack's side of the shared live sink: its message operations for one conversation (and thread).

``SlackOps`` posts, updates and deletes messages with the Web API (one attempt each; pacing, 429 pauses and
retries are the shared call policy's, in the channel's and the workspace's scopes, see
``channels.slack.client``). Parts are mrkdwn ``text`` while a reply streams and, at the end, a ``markdown``
block with the mrkdwn as its fallback text (``channels.slack.render``).

Native streaming (``SlackStream``): where the reply goes into a thread, the unfinished tail of a reply is
streamed with ``chat.startStream`` / ``chat.appendStream`` and ended with ``chat.stopStream``. The streamed
message is an ordinary message of the thread, so the sink's ledger takes it over (``MessageStream``):

- when the reply outgrows one message, the stream is stopped and its message is edited into the finished
  part; the rest streams in a new message;
- when Slack closed the stream (it expired, or the user stopped it) or the text was rewritten (a retried
  model answer), the stream is given up for the turn and its message is edited from then on;
- at the end the stream is stopped and its message updated to the final rendering of its part (an expired
  stream is simply updated).

A workspace that refuses ``chat.startStream`` (the method, a scope or the feature is missing) makes the
channel stream by updates from then on.

"Thinking": when nothing is shown a quarter of a second into the turn (``SlackSettings.thinking_delay``),
``assistant.threads.setStatus`` in a thread (Slack's AI-app status) or, where Slack refuses it, a reaction on
the user's message; either is cleared when the turn ends. Both methods have tight limits of their own for the
whole workspace, so an indicator is shown only when the workspace's thinking budget has room at that moment
(``SlackApi.thinking_scope``) and its method is not paused by a 429; otherwise the turn goes without one.

The same indicator shows while a message's files download, before its turn's sink opens
(``channels.common.working_sign``, ``SlackChannel.working``). The sink takes it over (``SlackOps.adopt``)
instead of showing a second one: one slot of the thinking budget and one call to clear it, as for any turn.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from channels.common.calls import outside_bound
from channels.common.errors import PlatformError
from channels.common.ledger import Part
from channels.common.live_sink import LiveSink
from channels.common.ops import Capabilities, NativeStream, TextChange
from channels.common.throttle import Scope
from channels.common.working_sign import WorkingSign
from channels.slack.approvals import ApprovalAction, Outcome, approval_blocks, approval_text, decided_blocks
from channels.slack.client import STREAM_ENDED, STREAM_REFUSED, error_code
from channels.slack.context import SlackContext
from channels.slack.posting import FindablePost, carries_button, carries_key, keyed
from channels.slack.render import PART_LIMIT, message_args, stream_pieces
from core.envelope import TurnTarget
from core.snapshot import ApprovalRequest, TurnSnapshot

if TYPE_CHECKING:
    from channels.slack.channel import SlackChannel

log = logging.getLogger(__name__)

THINKING_REACTION = "hourglass_flowing_sand"
THINKING_STATUS = "is thinking…"


@dataclass(frozen=True, slots=True)
class Destination:
    """Where a turn's messages go: the conversation, the thread (None: a DM's top level), and the user's
    message with its author and workspace."""

    channel: str
    thread_ts: str | None
    ctx: SlackContext

    @classmethod
    def of(cls, target: TurnTarget, *, thread_dm: bool = False) -> Destination:
        """``thread_dm``: answer a DM's top-level message in a thread under it (for native streaming)."""
        ctx = SlackContext.of(target)
        thread = ctx.thread_ts or (ctx.ts if thread_dm else None)
        return cls(target.chat_id, thread, ctx)


def _defused(text: str) -> str:
    # model text in a stream must not ping anyone: break Slack's special sequences
    return text.replace("<!", "<\u200b!").replace("<@", "<\u200b@").replace("<#", "<\u200b#")


class SlackOps:
    """``MessageOps`` for one destination."""

    def __init__(self, channel: SlackChannel, dest: Destination, *, native: bool) -> None:
        self._channel = channel
        self._api = channel.api
        self._dest = dest
        self._native = native
        self._thinking: str | None = None
        """"status" or "reaction" while a thinking indicator is up."""
        # a repeated post looks for its key first (``channels.slack.posting``): Slack answers it with the message
        self.capabilities = Capabilities(limit=PART_LIMIT, unit="utf16", can_delete=True, idempotent_sends=True,
                                         native_stream=native)
        self.scopes: tuple[Scope, ...] = self._api.scopes(dest.channel)
        self._posts: dict[str, FindablePost] = {}
        """Posts not answered yet, by key."""
        self._earlier: WorkingSign[SlackOps] | None = None
        """The working sign shown for this turn before its sink opened, until ``typing`` or the end takes it."""

    @property
    def dest(self) -> Destination:
        return self._dest

    @property
    def thinking(self) -> str | None:
        """"status" or "reaction" while this shows a thinking indicator."""
        return self._thinking

    def adopt(self, sign: WorkingSign[SlackOps]) -> None:
        """Take over the indicator ``sign`` shows, or is on its way to show: this turn shows no second one (its
        budget slot is spent already) and clears that one at its end."""
        self._earlier = sign

    async def _take_over(self) -> None:
        sign, self._earlier = self._earlier, None
        if sign is None:
            return
        async with outside_bound():  # the sign's own call, bounded by the call policy: not this attempt's wait
            await sign.landed.wait()
        if self._thinking is None:
            self._thinking = sign.ops.thinking

    async def send(self, part: Part, key: str) -> str:
        d = self._dest
        client = self._api.client
        post = self._posts.get(key)
        if post is None:
            post = self._posts[key] = FindablePost(self._channel, d.channel, d.thread_ts, carries_key(key))
        response = await self._api.once("chat.postMessage", lambda: post.post(lambda: client.chat_postMessage(
            channel=d.channel, thread_ts=d.thread_ts, unfurl_links=False, unfurl_media=False, metadata=keyed(key),
            **message_args(part))))
        del self._posts[key]
        return str(response["ts"])

    async def edit(self, message_id: str, part: Part) -> None:
        d = self._dest
        client = self._api.client
        await self._api.once("chat.update", lambda: client.chat_update(
            channel=d.channel, ts=message_id, **message_args(part)))

    async def delete(self, message_id: str) -> None:
        client = self._api.client
        try:
            await self._api.once("chat.delete", lambda: client.chat_delete(channel=self._dest.channel,
                                                                           ts=message_id))
        except PlatformError as exc:
            if exc.kind != "not_found":  # already gone is what we wanted
                raise

    async def typing(self) -> None:
        await self._take_over()
        if self._thinking is not None:
            return  # the status or reaction stays up until the end
        d = self._dest
        api = self._api
        client = api.client
        status = bool(d.thread_ts) and not self._channel.status_refused
        # its methods (to show it and to clear it) must not be paused by a 429 either
        methods = ("assistant.threads.setStatus",) if status else ("reactions.add", "reactions.remove")
        if not api.calls.throttle.take_now((api.thinking_scope(), *map(api.method_scope, methods))):
            log.debug("no room for a thinking indicator in the workspace now: this turn goes without one")
            return
        if status:
            try:
                await self._api.once("assistant.threads.setStatus", lambda: client.assistant_threads_setStatus(
                    channel_id=d.channel, thread_ts=str(d.thread_ts), status=THINKING_STATUS))
                self._thinking = "status"
                return
            except PlatformError as exc:
                if exc.transient:
                    raise
                # only AI-app threads have a status: a reaction says the same everywhere else
                log.info("no assistant thread status here (%s); showing a reaction instead", exc)
                self._channel.status_refused = True
                if api.calls.throttle.paused_for((api.method_scope("reactions.add"),
                                                  api.method_scope("reactions.remove"))) > 0:
                    return
        try:
            await self._api.once("reactions.add", lambda: client.reactions_add(
                channel=d.channel, timestamp=d.ctx.ts, name=THINKING_REACTION))
        except PlatformError as exc:
            if error_code(exc) != "already_reacted":
                raise
        self._thinking = "reaction"

    async def clear_thinking(self) -> None:
        """Take the thinking indicator down (a failure only leaves it up: logged, never raised)."""
        await self._take_over()
        shown = self._thinking
        d = self._dest
        client = self._api.client
        try:
            if shown == "reaction":
                await self._api.call("reactions.remove", lambda: client.reactions_remove(
                    channel=d.channel, timestamp=d.ctx.ts, name=THINKING_REACTION), channel=d.channel,
                    paced=False)
            elif shown == "status":
                await self._api.call("assistant.threads.setStatus", lambda: client.assistant_threads_setStatus(
                    channel_id=d.channel, thread_ts=str(d.thread_ts), status=""), channel=d.channel, paced=False)
        except PlatformError as exc:
            if error_code(exc) != "no_reaction":
                log.info("could not clear the thinking indicator: %s", exc)
        # forgotten once the call is over, not when it starts: a call cut off on its way (an abort the shutdown
        # cut short) leaves it for the next abort to take down
        if self._thinking == shown:
            self._thinking = None

    def stream(self) -> NativeStream | None:
        return SlackStream(self._channel, self._dest) if self._native else None


class SlackStream:
    """The unfinished tail of a reply as a Slack native stream (a ``MessageStream``, see the module docstring)."""

    shows_activity = False

    def __init__(self, channel: SlackChannel, dest: Destination) -> None:
        self._channel = channel
        self._api = channel.api
        self._dest = dest
        self._ts: str | None = None
        self._shown = ""
        """The Markdown the stream's message shows (what Slack accepted)."""
        self._streaming = False

    def _part(self) -> tuple[str, Part] | None:
        if self._ts is None:
            return None
        # a part no rendering equals, so the ledger edits it into whatever it must show
        return self._ts, Part(text=self._shown, source=self._shown, formatting=(("stream", self._ts),))

    async def push(self, snapshot: TurnSnapshot, text: str, change: TextChange | None) -> None:
        if change is None:
            return
        if self._ts is None:
            await self._start(text)
            return
        if change.replace:
            # a stream can only grow: a rewritten text is shown by editing the stream's message
            await self._stop()
            raise PlatformError("the reply was rewritten; a native stream cannot take that back",
                                kind="unsupported")
        d = self._dest
        client = self._api.client
        ts = str(self._ts)
        for piece in stream_pieces(_defused(change.text)):
            try:
                await self._api.once("chat.appendStream", functools.partial(
                    client.chat_appendStream, channel=d.channel, ts=ts, markdown_text=piece))
            except PlatformError as exc:
                if error_code(exc) in STREAM_ENDED:
                    self._streaming = False
                    raise PlatformError(f"the native stream ended: {exc}", kind="unsupported") from None
                raise
            self._shown += piece

    async def _start(self, text: str) -> None:
        d = self._dest
        client = self._api.client
        recipient: dict[str, Any] = {}
        if not d.ctx.dm:  # outside DMs Slack needs to know whom the stream is for
            recipient = {"recipient_user_id": d.ctx.user, "recipient_team_id": d.ctx.team_id or self._api.team_id}
        shown = _defused(text)
        try:
            response = await self._api.once("chat.startStream", lambda: client.chat_startStream(
                channel=d.channel, thread_ts=str(d.thread_ts), markdown_text=shown, **recipient))
        except PlatformError as exc:
            if not exc.transient and error_code(exc) in STREAM_REFUSED:
                self._channel.stream_refused = True
                raise PlatformError(f"chat.startStream refused: {exc}", kind="unsupported") from None
            raise
        self._ts, self._shown, self._streaming = str(response["ts"]), shown, True

    async def _stop(self) -> None:
        if self._ts is None or not self._streaming:
            return
        client = self._api.client
        try:
            await self._api.once("chat.stopStream", lambda: client.chat_stopStream(
                channel=self._dest.channel, ts=str(self._ts)))
        except PlatformError as exc:
            if error_code(exc) not in STREAM_ENDED:
                raise
        self._streaming = False

    async def handover(self) -> tuple[str, Part] | None:
        await self._stop()
        handed = self._part()
        self._ts, self._shown = None, ""
        return handed

    def leftover(self) -> tuple[str, Part] | None:
        return self._part()

    async def close(self, snapshot: TurnSnapshot, part: Part | None) -> str | None:
        if self._ts is None:
            return None
        await self._stop()
        ts = self._ts
        d = self._dest
        client = self._api.client
        if part is None:  # nothing of the final answer belongs here (it got shorter): remove the message
            try:
                await self._api.once("chat.delete", lambda: client.chat_delete(channel=d.channel, ts=ts))
            except PlatformError as exc:
                if exc.kind != "not_found":
                    raise
            self._ts = None
            return None
        await self._api.once("chat.update", lambda: client.chat_update(channel=d.channel, ts=ts,
                                                                        **message_args(part)))
        return ts


class SlackSink(LiveSink):
    """The shared live sink, which also takes the thinking indicator down when the turn is over."""

    def __init__(self, ops: SlackOps, *args: Any, **kw: Any) -> None:
        super().__init__(ops, *args, **kw)
        self.slack_ops = ops

    async def finish(self, snapshot: TurnSnapshot) -> None:
        try:
            await super().finish(snapshot)
        finally:
            await self.slack_ops.clear_thinking()

    async def abort(self) -> None:
        try:
            await super().abort()
        finally:
            # cut off before the end of its turn: it will not say how its requests ended (a press on one does)
            if isinstance(self.prompts, SlackPrompts):
                self.prompts.release()
        # nor will its end take the indicator down: that is done here (a failure is logged, never raised).
        # Awaited, not left to a task: an abort comes mostly from the shutdown, whose supervisor cancels the
        # tasks started meanwhile as soon as the turns are done, before their call reaches Slack; the callers
        # bound the abort (``core.delivery``).
        await self.slack_ops.clear_thinking()


@dataclass(slots=True)
class PromptHandle:
    """One approval message, and how it ended."""

    dest: Destination
    action: ApprovalAction
    tool_name: str
    arguments: str
    ts: str | None = None
    outcome: str | None = None
    """"allowed" / "denied" after a press; "ended" when it ended otherwise."""
    label: str | None = None
    """A subagent's request: which one asks."""
    by: str | None = None
    """Who pressed, for "allowed" / "denied"."""
    line: str | None = None
    """How it ended, when that is not a press's outcome (a timeout, a stopped reply)."""
    shown: bool = False
    """The message shows the outcome (its update went through): until then it may still show live buttons, so
    it stays in the open-requests record and a press on it shows the outcome again."""
    posted_at: float = 0.0
    """When its post was sent (``time.time()``): where to look for it in the conversation while ``ts`` is
    unknown (``SlackChannel.locate_prompt``)."""
    sink_ends: bool = False
    """A live sink of this process posted it and will say how it ended (``SlackPrompts.ended``): a press that
    finds it no longer pending leaves its message to the sink, which knows the line (timed out, stopped), rather
    than showing a bare "ended" that the sink's line could no longer replace."""
    showing: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False, compare=False)
    """Held while an update shows the outcome: a second one waits, and is not sent when the first went through."""

    def decided(self, outcome: str, *, by: str | None = None, line: str | None = None) -> None:
        """It ended (``outcome``), the first way it did: a later way does not change what it shows."""
        if self.outcome is None:
            self.outcome, self.by, self.line = outcome, by, line

    def outcome_blocks(self) -> list[dict[str, Any]]:
        """The message as it ended: no buttons, and how ("ended" while nothing decided it here)."""
        outcome: Outcome = "allowed" if self.outcome == "allowed" else (
            "denied" if self.outcome == "denied" else "ended")
        return decided_blocks(self.tool_name, self.arguments, outcome, by=self.by, line=self.line, label=self.label)


class SlackPrompts:
    """``ApprovalPrompts``: a Block Kit request with Allow / Deny buttons, in the turn's thread."""

    def __init__(self, channel: SlackChannel, target: TurnTarget, dest: Destination) -> None:
        self._channel = channel
        self._target = target
        self._dest = dest
        self._posted: list[PromptHandle] = []

    def release(self) -> None:
        """The sink is gone before its turn's end: the requests it has not ended are a press's to end."""
        for handle in self._posted:
            handle.sink_ends = False
        self._posted.clear()

    async def post(self, session_key: str, request: ApprovalRequest) -> Any:
        d = self._dest
        action = ApprovalAction(session_key, request.call_id, request.requested_by or self._target.sender_id,
                                tuple(request.origin))
        handle = PromptHandle(d, action, request.tool_name, request.arguments_summary, label=request.label,
                              posted_at=time.time())
        self._channel.remember_prompt(action, handle)
        # recorded before it is shown: if the bridge dies before Slack's answer, the next start finds the message
        # by its buttons and closes it (chat.postMessage has no idempotency key to ask for it by)
        await self._channel.save_prompts()
        client = self._channel.api.client
        # a try after one that may have been carried out looks in the conversation for the request's buttons
        # first: posting it again would show the request twice
        post = FindablePost(self._channel, d.channel, d.thread_ts, carries_button(action.encode()),
                            since=handle.posted_at)

        def post_once() -> Any:
            return post.post(lambda: client.chat_postMessage(
                channel=d.channel, thread_ts=d.thread_ts, text=approval_text(request.tool_name),
                blocks=approval_blocks(action, request.tool_name, request.arguments_summary, request.label)))

        try:
            response = await self._channel.api.call("chat.postMessage", post_once, channel=d.channel)
        except PlatformError as exc:
            if not exc.outcome_unknown:  # never shown; otherwise the record stays for the next start to look
                handle.outcome = "ended"
                await self._channel.save_prompts()
            raise
        handle.ts = str(response["ts"])
        # the sink holds it now and ends it (a post whose answer never came is not the sink's: a press ends it)
        handle.sink_ends = True
        self._posted.append(handle)
        try:
            await self._channel.save_prompts()
        except BaseException:
            handle.sink_ends = False  # the sink is not handed it after all
            raise
        return handle

    async def ended(self, handle: Any, line: str) -> None:
        entry: PromptHandle = handle
        # a press's own outcome stays; one its update could not show is tried once more
        entry.decided("ended", line=line)
        await self._channel.show_decision(entry)
