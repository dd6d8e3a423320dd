"""The prefix trie driven as the cache manager drives it, checked against its definitions.

A hypothesis state machine runs worker caches (:class:`BlockCache`, the rank daemons' own) over
a small forest of prefixes, and the trie over what it is told: cache events delivered late,
lost (a gap: the worker goes stale until a snapshot) or twice; requests matched and recorded
(Algorithm 1), some left running with their blocks pinned, some with their prefix pulled to
their worker (services/cachemgr/pull.py); scans whose copies and reclaims are
carried out (as the simulator does, ``sim.simulator.install_copy``), fail or stay in flight;
lazy reconcile copies on reuse; splits and merges (§6.2) with their re-homing copies; workers
leaving and joining. After every step the trie must agree with its own definitions (module
docstrings of ``services/cachemgr/trie.py`` and ``reconcile.py``):

* a node's ``refs`` is the number of workers with its block valid, pending or donor; ``_unref``
  is exactly the nodes with none, and no node a worker names was collected;
* a worker's valid, pending and donor blocks are disjoint, and it has no more valid blocks
  than its capacity (what its cache index can hold);
* holders(z) = the workers with every block of the root->z path valid; ReplicaCount per degree
  and the multi-holder index follow the holders; a worker's orphans are its valid blocks whose
  parent it does not hold;
* parent and child links agree;
* a worker whose every event reached the trie (none lost since its last snapshot, none
  waiting) has exactly its cache's blocks valid: the trie claims no block the worker lacks.

It found a split giving a child more valid blocks than its capacity (its cache then refused
to adopt them) and, where running requests pin blocks, a reconcile copy that only partly fit
being confirmed whole (both fixed). ``tests/cachemgr/test_cache_reconcile.py`` and
``tests/sim/test_install_copy.py`` hold a fixed case of each.
"""

from __future__ import annotations

import random

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from services.cachemgr.actions import Reclaim, Replicate
from services.cachemgr.events import CacheEvent
from services.cachemgr.pull import PullConfig, pull_on_route
from services.cachemgr.reconcile import RehomeConfig, rehome_on_merge, rehome_on_split
from services.cachemgr.scan import ScanConfig
from services.cachemgr.trie import ApplyOutcome, PrefixTrie
from services.rankd.blockcache import BlockCache
from shared.costmodel import DEFAULT_PROFILE
from sim.simulator import install_copy

N_BLOCKS = 40
# Thresholds low enough that scans copy and reclaim often (with 4-token blocks a missed
# prefix is worth microseconds).
SCAN = ScanConfig(theta_inter=1e-9, theta_intra=0.5, theta_reclaim=0.3, decay=0.8,
                  max_actions_per_list=2, max_replications=3)
REHOME = RehomeConfig(min_blocks=3, fill=0.9)
PULL = PullConfig(min_blocks=1)


