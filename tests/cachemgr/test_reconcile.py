"""§6.2 reconciliation: page parity after split/merge, assignment, pending, lazy copies."""

from __future__ import annotations

import pytest

from services.cachemgr.actions import Replicate
from services.cachemgr.events import Removed, Stored
from services.cachemgr.trie import PrefixTrie
from shared.ids import InvalidInput, UnknownWorker

P, L, R = "w-cp4-g0", "w-cp2-g0", "w-cp2-g2"


def split_setup(extra_branch: bool = False) -> PrefixTrie:
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(P, 4, 100)
    # pages 0..4; with 2C = 4 page p is on the left child iff p mod 4 < 2: 10, 11, 14 left
    t.apply(Stored(P, 1, None, (10, 11, 12, 13, 14)))
    if extra_branch:
        t.apply(Stored(P, 2, 10, (20, 21)))  # pages 1 (left) and 2 (right)
    return t


def test_split_page_parity_and_pending_on_assigned_child() -> None:
    t = split_setup()
    plan = t.reconcile_split(P, (L, R), {L: 50, R: 50})
    assert P not in t.workers() and t.worker_degree(L) == 2 and t.worker_degree(R) == 2
    assert plan.physical == {L: {10, 11, 14}, R: {12, 13}}
    # Left misses 2 pages, right 3: the tie on demand goes to the cheaper child.
    assert plan.assignment == {14: L}
    assert t.pending_blocks(L) == {12, 13} and t.pending_blocks(R) == frozenset()
    # Pending pages are not reusable: left holds only pages 0-1, right nothing from the root.
    assert dict(t.match([10, 11, 12, 13, 14]).held_blocks) == {L: 2}
    assert t.replica_count(14, 2) == 0


def test_lazy_reconcile_copy_on_first_reuse_then_install() -> None:
    t = split_setup()
    t.reconcile_split(P, (L, R), {L: 50, R: 50})
    acts = t.on_reuse(L, [10, 11, 12, 13, 14, 15])
    assert acts == (Replicate(13, 2, R, L, (12, 13), "reconcile"),)  # only the missing pages
    assert t.on_reuse(L, [10, 11, 12, 13, 14]) == ()  # already in flight
    assert t.match([10, 11, 12, 13, 14]).held(L) == 2  # not visible before confirmation
    t.apply(Stored(L, 1, 11, (12, 13)))  # the child's own report confirms installation
    assert t.pending_blocks(L) == frozenset() and t.inflight() == ()
    assert t.match([10, 11, 12, 13, 14]).held(L) == 5
    assert t.replica_count(14, 2) == 1


def test_split_assignment_by_demand_and_capacity() -> None:
    t = split_setup(extra_branch=True)
    plan = t.reconcile_split(P, (L, R), {L: 50, R: 50}, demand={14: 5.0, 21: 3.0})
    # 14 (heavier) first -> left (fewer missing pages); 21 -> right (less demand so far).
    assert plan.assignment == {14: L, 21: R}
    assert t.pending_blocks(R) == {10, 20}  # 21 (page 2) is already on the right child
    t2 = split_setup()
    plan2 = t2.reconcile_split(P, (L, R), {L: 3, R: 100})  # left has no room left
    assert plan2.assignment == {14: R} and t2.pending_blocks(R) == {10, 11, 14}
    t3 = split_setup()
    plan3 = t3.reconcile_split(P, (L, R), {L: 3, R: 2})
    assert plan3.assignment == {} and plan3.unassigned == (14,)


def test_pending_without_valid_copy_is_an_ordinary_miss() -> None:
    t = split_setup()
    t.add_worker("x", 2, 100)
    t.reconcile_split(P, (L, R), {L: 50, R: 50})
    t.apply(Removed(R, 1, (12, 13)))  # the sibling's copies are gone (e.g. LRU)
    assert t.on_reuse(L, [10, 11, 12, 13, 14]) == ()
    assert t.pending_blocks(L) == {13}  # 12 dropped: recomputed like any miss
    # A valid copy elsewhere is used when the hinted sibling lost it.
    t.apply(Stored("x", 1, None, (10, 11, 12, 13)))
    assert t.on_reuse(L, [10, 11, 12, 13]) == ()  # 12 no longer pending at L: run stops
    t.apply(Stored(L, 1, 11, (12,)))  # L recomputed and stored page 2
    assert t.on_reuse(L, [10, 11, 12, 13]) == (Replicate(13, 2, "x", L, (13,), "reconcile"),)


def test_merge_marks_misplaced_pages_pending() -> None:
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(L, 2, 50)
    t.add_worker(R, 2, 50)
    t.apply(Stored(L, 1, None, (10, 11, 12, 13)))  # pages 0-3 at the left child
    t.apply(Stored(R, 1, None, (10, 20)))  # pages 0-1 at the right child
    plan = t.reconcile_merge((L, R), P, 100)
    # On the merged worker page p must be on rank p mod 4: the left child's ranks serve
    # p mod 4 < 2 (10, 11 stay valid), the right child's p mod 4 >= 2 (none of 10, 20).
    assert plan.physical == {10, 11} and plan.pending == {12, 13, 20}
    assert t.workers() == (P,) and t.worker_degree(P) == 4
    assert t.match([10, 11, 12, 13]).held(P) == 2
    acts = t.on_reuse(P, [10, 11, 12, 13])
    assert acts == (Replicate(13, 4, P, P, (12, 13), "reconcile"),)  # moves between its ranks
    assert t.confirm_installed(P, [12, 13]) == 2
    assert t.match([10, 11, 12, 13]).held(P) == 4 and t.inflight() == ()


def test_reconcile_validation_changes_nothing() -> None:
    t = split_setup()
    t.add_worker(R, 2, 10)
    with pytest.raises(InvalidInput):
        t.reconcile_split(P, (L, R), {L: 50, R: 50})  # R already exists
    with pytest.raises(UnknownWorker):
        t.reconcile_split("nope", (L, "y"), {L: 5, "y": 5})
    with pytest.raises(InvalidInput):
        t.reconcile_split(P, (L, "y"), {L: 5})  # capacity missing for y
    with pytest.raises(InvalidInput):
        t.reconcile_split(P, (L, "y"), {L: 5, "y": 5}, demand={14: -1.0})
    with pytest.raises(InvalidInput):
        t.reconcile_merge((R, P), "m", 10)  # degrees 2 and 4
    with pytest.raises(InvalidInput):
        t.reconcile_split(R, ("p", "q"), {"p": 1, "q": 1})  # degree 1 unsupported
    assert set(t.workers()) == {P, R} and t.match([10, 11, 12]).held(P) == 3


def test_child_block_cache_seeded_from_the_plan_then_events_line_up() -> None:
    from services.rankd.blockcache import BlockCache

    t = split_setup()
    t.reconcile_split(P, (L, R), {L: 50, R: 50})
    cache = BlockCache(L, 50)
    cache.adopt([(h, t.parent(h)) for h in t.held_nodes(L)])
    assert cache.blocks() == {10, 11} and cache.take_events() == []
    with pytest.raises(InvalidInput):
        cache.adopt([(13, 12)])  # parent neither cached nor adopted
    # Installing the reconcile copy through the cache confirms it in the trie.
    (act,) = t.on_reuse(L, [10, 11, 12, 13, 14])
    cache.insert([10, 11, 12, 13])
    for ev in cache.take_events():
        t.apply(ev)
    assert t.pending_blocks(L) == frozenset() and t.match([10, 11, 12, 13, 14]).held(L) == 5
