"""Cache events: construction validates, wire round-trips, malformed dicts name the problem."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cachemgr.events import (
    Cleared,
    MalformedEvent,
    Removed,
    Snapshot,
    Stored,
    event_from_wire,
)
from shared.ids import InvalidInput

hashes = st.integers(min_value=-(2**63), max_value=2**64 - 1)
workers = st.text(min_size=1, max_size=12)


@st.composite
def any_event(draw):
    kind = draw(st.sampled_from(["stored", "removed", "cleared", "snapshot"]))
    w = draw(workers)
    if kind == "stored":
        chain = tuple(draw(st.lists(hashes, min_size=1, max_size=8, unique=True)))
        parent = draw(st.one_of(st.none(), hashes.filter(lambda h: h not in chain)))
        return Stored(w, draw(st.integers(1, 10**9)), parent, chain)
    if kind == "removed":
        return Removed(w, draw(st.integers(1, 10**9)),
                       tuple(draw(st.lists(hashes, min_size=1, max_size=8, unique=True))))
    if kind == "cleared":
        return Cleared(w, draw(st.integers(1, 10**9)))
    hs = draw(st.lists(hashes, max_size=10, unique=True))
    blocks = []
    for i, h in enumerate(hs):  # each block's parent is an earlier one or None: a forest
        p = None if i == 0 or draw(st.booleans()) else hs[draw(st.integers(0, i - 1))]
        blocks.append((h, p))
    return Snapshot(w, draw(st.integers(0, 10**9)), tuple(blocks))


@settings(max_examples=100, deadline=None)
@given(any_event())
def test_wire_round_trip_through_json(ev) -> None:
    wire = ev.to_wire()
    assert wire["type"] in {"stored", "removed", "cleared", "snapshot"}
    assert event_from_wire(json.loads(json.dumps(wire))) == ev


GOOD = {"type": "stored", "worker": "w", "event_id": 1, "parent_hash": None,
        "block_hashes": [1, 2]}


@pytest.mark.parametrize(
    ("wire", "needle"),
    [
        ([], "JSON object"),
        ({**GOOD, "type": "stord"}, "unknown cache event type"),
        ({**GOOD, "type": {}}, "unknown cache event type"),
        ({k: v for k, v in GOOD.items() if k != "event_id"}, "lacks field 'event_id'"),
        ({**GOOD, "extra": 1}, "unexpected fields"),
        ({**GOOD, "worker": ""}, "worker"),
        ({**GOOD, "event_id": 0}, "event_id"),
        ({**GOOD, "event_id": True}, "event_id"),
        ({**GOOD, "event_id": "3"}, "event_id"),
        ({**GOOD, "block_hashes": []}, "must not be empty"),
        ({**GOOD, "block_hashes": [1, "x"]}, "block_hashes[1]"),
        ({**GOOD, "block_hashes": [1, 1]}, "repeats"),
        ({**GOOD, "block_hashes": 5}, "list of block hashes"),
        ({**GOOD, "parent_hash": 2}, "cycle"),
        ({**GOOD, "parent_hash": 1.5}, "parent_hash"),
        ({"type": "removed", "worker": "w", "event_id": 2, "block_hashes": []}, "empty"),
        ({"type": "cleared", "worker": 3, "event_id": 2}, "worker"),
        ({"type": "snapshot", "worker": "w", "last_event_id": -1, "blocks": []}, "last_event_id"),
        ({"type": "snapshot", "worker": "w", "last_event_id": 0, "blocks": [[1]]}, "pair"),
        ({"type": "snapshot", "worker": "w", "last_event_id": 0, "blocks": [[1, 7]]},
         "does not list"),
        ({"type": "snapshot", "worker": "w", "last_event_id": 0, "blocks": [[1, 2], [2, 1]]},
         "cycle"),
        ({"type": "snapshot", "worker": "w", "last_event_id": 0, "blocks": [[1, None], [1, None]]},
         "twice"),
    ],
)
def test_malformed_wire_is_rejected_with_a_named_problem(wire, needle) -> None:
    with pytest.raises(MalformedEvent, match=None) as info:
        event_from_wire(wire)
    assert needle in str(info.value)
    assert isinstance(info.value, InvalidInput)


def test_direct_construction_validates_too() -> None:
    with pytest.raises(MalformedEvent):
        Stored("w", 1, None, [1, 2])  # type: ignore[arg-type]  # list, not tuple
    with pytest.raises(MalformedEvent):
        Removed("w", -3, (1,))