class TrieMachine(RuleBasedStateMachine):
    """Worker caches, their event streams and the trie, in step as the adapters keep them."""

    @initialize(seed=st.integers(0, 2**20), n4=st.integers(1, 3), n2=st.integers(0, 2))
    def setup(self, seed: int, n4: int, n2: int) -> None:
        rng = random.Random(seed)
        self.parents: dict[int, int | None] = {}
        for h in range(1, N_BLOCKS + 1):
            self.parents[h] = None if h <= 3 or rng.random() < 0.1 else rng.randint(1, h - 1)
        self.trie = PrefixTrie([2, 4], block_size=4)
        self.caches: dict[str, BlockCache] = {}
        self.degree: dict[str, int] = {}
        self.outbox: dict[str, list[CacheEvent]] = {}
        self.sent: dict[str, list[CacheEvent]] = {}
        self.lost: dict[str, bool] = {}
        self.flying: list[Replicate] = []
        self.running: list[tuple[str, tuple[int, ...]]] = []
        self.next_id = 0
        for c, n in ((4, n4), (2, n2)):
            for _ in range(n):
                self._join(c, rng.randint(2, 7) * c)

    # --- helpers --------------------------------------------------------------------------
    def _new_id(self) -> str:
        self.next_id += 1
        return f"w{self.next_id}"

    def _join(self, degree: int, capacity: int) -> str:
        w = self._new_id()
        self.trie.add_worker(w, degree, capacity)
        self._adopt(w, degree, capacity, ())
        return w

    def _adopt(self, w: str, degree: int, capacity: int,
               blocks: tuple[tuple[int, int | None], ...]) -> None:
        cache = BlockCache(w, capacity)
        if blocks:
            cache.adopt(list(blocks))
        self.caches[w], self.degree[w] = cache, degree
        self.outbox[w], self.sent[w], self.lost[w] = [], [], False

    def _leave(self, w: str) -> None:
        for d in (self.caches, self.degree, self.outbox, self.sent, self.lost):
            del d[w]

    def _path(self, leaf: int) -> tuple[int, ...]:
        out: list[int] = []
        x: int | None = leaf
        while x is not None:
            out.append(x)
            x = self.parents[x]
        return tuple(reversed(out))

    def _collect(self, w: str) -> None:
        self.outbox[w].extend(self.caches[w].take_events())

    def _pick(self, data: st.DataObject, degree: int | None = None) -> str | None:
        ws = sorted(w for w in self.caches if degree is None or self.degree[w] == degree)
        return data.draw(st.sampled_from(ws)) if ws else None

    def _apply(self, w: str, n: int) -> None:
        """Deliver the first ``n`` queued events of ``w`` to the trie, in order."""
        box = self.outbox[w]
        for ev in box[:n]:
            self.trie.apply(ev)
            self.sent[w].append(ev)
        del box[:n]

    def _retire(self, act: Replicate, outcome: str) -> None:
        """A copy lands (or fails) as in the simulator (``sim.simulator.install_copy``)."""
        self.flying.remove(act)
        t = self.trie
        if outcome == "fail" or act.dest not in self.caches or act.source not in self.caches:
            t.replication_failed(act)
            return
        self._apply(act.dest, len(self.outbox[act.dest]))  # its earlier events come first
        if install_copy(t, self.caches[act.dest], act) is None:
            t.replication_failed(act)  # the node was collected meanwhile
            return
        t.replication_done(act)

    # --- worker caches and their events -------------------------------------------------
    @rule(data=st.data(), leaves=st.lists(st.integers(1, N_BLOCKS), min_size=1, max_size=5))
    def requests(self, data: st.DataObject, leaves: list[int]) -> None:
        """Requests routed to workers: each matched, recorded (Algorithm 1), its lazy
        reconcile copies issued and its blocks cached there; the worker's events usually
        reach the trie at once, sometimes later (``deliver``)."""
        t = self.trie
        for leaf in leaves:
            w = self._pick(data)
            if w is None:
                return
            path = self._path(leaf)
            m = t.match(path)
            reused = data.draw(st.integers(0, m.held(w)))
            pref = data.draw(st.sampled_from([2, 4]))
            t.record_request(m, w, self.degree[w], reused, pref, len(path) * 4,
                             DEFAULT_PROFILE.predict_fast)
            self.flying.extend(t.on_reuse(w, path))
            if data.draw(st.booleans()):  # the route-time pull, as the manager issues it
                self.flying.extend(pull_on_route(t, m, w, PULL))
            # Some stay running: their cached part is pinned (not evictable) until they finish.
            running = data.draw(st.sampled_from([False, True]))
            stored = self.caches[w].insert(path, pin=running)
            if running and stored:
                self.running.append((w, path[:stored]))
            self._collect(w)
            if data.draw(st.sampled_from([True, True, True, False])):
                self._apply(w, len(self.outbox[w]))

    @precondition(lambda self: bool(self.running))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        """A running request's prefill ends: its blocks may be evicted again."""
        w, path = self.running.pop(data.draw(st.integers(0, len(self.running) - 1)))
        if w in self.caches:
            self.caches[w].unpin(path)

    @rule(data=st.data(), n=st.integers(1, 4))
    def deliver(self, data: st.DataObject, n: int) -> None:
        w = self._pick(data)
        if w is not None:
            self._apply(w, n)

    @rule(data=st.data(), kind=st.sampled_from(["lose", "duplicate", "snapshot", "remove",
                                                "clear"]))
    def fault(self, data: st.DataObject, kind: str) -> None:
        """What goes wrong between a worker and the manager, and the adapter's repair."""
        w = self._pick(data)
        if w is None:
            return
        cache = self.caches[w]
        if kind == "lose":  # an event lost on the bus: the next one shows a gap
            if self.outbox[w]:
                self.outbox[w].pop(0)
                self.lost[w] = True
        elif kind == "duplicate":  # an event delivered twice changes nothing
            if self.sent[w]:
                ev = data.draw(st.sampled_from(self.sent[w]))
                before = self.trie.last_event_id(w)
                if not self.trie.is_stale(w):
                    assert self.trie.apply(ev) is ApplyOutcome.DUPLICATE
                assert self.trie.last_event_id(w) == before
        elif kind == "snapshot":  # the adapter's answer to a gap: the worker's whole cache
            self._collect(w)
            self.trie.apply(cache.snapshot())
            self.outbox[w].clear()  # every queued event is older than the snapshot
            self.lost[w] = False
        elif kind == "remove":  # the worker drops blocks on its own (a reclaim racing it)
            leaf = data.draw(st.integers(1, N_BLOCKS))
            cache.remove(self._path(leaf)[-data.draw(st.integers(1, 3)):])
            self._collect(w)
        else:  # the worker resets its cache (its running requests' pins go with it)
            cache.clear()
            self.running = [r for r in self.running if r[0] != w]
            self._collect(w)

    # --- the manager's scan and its operations -----------------------------------------
    @rule(data=st.data())
    def scan(self, data: st.DataObject) -> None:
        res = self.trie.scan(SCAN, {}, {w: c.pinned() for w, c in self.caches.items()})
        for act in res.actions:
            if isinstance(act, Replicate):
                self.flying.append(act)
            elif isinstance(act, Reclaim):
                cache = self.caches.get(act.worker)
                if cache is None:
                    self.trie.reclaim_failed(act)
                    continue
                # The live adapter's order: the worker's events may reach the trie before or
                # after its reply is settled (reclaim_executed with the reply's count).
                gone = cache.remove(act.blocks)
                self._collect(act.worker)
                settle_first = data.draw(st.booleans())
                if settle_first:
                    self.trie.reclaim_executed(act, len(gone))
                self._apply(act.worker, len(self.outbox[act.worker]))
                if not settle_first:
                    self.trie.reclaim_executed(act, len(gone))

    @precondition(lambda self: bool(self.flying))
    @rule(data=st.data(), outcome=st.sampled_from(["done", "done", "fail"]))
    def transfer(self, data: st.DataObject, outcome: str) -> None:
        self._retire(data.draw(st.sampled_from(self.flying)), outcome)

    # --- reconfiguration and membership -------------------------------------------------
    def _reconfigure(self, old: tuple[str, ...], new: tuple[str, ...], plan_caps: dict[str, int]
                     ) -> None:
        for w in old:
            self._leave(w)
        for w in new:
            held = self.trie.held_nodes(w)
            self._adopt(w, self.trie.worker_degree(w), plan_caps[w],
                        tuple((h, self.trie.parent(h)) for h in sorted(
                            held, key=self.trie.prefix_length)))

    @rule(data=st.data(), kind=st.sampled_from(["split", "merge", "leave", "join", "donors"]),
          caps=st.tuples(st.integers(3, 12), st.integers(3, 12)))
    def membership(self, data: st.DataObject, kind: str, caps: tuple[int, int]) -> None:
        """§6.2's split and merge, a worker leaving or joining, donor pages freed."""
        t = self.trie
        if kind == "split":
            p = self._pick(data, degree=4)
            if p is None:
                return
            kids = (self._new_id(), self._new_id())
            # Each child has half the parent's GPUs, so half its blocks (as in the simulator).
            half = max(1, t.capacity_blocks(p) // 2)
            plan_caps = dict.fromkeys(kids, half)
            # The simulator re-homes the parent's long prefixes to its peers as the split starts.
            peers = [w for w, c in self.degree.items() if c == 4 and w != p]
            self.flying.extend(rehome_on_split(t, p, peers, REHOME))
            t.reconcile_split(p, kids, plan_caps)
            self._reconfigure((p,), kids, plan_caps)
        elif kind == "merge":
            twos = sorted(w for w, c in self.degree.items() if c == 2)
            if len(twos) < 2:
                return
            a, b = data.draw(st.lists(st.sampled_from(twos), min_size=2, max_size=2,
                                      unique=True))
            m = self._new_id()
            cap = t.capacity_blocks(a) + t.capacity_blocks(b)
            t.reconcile_merge((a, b), m, cap)
            self._reconfigure((a, b), (m,), {m: cap})
            # ... and, as the merged worker is exposed, copies its peers' long prefixes to it.
            peers = [w for w, c in self.degree.items() if c == 4 and w != m]
            self.flying.extend(rehome_on_merge(t, m, peers, REHOME))
        elif kind == "leave":
            w = self._pick(data)
            if w is None or len(self.caches) == 1:
                return
            before = set(t.inflight())
            cancelled = t.remove_worker(w)
            # What it cancels was in flight, and nothing in flight names it any more. Copies
            # still on the wire fail when they land (``_retire``), as in the simulator.
            assert set(cancelled) <= before
            assert all(w not in ((a.source, a.dest) if isinstance(a, Replicate) else (a.worker,))
                       for a in t.inflight())
            self._leave(w)
        elif kind == "join":
            if len(self.caches) < 6:
                c = data.draw(st.sampled_from([2, 4]))
                self._join(c, caps[0] * c // 2)
        else:
            w = self._pick(data)
            if w is not None:
                t.release_donors(w)

    # --- the definitions ----------------------------------------------------------------
    @invariant()
    def trie_matches_its_definitions(self) -> None:
        t = self.trie
        nodes = t._nodes
        named: dict[int, int] = {}
        for w in self.caches:
            v = t._workers[w]
            assert not (v.valid & v.pending.keys()) and not (v.valid & v.donors) \
                and not (v.donors & v.pending.keys()), w
            assert len(v.valid) <= v.capacity_blocks, w  # what its cache index can hold
            for h in v.valid | v.pending.keys() | v.donors:
                assert h in nodes, (w, h)  # never collected while a worker names it
                named[h] = named.get(h, 0) + 1
        assert set(t._workers) == set(self.caches)
        for h, n in nodes.items():
            assert n.refs == named.get(h, 0), h
            assert n.parent is None or n.parent.children.get(h) is n
            assert all(c.parent is n for c in n.children.values())
            path = []
            x = n
            while x is not None:
                path.append(x.hash)
                x = x.parent
            want = {w for w in self.caches if all(b in t._workers[w].valid for b in path)}
            assert n.holders == want, (h, n.holders, want)
            for i, c in enumerate(t.degrees):
                assert n.count[i] == sum(1 for w in want if self.degree[w] == c), h
        assert t._unref == {n for n in nodes.values() if n.refs == 0}
        assert t._multi == {n for n in nodes.values() if len(n.holders) >= 2}
        for w in self.caches:
            v = t._workers[w]
            assert v.orphans == {h for h in v.valid
                                 if nodes[h].parent is not None
                                 and w not in nodes[h].parent.holders}, w

    @invariant()
    def an_informed_trie_claims_only_what_the_cache_holds(self) -> None:
        for w, cache in self.caches.items():
            if self.lost[w] or self.outbox[w] or cache._events or self.trie.is_stale(w):
                continue
            assert self.trie.worker_blocks(w) == cache.blocks(), w


TrieMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                         deadline=None)
test_trie_state_machine = TrieMachine.TestCase
