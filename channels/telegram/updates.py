"""Reading Telegram updates that aiogram cannot read whole.

aiogram reads an update into its models, which refuse a field whose shape they do not know: a forward origin,
a paid medium or a reaction of a kind a later Bot API release added, an entity without its length. One such
field made the whole update unreadable, and in a ``getUpdates`` answer, which aiogram reads as one list, the
whole batch: the good updates with it were fetched again and refused again, and no chat was answered until
Telegram dropped the update, a day later. A webhook answered 400 for it, and Telegram gave up on the message.

``read_update`` reads such an update without the fields the models refuse (each a whole field of the message:
``forward_origin``, ``entities``, ``reply_to_message``), so the message itself is still answered, and says in
the log which fields it left out. An update whose message cannot be read even so (its id, chat or date are
what is refused) is read as its bare ``update_id``: the channel acknowledges it like any update it ignores,
and the log says so. Log lines name the update and the fields, never what they hold (a user's words).
``read_updates`` does the same for each update of a ``getUpdates`` answer aiogram refused.

No library offers this: pydantic reports where validation failed (``ValidationError.errors()``), and what to
leave out is a decision about Telegram's messages.
"""

from __future__ import annotations

import logging
from typing import Any

from aiogram import Bot
from aiogram.types import Update
from pydantic import ValidationError

log = logging.getLogger(__name__)

ESSENTIAL = frozenset({"message_id", "chat", "date"})
"""Fields of a message without which it is not one: an update refused for one of these is skipped."""
MAX_ROUNDS = 4
"""Times an update is read again without the fields refused the time before (a field left out can reveal
another, e.g. inside a reply that is then read too)."""


class NotAnUpdate(ValueError):
    """The data is not a Telegram update at all (not an object with an integer ``update_id``)."""


def read_update(data: Any, bot: Bot) -> Update:
    """``data`` (one decoded update) as an ``Update``, without the fields aiogram refuses; its bare
    ``update_id`` when its message cannot be read. Raises ``NotAnUpdate``."""
    try:
        return Update.model_validate(data, context={"bot": bot})
    except ValidationError as exc:
        error = exc
    if not isinstance(data, dict) or type(data.get("update_id")) is not int:
        raise NotAnUpdate("not a Telegram update")
    update_id: int = data["update_id"]
    left_out: list[str] = []
    for _ in range(MAX_ROUNDS):
        refused = _refused_fields(data, error)
        if not refused:
            break
        data = dict(data)
        for kind, name in refused:
            data[kind] = {k: v for k, v in data[kind].items() if k != name}
            left_out.append(f"{kind}.{name}")
        try:
            update = Update.model_validate(data, context={"bot": bot})
        except ValidationError as exc:
            error = exc
            continue
        log.warning("Telegram update %d was read without %s, which this aiogram cannot read", update_id,
                    ", ".join(left_out))
        return update
    log.error("Telegram update %d cannot be read (%s) and is skipped", update_id, _where(error))
    return Update(update_id=update_id)


def read_updates(answer: Any, bot: Bot) -> list[Update] | None:
    """The updates of a ``getUpdates`` answer aiogram refused, each read by ``read_update``; None when the
    answer is not a successful list of updates (then it is a failure of the call)."""
    if not isinstance(answer, dict) or answer.get("ok") is not True or not isinstance(answer.get("result"), list):
        return None
    try:
        return [read_update(item, bot) for item in answer["result"]]
    except NotAnUpdate:
        return None


def _refused_fields(data: dict[str, Any], error: ValidationError) -> set[tuple[str, str]]:
    """The (update kind, message field) pairs the error names that can be left out; none when a refused field
    is essential or not a field of an update's object."""
    refused: set[tuple[str, str]] = set()
    for problem in error.errors():
        loc = problem["loc"]
        if len(loc) < 2 or not isinstance(loc[0], str) or not isinstance(loc[1], str):
            return set()
        kind, name = loc[0], loc[1]
        if name in ESSENTIAL or not isinstance(data.get(kind), dict) or name not in data[kind]:
            return set()
        refused.add((kind, name))
    return refused


def _where(error: ValidationError) -> str:
    """Where validation failed, by field path only (pydantic's own text quotes the input)."""
    return "; ".join(".".join(str(part) for part in problem["loc"]) + f": {problem['type']}"
                     for problem in error.errors()[:5])
