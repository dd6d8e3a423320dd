"""``sglang``: SGLang's cache-aware router over homogeneous CP4 workers (§9.1).

Source: SGLang router / model gateway ``cache_aware`` policy
(``sgl-model-gateway/src/policies/cache_aware.rs``; peer-routing.md, "SGLang router"):

1. **Imbalance check** on in-flight requests per worker (incremented at routing, decremented on
   completion — here the worker's unfinished count): imbalanced iff
   ``max − min > balance_abs_threshold`` AND ``max > balance_rel_threshold · min``; then route to
   the least-loaded worker (first in view order among equals).
2. Otherwise **prefix match** on the router's *approximate* per-worker radix trees, built only
   from its own routing decisions (each routed request is inserted into the chosen worker's tree
   at routing time, in both branches). ``match_rate = matched / request length``; if
   ``match_rate > cache_threshold`` route to the best-matching worker (ties: arbitrary in SGLang,
   here drawn with the seeded rng), else to the worker with the **smallest tree** (first in view
   order among equals).
3. **Eviction**: every ``eviction_interval_s`` each tree larger than ``max_tree_blocks`` drops
   least-recently-used leaves down to it.

Defaults: cache_threshold 0.5, balance_abs_threshold 32, balance_rel_threshold 1.1,
eviction_interval_secs 30, max_tree_size 10,000 nodes of 16 tokens. Our tree nodes are cache
blocks of the view's block size B, so the tree budget keeps the same *token* budget:
10,000 × 16 / B blocks, ≈ 312 for the traces' 512-token blocks (peer-routing.md)
(:meth:`SglangPolicy.tree_budget_blocks`; ``max_tree_blocks`` fixes it instead).
``unbounded=True`` is the variant without eviction; report the stronger.

Tree nodes are chained block hashes (equal hash ⇔ equal prefix), so a worker's tree is the set of
hashes inserted for it, with parent links for leaf-first eviction. The approximate trees decide
routing only; the prefix actually reused (P) is what the chosen worker really holds
(``held_blocks``). Eviction runs lazily at the first placement at or after each interval
boundary (the core has no timer).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Mapping, Sequence

from services.scheduler.decision import Decision
from services.scheduler.evaluate import Evaluation, decide
from services.scheduler.load import WorkerLoad
from services.scheduler.policies.base import BaselinePolicy, check_int_at_least, draw_tie
from services.scheduler.registry import register_policy
from shared.costmodel import DEFAULT_PROFILE, Profile
from shared.ids import BlockHash, InvalidInput, WorkerId

SGLANG_BLOCK_TOKENS = 16
SGLANG_MAX_TREE_NODES = 10_000


class ApproxTrees:
    """Per-worker approximate prefix trees over chained block hashes, with LRU leaf eviction."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[WorkerId]] = {}
        self._parent: dict[BlockHash, BlockHash | None] = {}
        self._access: dict[WorkerId, dict[BlockHash, float]] = {}  # worker -> node -> last access
        self._nchild: dict[WorkerId, dict[BlockHash, int]] = {}  # worker -> node -> held children

    def size(self, worker: WorkerId) -> int:
        """Blocks in ``worker``'s tree."""
        return len(self._access.get(worker, ()))

    def holds(self, worker: WorkerId, block: BlockHash) -> bool:
        return block in self._access.get(worker, {})

    def insert(self, worker: WorkerId, blocks: Sequence[BlockHash], now: float) -> None:
        acc = self._access.setdefault(worker, {})
        nch = self._nchild.setdefault(worker, {})
        parent: BlockHash | None = None
        for h in blocks:
            if h not in acc:
                self._holders.setdefault(h, set()).add(worker)
                self._parent.setdefault(h, parent)
                nch[h] = 0
                if parent is not None:
                    nch[parent] += 1
            acc[h] = now
            parent = h

    def match(
        self, blocks: Sequence[BlockHash], workers: Sequence[WorkerId]
    ) -> dict[WorkerId, int]:
        """Matched prefix length in blocks per worker (0 for no match)."""
        out = dict.fromkeys(workers, 0)
        alive = set(workers)
        for depth, h in enumerate(blocks, start=1):
            holders = self._holders.get(h)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for w in alive:
                out[w] = depth
        return out

    def evict(self, worker: WorkerId, max_blocks: int) -> int:
        """Drop least-recently-used leaves of ``worker``'s tree until ≤ ``max_blocks``."""
        acc = self._access.get(worker)
        if not acc or len(acc) <= max_blocks:
            return 0
        nch = self._nchild[worker]
        heap = [(t, h) for h, t in acc.items() if nch[h] == 0]
        heapq.heapify(heap)
        removed = 0
        while len(acc) > max_blocks and heap:
            _, h = heapq.heappop(heap)
            del acc[h]
            del nch[h]
            hs = self._holders[h]
            hs.discard(worker)
            if not hs:
                del self._holders[h]
            removed += 1
            p = self._parent.get(h)
            if p is not None and p in nch:
                nch[p] -= 1
                if nch[p] == 0:
                    heapq.heappush(heap, (acc[p], p))
        return removed


