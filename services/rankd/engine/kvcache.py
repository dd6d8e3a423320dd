"""Paged, block-granular prefix KV cache of one rank of a CP worker.

Two parts, for a reason:

* :class:`PrefixIndex` — the worker-level metadata (which chained block hashes are cached,
  their parent, page index, LRU order) and the cache events. NOTE: every rank of a worker keeps
  an identical copy, because every rank performs the same operations in the same order
  (lookup, store, evict, import, clear are SPMD calls with identical arguments); eviction
  decisions therefore agree on all ranks without any communication.
* :class:`PagePool` — this rank's KV pages: one preallocated tensor
  (pages, layers, 2, B, Hkv, D) and a free list, holding only the pages it owns: page p of a
  prefix (the p-th block, 0-based) lives on CP rank p mod C (cp-attention.md rule 11). In an
  engine, every cache of the rank (the active worker's, the retired ones) shares one pool.

Capacity is ``pages_per_rank`` per rank; the index tracks every rank's use (each rank's copy
holds all C counters, so ranks whose page needs differ -- a chain whose length is not a
multiple of C -- still decide alike). A chain is stored up to its first page whose rank cannot
get room; eviction is planned before anything is dropped and frees pages only for the pages
that are stored (see :meth:`PrefixIndex._make_room`). Eviction is LRU over *leaves* of the
prefix tree (a block with no cached child), so a cached prefix never loses an inner block: it
shrinks from its tail. LRU uses a logical clock and a heap with lazy deletion (O(log n) per
touch; stale entries are skipped and the heap is compacted when it grows past 4x the live
blocks); a store that must evict plans on a copy of the heap (O(n log n), once or twice).

Events (drained by the adapter with :meth:`PrefixIndex.take_events`, never published here):
``{"type": "stored", "worker", "event_id", "parent_hash", "block_hashes"}``,
``{"type": "removed", "worker", "event_id", "block_hashes"}``,
``{"type": "cleared", "worker", "event_id"}``; event_id is per-worker monotonic from 1.

Re-shard (degree C -> C'): :meth:`RankKVCache.export_pages` on every source rank, move the
pages (any transport), :meth:`RankKVCache.import_prefix` on every destination rank with the
chain metadata; each destination rank keeps the pages p ≡ its rank (mod C'), so it needs to
be sent only those (TorchWorld.copy_prefix sends each member its own share).
"""

from __future__ import annotations

import heapq
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from services.rankd.engine.errors import KVFormatError
from services.rankd.engine.model import KVLayers
from shared.blockhash import chain_hashes
from shared.ids import BlockHash, InvalidInput, WorkerId

Event = dict[str, Any]


@dataclass(slots=True)
class _Node:
    hash: int
    parent: int | None
    page: int  # block index in its sequence: owned by CP rank page % degree
    children: int = 0
    stamp: int = 0


@dataclass(frozen=True)
class MatchResult:
    """Longest cached prefix of a request: ``block_hashes`` (root first), ``prefix_len`` tokens."""

    block_hashes: list[BlockHash]
    prefix_len: int


