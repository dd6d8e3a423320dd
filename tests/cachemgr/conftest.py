"""Shared helpers for the prefix-cache manager tests."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from services.cachemgr.events import Stored
from services.cachemgr.trie import PrefixTrie
from shared.ids import BlockHash, WorkerId

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # the tests import cachemgr_support
    sys.path.insert(0, _HERE)


class Feeder:
    """Hands out per-worker event ids so tests can write ``feed.store('a', [1, 2])``."""

    def __init__(self, trie: PrefixTrie) -> None:
        self.trie = trie
        self.ids: dict[str, int] = {}

    def next_id(self, w: str) -> int:
        self.ids[w] = self.ids.get(w, 0) + 1
        return self.ids[w]

    def store(self, w: str, chain: Sequence[int], parent: int | None = None):
        ev = Stored(WorkerId(w), self.next_id(w), parent, tuple(BlockHash(h) for h in chain))
        return self.trie.apply(ev)


@pytest.fixture
def make_trie() -> Callable[..., tuple[PrefixTrie, Feeder]]:
    def make(workers: dict[str, int] | None = None, degrees=(2, 4), block_size: int = 4,
             capacity: int = 100) -> tuple[PrefixTrie, Feeder]:
        t = PrefixTrie(degrees, block_size=block_size)
        for w, c in (workers or {}).items():
            t.add_worker(WorkerId(w), c, capacity)
        return t, Feeder(t)

    return make
