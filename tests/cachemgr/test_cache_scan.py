"""Algorithm 2 (lists, decay), §7.2 selection, confirmation, reclamation safety, GC."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cachemgr.actions import Reclaim, Replicate
from services.cachemgr.events import Removed, Stored
from services.cachemgr.scan import ScanConfig
from services.cachemgr.trie import PrefixTrie
from shared.ids import InvalidInput


def replicas(res) -> tuple:
    return tuple(a for a in res.actions if isinstance(a, Replicate))


def cfg(**kw) -> ScanConfig:
    base = dict(theta_inter=1.0, theta_intra=2.0, theta_reclaim=1.0, decay=0.5,
                max_actions_per_list=0)
    base.update(kw)
    return ScanConfig(**base)


def test_config_validation() -> None:
    with pytest.raises(InvalidInput, match="theta_reclaim"):
        ScanConfig(1.0, 1.0, 1.0, 0.5)
    for d in (0.0, 1.0, 1.5):
        with pytest.raises(InvalidInput, match="decay"):
            ScanConfig(1.0, 2.0, 1.0, d)
    with pytest.raises(InvalidInput):
        ScanConfig(-1.0, 2.0, 1.0, 0.5)
    with pytest.raises(InvalidInput):
        ScanConfig(1.0, 2.0, 1.0, 0.5, max_actions_per_list=-1)


def test_algorithm2_lists_and_decay(make_trie) -> None:
    t, f = make_trie({"a": 2, "b": 2, "c": 4})
    f.store("a", [1, 2, 3])
    f.store("b", [1])
    t.set_statistics(1, 2, access=5.0)  # r = 2: 5 > 2·2 -> intra
    t.set_statistics(2, 2, access=0.5)  # r = 1: 0.5 < 1·1 -> reclaim
    t.set_statistics(3, 2, access=1.5)  # r = 1: neither
    t.set_statistics(1, 4, missed=3.0)  # r = 0: 3 > 1 -> inter
    t.set_statistics(2, 4, missed=0.5)  # r = 0: not > 1
    t.set_statistics(3, 4, missed=2.0, access=7.0)  # inter (access is ignored when r = 0)
    res = t.scan(cfg())
    assert {(c.node_hash, c.degree) for c in res.inter} == {(1, 4), (3, 4)}
    assert {(c.node_hash, c.degree) for c in res.intra} == {(1, 2)}
    assert {(c.node_hash, c.degree) for c in res.reclaim} == {(2, 2)}
    assert res.actions == ()  # bound 0: lists only
    # Lines 12-14: every statistic scaled by the decay.
    assert t.access(1, 2) == 2.5 and t.access(2, 2) == 0.25 and t.access(3, 4) == 3.5
    assert t.missed(1, 4) == 1.5 and t.missed(3, 4) == 1.0 and t.missed(2, 4) == 0.25


def test_inter_ranked_by_missed_per_copied_block(make_trie) -> None:
    t, f = make_trie({"a": 2, "c": 4})
    f.store("a", [1, 2, 3])
    t.set_statistics(1, 4, missed=1.2)  # 1.2 per block (footprint 1)
    t.set_statistics(3, 4, missed=2.5)  # 2.5 / 3 blocks = 0.83 per block
    res = t.scan(cfg(max_actions_per_list=1))
    assert res.actions == (Replicate(1, 4, "a", "c", (1,), "inter"),)
    t2, f2 = make_trie({"a": 2, "c": 4})
    f2.store("a", [1, 2, 3])
    t2.set_statistics(1, 4, missed=1.2)
    t2.set_statistics(3, 4, missed=4.0)  # 1.33 per block now
    res2 = t2.scan(cfg(max_actions_per_list=1))
    assert res2.actions == (Replicate(3, 4, "a", "c", (1, 2, 3), "inter"),)


def test_destination_prefers_retained_path_then_capacity_then_load(make_trie) -> None:
    t, f = make_trie({"a": 2, "c": 4, "d": 4, "e": 4})
    f.store("a", [1, 2, 3])
    f.store("c", [1])
    t.set_statistics(3, 4, missed=9.0)
    load = {"c": 50.0, "d": 5.0, "e": 1.0}
    res = t.scan(cfg(max_actions_per_list=1), load=load)
    # c retains block 1 of the path: footprint 2, chosen despite its load; only the missing
    # blocks travel, from the only holder (an inter copy may use any degree).
    assert replicas(res) == (Replicate(3, 4, "a", "c", (2, 3), "inter"),)

    t2 = PrefixTrie([2, 4], block_size=4)
    t2.add_worker("a", 2, 100)
    t2.add_worker("c", 4, 2)
    t2.add_worker("d", 4, 100)
    t2.add_worker("e", 4, 100)
    t2.apply(Stored("a", 1, None, (1, 2, 3)))
    t2.apply(Stored("c", 1, None, (1,)))
    t2.set_statistics(3, 4, missed=9.0)
    # c pins its block 1 for a running request: 2 - 1 = 1 block of room < footprint 2.
    res2 = t2.scan(cfg(max_actions_per_list=1), load=load, in_use={"c": [1]})
    assert replicas(res2) == (Replicate(3, 4, "a", "e", (1, 2, 3), "inter"),)  # lower load


def test_intra_source_is_least_loaded_same_degree_holder(make_trie) -> None:
    t, f = make_trie({"a": 2, "b": 2, "x": 4, "d": 2})
    f.store("a", [1, 2])
    f.store("b", [1, 2])
    f.store("x", [1, 2])
    t.set_statistics(2, 2, access=10.0)  # r = 2: 10 > 4 -> intra
    t.set_statistics(1, 2, access=1.5)  # neither list
    res = t.scan(cfg(max_actions_per_list=1), load={"a": 3.0, "b": 1.0, "x": 0.0})
    assert replicas(res) == (Replicate(2, 2, "b", "d", (1, 2), "intra"),)


def test_intra_near_ties_prefer_smaller_footprint(make_trie) -> None:
    def run(acc_y: float):
        t, f = make_trie({"a": 2, "b": 2})
        f.store("a", [1, 2, 3])
        f.store("a", [5, 6])
        f.store("b", [5])
        for h in (1, 2, 5):
            t.set_statistics(h, 2, access=1.5)
        t.set_statistics(3, 2, access=10.0)  # X: footprint 3 at b
        t.set_statistics(6, 2, access=acc_y)  # Y: footprint 1 at b
        res = t.scan(cfg(max_actions_per_list=1))
        if replicas(res)[0].node_hash == 6:
            # b's block 5 is a reclaim candidate, but pinned while a copy builds on it.
            assert not [a for a in res.actions if isinstance(a, Reclaim) and a.worker == "b"]
        return replicas(res)

    assert run(9.8) == (Replicate(6, 2, "a", "b", (6,), "intra"),)  # within 5%: smaller copy
    assert run(5.0) == (Replicate(3, 2, "a", "b", (1, 2, 3), "intra"),)  # clear winner


def test_intra_copies_a_hot_chain_whole(make_trie) -> None:
    # Algorithm 1 counts an access on every node of a reused path, so a hot prefix's ancestors
    # tie with it; its first block (footprint 1) must not win the scan's copy alone.
    def run(acc_tail: float):
        t, f = make_trie({"a": 2, "b": 2, "c": 2})
        f.store("a", [1, 2, 3])
        f.store("b", [1, 2, 3])
        t.set_statistics(1, 2, access=10.0)
        t.set_statistics(2, 2, access=10.0)
        t.set_statistics(3, 2, access=acc_tail)
        return replicas(t.scan(cfg(max_actions_per_list=1), load={"a": 1.0}))

    assert run(10.0) == (Replicate(3, 2, "b", "c", (1, 2, 3), "intra"),)
    assert run(9.6) == (Replicate(3, 2, "b", "c", (1, 2, 3), "intra"),)  # within near_tie
    # Half the demand stops at block 2: the chain ends there (block 3 is a weaker candidate).
    assert run(4.5) == (Replicate(2, 2, "b", "c", (1, 2), "intra"),)

    # The whole chain fits nowhere: the longest part that fits is copied instead.
    t = PrefixTrie([2, 4], block_size=4)
    for w, cap in (("a", 100), ("b", 100), ("c", 2)):
        t.add_worker(w, 2, cap)
    for w in ("a", "b"):
        t.apply(Stored(w, 1, None, (1, 2, 3)))
    for h in (1, 2, 3):
        t.set_statistics(h, 2, access=10.0)
    assert replicas(t.scan(cfg(max_actions_per_list=1), load={"a": 1.0})) == (
        Replicate(2, 2, "b", "c", (1, 2), "intra"),)


def test_bound_per_list(make_trie) -> None:
    t, f = make_trie({"a": 2, "c": 4, "d": 4})
    for h in range(10, 15):
        f.store("a", [h])
        t.set_statistics(h, 4, missed=5.0 + h)
    assert len(t.scan(cfg(max_actions_per_list=2)).actions) == 2
    assert len(t.scan(cfg(max_actions_per_list=0)).actions) == 0


def test_one_replication_per_scan_across_both_lists(make_trie) -> None:
    """§8: the dispatcher starts at most one transfer per scan. With an inter and an intra
    candidate and one action per list, the lists alone would start two copies; the shared
    bound keeps the first (inter ranks first) and leaves reclamation alone."""

    def scan(**kw):
        t, f = make_trie({"a": 2, "b": 2, "d": 2, "c": 4})
        f.store("a", [1, 2])
        f.store("b", [1, 2])
        f.store("a", [7])
        f.store("b", [7])
        t.set_statistics(2, 2, access=10.0)  # r = 2: 10 > 2·2 -> intra
        t.set_statistics(1, 4, missed=3.0)  # r = 0 at degree 4 -> inter
        t.set_statistics(7, 2, access=0.1)  # r = 2, cold -> reclaim
        return t.scan(cfg(max_actions_per_list=1, **kw))

    both = scan()
    assert sorted(a.kind for a in replicas(both)) == ["inter", "intra"]
    one = scan(max_replications=1)
    assert [a.kind for a in replicas(one)] == ["inter"]
    assert [a for a in one.actions if isinstance(a, Reclaim)]  # not a replication: unbounded
    none = scan(max_replications=0)
    assert replicas(none) == () and [a for a in none.actions if isinstance(a, Reclaim)]
    with pytest.raises(InvalidInput, match="max_replications"):
        cfg(max_replications=-1)


def test_replica_visible_only_after_destination_confirms(make_trie) -> None:
    t, f = make_trie({"a": 2, "c": 4})
    f.store("a", [1, 2])
    t.set_statistics(2, 4, missed=9.0)
    (act,) = t.scan(cfg(max_actions_per_list=1)).actions
    assert act == Replicate(2, 4, "a", "c", (1, 2), "inter")
    assert t.replica_count(2, 4) == 0 and t.match([1, 2]).held_blocks == {"a": 2}
    assert t.inflight() == (act,)
    # The next scan does not issue the same copy again (missed still above θ after decay).
    t.set_statistics(2, 4, missed=9.0)
    assert t.scan(cfg(max_actions_per_list=1)).actions == ()
    # Transfer done but not yet reported: still invisible.
    t.apply(Stored("c", 1, None, (1, 2)))  # the destination's own confirmation
    assert t.replica_count(2, 4) == 1 and t.match([1, 2]).held_blocks == {"a": 2, "c": 2}
    assert t.inflight() == ()
    assert t.replication_done(act) is False  # already retired by the event


def test_failed_replication_can_be_issued_again(make_trie) -> None:
    t, f = make_trie({"a": 2, "c": 4})
    f.store("a", [1])
    t.set_statistics(1, 4, missed=9.0)
    (act,) = t.scan(cfg(max_actions_per_list=1)).actions
    assert t.replication_failed(act) is True and t.inflight() == ()
    t.set_statistics(1, 4, missed=9.0)
    assert t.scan(cfg(max_actions_per_list=1)).actions == (act,)


def test_reclaim_rules(make_trie) -> None:
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker("a", 2, 10)
    t.add_worker("b", 2, 4)
    t.add_worker("c", 4, 100)
    t.apply(Stored("a", 1, None, (1, 2)))
    t.apply(Stored("b", 1, None, (1, 2)))
    t.apply(Stored("c", 1, None, (1,)))
    res = t.scan(cfg(max_actions_per_list=3))
    assert {(c.node_hash, c.degree) for c in res.reclaim} == {(1, 2), (2, 2), (1, 4)}
    # (1, 2): both holders keep 2 below 1 -> not removable. (1, 4): c's copy, 3 holders -> ok.
    # (2, 2): b has the higher pressure (2/4 > 2/10); 1 follows it up the chain (b keeps
    # nothing else below 1, and a still holds 1 after c's and b's copies go).
    assert res.actions == (Reclaim("c", 1, (1,)), Reclaim("b", 2, (2, 1)))
    # Holder metadata changes only on the worker's Removed event.
    assert t.holders(1) == {"a", "b", "c"}
    t.apply(Removed("b", 2, (2, 1)))
    assert t.holders(1) == {"a", "c"} and t.inflight() == (Reclaim("c", 1, (1,)),)


def test_reclaim_skips_in_use_and_last_replica(make_trie) -> None:
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker("a", 2, 10)
    t.add_worker("b", 2, 4)
    t.apply(Stored("a", 1, None, (1, 2)))
    t.apply(Stored("b", 1, None, (1, 2)))
    res = t.scan(cfg(max_actions_per_list=3), in_use={"b": [2]})
    assert res.actions == (Reclaim("a", 2, (2, 1)),)  # b is pinned; a is the other holder
    t2, f2 = make_trie({"a": 2})
    f2.store("a", [1, 2])
    assert t2.scan(cfg(max_actions_per_list=3)).actions == ()  # never the last replica


def test_a_reclaim_the_worker_could_not_finish_leaves_the_flight(make_trie) -> None:
    """The live scan passes no pins (the worker skips what is pinned), so a reclaim may find
    a block it must keep. Settled with the reply's count (``reclaim_executed``): nothing
    removed retires it at once; a partial one waits for the Removed events of what went
    only. Before, both stayed in flight for as long as the kept blocks stayed cached: never
    chosen again, no copy source, and counted as gone in the last-replica check."""
    from services.rankd.blockcache import BlockCache

    t = PrefixTrie([2, 4], block_size=4)
    caches = {w: BlockCache(w, 10) for w in ("a", "b")}
    for w, c in caches.items():
        t.add_worker(w, 2, 10)
        c.insert((1, 2, 3))
    caches["a"].insert((7,))  # a's pressure is higher: its copy is the one reclaimed
    for c in caches.values():
        for ev in c.take_events():
            t.apply(ev)
    caches["a"].pin((1, 2, 3))  # a running request at a holds the prefix
    (rec,) = [x for x in t.scan(cfg(max_actions_per_list=1)).actions if isinstance(x, Reclaim)]
    assert (rec.worker, rec.blocks) == ("a", (3, 2, 1))
    assert caches["a"].remove(rec.blocks) == ()  # the worker keeps them all
    assert t.reclaim_executed(rec, 0) and t.inflight() == ()
    caches["a"].unpin((1, 2, 3))
    (again,) = [x for x in t.scan(cfg(max_actions_per_list=1)).actions
                if isinstance(x, Reclaim)]
    assert again == rec  # chosen again once the pin is gone
    # Partial: block 2 gains a child at a before the command lands; only 3 can go.
    caches["a"].insert((1, 2, 9))
    gone = caches["a"].remove(again.blocks)
    assert gone == (3,)
    assert t.reclaim_executed(again, len(gone))
    assert t.inflight() == (Reclaim("a", 3, (3,)),)  # waits for the Removed event of 3 only
    for ev in caches["a"].take_events():
        t.apply(ev)
    assert t.inflight() == ()
    assert not t.reclaim_executed(again, 1)  # no longer in flight


def test_source_of_inflight_copy_is_not_reclaimed(make_trie) -> None:
    t, f = make_trie({"a": 2, "b": 2, "c": 4})
    f.store("a", [1])
    f.store("b", [1])
    t.set_statistics(1, 4, missed=9.0)
    t.set_statistics(1, 2, access=0.5)  # r = 2: 0.5 < 2 -> reclaim candidate
    res = t.scan(cfg(max_actions_per_list=1), load={"a": 0.0, "b": 1.0})
    rep = [a for a in res.actions if isinstance(a, Replicate)]
    rec = [a for a in res.actions if isinstance(a, Reclaim)]
    assert rep == [Replicate(1, 4, "a", "c", (1,), "inter")]
    assert rec == [Reclaim("b", 1, (1,))]  # a is pinned as the copy's source


def test_gc_collects_unreferenced_cold_nodes_only(make_trie) -> None:
    t, f = make_trie({"a": 2, "b": 2})
    f.store("a", [1, 2, 3])
    f.store("b", [1, 7])
    t.apply(Removed("a", 2, (3, 2)))  # 2 and 3 now unreferenced
    t.set_statistics(2, 2, access=5.0)
    res = t.scan(cfg(gc_threshold=0.01))
    assert res.collected == 1 and 3 not in t and 2 in t  # 2 still carries demand
    t.set_statistics(2, 2, access=0.0)
    t.apply(Removed("b", 2, (1,)))  # 1 unreferenced but 7 (an orphan at b) hangs below it
    res = t.scan(cfg(gc_threshold=0.01))
    assert 2 not in t and 1 in t and 7 in t


# --- properties ----------------------------------------------------------------------------
@st.composite
def random_pool(draw):
    rng = random.Random(draw(st.integers(0, 10**6)))
    t = PrefixTrie([2, 4], block_size=4)
    workers = {f"w{i}": rng.choice([2, 4]) for i in range(draw(st.integers(2, 6)))}
    for w, c in workers.items():
        t.add_worker(w, c, rng.randint(3, 30))
    parents: dict[int, int | None] = {}
    for h in range(1, 25):
        parents[h] = None if h < 3 or rng.random() < 0.15 else rng.randint(1, h - 1)
    ids = dict.fromkeys(workers, 0)
    for _ in range(draw(st.integers(1, 25))):
        w = rng.choice(list(workers))
        leaf = rng.randint(1, 24)
        path = []
        x: int | None = leaf
        while x is not None:
            path.append(x)
            x = parents[x]
        path.reverse()
        have = t.worker_blocks(w)
        i = 0
        while i < len(path) and path[i] in have:
            i += 1
        if i < len(path):
            ids[w] += 1
            t.apply(Stored(w, ids[w], path[i - 1] if i else None, tuple(path[i:])))
    for h in list(t.node_hashes()):
        for c in (2, 4):
            t.set_statistics(h, c, access=rng.choice([0.0, 0.5, 3.0, 20.0]),
                             missed=rng.choice([0.0, 2.0, 30.0]))
    in_use = {w: [h for h in t.worker_blocks(w) if rng.random() < 0.2] for w in workers}
    load = {w: rng.random() * 10 for w in workers}
    return t, in_use, load


@settings(max_examples=60, deadline=None)
@given(random_pool(), st.integers(1, 4))
def test_scan_never_strands_never_takes_last_replica_never_shows_unconfirmed(pool, k) -> None:
    t, in_use, load = pool
    before = {h: t.holders(h) for h in t.node_hashes()}
    res = t.scan(ScanConfig(1.0, 2.0, 1.0, 0.5, max_actions_per_list=k), load=load,
                 in_use=in_use)
    # Scanning changes no holder (replicas appear only on confirmation).
    assert all(t.holders(h) == before[h] for h in t.node_hashes())
    removed: dict[int, set[str]] = {}
    for a in res.actions:
        if isinstance(a, Reclaim):
            valid = t.worker_blocks(a.worker)
            assert a.node_hash == a.blocks[0]
            for h in a.blocks:
                assert a.worker in before[h]
                assert h not in set(in_use.get(a.worker, ()))
                # no retained child outside the removed set: nothing stranded
                assert all(c not in valid or c in a.blocks for c in t.children(h))
                removed.setdefault(h, set()).add(a.worker)
        else:
            assert a.dest not in before[a.node_hash]
            assert a.source in before[a.node_hash]
            dest_has = t.worker_blocks(a.dest)
            path = []
            x: int | None = a.node_hash
            while x is not None:
                path.append(x)
                x = t.parent(x)
            assert a.blocks == tuple(h for h in reversed(path) if h not in dest_has)
            assert t.worker_degree(a.dest) == a.degree
            if a.kind == "intra":
                assert t.worker_degree(a.source) == a.degree
    for h, ws in removed.items():
        assert before[h] - ws, f"last replica of {h} reclaimed"
