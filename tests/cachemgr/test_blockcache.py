"""The worker-local LRU block cache, and its events driving the global trie."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cachemgr.events import Cleared, Removed, Stored
from services.cachemgr.trie import ApplyOutcome, PrefixTrie
from services.rankd.blockcache import BlockCache
from shared.ids import InvalidInput


def test_lookup_insert_and_events() -> None:
    c = BlockCache("w", 10)
    assert c.lookup([1, 2, 3]) == 0
    assert c.insert([1, 2, 3]) == 3
    assert c.insert([1, 2, 4, 5]) == 4
    assert c.lookup([1, 2, 4, 9]) == 3
    assert c.take_events() == [Stored("w", 1, None, (1, 2, 3)), Stored("w", 2, 2, (4, 5))]
    assert c.take_events() == []
    assert c.parent_of(4) == 2 and len(c) == 5


def test_lru_evicts_leaves_first_and_never_pinned() -> None:
    c = BlockCache("w", 4)
    c.insert([1, 2, 3])  # 1 <- 2 <- 3
    c.insert([7])
    c.lookup([7])  # 7 more recent than the 1-2-3 chain
    c.take_events()
    c.insert([8])  # must evict: the oldest leaf is 3 (never 1 or 2 while 3 is there)
    assert c.blocks() == {1, 2, 7, 8}
    assert c.take_events() == [Removed("w", 3, (3,)), Stored("w", 4, None, (8,))]
    c.pin([1, 2])
    c.insert([9, 10])  # 2 is pinned: the leaves 7 and 8 go
    assert c.blocks() == {1, 2, 9, 10}
    # Everything pinned or needed: only what fits is stored, still a whole prefix.
    c.pin([9, 10])
    assert c.insert([20, 21]) == 0 and c.blocks() == {1, 2, 9, 10}
    c.unpin([9, 10])
    with pytest.raises(InvalidInput):
        c.unpin([9])
    assert c.insert([1, 2, 30]) == 3  # evicts 10 (LRU leaf), hangs 30 under pinned 2


def test_insert_pins_the_request_path() -> None:
    c = BlockCache("w", 3)
    assert c.insert([1, 2], pin=True) == 2
    assert c.pins(1) == 1 and c.pins(2) == 1
    assert c.insert([5, 6]) == 1  # only one free slot; 1 and 2 are pinned
    c.unpin([1, 2])


def test_remove_only_whole_suffixes() -> None:
    c = BlockCache("w", 10)
    c.insert([1, 2, 3])
    c.insert([1, 2, 4])
    c.take_events()
    assert c.remove([2, 3]) == (3,)  # 2 still has child 4 cached
    assert c.remove([99]) == ()  # unknown: skipped (raced with eviction)
    c.pin([4])
    assert c.remove([4, 2]) == ()
    c.unpin([4])
    assert set(c.remove([2, 4])) == {2, 4}
    assert c.take_events() == [Removed("w", 3, (3,)), Removed("w", 4, (4, 2))]


def test_demote_makes_blocks_go_first_leaf_first_and_changes_nothing_else() -> None:
    c = BlockCache("w", 6)
    c.insert([1, 2, 3])  # a session the pull moved away
    c.insert([7, 8])
    c.insert([9])
    c.take_events()
    # Root first, as a pull's blocks come; 99 is not cached (raced with eviction): skipped.
    assert c.demote([1, 2, 3, 99]) == 3
    assert c.take_events() == []  # what the cache holds did not change
    assert c.blocks() == {1, 2, 3, 7, 8, 9}
    # Without the demotion the oldest leaf (8) would go; now the chain goes first, its leaf
    # first, and the rest of the LRU keeps its order.
    c.insert([20, 21])
    assert c.take_events() == [Removed("w", 4, (3, 2)), Stored("w", 5, None, (20, 21))]
    c.insert([30, 31])
    assert c.take_events()[0] == Removed("w", 6, (1, 8))


def test_demote_takes_a_block_only_with_all_of_its_cached_children() -> None:
    """A block with a cached child that is not demoted with it (the worker's own longer
    continuation) stays where it is, and so do its ancestors: it could not be evicted before
    that child, and at the old end every eviction would scan past it."""
    c = BlockCache("w", 8)
    c.insert([1, 2, 3, 4])  # the worker went on past the copied 1-2-3
    c.insert([9])
    assert c.demote([1, 2, 3]) == 0
    c.insert([1, 2, 5])  # a sibling of 3 under 2
    assert c.demote([1, 2, 5]) == 1  # only the private leaf 5: 2 keeps 3
    c.insert([20, 21, 22])  # two slots free, one to evict: 5, not the oldest leaf (4)
    assert c.blocks() == {1, 2, 3, 4, 9, 20, 21, 22}
    assert c.demote([4, 3, 2, 1]) == 4  # deepest first works as well (any order does)
    c.insert([30])
    assert c.blocks() == {1, 2, 3, 9, 20, 21, 22, 30}  # the demoted chain's leaf went first
    assert c.demote([1, 2, 3, 3]) == 3  # a repeated block counts once


def test_demote_leaves_pins_and_later_touches_in_charge() -> None:
    c = BlockCache("w", 4)
    c.insert([1, 2])
    c.insert([5])
    c.lookup([1, 2], pin=True)  # a request runs on the demoted prefix
    assert c.demote([1, 2]) == 2
    c.take_events()
    c.insert([6, 7])  # one free slot, one to evict: the pinned 1-2 stay, 5 goes
    assert c.blocks() == {1, 2, 6, 7} and c.take_events()[0] == Removed("w", 3, (5,))
    c.unpin([1, 2])
    c.demote([1, 2])
    c.lookup([1, 2])  # reused there after all: recent again
    c.insert([8])
    assert c.blocks() == {1, 2, 6, 8}  # the oldest leaf went, 7, not the demoted chain
    with pytest.raises(InvalidInput):
        c.demote([1, "x"])  # type: ignore[list-item]
    with pytest.raises(InvalidInput):
        c.demote(3)  # type: ignore[arg-type]


def test_bad_input_changes_nothing() -> None:
    c = BlockCache("w", 10)
    c.insert([1, 2])
    c.take_events()
    for bad in ("ab", [1, "x"], [1, True], 5):
        with pytest.raises(InvalidInput):
            c.insert(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        c.insert([2, 3])  # 2 is cached under 1, not at the root
    with pytest.raises(InvalidInput):
        c.insert([1, 5, 5])
    with pytest.raises(InvalidInput):
        c.pin([1, 77])
    assert c.pins(1) == 0 and c.blocks() == {1, 2} and c.take_events() == []
    with pytest.raises(InvalidInput):
        BlockCache("w", 0)


def test_clear_and_snapshot() -> None:
    c = BlockCache("w", 10)
    c.insert([1, 2])
    snap = c.snapshot()
    assert snap.last_event_id == 1 and set(snap.blocks) == {(1, None), (2, 1)}
    c.clear()
    assert len(c) == 0 and c.take_events()[-1] == Cleared("w", 2)


# --- properties ----------------------------------------------------------------------------
PARENT = {0: None, 1: 0, 2: 1, 3: 2, 4: 1, 5: None, 6: 5, 7: 6, 8: 5, 9: None, 10: 9, 11: 10}


def chain(h: int) -> list[int]:
    out = []
    x: int | None = h
    while x is not None:
        out.append(x)
        x = PARENT[x]
    return out[::-1]


ops = st.lists(st.tuples(st.sampled_from(["insert", "insert", "lookup", "remove", "pin",
                                          "unpin", "clear", "demote"]),
                         st.integers(0, 11), st.booleans()), max_size=60)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), ops, st.integers(0, 20))
def test_cache_bounds_whole_prefixes_and_trie_replay(cap, script, drop_at) -> None:
    c = BlockCache("w", cap)
    t = PrefixTrie([2], block_size=4)
    t.add_worker("w", 2, cap)
    pinned: list[list[int]] = []
    sent = 0
    for op, h, flag in script:
        path = chain(h)
        if op == "insert":
            n = c.insert(path, pin=flag)
            if flag and n:
                pinned.append(path[:n])
        elif op == "lookup":
            c.lookup(path)
        elif op == "remove":
            c.remove(path[-2:] if flag else path[-1:])
        elif op == "pin" and c.lookup(path) == len(path):
            c.pin(path)
            pinned.append(path)
        elif op == "unpin" and pinned:
            c.unpin(pinned.pop())
        elif op == "clear":
            c.clear()
            pinned.clear()
        elif op == "demote":  # any order, a chain or a leaf: eviction still takes leaves
            c.demote(path if flag else path[-1:])
        assert len(c) <= cap
        for b in c.blocks():
            p = c.parent_of(b)
            assert p is None or p in c  # whole prefixes only
        for path_ in pinned:
            assert all(b in c for b in path_)  # pinned blocks never evicted
        for ev in c.take_events():
            sent += 1
            if sent == drop_at:  # lose one event on the wire
                continue
            out = t.apply(ev)
            if sent > drop_at:
                assert out in (ApplyOutcome.GAP, ApplyOutcome.APPLIED)
    # A lost trailing event shows only as last_event_id lagging the worker's (its heartbeat
    # carries it); either way the adapter asks for a snapshot.
    if t.is_stale("w") or t.last_event_id("w") != c.last_event_id:
        assert t.apply(c.snapshot()) is ApplyOutcome.APPLIED
    # The trie's view reproduces the cache: same blocks, each held (all are whole prefixes).
    assert t.worker_blocks("w") == c.blocks()
    assert t.held_nodes("w") == c.blocks()
    for b in c.blocks():
        assert t.match(chain(b)).held("w") == len(chain(b))
