"""A reconcile as the cache manager publishes it (``reconciled_blocks``) and as a scheduler's
replica of the trie applies it (``mark_reconciled``): after the replica also has the new
workers' own snapshots, J's ``pending_reach`` on the replica is the manager's, and the replica
forgets the pages as the manager does (a ``Stored`` event makes them valid)."""

from __future__ import annotations

import pytest
from cachemgr_support import forest_path, merged_trie, store_leaves
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from services.cachemgr.events import Snapshot, Stored
from services.cachemgr.reconcile import (
    mark_reconciled,
    pending_reach,
    reconciled_blocks,
    reconciled_parts,
)
from services.cachemgr.trie import PrefixTrie
from shared.ids import InvalidInput, UnknownWorker
from shared.schemas import ReconciledNotice, decode, encode

P, L, R = "w-cp4-g0", "w-cp2-g0", "w-cp2-g2"


def split_trie() -> PrefixTrie:
    """The manager after splitting P, which held pages 0-4 of one prefix: L keeps 10, 11 valid
    and has 12-13 pending from R's donor pages and 14 pending on its own ranks."""
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(P, 4, 100)
    t.apply(Stored(P, 1, None, (10, 11, 12, 13, 14)))
    t.reconcile_split(P, (L, R), {L: 50, R: 50})
    return t


def snapshot_of(t: PrefixTrie, worker: str) -> Snapshot:
    return Snapshot(worker, 0, tuple((h, t.parent(h)) for h in sorted(t.worker_blocks(worker))))


def replica_of(manager: PrefixTrie, workers: tuple[str, ...]) -> PrefixTrie:
    """A scheduler's replica: the new workers registered empty, their notices marked, then
    their own snapshots (the order a live scheduler usually sees them in)."""
    rep = PrefixTrie([2, 4], block_size=4)
    for w in workers:
        rep.add_worker(w, manager.worker_degree(w), manager.capacity_blocks(w))
    for w in workers:
        mark_reconciled(rep, w, reconciled_blocks(manager, w))
    for w in workers:
        rep.apply(snapshot_of(manager, w))
    return rep


def test_the_notice_lists_pending_pages_with_sources_donors_and_the_chain_above() -> None:
    t = split_trie()
    assert reconciled_blocks(t, L) == [
        (10, None, "path", None), (11, 10, "path", None),
        (12, 11, "pending", R), (13, 12, "pending", R), (14, 13, "pending", L)]
    assert reconciled_blocks(t, R) == [
        (10, None, "path", None), (11, 10, "path", None),
        (12, 11, "donor", None), (13, 12, "donor", None)]
    fresh = PrefixTrie([2, 4], block_size=4)
    fresh.add_worker("w-cp2-g4", 2, 10)
    fresh.apply(Stored("w-cp2-g4", 1, None, (1, 2)))
    assert reconciled_blocks(fresh, "w-cp2-g4") == []  # nothing pending, no donors
    with pytest.raises(UnknownWorker):
        reconciled_blocks(t, P)  # the parent is gone


def test_a_replica_with_the_notices_credits_what_the_manager_would() -> None:
    t = split_trie()
    rep = replica_of(t, (L, R))
    req = [10, 11, 12, 13, 14, 15]
    held = dict(rep.match(req).held_blocks)
    assert held == dict(t.match(req).held_blocks) == {L: 2}
    assert pending_reach(rep, req, held) == pending_reach(t, req, held) == {L: 5}
    assert rep.pending_blocks(L) == {12, 13, 14} and rep.donor_blocks(R) == {12, 13}
    # Pending pages are not held: the replica's match is unchanged by the notice.
    assert rep.holders(12) == frozenset()
    # The child's own Stored event makes them valid, in the replica as in the manager.
    for trie in (t, rep):
        trie.apply(Stored(L, 1, 11, (12, 13, 14)))
    assert rep.pending_blocks(L) == frozenset() and rep.match(req).held(L) == 5
    assert pending_reach(rep, req, {L: 5}) == {}


def test_without_the_notice_the_replica_credits_nothing() -> None:
    t = split_trie()
    rep = PrefixTrie([2, 4], block_size=4)
    for w in (L, R):
        rep.add_worker(w, 2, 50)
        rep.apply(snapshot_of(t, w))
    assert pending_reach(rep, [10, 11, 12, 13, 14], {L: 2}) == {}


def test_a_merge_notice_marks_the_pages_on_the_merged_workers_ranks() -> None:
    t = merged_trie(L, R, P)
    assert reconciled_blocks(t, P) == [
        (10, None, "path", None), (11, 10, "path", None),
        (12, 11, "pending", P), (13, 12, "pending", P)]
    rep = replica_of(t, (P,))
    req = [10, 11, 12, 13]
    assert pending_reach(rep, req, rep.match(req).held_blocks) == {P: 4}


