"""Re-homing a split parent's long prefixes onto its degree's other workers (reconcile.py)."""

from __future__ import annotations

import pytest

from services.cachemgr.actions import Replicate
from services.cachemgr.events import Stored
from services.cachemgr.reconcile import RehomeConfig, rehome_on_split
from services.cachemgr.trie import PrefixTrie
from shared.ids import InvalidInput, UnknownWorker

P, A, B, S = "w-cp4-g0", "w-cp4-g4", "w-cp4-g8", "w-cp2-g12"
CFG = RehomeConfig(min_blocks=4, fill=1.0)


def setup(cap_a: int = 20, cap_b: int = 20) -> PrefixTrie:
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(P, 4, 100)
    t.add_worker(A, 4, cap_a)
    t.add_worker(B, 4, cap_b)
    t.add_worker(S, 2, 50)
    t.apply(Stored(P, 1, None, (1, 2, 3, 4, 5)))  # long: 5 blocks
    t.apply(Stored(P, 2, 2, (30, 31, 32)))  # long branch off block 2: 5 blocks
    t.apply(Stored(P, 3, None, (50, 51)))  # short: 2 blocks
    return t


def test_long_prefixes_go_to_the_roomiest_peer_as_missing_blocks_only() -> None:
    t = setup()
    t.apply(Stored(A, 1, None, (1, 2)))  # A already holds the shared head; B is roomier
    acts = rehome_on_split(t, P, [A, B], CFG)
    # No statistics: equal heat, so the tie goes to the longer, then the smaller hash (5).
    assert acts[0] == Replicate(5, 4, P, B, (1, 2, 3, 4, 5), "intra")
    # B now has 5 blocks reserved (room 15) vs A's 18: the next goes to A, without 1, 2.
    assert acts[1] == Replicate(32, 4, P, A, (30, 31, 32), "intra")
    assert len(acts) == 2  # the 2-block prefix is below min_blocks
    assert set(t.inflight()) == set(acts)
    # Not visible before the destination's own report.
    assert t.match([1, 2, 3, 4, 5]).held(B) == 0


def test_hottest_first_within_the_fill_bound() -> None:
    t = setup(cap_a=10, cap_b=6)
    t.set_statistics(31, 4, access=3.0)  # the branch is hotter
    acts = rehome_on_split(t, P, [A, B], RehomeConfig(min_blocks=4, fill=0.5))
    # A (room 10) takes the hot branch's 5 blocks (5 <= 0.5 * 10); the other prefix fits
    # nowhere: A is at its bound, B (6 blocks) would reach 5 > 3.
    assert acts == (Replicate(32, 4, P, A, (1, 2, 30, 31, 32), "intra"),)


def test_a_peer_holding_the_prefix_whole_is_skipped() -> None:
    t = setup(cap_a=100, cap_b=5)
    t.apply(Stored(A, 1, None, (1, 2, 3, 4, 5)))
    t.apply(Stored(A, 2, 2, (30, 31, 32)))
    assert rehome_on_split(t, P, [A, B], CFG) == ()
    assert t.inflight() == ()


def test_nothing_without_peers_and_bad_input_raises() -> None:
    t = setup()
    assert rehome_on_split(t, P, [], CFG) == ()
    assert rehome_on_split(t, P, [P], CFG) == ()  # the parent is no peer of itself
    with pytest.raises(InvalidInput):
        rehome_on_split(t, P, [S], CFG)  # another degree
    with pytest.raises(UnknownWorker):
        rehome_on_split(t, P, ["w-cp4-g16"], CFG)
    with pytest.raises(InvalidInput):
        rehome_on_split(t, P, [A], {"min_blocks": 4})  # type: ignore[arg-type]
    for bad in ({"min_blocks": 0, "fill": 0.5}, {"min_blocks": 4, "fill": 0.0},
                {"min_blocks": 4, "fill": 1.5}, {"min_blocks": True, "fill": 0.5}):
        with pytest.raises(InvalidInput):
            RehomeConfig(**bad)  # type: ignore[arg-type]
