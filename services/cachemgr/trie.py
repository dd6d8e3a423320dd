"""The global prefix trie of §7.1: logical prefix structure, replica holders, per-degree demand.

One :class:`TrieNode` per cache block, keyed by its chained block hash. The path from the root to
node z is the complete prefix ending at z; ``PrefixLength(z) = (depth(z) + 1) * block_size``
tokens (depth 0 = a root child = the first block of a prompt).

Holders (the paper's "workers that currently hold the complete cached prefix ending at z")
----------------------------------------------------------------------------------------------
For every registered worker the trie keeps the set of blocks the worker has *confirmed* through
its own cache events (``valid``) and the blocks the manager expects it to get after a split or
merge (``pending``, §6.2). A worker w is a **holder of z iff every block on the root->z path is
in w's valid set**. Consequences used throughout:

* ``holders(child) ⊆ holders(parent)`` (NOTE: invariant), so the longest prefix of a request a
  worker holds is simply the depth of the deepest matched node whose holder set contains it.
* A valid block whose path is broken at that worker (an "orphan": an interior block was removed,
  or a split left only every other page on a child) is physically resident and can serve as a
  copy source, but is not a holder and is never reused.
* Pending blocks are never holders; they become valid on the worker's ``Stored`` event for them
  (or :meth:`PrefixTrie.confirm_installed`).
* Donor blocks (after a split or merge) are pages physically resident at a worker that are not
  part of a whole prefix there, so its own cache index does not list them; they serve only as
  reconcile copy sources and are released by :meth:`PrefixTrie.release_donors`, a ``Cleared``
  event or the worker's removal.
* A stale worker (event gap) holds nothing until its snapshot arrives: its cached prefixes count
  as misses in :meth:`PrefixTrie.match` and in ``ReplicaCount``.

Confirmation (§7.2): a replica becomes visible only when the destination's own ``Stored`` event
for it is applied; a reclaimed one disappears only on its ``Removed`` event. Issued but
unconfirmed operations are kept as *in flight* (by destination and node) so a scan never issues
the same copy or deletion twice; a ``Stored``/``Removed`` event that completes one retires it,
and :meth:`PrefixTrie.replication_done` / ``replication_failed`` / ``reclaim_failed`` retire it
explicitly.

Hot path: :meth:`PrefixTrie.match` does one dict lookup per request block and touches each
holder set only where it shrinks along the path (sizes compared first, which is exact thanks to
the subset invariant), so its cost is O(path length + holders that drop out). ``ReplicaCount``
is an O(1) per-degree counter kept on each node.

Pure: no IO, no clock, no asyncio/nats/torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import TYPE_CHECKING, Final

from services.cachemgr.actions import CacheAction, Reclaim, Replicate
from services.cachemgr.events import (
    CacheEvent,
    Cleared,
    Removed,
    Snapshot,
    Stored,
    topological_order,
)
from shared.ids import (
    DEFAULT_BLOCK_SIZE,
    BlockHash,
    Degree,
    InvalidInput,
    UnknownWorker,
    VertumnusError,
    WorkerId,
)

if TYPE_CHECKING:
    from services.cachemgr.reconcile import MergePlan, SplitPlan
    from services.cachemgr.scan import ScanConfig, ScanResult

MAX_REQUEST_BLOCKS: Final[int] = 1 << 16
"""Longest request (in blocks) ``match`` accepts: 32M tokens at B = 512."""

HELD_BACK_MAX: Final[int] = 4096
"""Most events a stale worker's view holds back for the snapshot that ends its gap; past it,
the newest are dropped and that snapshot is followed by another (``apply``)."""


class ApplyOutcome(StrEnum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"  # event_id <= last applied (or an older snapshot): nothing changed
    GAP = "gap"  # worker's view now stale; the event was not applied; ask for a snapshot


class InconsistentEvent(InvalidInput):
    """A well-formed event that contradicts the trie (a block hash under two different parents)."""


class TrieNode:
    """One cache block. Plain ``__slots__`` class: ~100k of them live in the hot path.

    ``count[i]``   -- holders of degree ``degrees[i]`` (ReplicaCount), kept in step with holders.
    ``access[i]``, ``missed[i]`` -- §7.1 statistics for degree ``degrees[i]``.
    ``refs``       -- workers that have this block valid, pending or donor; a node with refs > 0 is
                      never garbage-collected (NOTE: invariant), so its hash stays resolvable.

    Statistics are stored lazily (speed): ``_acc`` / ``_mis`` stay ``None`` until the first
    non-zero write, and the scan's decay is not applied to every node at every scan. Instead
    the trie keeps the list of decay factors of all scans so far (``_dh``, shared by its nodes)
    and ``ep`` says how many of them ``_acc`` / ``_mis`` already include; :meth:`catch_up`
    applies the missing ones, one multiplication per scan in scan order -- exactly the float
    operations an eager decay would have done, so values are bit-identical. Read the
    statistics through the ``access`` / ``missed`` properties (they catch up first).
    """

    __slots__ = ("hash", "parent", "depth", "children", "holders", "count", "_acc", "_mis",
                 "ep", "_dh", "refs")

    def __init__(self, h: BlockHash, parent: TrieNode | None, n_degrees: int,
                 decays: list[float] | None = None) -> None:
        self.hash: BlockHash = h
        self.parent: TrieNode | None = parent
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.children: dict[BlockHash, TrieNode] = {}
        self.holders: set[WorkerId] = set()
        self.count: list[int] = [0] * n_degrees
        self._acc: list[float] | None = None
        self._mis: list[float] | None = None
        dh = [] if decays is None else decays
        self._dh: list[float] = dh
        self.ep: int = len(dh)
        self.refs: int = 0

    def catch_up(self) -> None:
        """Apply the decays of the scans since ``ep`` (same operations as an eager decay)."""
        dh = self._dh
        e, k = len(dh), self.ep
        if k == e:
            return
        self.ep = e
        acc, mis = self._acc, self._mis
        if acc is None and mis is None:
            return
        if e - k == 1:  # the common case: one scan behind
            d = dh[k]
            for arr in (acc, mis):
                if arr is None:
                    continue
                if len(arr) == 2:  # two degrees, the usual lattice: unrolled (speed)
                    arr[0] *= d
                    arr[1] *= d
                else:
                    for i in range(len(arr)):
                        arr[i] *= d
            return
        for arr in (acc, mis):
            if arr is None:
                continue
            for i, v in enumerate(arr):
                if v:
                    for j in range(k, e):
                        v *= dh[j]
                        if not v:
                            break
                    arr[i] = v

    @property
    def access(self) -> list[float]:
        """access[i] for degree index i, current (decays applied); a live list."""
        if self.ep != len(self._dh):
            self.catch_up()
        a = self._acc
        if a is None:
            a = self._acc = [0.0] * len(self.count)
        return a

    @property
    def missed(self) -> list[float]:
        """missed[i] for degree index i, current (decays applied); a live list."""
        if self.ep != len(self._dh):
            self.catch_up()
        m = self._mis
        if m is None:
            m = self._mis = [0.0] * len(self.count)
        return m

    def path(self) -> list[TrieNode]:
        """Root->self, root first."""
        out: list[TrieNode] = []
        n: TrieNode | None = self
        while n is not None:
            out.append(n)
            n = n.parent
        out.reverse()
        return out


class WorkerView:
    """What the manager knows about one worker's cache (package-private; read via the trie)."""

    __slots__ = ("worker", "degree", "deg_idx", "capacity_blocks", "last_event_id", "stale",
                 "valid", "pending", "orphans", "donors", "seen_event_id", "held_back")

    def __init__(self, worker: WorkerId, degree: Degree, deg_idx: int, capacity: int,
                 last_event_id: int) -> None:
        self.worker = worker
        self.degree = degree
        self.deg_idx = deg_idx
        self.capacity_blocks = capacity
        self.last_event_id = last_event_id
        self.stale = False
        self.valid: set[BlockHash] = set()
        # pending hash -> where a valid copy was left (sibling, the worker itself after a merge)
        # or None (any valid copy in the pool will do).
        self.pending: dict[BlockHash, WorkerId | None] = {}
        # valid blocks that are not held (broken path); usually empty, which lets the hot
        # insert path skip scanning children.
        self.orphans: set[BlockHash] = set()
        # resident pages outside the worker's index, kept as copy sources (§6.2)
        self.donors: set[BlockHash] = set()
        # The newest event id seen (applied or not): a snapshot older than it would lose the
        # effect of an event that will never come again. Events not applied while stale are
        # held back (at most HELD_BACK_MAX) and applied after the snapshot that ends the gap.
        self.seen_event_id = last_event_id
        self.held_back: dict[int, CacheEvent] = {}

    @property
    def used_blocks(self) -> int:
        return len(self.valid) + len(self.pending) + len(self.donors)


