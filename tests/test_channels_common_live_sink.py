"""The shared live sink over a platform double: native streams get appends and, after a rewind, a
replacement; a reply outgrowing one message is streamed by freezing finished messages and re-splitting
only the tail; what the chat ends up showing is the final rendering."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from channels.common.calls import CallPolicy, Calls
from channels.common.errors import PlatformError
from channels.common.ledger import Part
from channels.common.live_sink import LiveSettings, LiveSink
from channels.common.ops import Capabilities, PlainRenderer, TextChange
from channels.common.splitter import split_text
from channels.common.throttle import Scope, Throttle
from core.agent.events import Forwarded, PartialText, RequestBegin, RequestEnd, SessionMeta
from core.controller import TurnController
from core.snapshot import TurnSnapshot
from tests.support.clock import GatedClock

NO_GATE = LiveSettings(first_chars=0, first_delay=0.0)


class Stream:
    shows_activity = False

    def __init__(self) -> None:
        self.pushes: list[tuple[str, str]] = []
        self.closed: Part | None = None

    async def push(self, snapshot: TurnSnapshot, text: str, change: TextChange | None) -> None:
        assert change is not None
        self.pushes.append(("replace" if change.replace else "append", change.text))

    async def close(self, snapshot: TurnSnapshot, part: Part | None) -> str | None:
        self.closed = part
        return "streamed"

    def leftover(self) -> tuple[str, Part] | None:
        return None


class Chat:
    """Messages as a user sees them, and every call made."""

    def __init__(self, *, limit: int | None = None, stream: Stream | None = None) -> None:
        self.capabilities = Capabilities(limit=limit, native_stream=stream is not None)
        self.scopes = (Scope("chat", 0.0),)
        self.shown: dict[str, str] = {}
        self.calls: list[tuple[str, str, str]] = []
        self._stream = stream

    async def send(self, part: Part, key: str) -> str:
        mid = str(len(self.shown) + 1)
        self.shown[mid] = part.text
        self.calls.append(("send", mid, part.text))
        return mid

    async def edit(self, message_id: str, part: Part) -> None:
        self.shown[message_id] = part.text
        self.calls.append(("edit", message_id, part.text))

    async def delete(self, message_id: str) -> None:
        raise PlatformError("not in this test", kind="permanent")

    async def typing(self) -> None:
        return None

    def stream(self) -> Stream | None:
        return self._stream


def sink_for(chat: Chat) -> LiveSink:
    return LiveSink(chat, PlainRenderer(), Calls(Throttle(), CallPolicy(timeout=None)), settings=NO_GATE)


async def stream_text(c: TurnController, *pieces: str) -> None:
    for piece in pieces:
        c.apply(PartialText("delta", piece))
        await asyncio.sleep(0.005)


async def test_a_native_stream_gets_appends_and_a_replacement_when_a_retry_rewinds_the_text():
    stream = Stream()
    chat = Chat(stream=stream)
    sink = sink_for(chat)
    c = TurnController("t", "s")
    following = asyncio.create_task(sink.follow(c))
    c.apply(RequestBegin(1, 1))
    await stream_text(c, "Hel", "lo")
    c.apply(RequestEnd("malformed", 1, retry_in=0.01))  # the retried request starts over
    c.apply(RequestBegin(1, 2))
    await stream_text(c, "Hi", " there")
    final = c.finish("completed")
    await asyncio.wait_for(following, 1)
    await sink.finish(final)
    assert stream.pushes == [("replace", "Hel"), ("append", "lo"), ("replace", "Hi"), ("append", " there")]
    assert stream.closed == Part.plain("Hi there")
    assert sink.undelivered(final) == ""


async def test_a_long_reply_freezes_finished_messages_and_ends_as_its_final_split():
    chat = Chat(limit=40)
    sink = sink_for(chat)
    c = TurnController("t", "s")
    following = asyncio.create_task(sink.follow(c))
    words = [f"word{i} " for i in range(60)]
    await stream_text(c, *words)
    final = c.finish("completed")
    await asyncio.wait_for(following, 1)
    await sink.finish(final)
    expected = split_text("".join(words), 40, measure=len)
    assert list(chat.shown.values()) == expected
    # a message was never edited once its successor had been sent
    for mid in chat.shown:
        successor = next((i for i, call in enumerate(chat.calls) if call[0] == "send" and int(call[1]) > int(mid)),
                         None)
        if successor is not None:
            assert not [call for call in chat.calls[successor:] if call[:2] == ("edit", mid)]


class Looked(Throttle):
    """A throttle that counts every look at it (``ready_in``)."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def ready_in(self, scopes: Sequence[Scope]) -> float:
        self.looks += 1
        return super().ready_in(scopes)


