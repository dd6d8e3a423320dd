"""The periodic prefix-cache scan: Algorithm 2 and the selection of §7.2.

Algorithm 2, exactly as written: for every node z and degree C, with r = ReplicaCount(z, C),
  r = 0 and missed[z, C] > θ_inter          -> inter list
  r > 0 and access[z, C] > r·θ_intra        -> intra list
  r > 0 and access[z, C] < r·θ_reclaim      -> reclaim list (only if not intra)
then every access and missed is multiplied by ``decay``. The lists keep the values seen before
the decay (ranking is invariant under the uniform decay anyway).

Selection (§7.2), each list ranked separately and at most ``max_actions_per_list`` taken:
* inter:   by missed[z, C] per copied block, descending;
* intra:   by access[z, C] / r descending; among near-ties (within ``near_tie``, relative) the
           smaller copy footprint first. A candidate whose child at C is also one with nearly
           all of its demand (child's access >= (1 - ``near_tie``)·z's) is left to the child:
           Algorithm 1 counts an access on every node of a reused path, so each ancestor of a
           hot prefix ties with it and has the smallest footprint, and copying those one block
           per scan would spend the scan's copy on a prefix's first block while the requests
           reuse the whole path. The child's copy carries z's blocks with it (z is tried
           only after every chain end: for a chain whose end no destination can take);
* reclaim: by access[z, C] / r ascending.
Copy footprint for a destination = the blocks of the root->z path it does not have (valid).
Destination: a non-stale degree-C worker without z and without an in-flight copy of z, whose
capacity minus pinned (``in_use``) and reserved blocks fits the footprint; preferred by
(smaller footprint = longer retained ancestor path, free room without eviction, lower load,
lower cache pressure, id). Source: intra -- the least-loaded degree-C holder of z; inter -- the
least-loaded holder of z at any degree. A (z, C) already covered by an in-flight copy to a
degree-C worker is skipped (a scan never issues the same copy twice).
Reclaim: among degree-C holders of z where the replica is not in use (``in_use`` plus blocks
pinned as sources of in-flight copies) and no block of z's subtree is retained below it, the one
with the highest cache pressure (used / capacity). NOTE: a reclaim never takes a prefix's last
replica in the pool (design.md), counting in-flight and same-scan reclaims. The deletion extends
upward over ancestors that are themselves reclaim candidates at C, kept by nothing else at that
worker, not in use and not the last replica.

Finally nodes with no worker reference (valid or pending), no children, no in-flight operation
and all statistics below ``gc_threshold`` are garbage-collected, deepest first (NOTE: a node
with a descendant is never collected, so no held node loses its path).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Final

from services.cachemgr.actions import CacheAction, Reclaim, Replicate
from services.cachemgr.trie import held_along
from shared.ids import BlockHash, Degree, InvalidInput, WorkerId

if TYPE_CHECKING:
    from services.cachemgr.trie import PrefixTrie, TrieNode, WorkerView

_NO_LOAD: Final[float] = 0.0


@dataclass(frozen=True, slots=True)
class ScanConfig:
    """Thresholds of Algorithm 2 and the selection bounds (§7.2, §8).

    ``theta_inter`` is in seconds of predicted benefit (missed accumulates Ê differences);
    ``theta_intra``/``theta_reclaim`` are per-replica accesses per (decayed) scan horizon.
    ``max_actions_per_list`` bounds each list per scan. ``max_replications`` bounds the copies a
    scan starts, inter and intra together (§8: "the cache dispatcher launches at most one active
    transfer per scan"; the calibrated default is 1); None leaves only the per-list bound.
    ``gc_threshold``: statistics below it are negligible for garbage
    collection. ``near_tie``: relative gap under which intra candidates count as tied.
    """

    theta_inter: float
    theta_intra: float
    theta_reclaim: float
    decay: float
    max_actions_per_list: int = 1
    max_replications: int | None = None
    gc_threshold: float = 1e-3
    near_tie: float = 0.05

    def __post_init__(self) -> None:
        for name in ("theta_inter", "theta_intra", "theta_reclaim", "gc_threshold", "near_tie"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
                    or v < 0:
                raise InvalidInput(f"{name} must be a finite number >= 0, got {v!r}")
        if not self.theta_reclaim < self.theta_intra:
            raise InvalidInput(
                f"theta_reclaim ({self.theta_reclaim}) must be < theta_intra ({self.theta_intra})"
                " to avoid replicate/reclaim oscillation")
        if isinstance(self.decay, bool) or not isinstance(self.decay, int | float) \
                or not 0.0 < self.decay < 1.0:
            raise InvalidInput(f"decay must be in (0, 1), got {self.decay!r}")
        m = self.max_actions_per_list
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise InvalidInput(f"max_actions_per_list must be an integer >= 0, got {m!r}")
        r = self.max_replications
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise InvalidInput(f"max_replications must be an integer >= 0 or None, got {r!r}")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One (z, C) entry of an Algorithm 2 list, with the statistics it was judged on."""

    node_hash: BlockHash
    degree: Degree
    replicas: int
    access: float
    missed: float


@dataclass(frozen=True, slots=True)
class ScanResult:
    inter: tuple[Candidate, ...]
    intra: tuple[Candidate, ...]
    reclaim: tuple[Candidate, ...]
    actions: tuple[CacheAction, ...]  # selected and now in flight: inter, then intra, reclaim
    collected: int  # nodes garbage-collected


class _Selector:
    """Selection state of one scan: loads, pins, reservations made so far."""

    def __init__(self, trie: PrefixTrie, cfg: ScanConfig, load: Mapping[WorkerId, float],
                 in_use: Mapping[WorkerId, Iterable[BlockHash]]) -> None:
        self.trie = trie
        self.cfg = cfg
        self.views = {w: v for w, v in trie._workers.items() if not v.stale}
        self.load: dict[WorkerId, float] = {}
        for w, x in load.items():
            if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x) \
                    or x < 0:
                raise InvalidInput(f"load of {w!r} must be a finite number >= 0, got {x!r}")
            self.load[w] = float(x)
        self.pinned: dict[WorkerId, set[BlockHash]] = {}
        for w, hs in in_use.items():
            try:
                self.pinned.setdefault(w, set()).update(hs)
            except TypeError as exc:
                raise InvalidInput(f"in_use[{w!r}] must be an iterable of block hashes") from exc
        nodes = trie._nodes
        # (node, degree index) covered by an in-flight copy to a worker of that degree.
        self.covered: set[tuple[BlockHash, int]] = set()
        self.reserved: dict[WorkerId, int] = {}
        for dest, acts in trie._replicating.items():
            dv = trie._workers[dest]
            self.reserved[dest] = trie._reserved(dv)
            for a in acts.values():
                self._cover(dv.deg_idx, a)
                n = nodes.get(a.node_hash)
                if n is not None:
                    self._pin_copy(a, n.path())
        self.with_orphans = [v for v in self.views.values() if v.orphans]
        # Per degree index, the largest room any worker has: bounds a zero-retention footprint
        # when ranking without visiting every worker per candidate.
        self.max_room: dict[int, int] = {}
        self.per_degree: dict[int, int] = {}
        self.room: dict[WorkerId, int] = {}
        for w, v in self.views.items():
            room = self.free_room(v)
            self.room[w] = room
            self.max_room[v.deg_idx] = max(self.max_room.get(v.deg_idx, -1), room)
            self.per_degree[v.deg_idx] = self.per_degree.get(v.deg_idx, 0) + 1
        self.reclaiming: dict[BlockHash, set[WorkerId]] = {}
        for w, racts in trie._reclaiming.items():
            for r in racts.values():
                for h in r.blocks:
                    self.reclaiming.setdefault(h, set()).add(w)

    def _pin_copy(self, a: Replicate, path: list[TrieNode]) -> None:
        # NOTE: until a copy is retired its source keeps the path, and so does its destination
        # (the part it already had is what made the footprint small): neither is reclaimed.
        hs = [x.hash for x in path]
        self.pinned.setdefault(a.source, set()).update(hs)
        self.pinned.setdefault(a.dest, set()).update(hs)

    def _cover(self, di: int, a: Replicate) -> None:
        n = self.trie._nodes.get(a.node_hash)
        if a.kind != "reconcile" and n is not None:
            for x in n.path():
                self.covered.add((x.hash, di))
        else:
            for h in a.blocks:
                self.covered.add((h, di))

    # -- helpers ---------------------------------------------------------------------
    def free_room(self, v: WorkerView) -> int:
        """Blocks a destination can make room for: capacity less pinned resident blocks and
        blocks reserved by copies to it (LRU evicts the rest: design.md counts it as free)."""
        pinned = self.pinned.get(v.worker)
        n_pinned = len(pinned & v.valid) if pinned else 0
        return v.capacity_blocks - n_pinned - self.reserved.get(v.worker, 0)

    def pressure(self, v: WorkerView) -> float:
        return (v.used_blocks + self.reserved.get(v.worker, 0)) / v.capacity_blocks

    def retained(self, path: list[TrieNode]) -> dict[WorkerId, int]:
        """Blocks of ``path`` each worker already has valid (held prefix + orphans on it)."""
        out = held_along(path)
        for v in self.with_orphans:
            extra = sum(1 for n in path if n.hash in v.orphans)
            if extra:
                out[v.worker] = out.get(v.worker, 0) + extra
        return out

    def destinations(self, node: TrieNode, di: int,
                     path: list[TrieNode]) -> list[tuple[tuple, WorkerId, int]]:
        """Feasible degree-C destinations for z as (preference key, worker, footprint)."""
        retained = self.retained(path)
        trie = self.trie
        out = []
        for w, v in self.views.items():
            if v.deg_idx != di or w in node.holders:
                continue
            acts = trie._replicating.get(w)
            if acts and node.hash in acts:
                continue
            footprint = len(path) - retained.get(w, 0)
            if footprint > self.free_room(v):
                continue
            free = v.capacity_blocks - v.used_blocks - self.reserved.get(w, 0)
            key = (footprint, 0 if free >= footprint else 1, self.load.get(w, _NO_LOAD),
                   self.pressure(v), w)
            out.append((key, w, footprint))
        out.sort()
        return out

    def source(self, node: TrieNode, di: int | None) -> WorkerId | None:
        busy = self.reclaiming.get(node.hash, ())
        best: tuple[float, WorkerId] | None = None
        for w in node.holders:
            v = self.views.get(w)
            if v is None or w in busy or (di is not None and v.deg_idx != di):
                continue
            k = (self.load.get(w, _NO_LOAD), w)
            if best is None or k < best:
                best = k
        return None if best is None else best[1]

    def replicate(self, cand: Candidate, kind: str) -> Replicate | None:
        trie = self.trie
        node = trie._nodes[cand.node_hash]
        di = trie._deg_idx[cand.degree]
        if (node.hash, di) in self.covered:
            return None
        src = self.source(node, di if kind == "intra" else None)
        if src is None:
            return None
        path = node.path()
        dests = self.destinations(node, di, path)
        if not dests:
            return None
        _, dest, _ = dests[0]
        dv = self.views[dest]
        blocks = tuple(n.hash for n in path if n.hash not in dv.valid)
        action = Replicate(node.hash, cand.degree, src, dest, blocks, kind)  # type: ignore[arg-type]
        self._cover(di, action)
        self.reserved[dest] = self.reserved.get(dest, 0) + len(blocks)
        self._pin_copy(action, path)
        return action

    def min_footprint(self, cand: Candidate) -> int | None:
        """Smallest copy footprint over degree-C destinations, for ranking only.

        Exact for workers that retain part of the path; any other worker would copy the whole
        path, counted feasible if some degree-C worker has that much room (the exact choice is
        made in :meth:`replicate`). Holder groups are visited deepest first and the walk stops
        at the first feasible worker, so ranking costs O(path + a few holders) per candidate
        instead of O(workers) -- the root block of a popular system prompt is held by everyone.
        """
        trie = self.trie
        node = trie._nodes[cand.node_hash]
        di = trie._deg_idx[cand.degree]
        path = node.path()
        n = len(path)
        best: int | None = n if n <= self.max_room.get(di, -1) else None
        room = self.room
        for v in self.with_orphans:
            w = v.worker
            if v.deg_idx == di and w not in node.holders:
                fp = n - self.retained(path).get(w, 0)
                if fp <= room[w] and (best is None or fp < best):
                    best = fp
        views = self.views
        for depth, group in _holder_groups(path):
            fp = n - depth
            if best is not None and fp >= best:
                break
            for w in group:
                v = views.get(w)
                if v is not None and v.deg_idx == di and fp <= room[w] \
                        and w not in node.holders:
                    best = fp
                    break
        if best == n and cand.replicas and \
                self.per_degree.get(di, 0) <= cand.replicas:
            return None  # every degree-C worker already holds z
        return best

    def reclaim(self, cand: Candidate, reclaimable: set[BlockHash]) -> Reclaim | None:
        trie = self.trie
        node = trie._nodes[cand.node_hash]
        di = trie._deg_idx[cand.degree]
        best: tuple[float, str] | None = None
        chosen: WorkerId | None = None
        for w in node.holders:
            v = self.views.get(w)
            if v is None or v.deg_idx != di or not self._removable(node, v, None):
                continue
            k = (-self.pressure(v), w)
            if best is None or k < best:
                best, chosen = k, w
        if chosen is None:
            return None
        v = self.views[chosen]
        blocks = [node.hash]
        prev, a = node, node.parent
        while a is not None and a.hash in reclaimable and self._removable(a, v, prev):
            blocks.append(a.hash)
            prev, a = a, a.parent
        for h in blocks:
            self.reclaiming.setdefault(h, set()).add(chosen)
        return Reclaim(chosen, node.hash, tuple(blocks))

    def _removable(self, n: TrieNode, v: WorkerView, only_child: TrieNode | None) -> bool:
        w = v.worker
        busy = self.reclaiming.get(n.hash, set())
        if w in busy or n.hash in self.pinned.get(w, ()):
            return False
        # NOTE: never the last replica in the pool (holders minus those already being removed).
        if len(n.holders) - len(busy & n.holders) < 2:
            return False
        # Nothing retained (or being reconciled) below it at this worker, other than the chain
        # being removed.
        valid, pending = v.valid, v.pending
        for c in n.children.values():
            if c is not only_child and (c.hash in valid or c.hash in pending):
                return False
        return True


