"""Who may decide an approval besides its sender (``core.agent.deciders``): an allow list a channel sorted into
ids and names matches each only against its own kind; a plain list keeps matching an entry against both."""

from __future__ import annotations

from core.agent.deciders import AllowEntries, Decider, Deciders


def test_a_username_spelled_like_an_allowed_id_decides_nothing() -> None:
    deciders = Deciders(AllowEntries(ids=frozenset({"U0ALICE", "U0BOB"}), names=frozenset({"carol"})))
    eve = Decider("U0EVE", ("u0bob",), "Eve")  # her username reads like Bob's id
    assert not deciders.may_decide(eve, "U0ALICE")
    assert deciders.may_decide(Decider("U0BOB", ("bob",)), "U0ALICE")  # Bob, by his id
    assert deciders.may_decide(Decider("U0CAROL", ("Carol",)), "U0ALICE")  # Carol, by her username, any case
    assert not deciders.may_decide(Decider("carol"), "U0ALICE")  # an id spelled like an allowed name
    assert not deciders.may_decide(Decider("u0bob"), "U0ALICE")  # ids are matched exactly
    assert deciders.may_decide(eve, "U0EVE")  # the sender always decides their own


def test_a_star_names_nobody_in_either_kind() -> None:
    deciders = Deciders(AllowEntries(ids=frozenset({"*"}), names=frozenset({"*", "@*"})))
    assert not deciders.may_decide(Decider("U0BOB", ("bob",)), "U0ALICE")
    assert deciders.may_decide(Decider("U0ALICE", ("alice",)), "U0ALICE")


def test_a_plain_list_matches_an_entry_against_ids_and_names_as_before() -> None:
    deciders = Deciders(["12345", "@Alice", "*"])  # a Telegram allow list: numeric ids and usernames
    assert deciders.may_decide(Decider("12345"), "999")
    assert deciders.may_decide(Decider("777", ("alice",)), "999")
    assert not deciders.may_decide(Decider("888", ("bob",)), "999")


def test_sorted_entries_still_read_as_an_allow_list() -> None:
    entries = AllowEntries(ids=frozenset({"U0BOB"}), names=frozenset({"carol"}))
    assert list(entries) == ["U0BOB", "@carol"]