def test_marking_is_idempotent_and_a_valid_block_stays_valid() -> None:
    t = split_trie()
    rep = replica_of(t, (L, R))
    entries = reconciled_blocks(t, L)
    again = mark_reconciled(rep, L, entries)
    # 12-14 pending again (same sources); the path blocks 10, 11 are valid: untouched.
    assert (again.pending, again.donors, again.created, again.skipped) == (3, 0, 0, 0)
    assert rep.pending_blocks(L) == {12, 13, 14} and rep.worker_blocks(L) == {10, 11}
    # A pending entry for a block the worker already has valid changes nothing.
    rep.apply(Stored(L, 1, 11, (12,)))
    mark_reconciled(rep, L, entries)
    assert 12 in rep.worker_blocks(L) and rep.pending_blocks(L) == {13, 14}


def test_entries_that_contradict_the_trie_or_hang_from_nothing_are_skipped() -> None:
    rep = PrefixTrie([2, 4], block_size=4)
    rep.add_worker(L, 2, 50)
    rep.add_worker(R, 2, 50)
    rep.apply(Stored(R, 1, None, (10, 11)))
    got = mark_reconciled(rep, L, [
        (12, 10, "pending", R),  # the trie has no 12: created under 10
        (11, 99, "path", None),  # the trie has 11 under 10, not 99: skipped ...
        (13, 11, "pending", R),  # ... with everything below it
        (20, 77, "pending", None),  # 77 neither in the trie nor listed: skipped
        (21, 20, "donor", None),
    ])
    assert (got.pending, got.donors, got.created, got.skipped) == (1, 0, 1, 4)
    assert rep.pending_blocks(L) == {12} and rep.donor_blocks(L) == frozenset()
    assert rep.parent(12) == 10 and rep.parent(11) == 10
    # A path link no worker claims is created unreferenced: collectable when the pages go.
    got = mark_reconciled(rep, L, [(30, None, "path", None), (31, 30, "donor", None)])
    assert (got.donors, got.created) == (1, 2) and rep.donor_blocks(L) == {31}


@pytest.mark.parametrize("entry", [
    (1, None, "valid", None),  # not a role
    ("1", None, "path", None),  # not a hash
    (True, None, "path", None),
    (1, "x", "path", None),
    (1, None, "pending", 7),  # not a worker id
    (1, None, "path"),  # not four fields
    "1",
])
def test_a_bad_entry_is_refused(entry: object) -> None:
    rep = PrefixTrie([2, 4], block_size=4)
    rep.add_worker(L, 2, 50)
    # Good entries before it change nothing either: the notice is refused whole.
    with pytest.raises(InvalidInput):
        mark_reconciled(rep, L, [(1, None, "path", None), (2, 1, "pending", None),
                                 entry])  # type: ignore[list-item]
    assert len(rep) == 0 and rep.pending_blocks(L) == set()


def test_an_unregistered_worker_is_refused() -> None:
    with pytest.raises(UnknownWorker):
        mark_reconciled(PrefixTrie([2, 4], block_size=4), L, [(1, None, "pending", None)])


def test_the_notice_round_trips_and_refuses_what_a_replica_could_not_apply() -> None:
    t = split_trie()
    notice = ReconciledNotice(worker=L, degree=2, epoch=3, blocks=reconciled_blocks(t, L))
    data, headers = encode(notice)
    back = decode(ReconciledNotice, data, headers)
    assert back == notice and back.blocks[2] == (12, 11, "pending", R)
    good = dict(worker=L, degree=2, epoch=1)
    for blocks, why in [
        ([(1, None, "path", None), (1, None, "path", None)], "repeats"),
        ([(2, 1, "pending", None), (1, None, "path", None)], "before its parent"),
        ([(1, None, "donor", R)], "only a pending entry"),
        ([(1, 1, "pending", None)], "its own parent"),
        ([(1, None, "valid", None)], "literal"),
        ([(1, None, "pending", "Not An Id")], "pattern"),
        ([(2**64, None, "path", None)], "less than"),
    ]:
        with pytest.raises(ValidationError, match=why):
            ReconciledNotice(**good, blocks=blocks)
    with pytest.raises(ValidationError, match="parts count from 0"):
        ReconciledNotice(**good, part=1, parts=1, blocks=[])