class PrefixIndex:
    """Worker-level metadata of the cached prefixes (identical on every rank of the worker)."""

    def __init__(self, worker: WorkerId, degree: int, pages_per_rank: int) -> None:
        if degree < 1 or pages_per_rank < 1:
            raise InvalidInput("degree and pages_per_rank must be >= 1")
        self.worker = worker
        self.degree = degree
        self.pages_per_rank = pages_per_rank
        self._nodes: dict[int, _Node] = {}
        self._used = [0] * degree
        self._clock = 0
        self._heap: list[tuple[int, int]] = []  # (stamp, hash) of leaves, lazily invalidated
        self._event_id = 0
        self._events: list[Event] = []

    # --- queries --------------------------------------------------------------------------
    def __contains__(self, h: int) -> bool:
        return h in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def blocks(self) -> frozenset[BlockHash]:
        return frozenset(BlockHash(h) for h in self._nodes)

    def parent_of(self, h: int) -> int | None:
        return self._nodes[h].parent

    def owner(self, h: int) -> int:
        return self._nodes[h].page % self.degree

    def used(self, rank: int) -> int:
        return self._used[rank]

    def match(self, hashes: list[BlockHash]) -> list[BlockHash]:
        """Longest prefix of ``hashes`` (a chain from the root) that is cached; touches it."""
        out: list[BlockHash] = []
        parent = None
        for h in hashes:
            n = self._nodes.get(h)
            if n is None or n.parent != parent:
                break
            out.append(h)
            parent = h
        self._touch(out)
        return out

    def snapshot(self) -> Event:
        return {
            "type": "snapshot",
            "worker": self.worker,
            "last_event_id": self._event_id,
            "blocks": [[n.hash, n.parent] for n in self._nodes.values()],
        }

    def take_events(self) -> list[Event]:
        ev, self._events = self._events, []
        return ev

    # --- mutations ---------------------------------------------------------------------------
    def insert(
        self,
        parent: int | None,
        hashes: list[BlockHash],
        protect: set[int] = frozenset(),  # type: ignore[assignment]
    ) -> tuple[list[BlockHash], list[BlockHash]]:
        """Cache the chain ``hashes`` under ``parent`` (None = root; else must be cached).

        Stores the longest prefix of ``hashes`` that fits, evicting LRU leaves (never
        ``protect`` nor the parent path) for those pages only: a page that cannot be stored
        costs no other rank a page. Blocks already cached are skipped (touched). Returns
        (stored, evicted) and emits the events. Deterministic in the index's state and the
        arguments: every rank of the worker reaches the same outcome.
        """
        if parent is not None and parent not in self._nodes:
            raise InvalidInput(f"parent block {parent} is not cached")
        base = 0 if parent is None else self._nodes[parent].page + 1
        path = self._path(parent)
        # Skip the already-cached head of the chain (cached under the block before it).
        nodes = self._nodes
        i = 0
        while i < len(hashes) and hashes[i] in nodes and nodes[hashes[i]].parent == parent:
            parent = hashes[i]
            i += 1
        # NOTE: stop before a block that is cached elsewhere or repeats (a bad or colliding
        # chain from the request): storing it would overwrite its node and leak its page and
        # its old parent's child count (a never-evictable block), or make it its own parent.
        new: list[BlockHash] = []
        seen: set[int] = set()
        for h in hashes[i:]:
            if h in nodes or h in seen:
                break
            seen.add(h)
            new.append(h)
        first_page = base + i
        keep = set(protect) | set(path) | set(hashes[:i])
        evicted = self._make_room(first_page, len(new), keep)
        n_fit = self._fit(first_page, len(new))
        new = new[:n_fit]
        self._clock += 1
        for j, h in enumerate(new):
            if parent is not None:
                self._nodes[parent].children += 1
            self._nodes[h] = _Node(h, parent, first_page + j, stamp=self._clock)
            self._used[(first_page + j) % self.degree] += 1
            parent = h
        self._touch(list(path) + list(hashes[:i]) + new)
        if evicted:
            self._emit({"type": "removed", "block_hashes": evicted})
        if new:
            self._emit(
                {"type": "stored", "parent_hash": self._nodes[new[0]].parent, "block_hashes": new}
            )
        return new, evicted

    def remove(self, hashes: list[BlockHash]) -> list[BlockHash]:
        """Exact-key deletion (reclaim): drop ``hashes`` and every cached descendant."""
        doomed: set[int] = set()
        for h in hashes:
            if h in self._nodes:
                doomed.add(h)
        # descendants: iterate to a fixed point (prefix trees are shallow in tests/production)
        changed = True
        while changed:
            changed = False
            for n in self._nodes.values():
                if n.parent in doomed and n.hash not in doomed:
                    doomed.add(n.hash)
                    changed = True
        order = sorted(doomed, key=lambda h: -self._nodes[h].page)  # leaves first
        for h in order:
            self._drop(h)
        if order:
            self._emit({"type": "removed", "block_hashes": order})
        return order

    def clear(self) -> list[BlockHash]:
        gone = list(self._nodes)
        self._nodes.clear()
        self._heap.clear()
        self._used = [0] * self.degree
        self._emit({"type": "cleared"})
        return gone

    # --- internals -------------------------------------------------------------------------
    def _path(self, h: int | None) -> list[int]:
        out = []
        while h is not None:
            out.append(h)
            h = self._nodes[h].parent
        return out[::-1]

    def _touch(self, hashes: list[int]) -> None:
        if not hashes:
            return
        self._clock += 1
        for h in hashes:
            n = self._nodes[h]
            n.stamp = self._clock
            if n.children == 0:
                heapq.heappush(self._heap, (n.stamp, h))
        if len(self._heap) > 4 * len(self._nodes) + 64:
            self._heap = [(n.stamp, n.hash) for n in self._nodes.values() if n.children == 0]
            heapq.heapify(self._heap)

    def _need(self, first_page: int, n: int) -> list[int]:
        need = [0] * self.degree
        for p in range(first_page, first_page + n):
            need[p % self.degree] += 1
        return need

    def _fit(self, first_page: int, n: int, used: list[int] | None = None) -> int:
        """How many of the pages ``first_page ..`` (at most ``n``) fit, in order, given the
        per-rank ``used`` counts (default: the current ones)."""
        free = [self.pages_per_rank - u for u in (self._used if used is None else used)]
        for k in range(n):
            r = (first_page + k) % self.degree
            if free[r] == 0:
                return k
            free[r] -= 1
        return n

    def _plan_evictions(
        self, first_page: int, n: int, keep: set[int]
    ) -> tuple[list[BlockHash], list[int]]:
        """Dry run of LRU eviction for the ``n`` pages from ``first_page``: (the leaves to
        evict, in a valid order -- each is a leaf once the ones before it are gone; the
        per-rank use afterwards). Changes nothing.

        Pops LRU leaves (on a copy of the heap) and evicts one only when its owner rank is
        still short for these pages and it is not in ``keep``; evicting a leaf may expose its
        parent, which then competes by its own stamp. A rank whose every page is kept (or
        only reachable through leaves on ranks that are no longer short) stays short: the
        caller decides what to do with a plan that does not make room for all ``n``.
        """
        need = self._need(first_page, n)
        used = list(self._used)
        cap = self.pages_per_rank
        evicted: list[BlockHash] = []
        if all(need[r] <= cap - used[r] for r in range(self.degree)):
            return evicted, used  # the common case: room already, no heap copy
        nodes = self._nodes
        heap = list(self._heap)  # a copy of a heap is a heap
        gone: set[int] = set()
        lost_children: dict[int, int] = {}  # parent -> children evicted in this plan

        def children(h: int) -> int:
            return nodes[h].children - lost_children.get(h, 0)

        # NOTE: an entry skipped because its rank is not short (or it is kept) is dropped from
        # the copy for good, as the real heap did before: a rank's shortness only decreases.
        while heap and any(need[r] > cap - used[r] for r in range(self.degree)):
            stamp, h = heapq.heappop(heap)
            node = nodes.get(h)
            if node is None or h in gone or children(h) or node.stamp != stamp:
                continue  # stale entry
            r = node.page % self.degree
            if h in keep or need[r] <= cap - used[r]:
                continue
            gone.add(h)
            used[r] -= 1
            evicted.append(BlockHash(h))
            parent = node.parent
            if parent is not None:
                lost_children[parent] = lost_children.get(parent, 0) + 1
                if children(parent) == 0:
                    heapq.heappush(heap, (nodes[parent].stamp, parent))
        return evicted, used

    def _make_room(self, first_page: int, n: int, keep: set[int]) -> list[BlockHash]:
        """Evict LRU leaves (never ``keep``) for the ``n`` new pages from ``first_page``;
        returns the evicted blocks (leaves first).

        Only the leading part of a chain that fits is stored (:meth:`_fit`), so eviction is
        planned first and evicts only for the pages that will be stored: when one rank cannot
        get room (its pages are all kept, e.g. rankd's protected blocks), the other ranks do
        not give up pages for pages of the chain beyond that point, which would be freed for
        nothing (cache space lost, "removed" events for blocks nobody replaced). Every rank
        runs this on an identical index, so every rank evicts the same blocks.
        """
        plan, used = self._plan_evictions(first_page, n, keep)
        k = self._fit(first_page, n, used)
        if k < n:
            # Plan again for the k pages that fit: it evicts exactly each rank's shortfall.
            lean, lean_used = self._plan_evictions(first_page, k, keep)
            if self._fit(first_page, k, lean_used) == k:
                plan = lean
            else:
                # Rare: the k pages fit only thanks to a parent exposed by evicting a leaf on a
                # rank short for the later pages alone. Keep the plan's shortest head that
                # still fits k (a head of a valid eviction order is valid).
                used = list(self._used)
                m = 0
                while self._fit(first_page, k, used) < k:
                    used[self._nodes[plan[m]].page % self.degree] -= 1
                    m += 1
                plan = plan[:m]
        for h in plan:
            parent = self._nodes[h].parent
            self._drop(h)
            if parent is not None and self._nodes[parent].children == 0:
                p = self._nodes[parent]
                heapq.heappush(self._heap, (p.stamp, p.hash))
        return plan

    def _drop(self, h: int) -> None:
        n = self._nodes.pop(h)
        self._used[n.page % self.degree] -= 1
        if n.parent is not None and n.parent in self._nodes:
            self._nodes[n.parent].children -= 1

    def _emit(self, ev: Event) -> None:
        self._event_id += 1
        self._events.append(
            {"type": ev.pop("type"), "worker": self.worker, "event_id": self._event_id, **ev}
        )