def _holder_groups(path: list[TrieNode]) -> list[tuple[int, set[WorkerId]]]:
    """(held blocks, workers) groups along a root-first path, deepest first (cf. held_along)."""
    groups: list[tuple[int, set[WorkerId]]] = []
    cur = path[0].holders
    for i in range(1, len(path)):
        nxt = path[i].holders
        if len(nxt) != len(cur):
            groups.append((i, cur - nxt))
            cur = nxt
            if not cur:
                break
    if cur:
        groups.append((len(path), cur))
    groups.reverse()
    return groups


def _chain_ends(trie: PrefixTrie, intra: list[tuple[Candidate, int]],
                tie: float) -> tuple[list[tuple[Candidate, int]], list[Candidate]]:
    """Split ``intra`` (candidates with their footprints, order kept) into the chain ends and
    the candidates a child candidate at the same degree subsumes: one with access >= (1 -
    ``tie``)·the parent's, i.e. the parent's demand almost all continues into the child, whose
    copy brings the parent's blocks along (a copy is the root->node path). A child has at most
    its parent's replicas, so its access / r is no lower. The subsumed come back deepest first
    (then by access / r): they are tried only after every chain end, so a chain whose end no
    destination can take (footprints here are estimates) still gets its longest part that fits.
    """
    by_key = {(c.node_hash, c.degree): c for c, _ in intra}
    nodes = trie._nodes
    subsumed: set[tuple[BlockHash, Degree]] = set()
    for c, _ in intra:
        parent = nodes[c.node_hash].parent
        if parent is None:
            continue
        p = by_key.get((parent.hash, c.degree))
        if p is not None and c.access >= (1.0 - tie) * p.access:
            subsumed.add((p.node_hash, p.degree))
    if not subsumed:
        return intra, []
    ends = [cf for cf in intra if (cf[0].node_hash, cf[0].degree) not in subsumed]
    inner = sorted((by_key[k] for k in subsumed),
                   key=lambda c: (-nodes[c.node_hash].depth, -c.access / c.replicas,
                                  c.node_hash, c.degree))
    return ends, inner


