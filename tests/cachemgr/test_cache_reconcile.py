"""§6.2 reconciliation: page parity after split/merge, assignment, pending, lazy copies."""

from __future__ import annotations

import pytest
from cachemgr_support import forest_path, merged_trie, store_leaves
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cachemgr.actions import Replicate
from services.cachemgr.events import Stored
from services.cachemgr.reconcile import pending_reach
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
    # Resident: left 10, 11, 14; right 12, 13. Valid = whole prefixes only.
    assert plan.valid == {L: {10, 11}, R: frozenset()}
    # Left has 3 pages to reconcile (2 to copy), right 5: the tie on demand goes left.
    assert plan.assignment == {14: L}
    assert t.pending_blocks(L) == {12, 13, 14} and t.pending_blocks(R) == frozenset()
    assert plan.donors == {L: frozenset(), R: {12, 13}} and t.donor_blocks(R) == {12, 13}
    # Pending pages are not reusable: left holds only pages 0-1, right nothing from the root.
    assert dict(t.match([10, 11, 12, 13, 14]).held_blocks) == {L: 2}
    assert t.replica_count(14, 2) == 0


def test_lazy_reconcile_copy_on_first_reuse_then_install() -> None:
    t = split_setup()
    t.reconcile_split(P, (L, R), {L: 50, R: 50})
    acts = t.on_reuse(L, [10, 11, 12, 13, 14, 15])
    assert acts == (Replicate(13, 2, R, L, (12, 13), "reconcile"),  # only the missing pages
                    Replicate(14, 2, L, L, (14,), "reconcile"))  # resident: index it
    assert t.on_reuse(L, [10, 11, 12, 13, 14]) == ()  # already in flight
    assert t.match([10, 11, 12, 13, 14]).held(L) == 2  # not visible before confirmation
    t.apply(Stored(L, 1, 11, (12, 13, 14)))  # the child's own report confirms installation
    assert t.pending_blocks(L) == frozenset() and t.inflight() == ()
    assert t.match([10, 11, 12, 13, 14]).held(L) == 5
    assert t.replica_count(14, 2) == 1


def test_split_assignment_by_demand_and_capacity() -> None:
    t = split_setup(extra_branch=True)
    plan = t.reconcile_split(P, (L, R), {L: 50, R: 50}, demand={14: 5.0, 21: 3.0})
    # 14 (heavier) first -> left (fewer missing pages); 21 -> right (less demand so far).
    assert plan.assignment == {14: L, 21: R}
    assert t.pending_blocks(R) == {10, 20, 21}  # 21 (page 2) is resident there already
    assert t.donor_blocks(R) == {12, 13}
    t2 = split_setup()
    plan2 = t2.reconcile_split(P, (L, R), {L: 3, R: 100})  # left has no room left
    assert plan2.assignment == {14: R} and t2.pending_blocks(R) == {10, 11, 12, 13, 14}
    assert t2.donor_blocks(L) == {14}  # the source of R's page 4; 10-11 stay valid on L
    t3 = split_setup()
    plan3 = t3.reconcile_split(P, (L, R), {L: 3, R: 2})
    assert plan3.assignment == {} and plan3.unassigned == (14,)


def test_pending_without_valid_copy_is_an_ordinary_miss() -> None:
    t = split_setup()
    t.add_worker("x", 2, 100)
    t.reconcile_split(P, (L, R), {L: 50, R: 50})
    assert t.release_donors(R) == 2  # the sibling freed its copies
    assert t.on_reuse(L, [10, 11, 12, 13, 14]) == ()
    assert t.pending_blocks(L) == {13, 14}  # 12 dropped: recomputed like any miss
    # A valid copy elsewhere is used when the hinted sibling lost it.
    t.apply(Stored("x", 1, None, (10, 11, 12, 13)))
    assert t.on_reuse(L, [10, 11, 12, 13]) == ()  # 12 no longer pending at L: run stops
    t.apply(Stored(L, 1, 11, (12,)))  # L recomputed and stored page 2
    assert t.on_reuse(L, [10, 11, 12, 13]) == (Replicate(13, 2, "x", L, (13,), "reconcile"),)


