"""Properties of the grouping lattice and of compositions over it, on random lattices.

test_lattice.py walks a fixed list of lattices; here the lattice itself is drawn (GPU count,
node size, degree set), and each property is stated from the module doc's rules, not from the
implementation: a degree-C worker is an aligned group [kC, (k+1)C) inside one node and inside
[0, G); a split replaces one degree-2C worker by its two aligned degree-C halves, a merge is
the inverse and only of siblings; both keep the GPU budget.
"""

from __future__ import annotations

import math

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from services.controller.composition import (
    HistoricalSample,
    HistoricalWorkload,
    capacity,
    capacity_of_counts,
    initial_composition,
)
from services.controller.lattice import Composition, Lattice, LatticeOp, OpKind, adjacent
from shared.costmodel import Profile
from shared.ids import InvalidInput
from shared.worker import GpuGroup

DEGREES = (1, 2, 4, 8, 16)


@st.composite
def lattices(draw: st.DrawFn, consecutive: bool = False) -> Lattice:
    """A valid lattice: G ≤ 48 GPUs, node sizes of real and odd machines, degrees ⊂ {1..16}."""
    gpn = draw(st.sampled_from([2, 4, 6, 8, 12, 16]))
    if consecutive:  # a run of consecutive powers of two: every split has its halves' degree
        lo = draw(st.integers(0, 4))
        hi = draw(st.integers(lo, 4))
        degs = set(DEGREES[lo : hi + 1])
    else:
        degs = draw(st.sets(st.sampled_from(DEGREES), min_size=1, max_size=4))
    degs = {c for c in degs if c <= gpn} or {1}
    cmin = min(degs)
    assume(gpn % cmin == 0)
    g = cmin * draw(st.integers(1, 48 // cmin))
    return Lattice(g, degs, gpus_per_node=gpn)


@st.composite
def compositions(draw: st.DrawFn, lat: Lattice, walk: int = 12) -> Composition:
    """A composition of ``lat``: a canonical one for an achievable count vector, then a short
    random walk over adjacent operations (so non-canonical layouts are reached too)."""
    vecs = sorted(lat.achievable_counts())
    vec = draw(st.sampled_from(vecs))
    comp = Composition.from_counts(lat, dict(zip(lat.sorted_degrees, vec, strict=True)))
    for k in draw(st.lists(st.integers(0, 1000), max_size=walk)):
        ops = comp.adjacent()
        if not ops:
            break
        comp = comp.apply(ops[k % len(ops)])
    return comp


def _is_lattice_group(lat: Lattice, first: int, degree: int) -> bool:
    """The module doc's definition, from first principles."""
    return (
        degree in lat.degrees
        and first % degree == 0
        and first + degree <= lat.num_gpus
        and first // lat.gpus_per_node == (first + degree - 1) // lat.gpus_per_node
    )


def _legal_ops(comp: Composition) -> set[LatticeOp]:
    """Every split and merge the rules allow on ``comp``, enumerated naively (all pairs)."""
    lat = comp.lattice
    out: set[LatticeOp] = set()
    for g in comp.groups:
        half = g.degree // 2
        if g.degree >= 2 and half in lat.degrees:
            out.add(
                LatticeOp(
                    OpKind.SPLIT,
                    (g,),
                    (GpuGroup(g.first_gpu, half), GpuGroup(g.first_gpu + half, half)),
                )
            )
    for lo in comp.groups:
        for hi in comp.groups:
            c = lo.degree
            if (
                hi.degree == c
                and hi.first_gpu == lo.first_gpu + c
                and _is_lattice_group(lat, lo.first_gpu, 2 * c)
            ):
                out.add(LatticeOp(OpKind.MERGE, (lo, hi), (GpuGroup(lo.first_gpu, 2 * c),)))
    return out


# Mostly plausible lattice parameters (powers of two, node sizes of real machines, G a multiple
# of a degree) with a few bad values among them: uniform integers almost never build a lattice,
# so the half of the property about a built one would hardly run.
_DEGREE = st.sampled_from([1, 2, 4, 8] * 8 + [16, -1, 0, 3, 6, 40])
_GPN = st.sampled_from([8, 16] * 6 + [2, 4, -1, 0, 1, 3, 6, 12])


@st.composite
def _lattice_args(draw: st.DrawFn) -> tuple[int, set[int], int]:
    degrees = draw(st.sets(_DEGREE, max_size=4))
    gpn = draw(_GPN)
    unit = max([gpn, *degrees, 1])
    g = draw(st.one_of(st.integers(1, 8).map(lambda k: k * unit),  # usually a whole number of
                       st.integers(-2, 64)))                       # nodes, sometimes anything
    return g, degrees, gpn


@settings(max_examples=200, deadline=None)
@given(args=_lattice_args())
def test_any_lattice_parameters_build_a_lattice_or_raise_invalid_input(
    args: tuple[int, set[int], int],
) -> None:
    """Lattice construction never fails with anything but InvalidInput; a lattice that is
    built keeps its contract: the all-smallest-degree composition exists and covers G."""
    g, degrees, gpn = args
    try:
        lat = Lattice(g, degrees, gpus_per_node=gpn)
    except InvalidInput:
        return
    smallest = Composition.uniform(lat, min(lat.degrees))
    assert sum(x.degree for x in smallest.groups) == lat.num_gpus
    assert smallest.count_vector() in lat.achievable_counts()


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_adjacent_is_exactly_the_legal_splits_and_merges(data: st.DataObject) -> None:
    """``adjacent`` offers every split of a degree-2C worker into its aligned halves and every
    merge of two sibling degree-C workers into a lattice parent — and nothing else; each keeps
    the GPU budget, changes only the operation's workers and moves one worker count each way."""
    lat = data.draw(lattices())
    comp = data.draw(compositions(lat))
    ops = adjacent(comp)
    assert set(ops) == _legal_ops(comp)
    assert len(ops) == len(set(ops))
    degs = lat.sorted_degrees
    for op in ops:
        after = comp.apply(op)
        assert sum(x.degree for x in after.groups) == lat.num_gpus
        assert set(after.groups) == (set(comp.groups) - set(op.sources)) | set(op.targets)
        assert sorted(op.gpus) == sorted(gpu for x in op.targets for gpu in x.gpus)
        small, big = (op.targets, op.sources) if op.kind is OpKind.SPLIT else (
            op.sources, op.targets)
        c = small[0].degree
        delta = [a - b for a, b in zip(after.count_vector(), comp.count_vector(), strict=True)]
        sign = 1 if op.kind is OpKind.SPLIT else -1
        assert delta[degs.index(c)] == 2 * sign and delta[degs.index(2 * c)] == -sign
        assert sum(map(abs, delta)) == 3
        assert (len(small), len(big)) == (2, 1) and big[0].degree == 2 * c


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_operations_outside_adjacent_are_refused(data: st.DataObject) -> None:
    """Merging two workers that are not siblings (or not both workers of the composition), or
    splitting a worker into anything but its halves, raises InvalidInput."""
    lat = data.draw(lattices())
    comp = data.draw(compositions(lat))
    a = data.draw(st.sampled_from(comp.groups))
    b = data.draw(st.sampled_from(comp.groups))
    legal = set(adjacent(comp))
    candidates = []
    if a.degree == b.degree and a.first_gpu < b.first_gpu and a.first_gpu % (2 * a.degree) == 0:
        candidates.append(LatticeOp(OpKind.MERGE, (a, b), (GpuGroup(a.first_gpu, 2 * a.degree),)))
    if a.degree >= 2:
        half = a.degree // 2
        shifted = GpuGroup(a.first_gpu + half, half)
        candidates.append(LatticeOp(OpKind.SPLIT, (a,), (shifted, GpuGroup(a.first_gpu, half))))
        candidates.append(LatticeOp(OpKind.SPLIT, (a,), (a,)))
    for op in candidates:
        if op in legal:
            continue
        try:
            comp.apply(op)
        except InvalidInput:
            continue
        raise AssertionError(f"{op} applied to {comp.describe()} but is not adjacent")


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_splits_alone_reach_the_all_smallest_composition(data: st.DataObject) -> None:
    """With consecutive degrees every worker above the smallest degree can be split, so from any
    composition exactly G/c_min − n_workers splits (in any order) lead to all-smallest."""
    lat = data.draw(lattices(consecutive=True))
    comp = data.draw(compositions(lat))
    cmin = min(lat.degrees)
    n_workers = len(comp.groups)
    steps = 0
    while True:
        splits = [op for op in comp.adjacent() if op.kind is OpKind.SPLIT]
        if not splits:
            break
        comp = comp.apply(splits[data.draw(st.integers(0, len(splits) - 1))])
        steps += 1
    assert comp == Composition.uniform(lat, cmin)
    assert steps == lat.num_gpus // cmin - n_workers


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_from_counts_round_trips_every_achievable_vector(data: st.DataObject) -> None:
    """Every achievable count vector builds a composition with exactly those counts, and the
    paper notation of it parses back to the same (canonical) composition."""
    lat = data.draw(lattices())
    vecs = sorted(lat.achievable_counts())
    for vec in data.draw(st.lists(st.sampled_from(vecs), min_size=1, max_size=6)):
        comp = Composition.from_counts(lat, dict(zip(lat.sorted_degrees, vec, strict=True)))
        assert comp.count_vector() == vec
        assert Composition.parse(lat, comp.describe()) == comp


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_walks_stay_within_the_achievable_counts(data: st.DataObject) -> None:
    """A composition reached by any walk has a count vector the lattice lists as achievable
    (what capacity and the initial-composition rule enumerate)."""
    lat = data.draw(lattices())
    comp = data.draw(compositions(lat, walk=30))
    assert comp.count_vector() in lat.achievable_counts()


# --- capacity and the initial composition (composition.py) --------------------------------
@settings(max_examples=100, deadline=None)
@given(
    data=st.data(),
    kappa=st.lists(st.floats(1.0, 100.0), min_size=5, max_size=5),
    demand=st.floats(0.0, 2_000.0),
    headroom=st.floats(1.0, 2.0),
    tolerance=st.floats(0.0, 1.0),
    samples=st.lists(
        st.tuples(st.integers(1, 200_000), st.floats(0.1, 50.0), st.floats(0.3, 1.0),
                  st.floats(0.0, 10.0)),
        max_size=8,
    ),
)
def test_initial_composition_has_enough_capacity_or_the_most(
    data: st.DataObject,
    kappa: list[float],
    demand: float,
    headroom: float,
    tolerance: float,
    samples: list[tuple[int, float, float, float]],
) -> None:
    """§6.1: the initial composition is achievable; when it reports sufficient it has capacity
    ≥ headroom × demand; when no composition has that much, it is one of the largest capacity.
    The reported capacity is the composition's Σ κ."""
    lat = data.draw(lattices())
    degs = lat.sorted_degrees
    prof = Profile(kappa=dict(zip(DEGREES, kappa, strict=True)))
    hist = HistoricalWorkload(
        demand,
        tuple(
            # Service time shrinks by ``eff`` per doubling: eff < 0.71 means 1.4× speed-up.
            HistoricalSample(n, {c: base * eff ** math.log2(c) for c in degs}, weight=w)
            for n, base, eff, w in samples
        ),
    )
    choice = initial_composition(
        lat, prof, hist, headroom=headroom, mixture_tolerance=tolerance
    )
    assert choice.composition.count_vector() in lat.achievable_counts()
    assert math.isclose(choice.capacity_s, capacity(choice.composition, prof))
    assert math.isclose(choice.required_s, headroom * demand)
    best = max(capacity_of_counts(degs, v, prof) for v in lat.achievable_counts())
    if choice.sufficient:
        assert choice.capacity_s >= choice.required_s
    if best < choice.required_s:
        assert not choice.sufficient and math.isclose(choice.capacity_s, best)
    assert math.isclose(sum(choice.mixture.values()), 1.0)
