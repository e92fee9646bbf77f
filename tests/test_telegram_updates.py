"""``channels.telegram.updates``: reading an update without the fields aiogram refuses (pure logic; the
channel end to end is in ``test_telegram_unreadable.py``)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiogram import Bot

from channels.telegram.updates import NotAnUpdate, read_update, read_updates

BOT = Bot("123:abc")


def update(**message: Any) -> dict[str, Any]:
    base = {"message_id": 1, "date": 0, "chat": {"id": 5, "type": "private"},
            "from": {"id": 7, "is_bot": False, "first_name": "A"}, "text": "a secret"}
    return {"update_id": 42, "message": {**base, **message}}


def test_a_field_of_an_unknown_kind_is_left_out_and_the_message_kept(caplog):
    caplog.set_level(logging.WARNING)
    got = read_update(update(forward_origin={"type": "hidden_bot", "date": 1},
                             entities=[{"type": "bold", "offset": 0}]), BOT)
    assert got.message is not None and got.message.text == "a secret"
    assert got.message.forward_origin is None and got.message.entities is None
    assert "message.entities" in caplog.text and "message.forward_origin" in caplog.text
    assert "a secret" not in caplog.text


def test_a_reply_that_cannot_be_read_is_left_out_and_the_message_kept():
    reply = {"message_id": 2, "date": 0, "chat": {"id": 5, "type": "private"}, "forward_origin": {"type": "x"}}
    got = read_update(update(reply_to_message=reply), BOT)
    assert got.message is not None and got.message.reply_to_message is None and got.message.text == "a secret"


@pytest.mark.parametrize("field", ["message_id", "chat", "date"])
def test_a_message_whose_id_chat_or_date_cannot_be_read_is_its_bare_update(field, caplog):
    got = read_update(update(**{field: "not that"}), BOT)
    assert got.update_id == 42 and got.message is None
    assert f"message.{field}" in caplog.text and "not that" not in caplog.text and "a secret" not in caplog.text


@pytest.mark.parametrize("data", [[], "x", {"message": {}}, {"update_id": None}, {"update_id": 1.5}])
def test_what_is_not_an_update_is_refused(data):
    with pytest.raises(NotAnUpdate):
        read_update(data, BOT)


def test_a_getupdates_answer_is_read_update_by_update():
    good = {"update_id": 41, "message": update()["message"]}
    odd = update(forward_origin={"type": "hidden_bot"})
    got = read_updates({"ok": True, "result": [good, odd]}, BOT)
    assert got is not None and [u.update_id for u in got] == [41, 42]
    assert all(u.message is not None and u.message.text == "a secret" for u in got)


@pytest.mark.parametrize("answer", [
    "<html>maintenance</html>", {"ok": False, "result": []}, {"ok": True, "result": {}},
    {"ok": True, "result": [{"no": "update_id"}]}])
def test_an_answer_that_is_not_a_list_of_updates_is_not_read(answer):
    assert read_updates(answer, BOT) is None
