"""Applying cache events: holders, duplicates, gaps, snapshots, bad input, and a model check."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cachemgr.events import Cleared, Removed, Snapshot, Stored
from services.cachemgr.trie import ApplyOutcome, InconsistentEvent, PrefixTrie
from shared.ids import InvalidInput, UnknownWorker


def state(t: PrefixTrie):
    """Everything observable about holders, for 'state unchanged' checks."""
    return (
        {h: (t.holders(h), tuple(t.replica_count(h, c) for c in t.degrees))
         for h in t.node_hashes()},
        {w: (t.worker_blocks(w), t.pending_blocks(w), t.last_event_id(w), t.is_stale(w))
         for w in t.workers()},
    )


def test_stored_makes_complete_prefix_holders(make_trie) -> None:
    t, f = make_trie({"a": 2, "b": 4})
    assert f.store("a", [1, 2, 3]) is ApplyOutcome.APPLIED
    assert f.store("a", [4], parent=2) is ApplyOutcome.APPLIED
    assert f.store("b", [1, 2]) is ApplyOutcome.APPLIED
    assert t.holders(2) == {"a", "b"} and t.holders(3) == {"a"} and t.holders(4) == {"a"}
    assert t.replica_count(2, 2) == 1 and t.replica_count(2, 4) == 1
    assert t.replica_count(3, 4) == 0
    assert t.prefix_length(1) == 4 and t.prefix_length(3) == 12  # block_size 4
    assert t.parent(4) == 2 and set(t.children(2)) == {3, 4}


def test_removing_an_interior_block_leaves_orphans_that_are_not_holders(make_trie) -> None:
    t, f = make_trie({"a": 2})
    f.store("a", [1, 2, 3, 4])
    t.apply(Removed("a", 2, (2,)))
    assert t.holders(1) == {"a"}
    assert t.holders(3) == frozenset() and t.holders(4) == frozenset()
    assert t.worker_blocks("a") == {1, 3, 4}  # still resident, usable as copy sources
    assert t.match([1, 2, 3, 4]).held_blocks == {"a": 1}
    # Re-storing the missing link reconnects the orphans.
    f.ids["a"] = 2
    f.store("a", [2], parent=1)
    assert t.holders(4) == {"a"}
    assert t.match([1, 2, 3, 4]).held_blocks == {"a": 4}


def test_cleared_drops_everything(make_trie) -> None:
    t, f = make_trie({"a": 2})
    f.store("a", [1, 2])
    assert t.apply(Cleared("a", 2)) is ApplyOutcome.APPLIED
    assert t.holders(1) == frozenset() and t.worker_blocks("a") == frozenset()


def test_duplicate_is_a_no_op(make_trie) -> None:
    t, f = make_trie({"a": 2})
    f.store("a", [1, 2])
    t.apply(Removed("a", 2, (2,)))
    before = state(t)
    assert t.apply(Stored("a", 2, 1, (2,))) is ApplyOutcome.DUPLICATE
    assert t.apply(Stored("a", 1, None, (7,))) is ApplyOutcome.DUPLICATE
    assert state(t) == before


def test_gap_marks_stale_until_snapshot(make_trie) -> None:
    t, f = make_trie({"a": 2, "b": 2})
    f.store("a", [1, 2, 3])
    f.store("b", [1, 2])
    assert t.apply(Stored("a", 3, 3, (4,))) is ApplyOutcome.GAP  # event 2 was lost
    assert t.is_stale("a") and t.stale_workers() == ("a",)
    # Its prefixes now count as misses.
    assert t.match([1, 2, 3]).held_blocks == {"b": 2}
    assert t.replica_count(1, 2) == 1
    # Later events are not applied while stale, even the missing one arriving late.
    assert t.apply(Stored("a", 2, 3, (9,))) is ApplyOutcome.GAP
    assert t.apply(Stored("a", 1, None, (1,))) is ApplyOutcome.DUPLICATE
    snap = Snapshot("a", 3, ((1, None), (2, 1), (3, 2), (4, 3)))
    assert t.apply(snap) is ApplyOutcome.APPLIED
    assert not t.is_stale("a") and t.last_event_id("a") == 3
    assert t.match([1, 2, 3, 4]).held_blocks == {"a": 4, "b": 2}
    assert t.apply(Stored("a", 4, 4, (5,))) is ApplyOutcome.APPLIED
    # An older snapshot than what was applied is ignored.
    assert t.apply(Snapshot("a", 2, ())) is ApplyOutcome.DUPLICATE
    assert t.holders(5) == {"a"}


def test_a_stale_worker_refuses_a_snapshot_older_than_what_was_applied(make_trie) -> None:
    # Asked for before the gap (at registration) and answered after it: applying it would
    # bring back block 3, whose removal (event 3) was applied and will never come again.
    t, f = make_trie({"a": 2})
    f.store("a", [1, 2, 3])
    old = Snapshot("a", 1, ((1, None), (2, 1), (3, 2)))
    assert t.apply(Stored("a", 2, 3, (4,))) is ApplyOutcome.APPLIED
    assert t.apply(Removed("a", 3, (4, 3))) is ApplyOutcome.APPLIED
    assert t.apply(Stored("a", 5, 2, (9,))) is ApplyOutcome.GAP  # event 4 was lost
    assert t.apply(old) is ApplyOutcome.DUPLICATE
    assert t.is_stale("a") and t.last_event_id("a") == 3 and t.holders(3) == frozenset()
    # The snapshot the gap asked for ends it (event 5, held back, is in it).
    now = Snapshot("a", 5, ((1, None), (2, 1), (9, 2)))
    assert t.apply(now) is ApplyOutcome.APPLIED
    assert not t.is_stale("a") and t.worker_blocks("a") == {1, 2, 9}


def test_events_after_the_gap_are_applied_on_top_of_an_older_snapshot(make_trie) -> None:
    # Event 4 lost; 5 and 6 arrive while the snapshot (taken after 4) is on its way: they
    # are held back and applied on top of it, so an idle worker does not stay wrong.
    t, f = make_trie({"a": 2})
    f.store("a", [1, 2])
    assert t.apply(Stored("a", 3, 2, (3,))) is ApplyOutcome.GAP  # event 2 lost
    assert t.apply(Removed("a", 4, (3,))) is ApplyOutcome.GAP
    assert t.apply(Stored("a", 5, 2, (7,))) is ApplyOutcome.GAP
    snap = Snapshot("a", 3, ((1, None), (2, 1), (3, 2), (5, 2)))
    assert t.apply(snap) is ApplyOutcome.APPLIED
    assert not t.is_stale("a") and t.last_event_id("a") == 5
    assert t.worker_blocks("a") == {1, 2, 5, 7} and t.holders(3) == frozenset()
    assert t.apply(Stored("a", 6, 7, (8,))) is ApplyOutcome.APPLIED


def test_a_snapshot_short_of_an_event_seen_leaves_the_worker_stale(make_trie,
                                                                    monkeypatch) -> None:
    import services.cachemgr.trie as trie_mod

    t, f = make_trie({"a": 2})
    f.store("a", [1])
    # A hole after the snapshot: 3 applies on top of it, 5 is a gap again (4 missing).
    assert t.apply(Stored("a", 3, 1, (3,))) is ApplyOutcome.GAP
    assert t.apply(Stored("a", 5, 3, (5,))) is ApplyOutcome.GAP
    assert t.apply(Snapshot("a", 2, ((1, None),))) is ApplyOutcome.APPLIED
    assert t.is_stale("a") and t.last_event_id("a") == 3
    assert t.apply(Snapshot("a", 4, ((1, None), (3, 1)))) is ApplyOutcome.APPLIED
    assert not t.is_stale("a") and t.worker_blocks("a") == {1, 3, 5}
    # Held back only up to HELD_BACK_MAX: an event seen and dropped makes the snapshot that
    # does not cover it leave the worker stale (the adapter asks again).
    monkeypatch.setattr(trie_mod, "HELD_BACK_MAX", 1)
    assert t.apply(Stored("a", 7, 5, (7,))) is ApplyOutcome.GAP
    assert t.apply(Stored("a", 8, 7, (8,))) is ApplyOutcome.GAP  # not held back
    assert t.apply(Snapshot("a", 6, ((1, None), (3, 1), (5, 3)))) is ApplyOutcome.APPLIED
    assert t.is_stale("a") and t.worker_blocks("a") == frozenset()
    snap = Snapshot("a", 8, ((1, None), (3, 1), (5, 3), (7, 5), (8, 7)))
    assert t.apply(snap) is ApplyOutcome.APPLIED
    assert not t.is_stale("a") and t.worker_blocks("a") == {1, 3, 5, 7, 8}


def test_stored_under_a_parent_the_worker_lacks_is_a_gap(make_trie) -> None:
    t, f = make_trie({"a": 2, "b": 2})
    f.store("b", [1, 2])
    assert t.apply(Stored("a", 1, 2, (3,))) is ApplyOutcome.GAP
    assert t.is_stale("a") and 3 not in t


def test_unknown_worker_and_bad_input_change_nothing(make_trie) -> None:
    t, f = make_trie({"a": 2})
    f.store("a", [1, 2])
    before = state(t)
    with pytest.raises(UnknownWorker):
        t.apply(Stored("zz", 1, None, (5,)))
    with pytest.raises(InvalidInput):
        t.apply({"type": "stored"})  # type: ignore[arg-type]
    # A chain contradicting the trie (2 already follows 1): typed error, nothing applied.
    with pytest.raises(InconsistentEvent):
        t.apply(Stored("a", 2, None, (9, 2)))
    with pytest.raises(InconsistentEvent):
        t.apply(Snapshot("a", 5, ((2, None),)))
    assert state(t) == before and 9 not in t
    with pytest.raises(UnknownWorker):
        t.remove_worker("zz")
    with pytest.raises(InvalidInput):
        t.add_worker("a", 2, 10)  # already registered
    with pytest.raises(InvalidInput):
        t.add_worker("c", 3, 10)  # degree not supported
    with pytest.raises(InvalidInput):
        t.add_worker("c", 2, 0)
    with pytest.raises(InvalidInput):
        PrefixTrie([2, 2])
    assert state(t) == before


def test_remove_worker_drops_its_holdings(make_trie) -> None:
    t, f = make_trie({"a": 2, "b": 4})
    f.store("a", [1, 2])
    f.store("b", [1])
    t.remove_worker("a")
    assert t.holders(1) == {"b"} and t.holders(2) == frozenset()


# --- property: holders are exactly what the applied events imply ---------------------------
# Hash h's parent is fixed by a tiny universe (a forest over 0..11), so any chain we generate is
# consistent. The model replays events per worker with its own rules, independently.
PARENT = {0: None, 1: 0, 2: 1, 3: 1, 4: 2, 5: None, 6: 5, 7: 6, 8: 6, 9: 3, 10: 9, 11: 4}
WORKERS = {"a": 2, "b": 2, "c": 4}


def chain_to(h: int) -> list[int]:
    out = []
    x: int | None = h
    while x is not None:
        out.append(x)
        x = PARENT[x]
    return out[::-1]


@st.composite
def event_streams(draw):
    ops = []
    for _ in range(draw(st.integers(1, 40))):
        w = draw(st.sampled_from(sorted(WORKERS)))
        kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear", "skip",
                                     "dup", "snapshot"]))
        ops.append((w, kind, draw(st.integers(0, 11)), draw(st.integers(1, 3))))
    return ops


@settings(max_examples=80, deadline=None)
@given(event_streams())
def test_holders_match_an_independent_model(ops) -> None:
    t = PrefixTrie([2, 4], block_size=4)
    for w, c in WORKERS.items():
        t.add_worker(w, c, 1000)
    model: dict[str, set[int]] = {w: set() for w in WORKERS}  # the worker's real cache
    known: dict[str, set[int] | None] = {w: set() for w in WORKERS}  # None: stale
    sent = {w: 0 for w in WORKERS}
    applied = {w: 0 for w in WORKERS}  # last event id the manager applied, per the model
    for w, kind, h, k in ops:
        if kind == "store":
            path = chain_to(h)
            i = 0  # the worker stores the missing tail of the path under its cached part
            while i < len(path) and path[i] in model[w]:
                i += 1
            new = path[i:i + k]
            if not new:
                continue
            sent[w] += 1
            ev = Stored(w, sent[w], path[i - 1] if i else None, tuple(new))
            model[w].update(new)
        elif kind == "remove":
            victims = [x for x in model[w] if x in chain_to(h)][:k]
            if not victims:
                continue
            sent[w] += 1
            ev = Removed(w, sent[w], tuple(victims))
            model[w].difference_update(victims)
        elif kind == "clear":
            sent[w] += 1
            ev = Cleared(w, sent[w])
            model[w].clear()
        elif kind == "skip":  # an event lost on the wire
            sent[w] += 1
            model[w].add(chain_to(h)[0])
            continue
        elif kind == "dup":
            if applied[w] == 0:
                continue
            ev = Cleared(w, applied[w])  # an id already applied: must be ignored
        else:
            model[w] = {x for x in model[w] if all(y in model[w] for y in chain_to(x))}
            ev = Snapshot(w, sent[w], tuple((x, PARENT[x]) for x in model[w]))
        out = t.apply(ev)
        if kind == "snapshot":
            assert out is ApplyOutcome.APPLIED
            known[w], applied[w] = set(model[w]), sent[w]
        elif kind == "dup":
            assert out is ApplyOutcome.DUPLICATE
        elif known[w] is None or ev.event_id > applied[w] + 1 or (
                isinstance(ev, Stored) and ev.parent_hash is not None
                and ev.parent_hash not in known[w]):
            assert out is ApplyOutcome.GAP
            known[w] = None
        else:
            assert out is ApplyOutcome.APPLIED
            known[w], applied[w] = set(model[w]), ev.event_id
        # check: holders(x) = workers whose known set contains x's whole path
        for x in t.node_hashes():
            expect = {v for v, s in known.items() if s is not None
                      and all(y in s for y in chain_to(x))}
            assert t.holders(x) == expect, (x, known)
            for c in t.degrees:
                assert t.replica_count(x, c) == sum(1 for v in expect if WORKERS[v] == c)
            # match agrees: each worker's longest fully known prefix of the chain to x
            path = chain_to(x)
            want = {}
            for v, s in known.items():
                k = 0
                while s is not None and k < len(path) and path[k] in s:
                    k += 1
                if k:
                    want[v] = k
            assert dict(t.match(path).held_blocks) == want
        for v, s in known.items():
            assert t.is_stale(v) == (s is None)
            if s is not None:
                assert t.worker_blocks(v) == s


def test_set_capacity_keeps_holdings_and_checks_its_input(make_trie) -> None:
    t, f = make_trie({"a": 2})
    f.store("a", [1, 2, 3])
    before = state(t)
    t.set_capacity("a", 7)
    assert t.capacity_blocks("a") == 7 and state(t) == before
    for bad in (0, -1, 2.5, True, "8"):
        with pytest.raises(InvalidInput, match="capacity_blocks must be an integer >= 1"):
            t.set_capacity("a", bad)  # type: ignore[arg-type]
    assert t.capacity_blocks("a") == 7
    with pytest.raises(UnknownWorker):
        t.set_capacity("zz", 5)