async def test_chats_sharing_a_budget_take_its_slots_without_all_waking_for_each_slot():
    """Twenty chats stream at once through one budget of a call per 20 ms (Slack's workspace): about one
    live update looks at the budget per slot, and the slots are used rather than left to pass."""
    throttle = Looked()
    chats = [Chat() for _ in range(20)]
    for chat in chats:
        chat.scopes = (Scope("workspace", 0.02),)
    sinks = [LiveSink(chat, PlainRenderer(), Calls(throttle, CallPolicy(timeout=None)), settings=NO_GATE)
             for chat in chats]
    turns = [TurnController(f"t{i}", f"s{i}") for i in range(20)]
    following = [asyncio.create_task(sink.follow(turn)) for sink, turn in zip(sinks, turns, strict=True)]
    started = asyncio.get_running_loop().time()
    for n in range(60):  # every chat has news every 10 ms for 0.6 s: 30 slots
        for turn in turns:
            turn.apply(PartialText("delta", f"w{n} "))
        await asyncio.sleep(0.01)
    elapsed = asyncio.get_running_loop().time() - started
    slots = elapsed / 0.02
    updates = sum(len(chat.calls) for chat in chats)
    # every chat looking for every slot would be ~20 looks a slot (~680 here, counted)
    assert throttle.looks <= 8 * slots, (throttle.looks, slots)
    assert updates >= slots / 3, (updates, slots)
    for sink, turn, task in zip(sinks, turns, following, strict=True):
        final = turn.finish("completed")
        await asyncio.wait_for(task, 1)
        await sink.finish(final)
    assert all(list(chat.shown.values()) == ["".join(f"w{n} " for n in range(60))] for chat in chats)


# ---- abort: core gave up waiting; the chat stays as it is ----------------------------------------------