@dataclass(frozen=True, slots=True)
class MatchResult:
    """§7.1 lookup of one request.

    ``path`` -- MatchedPath: the longest run of the request's block hashes (from its first
    block) present as a chain in the trie, whoever holds it.
    ``held_blocks`` -- for each non-stale worker, its longest fully held prefix of the request in
    blocks (valid blocks only, pending excluded); workers at 0 are omitted.
    """

    path: tuple[BlockHash, ...]
    held_blocks: Mapping[WorkerId, int]
    # The matched nodes, the trie that matched them and its collection count then: while no
    # node has been collected since, record_request on that trie takes them as they are
    # instead of looking every hash up again (speed). Not part of the value.
    _nodes: tuple[TrieNode, ...] = field(default=(), compare=False, repr=False)
    _trie: object = field(default=None, compare=False, repr=False)
    _gen: int = field(default=-1, compare=False, repr=False)

    @property
    def matched_blocks(self) -> int:
        return len(self.path)

    def held(self, worker: WorkerId) -> int:
        return self.held_blocks.get(worker, 0)


@dataclass(frozen=True, slots=True)
class RecordResult:
    """What :meth:`PrefixTrie.record_request` added (for tests, metrics and logs)."""

    accessed_nodes: int
    missed_nodes: int
    missed_benefit: float


_EMPTY: Final[Mapping[WorkerId, int]] = MappingProxyType({})


def held_along(path: Sequence[TrieNode]) -> dict[WorkerId, int]:
    """For a root-first chain of nodes: each holder's longest held prefix of it, in blocks.

    NOTE: relies on holders(child) ⊆ holders(parent): a worker's held length is the depth of
    the deepest node that still lists it, and equal set sizes along the path mean equal sets,
    so only the nodes where the holder set shrinks are visited (set difference in C).
    """
    if not path:
        return {}
    held: dict[WorkerId, int] = {}
    cur = path[0].holders
    depth = len(path)
    for i in range(1, len(path)):
        nxt = path[i].holders
        if len(nxt) != len(cur):
            held.update(dict.fromkeys(cur - nxt, i))
            cur = nxt
            if not cur:
                depth = i
                break
    held.update(dict.fromkeys(cur, depth))
    return held