def _ranked_intra(cands: list[tuple[Candidate, int]], tie: float) -> list[Candidate]:
    """access/r descending; within near-tie groups, smaller footprint first."""
    cands.sort(key=lambda cf: (-cf[0].access / cf[0].replicas, cf[1], cf[0].node_hash))
    out: list[Candidate] = []
    i = 0
    while i < len(cands):
        head = cands[i][0].access / cands[i][0].replicas
        j = i + 1
        while j < len(cands) and cands[j][0].access / cands[j][0].replicas >= head * (1 - tie):
            j += 1
        group = sorted(cands[i:j], key=lambda cf: (cf[1], -cf[0].access / cf[0].replicas,
                                                   cf[0].node_hash))
        out.extend(c for c, _ in group)
        i = j
    return out


def run_scan(trie: PrefixTrie, cfg: ScanConfig, load: Mapping[WorkerId, float],
             in_use: Mapping[WorkerId, Iterable[BlockHash]], *, lists: bool = True) -> ScanResult:
    """One periodic scan: Algorithm 2's lists and decay, §7.2's selection, then GC.

    ``load``: worker -> outstanding predicted seconds (missing: 0). ``in_use``: worker -> blocks
    pinned by running requests there. Unknown workers in either are ignored (they may have just
    left the pool). Selected actions are recorded as in flight on ``trie``.

    ``lists=False`` returns empty inter / intra / reclaim lists but the same actions, decay and
    collection, at a cost independent of the trie's size (speed; the simulator's path):

    * decay is lazy (:class:`~services.cachemgr.trie.TrieNode` applies it on the next read,
      with the same float operations), so no pass over every node is needed;
    * inter and intra candidates need missed > θ_inter, resp. access > r·θ_intra >= θ_intra,
      and statistics only grow through ``record_request`` / ``set_statistics``: the trie
      keeps the nodes touched since the last scan and those still above the thresholds after
      its decay (``_touched``, ``_hot``); only they are examined (a full pass rebuilds the
      index when a scan lowers a threshold);
    * a reclaim never takes the last replica, so only nodes with >= 2 holders (``_multi``) can
      give one; they are ranked exactly as the full list would be (access / r, hash, degree),
      and "is an ancestor a reclaim candidate" is evaluated directly;
    * garbage collection only looks at nodes with refs == 0 (``_unref``).
    """
    if not isinstance(cfg, ScanConfig):
        raise InvalidInput(f"config must be a ScanConfig, got {type(cfg).__name__}")
    if not isinstance(load, Mapping) or not isinstance(in_use, Mapping):
        raise InvalidInput("load and in_use must be mappings keyed by worker id")
    sel = _Selector(trie, cfg, load, in_use)  # validates before anything changes

    # --- Algorithm 2, lines 1-11 ---------------------------------------------------------
    degrees = trie.degrees
    nd = len(degrees)
    t_inter, t_intra, t_rec = cfg.theta_inter, cfg.theta_intra, cfg.theta_reclaim
    d = cfg.decay
    inter: list[Candidate] = []
    intra: list[Candidate] = []
    reclaim: list[Candidate] = []
    e = len(trie._decays)
    zeros = (0.0,) * nd
    hot_th = trie._hot_th
    full = lists or t_inter < hot_th[0] or t_intra < hot_th[1]
    # Reclaim candidates as (access / r, hash, degree, node, degree index): the list's ranking.
    rec_keys: list[tuple[float, BlockHash, Degree, TrieNode, int]] = []
    # Index path: multi-holder nodes with a zero access at some degree (by hash), and those
    # with any access at all (source of the positive reclaim keys).
    zero_nodes: list[TrieNode] = []
    acc_nodes: list[TrieNode] = []
    if full:
        hot: set[TrieNode] = set()
        for n in trie._nodes.values():
            if n.ep != e:
                n.catch_up()
            count, acc, mis = n.count, n._acc, n._mis
            if acc is None and mis is None:
                for i in range(nd):
                    r = count[i]
                    if r and 0.0 < r * t_rec:
                        reclaim.append(Candidate(n.hash, degrees[i], r, 0.0, 0.0))
                continue
            if acc is None:
                acc = zeros
            if mis is None:
                mis = zeros
            keep = False
            for i in range(nd):
                r = count[i]
                a, m = acc[i], mis[i]
                if r == 0:
                    if m > t_inter:
                        inter.append(Candidate(n.hash, degrees[i], 0, a, m))
                elif a > r * t_intra:
                    intra.append(Candidate(n.hash, degrees[i], r, a, m))
                elif a < r * t_rec:
                    reclaim.append(Candidate(n.hash, degrees[i], r, a, m))
                if m * d > t_inter or a * d > t_intra:
                    keep = True
            if keep:
                hot.add(n)
        trie._hot = hot
        if lists is False:
            multi = trie._multi
            for c in reclaim:
                n = trie._nodes[c.node_hash]
                if n in multi:
                    rec_keys.append((c.access / c.replicas, c.node_hash, c.degree, n,
                                     trie._deg_idx[c.degree]))
    else:
        hot = trie._hot
        for n in trie._touched:
            hot.add(n)
        nodes = trie._nodes
        drop: list[TrieNode] = []
        for n in hot:
            if nodes.get(n.hash) is not n:
                drop.append(n)  # collected meanwhile
                continue
            if n.ep != e:
                n.catch_up()
            count = n.count
            acc = n._acc if n._acc is not None else zeros
            mis = n._mis if n._mis is not None else zeros
            keep = False
            for i in range(nd):
                r = count[i]
                a, m = acc[i], mis[i]
                if r == 0:
                    if m > t_inter:
                        inter.append(Candidate(n.hash, degrees[i], 0, a, m))
                elif a > r * t_intra:
                    intra.append(Candidate(n.hash, degrees[i], r, a, m))
                if m * d > t_inter or a * d > t_intra:
                    keep = True
            if not keep:
                drop.append(n)
        for n in drop:
            hot.discard(n)
        # Reclaim candidates leave Algorithm 2's list in (access / r, hash, degree) order and
        # selection stops after a few. Every multi-holder node with a zero access at a degree
        # it is held at ranks at access / r = 0 (most candidates: no access at all, or none at
        # that degree), so those come first, ordered by (hash, degree): the nodes are only
        # sorted by hash here (in C) and expanded lazily (_zero_keys). The positive keys are
        # built and heap-ordered only if the zero ones run out (_positive_keys).
        if 0.0 < t_rec:  # access 0 < r·θ_reclaim for every r >= 1; else the list is empty
            zero_append, acc_append = zero_nodes.append, acc_nodes.append
            for n in trie._multi:
                acc = n._acc
                if acc is None:
                    zero_append(n)
                    continue
                # A decay keeps a zero zero; a positive value needs the exact decayed value
                # (it could underflow to zero), so only then is the node caught up here.
                if 0.0 in acc:
                    zero_append(n)
                elif n.ep != e:
                    n.catch_up()
                    if 0.0 in acc:
                        zero_append(n)
                acc_append(n)
            zero_nodes.sort(key=_HASH)
    trie._touched = set()
    trie._hot_th = (t_inter, t_intra)

    # --- §7.2 selection ------------------------------------------------------------------
    # (It reads no statistics but the candidates' own, so Algorithm 2's decay, lines 12-14,
    # is recorded after it: the lazy decay then leaves every value read here pre-decay.)
    bound = cfg.max_actions_per_list
    actions: list[CacheAction] = []
    if bound:
        ranked_inter: list[tuple[float, Candidate]] = []
        for c in inter:
            fp = sel.min_footprint(c)
            if fp:
                ranked_inter.append((c.missed / fp, c))
        ranked_inter.sort(key=lambda x: (-x[0], x[1].node_hash, x[1].degree))
        # Copies share one budget across both lists (ScanConfig.max_replications).
        cap = cfg.max_replications
        n_inter = _take(actions, (c for _, c in ranked_inter), lambda c: sel.replicate(c, "inter"),
                        bound if cap is None else min(bound, cap))

        if not full:
            # The full pass lists in trie order (a node's degrees in index order); ties of the
            # stable sorts below are between one node's degrees only, so this order suffices.
            di = trie._deg_idx
            intra.sort(key=lambda c: (c.node_hash, di[c.degree]))
        with_fp = [(c, fp) for c in intra if (fp := sel.min_footprint(c)) is not None]
        ends, inner = _chain_ends(trie, with_fp, cfg.near_tie)
        _take(actions, itertools.chain(_ranked_intra(ends, cfg.near_tie), inner),
              lambda c: sel.replicate(c, "intra"),
              bound if cap is None else min(bound, cap - n_inter))

        if lists:
            reclaim_sorted = sorted(reclaim, key=lambda c: (c.access / c.replicas, c.node_hash,
                                                             c.degree))
            by_degree: dict[Degree, set[BlockHash]] = {}
            for c in reclaim:
                by_degree.setdefault(c.degree, set()).add(c.node_hash)
            _take(actions, reclaim_sorted, lambda c: sel.reclaim(c, by_degree[c.degree]), bound)
        else:
            # Only multi-holder candidates, in the list's order; reclaim() returns None for the
            # others without side effects. Ancestors are tested for list membership directly.
            # A heap, popped in order until enough reclaims: few trials are ever needed.
            # (access / r, hash, degree) is unique, so the node is never compared.
            ranked: Iterable[tuple[float, BlockHash, Degree, TrieNode, int]]
            if full:
                heapq.heapify(rec_keys)
                ranked = _popped(rec_keys)
            else:
                ranked = itertools.chain(_zero_keys(zero_nodes, degrees),
                                         _positive_keys(acc_nodes, degrees, t_rec))
            tests = [_InReclaimList(trie, i, t_rec) for i in range(nd)]
            _take(actions, (Candidate(h, c, n.count[i], q, 0.0) for q, h, c, n, i in ranked),
                  lambda c: sel.reclaim(c, tests[trie._deg_idx[c.degree]]), bound)
    for a in actions:
        trie._begin(a)

    # --- Algorithm 2, lines 12-14: every access and missed times the decay (lazily) -------
    trie._decays.append(d)

    return ScanResult(tuple(inter) if lists else (), tuple(intra) if lists else (),
                      tuple(reclaim) if lists else (), tuple(actions),
                      collect(trie, cfg.gc_threshold))


