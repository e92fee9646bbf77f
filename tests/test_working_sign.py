"""channels.common.working_sign: a sign shown while files download is handed to the turn's sink, or taken down.

The platforms' own behaviour (what shows on Slack and Feishu) is in tests/test_slack_working_sign.py and
tests/test_feishu_working_sign.py; these pin the hand-over itself."""

from __future__ import annotations

import asyncio
from typing import Any

from channels.common.errors import PlatformError
from channels.common.working_sign import WorkingSigns


class Chat:
    """What a chat shows: how many signs are up, and every show and take-down."""

    def __init__(self, *, refuse: bool = False) -> None:
        self.up = 0
        self.calls: list[str] = []
        self.refuse = refuse

    async def show(self) -> None:
        self.calls.append("show")
        if self.refuse:
            raise PlatformError("reactions.add: no room", kind="rate_limited")
        self.up += 1

    async def take_down(self) -> None:
        self.calls.append("take_down")
        self.up = max(0, self.up - 1)


def signs(handover: float = 0.05) -> tuple[WorkingSigns[Chat], list[asyncio.Task[Any]]]:
    tasks: list[asyncio.Task[Any]] = []
    return WorkingSigns(lambda name, coro: tasks.append(asyncio.create_task(coro, name=name)),
                        lambda: handover), tasks


async def test_a_sign_the_turn_takes_stays_for_the_turn_to_take_down() -> None:
    chat = Chat()
    working, tasks = signs()
    async with working.showing("m1", chat, show=chat.show, take_down=chat.take_down, name="w"):
        await asyncio.sleep(0)
        assert chat.up == 1  # shown while the files download
    sign = working.take("m1")
    assert sign is not None and sign.ops is chat
    await asyncio.gather(*tasks)
    assert chat.calls == ["show"] and chat.up == 1  # the turn's sink takes it down at its end
    assert working.take("m1") is None


async def test_a_sign_no_turn_takes_is_taken_down_after_the_handover() -> None:
    chat = Chat()
    working, tasks = signs()
    async with working.showing("m1", chat, show=chat.show, take_down=chat.take_down, name="w"):
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert chat.calls == ["show", "take_down"] and chat.up == 0
    assert working.take("m1") is None  # a turn that opens later shows its own


async def test_the_same_message_shows_one_sign_and_a_refused_one_is_no_error() -> None:
    chat = Chat()
    working, tasks = signs()
    async with working.showing("m1", chat, show=chat.show, take_down=chat.take_down, name="w"):
        async with working.showing("m1", chat, show=chat.show, take_down=chat.take_down, name="w"):
            await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    assert chat.calls == ["show", "take_down"]
    refusing = Chat(refuse=True)
    async with working.showing("m2", refusing, show=refusing.show, take_down=refusing.take_down, name="w"):
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)  # no exception out of the sign's task
    assert refusing.up == 0


async def test_a_shutdown_during_the_wait_takes_the_sign_down() -> None:
    chat = Chat()
    working, tasks = signs(handover=30.0)
    async with working.showing("m1", chat, show=chat.show, take_down=chat.take_down, name="w"):
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    tasks[0].cancel()  # the supervisor's shutdown cancels the wait for a sink
    await asyncio.gather(*tasks, return_exceptions=True)
    assert chat.calls == ["show", "take_down"] and chat.up == 0
