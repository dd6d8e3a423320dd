"""A worker's local prefix cache of full KV blocks with LRU eviction (pure; sim and live rankd).

Blocks are keyed by chained hash (equal hash <=> equal prefix) and linked to their parent, so the
cache is a forest of prefixes. NOTE: invariant -- the cache only ever holds *whole prefixes*: a
block is cached only if its parent is (or it is a prompt's first block). Eviction therefore
takes only leaves (no cached child), and never a pinned block (a running request's prefix, or
the source of an in-flight replication).

Data structures, chosen for the hot path (every request does one ``lookup`` and one ``insert``):
* one ``OrderedDict`` hash -> entry, in LRU order (oldest first): lookup, touch (move_to_end)
  and removal are O(1);
* a path is touched leaf-first, so every ancestor is at least as recent as its descendants and
  the oldest entries are nearly always evictable leaves; the eviction scan from the old end only
  skips pinned blocks and the rare older interior block (amortised O(1) per eviction when few
  blocks are pinned);
* each entry counts its cached children, so "is a leaf" is O(1).

Every change is reported as a cache event (``Stored`` / ``Removed`` / ``Cleared``, see
:mod:`services.cachemgr.events`) with this cache's own monotonic event ids, queued internally and
drained by the adapter with :meth:`BlockCache.take_events` (SGLang's radix-cache event queue).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from services.cachemgr.events import (
    CacheEvent,
    Cleared,
    Removed,
    Snapshot,
    Stored,
    topological_order,
)
from shared.ids import BlockHash, InvalidInput, WorkerId


class _Entry:
    __slots__ = ("parent", "children", "pins")

    def __init__(self, parent: BlockHash | None) -> None:
        self.parent = parent
        self.children = 0
        self.pins = 0


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
        self._lru: OrderedDict[BlockHash, _Entry] = OrderedDict()
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
            return self._lru[h].parent
        except KeyError:
            raise InvalidInput(f"block {h!r} is not cached") from None

    def pins(self, h: BlockHash) -> int:
        e = self._lru.get(h)
        return 0 if e is None else e.pins

    @property
    def last_event_id(self) -> int:
        return self._last_event_id

    def _prefix(self, hs: tuple[BlockHash, ...]) -> int:
        """Leading blocks of ``hs`` cached as a chain (raises on a chain conflict)."""
        lru = self._lru
        prev: BlockHash | None = None
        for i, h in enumerate(hs):
            e = lru.get(h)
            if e is None:
                return i
            if e.parent != prev:
                raise InvalidInput(
                    f"block {h} is cached under parent {e.parent}, "
                    f"the request puts it under {prev}")
            prev = h
        return len(hs)

    def lookup(self, block_hashes: Sequence[BlockHash]) -> int:
        """Longest cached prefix of the request in blocks; touches it in the LRU."""
        hs = _check_hashes(block_hashes)
        k = self._prefix(hs)
        self._touch(hs[:k])
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
        lru = self._lru
        existing, new = hs[:k], hs[k:]
        if new and not lru.keys().isdisjoint(new):
            for h in new:
                if h in lru:  # cached under another parent: the request's chain contradicts ours
                    raise InvalidInput(
                        f"block {h} is already cached under parent {lru[h].parent}")
        evicted: list[BlockHash] = []
        want = len(new) - (self.capacity_blocks - len(lru))
        if want > 0:
            # Protect the path we hang the new blocks under while evicting.
            for h in existing:
                lru[h].pins += 1
            try:
                while want > 0:  # _evict_one, inlined (speed)
                    for v, e in lru.items():  # noqa: B007 (v is used after the break)
                        if e.children == 0 and e.pins == 0:
                            break
                    else:
                        break
                    del lru[v]
                    if e.parent is not None:
                        lru[e.parent].children -= 1
                    evicted.append(v)
                    want -= 1
            finally:
                for h in existing:
                    lru[h].pins -= 1
        fit = min(len(new), self.capacity_blocks - len(lru))
        stored = new[:fit] if fit < len(new) else new
        parent = existing[-1] if existing else None
        if stored:
            # Insert leaf-first so that ancestors end up more recent than descendants; each
            # new block but the last has exactly one cached child (the next one).
            e = _Entry(stored[-2] if fit > 1 else parent)
            lru[stored[-1]] = e
            for i in range(fit - 2, -1, -1):
                e = _Entry(stored[i - 1] if i else parent)
                e.children = 1
                lru[stored[i]] = e
            if parent is not None:
                lru[parent].children += 1
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
            for h in hs[:cached]:
                lru[h].pins += 1
        return cached

    def pin(self, block_hashes: Sequence[BlockHash]) -> None:
        """Pin cached blocks against eviction and removal (one pin per call)."""
        hs = _check_hashes(block_hashes)
        for h in hs:
            if h not in self._lru:
                raise InvalidInput(f"cannot pin block {h}: not cached")
        for h in hs:
            self._lru[h].pins += 1

    def unpin(self, block_hashes: Sequence[BlockHash]) -> None:
        hs = _check_hashes(block_hashes)
        lru = self._lru
        if len(set(hs)) == len(hs):  # the usual case, one pin each: no counting (speed)
            for h in hs:
                e = lru.get(h)
                if e is None or e.pins < 1:
                    raise InvalidInput(f"cannot unpin block {h}: not pinned 1 time(s)")
            for h in hs:
                lru[h].pins -= 1
            return
        need: dict[BlockHash, int] = {}
        for h in hs:
            need[h] = need.get(h, 0) + 1
        for h, n in need.items():
            e = self._lru.get(h)
            if e is None or e.pins < n:
                raise InvalidInput(f"cannot unpin block {h}: not pinned {n} time(s)")
        for h in hs:
            self._lru[h].pins -= 1

    def remove(self, block_hashes: Sequence[BlockHash]) -> tuple[BlockHash, ...]:
        """Delete the given blocks where allowed (a reclaim command); returns those removed.

        A block is removed only if it is cached, not pinned, and every cached child of it is
        removed too -- so the cache still holds whole prefixes. Others are skipped (not an
        error: the command may race with eviction or a new request). Emits one ``Removed``.
        """
        hs = _check_hashes(block_hashes)
        lru = self._lru
        want = {h for h in hs if h in lru}
        depth: dict[BlockHash, int] = {}

        def depth_of(h: BlockHash) -> int:
            chain = []
            x: BlockHash | None = h
            while x is not None and x not in depth:
                chain.append(x)
                x = lru[x].parent
            d = -1 if x is None else depth[x]
            for y in reversed(chain):
                d += 1
                depth[y] = d
            return depth[h]

        removed_children: dict[BlockHash, int] = {}
        gone: list[BlockHash] = []
        for h in sorted(want, key=lambda x: -depth_of(x)):
            e = lru[h]
            if e.pins or e.children != removed_children.get(h, 0):
                continue
            gone.append(h)
            if e.parent is not None:
                removed_children[e.parent] = removed_children.get(e.parent, 0) + 1
        for h in gone:
            e = lru.pop(h)
            if e.parent is not None:
                lru[e.parent].children -= 1
        if gone:
            self._emit_removed(gone)
        return tuple(gone)

    def clear(self) -> None:
        """Drop every block (pins included: the worker is being reset). Emits ``Cleared``."""
        self._lru.clear()
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
        parents: dict[BlockHash, BlockHash | None] = {}
        for pair in blocks:
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidInput(f"not a (hash, parent) pair: {pair!r}")
            h, p = pair
            _check_hashes((h,) if p is None else (h, p))
            if h in self._lru and self._lru[h].parent != p:
                raise InvalidInput(f"block {h} is cached under {self._lru[h].parent}, not {p}")
            parents[h] = p
        new = {h: p for h, p in parents.items() if h not in self._lru}
        for h, p in new.items():
            if p is not None and p not in self._lru and p not in new:
                raise InvalidInput(f"block {h}'s parent {p} is neither cached nor adopted")
        if len(self._lru) + len(new) > self.capacity_blocks:
            raise InvalidInput(f"adopting {len(new)} blocks exceeds capacity "
                               f"{self.capacity_blocks} (holding {len(self._lru)})")
        order = topological_order(new)
        if order is None:
            raise InvalidInput("adopted blocks form a cycle")
        for h in reversed(order):  # leaves first: ancestors end up more recent
            self._lru[h] = _Entry(new[h])
        for h in order:
            p = new[h]
            if p is not None:
                self._lru[p].children += 1

    def snapshot(self) -> Snapshot:
        """The whole index as of the last event emitted (for a consumer that saw a gap)."""
        return Snapshot(self.worker, self._last_event_id,
                        tuple((h, e.parent) for h, e in self._lru.items()))

    def take_events(self) -> list[CacheEvent]:
        """Drain the queued events, oldest first."""
        out, self._events = self._events, []
        return out

    # ------------------------------------------------------------------ internals
    def _touch(self, path: Sequence[BlockHash]) -> None:
        move = self._lru.move_to_end
        for h in reversed(path):
            move(h)

    def _evict_one(self) -> BlockHash | None:
        """Evict the oldest unpinned leaf (plain loop: no generator per eviction)."""
        lru = self._lru
        for victim, e in lru.items():  # noqa: B007 (victim is used after the break)
            if e.children == 0 and e.pins == 0:
                break
        else:
            return None
        del lru[victim]
        if e.parent is not None:
            lru[e.parent].children -= 1
        return victim

    def _emit_removed(self, hs: list[BlockHash]) -> None:
        self._last_event_id += 1
        # Trusted: non-empty, distinct int hashes that were cached (see Stored.trusted).
        self._events.append(Removed.trusted(self.worker, self._last_event_id, tuple(hs)))