_HASH: Final = attrgetter("hash")


def _zero_keys(nodes: list[TrieNode], degrees: tuple[Degree, ...]) -> Iterator:
    """(access / r = 0.0, hash, degree, node, degree index) for every degree a node is held at
    with zero access, in order (``nodes`` sorted by hash; a node's degrees ascending). A zero
    stays zero under decay, so a node need not be caught up for this."""
    order = sorted(range(len(degrees)), key=degrees.__getitem__)
    for n in nodes:
        count, acc = n.count, n._acc
        for i in order:
            r = count[i]
            if r and (acc is None or acc[i] == 0.0):
                yield (0.0 if acc is None else acc[i] / r, n.hash, degrees[i], n, i)


def _positive_keys(nodes: list[TrieNode], degrees: tuple[Degree, ...],
                   t_rec: float) -> Iterator:
    """The reclaim keys with access > 0 (access < r·θ_reclaim) of ``nodes``, in
    (access / r, hash, degree) order; built on the first ``next`` only."""
    keys = []
    for n in nodes:
        if n.ep != len(n._dh):
            n.catch_up()
        count, acc = n.count, n._acc
        for i in range(len(degrees)):
            r = count[i]
            if r:
                a = acc[i]
                if 0.0 < a < r * t_rec:
                    keys.append((a / r, n.hash, degrees[i], n, i))
    heapq.heapify(keys)
    yield from _popped(keys)