class PrefixTrie:
    """Global prefix trie over all workers' caches (§7.1), with §7.2's scan and §6.2's reconcile.

    ``degrees`` are the supported CP degrees C; statistics are kept per degree.
    """

    def __init__(self, degrees: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        degs = tuple(degrees)
        if not degs:
            raise InvalidInput("need at least one supported CP degree")
        for c in degs:
            if isinstance(c, bool) or not isinstance(c, int) or c < 1:
                raise InvalidInput(f"CP degrees must be integers >= 1, got {c!r}")
        if len(set(degs)) != len(degs):
            raise InvalidInput(f"CP degrees repeat: {degs}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise InvalidInput(f"block_size must be an integer >= 1, got {block_size!r}")
        self.degrees: tuple[Degree, ...] = tuple(Degree(c) for c in degs)
        self.block_size: int = block_size
        self._deg_idx: dict[int, int] = {c: i for i, c in enumerate(self.degrees)}
        self._nodes: dict[BlockHash, TrieNode] = {}
        self._workers: dict[WorkerId, WorkerView] = {}
        # In-flight operations, by worker then node: few at a time (bounded per scan).
        self._replicating: dict[WorkerId, dict[BlockHash, Replicate]] = {}
        self._reclaiming: dict[WorkerId, dict[BlockHash, Reclaim]] = {}
        # --- scan indexes (speed; see services.cachemgr.scan) -----------------------------
        # Decay factor of every scan so far, shared with the nodes (lazy decay, TrieNode).
        self._decays: list[float] = []
        # Nodes whose access / missed grew past _hot_th since the last scan (record_request;
        # set_statistics adds any node it changes).
        self._touched: set[TrieNode] = set()
        # Nodes that after the last scan's decay still had missed > _hot_th[0] or access >
        # _hot_th[1] at some degree. NOTE: invariant -- every other node not in _touched has
        # all missed <= _hot_th[0] and all access <= _hot_th[1].
        self._hot: set[TrieNode] = set()
        self._hot_th: tuple[float, float] = (0.0, 0.0)
        # Nodes with >= 2 holders (only those can give a reclaim: never the last replica).
        self._multi: set[TrieNode] = set()
        # Nodes with refs == 0 (the only ones garbage collection may take).
        self._unref: set[TrieNode] = set()
        # Garbage collections that removed nodes so far (the only way a node leaves _nodes):
        # a MatchResult made at the same count still names live nodes (record_request).
        self._collections = 0

    def release(self) -> None:
        """Forget every node, worker and operation in flight: the trie is as new (same degrees
        and block size) afterwards. For the end of a run that drops the trie (a finished
        simulation: sim.experiments.run_deployment), called from ordinary code so that an
        interrupt during it (KeyboardInterrupt) propagates like anywhere else.

        Why: a node and its children reference each other, so the ~55k nodes of a finished
        simulation's trie would otherwise wait for the cyclic collector, whose pass over them
        costs ~0.2 s at some later, unrelated allocation. Unlinking the children lets
        reference counting free them here, for a fraction of that (1.06x end to end;
        docs/evaluation.md, "Simulator speed"). NOTE: this used to be ``__del__``; an
        exception raised inside ``__del__`` (Ctrl-C during its loop) is printed and swallowed,
        and the run went on. A trie never released is left to the collector. Nodes still
        referenced elsewhere (a MatchResult: stale once released, as after a collection)
        keep everything but their children."""
        for n in self._nodes.values():
            n.children.clear()
        self._nodes.clear()
        self._workers.clear()
        self._replicating.clear()
        self._reclaiming.clear()
        self._touched.clear()
        self._hot.clear()
        self._multi.clear()
        self._unref.clear()
        self._collections += 1  # every MatchResult made before names forgotten nodes

    # ------------------------------------------------------------------ workers
    def add_worker(self, worker: WorkerId, degree: int, capacity_blocks: int,
                   *, last_event_id: int = 0) -> None:
        """Register a worker with an empty cache; its next event must be ``last_event_id + 1``."""
        if not isinstance(worker, str) or not worker:
            raise InvalidInput(f"worker id must be a non-empty string, got {worker!r}")
        if worker in self._workers:
            raise InvalidInput(f"worker {worker} is already registered")
        if degree not in self._deg_idx:
            raise InvalidInput(f"degree {degree!r} of {worker} is not one of {self.degrees}")
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) \
                or capacity_blocks < 1:
            raise InvalidInput(f"capacity_blocks must be an integer >= 1, got {capacity_blocks!r}")
        if isinstance(last_event_id, bool) or not isinstance(last_event_id, int) \
                or last_event_id < 0:
            raise InvalidInput(f"last_event_id must be an integer >= 0, got {last_event_id!r}")
        self._workers[worker] = WorkerView(worker, Degree(degree), self._deg_idx[degree],
                                           capacity_blocks, last_event_id)

    def remove_worker(self, worker: WorkerId) -> tuple[CacheAction, ...]:
        """Forget a worker and its holdings; returns the in-flight operations this cancels."""
        view = self._view(worker)
        self._drop_all(view, keep_plans=False)
        cancelled: list[CacheAction] = []
        cancelled.extend(self._replicating.pop(worker, {}).values())
        cancelled.extend(self._reclaiming.pop(worker, {}).values())
        for dest, acts in list(self._replicating.items()):
            for key, act in list(acts.items()):
                if act.source == worker:
                    cancelled.append(acts.pop(key))
            if not acts:
                del self._replicating[dest]
        del self._workers[worker]
        return tuple(cancelled)

    def workers(self) -> tuple[WorkerId, ...]:
        return tuple(self._workers)

    def worker_degree(self, worker: WorkerId) -> Degree:
        return self._view(worker).degree

    def capacity_blocks(self, worker: WorkerId) -> int:
        return self._view(worker).capacity_blocks

    def set_capacity(self, worker: WorkerId, capacity_blocks: int) -> None:
        """The worker's cache holds ``capacity_blocks`` blocks (its state told us, or a new
        process has another size); holdings are kept: the worker's own evictions, reported
        as events, bring them within it."""
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) \
                or capacity_blocks < 1:
            raise InvalidInput(f"capacity_blocks must be an integer >= 1, got {capacity_blocks!r}")
        self._view(worker).capacity_blocks = capacity_blocks

    def is_stale(self, worker: WorkerId) -> bool:
        return self._view(worker).stale

    def stale_workers(self) -> tuple[WorkerId, ...]:
        """Workers waiting for a snapshot (the adapter asks each for one)."""
        return tuple(w for w, v in self._workers.items() if v.stale)

    def last_event_id(self, worker: WorkerId) -> int:
        return self._view(worker).last_event_id

    def worker_blocks(self, worker: WorkerId) -> frozenset[BlockHash]:
        """Blocks the worker has confirmed (valid), including orphans; excludes pending."""
        return frozenset(self._view(worker).valid)

    def pending_blocks(self, worker: WorkerId) -> frozenset[BlockHash]:
        """Blocks awaiting reconciliation at the worker (§6.2): not reusable, not matched."""
        return frozenset(self._view(worker).pending)

    def has_pending(self, worker: WorkerId) -> bool:
        """Whether the worker has any block awaiting reconciliation (O(1); see on_reuse)."""
        return bool(self._view(worker).pending)

    def donor_blocks(self, worker: WorkerId) -> frozenset[BlockHash]:
        """Resident pages kept only as reconcile sources (not in the worker's cache index)."""
        return frozenset(self._view(worker).donors)

    def release_donors(self, worker: WorkerId,
                       block_hashes: Iterable[BlockHash] | None = None) -> int:
        """Forget donor pages (all, or the given ones) once the worker freed them; returns count."""
        view = self._view(worker)
        hs = list(view.donors) if block_hashes is None else \
            [h for h in block_hashes if h in view.donors]
        for h in hs:
            self._drop_block(view, h)
        return len(hs)

    def used_blocks(self, worker: WorkerId) -> int:
        """Valid + pending + donor + reserved by in-flight copies (what occupies its capacity)."""
        view = self._view(worker)
        return view.used_blocks + self._reserved(view)

    def held_nodes(self, worker: WorkerId) -> frozenset[BlockHash]:
        """Nodes whose complete prefix the worker holds (O(valid blocks))."""
        view = self._view(worker)
        nodes = self._nodes
        return frozenset(h for h in view.valid if worker in nodes[h].holders)

    # ------------------------------------------------------------------ nodes
    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, h: object) -> bool:
        return h in self._nodes

    def node_hashes(self) -> Iterator[BlockHash]:
        return iter(self._nodes)

    def collect_unreferenced(self) -> int:
        """Drop every node no worker references (valid, pending or donor), that no copy in
        flight protects and that has no child left (then its parent, and so on), whatever
        its statistics; returns how many went. For a replica that keeps no statistics (the
        scheduler's: it never records requests, never scans): without it every block any
        worker ever cached would stay in its trie for good. The cache manager's trie is
        collected by its scan instead, which keeps a node while its statistics are above
        the scan's threshold (services/cachemgr/scan.py)."""
        if not self._unref:
            return 0
        from services.cachemgr.scan import collect

        return collect(self, math.inf)

    def parent(self, h: BlockHash) -> BlockHash | None:
        p = self._node(h).parent
        return None if p is None else p.hash

    def children(self, h: BlockHash) -> tuple[BlockHash, ...]:
        return tuple(self._node(h).children)

    def prefix_length(self, h: BlockHash) -> int:
        """PrefixLength(z) in tokens: (depth + 1) * block_size."""
        return (self._node(h).depth + 1) * self.block_size

    def holders(self, h: BlockHash) -> frozenset[WorkerId]:
        return frozenset(self._node(h).holders)

    def replica_count(self, h: BlockHash, degree: int) -> int:
        """ReplicaCount(z, C): confirmed degree-C holders of the complete prefix ending at z."""
        return self._node(h).count[self._di(degree)]

    def access(self, h: BlockHash, degree: int) -> float:
        return self._node(h).access[self._di(degree)]

    def missed(self, h: BlockHash, degree: int) -> float:
        return self._node(h).missed[self._di(degree)]

    def set_statistics(self, h: BlockHash, degree: int, *, access: float | None = None,
                       missed: float | None = None) -> None:
        """Overwrite access[z, C] / missed[z, C] (restoring a saved manager; tests)."""
        n, i = self._node(h), self._di(degree)
        for name, v in (("access", access), ("missed", missed)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)
                                  or not v >= 0 or v == float("inf")):
                raise InvalidInput(f"{name} must be a finite number >= 0, got {v!r}")
        if access is not None:
            n.access[i] = float(access)
        if missed is not None:
            n.missed[i] = float(missed)
        self._touched.add(n)  # a value may have grown: the next scan must look at it

    # ------------------------------------------------------------------ events
    def apply(self, event: CacheEvent) -> ApplyOutcome:
        """Apply one worker cache event (design.md "Cache events").

        * unknown worker -> :class:`UnknownWorker`; a chain that contradicts the trie (a hash
          under two parents: a collision or a corrupt worker) -> :class:`InconsistentEvent`;
          both change nothing (the event id is not consumed either, so that worker's next
          event shows a gap and the adapter asks for a snapshot).
        * ``event_id <= last applied`` -> DUPLICATE, no-op.
        * ``event_id > last + 1``, or any event while stale -> GAP: the worker's holdings are
          dropped (they count as misses), it is marked stale, the event is not applied.
        * a ``Stored`` whose ``parent_hash`` the worker is not known to have (neither valid nor
          pending) is treated as a GAP too: we missed the event that stored the parent, and
          guessing would create a holder the worker may not have.
        * a ``Snapshot`` replaces the worker's valid blocks and clears stale, unless it is older
          than what was applied (``last_event_id`` < last applied: DUPLICATE, stale or not:
          the applied events' effects would be lost for good). A stale worker's snapshot must
          also reach the newest event seen but not applied: events after the gap are held back
          (at most :data:`HELD_BACK_MAX`) and applied on top of the snapshot; if some are
          missing (not held back, or not yet arrived: ``last_event_id`` below the newest seen)
          the worker is stale again after it (APPLIED: ask for another snapshot).
          Pending blocks the snapshot does not list stay pending.
        """
        cls = event.__class__
        if cls is not Stored and cls is not Removed and cls is not Cleared \
                and cls is not Snapshot and not isinstance(event, Stored | Removed | Cleared
                                                           | Snapshot):
            raise InvalidInput(f"not a cache event: {type(event).__name__}")
        view = self._view(event.worker)
        if cls is Snapshot or (cls is not Stored and isinstance(event, Snapshot)):
            return self._apply_snapshot(view, event)  # type: ignore[arg-type]
        eid = event.event_id
        if eid <= view.last_event_id:
            return ApplyOutcome.DUPLICATE
        if view.stale or eid > view.last_event_id + 1:
            return self._gap(view, event)
        if cls is Stored or isinstance(event, Stored):
            p = event.parent_hash  # type: ignore[union-attr]
            valid = view.valid
            if p is not None and p not in valid and p not in view.pending:
                return self._gap(view, event)
            self._apply_stored(view, p, event.block_hashes)  # type: ignore[union-attr]
            if self._replicating:
                self._retire_replications(view)
        elif cls is Removed or isinstance(event, Removed):
            drop = self._drop_block
            valid, w, nodes, unref = view.valid, view.worker, self._nodes, self._unref
            multi, di, orphans = self._multi, view.deg_idx, view.orphans
            for h in event.block_hashes:  # type: ignore[union-attr]
                if h in valid:  # the common case of _drop_block, inlined (speed)
                    node = nodes[h]
                    hs = node.holders
                    if w in hs:
                        # _unmark_held(view, node) inlined for the node itself; its subtree
                        # walk is needed only below children the worker also holds (rare: a
                        # worker evicts leaves of its own cache), visited in the same order.
                        hs.discard(w)
                        if len(hs) == 1:
                            multi.discard(node)
                        node.count[di] -= 1
                        for c in node.children.values():
                            if w in c.holders:
                                below = [x for x in node.children.values() if w in x.holders]
                                for x in reversed(below):
                                    self._unmark_held(view, x)
                                break
                    valid.discard(h)
                    if orphans:  # usually empty (the walk above may add to it)
                        orphans.discard(h)
                    node.refs -= 1
                    if not node.refs:
                        unref.add(node)
                else:
                    drop(view, h)
            if self._reclaiming:
                self._retire_reclaims(view)
        else:
            self._drop_all(view, keep_plans=False)
            self._retire_reclaims(view)
        view.last_event_id = eid
        return ApplyOutcome.APPLIED

    def _apply_stored(self, view: WorkerView, p: BlockHash | None,
                      hs: tuple[BlockHash, ...]) -> None:
        """Install a validated ``Stored`` chain (checks the chain first: raises, changes nothing).

        The chain's blocks already in the trie come first (a block after a new one cannot
        exist: it would follow a hash the trie does not have); the new tail is created in one
        pass, each node held iff the block it hangs under is held by the worker.
        """
        nodes = self._nodes
        parent = None if p is None else nodes[p]
        found: list[TrieNode] = []
        expected = parent
        k = 0
        for h in hs:
            n = nodes.get(h)
            if n is None:
                break
            if n.parent is not expected:
                self._check_chain(p, hs)  # raises InconsistentEvent with the details
            found.append(n)
            expected = n
            k += 1
        if k + 1 < len(hs) and not nodes.keys().isdisjoint(hs[k + 1:]):
            self._check_chain(p, hs)  # raises
        for n in found:
            self._add_valid(view, n)
        if k == len(hs):
            return
        prev = found[-1] if found else parent
        w, di = view.worker, view.deg_idx
        # Every new node is held iff the block it hangs under is (then the whole tail is).
        held = prev is None or w in prev.holders
        nd = len(self.degrees)
        dh = self._decays
        ep = len(dh)
        new = hs[k:] if k else hs
        # TrieNode(h, prev, nd, dh) with refs = 1 and the holder added, built attribute by
        # attribute without the __init__ call (speed: ~180k nodes per simulated run); every
        # slot gets exactly the value __init__ and the updates after it would give.
        make = _new_node
        depth = -1 if prev is None else prev.depth
        for h in new:
            node = make(TrieNode)
            node.hash = h
            node.parent = prev
            depth += 1
            node.depth = depth
            node.children = {}
            count = [0] * nd
            if held:
                node.holders = {w}
                count[di] = 1
            else:
                node.holders = set()
            node.count = count
            node._acc = None
            node._mis = None
            node._dh = dh
            node.ep = ep
            node.refs = 1
            nodes[h] = node
            if prev is not None:
                prev.children[h] = node
            prev = node
        view.valid.update(new)  # the same insertions, in the same order, as one call
        if not held:
            view.orphans.update(new)

    def confirm_installed(self, worker: WorkerId, block_hashes: Iterable[BlockHash]) -> int:
        """Mark pending blocks installed without an event (explicit confirmation, §6.2).

        Returns how many became valid; hashes that are not pending at the worker are ignored.
        """
        view = self._view(worker)
        hs = [h for h in block_hashes if h in view.pending]
        # Parents first, so holder marking cascades in one pass.
        for h in sorted(hs, key=lambda x: self._nodes[x].depth):
            self._add_valid(view, self._nodes[h])
        self._retire_replications(view)
        return len(hs)

    # ------------------------------------------------------------------ lookup
    def match(self, block_hashes: Sequence[BlockHash]) -> MatchResult:
        """MatchedPath of a request and each worker's longest held prefix (see MatchResult)."""
        if block_hashes.__class__ is not tuple and (  # a tuple skips the ABC check (speed)
                not isinstance(block_hashes, Sequence) or isinstance(block_hashes, str | bytes)):
            raise InvalidInput(f"block_hashes must be a sequence of ints, got {block_hashes!r}")
        if len(block_hashes) > MAX_REQUEST_BLOCKS:
            raise InvalidInput(f"request has {len(block_hashes)} blocks, over {MAX_REQUEST_BLOCKS}")
        nodes = self._nodes
        path: list[TrieNode] = []
        prev: TrieNode | None = None
        try:
            for h in block_hashes:
                n = nodes.get(h)
                # A hash present under another parent cannot continue this chain.
                if n is None or n.parent is not prev:
                    break
                path.append(n)
                prev = n
        except TypeError as exc:  # unhashable element
            raise InvalidInput(f"block hashes must be ints: {exc}") from exc
        if not path:
            return MatchResult((), _EMPTY)
        held = held_along(path)
        # The matched nodes' hashes are the request's first len(path) hashes (a slice is C).
        k = len(path)
        hashes = block_hashes[:k] if block_hashes.__class__ is tuple \
            else tuple(block_hashes[:k])
        return MatchResult(hashes, MappingProxyType(held), tuple(path), self, self._collections)

    # ------------------------------------------------------------------ Algorithm 1
    def record_request(
        self,
        match: MatchResult,
        chosen_worker: WorkerId,
        chosen_degree: int,
        reused_blocks: int,
        preferred_degree: int,
        request_len_tokens: int,
        predict: Callable[[int, int, int], float],
    ) -> RecordResult:
        """Algorithm 1: per-request statistics update.

        * access[z, C_w] += 1 for z on ReusedPath = the first ``reused_blocks`` nodes of
          ``match.path`` (what the chosen worker actually reuses).
        * for z on MatchedPath with ReplicaCount(z, C_pref) == 0:
          missed[z, C_pref] += Ê_Cpref(L − P0, P0) − Ê_Cpref(L − P1, P1), with
          P0 = PrefixLength(Parent(z)) (0 for a root child) and P1 = PrefixLength(z).

        ``predict(R, P, C)`` is Ê_C (e.g. ``Profile.predict``). Clamping (design.md: a request
        always recomputes its last token): both P0 and P1 are capped at L − 1, so R ≥ 1; a node
        lying wholly beyond L − 1 then adds 0. A negative difference (possible only with a
        profile whose cached-token cost b exceeds the per-token compute saved) adds 0: missed
        measures benefit lost, never a gain.

        Nodes of ``match.path`` garbage-collected since the match end the path there.
        """
        view = self._view(chosen_worker)
        if chosen_degree != view.degree:
            raise InvalidInput(
                f"chosen_degree {chosen_degree!r} is not {chosen_worker}'s degree {view.degree}")
        pi = self._di(preferred_degree)
        if not isinstance(match, MatchResult):
            raise InvalidInput(f"match must be a MatchResult, got {type(match).__name__}")
        if isinstance(reused_blocks, bool) or not isinstance(reused_blocks, int) \
                or not 0 <= reused_blocks <= match.matched_blocks:
            raise InvalidInput(f"reused_blocks must be an integer in [0, "
                               f"{match.matched_blocks}], got {reused_blocks!r}")
        if isinstance(request_len_tokens, bool) or not isinstance(request_len_tokens, int) \
                or request_len_tokens < 1:
            raise InvalidInput(f"request_len_tokens must be an integer >= 1, "
                               f"got {request_len_tokens!r}")
        if not callable(predict):
            raise InvalidInput("predict must be callable as predict(R, P, C)")
        nodes: list[TrieNode] | tuple[TrieNode, ...]
        if match._trie is self and match._gen == self._collections:
            # Nothing collected since this trie matched: every matched node is still the live
            # node of its hash, so the walk below would find exactly these (speed).
            nodes = match._nodes
        else:
            nodes = []
            prev: TrieNode | None = None
            get = self._nodes.get
            for h in match.path:
                n = get(h)
                if n is None or n.parent is not prev:
                    break
                nodes.append(n)
                prev = n
        # Compute everything first: predict may raise, and then nothing may have changed.
        L, B, cpref = request_len_tokens, self.block_size, self.degrees[pi]
        gains: list[tuple[TrieNode, float]] = []
        # Ê_Cpref(L − P, P) by P: consecutive nodes share a prefix length (P1 of one is P0 of
        # the next), so each value is computed once (predict is a pure model).
        memo: dict[int, float] = {}
        for n in nodes:
            if n.count[pi] != 0:
                continue
            p0 = min(n.depth * B, L - 1)
            p1 = min((n.depth + 1) * B, L - 1)
            benefit = 0.0
            if p1 > p0:
                try:
                    e0 = memo.get(p0)
                    if e0 is None:
                        e0 = memo[p0] = float(predict(L - p0, p0, cpref))
                    e1 = memo.get(p1)
                    if e1 is None:
                        e1 = memo[p1] = float(predict(L - p1, p1, cpref))
                    benefit = e0 - e1
                except VertumnusError:
                    raise
                except Exception as exc:  # a user-supplied model failing is bad input here
                    raise InvalidInput(f"predict failed: {exc!r}") from exc
                if not benefit > 0.0:  # also rejects NaN
                    benefit = 0.0
            gains.append((n, benefit))
        ci = view.deg_idx
        reused = nodes[: reused_blocks]
        e = len(self._decays)
        nd = len(self.degrees)
        # The scan index needs only nodes now above the last scan's thresholds (see _hot).
        touched = self._touched
        th_mis, th_acc = self._hot_th
        for n in reused:
            if n.ep != e:
                n.catch_up()
            a = n._acc
            if a is None:
                a = n._acc = [0.0] * nd
            a[ci] += 1.0
            if a[ci] > th_acc:
                touched.add(n)
        total = 0.0
        for n, b in gains:
            if n.ep != e:
                n.catch_up()
            m = n._mis
            if m is None:
                m = n._mis = [0.0] * nd
            m[pi] += b
            if m[pi] > th_mis:
                touched.add(n)
            total += b
        return RecordResult(len(reused), len(gains), total)

    # ------------------------------------------------------------------ Algorithm 2
    def scan(self, config: ScanConfig, load: Mapping[WorkerId, float] | None = None,
             in_use: Mapping[WorkerId, Iterable[BlockHash]] | None = None,
             *, lists: bool = True) -> ScanResult:
        """Algorithm 2 plus §7.2's selection; see :func:`services.cachemgr.scan.run_scan`.

        ``lists=False``: same actions, decay and collection, but the result's inter / intra /
        reclaim lists are left empty -- the scan then costs O(changed and multi-holder nodes)
        instead of O(trie) (what a caller that only needs the actions should use).
        """
        from services.cachemgr.scan import run_scan

        return run_scan(self, config, load or {}, in_use or {}, lists=lists)

    # ------------------------------------------------------------------ §6.2 reconcile
    def reconcile_split(self, parent: WorkerId, children: tuple[WorkerId, WorkerId],
                        capacity_blocks: Mapping[WorkerId, int],
                        demand: Mapping[BlockHash, float] | None = None) -> SplitPlan:
        """See :func:`services.cachemgr.reconcile.reconcile_split`."""
        from services.cachemgr.reconcile import reconcile_split

        return reconcile_split(self, parent, children, capacity_blocks, demand)

    def reconcile_merge(self, children: tuple[WorkerId, WorkerId], parent: WorkerId,
                        capacity_blocks: int) -> MergePlan:
        """See :func:`services.cachemgr.reconcile.reconcile_merge`."""
        from services.cachemgr.reconcile import reconcile_merge

        return reconcile_merge(self, children, parent, capacity_blocks)

    def on_reuse(self, worker: WorkerId,
                 block_hashes: Sequence[BlockHash]) -> tuple[Replicate, ...]:
        """Lazy reconcile copies for a request routed to ``worker``; see reconcile.on_reuse."""
        from services.cachemgr.reconcile import on_reuse

        return on_reuse(self, worker, block_hashes)

    # ------------------------------------------------------------------ in flight
    def inflight(self) -> tuple[CacheAction, ...]:
        """Issued operations not yet confirmed or retired."""
        out: list[CacheAction] = []
        for acts in self._replicating.values():
            out.extend(acts.values())
        for racts in self._reclaiming.values():
            out.extend(racts.values())
        return tuple(out)

    def replication_done(self, action: Replicate) -> bool:
        """The transfer layer finished ``action``. Retires it; returns False if not in flight.

        NOTE: this does not make the replica visible -- only the destination's ``Stored``
        event does (which usually retires the action before this call).
        """
        return self._retire(self._replicating, action.dest, action)

    def replication_failed(self, action: Replicate) -> bool:
        """The transfer failed; the next scan (or reuse, for reconcile) may issue it again."""
        return self._retire(self._replicating, action.dest, action)

    def reclaim_failed(self, action: Reclaim) -> bool:
        """The worker refused or lost the deletion; a later scan may choose again."""
        return self._retire(self._reclaiming, action.worker, action)

    def reclaim_executed(self, action: Reclaim, removed: int) -> bool:
        """The worker executed ``action`` and removed ``removed`` of its blocks (a reply's
        ``blocks_done``): a pinned block, or one with a child it must keep, stays, and with
        it every ancestor. Returns False if ``action`` is not in flight.

        Nothing removed: retired now (no ``Removed`` event will come). Otherwise the reclaim
        stays in flight only until the ``Removed`` events of what went are applied: a worker
        removes deepest first and stops below a block it keeps, so those are the first
        ``removed`` of ``action.blocks`` (node first). Waiting for every block of the action,
        a partial one would stay in flight for as long as the kept blocks stay cached,
        keeping them from being chosen again and from serving as a copy source, and counting
        them as already gone in the last-replica check of the other holders.
        """
        acts = self._reclaiming.get(action.worker)
        if not acts or acts.get(action.node_hash) != action:
            return False
        if removed <= 0:
            return self._retire(self._reclaiming, action.worker, action)
        if removed < len(action.blocks):
            acts[action.node_hash] = Reclaim(action.worker, action.node_hash,
                                             action.blocks[:removed])
        view = self._workers.get(action.worker)
        if view is not None:  # its events may be applied already
            self._retire_reclaims(view)
        return True

    # ------------------------------------------------------------------ package-private
    def _view(self, worker: WorkerId) -> WorkerView:
        try:
            return self._workers[worker]
        except (KeyError, TypeError):
            raise UnknownWorker(f"unknown worker {worker!r}") from None

    def _di(self, degree: int) -> int:
        try:
            return self._deg_idx[degree]
        except (KeyError, TypeError):
            raise InvalidInput(f"degree {degree!r} is not one of {self.degrees}") from None

    def _node(self, h: BlockHash) -> TrieNode:
        try:
            return self._nodes[h]
        except (KeyError, TypeError):
            raise InvalidInput(f"block {h!r} is not in the prefix trie") from None

    def _create(self, h: BlockHash, parent: TrieNode | None) -> TrieNode:
        # NOTE: refs == 0 here, yet not in _unref: every caller adds it as valid right away,
        # except reconcile.mark_reconciled, which adds it to _unref itself (a path link).
        node = TrieNode(h, parent, len(self.degrees), self._decays)
        self._nodes[h] = node
        if parent is not None:
            parent.children[h] = node
        return node

    def _check_chain(self, parent: BlockHash | None, chain: Sequence[BlockHash]) -> None:
        nodes = self._nodes
        expected = parent
        for h in chain:
            n = nodes.get(h)
            if n is not None:
                have = None if n.parent is None else n.parent.hash
                if have != expected:
                    raise InconsistentEvent(
                        f"block {h} follows {have} in the trie but {expected} in the event")
            expected = h

    def _gap(self, view: WorkerView, event: CacheEvent) -> ApplyOutcome:
        """``event`` (id above the last applied) cannot be applied: the view goes stale and
        the event is held back for the snapshot that ends the gap (``apply``)."""
        self._mark_stale(view)
        eid = event.event_id
        if eid > view.seen_event_id:
            view.seen_event_id = eid
        held = view.held_back
        if eid in held or len(held) < HELD_BACK_MAX:
            held[eid] = event
        return ApplyOutcome.GAP

    def _apply_snapshot(self, view: WorkerView, ev: Snapshot) -> ApplyOutcome:
        if ev.last_event_id < view.last_event_id:
            return ApplyOutcome.DUPLICATE
        parents = dict(ev.blocks)
        order = topological_order(parents)
        assert order is not None  # Snapshot validated acyclicity
        nodes = self._nodes
        for h in order:
            n = nodes.get(h)
            if n is not None:
                have = None if n.parent is None else n.parent.hash
                if have != parents[h]:
                    raise InconsistentEvent(
                        f"snapshot of {view.worker}: block {h} under {parents[h]}, "
                        f"trie has it under {have}")
        self._drop_all(view, keep_plans=True)
        for h in order:
            n = nodes.get(h)
            if n is None:
                p = parents[h]
                n = self._create(h, None if p is None else nodes[p])
            self._add_valid(view, n)
        view.last_event_id = ev.last_event_id
        if ev.last_event_id > view.seen_event_id:
            view.seen_event_id = ev.last_event_id
        view.stale = False
        self._retire_replications(view)
        self._retire_reclaims(view)
        # The events seen after the gap, on top of the snapshot (those it covers are
        # duplicates); a missing one makes the view stale again, holding back the rest.
        held, view.held_back = view.held_back, {}
        for eid in sorted(held):
            if eid > view.last_event_id:
                self.apply(held[eid])
        if not view.stale and view.last_event_id < view.seen_event_id:
            # An event seen but not held back (HELD_BACK_MAX) or not covered: ask again.
            self._mark_stale(view)
        return ApplyOutcome.APPLIED

    def _mark_stale(self, view: WorkerView) -> None:
        # Its view can no longer be trusted: drop every confirmed block (they count as misses).
        # Pending plans stay; in-flight operations stay (their own events will retire them, or
        # the snapshot will).
        self._drop_all(view, keep_plans=True)
        view.stale = True

    def _add_valid(self, view: WorkerView, node: TrieNode) -> None:
        h = node.hash
        if h in view.valid:
            return
        if view.pending.pop(h, _ABSENT) is _ABSENT:
            if h in view.donors:
                view.donors.discard(h)
            else:
                if not node.refs:
                    self._unref.discard(node)
                node.refs += 1
        view.valid.add(h)
        parent = node.parent
        if parent is None or view.worker in parent.holders:
            self._mark_held(view, node)
        else:
            view.orphans.add(h)

    def _mark_held(self, view: WorkerView, node: TrieNode) -> None:
        w, di, orphans = view.worker, view.deg_idx, view.orphans
        stack = [node]
        multi = self._multi
        while stack:
            n = stack.pop()
            hs = n.holders
            hs.add(w)
            if len(hs) == 2:
                multi.add(n)
            n.count[di] += 1
            orphans.discard(n.hash)
            if orphans:  # only then can a valid child be waiting for this link
                for c in n.children.values():
                    if c.hash in orphans:
                        stack.append(c)

    def _unmark_held(self, view: WorkerView, node: TrieNode) -> None:
        w, di = view.worker, view.deg_idx
        multi, valid, orphans = self._multi, view.valid, view.orphans
        stack = [node]
        while stack:
            n = stack.pop()
            hs = n.holders
            hs.discard(w)
            if len(hs) == 1:
                multi.discard(n)
            n.count[di] -= 1
            h = n.hash
            if h in valid:
                orphans.add(h)
            ch = n.children
            if ch:
                for c in ch.values():
                    if w in c.holders:
                        stack.append(c)

    def _drop_block(self, view: WorkerView, h: BlockHash) -> None:
        if h in view.valid:
            node = self._nodes[h]
            if view.worker in node.holders:
                self._unmark_held(view, node)
            view.valid.discard(h)
            view.orphans.discard(h)
        elif h in view.pending:
            del view.pending[h]
            node = self._nodes[h]
        elif h in view.donors:
            view.donors.discard(h)
            node = self._nodes[h]
        else:
            return
        node.refs -= 1
        if not node.refs:
            self._unref.add(node)

    def _add_pending(self, view: WorkerView, node: TrieNode, source: WorkerId | None) -> None:
        h = node.hash
        if h in view.valid:
            return
        if h in view.donors:
            view.donors.discard(h)
        elif h not in view.pending:
            if not node.refs:
                self._unref.discard(node)
            node.refs += 1
        view.pending[h] = source

    def _add_donor(self, view: WorkerView, node: TrieNode) -> None:
        h = node.hash
        if h in view.valid or h in view.pending or h in view.donors:
            return
        if not node.refs:
            self._unref.discard(node)
        node.refs += 1
        view.donors.add(h)

    def _drop_all(self, view: WorkerView, *, keep_plans: bool) -> None:
        nodes, w, di = self._nodes, view.worker, view.deg_idx
        multi, unref = self._multi, self._unref
        for h in view.valid:
            n = nodes[h]
            hs = n.holders
            if w in hs:
                hs.discard(w)
                if len(hs) == 1:
                    multi.discard(n)
                n.count[di] -= 1
            n.refs -= 1
            if not n.refs:
                unref.add(n)
        view.valid.clear()
        view.orphans.clear()
        if not keep_plans:
            for h in view.pending:
                n = nodes[h]
                n.refs -= 1
                if not n.refs:
                    unref.add(n)
            view.pending.clear()
            for h in view.donors:
                n = nodes[h]
                n.refs -= 1
                if not n.refs:
                    unref.add(n)
            view.donors.clear()

    def _reserved(self, view: WorkerView) -> int:
        acts = self._replicating.get(view.worker)
        if not acts:
            return 0
        missing: set[BlockHash] = set()
        for a in acts.values():
            # Pending blocks already count in used_blocks; count only what is new here.
            missing.update(h for h in a.blocks if h not in view.valid and h not in view.pending)
        return len(missing)

    def _begin(self, action: CacheAction) -> None:
        if isinstance(action, Replicate):
            self._replicating.setdefault(action.dest, {})[action.node_hash] = action
        else:
            self._reclaiming.setdefault(action.worker, {})[action.node_hash] = action

    def _retire(self, table: dict[WorkerId, dict[BlockHash, CacheAction]], worker: WorkerId,
                action: CacheAction) -> bool:
        acts = table.get(worker)
        if not acts or acts.get(action.node_hash) != action:
            return False
        del acts[action.node_hash]
        if not acts:
            del table[worker]
        return True

    def _retire_replications(self, view: WorkerView) -> None:
        acts = self._replicating.get(view.worker)
        if not acts:
            return
        for key, a in list(acts.items()):
            if all(h in view.valid for h in a.blocks):
                del acts[key]
        if not acts:
            del self._replicating[view.worker]

    def _retire_reclaims(self, view: WorkerView) -> None:
        acts = self._reclaiming.get(view.worker)
        if not acts:
            return
        for key, a in list(acts.items()):
            if not any(h in view.valid for h in a.blocks):
                del acts[key]
        if not acts:
            del self._reclaiming[view.worker]


_ABSENT: Final = object()

_new_node: Final = object.__new__
"""Allocates a TrieNode without running ``__init__`` (the hot path sets every slot itself)."""
