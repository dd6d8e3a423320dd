"""The trie's speed paths behave exactly like the simple reference behaviour they replace.

* ``record_request`` takes the matched nodes from a fresh :class:`MatchResult` instead of looking
  every hash up again; a twin trie given the same match without its nodes (the lookup walk) must
  end in the same state, also when a garbage collection ran between the match and the record
  (the match's nodes may then be gone: the walk must be used, ending the path there).
* garbage collection (``scan.collect``) walks each collected chain upwards in one go; the set
  it removes must be the fixed point of the rule "unreferenced, childless, unprotected and cold"
  computed naively over the whole trie.
* a ``Stored`` chain's new nodes are built without ``TrieNode.__init__``: every slot must hold
  what ``__init__`` (and the updates after it) would give.
"""

from __future__ import annotations

import copy
import gc
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cachemgr import scan as scan_mod
from services.cachemgr.events import Removed, Stored
from services.cachemgr.scan import ScanConfig
from services.cachemgr.trie import MatchResult, PrefixTrie, TrieNode
from shared.costmodel import DEFAULT_PROFILE


def _state(t: PrefixTrie) -> dict:
    out = {}
    for h in t.node_hashes():
        out[h] = (t.parent(h), tuple(sorted(t.children(h))), t.holders(h),
                  tuple(t.access(h, c).hex() for c in t.degrees),
                  tuple(t.missed(h, c).hex() for c in t.degrees),
                  tuple(t.replica_count(h, c) for c in t.degrees), t._nodes[h].refs,
                  t._nodes[h].depth)
    return out


def _random_history(seed: int):
    """Random trees, workers, stores, removals, requests and scans on one trie; yields the
    trie and a request path at every step where a request is placed."""
    rng = random.Random(seed)
    t = PrefixTrie([2, 4], block_size=4)
    workers = {f"w{i}": rng.choice([2, 4]) for i in range(rng.randint(1, 5))}
    for w, c in workers.items():
        t.add_worker(w, c, 1000)
    parents: dict[int, int | None] = {}
    for h in range(1, 50):
        parents[h] = None if h < 3 or rng.random() < 0.1 else rng.randint(1, h - 1)
    ids = dict.fromkeys(workers, 0)

    def path_of(leaf: int) -> list[int]:
        p: list[int] = []
        x: int | None = leaf
        while x is not None:
            p.append(x)
            x = parents[x]
        return p[::-1]

    for _ in range(60):
        w = rng.choice(list(workers))
        op = rng.random()
        have = t.worker_blocks(w)
        if op < 0.45:
            path = path_of(rng.randint(1, 49))
            i = 0
            while i < len(path) and path[i] in have:
                i += 1
            if i < len(path) and all(h not in have for h in path[i:]):
                ids[w] += 1
                t.apply(Stored(w, ids[w], path[i - 1] if i else None, tuple(path[i:])))
        elif op < 0.7 and have:
            ids[w] += 1
            t.apply(Removed(w, ids[w], tuple(rng.sample(sorted(have),
                                                        rng.randint(1, min(4, len(have)))))))
        elif op < 0.8:
            cfg = ScanConfig(theta_inter=rng.choice([0.0, 0.05, 1.0]), theta_intra=2.0,
                             theta_reclaim=rng.choice([0.0, 0.5]),
                             decay=rng.choice([0.5, 0.9]), max_actions_per_list=0,
                             gc_threshold=rng.choice([0.0, 1e-3, 0.3]))
            t.scan(cfg, lists=rng.random() < 0.3)
        else:
            yield t, workers, path_of(rng.randint(1, 49)), rng


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6))
def test_record_request_with_match_nodes_equals_lookup_walk(seed: int) -> None:
    for t, workers, path, rng in _random_history(seed):
        m = t.match(path)
        if rng.random() < 0.3:
            # A collection between match and record: the match's nodes may be gone.
            t.scan(ScanConfig(0.0, 2.0, 0.0, 0.5, max_actions_per_list=0, gc_threshold=1.0),
                   lists=False)
        twin = copy.deepcopy(t)
        w = rng.choice(list(workers))
        reused = rng.randint(0, m.held(w))
        pref = rng.choice([2, 4])
        length = len(path) * 4 + rng.randint(-3, 3) if path else 1
        length = max(1, length)
        fast = m  # with its nodes: the speed path (when nothing was collected since)
        plain = MatchResult(m.path, m.held_blocks)  # no nodes: the lookup walk
        r1 = t.record_request(fast, w, workers[w], reused, pref, length,
                              DEFAULT_PROFILE.predict_fast)
        r2 = twin.record_request(plain, w, workers[w], reused, pref, length,
                                 DEFAULT_PROFILE.predict_fast)
        assert r1 == r2
        assert _state(t) == _state(twin)
        assert {n.hash for n in t._touched} == {n.hash for n in twin._touched}