def _popped(heap: list) -> Iterator:
    pop = heapq.heappop
    while heap:
        yield pop(heap)


class _InReclaimList:
    """``h in test``: is (h, degrees[i]) in Algorithm 2's reclaim list of this scan, i.e.
    r > 0 and access < r·θ_reclaim (which excludes the intra list, θ_reclaim < θ_intra)."""

    __slots__ = ("nodes", "i", "t_rec")

    def __init__(self, trie: PrefixTrie, i: int, t_rec: float) -> None:
        self.nodes, self.i, self.t_rec = trie._nodes, i, t_rec

    def __contains__(self, h: object) -> bool:
        n = self.nodes.get(h)  # type: ignore[call-overload]
        if n is None:
            return False
        r = n.count[self.i]
        if not r:
            return False
        a = n.access[self.i]
        return a < r * self.t_rec


def _take(out: list[CacheAction], ranked: Iterable[Candidate], make, bound: int) -> int:
    """Append up to ``bound`` actions ``make`` gives for ``ranked`` (None: skipped); how many."""
    taken = 0
    for c in ranked:
        if taken >= bound:
            break
        a = make(c)
        if a is not None:
            out.append(a)
            taken += 1
    return taken


def collect(trie: PrefixTrie, threshold: float) -> int:
    """Drop unreferenced childless nodes with negligible statistics, deepest first.

    Only nodes with refs == 0 are examined (the trie indexes them); the set collected is the
    same fixed point whatever the order ("childless, unreferenced, cold, unprotected", with
    parents re-examined when their last child goes).
    """
    protected: set[BlockHash] = set()
    for acts in trie._replicating.values():
        for a in acts.values():
            protected.add(a.node_hash)
            protected.update(a.blocks)
    for racts in trie._reclaiming.values():
        for r in racts.values():
            protected.update(r.blocks)
    e = len(trie._decays)

    zero_cold = 0.0 < threshold

    def cold(n: TrieNode) -> bool:
        acc, mis = n._acc, n._mis
        if acc is None and mis is None:
            return zero_cold
        below = (0.0 if acc is None else max(acc)) < threshold and \
            (0.0 if mis is None else max(mis)) < threshold
        if below or n.ep == e:
            # NOTE: a decay (0 < d < 1) never raises a value >= 0, so values below the
            # threshold before the pending decays are below it after them: no catch-up needed.
            return below
        n.catch_up()
        return (0.0 if acc is None else max(acc)) < threshold and \
            (0.0 if mis is None else max(mis)) < threshold

    cands = [n for n in trie._unref
             if not n.children and n.hash not in protected
             and ((zero_cold and n._acc is None and n._mis is None) or cold(n))]
    nodes = trie._nodes
    gone: list[TrieNode] = []
    append = gone.append
    # Each candidate goes, then its ancestors while each is left childless and is itself
    # collectable (speed: one walk up a chain instead of one round per depth level; the set
    # collected is the same fixed point, since whether a node is collectable does not depend
    # on the order and it can only become childless once).
    for n in cands:
        while True:
            h = n.hash
            del nodes[h]
            append(n)
            p = n.parent
            if p is None:
                break
            ch = p.children
            del ch[h]
            if ch or p.refs or p.hash in protected:
                break
            if p._acc is None and p._mis is None:  # cold(p)'s common case, inlined (speed)
                if not zero_cold:
                    break
            elif not cold(p):
                break
            n = p
    if gone:
        trie._collections += 1
        trie._unref.difference_update(gone)
        if trie._hot:
            trie._hot.difference_update(gone)
        if trie._touched:
            trie._touched.difference_update(gone)
    return len(gone)