def shared_stem_split() -> PrefixTrie:
    """Two retained prefixes over one stem split to different children: 10..15 (pages 0-5:
    10, 11, 14, 15 on the left, 12, 13 on the right) to the left (heavier), 10..14, 16, 17,
    18 to the right. Each child's pages of the stem are pending on it (their ancestors are
    on the sibling) and needed by the sibling."""
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(P, 4, 100)
    t.apply(Stored(P, 1, None, (10, 11, 12, 13, 14, 15)))
    t.apply(Stored(P, 2, 14, (16, 17, 18)))
    plan = t.reconcile_split(P, (L, R), {L: 50, R: 50}, demand={15: 5.0, 18: 3.0})
    assert plan.assignment == {15: L, 18: R}
    assert t.pending_blocks(L) == {12, 13, 14, 15}
    assert t.pending_blocks(R) == {10, 11, 12, 13, 14, 16, 17, 18}
    return t


def test_a_page_pending_on_the_sibling_but_resident_there_is_a_copy_source() -> None:
    """12 and 13 sit on the right child, pending there (their ancestors 10, 11 are on the
    left); 14 sits on the left, pending there. Each is copied from where it sits. Before, a
    pending page was no source: the left child dropped 12 (no request reused the prefix
    beyond 11) and the right child 14."""
    t = shared_stem_split()
    assert t.on_reuse(L, [10, 11, 12, 13, 14, 15]) == (
        Replicate(13, 2, R, L, (12, 13), "reconcile"),
        Replicate(15, 2, L, L, (14, 15), "reconcile"))
    assert t.on_reuse(R, [10, 11, 12, 13, 14, 16, 17, 18]) == (
        Replicate(16, 2, L, R, (10, 11, 14, 16), "reconcile"),
        Replicate(18, 2, R, R, (12, 13, 17, 18), "reconcile"))
    assert t.pending_blocks(L) == {12, 13, 14, 15}  # nothing dropped: all on their way
    assert t.pending_blocks(R) == {10, 11, 12, 13, 14, 16, 17, 18}


def test_a_merge_back_keeps_the_childrens_resident_pending_pages() -> None:
    """Merged back before any reuse: every page of the two prefixes is on the merged worker,
    pending on itself (indexed, or moved between its own ranks, at the first reuse). Before,
    the children's pending pages were taken as gone: pending with no copy anywhere, dropped
    at the first reuse and recomputed."""
    t = shared_stem_split()
    plan = t.reconcile_merge((L, R), P, 100)
    assert plan.valid == {10, 11}
    assert t._workers[P].pending == {h: P for h in (12, 13, 14, 15, 16, 17, 18)}
    assert t.on_reuse(P, [10, 11, 12, 13, 14, 16, 17, 18]) == (
        Replicate(18, 4, P, P, (12, 13, 14, 16, 17, 18), "reconcile"),)
    assert t.pending_blocks(P) == {12, 13, 14, 15, 16, 17, 18}  # none dropped


def test_a_split_of_a_merged_worker_gives_up_its_resident_pending_pages() -> None:
    """A merged worker's page pending on itself may sit on either half, whatever its depth
    (the left child's pages 2-3 stay on the left GPUs after a merge): a split cannot tell
    which child holds it, so it is given up, not placed by the layout rule on a child that
    never computed it (what the simulator's run without a cache manager checks:
    tests/sim_engine/test_sim_cache.py)."""
    t = merged_trie(L, R, P)
    assert t._workers[P].pending == {12: P, 13: P}
    plan = t.reconcile_split(P, (L, R), {L: 100, R: 100})
    assert plan.valid == {L: {10, 11}, R: frozenset()}
    assert t.donor_blocks(R) == frozenset() and t.pending_blocks(R) == frozenset()