# --- property: whatever the split, the replica credits exactly what the manager would --------
@st.composite
def split_case(draw):
    """A forest of 24 blocks, the prefixes P caches, the requests, the children's capacities
    and whether they merge back. Biased toward what leaves pages pending (a split leaves a
    prefix's pages from the third on pending when a child has room for them; a merge of the
    split leaves those with no copy source): mostly deep chains (each block most often under
    the one before), the deepest blocks cached first, requests mostly for cached prefixes,
    capacities mostly with room for the whole forest, and mostly no merge. Shallow forests,
    small capacities and merges stay in. (Measured: with the former uniform draws 3-9 of 60
    examples had a request with a pending reach; with these, 30-48 of 60.)"""
    parents: dict[int, int | None] = {100: None}
    for h in range(101, 124):
        kind = draw(st.integers(0, 9))  # 0-5: one deeper; 6-8: under any block; 9: a root
        parents[h] = h - 1 if kind < 6 else None if kind == 9 else draw(st.integers(100, h - 1))
    deepest_first = sorted(parents, key=lambda h: (-len(forest_path(parents, h)), h))
    leaves = draw(st.lists(st.sampled_from(deepest_first), min_size=1, max_size=6))
    requests = draw(st.lists(st.one_of(st.sampled_from(leaves), st.integers(100, 123)),
                             min_size=1, max_size=6))
    cap = st.one_of(st.integers(24, 48), st.integers(2, 23))
    return parents, leaves, requests, draw(cap), draw(cap), draw(st.integers(0, 3)) == 3


@settings(max_examples=60, deadline=None)
@given(split_case())
def test_the_replica_credits_what_the_manager_would_after_any_split_or_merge(case) -> None:
    parents, leaves, requests, cap_l, cap_r, merge_back = case
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(P, 4, 1000)
    store_leaves(t, P, parents, leaves)
    t.reconcile_split(P, (L, R), {L: cap_l, R: cap_r})
    made: tuple[str, ...] = (L, R)
    if merge_back:
        t.reconcile_merge((L, R), P, 1000)
        made = (P,)
    rep = replica_of(t, made)
    for w in made:
        assert rep.pending_blocks(w) == t.pending_blocks(w)
        assert rep.donor_blocks(w) == t.donor_blocks(w)
        assert rep.worker_blocks(w) == t.worker_blocks(w)
    for leaf in requests:
        req = forest_path(parents, leaf)
        held = dict(t.match(req).held_blocks)
        assert dict(rep.match(req).held_blocks) == held
        assert pending_reach(rep, req, held) == pending_reach(t, req, held)


# --- a large reconcile in parts that each stand alone -----------------------------------------
def many_chains_split(n: int) -> PrefixTrie:
    """P held ``n`` five-block prompts of their own; split into L, R. L's notice lists path
    links above its pending pages: cut plainly, such a link ends a part childless when its
    pages come in a later one."""
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(P, 4, 10**6)
    for i in range(n):
        t.apply(Stored(P, i + 1, None, tuple(range(10 * i + 100, 10 * i + 105))))
    t.reconcile_split(P, (L, R), {L: 10**6, R: 10**6})
    return t


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64, 199, 200, 1000])
def test_parts_stand_alone_and_keep_every_entry_once(size: int) -> None:
    t = many_chains_split(40)
    entries = reconciled_blocks(t, L)
    assert len(entries) == 200  # 40 five-block chains: sizes 200 and 1000 take it whole
    parent_of = {h: p for h, p, _, _ in entries}
    parts = reconciled_parts(entries, size)
    prior: set[int] = set()
    own: list[tuple] = []
    own_ends: list[int] = []  # how many entries the parts so far have placed
    for part in parts:
        k = 0
        while k < len(part) and part[k][0] in prior:  # the links repeated from earlier parts
            k += 1
        assert all(role == "path" and src is None for _, _, role, src in part[:k])
        assert k < len(part)  # every part has entries of its own
        assert len(part) <= size or len(part) - k == 1
        listed: set[int] = set()
        for h, p, _, _ in part:
            assert p is None or p in listed  # parents first, within the part
            listed.add(h)
        own += part[k:]
        prior |= listed
        own_ends.append(len(own))
    assert own == entries
    # Every part but the last is full: its first successor's own entry, with the chain above
    # it that the part does not list yet, would have taken it past ``size``.
    for part, done in zip(parts[:-1], own_ends, strict=False):
        listed = {h for h, _, _, _ in part}
        missing, q = 0, parent_of[entries[done][0]]
        while q is not None and q not in listed:
            missing += 1
            q = parent_of[q]
        assert len(part) + missing + 1 > size, (len(part), missing, size)
    if size >= len(entries):
        assert parts == [entries]
    else:
        assert len(parts) > 1


