"""The scan's fast path (``lists=False``: lazy decay and indexes) selects exactly what the full
Algorithm 2 pass selects, decays and collects the same, over random histories."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from services.cachemgr.actions import Reclaim
from services.cachemgr.events import Removed, Stored
from services.cachemgr.scan import ScanConfig
from services.cachemgr.trie import PrefixTrie
from shared.costmodel import DEFAULT_PROFILE


def _state(t: PrefixTrie) -> dict:
    out = {}
    for h in t.node_hashes():
        out[h] = (t.parent(h), t.holders(h),
                  tuple(t.access(h, c).hex() for c in t.degrees),
                  tuple(t.missed(h, c).hex() for c in t.degrees),
                  tuple(t.replica_count(h, c) for c in t.degrees))
    return out


def _history(seed: int, rounds: int):
    """Two identical tries driven through the same random history; yields at each scan."""
    rng = random.Random(seed)
    degrees = rng.choice([[2, 4], [4, 2]])  # the degree order must not matter either
    tries = [PrefixTrie(degrees, block_size=4), PrefixTrie(degrees, block_size=4)]
    workers = {f"w{i}": rng.choice([2, 4]) for i in range(rng.randint(2, 6))}
    for t in tries:
        for w, c in workers.items():
            t.add_worker(w, c, 1000)
    parents: dict[int, int | None] = {}
    for h in range(1, 60):
        parents[h] = None if h < 4 or rng.random() < 0.1 else rng.randint(1, h - 1)
    ids = dict.fromkeys(workers, 0)

    def path_of(leaf: int) -> list[int]:
        p, x = [], leaf
        while x is not None:
            p.append(x)
            x = parents[x]
        return p[::-1]

    for rnd in range(rounds):
        for _ in range(rng.randint(0, 12)):
            w = rng.choice(list(workers))
            op = rng.random()
            have = tries[0].worker_blocks(w)
            if op < 0.5:
                path = path_of(rng.randint(1, 59))
                i = 0
                while i < len(path) and path[i] in have:
                    i += 1
                if i < len(path) and all(h not in have for h in path[i:]):
                    ids[w] += 1
                    ev = Stored(w, ids[w], path[i - 1] if i else None, tuple(path[i:]))
                    for t in tries:
                        t.apply(ev)
            elif op < 0.7 and have:
                hs = tuple(rng.sample(sorted(have), rng.randint(1, min(3, len(have)))))
                ids[w] += 1
                for t in tries:
                    t.apply(Removed(w, ids[w], hs))
            else:
                path = path_of(rng.randint(1, 59))
                m = tries[0].match(path)
                held = m.held(w)
                pref = rng.choice([2, 4])
                length = len(path) * 4 + rng.randint(0, 3)
                for t in tries:
                    t.record_request(t.match(path), w, workers[w], held, pref, length,
                                     DEFAULT_PROFILE.predict_fast)
        if rng.random() < 0.1 and len(tries[0]):
            h = rng.choice(list(tries[0].node_hashes()))
            c = rng.choice([2, 4])
            a, m = rng.choice([0.0, 0.5, 5.0, 40.0]), rng.choice([0.0, 3.0, 0.2])
            for t in tries:
                t.set_statistics(h, c, access=a, missed=m)
        cfg = ScanConfig(theta_inter=rng.choice([0.0, 0.01, 0.05, 1.0]),
                         theta_intra=rng.choice([1.5, 2.0, 6.0]),
                         theta_reclaim=rng.choice([0.0, 0.5, 1.0]),
                         decay=rng.choice([0.5, 0.5, 0.7, 0.9]),
                         max_actions_per_list=rng.randint(0, 3),
                         gc_threshold=rng.choice([0.0, 1e-3, 0.3]))
        in_use = {w: [h for h in tries[0].worker_blocks(w) if rng.random() < 0.1]
                  for w in workers}
        load = {w: float(rng.randint(0, 3)) for w in workers}
        yield rnd, tries, cfg, load, in_use, ids


def _check_indexes(t: PrefixTrie) -> None:
    """The scan indexes agree with a brute-force pass over the trie."""
    nodes = list(t._nodes.values())
    assert t._unref == {n for n in nodes if n.refs == 0}
    assert t._multi == {n for n in nodes if len(n.holders) >= 2}
    th_mis, th_acc = t._hot_th
    for n in nodes:
        if n not in t._hot and n not in t._touched:
            assert max(n.missed) <= th_mis and max(n.access) <= th_acc


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10**6))
def test_fast_scan_matches_full_scan(seed: int) -> None:
    for _, (full, fast), cfg, load, in_use, ids in _history(seed, 12):
        _check_indexes(fast)
        a = full.scan(cfg, load, in_use)
        b = fast.scan(cfg, load, in_use, lists=False)
        assert a.actions == b.actions
        assert a.collected == b.collected
        assert b.inter == b.intra == b.reclaim == ()
        assert _state(full) == _state(fast)
        assert full.inflight() == fast.inflight()
        _check_indexes(fast)
        _check_indexes(full)
        # Carry the reclaims out on both, so the histories keep exercising removal.
        for act in a.actions:
            if isinstance(act, Reclaim):
                ids[act.worker] += 1
                for t in (full, fast):
                    t.apply(Removed(act.worker, ids[act.worker], act.blocks))
            else:
                for t in (full, fast):
                    t.replication_done(act)


def test_lazy_decay_reads_like_eager_decay(make_trie) -> None:
    t, f = make_trie({"a": 2})
    f.store("a", [1, 2])
    t.set_statistics(1, 2, access=3.0, missed=1.0)
    cfg = ScanConfig(1.0, 2.0, 1.0, 0.7)
    v = 3.0
    for _ in range(5):
        t.scan(cfg, lists=False)
        v *= 0.7
    assert t.access(1, 2) == v
    assert t.access(2, 2) == 0.0 and t.missed(2, 4) == 0.0
