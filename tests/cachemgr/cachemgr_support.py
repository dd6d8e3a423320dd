"""Helpers of the cache manager's property tests (imported by the tests; the unique module
name avoids clashes under ``--import-mode=importlib``): random prefix forests cached by one
worker."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from services.cachemgr.events import Stored
from services.cachemgr.trie import PrefixTrie


def forest_path(parents: Mapping[int, int | None], h: int) -> list[int]:
    """The root-first chain of blocks from a forest's root down to ``h``."""
    out: list[int] = []
    x: int | None = h
    while x is not None:
        out.append(x)
        x = parents[x]
    return out[::-1]


def store_leaves(t: PrefixTrie, worker: str, parents: Mapping[int, int | None],
                 leaves: Iterable[int]) -> None:
    """``worker`` (registered, no events yet) caches the whole prefix of each leaf in turn:
    one ``Stored`` event for the part of each chain it does not have yet."""
    eid = 0
    for leaf in leaves:
        path = forest_path(parents, leaf)
        have = t.worker_blocks(worker)
        i = 0
        while i < len(path) and path[i] in have:
            i += 1
        if i < len(path):
            eid += 1
            t.apply(Stored(worker, eid, path[i - 1] if i else None, tuple(path[i:])))


def merged_trie(left: str, right: str, parent: str) -> PrefixTrie:
    """Two CP2 halves merged into their CP4 ``parent`` after ``left`` cached pages 0-3 of one
    prefix (10, 11, 12, 13): pages 0-1 stay valid, pages 2-3 are pending on the merged
    worker's own ranks."""
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(left, 2, 50)
    t.add_worker(right, 2, 50)
    t.apply(Stored(left, 1, None, (10, 11, 12, 13)))
    t.reconcile_merge((left, right), parent, 100)
    return t