class PagePool:
    """One rank's KV pages: one preallocated (pages, layers, 2, B, Hkv, D) tensor and a free
    list, shared by every cache of the rank (its active worker's and the retired ones).

    Why one per rank: a rank is a member of one lattice worker per degree, and a split or
    merge gives it a new cache while the old one stays resident (retired); a pool per cache
    would multiply the rank's KV memory by the number of degrees (on a GPU sized for
    ``pages_per_rank``, the first switch would run out of memory). A slot is keyed by block
    hash and counts the caches holding it: a hash names a chain of tokens, hence also their
    positions, so a block's page is the same KV in every cache of the rank and a cache that
    installs a page another cache here holds shares its slot instead of copying it.

    Room: a cache's index never holds more than its ``pages_per_rank`` pages on a rank, and
    the pool has at least that many slots. When a page is needed and no slot is free,
    :attr:`reclaim` (set by the engine: drop a retired cache holding a page the active one
    does not) is called until one is; the cache it cannot drop (the active one) fits by the
    index's own accounting.
    """

    def __init__(
        self,
        pages: int,
        layers: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        if pages < 1:
            raise InvalidInput(f"a page pool needs >= 1 page, got {pages}")
        self.data = torch.zeros(
            pages, layers, 2, block_size, kv_heads, head_dim, dtype=dtype, device=device
        )
        self._free = list(range(pages - 1, -1, -1))
        self._slot: dict[int, int] = {}
        self._refs: dict[int, int] = {}
        self.reclaim: Callable[[], bool] | None = None
        """Drops one holder of a page (and returns True; called again while no slot is
        free: a page two retired caches share needs both dropped), or returns False when
        nothing can be dropped."""

    @property
    def capacity(self) -> int:
        return self.data.shape[0]

    @property
    def free(self) -> int:
        return len(self._free)

    def __contains__(self, h: int) -> bool:
        return h in self._slot

    def __len__(self) -> int:
        """Slots in use (a page shared by several caches counts once)."""
        return len(self._slot)

    def holders(self, h: int) -> int:
        """How many caches of the rank hold page ``h`` (0: not resident)."""
        return self._refs.get(h, 0)

    def acquire(self, h: int, kv: Tensor | None) -> None:
        """One more holder of page ``h``. Not resident: a slot is taken (reclaiming one when
        none is free) and ``kv`` (layers, 2, B, Hkv, D) copied in. Resident: shared as is
        (``kv`` may then be None)."""
        if h in self._slot:
            self._refs[h] += 1
            return
        if kv is None:
            raise KVFormatError(f"page {h} is not resident and no KV was given")
        while not self._free:  # each reclaim drops a holder: this ends
            if self.reclaim is None or not self.reclaim():
                # The index guaranteed room for the caches that cannot be dropped: a bug.
                raise RuntimeError("no free KV page and nothing to reclaim")
        slot = self._free.pop()
        self.data[slot].copy_(kv)
        self._slot[h] = slot
        self._refs[h] = 1

    def get(self, h: int) -> Tensor:
        return self.data[self._slot[h]]

    def release(self, h: int) -> None:
        """One holder fewer of page ``h``; its slot is free once none is left."""
        n = self._refs.get(h)
        if n is None:
            return
        if n > 1:
            self._refs[h] = n - 1
            return
        del self._refs[h]
        self._free.append(self._slot.pop(h))


@dataclass(frozen=True)
class Page:
    """One exported page: block ``hash`` (child of ``parent``), block index ``page``,
    kv (layers, 2, B, Hkv, D)."""

    hash: BlockHash
    parent: BlockHash | None
    page: int
    kv: Tensor


@dataclass
class Lookup:
    """A request's cache hit on this rank: matched hashes, P, the local shard
    (layers, 2, T_local, Hkv, D) of pages p ≡ rank (mod C), and the request's full-block chain."""

    match: MatchResult
    local_kv: Tensor | None
    chain: list[BlockHash] = field(default_factory=list)


class RankKVCache:
    """Prefix cache of CP rank ``rank`` of worker ``worker`` (degree ``degree``).

    Every method is an SPMD call: all ranks of the worker call it with the same arguments, in
    the same order (their :class:`PrefixIndex` copies stay identical).
    """

    def __init__(
        self,
        worker: WorkerId,
        degree: int,
        rank: int,
        block_size: int,
        pages_per_rank: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        pool: PagePool | None = None,
    ) -> None:
        if not 0 <= rank < degree:
            raise InvalidInput(f"rank {rank} outside [0, {degree})")
        if block_size < 1:
            raise InvalidInput(f"block_size must be >= 1, got {block_size}")
        self.rank, self.degree, self.block_size = rank, degree, block_size
        self.shape = (layers, 2, block_size, kv_heads, head_dim)
        self.index = PrefixIndex(worker, degree, pages_per_rank)
        self.last_evicted: list[BlockHash] = []  # what the last store() evicted to make room
        if pool is None:
            pool = PagePool(pages_per_rank, layers, block_size, kv_heads, head_dim, dtype, device)
        elif tuple(pool.data.shape[1:]) != self.shape or pool.data.dtype != dtype:
            raise InvalidInput(f"page pool of {tuple(pool.data.shape[1:])} {pool.data.dtype} "
                               f"pages for a cache of {self.shape} {dtype}")
        elif pool.capacity < pages_per_rank:
            raise InvalidInput(f"page pool of {pool.capacity} pages for a cache of "
                               f"{pages_per_rank} pages per rank")
        self.pool = pool
        self._mine: set[int] = set()  # the pages this cache holds on this rank (pool slots)

    @property
    def worker(self) -> WorkerId:
        return self.index.worker

    def take_events(self) -> list[Event]:
        return self.index.take_events()

    def blocks(self) -> frozenset[BlockHash]:
        """Every cached block hash (worker-level: identical on every rank)."""
        return self.index.blocks()

    def lookup(
        self,
        token_ids: Tensor | list[int],
        *,
        chain: list[BlockHash] | None = None,
        max_prefix: int | None = None,
    ) -> Lookup:
        """Longest cached prefix of a request, keeping R >= 1: P = min(matched·B, n − 1), so
        when every full block matches and n is a multiple of B the last page is reused
        partially (its first B − 1 tokens) and only the last token is recomputed — the same
        rule as rankd's BlockCache (``min(hit·B, n − 1)``).

        ``chain``: the request's full-block hashes (root first, at most n // B of them) used
        as cache keys instead of hashing ``token_ids`` here — rankd passes the gateway's hash
        chain so that this cache and its own BlockCache name blocks alike; blocks beyond the
        chain are neither reused nor stored. ``max_prefix``: reuse at most this many tokens
        (rankd's decided P). Raises InvalidInput for a chain longer than the full blocks or a
        negative ``max_prefix``.
        """
        ids = torch.as_tensor(token_ids).reshape(-1)
        n = ids.numel()
        full = n // self.block_size
        if chain is None:
            chain = chain_hashes(ids.tolist(), self.block_size)
        elif len(chain) > full:
            raise InvalidInput(
                f"{len(chain)} block hashes for {n} tokens ({full} full blocks of "
                f"{self.block_size})"
            )
        limit = max(0, n - 1)
        if max_prefix is not None:
            if max_prefix < 0:
                raise InvalidInput(f"max_prefix must be >= 0, got {max_prefix}")
            limit = min(limit, max_prefix)
        usable = list(chain[: -(-limit // self.block_size)])  # blocks touching [0, limit)
        matched = self.index.match(usable)
        p = min(len(matched) * self.block_size, limit)
        local = self._local_shard(matched, p)
        return Lookup(MatchResult(matched, p), local, list(chain))

    def _local_shard(self, matched: list[BlockHash], prefix_len: int) -> Tensor | None:
        """This rank's pages of the matched chain, the last page cut to the prefix's end."""
        if not matched:
            return None
        last = len(matched) - 1
        cut = prefix_len - last * self.block_size  # tokens used of the last page (1..B)
        parts = []
        for p, h in enumerate(matched):
            if p % self.degree == self.rank:
                page = self.pool.get(h)
                parts.append(page[:, :, :cut] if p == last else page)
        if not parts:
            return self.pool.data.new_zeros(*self.shape[:2], 0, *self.shape[3:])
        return torch.cat(parts, dim=2)

    def store(self, lookup: Lookup, new_kv: KVLayers) -> list[BlockHash]:
        """Cache the request's new FULL blocks after prefill. ``new_kv``: per layer (R, Hkv, D)
        for the R new tokens at positions P..P+R-1 (P = lookup.match.prefix_len)."""
        p0 = lookup.match.prefix_len
        b = self.block_size
        first = len(lookup.match.block_hashes)
        todo = lookup.chain[first:]
        r = new_kv[0][0].shape[0] if new_kv else 0
        if p0 + r < (first + len(todo)) * b:
            raise InvalidInput("new_kv is shorter than the request's full blocks")
        parent = lookup.match.block_hashes[-1] if first else None
        stored, evicted = self.index.insert(parent, todo, protect=set(lookup.match.block_hashes))
        for h in evicted:
            self._release(h)
        self.last_evicted = evicted
        for h in stored:
            page = first + todo.index(h)
            if page % self.degree == self.rank:
                lo = page * b - p0
                kv = torch.stack([torch.stack([k[lo : lo + b], v[lo : lo + b]]) for k, v in new_kv])
                self._acquire(h, kv)
        return stored

    def export_pages(self, hashes: list[BlockHash]) -> list[Page]:
        """This rank's pages among the cached chain ``hashes`` (root first), as copies."""
        out = []
        for h in hashes:
            if h in self.index and h in self._mine:
                n = self.index._nodes[h]
                out.append(Page(BlockHash(h), n.parent, n.page, self.pool.get(h).clone()))
        return out

    def import_prefix(
        self,
        chain: list[tuple[BlockHash, BlockHash | None]],
        pages: list[Page],
        protect: frozenset[BlockHash] | set[BlockHash] = frozenset(),
        *,
        payload_shape: tuple[int, ...] | None = None,
    ) -> list[BlockHash]:
        """Install a chain (root first: (hash, parent) per block, pages 0..n-1) whose pages
        come from another worker or degree; keeps the pages p ≡ rank (mod C).

        Room is made by evicting LRU leaves, never a block of ``protect`` (nor the chain's
        already-cached head); when that is not enough only the leading part that fits is
        stored (possibly nothing). ``protect``: blocks the caller still needs resident --
        rankd's pinned blocks and the blocks of the request whose KV hand-off is in progress
        (see TorchBackend.prepare_cache_command).

        An owned page may be left out of ``pages`` when this rank's pool already holds it
        (another cache of the rank, e.g. the retired predecessor after a split or merge):
        the slot is then shared, nothing is copied (:meth:`resident_prefix` says how far that
        goes; every member must be able to, which the caller checks first).

        Validates first (chain links, every owned page present, every given page of the
        chain with the right shape) and changes nothing on failure (:class:`KVFormatError`).
        Members must refuse a bad payload together: one rank refusing while the others
        install would split the worker's index. Ranks given the same pages do (shapes are
        checked on every given page, not only the owned ones); ranks each given only their
        own pages (TorchWorld.copy_prefix) are also given ``payload_shape``, the one shape
        of every page of the whole payload (the caller checked that), and each refuses a
        payload of another shape than its cache's -- the same verdict on every member.
        """
        if payload_shape is not None and tuple(payload_shape) != self.shape:
            raise KVFormatError(f"pages of shape {tuple(payload_shape)}, want {self.shape}")
        by_hash = {pg.hash: pg for pg in pages}
        prev = None
        for i, (h, parent) in enumerate(chain):
            if parent != prev:
                raise KVFormatError(f"chain broken at block {i}: parent {parent} != {prev}")
            prev = h
            if h not in self.index:
                pg = by_hash.get(h)
                if pg is None:
                    if i % self.degree != self.rank or h in self.pool:
                        continue  # another rank's page (the caller may give each rank its
                        # own), or one this rank's pool holds already (shared)
                    raise KVFormatError(f"page {i} ({h}) owned by rank {self.rank} is missing")
                if tuple(pg.kv.shape) != self.shape:
                    raise KVFormatError(
                        f"page {i} has shape {tuple(pg.kv.shape)}, want {self.shape}"
                    )
        hashes = [h for h, _ in chain]
        head = self.index.match(hashes)  # already cached part (also touches it)
        parent = head[-1] if head else None
        stored, evicted = self.index.insert(
            parent, hashes[len(head) :], protect=set(head) | set(protect)
        )
        for h in evicted:
            self._release(h)
        self.last_evicted = evicted
        mine = [h for h in stored if hashes.index(h) % self.degree == self.rank]
        # Shared pages first: a slot taken for a given page may reclaim the cache that holds
        # a resident one.
        for h in mine:
            if h not in by_hash:
                self._acquire(h, None)
        for h in mine:
            if h in by_hash:
                self._acquire(h, by_hash[h].kv)
        return stored

    def resident_prefix(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of the chain ``hashes`` this rank could install without
        being given a page: each page it owns at this degree is in this cache or elsewhere
        in the rank's pool (:meth:`import_prefix` then shares it). No change."""
        n = 0
        for i, h in enumerate(hashes):
            if i % self.degree == self.rank and h not in self.pool:
                break
            n += 1
        return n

    def chain_of(self, hashes: list[BlockHash]) -> list[tuple[BlockHash, BlockHash | None]]:
        """(hash, parent) metadata of a cached chain, for :meth:`import_prefix` elsewhere."""
        return [(h, self.index._nodes[h].parent) for h in hashes if h in self.index]

    def remove(self, hashes: list[BlockHash]) -> list[BlockHash]:
        gone = self.index.remove(hashes)
        for h in gone:
            self._release(h)
        return gone

    def clear(self) -> None:
        self.index.clear()
        for h in list(self._mine):
            self._release(h)

    def pages_outside(self, other: RankKVCache) -> int:
        """Pages this cache holds on this rank that ``other`` does not (e.g. the active
        cache): the slots that dropping this cache and every other holder but ``other``
        would free."""
        return len(self._mine - other._mine)

    def _acquire(self, h: int, kv: Tensor | None) -> None:
        if h not in self._mine:
            self.pool.acquire(h, kv)
            self._mine.add(h)

    def _release(self, h: int) -> None:
        if h in self._mine:
            self._mine.remove(h)
            self.pool.release(h)


def pages_to_bytes(chain: list[tuple[BlockHash, BlockHash | None]], pages: list[Page]) -> bytes:
    """Serialise exported pages and their chain metadata (for replication over a message
    transport; chunk the result with ``decode.encode_chunks``). A safetensors blob: tensors
    ``page.{i}`` (layers, 2, B, Hkv, D), metadata ``chain`` [[hash, parent]] and ``pages``
    [[hash, parent, page]] as JSON (hashes are < 2^63, exact in JSON)."""
    tensors = {f"page.{i}": pg.kv.detach().contiguous().cpu() for i, pg in enumerate(pages)}
    md = {
        "chain": json.dumps([[h, p] for h, p in chain]),
        "pages": json.dumps([[pg.hash, pg.parent, pg.page] for pg in pages]),
    }
    return st_save(tensors, metadata=md)


def pages_from_bytes(blob: bytes) -> tuple[list[tuple[BlockHash, BlockHash | None]], list[Page]]:
    """Inverse of :func:`pages_to_bytes`; :class:`KVFormatError` if malformed."""
    try:
        tensors = st_load(blob)
        (n,) = struct.unpack("<Q", blob[:8])
        md = json.loads(blob[8 : 8 + n])["__metadata__"]
        chain = [
            (BlockHash(h), None if p is None else BlockHash(p)) for h, p in json.loads(md["chain"])
        ]
        pages = [
            Page(BlockHash(h), None if p is None else BlockHash(p), int(i), tensors[f"page.{k}"])
            for k, (h, p, i) in enumerate(json.loads(md["pages"]))
        ]
    except (SafetensorError, KeyError, ValueError, TypeError, struct.error) as exc:
        raise KVFormatError(f"malformed page payload: {exc!r}") from exc
    return chain, pages