def test_pending_reach_is_what_on_reuse_would_bring_without_its_side_effects() -> None:
    t = split_setup()
    t.add_worker("x", 2, 100)
    t.reconcile_split(P, (L, R), {L: 50, R: 50})
    req = [10, 11, 12, 13, 14, 15]
    held = dict(t.match(req).held_blocks)
    assert held == {L: 2}
    # L holds pages 0-1 and has 2-4 pending (12-13 from R's donors, 14 its own resident
    # page): once its reconcile copies land it holds 5 of the request. R, x: nothing pending.
    assert pending_reach(t, req, held) == {L: 5}
    assert t.inflight() == () and t.pending_blocks(L) == {12, 13, 14}  # nothing sent
    # Only where it reaches beyond what the worker holds.
    assert pending_reach(t, req, {L: 5}) == {}
    assert pending_reach(t, [10, 11], held) == {}
    # The request's chain decides: a block not under the previous one ends the walk.
    assert pending_reach(t, [10, 11, 13, 14], held) == {}
    # Copies on their way count; a pending page with no source left ends the walk, as
    # on_reuse's would (it drops it there).
    acts = t.on_reuse(L, req)
    assert pending_reach(t, req, held) == {L: 5}
    for a in acts:
        assert t.replication_failed(a)
    assert t.release_donors(R) == 2
    assert pending_reach(t, req, held) == {}
    assert t.pending_blocks(L) == {12, 13, 14}  # still pending: pending_reach drops nothing
    with pytest.raises(InvalidInput):
        pending_reach(t, "ab", held)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        pending_reach(t, [10, [11]], held)  # type: ignore[list-item]


def test_pending_reach_after_a_merge_counts_pages_on_the_merged_workers_own_ranks() -> None:
    t = merged_trie(L, R, P)
    # Pages 2-3 sit on the merged worker's own ranks (source: itself): always reachable.
    assert pending_reach(t, [10, 11, 12, 13], t.match([10, 11, 12, 13]).held_blocks) == {P: 4}


def test_merge_marks_misplaced_pages_pending() -> None:
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(L, 2, 50)
    t.add_worker(R, 2, 50)
    t.apply(Stored(L, 1, None, (10, 11, 12, 13)))  # pages 0-3 at the left child
    t.apply(Stored(R, 1, None, (10, 20)))  # pages 0-1 at the right child
    plan = t.reconcile_merge((L, R), P, 100)
    # On the merged worker page p must be on rank p mod 4: the left child's ranks serve
    # p mod 4 < 2 (10, 11 stay valid), the right child's p mod 4 >= 2 (none of 10, 20).
    assert plan.valid == {10, 11} and plan.pending == {12, 13, 20}
    assert t.workers() == (P,) and t.worker_degree(P) == 4
    assert t.match([10, 11, 12, 13]).held(P) == 2
    acts = t.on_reuse(P, [10, 11, 12, 13])
    assert acts == (Replicate(13, 4, P, P, (12, 13), "reconcile"),)  # moves between its ranks
    assert t.confirm_installed(P, [12, 13]) == 2
    assert t.match([10, 11, 12, 13]).held(P) == 4 and t.inflight() == ()


def test_merge_never_indexes_more_than_the_merged_capacity() -> None:
    """Donor pages (leftovers of a split, outside the children's caches) plus the children's
    own pages can exceed the merged worker's capacity; its cache could not adopt them all, so
    the children's own pages win and nothing beyond the capacity is indexed as valid."""
    t = split_setup()
    t.reconcile_split(P, (L, R), {L: 50, R: 50})
    assert t.worker_blocks(L) == {10, 11} and t.donor_blocks(R) == {12, 13}
    # Without the cap, pages 0-3 (10, 11 on L; donors 12, 13 on R) would all be valid.
    plan = t.reconcile_merge((L, R), P, 2)
    assert plan.valid == {10, 11} and t.worker_blocks(P) == {10, 11}
    assert {12, 13} <= plan.pending  # recomputed or copied on reuse, like any miss
    t2 = split_setup()
    t2.reconcile_split(P, (L, R), {L: 50, R: 50})
    plan2 = t2.reconcile_merge((L, R), P, 100)
    assert plan2.valid == {10, 11, 12, 13}  # room: all kept
    # ... and the left child's resident pending page 4 stays, pending on the merged worker.
    assert plan2.pending == {14} and t2._workers[P].pending == {14: P}


