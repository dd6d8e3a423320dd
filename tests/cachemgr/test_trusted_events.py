"""Events built by BlockCache through the unvalidated constructors equal validated ones."""

from __future__ import annotations

import pytest

from services.cachemgr.events import MalformedEvent, Removed, Stored
from services.rankd.blockcache import BlockCache
from shared.ids import InvalidInput


def test_trusted_constructors_equal_validated() -> None:
    assert Stored.trusted("w", 3, 7, (8, 9)) == Stored("w", 3, 7, (8, 9))
    assert Removed.trusted("w", 4, (8,)) == Removed("w", 4, (8,))
    with pytest.raises(MalformedEvent):
        Stored("w", 3, 7, (7,))  # the validating constructor still validates


def test_blockcache_events_are_valid_events() -> None:
    c = BlockCache("w", 4)
    c.insert((1, 2, 3))
    c.insert((1, 2, 5, 6))  # evicts 3, stores 5 and 6 under 2
    evs = c.take_events()
    assert [type(ev) for ev in evs] == [Stored, Removed, Stored]
    for ev in evs:
        rebuilt = type(ev)(*(getattr(ev, f) for f in ev.__dataclass_fields__))
        assert rebuilt == ev


def test_blockcache_fast_hash_check_rejects_bad_input() -> None:
    c = BlockCache("w", 4)
    for bad in ((1, True), (1, "x"), (1, 2.0), "ab", 5):
        with pytest.raises(InvalidInput):
            c.insert(bad)  # type: ignore[arg-type]
    assert c.lookup([1, 2]) == 0 and len(c) == 0