def test_record_request_after_a_collection_took_matched_nodes_walks_the_live_ones() -> None:
    """The case the random histories reach only now and then, built on purpose: between the
    match and the record a collection removes matched nodes 2 and 3, and 2 is stored again
    (a new node of the same hash). The record must count the live chain (1, new 2), not the
    match's stale nodes."""
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker("a", 4, 100)
    t.add_worker("b", 2, 100)
    t.apply(Stored("a", 1, None, (1, 2, 3)))
    t.apply(Stored("b", 1, None, (1,)))
    t.apply(Removed("a", 2, (2, 3)))  # 2 and 3: unreferenced, cold, still in the trie
    m = t.match([1, 2, 3])
    assert m.path == (1, 2, 3) and dict(m.held_blocks) == {"a": 1, "b": 1}
    stale = t._nodes[2]
    collected = scan_mod.collect(t, 1.0)
    assert collected == 2 and 2 not in t._nodes and 3 not in t._nodes
    t.apply(Stored("b", 2, 1, (2,)))  # 2 again, a new node, held by b (degree 2) only
    assert t._nodes[2] is not stale
    twin = copy.deepcopy(t)

    def per_token(r: int, p: int, c: int) -> float:  # Ê = R seconds: a block saves 4.0
        return float(r)

    # b (degree 2) reuses 1 block; preferred degree 4; 16 tokens (4 blocks).
    r1 = t.record_request(m, "b", 2, 1, 4, 16, per_token)
    r2 = twin.record_request(MatchResult(m.path, m.held_blocks), "b", 2, 1, 4, 16, per_token)
    # By hand: access[1, C=2] += 1; at degree 4 node 1 has a replica (a), new 2 has none:
    # missed[2, C=4] += Ê(16 - 4, 4) - Ê(16 - 8, 8) = 12 - 8 = 4; 3 is gone, the path ends.
    assert (r1.accessed_nodes, r1.missed_nodes, r1.missed_benefit) == (1, 1, 4.0)
    assert r2 == r1
    assert t.access(1, 2) == 1.0 and t.access(1, 4) == 0.0 and t.access(2, 2) == 0.0
    assert t.missed(1, 4) == 0.0 and t.missed(2, 4) == 4.0
    assert stale._acc is None and stale._mis is None  # the collected node was not written
    assert _state(t) == _state(twin)
    assert {n.hash for n in t._touched} == {n.hash for n in twin._touched}


def _reference_collect(t: PrefixTrie, threshold: float) -> set[int]:
    """The hashes garbage collection must remove: the naive fixed point over every node."""
    protected: set[int] = set()
    for acts in t._replicating.values():
        for a in acts.values():
            protected.add(a.node_hash)
            protected.update(a.blocks)
    for racts in t._reclaiming.values():
        for r in racts.values():
            protected.update(r.blocks)
    alive = set(t._nodes)
    kids = {h: set(n.children) for h, n in t._nodes.items()}
    while True:
        drop = {h for h in alive
                if not (kids[h] & alive) and t._nodes[h].refs == 0 and h not in protected
                and max(t._nodes[h].access) < threshold and max(t._nodes[h].missed) < threshold}
        if not drop:
            return set(t._nodes) - alive
        alive -= drop


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from([0.0, 1e-3, 0.3, 5.0]))
def test_collect_removes_the_naive_fixed_point(seed: int, threshold: float) -> None:
    for t, _, _, rng in _random_history(seed):
        if rng.random() < 0.5:
            continue
        ref = copy.deepcopy(t)
        expected = _reference_collect(ref, threshold)
        before = set(t._nodes)
        n = scan_mod.collect(t, threshold)
        assert before - set(t._nodes) == expected
        assert n == len(expected)
        for h, node in t._nodes.items():
            assert all(c in t._nodes for c in node.children)
            assert node.parent is None or node.parent.children[h] is node
        assert t._unref == {x for x in t._nodes.values() if x.refs == 0}