def test_split_never_indexes_more_than_a_childs_capacity() -> None:
    """Pages sit on ranks by depth, so a parent full of one- and two-block prompts has every
    page on the left child's GPUs: more whole prefixes than the left child's cache index can
    hold. The shallowest are indexed (whole prefixes still) and the child's cache adopts them;
    every resident page is still accounted for (valid, pending or donor)."""
    from services.rankd.blockcache import BlockCache

    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(P, 4, 8)
    for i in range(4):  # four two-block prompts: depths 0 and 1, all on the left
        t.apply(Stored(P, i + 1, None, (100 + i, 200 + i)))
    plan = t.reconcile_split(P, (L, R), {L: 4, R: 4})
    valid = t.worker_blocks(L)
    assert valid == {100, 101, 102, 103} == plan.valid[L]  # the roots: depth 0 first
    assert len(valid) <= t.capacity_blocks(L)
    assert valid | t.pending_blocks(L) | t.donor_blocks(L) == {100 + i for i in range(4)} | {
        200 + i for i in range(4)}
    # The right child, with room, takes prefixes to copy over: pending, within its capacity.
    assert t.worker_blocks(R) == frozenset() and t.used_blocks(R) <= t.capacity_blocks(R)
    cache = BlockCache(L, 4)
    cache.adopt([(h, t.parent(h)) for h in sorted(t.held_nodes(L), key=t.prefix_length)])
    assert cache.blocks() == valid


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
    assert len(t.on_reuse(L, [10, 11, 12, 13, 14])) == 2
    cache.insert([10, 11, 12, 13, 14])
    for ev in cache.take_events():
        t.apply(ev)
    assert t.pending_blocks(L) == frozenset() and t.match([10, 11, 12, 13, 14]).held(L) == 5


# --- properties ----------------------------------------------------------------------------
@st.composite
def parent_cache(draw):
    """A degree-4 parent holding whole prefixes over a random forest of 30 blocks."""
    parents: dict[int, int | None] = {100: None}
    for h in range(101, 130):
        parents[h] = draw(st.one_of(st.none(), st.integers(100, h - 1)))
    leaves = draw(st.lists(st.integers(100, 129), min_size=1, max_size=8))
    return parents, leaves, draw(st.integers(2, 40)), draw(st.integers(2, 40))


def _closed(t: PrefixTrie, hs) -> bool:
    return all(t.parent(h) is None or t.parent(h) in hs for h in hs)


@settings(max_examples=60, deadline=None)
@given(parent_cache())
def test_split_then_merge_invariants(case) -> None:
    parents, leaves, cap_l, cap_r = case
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(P, 4, 1000)
    store_leaves(t, P, parents, leaves)
    resident = t.worker_blocks(P)
    depth = {h: len(forest_path(parents, h)) - 1 for h in resident}
    plan = t.reconcile_split(P, (L, R), {L: cap_l, R: cap_r})
    res = {}
    for x in (L, R):
        valid, pend, don = t.worker_blocks(x), t.pending_blocks(x), t.donor_blocks(x)
        assert _closed(t, valid)  # whole prefixes only, as the worker's own index
        res[x] = valid | don | {h for h in pend if h in plan.pending[x] and
                                (depth.get(h, -1) % 4 < 2) == (x == L) and h in resident}
    # every resident page stays on exactly one child: the one owning its rank (p mod 4)
    assert res[L] | res[R] == resident and not res[L] & res[R]
    assert all((depth[h] % 4 < 2) == (h in res[L]) for h in resident)
    for leaf, x in plan.assignment.items():
        got = t.worker_blocks(x) | t.pending_blocks(x)
        assert set(forest_path(parents, leaf)) <= got
    # pending pages are never reusable
    for x in (L, R):
        for h in t.pending_blocks(x):
            assert x not in t.holders(h)
    # merge back: the union returns; valid is whole prefixes, the rest pending
    mplan = t.reconcile_merge((L, R), P, 1000)
    assert _closed(t, t.worker_blocks(P))
    assert resident <= (mplan.valid | mplan.pending)


def test_split_default_demand_is_access_not_missed_seconds() -> None:
    """The default demand is the access counts only: a prefix with a large ``missed`` (seconds
    of benefit, another unit) but fewer accesses ranks below the more-used one."""
    t = split_setup(extra_branch=True)
    t.set_statistics(14, 4, access=3.0, missed=0.0)
    t.set_statistics(21, 4, access=1.0)
    t.set_statistics(21, 2, missed=50.0)
    plan = t.reconcile_split(P, (L, R), {L: 50, R: 50})
    # 14 (more accesses) first -> left (fewer missing pages); 21 then goes right. With missed
    # added to the weight 21 would be placed first, on the left, and 14 on the right.
    assert plan.assignment == {14: L, 21: R}
