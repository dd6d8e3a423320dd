"""The buddy lattice: groups, compositions, adjacent split/merge operations."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.lattice import (
    Composition,
    Lattice,
    LatticeOp,
    OpKind,
    adjacent,
    apply,
)
from shared.ids import InvalidInput, UnknownWorker
from shared.worker import GpuGroup


def _n_compositions(lat: Lattice) -> int:
    return math.prod(len(t) for t in lat._node_tilings)


# --- lattice validation -------------------------------------------------------------------
@pytest.mark.parametrize(
    ("g", "degrees", "gpn"),
    [
        (0, {2}, 8),  # no GPUs
        (16, set(), 8),  # no degrees
        (16, {3}, 8),  # not a power of two
        (16, {2, 16}, 8),  # a degree larger than a node would cross it
        (18, {4}, 8),  # G not a multiple of the smallest degree
        (12, {4}, 6),  # node size not a multiple of the smallest degree
    ],
)
def test_bad_lattices_are_rejected(g: int, degrees: set[int], gpn: int) -> None:
    with pytest.raises(InvalidInput):
        Lattice(g, degrees, gpn)


def test_g40_degrees_2_4_enumeration() -> None:
    lat = Lattice(40, {2, 4})
    assert lat.num_nodes == 5
    # Per node of 8: each aligned half is one CP4 or two CP2 -> 4 tilings; 4^5 in all.
    assert [len(t) for t in lat._node_tilings] == [4] * 5
    assert _n_compositions(lat) == 1024
    # Counts (n_CP2, n_CP4): n_CP4 = 0..10, n_CP2 = 2·(10 − n_CP4).
    assert lat.achievable_counts() == {(2 * (10 - k), k) for k in range(11)}


def test_g16_degrees_2_4_8_enumeration() -> None:
    lat = Lattice(16, {2, 4, 8})
    # Per node: one CP8, or each half as CP4 or 2×CP2 (4) -> 5; two nodes -> 25.
    assert _n_compositions(lat) == 25
    # (n_CP2, n_CP4, n_CP8)
    assert lat.achievable_counts() == {
        (0, 0, 2),
        (0, 2, 1),
        (2, 1, 1),
        (4, 0, 1),
        (0, 4, 0),
        (2, 3, 0),
        (4, 2, 0),
        (6, 1, 0),
        (8, 0, 0),
    }


def test_uniform_and_describe() -> None:
    lat = Lattice(40, {2, 4})
    c4 = Composition.uniform(lat, 4)
    assert c4.describe() == "10CP4"
    assert c4.counts() == {2: 0, 4: 10}
    assert Composition.uniform(lat, 2).describe() == "20CP2"
    assert Composition.from_counts(lat, {2: 4, 4: 8}).describe() == "4CP2/8CP4"


def test_paper_notation_degrees_4_8() -> None:
    lat = Lattice(40, {4, 8})
    for counts, text in [
        ({4: 8, 8: 1}, "8CP4/1CP8"),
        ({4: 6, 8: 2}, "6CP4/2CP8"),
        ({4: 4, 8: 3}, "4CP4/3CP8"),
        ({4: 2, 8: 4}, "2CP4/4CP8"),
    ]:
        comp = Composition.from_counts(lat, counts)
        assert comp.describe() == text
        assert sum(g.degree for g in comp.groups) == 40


def test_from_counts_is_canonical_and_rejects_unreachable() -> None:
    lat = Lattice(16, {2, 4})
    comp = Composition.from_counts(lat, {2: 4, 4: 2})
    # Larger degrees on lower GPUs.
    assert comp.groups == (
        GpuGroup(0, 4),
        GpuGroup(4, 4),
        GpuGroup(8, 2),
        GpuGroup(10, 2),
        GpuGroup(12, 2),
        GpuGroup(14, 2),
    )
    with pytest.raises(InvalidInput):
        Composition.from_counts(lat, {2: 1, 4: 3})  # 14 GPUs
    with pytest.raises(InvalidInput):
        Composition.from_counts(lat, {8: 2})  # degree not in the set


def test_composition_validation() -> None:
    lat = Lattice(16, {2, 4})
    with pytest.raises(InvalidInput, match="not covered"):
        Composition(lat, (GpuGroup(0, 4), GpuGroup(8, 4), GpuGroup(12, 4)))
    with pytest.raises(InvalidInput, match="overlaps"):
        Composition(
            lat, (GpuGroup(0, 4), GpuGroup(2, 2), GpuGroup(4, 4), GpuGroup(8, 4), GpuGroup(12, 4))
        )
    with pytest.raises(InvalidInput, match="degree 8"):
        Composition(lat, (GpuGroup(0, 8), GpuGroup(8, 8)))
    with pytest.raises(InvalidInput, match="past the last"):
        Composition(lat, (*Composition.uniform(lat, 4).groups, GpuGroup(16, 4)))
    with pytest.raises(UnknownWorker):
        Composition.uniform(lat, 4).group("w-cp2-g0")


def test_group_crossing_a_node_is_rejected() -> None:
    # Nodes of 6 GPUs with degrees {2, 4}: the aligned group [4, 8) straddles GPUs 5|6.
    lat = Lattice(12, {2, 4}, gpus_per_node=6)
    assert not lat.is_group(GpuGroup(4, 4))
    with pytest.raises(InvalidInput, match="crosses a node"):
        Composition(lat, (GpuGroup(0, 4), GpuGroup(4, 4), GpuGroup(8, 4)))
    comp = Composition.uniform(lat, 2)
    merges = [op for op in adjacent(comp) if op.kind is OpKind.MERGE]
    # Only [0,4) and [8,12) are lattice groups of degree 4.
    assert [op.targets for op in merges] == [(GpuGroup(0, 4),), (GpuGroup(8, 4),)]


def test_partial_last_node() -> None:
    lat = Lattice(12, {2, 4})  # nodes of 8 and 4 GPUs
    assert lat.num_nodes == 2
    assert Composition.uniform(lat, 4).describe() == "3CP4"
    assert lat.achievable_counts() == {(0, 3), (2, 2), (4, 1), (6, 0)}


def test_adjacent_operations_g16_2_4_8() -> None:
    lat = Lattice(16, {2, 4, 8})
    two8 = Composition.uniform(lat, 8)
    ops = adjacent(two8)
    assert [(op.kind, op.sources) for op in ops] == [
        (OpKind.SPLIT, (GpuGroup(0, 8),)),
        (OpKind.SPLIT, (GpuGroup(8, 8),)),
    ]
    assert ops[0].targets == (GpuGroup(0, 4), GpuGroup(4, 4))
    four4 = Composition.uniform(lat, 4)
    ops = adjacent(four4)
    assert sum(op.kind is OpKind.SPLIT for op in ops) == 4
    merges = [op for op in ops if op.kind is OpKind.MERGE]
    # g4+g8 are adjacent CP4s but not siblings (and would cross a node): not offered.
    assert [op.sources for op in merges] == [
        (GpuGroup(0, 4), GpuGroup(4, 4)),
        (GpuGroup(8, 4), GpuGroup(12, 4)),
    ]
    assert four4.apply(merges[1]).describe() == "2CP4/1CP8"


def test_no_operation_between_non_consecutive_degrees() -> None:
    lat = Lattice(16, {2, 8})
    assert adjacent(Composition.uniform(lat, 8)) == ()
    assert adjacent(Composition.uniform(lat, 2)) == ()


def test_g40_uniform_adjacency() -> None:
    lat = Lattice(40, {2, 4})
    ops4 = adjacent(Composition.uniform(lat, 4))
    assert len(ops4) == 10 and all(op.kind is OpKind.SPLIT for op in ops4)
    ops2 = adjacent(Composition.uniform(lat, 2))
    assert len(ops2) == 10 and all(op.kind is OpKind.MERGE for op in ops2)
    assert Composition.uniform(lat, 4).apply(ops4[3]).describe() == "2CP2/9CP4"


def test_apply_rejects_foreign_or_malformed_ops() -> None:
    lat = Lattice(16, {2, 4})
    comp = Composition.uniform(lat, 4)
    not_there = LatticeOp(OpKind.MERGE, (GpuGroup(0, 2), GpuGroup(2, 2)), (GpuGroup(0, 4),))
    with pytest.raises(InvalidInput):
        apply(comp, not_there)
    wrong_targets = LatticeOp(OpKind.SPLIT, (GpuGroup(0, 4),), (GpuGroup(0, 4),))
    with pytest.raises(InvalidInput):
        apply(comp, wrong_targets)
    non_siblings = LatticeOp(OpKind.MERGE, (GpuGroup(4, 4), GpuGroup(8, 4)), (GpuGroup(0, 8),))
    with pytest.raises(InvalidInput):
        apply(comp, non_siblings)


# --- invariant: any walk over adjacent operations stays a valid composition ---------------
LATTICES = [
    Lattice(40, {2, 4}),
    Lattice(16, {2, 4, 8}),
    Lattice(40, {4, 8}),
    Lattice(24, {1, 2, 4, 8}),
    Lattice(12, {2, 4}, gpus_per_node=6),
]


def _start(lat_idx: int, start_idx: int) -> tuple[Lattice, Composition]:
    """A lattice of LATTICES and one of its achievable compositions (a walk's start)."""
    lat = LATTICES[lat_idx]
    starts = sorted(lat.achievable_counts())
    vec = starts[start_idx % len(starts)]
    return lat, Composition.from_counts(lat, dict(zip(lat.sorted_degrees, vec, strict=True)))


@settings(max_examples=60, deadline=None)
@given(
    lat_idx=st.integers(0, len(LATTICES) - 1),
    start_idx=st.integers(0, 10_000),
    choices=st.lists(st.integers(0, 10_000), max_size=40),
)
def test_random_walks_keep_a_valid_composition(
    lat_idx: int, start_idx: int, choices: list[int]
) -> None:
    lat, comp = _start(lat_idx, start_idx)
    for k in choices:
        ops = adjacent(comp)
        if not ops:
            break
        op = ops[k % len(ops)]
        nxt = comp.apply(op)
        # Every GPU covered exactly once, every group a lattice group inside one node.
        gpus = sorted(gpu for g in nxt.groups for gpu in g.gpus)
        assert gpus == list(range(lat.num_gpus))
        for g in nxt.groups:
            assert g.degree in lat.degrees
            assert g.within_node(lat.gpus_per_node)
            assert g.first_gpu % g.degree == 0
        assert sum(g.degree for g in nxt.groups) == lat.num_gpus
        assert nxt.count_vector() in lat.achievable_counts()
        # The inverse operation is offered and undoes it.
        inverse = LatticeOp(
            OpKind.MERGE if op.kind is OpKind.SPLIT else OpKind.SPLIT, op.targets, op.sources
        )
        assert inverse in adjacent(nxt)
        assert nxt.apply(inverse) == comp
        comp = nxt


def test_parse_round_trips_the_paper_notation() -> None:
    lat = Lattice(40, {4, 8})
    for text in ["8CP4/1CP8", "2CP4/4CP8", "10CP4", "5CP8"]:
        assert Composition.parse(lat, text).describe() == text
    assert Composition.parse(lat, " 1cp8 / 8cp4 ").describe() == "8CP4/1CP8"
    for bad in ["", "8CP4/", "CP4", "8XP4", "9CP4"]:
        with pytest.raises(InvalidInput):
            Composition.parse(lat, bad)


# --- memoised adjacency (the planner evaluates the same neighbours every window) -----------
def test_apply_memo_returns_the_same_validated_composition() -> None:
    lat = Lattice(40, {2, 4})
    comp = Composition.parse(lat, "8CP2/6CP4")
    assert comp.adjacent() is comp.adjacent()  # enumerated once
    for op in comp.adjacent():
        first = comp.apply(op)
        # An equal (not identical) operation hits the same entry.
        again = apply(comp, LatticeOp(op.kind, tuple(op.sources), tuple(op.targets)))
        assert again is first
        # Equal to what an unmemoised build gives: a fresh, equal composition has no memo.
        fresh = Composition(lat, comp.groups).apply(op)
        assert fresh == first and fresh is not first
        kept = tuple(g for g in comp.groups if g not in op.sources)
        assert first == Composition(lat, kept + op.targets)
        assert repr(first) == repr(fresh) and hash(first) == hash(fresh)


def test_memo_is_not_part_of_equality_repr_or_pickled_state() -> None:
    import pickle

    lat = Lattice(16, {2, 4})
    used, unused = Composition.uniform(lat, 4), Composition.uniform(lat, 4)
    for op in used.adjacent():
        used.apply(op)
    assert used == unused and hash(used) == hash(unused) and repr(used) == repr(unused)
    copy = pickle.loads(pickle.dumps(used))
    assert copy == used
    assert copy._derived.applied == {} and copy._derived.adjacent is None
    assert copy.adjacent() == used.adjacent()


def test_invalid_ops_still_raise_after_valid_ones_were_memoised() -> None:
    lat = Lattice(16, {2, 4})
    comp = Composition.uniform(lat, 4)
    for op in comp.adjacent():
        comp.apply(op)
    bad = [
        LatticeOp(OpKind.MERGE, (GpuGroup(0, 2), GpuGroup(2, 2)), (GpuGroup(0, 4),)),
        LatticeOp(OpKind.SPLIT, (GpuGroup(0, 4),), (GpuGroup(0, 4),)),
        # Unhashable parts cannot be looked up; they are rejected by validation.
        LatticeOp(OpKind.SPLIT, [GpuGroup(0, 4)], [GpuGroup(0, 2), GpuGroup(2, 2)]),  # type: ignore[arg-type]
    ]
    for op in bad:
        for _ in range(2):  # a failure is never memoised
            with pytest.raises(InvalidInput, match="not a lattice|not a worker"):
                comp.apply(op)
    with pytest.raises(InvalidInput, match="expected a LatticeOp"):
        comp.apply("split w-cp4-g0")  # type: ignore[arg-type]
    assert len(comp._derived.applied) == len(comp.adjacent())


@settings(max_examples=40, deadline=None)
@given(
    lat_idx=st.integers(0, len(LATTICES) - 1),
    start_idx=st.integers(0, 10_000),
    choices=st.lists(st.integers(0, 10_000), max_size=20),
)
def test_memoised_walks_match_unmemoised_ones(
    lat_idx: int, start_idx: int, choices: list[int]
) -> None:
    lat, comp = _start(lat_idx, start_idx)
    for k in choices:
        ops = comp.adjacent()
        if not ops:
            break
        op = ops[k % len(ops)]
        twin = Composition(lat, comp.groups)  # fresh memo every step
        assert twin.adjacent() == ops
        assert comp.apply(op) == twin.apply(op) == comp.apply(op)
        comp = comp.apply(op)
