"""The shared rule of a new worker's valid index (reconcile.reconciled_index): what the trie's
reconciliation makes valid and what a rank host seeds into the new worker's BlockCache."""

from __future__ import annotations

import pytest

from services.cachemgr.events import Stored
from services.cachemgr.reconcile import (
    ResidentPage,
    guess_capacity,
    index_pages,
    reconciled_index,
)
from services.cachemgr.trie import PrefixTrie
from services.rankd.blockcache import BlockCache
from shared.ids import InvalidInput

P, L, R = "w-cp4-g0", "w-cp2-g0", "w-cp2-g2"


def cache_of(worker: str, *chains: tuple[int, ...]) -> BlockCache:
    c = BlockCache(worker, 100)
    for chain in chains:
        c.insert(chain)
    return c


def pages(c: BlockCache) -> dict[int, ResidentPage]:
    return index_pages({h: c.parent_of(h) for h in c.blocks()})


def test_index_pages_depths_and_contract() -> None:
    assert index_pages({10: None, 11: 10, 12: 11, 20: 10}) == {
        10: ResidentPage(None, 0), 11: ResidentPage(10, 1), 12: ResidentPage(11, 2),
        20: ResidentPage(10, 1)}
    with pytest.raises(InvalidInput):
        index_pages({11: 10})  # not a whole prefix
    with pytest.raises(InvalidInput):
        index_pages({1: 2, 2: 1})  # a cycle


def test_split_seed_equals_the_tries_valid_blocks() -> None:
    chains = ((10, 11, 12, 13, 14), (10, 20, 21), (30,))
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(P, 4, 100)
    for i, chain in enumerate(chains, start=1):
        t.apply(Stored(P, i, None, chain))
    parent = pages(cache_of(P, *chains))
    plan = t.reconcile_split(P, (L, R), {L: 4, R: 4})
    for w, side in ((L, "left"), (R, "right")):
        seed = reconciled_index((parent,), child_degree=2, new=side, capacity_blocks=4)
        assert {h for h, _ in seed} == plan.valid[w] == t.held_nodes(w)
    # Pages 0-1 of every prefix are on the left, cut to the 4 shallowest (then by hash).
    assert reconciled_index((parent,), child_degree=2, new="left", capacity_blocks=4) == (
        (10, None), (30, None), (11, 10), (20, 10))


def test_merge_seed_equals_the_tries_valid_blocks() -> None:
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(L, 2, 100)
    t.add_worker(R, 2, 100)
    t.apply(Stored(L, 1, None, (10, 11, 12, 13, 14)))
    t.apply(Stored(R, 1, None, (10, 11, 12, 13)))
    t.apply(Stored(R, 2, None, (40, 41)))
    left = pages(cache_of(L, (10, 11, 12, 13, 14)))
    right = pages(cache_of(R, (10, 11, 12, 13), (40, 41)))
    plan = t.reconcile_merge((L, R), P, 100)
    seed = reconciled_index((left, right), child_degree=2, new="merged", capacity_blocks=100)
    assert {h for h, _ in seed} == plan.valid == t.held_nodes(P) == {10, 11, 12, 13, 14}


def test_bad_arguments() -> None:
    one = {10: ResidentPage(None, 0)}
    with pytest.raises(InvalidInput):
        reconciled_index((one, one), child_degree=2, new="left", capacity_blocks=4)
    with pytest.raises(InvalidInput):
        reconciled_index((one,), child_degree=2, new="merged", capacity_blocks=4)
    with pytest.raises(InvalidInput):
        reconciled_index((one,), child_degree=2, new="middle", capacity_blocks=4)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        reconciled_index((one,), child_degree=2, new="left", capacity_blocks=0)


@pytest.mark.parametrize(
    ("degree", "known", "expected"),
    [
        (2, [], 4096),  # nothing known: the default
        (2, [(4, 8)], 4),  # one figure per GPU (the backends' rule): C times it
        (8, [(4, 8), (2, 4)], 16),
        (1, [(4, 10)], 2),  # rounded down
        (1, [(4, 2)], 1),  # never below 1
        (2, [(4, 64), (2, 64)], 64),  # one figure per worker (VTM_KV_TOTAL_BLOCKS)
        (2, [(4, 40), (2, 6), (2, 12)], 12),  # mixed: the (upper) median per GPU, 6 × 2
    ],
)
def test_guess_capacity(degree: int, known: list[tuple[int, int]], expected: int) -> None:
    assert guess_capacity(degree, known, 4096) == expected


@pytest.mark.parametrize(
    ("degree", "known", "default"),
    [(0, [], 1), (2, [(0, 8)], 1), (2, [(2, 0)], 1), (2, [], 0), (True, [], 1)],
)
def test_guess_capacity_refuses_what_is_no_capacity(
    degree: int, known: list[tuple[int, int]], default: int
) -> None:
    with pytest.raises(InvalidInput):
        guess_capacity(degree, known, default)
