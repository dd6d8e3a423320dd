"""The simulator's landing of a copy (``sim.simulator.install_copy``) keeps the trie truthful.

A copy arrives at a worker whose pinned blocks (running requests) leave room for only part of
the path: the trie must then list exactly what the worker's cache holds, not the whole copy.
"""

from __future__ import annotations

from services.cachemgr.actions import Replicate
from services.cachemgr.events import Stored
from services.cachemgr.trie import PrefixTrie
from services.rankd.blockcache import BlockCache
from sim.simulator import install_copy

P, L, R = "w-cp4-g0", "w-cp2-g0", "w-cp2-g2"
CHAIN = (1, 2, 3, 4, 5, 6)


def _split_with_pending() -> tuple[PrefixTrie, BlockCache]:
    """A CP4 parent holding CHAIN splits; the left child (pages 0, 1 valid; 2-5 pending: two
    from the right child, two resident) gets a cache with capacity 8 seeded from the trie."""
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(P, 4, 16)
    t.apply(Stored(P, 1, None, CHAIN))
    t.reconcile_split(P, (L, R), {L: 8, R: 8})
    assert t.worker_blocks(L) == {1, 2} and t.pending_blocks(L) == {3, 4, 5, 6}
    cache = BlockCache(L, 8)
    cache.adopt([(h, t.parent(h)) for h in sorted(t.held_nodes(L), key=t.prefix_length)])
    return t, cache


def test_a_partly_installed_reconcile_copy_confirms_only_what_the_cache_holds() -> None:
    t, cache = _split_with_pending()
    cache.insert((30, 31, 32, 33, 34), pin=True)  # a running request: 7 of 8 blocks in use
    for ev in cache.take_events():
        t.apply(ev)
    acts = t.on_reuse(L, CHAIN)
    assert {a.blocks for a in acts} == {(3, 4), (5, 6)}
    for act in acts:
        assert install_copy(t, cache, act) == 3  # pages 0-2: one more block fits
        t.replication_done(act)
    assert cache.blocks() == {1, 2, 3, 30, 31, 32, 33, 34}
    assert t.worker_blocks(L) == cache.blocks()  # no page the worker lacks
    assert t.match(CHAIN).held(L) == 3
    assert t.pending_blocks(L) == {4, 5, 6}  # still to come, on a later reuse


def test_a_whole_copy_is_confirmed_by_the_workers_own_event() -> None:
    t, cache = _split_with_pending()
    acts = t.on_reuse(L, CHAIN)
    for act in acts:
        assert install_copy(t, cache, act) in (4, 6)
        t.replication_done(act)
    assert t.worker_blocks(L) == cache.blocks() == set(CHAIN)
    assert t.pending_blocks(L) == frozenset() and t.match(CHAIN).held(L) == 6


def test_a_collected_node_changes_nothing() -> None:
    t, cache = _split_with_pending()
    # A copy of a node the trie no longer has (a scan collected it while the copy was on the
    # wire).
    act = Replicate(node_hash=99, degree=2, source=R, dest=L, blocks=(99,), kind="intra")
    before = cache.blocks()
    assert install_copy(t, cache, act) is None
    assert cache.blocks() == before and cache.take_events() == []