def test_parts_refuse_a_bad_size_or_a_dangling_entry() -> None:
    for bad in (0, -1, True, 2.0):
        with pytest.raises(InvalidInput, match="max_entries"):
            reconciled_parts([], bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="not listed before it"):
        reconciled_parts([(2, 1, "path", None)], 8)
    assert reconciled_parts([], 8) == []


def test_a_collection_between_parts_loses_nothing() -> None:
    """The scheduler applies each part as it arrives, and its housekeeping collects childless
    unreferenced nodes in between: the path links an earlier part made can be gone. Each part
    repeats them, so the replica still marks everything and credits what the manager would."""
    t = many_chains_split(300)

    def replica(cut) -> tuple[PrefixTrie, int]:
        rep = PrefixTrie([2, 4], block_size=4)
        for w in (L, R):
            rep.add_worker(w, t.worker_degree(w), 10**6)
        skipped = 0
        for w in (L, R):
            for part in cut(reconciled_blocks(t, w)):
                skipped += mark_reconciled(rep, w, part).skipped
                rep.collect_unreferenced()
        for w in (L, R):
            rep.apply(snapshot_of(t, w))
        return rep, skipped

    rep, skipped = replica(lambda es: reconciled_parts(es, 64))
    assert skipped == 0
    assert rep.pending_blocks(L) == t.pending_blocks(L) and len(t.pending_blocks(L)) > 500
    for i in (0, 150, 299):
        req = list(range(10 * i + 100, 10 * i + 105))
        held = dict(t.match(req).held_blocks)
        assert pending_reach(rep, req, held) == pending_reach(t, req, held)
    # Cut plainly, the parts after the first hang from links the collection took.
    plain, skipped = replica(lambda es: [es[i:i + 64] for i in range(0, len(es), 64)])
    assert skipped > 0 and not plain.pending_blocks(L)


# --- a replica without statistics collects what no worker holds ------------------------------
def test_a_replica_drops_the_blocks_no_worker_holds_any_more() -> None:
    """``collect_unreferenced``: the scheduler's replica records no statistics and never
    scans, so without it every block ever cached would stay. It keeps every node a worker
    references (valid, pending, donor) and the chain above it, and a node with a copy in
    flight to it."""
    from services.cachemgr.actions import Replicate
    from services.cachemgr.events import Removed

    t = split_trie()  # L: 10, 11 valid, 12-14 pending; R: 12, 13 donors
    t.add_worker("w-cp2-g4", 2, 50)
    e = 0
    for i in range(50):  # another worker caches and evicts 50 prompts of its own
        hs = tuple(range(1000 + 10 * i, 1010 + 10 * i))
        e += 1
        t.apply(Stored("w-cp2-g4", e, None, hs))
        e += 1
        t.apply(Removed("w-cp2-g4", e, hs))
    assert len(t) == 5 + 500
    assert t.collect_unreferenced() == 500 and len(t) == 5
    assert t.collect_unreferenced() == 0
    # A copy in flight protects its blocks; the valid chain, pending and donors stay.
    e += 1
    t.apply(Stored("w-cp2-g4", e, None, (7, 8)))
    t._begin(Replicate(8, 2, "w-cp2-g4", R, (7, 8), "pull"))
    e += 1
    t.apply(Removed("w-cp2-g4", e, (7, 8)))
    assert t.collect_unreferenced() == 0 and {7, 8} <= set(t.node_hashes())
    assert t.replication_failed(Replicate(8, 2, "w-cp2-g4", R, (7, 8), "pull"))
    assert t.collect_unreferenced() == 2
    assert set(t.node_hashes()) == {10, 11, 12, 13, 14}
    assert pending_reach(t, [10, 11, 12, 13, 14], {L: 2}) == {L: 5}


def test_a_worker_whose_lease_lapsed_is_no_copy_source() -> None:
    """A scheduler's replica keeps a worker whose state expired (the KV does not tell of a TTL
    expiry) while the cache manager has removed it: given as ``gone``, it is no source, and
    the replica credits what the manager does."""
    t = split_trie()  # L: 12-13 pending from R's donor pages, 14 on its own ranks
    rep = replica_of(t, (L, R))
    req = [10, 11, 12, 13, 14]
    assert pending_reach(rep, req, {L: 2}) == pending_reach(t, req, {L: 2}) == {L: 5}
    t.remove_worker(R)
    assert pending_reach(t, req, {L: 2}) == {}
    assert pending_reach(rep, req, {L: 2}) == {L: 5}  # R lingers in the replica
    assert pending_reach(rep, req, {L: 2}, gone={R}) == {}
    assert pending_reach(rep, req, {L: 2}, gone={"w-cp2-g9"}) == {L: 5}