class LeftoverStream(Stream):
    """A stream that leaves its message in the chat (the web chat's turn entry, a Slack stream's message)."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""

    async def push(self, snapshot: TurnSnapshot, text: str, change: TextChange | None) -> None:
        await super().push(snapshot, text, change)
        self.text = text

    def leftover(self) -> tuple[str, Part] | None:
        return ("streamed", Part.plain(self.text)) if self.text else None


class Shouting(PlainRenderer):
    """A final rendering that differs from the streamed one (as formatting does)."""

    def final_part(self, source: str) -> Part:
        return Part(text=source.upper(), source=source)


def squash(text: str) -> str:
    return "".join(text.split())


async def until(cond: Callable[[], bool]) -> None:
    """Wait (at most 2 s) until ``cond`` holds."""
    for _ in range(400):
        if cond():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached in time")


async def streamed_then_finished(sink: LiveSink, shown: Callable[[], str], streamed: str,
                                 final: str) -> TurnSnapshot:
    """Stream ``streamed`` until the chat shows it (``shown``), then end the turn with ``final``."""
    c = TurnController("t", "s")
    following = asyncio.create_task(sink.follow(c))
    words = streamed.split(" ")
    await stream_text(c, *[f"{w} " for w in words[:-1]], words[-1])
    await until(lambda: squash(shown()) == squash(streamed))
    snapshot = c.finish("completed", text=final)
    await asyncio.wait_for(following, 1)
    return snapshot


async def test_an_aborted_sink_counts_every_message_it_left_and_names_only_the_rest():
    chat = Chat(limit=40)
    sink = sink_for(chat)
    streamed = " ".join(f"w{i}" for i in range(30))
    final = streamed + " and the words the preview never got"
    snapshot = await streamed_then_finished(sink, lambda: "".join(chat.shown.values()), streamed, final)
    await sink.abort()  # the final update never came
    rest = sink.undelivered(snapshot)
    assert rest is not None
    assert squash("".join(chat.shown.values()) + rest) == squash(final)  # every word once


async def test_an_aborted_native_stream_counts_what_its_message_shows():
    stream = LeftoverStream()
    sink = sink_for(Chat(stream=stream))
    snapshot = await streamed_then_finished(sink, lambda: stream.text, "The answer begins", "The answer begins here")
    await sink.abort()
    assert sink.undelivered(snapshot) == "here"

    stream = LeftoverStream()
    sink = sink_for(Chat(stream=stream))
    snapshot = await streamed_then_finished(sink, lambda: stream.text, "All of it", "All of it")
    await sink.abort()
    assert sink.undelivered(snapshot) == ""  # the stream's message shows the whole answer


async def test_a_delete_an_abort_cut_off_counts_as_done_so_its_words_are_sent_again_not_lost():
    class Stuck(Chat):
        async def edit(self, message_id: str, part: Part) -> None:
            if part.text.isupper():
                raise PlatformError("message can't be edited", kind="permanent")
            await super().edit(message_id, part)

        async def delete(self, message_id: str) -> None:
            await asyncio.Event().wait()  # the platform never answers

    chat = Stuck()
    sink = LiveSink(chat, Shouting(), Calls(Throttle(), CallPolicy(timeout=None)), settings=NO_GATE)
    snapshot = await streamed_then_finished(sink, lambda: "".join(chat.shown.values()), "a b c", "a b c")
    finishing = asyncio.create_task(sink.finish(snapshot))
    await until(lambda: sink.deleting is not None)  # the stale preview's delete is on its way
    finishing.cancel()
    await asyncio.gather(finishing, return_exceptions=True)
    await sink.abort()
    assert sink.undelivered(snapshot) == "a b c"


class Typed(Chat):
    def __init__(self) -> None:
        super().__init__()
        self.typed = 0

    async def typing(self) -> None:
        self.typed += 1


def spawned(name: str, coro) -> asyncio.Task[None]:
    return asyncio.get_running_loop().create_task(coro, name=name)


async def test_a_delayed_working_sign_is_not_shown_when_the_answer_comes_first():
    chat = Typed()
    sink = LiveSink(chat, PlainRenderer(), Calls(Throttle(), CallPolicy(timeout=None)), settings=NO_GATE,
                    spawn=spawned)
    sink.start_typing(delay=3600)  # far later than the answer
    snapshot = await streamed_then_finished(sink, lambda: "".join(chat.shown.values()), "The answer", "The answer")
    async with asyncio.timeout(5):  # the finish does not wait out the delay
        await sink.finish(snapshot)
    assert chat.typed == 0 and list(chat.shown.values()) == ["The answer"]


async def test_a_delayed_working_sign_is_shown_while_nothing_else_is():
    chat = Typed()
    sink = LiveSink(chat, PlainRenderer(), Calls(Throttle(), CallPolicy(timeout=None)), settings=NO_GATE,
                    spawn=spawned)
    sink.start_typing(delay=0.01)
    await until(lambda: chat.typed == 1)
    assert chat.shown == {}


# ---- a new message carries what the turn shows when its slot comes -------------------------------------


async def test_a_first_message_that_waited_while_the_reply_outgrew_it_carries_the_newest_first_part():
    clock = GatedClock()
    calls = Calls(Throttle(clock=clock), CallPolicy(timeout=None))
    sends = Scope("bot:sends", 1.0)
    await calls.throttle.reserve((sends,))  # another chat's new message took the bot's slot
    chat = Chat(limit=40)
    sink = LiveSink(chat, PlainRenderer(), calls, settings=NO_GATE, send_scopes=(sends,))
    c = TurnController("t", "s")
    following = asyncio.create_task(sink.follow(c))
    await stream_text(c, "word0 ")
    for _ in range(200):  # the first message is booked with "word0 " and waits for its slot
        if clock.waiting:
            break
        await asyncio.sleep(0.005)
    words = ["word0 "] + [f"word{i} " for i in range(1, 30)]
    await stream_text(c, *words[1:])  # meanwhile the reply outgrew one message
    expected = split_text("".join(words), 40, measure=len)
    clock.gate.set()
    for _ in range(200):
        if chat.calls:
            break
        await asyncio.sleep(0.005)
    assert chat.calls[0] == ("send", "1", expected[0])
    final = c.finish("completed")
    await asyncio.wait_for(following, 1)
    await sink.finish(final)
    assert list(chat.shown.values()) == expected
    assert [call[1] for call in chat.calls if call[0] == "send"] == [str(i + 1) for i in range(len(expected))]
    assert sink.undelivered(final) == ""


async def test_an_aborted_preview_with_a_subagents_status_lines_counts_only_its_words():
    """A preview left in the chat (the sink was aborted) that showed a running subagent's status line under
    the answer's beginning: the rest of the answer is what is missing, not the whole of it again."""
    chat = Chat()
    sink = sink_for(chat)
    c = TurnController("t", "s")
    child = "web:s-sub-aaaaaaaaaaaa"
    c.apply(Forwarded((child,), SessionMeta(child, "s", "researcher", "look it up", "call_1")))
    following = asyncio.create_task(sink.follow(c))
    await stream_text(c, "The answer ", "begins")
    await until(lambda: list(chat.shown.values()) == ["The answer begins\n\n⏳ researcher: look it up · starting"])
    snapshot = c.finish("completed", text="The answer begins here.")
    await asyncio.wait_for(following, 1)
    await sink.abort()
    assert sink.undelivered(snapshot) == "here."
