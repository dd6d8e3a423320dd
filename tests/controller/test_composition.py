"""Capacity and the initial composition rule (§6.1); values derived by hand."""

from __future__ import annotations

import pytest

from services.controller.composition import (
    HistoricalSample,
    HistoricalWorkload,
    capacity,
    demand_percentile,
    expected_mixture,
    initial_composition,
    mixture_distance,
    preferred_degree,
    samples_from_lengths,
)
from services.controller.lattice import Composition, Lattice
from shared.costmodel import Profile
from shared.ids import InvalidInput

PROFILE = Profile(kappa={2: 10.0, 4: 16.0})
LAT = Lattice(16, {2, 4})

# Short: Ê_2/Ê_4 = 1.0/0.9 ≈ 1.11 < 1.4 -> prefers CP2; 2 GPU·1.0 s each.
SHORT = HistoricalSample(1_000, {2: 1.0, 4: 0.9})
# Long: 10/6 ≈ 1.67 ≥ 1.4 -> prefers CP4; 4 GPU·6 s = 24 GPU-s each.
LONG = HistoricalSample(100_000, {2: 10.0, 4: 6.0})


def _half_half() -> tuple[HistoricalSample, ...]:
    # 6 short (12 GPU-s) + 0.5 long (12 GPU-s): mixture 50/50.
    return (
        HistoricalSample(SHORT.input_len, SHORT.service_s, weight=6.0),
        HistoricalSample(LONG.input_len, LONG.service_s, weight=0.5),
    )


def test_capacity_sums_kappa() -> None:
    assert capacity(Composition.uniform(LAT, 4), PROFILE) == 64.0
    assert capacity(Composition.from_counts(LAT, {2: 2, 4: 3}), PROFILE) == 68.0
    # A degree without a profiled κ falls back to 0.7·H = 14 s.
    assert capacity(Composition.uniform(LAT, 2), Profile(kappa={4: 16.0})) == 8 * 14.0


def test_preferred_degree_and_mixture() -> None:
    assert preferred_degree(SHORT, (2, 4), 1.4) == 2
    assert preferred_degree(LONG, (2, 4), 1.4) == 4
    assert preferred_degree(LONG, (2, 4), 1.7) == 2
    mix = expected_mixture(_half_half(), (2, 4))
    assert mix == pytest.approx({2: 0.5, 4: 0.5})
    assert expected_mixture((), (2, 4)) == {2: 1.0, 4: 0.0}


def test_mixture_distance_is_cumulative_from_the_large_end() -> None:
    # 2CP2/3CP4 on 16 GPUs: CP4 share 12/16 = 0.75 vs target 0.5.
    assert mixture_distance((2, 4), (2, 3), 16, {2: 0.5, 4: 0.5}) == pytest.approx(0.25)
    assert mixture_distance((2, 4), (4, 2), 16, {2: 0.5, 4: 0.5}) == pytest.approx(0.0)


# Counts (n2, n4) on 16 GPUs: capacities 80, 76, 72, 68, 64 for n4 = 0..4; CP4 shares
# 0, .25, .5, .75, 1 -> distances to 50/50: .5, .25, 0, .25, .5; tolerance .25 ->
# suitable: 6CP2/1CP4, 4CP2/2CP4, 2CP2/3CP4.
@pytest.mark.parametrize(
    ("demand", "expected", "sufficient"),
    [
        (50.0, "2CP2/3CP4", True),  # need 60: all suitable fit -> most CP4
        (58.0, "4CP2/2CP4", True),  # need 69.6: 76 and 72 fit -> more CP4 of those
        (62.0, "6CP2/1CP4", True),  # need 74.4: only 76
        (70.0, "8CP2", False),  # need 84: nothing fits -> the largest capacity (80)
    ],
)
def test_initial_composition_examples(demand: float, expected: str, sufficient: bool) -> None:
    choice = initial_composition(LAT, PROFILE, HistoricalWorkload(demand, _half_half()))
    assert choice.composition.describe() == expected
    assert choice.sufficient is sufficient
    assert choice.required_s == pytest.approx(1.2 * demand)


def test_all_long_history_favours_large_degree() -> None:
    choice = initial_composition(LAT, PROFILE, HistoricalWorkload(10.0, (LONG,)))
    assert choice.composition.describe() == "4CP4"
    assert choice.mixture == {2: 0.0, 4: 1.0}


