"""Re-homing long prefixes across a reconfiguration (reconcile.py): a split parent's onto its
degree's other workers, and its peers' onto a merged worker."""

from __future__ import annotations

import pytest

from services.cachemgr.actions import Demote, Replicate
from services.cachemgr.events import Stored
from services.cachemgr.reconcile import RehomeConfig, rehome_on_merge, rehome_on_split
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
                {"min_blocks": 4, "fill": 1.5}, {"min_blocks": True, "fill": 0.5},
                {"min_blocks": 4, "fill": 0.5, "displace": 1}):
        with pytest.raises(InvalidInput):
            RehomeConfig(**bad)  # type: ignore[arg-type]


# --- split into full peers: displacement ---------------------------------------------------
DISPLACE = RehomeConfig(min_blocks=3, fill=1.0, displace=True)


def heat(t: PrefixTrie, path: tuple[int, ...], access: float) -> None:
    """Give every block of ``path`` the access count ``access`` (degree 4), as requests that
    reused the whole path would have."""
    for h in path:
        t.set_statistics(h, 4, access=access)


def full_peer(cap_a: int, *prefixes: tuple[tuple[int, ...], float]) -> PrefixTrie:
    """P holds two 3-block documents, (1, 2, 3) with heat 5 and (11, 12, 13) with heat 4; the
    peer A of ``cap_a`` blocks holds ``prefixes`` (stored in that order: the last is the most
    recent in A's LRU), each with its heat."""
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(P, 4, 100)
    t.add_worker(A, 4, cap_a)
    t.apply(Stored(P, 1, None, (1, 2, 3)))
    t.apply(Stored(P, 2, None, (11, 12, 13)))
    heat(t, (1, 2, 3), 5.0)
    heat(t, (11, 12, 13), 4.0)
    for i, (path, a) in enumerate(prefixes, start=1):
        t.apply(Stored(A, i, None, path))
        heat(t, path, a)
    return t


def test_a_full_peer_takes_a_hotter_copy_over_its_colder_blocks_demoted_leaf_last() -> None:
    # A is full (6 of 6): the hot prefix (70..72) was stored first, the cold one last, so plain
    # LRU would evict the hot one to make room.
    t = full_peer(6, ((70, 71, 72), 9.0), ((60, 61, 62), 0.0))
    assert rehome_on_split(t, P, [A], RehomeConfig(min_blocks=3, fill=1.0)) == ()
    acts = rehome_on_split(t, P, [A], DISPLACE)
    # (1, 2, 3) (heat 5) displaces the three cold blocks; (11, 12, 13) (heat 4) would need
    # three more blocks colder than 4, and A's others are at 9.
    assert acts == (Replicate(3, 4, P, A, (1, 2, 3), "intra"), Demote(A, (60, 61, 62)))
    assert t.inflight() == (acts[0],)


def test_displacement_is_promised_once_coldest_first_across_copies() -> None:
    t = full_peer(9, ((80, 81, 82), 9.0), ((70, 71, 72), 3.0), ((60, 61, 62), 0.0))
    acts = rehome_on_split(t, P, [A], DISPLACE)
    # The first copy (heat 5) takes the 3 coldest; the second (heat 4) the next 3, at heat 3.
    # The Demote lists the hottest first: A moves each to its LRU's old end in turn, so 62
    # (coldest, deepest) goes first, then 61, 60, 72, 71, 70; 80..82 stay.
    assert acts == (Replicate(3, 4, P, A, (1, 2, 3), "intra"),
                    Replicate(13, 4, P, A, (11, 12, 13), "intra"),
                    Demote(A, (70, 71, 72, 60, 61, 62)))


def test_no_displacement_of_blocks_as_hot_as_the_copy_or_for_an_unused_prefix() -> None:
    t = full_peer(6, ((70, 71, 72), 5.0), ((60, 61, 62), 5.0))
    assert rehome_on_split(t, P, [A], DISPLACE) == ()  # 5 is not colder than 5 (nor 4)
    assert t.inflight() == ()
    t = full_peer(6, ((60, 61, 62), 0.0), ((70, 71, 72), 0.0))
    heat(t, (1, 2, 3), 0.0)
    heat(t, (11, 12, 13), 0.0)
    assert rehome_on_split(t, P, [A], DISPLACE) == ()  # nothing is colder than never reused


def test_displacement_counts_only_what_goes_over_the_fill_bound() -> None:
    # A holds 4 of 8 blocks. Under fill 1.0 the first copy fits and the second goes 2 blocks
    # over: the two coldest (deepest first) are demoted.
    t = full_peer(8, ((60, 61, 62, 63), 0.0))
    assert rehome_on_split(t, P, [A], DISPLACE) == (
        Replicate(3, 4, P, A, (1, 2, 3), "intra"), Replicate(13, 4, P, A, (11, 12, 13), "intra"),
        Demote(A, (62, 63)))
    # Under fill 0.5 (4 blocks) the first goes 3 over; the second would take A 6 blocks over
    # its bound, and A has 4 to give.
    t = full_peer(8, ((60, 61, 62, 63), 0.0))
    assert rehome_on_split(t, P, [A], RehomeConfig(min_blocks=3, fill=0.5, displace=True)) == (
        Replicate(3, 4, P, A, (1, 2, 3), "intra"), Demote(A, (61, 62, 63)))