@register_policy("sglang")
class SglangPolicy(BaselinePolicy):
    """SGLang ``cache_aware``: balance on imbalance, else approximate-tree prefix affinity."""

    policy_name = "sglang"

    def __init__(
        self,
        *,
        profile: Profile = DEFAULT_PROFILE,
        rng: random.Random | None = None,
        cache_threshold: float = 0.5,
        balance_abs_threshold: int = 32,
        balance_rel_threshold: float = 1.1,
        eviction_interval_s: float = 30.0,
        max_tree_blocks: int | None = None,
        unbounded: bool = False,
        pool_degree: int = 4,
    ) -> None:
        if not (0.0 <= cache_threshold <= 1.0):
            raise InvalidInput(f"cache_threshold must be in [0, 1], got {cache_threshold!r}")
        check_int_at_least("balance_abs_threshold", balance_abs_threshold, 0)
        if not (math.isfinite(balance_rel_threshold) and balance_rel_threshold >= 0):
            raise InvalidInput(f"balance_rel_threshold must be >= 0, got {balance_rel_threshold!r}")
        if not (math.isfinite(eviction_interval_s) and eviction_interval_s > 0):
            raise InvalidInput(f"eviction_interval_s must be > 0, got {eviction_interval_s!r}")
        if max_tree_blocks is not None:
            check_int_at_least("max_tree_blocks", max_tree_blocks, 1)
        self.profile = profile
        self.rng = rng if rng is not None else random.Random(0)
        self.cache_threshold = float(cache_threshold)
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = float(balance_rel_threshold)
        self.eviction_interval_s = float(eviction_interval_s)
        self.max_tree_blocks = max_tree_blocks
        self.unbounded = bool(unbounded)
        self.pool_degree = pool_degree
        self.trees = ApproxTrees()
        self._next_eviction = self.eviction_interval_s

    def tree_budget_blocks(self, block_size: int) -> int:
        """A tree's size bound in blocks of ``block_size`` tokens: ``max_tree_blocks`` if
        given, else SGLang's default token budget (10,000 nodes of 16 tokens) in such blocks,
        at least one (module docstring)."""
        if self.max_tree_blocks is not None:
            return self.max_tree_blocks
        return max(1, SGLANG_MAX_TREE_NODES * SGLANG_BLOCK_TOKENS // block_size)

    def choose(self, ev: Evaluation, loads: Mapping[WorkerId, WorkerLoad]) -> Decision:
        request, view, now = ev.request, ev.view, ev.now
        if not self.unbounded and now >= self._next_eviction:
            budget = self.tree_budget_blocks(view.block_size)
            for w in view.workers:
                self.trees.evict(w.worker_id, budget)
            k = math.floor(now / self.eviction_interval_s) + 1
            self._next_eviction = k * self.eviction_interval_s

        elig = ev.eligible
        wids = [ev.workers[i].worker_id for i in elig]
        inflight = [loads[w].unfinished for w in wids]
        lo, hi = min(inflight), max(inflight)
        scores: list[float | None] = [None] * len(ev.workers)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            k = inflight.index(lo)
            chosen = elig[k]
            for i, load in zip(elig, inflight, strict=True):
                scores[i] = float(load)
            note = f"imbalanced (in-flight max {hi}, min {lo}) -> least loaded"
            objective, label = "min", "in-flight"
        else:
            matched = self.trees.match(request.block_hashes, wids)
            L = request.length
            B = view.block_size
            rates = [min(matched[w] * B, L) / L for w in wids]
            best_rate = max(rates)
            if best_rate > self.cache_threshold:
                tied = [k for k, r in enumerate(rates) if r == best_rate]
                k = draw_tie(self.rng, tied)
                chosen = elig[k]
                for i, r in zip(elig, rates, strict=True):
                    scores[i] = r
                note = f"match rate {best_rate:.3f} > {self.cache_threshold} -> best match"
                objective, label = "max", "match_rate"
            else:
                sizes = [self.trees.size(w) for w in wids]
                k = sizes.index(min(sizes))
                chosen = elig[k]
                for i, sz in zip(elig, sizes, strict=True):
                    scores[i] = float(sz)
                note = f"match rate {best_rate:.3f} <= {self.cache_threshold} -> smallest tree"
                objective, label = "min", "tree_blocks"
        self.trees.insert(ev.workers[chosen].worker_id, request.block_hashes, now)
        return decide(
            self.name, ev, chosen, scores, objective=objective, score_label=label, note=note
        )