def test_all_short_history_light_load_stays_small_degree_heavy() -> None:
    # Mixture 100% CP2: suitable are CP4 shares ≤ .25 -> 6CP2/1CP4 has the most CP4.
    choice = initial_composition(LAT, PROFILE, HistoricalWorkload(10.0, (SHORT,)))
    assert choice.composition.describe() == "6CP2/1CP4"


def test_paper_degrees_4_8_on_40_gpus() -> None:
    lat = Lattice(40, {4, 8})
    prof = Profile(kappa={4: 16.0, 8: 24.0})
    long8 = HistoricalSample(100_000, {4: 10.0, 8: 6.0})
    short4 = HistoricalSample(2_000, {4: 1.0, 8: 0.9})
    # GPU-s: long 8·6 = 48, short 4·1 = 4 -> weights 1 and 12 give 50/50.
    hist = HistoricalWorkload(100.0, (long8, HistoricalSample(2_000, short4.service_s, 12.0)))
    # Counts (n4, n8) = (10 − 2·n8, n8), n8 = 0..5; capacity 16·n4 + 24·n8 = 160 − 8·n8;
    # need 1.2·100 = 120 -> every n8 ≤ 5 fits. CP8 share 0.2·n8; within .25 of .5:
    # n8 ∈ {2, 3} -> most CP8 = 3.
    assert initial_composition(lat, prof, hist).composition.describe() == "4CP4/3CP8"
    # A looser tolerance (.3) admits n8 ∈ {1..4} -> 4.
    loose = initial_composition(lat, prof, hist, mixture_tolerance=0.3)
    assert loose.composition.describe() == "2CP4/4CP8"
    # Demand 130 needs 156: only n8 = 0 (160) fits, and it is not suitable -> largest
    # capacity, which is that same 10CP4.
    heavy = initial_composition(lat, prof, HistoricalWorkload(130.0, hist.samples))
    assert heavy.composition.describe() == "10CP4" and heavy.sufficient


def test_samples_from_lengths_use_the_profile() -> None:
    prof = Profile()
    (s,) = samples_from_lengths([8_192], prof, (2, 4), cached_fraction=0.5)
    assert s.service_s[2] == prof.predict(4_096, 4_096, 2)
    assert s.service_s[4] == prof.predict(4_096, 4_096, 4)
    (one,) = samples_from_lengths([1], prof, (2,), cached_fraction=0.9)
    assert one.service_s[2] == prof.predict(1, 0, 2)  # R ≥ 1 always
    with pytest.raises(InvalidInput):
        samples_from_lengths([0], prof, (2,))


def test_demand_percentile() -> None:
    assert demand_percentile([float(x) for x in range(1, 11)], 0.9) == 9.0
    assert demand_percentile([5.0], 0.5) == 5.0
    with pytest.raises(InvalidInput):
        demand_percentile([], 0.9)


@pytest.mark.parametrize(
    "kwargs",
    [{"headroom": 0.9}, {"speedup_threshold": 0.5}, {"mixture_tolerance": 2.0}],
)
def test_initial_composition_rejects_bad_parameters(kwargs: dict) -> None:
    with pytest.raises(InvalidInput):
        initial_composition(LAT, PROFILE, HistoricalWorkload(10.0, ()), **kwargs)


def test_bad_history_is_rejected() -> None:
    with pytest.raises(InvalidInput):
        HistoricalWorkload(-1.0)
    missing_degree = HistoricalSample(10, {2: 1.0})
    with pytest.raises(InvalidInput, match="service_s\\[4\\]"):
        initial_composition(LAT, PROFILE, HistoricalWorkload(1.0, (missing_degree,)))


def test_capacity_memo_is_per_profile_and_exclusion() -> None:
    comp = Composition.from_counts(LAT, {2: 2, 4: 3})
    other = Profile(kappa={2: 1.0, 4: 2.0})
    for _ in range(2):  # second round answers from the memo
        assert capacity(comp, PROFILE) == 68.0
        assert capacity(comp, other) == 8.0
        assert capacity(comp, PROFILE, frozenset({"w-cp4-g0"})) == 52.0
        assert capacity(comp, PROFILE, {"w-cp4-g0", "w-cp2-g12"}) == 42.0  # a set: no memo
        assert capacity(comp, PROFILE, ()) == 68.0
    # An equal composition built afresh agrees.
    assert capacity(Composition(LAT, comp.groups), other, frozenset({"w-cp2-g12"})) == 7.0
    assert capacity(comp, other, frozenset({"w-cp2-g12"})) == 7.0