# --- merge ---------------------------------------------------------------------------------
M = "w-cp4-g12"


def merged_setup(cap_m: int = 20) -> PrefixTrie:
    """P and A (peers at degree 4) hold documents; M is the merged worker, full of short
    prompts from its children."""
    t = PrefixTrie([2, 4], block_size=4)
    t.add_worker(P, 4, 100)
    t.add_worker(A, 4, 100)
    t.add_worker(M, 4, cap_m)
    t.add_worker(S, 2, 50)
    t.apply(Stored(P, 1, None, (1, 2, 3, 4, 5)))  # document 1: 5 blocks
    t.apply(Stored(A, 1, None, (1, 2, 3, 4, 5)))  # ... held by both peers
    t.apply(Stored(A, 2, None, (20, 21, 22, 23)))  # document 2: 4 blocks, on A only
    t.apply(Stored(P, 2, None, (40, 41)))  # short: below min_blocks
    t.apply(Stored(M, 1, None, (60, 61, 62, 63, 64, 65)))  # the children's short prompts
    t.apply(Stored(S, 1, None, (70, 71, 72, 73, 74)))  # another degree's document
    return t


def test_merged_worker_gets_its_peers_long_prefixes_once_spread_over_sources() -> None:
    t = merged_setup()
    t.apply(Stored(M, 2, None, (1, 2)))  # M holds document 1's head already
    acts = rehome_on_merge(t, M, [P, A], CFG)
    # Equal heat: longer first. Document 1 from P (ties on copies issued go to the smaller
    # id), only its missing blocks; document 2 from A (P has issued one already, and only A
    # holds it). The short prefix and the degree-2 document are not copied; M's own
    # cache (used 8 of 20) does not limit the copies.
    assert acts == (Replicate(5, 4, P, M, (3, 4, 5), "intra"),
                    Replicate(23, 4, A, M, (20, 21, 22, 23), "intra"))
    assert set(t.inflight()) == set(acts)
    assert t.match([1, 2, 3, 4, 5]).held(M) == 2  # visible only on M's own report
    t.apply(Stored(M, 3, 2, (3, 4, 5)))
    assert t.match([1, 2, 3, 4, 5]).held(M) == 5
    assert acts[0] not in t.inflight()


def test_merge_copies_hottest_first_within_fill_and_skip_whole_or_pending() -> None:
    t = merged_setup(cap_m=10)
    t.set_statistics(22, 4, access=2.0)  # document 2 is hotter
    # fill 0.5 of 10 blocks: document 2 (4 blocks) fits, document 1 (5 more) does not.
    assert rehome_on_merge(t, M, [P, A], RehomeConfig(min_blocks=4, fill=0.5)) == (
        Replicate(23, 4, A, M, (20, 21, 22, 23), "intra"),)
    t2 = merged_setup()
    t2.apply(Stored(M, 2, None, (20, 21, 22, 23)))  # whole already
    assert [a.node_hash for a in rehome_on_merge(t2, M, [P, A], CFG)] == [5]


def test_merge_without_peers_and_bad_input() -> None:
    t = merged_setup()
    assert rehome_on_merge(t, M, [], CFG) == ()
    assert rehome_on_merge(t, M, [M], CFG) == ()
    with pytest.raises(InvalidInput):
        rehome_on_merge(t, M, [S], CFG)
    with pytest.raises(UnknownWorker):
        rehome_on_merge(t, M, ["w-cp4-g16"], CFG)
    with pytest.raises(InvalidInput):
        rehome_on_merge(t, M, [P], None)  # type: ignore[arg-type]


def test_merge_skips_a_prefix_the_lazy_reconcile_will_bring() -> None:
    t = PrefixTrie([2, 4], block_size=4)
    left, right = "w-cp2-g12", "w-cp2-g14"
    t.add_worker(A, 4, 100)
    t.add_worker(left, 2, 50)
    t.add_worker(right, 2, 50)
    t.apply(Stored(A, 1, None, (1, 2, 3, 4, 5)))
    t.apply(Stored(A, 2, None, (20, 21, 22, 23)))
    t.apply(Stored(left, 1, None, (1, 2, 3, 4, 5)))  # pages 2, 3 land on the wrong ranks
    t.reconcile_merge((left, right), M, 100)
    assert t.pending_blocks(M)  # the precondition of this test
    assert [a.node_hash for a in rehome_on_merge(t, M, [A], CFG)] == [23]