def test_stored_chain_nodes_equal_init_built_nodes() -> None:
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker("a", 4, 100)
    t.add_worker("b", 2, 100)
    t.apply(Stored("a", 1, None, (1, 2, 3)))
    t.apply(Stored("b", 1, None, (1,)))
    t.apply(Stored("b", 2, 1, (7, 8)))  # hangs under a held block: held
    t.apply(Removed("a", 2, (2, 3)))
    t.apply(Stored("a", 3, 1, (2, 9)))  # 2 exists again under 1; 9 is new
    # What the script above leaves, worked out by hand from its events:
    # hash: (parent, depth, workers holding it valid, children)
    expected = {
        1: (None, 0, {"a", "b"}, {2, 7}),
        2: (1, 1, {"a"}, {3, 9}),  # removed by a, then stored again under a's held 1
        3: (2, 2, set(), set()),  # removed by a: unreferenced, not yet collected
        7: (1, 1, {"b"}, {8}),  # under b's held 1: held
        8: (7, 2, {"b"}, set()),
        9: (2, 2, {"a"}, set()),  # new, under 2, which a holds again: held
    }
    degree_of = {"a": 4, "b": 2}
    assert set(t._nodes) == set(expected)
    for h, (parent, depth, holders, children) in expected.items():
        n = t._nodes[h]
        ref = TrieNode(h, None if parent is None else t._nodes[parent], len(t.degrees),
                       t._decays)
        assert ref.depth == depth
        ref.refs = len(holders)  # no pending or donor blocks in this script
        for w in holders:
            ref.holders.add(w)
            ref.count[t.degrees.index(degree_of[w])] += 1
        ref.children.update({c: t._nodes[c] for c in children})
        for slot in TrieNode.__slots__:
            assert getattr(n, slot) == getattr(ref, slot), (h, slot)


def _live_trie_nodes() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is TrieNode)


def _two_workers_trie() -> PrefixTrie:
    t = PrefixTrie((2, 4), block_size=4)
    t.add_worker("a", 2, 100)
    t.add_worker("b", 4, 100)
    t.apply(Stored("a", 1, None, (1, 2, 3)))
    t.apply(Stored("b", 1, None, (1, 2, 4)))
    return t


def test_a_released_trie_is_freed_without_the_cyclic_collector() -> None:
    """A node and its children reference each other; :meth:`PrefixTrie.release` (a finished
    simulation's, sim.experiments.run_deployment) unlinks them, so its nodes are freed by
    reference counting at once, with the cyclic collector off. (Counted as live TrieNodes,
    not as what a collection finds: other threads' garbage does not count.)"""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        before = _live_trie_nodes()
        t = _two_workers_trie()
        assert _live_trie_nodes() == before + 4
        kept = t._nodes[2]  # a node someone still holds keeps all but its children
        assert set(kept.children) == {3, 4}
        t.release()
        assert _live_trie_nodes() == before + 2  # it and its parent; 3 and 4 are gone
        assert kept.children == {} and kept.hash == 2 and kept.holders == {"a", "b"}
        # As new: no node, no worker; a match made before it is no longer trusted.
        assert len(t) == 0 and t.workers() == () and t.match([1, 2]).path == ()
        t.add_worker("a", 2, 100)
        t.apply(Stored("a", 1, None, (7,)))
        assert list(t.node_hashes()) == [7]
        t.release()  # twice is fine
        del t
        assert _live_trie_nodes() == before + 2
    finally:
        if was:
            gc.enable()


def test_dropping_a_trie_runs_no_code_of_it() -> None:
    """Dropping a trie does no work of its own (no ``__del__``): an exception raised there
    -- a Ctrl-C during a loop over ~55k nodes -- would be printed and swallowed ("Exception
    ignored in: PrefixTrie.__del__") and the run would go on. A trie not released is left
    to the collector: a node someone holds keeps its children."""
    t = _two_workers_trie()
    kept = t._nodes[2]
    del t
    assert set(kept.children) == {3, 4}


class _InterruptingChildren(dict):  # type: ignore[type-arg]
    """A node's children whose unlinking is interrupted (as by Ctrl-C)."""

    def clear(self) -> None:
        raise KeyboardInterrupt


def test_an_interrupt_while_a_trie_is_released_propagates() -> None:
    """The release runs as ordinary code: a KeyboardInterrupt raised during it reaches the
    caller (``simulate`` stops, exit 130) instead of being swallowed."""
    t = _two_workers_trie()
    t._nodes[2].children = _InterruptingChildren(t._nodes[2].children)
    with pytest.raises(KeyboardInterrupt):
        t.release()
