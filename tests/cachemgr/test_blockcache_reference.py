"""BlockCache (dict-based, tuned for speed) against a plain reference model of its contract.

The reference below is written from the documented behaviour only, as slowly and plainly as
possible: a Python list in LRU order (oldest first) of ``[hash, parent, pins]`` entries;
"touch" moves a path to the end leaf-first; eviction removes, one at a time, the oldest entry
that has no cached child and no pin and is not the block the new chain hangs under; new blocks
are appended leaf-first; ``remove`` takes, deepest first, each requested block that is unpinned
and whose cached children are all removed too. Random operation scripts must give the same
return values, events, contents, parents, pins and snapshots in both.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.cachemgr.events import Removed, Stored
from services.rankd.blockcache import BlockCache
from shared.ids import InvalidInput

# A forest of prefixes: parent of each block (0 and 5 and 9 are first blocks of prompts).
PARENT: dict[int, int | None] = {0: None, 1: 0, 2: 1, 3: 2, 4: 1, 5: None, 6: 5, 7: 6, 8: 6,
                                 9: None, 10: 9, 11: 10, 12: 11, 13: 12}


def chain(h: int) -> tuple[int, ...]:
    out = []
    x: int | None = h
    while x is not None:
        out.append(x)
        x = PARENT[x]
    return tuple(reversed(out))


class RefCache:
    """The reference: O(n) everything, no indexes."""

    def __init__(self, worker: str, capacity: int) -> None:
        self.worker, self.capacity = worker, capacity
        self.lru: list[list[Any]] = []  # [hash, parent, pins], oldest first
        self.events: list[Any] = []
        self.eid = 0

    def _find(self, h: int) -> list[Any] | None:
        return next((e for e in self.lru if e[0] == h), None)

    def _children(self, h: int) -> int:
        return sum(1 for e in self.lru if e[1] == h)

    def _touch(self, path: tuple[int, ...]) -> None:
        for h in reversed(path):  # leaf first, so the root of the path ends up most recent
            e = self._find(h)
            assert e is not None
            self.lru.remove(e)
            self.lru.append(e)

    def _prefix(self, hs: tuple[int, ...]) -> int:
        k, prev = 0, None
        for h in hs:
            e = self._find(h)
            if e is None:
                break
            if e[1] != prev:
                raise InvalidInput("chain conflict")
            k, prev = k + 1, h
        return k

    def lookup(self, hs: tuple[int, ...], pin: bool = False) -> int:
        k = self._prefix(hs)
        self._touch(hs[:k])
        if pin and k:
            self.pin(hs[:k])
        return k

    def insert(self, hs: tuple[int, ...], pin: bool = False) -> int:
        k = self._prefix(hs)
        existing, new = hs[:k], hs[k:]
        if any(self._find(h) for h in new):
            raise InvalidInput("cached under another parent")
        guard = existing[-1] if existing else None
        evicted = []
        want = len(new) - (self.capacity - len(self.lru))
        while want > 0:
            victim = next((e for e in self.lru if e[2] == 0 and e[0] != guard
                           and self._children(e[0]) == 0), None)
            if victim is None:
                break
            self.lru.remove(victim)
            evicted.append(victim[0])
            want -= 1
        fit = min(len(new), self.capacity - len(self.lru))
        stored = new[:fit]
        parent = guard
        for i in range(len(stored) - 1, -1, -1):
            self.lru.append([stored[i], stored[i - 1] if i else parent, 0])
        self._touch(existing)
        if evicted:
            self.eid += 1
            self.events.append(Removed(self.worker, self.eid, tuple(evicted)))
        if stored:
            self.eid += 1
            self.events.append(Stored(self.worker, self.eid, parent, tuple(stored)))
        if pin:
            self.pin(hs[: k + fit])
        return k + fit

    def pin(self, hs: tuple[int, ...]) -> None:
        entries = [self._find(h) for h in hs]
        if any(e is None for e in entries):
            raise InvalidInput("not cached")
        for e in entries:
            e[2] += 1  # type: ignore[index]

    def unpin(self, hs: tuple[int, ...]) -> None:
        for h in set(hs):
            e = self._find(h)
            if e is None or e[2] < hs.count(h):
                raise InvalidInput("not pinned")
        for h in hs:
            self._find(h)[2] -= 1  # type: ignore[index]

    def remove(self, hs: tuple[int, ...]) -> tuple[int, ...]:
        def depth(h: int) -> int:
            return len(chain(h))

        gone: list[int] = []
        for h in sorted({h for h in hs if self._find(h)}, key=depth, reverse=True):
            e = self._find(h)
            assert e is not None
            kids = [x[0] for x in self.lru if x[1] == h]
            if e[2] == 0 and all(k in gone for k in kids):
                gone.append(h)
        for h in gone:
            self.lru.remove(self._find(h))  # type: ignore[arg-type]
        if gone:
            self.eid += 1
            self.events.append(Removed(self.worker, self.eid, tuple(gone)))
        return tuple(gone)

    def take_events(self) -> list[Any]:
        out, self.events = self.events, []
        return out


def _same(c: BlockCache, r: RefCache) -> None:
    assert c.take_events() == r.take_events()
    assert [h for h, _ in c.snapshot().blocks] == [e[0] for e in r.lru]  # LRU order too
    for h, p, pins in r.lru:
        assert c.parent_of(h) == p and c.pins(h) == pins
    assert c.blocks() == {e[0] for e in r.lru} and len(c) == len(r.lru)


def _both(c: BlockCache, r: RefCache, name: str, *args: Any, **kw: Any) -> Any:
    outs = []
    for obj in (c, r):
        try:
            outs.append(("ok", getattr(obj, name)(*args, **kw)))
        except InvalidInput:
            outs.append(("error", None))
    assert outs[0] == outs[1], (name, args)
    return outs[0][1]


ops = st.lists(st.tuples(st.sampled_from(["insert", "insert", "insert_pin", "lookup",
                                          "lookup_pin", "pin", "unpin", "remove"]),
                         st.sampled_from(sorted(PARENT)), st.integers(0, 3)),
               max_size=80)


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 9), ops)
def test_blockcache_matches_reference_model(cap: int, script) -> None:
    c, r = BlockCache("w", cap), RefCache("w", cap)
    pinned: list[tuple[int, ...]] = []
    for op, h, extra in script:
        path = chain(h)
        if op in ("insert", "insert_pin"):
            n = _both(c, r, "insert", path, pin=op == "insert_pin")
            if op == "insert_pin" and n:
                pinned.append(path[:n])
        elif op == "lookup":
            _both(c, r, "lookup", path)
        elif op == "lookup_pin":
            k = _both(c, r, "lookup", path, pin=True)
            if k:
                pinned.append(path[:k])
        elif op == "pin":
            k = _both(c, r, "lookup", path)
            if k and extra:
                _both(c, r, "pin", path[:k])
                pinned.append(path[:k])
        elif op == "unpin":
            if pinned:
                _both(c, r, "unpin", pinned.pop(extra % len(pinned)))
            else:
                _both(c, r, "unpin", path)  # not pinned: both refuse
        else:
            _both(c, r, "remove", path[-1 - extra % len(path):])
        _same(c, r)


def test_reference_sanity_eviction_skips_pinned_and_interior() -> None:
    """The reference itself on a hand-made case (so the comparison is not vacuous)."""
    r = RefCache("w", 4)
    r.insert(chain(2))  # 0 <- 1 <- 2
    r.insert(chain(5))
    r.pin((5,))
    assert r.insert(chain(4)) == 3  # evicts the leaf 2 (5 is pinned, 0 and 1 interior/guard)
    assert [e[0] for e in r.lru] == [5, 4, 1, 0]
    c = BlockCache("w", 4)
    c.insert(chain(2))
    c.insert(chain(5))
    c.pin((5,))
    assert c.insert(chain(4)) == 3
    assert [h for h, _ in c.snapshot().blocks] == [5, 4, 1, 0]


@pytest.mark.parametrize("cap", [1, 3])
def test_insert_keeps_the_hanging_block_when_everything_else_is_pinned(cap: int) -> None:
    c, r = BlockCache("w", cap), RefCache("w", cap)
    _both(c, r, "insert", chain(0))
    _both(c, r, "insert", chain(3))  # needs room for 1, 2, 3 under 0: 0 must stay
    _same(c, r)
    assert 0 in c
