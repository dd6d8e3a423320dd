"""A worker's local prefix cache of full KV blocks with LRU eviction (pure; sim and live rankd).

Blocks are keyed by chained hash (equal hash <=> equal prefix) and linked to their parent, so the
cache is a forest of prefixes. NOTE: invariant -- the cache only ever holds *whole prefixes*: a
block is cached only if its parent is (or it is a prompt's first block). Eviction therefore
takes only leaves (no cached child), and never a pinned block (a running request's prefix, or
the source of an in-flight replication).

Data structures, chosen for the hot path (every request does one ``lookup`` and one ``insert``,
and a full cache evicts as many blocks as it stores): no Python object per block --
* one ``OrderedDict`` hash -> parent hash, in LRU order (oldest first): lookup, touch
  (move_to_end) and removal are O(1), and a new chain is stored with one C-level ``update``;
* ``_kids``: hash -> number of cached children, only for blocks that have some (absent = a leaf),
  so "is a leaf" is one dict probe;
* ``_pins``: hash -> pin count, only for pinned blocks;
* a path is touched leaf-first, so every ancestor is at least as recent as its descendants and
  the oldest entries are nearly always evictable leaves; the eviction scan from the old end only
  skips pinned blocks and the rare older interior block (amortised O(1) per eviction when few
  blocks are pinned).

Every change is reported as a cache event (``Stored`` / ``Removed`` / ``Cleared``, see
:mod:`services.cachemgr.events`) with this cache's own monotonic event ids, queued internally and
drained by the adapter with :meth:`BlockCache.take_events` (SGLang's radix-cache event queue).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Final

from services.cachemgr.events import (
    CacheEvent,
    Cleared,
    Removed,
    Snapshot,
    Stored,
    topological_order,
)
from shared.ids import BlockHash, InvalidInput, WorkerId

_MISSING: Final = object()
"""Marks an absent block where ``None`` (a root block's parent) is a real value."""


_INT_ONLY = frozenset({int})


def _check_hashes(block_hashes: object) -> tuple[BlockHash, ...]:
    if block_hashes.__class__ is tuple:
        # Fast path (speed): a tuple of plain ints is checked in C; anything else (an int
        # subclass, a bad element) goes through the per-element check below.
        if not block_hashes or _INT_ONLY.issuperset(map(type, block_hashes)):  # type: ignore
            return block_hashes  # type: ignore[return-value]
    elif not isinstance(block_hashes, Sequence) or isinstance(block_hashes, str | bytes):
        raise InvalidInput(f"block_hashes must be a sequence of ints, got {block_hashes!r}")
    hs = tuple(block_hashes)  # type: ignore[arg-type]
    for h in hs:
        if isinstance(h, bool) or not isinstance(h, int):
            raise InvalidInput(f"block hashes must be ints, got {h!r}")
    return hs


class BlockCache:
    """LRU block cache of one worker holding at most ``capacity_blocks`` blocks."""

    def __init__(self, worker: WorkerId, capacity_blocks: int) -> None:
        if not isinstance(worker, str) or not worker:
            raise InvalidInput(f"worker must be a non-empty string, got {worker!r}")
        if isinstance(capacity_blocks, bool) or not isinstance(capacity_blocks, int) \
                or capacity_blocks < 1:
            raise InvalidInput(f"capacity_blocks must be an integer >= 1, got {capacity_blocks!r}")
        self.worker = worker
        self.capacity_blocks = capacity_blocks
        # hash -> parent hash (None: a prompt's first block), oldest first.
        self._lru: OrderedDict[BlockHash, BlockHash | None] = OrderedDict()
        # NOTE: invariants -- _kids[h] = number of cached blocks whose parent is h, present only
        # when > 0; _pins[h] = pin count, present only when > 0 and only for cached blocks.
        self._kids: dict[BlockHash, int] = {}
        self._pins: dict[BlockHash, int] = {}
        self._events: list[CacheEvent] = []
        self._last_event_id = 0

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, h: object) -> bool:
        return h in self._lru

    def blocks(self) -> frozenset[BlockHash]:
        return frozenset(self._lru)

    def parent_of(self, h: BlockHash) -> BlockHash | None:
        try:
            return self._lru[h]
        except KeyError:
            raise InvalidInput(f"block {h!r} is not cached") from None

    def pins(self, h: BlockHash) -> int:
        return self._pins.get(h, 0)

    def pinned(self) -> frozenset[BlockHash]:
        """Every block holding at least one pin (what a backend must keep resident)."""
        return frozenset(self._pins)

    @property
    def last_event_id(self) -> int:
        return self._last_event_id

    def _prefix(self, hs: tuple[BlockHash, ...]) -> int:
        """Leading blocks of ``hs`` cached as a chain (raises on a chain conflict)."""
        get = self._lru.get
        prev: BlockHash | None = None
        for i, h in enumerate(hs):
            p = get(h, _MISSING)
            if p is _MISSING:
                return i
            if p != prev:
                raise InvalidInput(
                    f"block {h} is cached under parent {p}, the request puts it under {prev}")
            prev = h
        return len(hs)

    def peek(self, block_hashes: Sequence[BlockHash]) -> int:
        """Longest cached prefix of the request in blocks, as :meth:`lookup` finds it, without
        touching the LRU (0 where the chain contradicts the cache)."""
        try:
            return self._prefix(_check_hashes(block_hashes))
        except InvalidInput:
            return 0

    def lookup(self, block_hashes: Sequence[BlockHash], *, pin: bool = False) -> int:
        """Longest cached prefix of the request in blocks; touches it in the LRU.

        With ``pin=True`` that prefix also gets one pin, as :meth:`pin` would give it (the
        caller unpins ``block_hashes[:returned]`` when the request finishes).
        """
        hs = _check_hashes(block_hashes)
        k = self._prefix(hs)
        if k:
            path = hs[:k]
            self._touch(path)
            if pin:
                self._add_pins(path)
        return k

    # ------------------------------------------------------------------ changes
    def insert(self, block_hashes: Sequence[BlockHash], *, pin: bool = False) -> int:
        """Cache the request's full blocks ``block_hashes`` (root first); returns blocks cached.

        Already-cached leading blocks are touched; the rest are stored, evicting LRU leaves
        that are not pinned as needed. If not enough can be evicted, only the leading part
        that fits is stored (still a whole prefix). With ``pin=True`` the cached part of the
        path gets one pin (the caller unpins it when the request finishes).
        Emits ``Removed`` (evictions) then ``Stored`` (new blocks).
        """
        hs = _check_hashes(block_hashes)
        if len(set(hs)) != len(hs):
            raise InvalidInput("block_hashes repeats a hash (not a chain)")
        k = self._prefix(hs)
        lru, kids = self._lru, self._kids
        existing, new = hs[:k], hs[k:]
        if new and not lru.keys().isdisjoint(new):
            for h in new:
                if h in lru:  # cached under another parent: the request's chain contradicts ours
                    raise InvalidInput(f"block {h} is already cached under parent {lru[h]}")
        parent = existing[-1] if existing else None
        evicted: list[BlockHash] = []
        want = len(new) - (self.capacity_blocks - len(lru))
        if want > 0:
            pins = self._pins
            # The block the new chain hangs under must survive (then so do its ancestors:
            # each keeps a cached child). Evict the oldest unpinned leaf, one at a time.
            while want > 0 and lru:
                # The oldest block is nearly always an evictable leaf: take it in one call;
                # otherwise put it back where it was and scan from the old end.
                v, p = lru.popitem(last=False)
                if v in kids or v in pins or v == parent:
                    lru[v] = p
                    lru.move_to_end(v, last=False)
                    for v in lru:
                        if v not in kids and v not in pins and v != parent:
                            break
                    else:
                        break
                    p = lru.pop(v)
                if p is not None:
                    c = kids[p] - 1
                    if c:
                        kids[p] = c
                    else:
                        del kids[p]
                evicted.append(v)
                want -= 1
        fit = min(len(new), self.capacity_blocks - len(lru))
        stored = new[:fit] if fit < len(new) else new
        if stored:
            # Leaf-first, so that ancestors end up more recent than descendants; each block
            # hangs under the one before it, and each but the last has one cached child.
            lru.update(zip(reversed(stored), reversed((parent, *stored[:-1])), strict=True))
            if fit > 1:
                kids.update(dict.fromkeys(stored[:-1], 1))
            if parent is not None:
                kids[parent] = kids.get(parent, 0) + 1
        if existing:
            self._touch(existing)
        if evicted:
            self._emit_removed(evicted)
        if stored:
            self._last_event_id += 1
            # Trusted: worker validated, ids from 1, distinct int hashes, parent cached.
            self._events.append(Stored.trusted(self.worker, self._last_event_id, parent,
                                               stored))
        cached = k + fit
        if pin:
            self._add_pins(hs[:cached])
        return cached

    def pin(self, block_hashes: Sequence[BlockHash]) -> None:
        """Pin cached blocks against eviction and removal (one pin per call)."""
        hs = _check_hashes(block_hashes)
        lru = self._lru
        for h in hs:
            if h not in lru:
                raise InvalidInput(f"cannot pin block {h}: not cached")
        self._add_pins(hs)

    def unpin(self, block_hashes: Sequence[BlockHash]) -> None:
        hs = _check_hashes(block_hashes)
        pins = self._pins
        get = pins.get
        if len(set(hs)) == len(hs):  # the usual case, one pin each: no counting (speed)
            for h in hs:
                if get(h, 0) < 1:
                    raise InvalidInput(f"cannot unpin block {h}: not pinned 1 time(s)")
        else:
            need: dict[BlockHash, int] = {}
            for h in hs:
                need[h] = need.get(h, 0) + 1
            for h, n in need.items():
                if get(h, 0) < n:
                    raise InvalidInput(f"cannot unpin block {h}: not pinned {n} time(s)")
        for h in hs:
            c = pins[h] - 1
            if c:
                pins[h] = c
            else:
                del pins[h]

    def demote(self, block_hashes: Sequence[BlockHash]) -> int:
        """Make the given cached blocks the first to be evicted (a demote command: the source of
        a route-time pull, services/cachemgr/pull.py); returns how many were demoted.

        Each cached block that can go first moves to the old end of the LRU, in the given
        order, so with ``block_hashes`` root first (a chain, as a pull copies it) the deepest
        block ends up oldest and the chain is evicted leaf first, as the LRU order keeps it
        elsewhere. A block goes first only together with every cached child of it: one with
        a child that stays (the worker's own continuation of the prefix) could not be evicted
        before that child anyway, and parked at the old end every eviction would have to
        scan past it -- it stays where it is, and so do its ancestors. Blocks not cached are
        skipped (the command may race with eviction); pins still protect (eviction skips a
        pinned block wherever it stands). Nothing is removed and no event is emitted: what
        the cache holds does not change, only which block goes first, and a later lookup or
        insert that touches a demoted block makes it recent again.
        """
        hs = _check_hashes(block_hashes)
        lru, kids = self._lru, self._kids
        going: dict[BlockHash, None] = {}
        left: dict[BlockHash, int] = {}  # block -> its cached children not going (yet)
        # Deepest first, which is one pass for a chain given root first; again until nothing
        # changes, for any other order.
        changed = True
        while changed:
            changed = False
            for h in reversed(hs):
                if h in going or h not in lru or left.get(h, kids.get(h, 0)):
                    continue
                going[h] = None
                p = lru[h]
                if p is not None:
                    left[p] = left.get(p, kids.get(p, 0)) - 1
                changed = True
        move = lru.move_to_end
        for h in hs:
            if h in going:
                move(h, last=False)
        return len(going)

    def remove(self, block_hashes: Sequence[BlockHash]) -> tuple[BlockHash, ...]:
        """Delete the given blocks where allowed (a reclaim command); returns those removed.

        A block is removed only if it is cached, not pinned, and every cached child of it is
        removed too -- so the cache still holds whole prefixes. Others are skipped (not an
        error: the command may race with eviction or a new request). Emits one ``Removed``.
        """
        hs = _check_hashes(block_hashes)
        lru, kids, pins = self._lru, self._kids, self._pins
        want = {h for h in hs if h in lru}
        depth: dict[BlockHash, int] = {}

        def depth_of(h: BlockHash) -> int:
            chain = []
            x: BlockHash | None = h
            while x is not None and x not in depth:
                chain.append(x)
                x = lru[x]
            d = -1 if x is None else depth[x]
            for y in reversed(chain):
                d += 1
                depth[y] = d
            return depth[h]

        removed_children: dict[BlockHash, int] = {}
        gone: list[BlockHash] = []
        for h in sorted(want, key=lambda x: -depth_of(x)):
            if h in pins or kids.get(h, 0) != removed_children.get(h, 0):
                continue
            gone.append(h)
            p = lru[h]
            if p is not None:
                removed_children[p] = removed_children.get(p, 0) + 1
        for h in gone:  # deepest first: a block's children go before it
            p = lru.pop(h)
            if p is not None:
                c = kids[p] - 1
                if c:
                    kids[p] = c
                else:
                    del kids[p]
        if gone:
            self._emit_removed(gone)
        return tuple(gone)

    def clear(self) -> None:
        """Drop every block (pins included: the worker is being reset). Emits ``Cleared``."""
        self._lru.clear()
        self._kids.clear()
        self._pins.clear()
        self._last_event_id += 1
        self._events.append(Cleared(self.worker, self._last_event_id))

    def adopt(self, blocks: Sequence[tuple[BlockHash, BlockHash | None]]) -> None:
        """Seed resident blocks *without* events (the manager already knows them).

        For a worker created by a split or merge: its ranks already hold these pages, and the
        manager registered them when it reconciled (e.g. the complete prefixes from
        ``PrefixTrie.held_nodes(child)``). Pairs are ``(hash, parent)``; every parent must be
        ``None``, cached, or in ``blocks`` (whole prefixes), and they must fit.
        """
        if not isinstance(blocks, Sequence):
            raise InvalidInput("blocks must be a sequence of (hash, parent) pairs")
        lru = self._lru
        parents: dict[BlockHash, BlockHash | None] = {}
        for pair in blocks:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidInput(f"not a (hash, parent) pair: {pair!r}")
            h, p = pair
            _check_hashes((h,) if p is None else (h, p))
            if h in lru and lru[h] != p:
                raise InvalidInput(f"block {h} is cached under {lru[h]}, not {p}")
            parents[h] = p
        new = {h: p for h, p in parents.items() if h not in lru}
        for h, p in new.items():
            if p is not None and p not in lru and p not in new:
                raise InvalidInput(f"block {h}'s parent {p} is neither cached nor adopted")
        if len(lru) + len(new) > self.capacity_blocks:
            raise InvalidInput(f"adopting {len(new)} blocks exceeds capacity "
                               f"{self.capacity_blocks} (holding {len(lru)})")
        order = topological_order(new)
        if order is None:
            raise InvalidInput("adopted blocks form a cycle")
        kids = self._kids
        for h in reversed(order):  # leaves first: ancestors end up more recent
            lru[h] = new[h]
        for h in order:
            p = new[h]
            if p is not None:
                kids[p] = kids.get(p, 0) + 1

    def snapshot(self) -> Snapshot:
        """The whole index as of the last event emitted (for a consumer that saw a gap)."""
        return Snapshot(self.worker, self._last_event_id, tuple(self._lru.items()))

    def take_events(self) -> list[CacheEvent]:
        """Drain the queued events, oldest first."""
        out, self._events = self._events, []
        return out

    # ------------------------------------------------------------------ internals
    def _touch(self, path: Sequence[BlockHash]) -> None:
        move = self._lru.move_to_end
        for h in reversed(path):
            move(h)

    def _add_pins(self, hs: Sequence[BlockHash]) -> None:
        pins = self._pins
        get = pins.get
        for h in hs:
            pins[h] = get(h, 0) + 1

    def _emit_removed(self, hs: list[BlockHash]) -> None:
        self._last_event_id += 1
        # Trusted: non-empty, distinct int hashes that were cached (see Stored.trusted).
        self._events.append(Removed.trusted(self.worker, self._last_event_id, tuple(hs)))
