"""Per-window split/merge decisions (§6.2); every number below is derived by hand.

Setup: 16 GPUs, degrees {2, 4}, κ_2 = 10 s, κ_4 = 16 s per 20-s window; default thresholds
u = 0.9, l = 0.5, merge headroom 0.8, long-fraction δ = 0.15, stability 0.3, persistence 2.
"""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.composition import capacity
from services.controller.lattice import Composition, Lattice, LatticeOp, OpKind
from services.controller.planner import ControllerConfig, Planner
from services.controller.windows import WindowSummary
from shared.costmodel import Profile
from shared.ids import InvalidInput, WorkerId
from shared.worker import GpuGroup

PROFILE = Profile(kappa={2: 10.0, 4: 16.0})
LAT = Lattice(16, {2, 4})
FOUR_CP4 = Composition.uniform(LAT, 4)  # K = 64: u·K = 57.6, l·K = 32
EIGHT_CP2 = Composition.uniform(LAT, 2)  # K = 80: u·K = 72, l·K = 40
MIXED = Composition.from_counts(LAT, {2: 4, 4: 2})  # CP4 g0,g4; CP2 g8..g14; K = 72


def win(k: int, demand: float, requests: int = 10, long: int = 0) -> WindowSummary:
    return WindowSummary(k, 20.0 * k, 20.0 * (k + 1), demand, requests, long)


def W(s: str) -> WorkerId:
    return WorkerId(s)


def test_split_after_persistence_picks_min_drain_then_traffic() -> None:
    p = Planner(PROFILE)
    drain = {W("w-cp4-g0"): 3.0, W("w-cp4-g4"): 1.0, W("w-cp4-g8"): 1.0, W("w-cp4-g12"): 2.0}
    traffic = {W("w-cp4-g4"): 5.0, W("w-cp4-g8"): 2.0}
    first = p.observe(win(0, 60.0), FOUR_CP4, drain_s=drain, traffic=traffic)
    assert first.capacity_s == 64.0
    assert first.capacity_signal is OpKind.SPLIT and first.plan is None and first.streak == 1
    second = p.observe(win(1, 60.0), FOUR_CP4, drain_s=drain, traffic=traffic)
    plan = second.plan
    assert plan is not None
    # g4 and g8 tie on drain (1.0 s); g8 carries less reconciliation traffic (2 < 5).
    assert plan.kind is OpKind.SPLIT
    assert plan.sources == (GpuGroup(8, 4),)
    assert plan.targets == (GpuGroup(8, 2), GpuGroup(10, 2))
    assert (plan.predicted_drain_s, plan.reconcile_traffic) == (1.0, 2.0)
    assert "4CP4 -> 2CP2/3CP4" in plan.reason
    # The streak restarts after a plan.
    assert p.streak == (None, 0)


def test_merge_plan_drain_is_the_slower_sibling_and_traffic_sums() -> None:
    p = Planner(PROFILE)
    drain = {
        W("w-cp2-g0"): 2.0,
        W("w-cp2-g2"): 0.5,  # pair drain 2.0
        W("w-cp2-g4"): 1.0,
        W("w-cp2-g6"): 1.0,  # 1.0
        W("w-cp2-g8"): 0.2,
        W("w-cp2-g10"): 1.5,  # 1.5
        W("w-cp2-g12"): 1.0,
        W("w-cp2-g14"): 0.9,  # 1.0
    }
    traffic = {W("w-cp2-g4"): 3.0, W("w-cp2-g6"): 1.0, W("w-cp2-g12"): 1.0, W("w-cp2-g14"): 2.0}
    # D = 20 < l·K = 40; after a merge K' = 6·10 + 16 = 76 and 0.8·76 = 60.8 ≥ 20: admitted.
    assert p.observe(win(0, 20.0), EIGHT_CP2, drain_s=drain, traffic=traffic).plan is None
    plan = p.observe(win(1, 20.0), EIGHT_CP2, drain_s=drain, traffic=traffic).plan
    assert plan is not None and plan.kind is OpKind.MERGE
    # g4+g6 and g12+g14 tie on drain 1.0; traffic 4 vs 3 -> g12+g14.
    assert plan.sources == (GpuGroup(12, 2), GpuGroup(14, 2))
    assert plan.targets == (GpuGroup(12, 4),)
    assert (plan.predicted_drain_s, plan.reconcile_traffic) == (1.0, 3.0)


def test_traffic_callable_scores_whole_operations() -> None:
    p = Planner(PROFILE, ControllerConfig(persistence=1))

    def traffic(op: LatticeOp) -> float:
        return 0.0 if op.sources[0].first_gpu == 4 else 1.0

    plan = p.observe(win(0, 20.0), EIGHT_CP2, traffic=traffic).plan
    assert plan is not None and plan.sources[0] == GpuGroup(4, 2)


def test_no_operation_until_the_condition_persists() -> None:
    p = Planner(PROFILE, ControllerConfig(persistence=3))
    seq = [60.0, 40.0, 60.0, 60.0]  # the hold at 40 resets the streak
    decisions = [p.observe(win(k, d), FOUR_CP4) for k, d in enumerate(seq)]
    assert [d.streak for d in decisions] == [1, 0, 1, 2]
    assert all(d.plan is None for d in decisions)
    assert p.observe(win(4, 60.0), FOUR_CP4).plan is not None


def test_direction_change_restarts_the_streak() -> None:
    p = Planner(PROFILE)
    assert p.observe(win(0, 60.0), FOUR_CP4).streak == 1  # split
    d = p.observe(win(1, 10.0), FOUR_CP4)  # merge (10 < 32)
    assert (d.direction, d.streak, d.plan) == (OpKind.MERGE, 1, None)


def test_empty_windows_signal_merge() -> None:
    p = Planner(PROFILE)
    p.observe(win(0, 0.0, requests=0), EIGHT_CP2)
    d = p.observe(win(1, 0.0, requests=0), EIGHT_CP2)
    assert d.capacity_signal is OpKind.MERGE and d.plan is not None


def test_capacity_takes_precedence_over_the_long_fraction() -> None:
    p = Planner(PROFILE)
    # Reference: D = 50 (within [32, 57.6]), f = 0.2.
    p.observe(win(0, 50.0, 10, 2), FOUR_CP4)
    assert p.reference == (50.0, 0.2)
    # D = 58 > 57.6 -> split; stable (|58 − 50| ≤ 15) and f = 0.6 (+0.4) -> merge: conflict.
    d = p.observe(win(1, 58.0, 10, 6), FOUR_CP4)
    assert d.capacity_signal is OpKind.SPLIT
    assert d.fraction_signal is OpKind.MERGE
    assert d.direction is OpKind.SPLIT
    assert "capacity overrides" in d.reason
    assert d.trigger == "capacity"
    # Within bounds and no shift: no rule signals.
    assert Planner(PROFILE).observe(win(0, 50.0, 10, 2), FOUR_CP4).trigger is None


def test_long_fraction_increase_merges_at_stable_demand() -> None:
    p = Planner(PROFILE)
    # MIXED: K = 72, band [36, 64.8]. Reference D = 50, f = 0.1.
    p.observe(win(0, 50.0, 10, 1), MIXED)
    d1 = p.observe(win(1, 52.0, 10, 4), MIXED)  # +0.3 ≥ 0.15 at stable demand
    assert (d1.capacity_signal, d1.fraction_signal, d1.plan) == (None, OpKind.MERGE, None)
    assert d1.trigger == "long_fraction"  # rule 2, pending
    d2 = p.observe(win(2, 52.0, 10, 4), MIXED)
    # Merged K' = 2·10 + 3·16 = 68; 0.8·68 = 54.4 ≥ 52: admitted; no estimates -> lowest GPU.
    assert d2.plan is not None and d2.trigger == "long_fraction"
    assert d2.plan.sources == (GpuGroup(8, 2), GpuGroup(10, 2))


def test_long_fraction_decrease_splits_and_unstable_demand_rebases() -> None:
    p = Planner(PROFILE)
    p.observe(win(0, 40.0, 10, 5), FOUR_CP4)  # reference (40, 0.5)
    # |55 − 40| = 15 > 0.3·40 = 12: unstable -> no fraction signal, the reference moves.
    d = p.observe(win(1, 55.0, 10, 1), FOUR_CP4)
    assert d.fraction_signal is None and p.reference == (55.0, 0.1)
    d = p.observe(win(2, 55.0, 10, 5), FOUR_CP4)  # +0.4 -> merge signal (nothing to merge)
    assert d.fraction_signal is OpKind.MERGE
    p2 = Planner(PROFILE)
    p2.observe(win(0, 45.0, 10, 5), FOUR_CP4)
    p2.observe(win(1, 45.0, 10, 2), FOUR_CP4)  # −0.3 -> split pending
    d = p2.observe(win(2, 45.0, 10, 2), FOUR_CP4)
    # After a split K' = 3·16 + 2·10 = 68, l·K' = 34 ≤ 45: admitted.
    assert d.fraction_signal is OpKind.SPLIT and d.plan is not None
    assert d.plan.kind is OpKind.SPLIT


def test_fraction_split_refused_if_it_would_underload() -> None:
    p = Planner(PROFILE)
    p.observe(win(0, 33.0, 10, 5), FOUR_CP4)  # 33 ≥ 32: no capacity signal
    p.observe(win(1, 33.5, 10, 2), FOUR_CP4)
    d = p.observe(win(2, 33.5, 10, 2), FOUR_CP4)
    # l·K' = 0.5·68 = 34 > 33.5: the split would invite a merge right back.
    assert d.direction is OpKind.SPLIT and d.plan is None
    assert "split refused" in d.reason


def test_merge_admission_refused_when_capacity_would_not_suffice() -> None:
    prof = Profile(kappa={2: 10.0, 4: 12.0})
    cfg = ControllerConfig(lower=0.85, upper=0.9, merge_headroom=0.85)
    p = Planner(prof, cfg)
    # 8CP2: K = 80, l·K = 68 > 66 -> merge signal; merged K' = 60 + 12 = 72,
    # 0.85·72 = 61.2 < 66 -> refused.
    p.observe(win(0, 66.0), EIGHT_CP2)
    d = p.observe(win(1, 66.0), EIGHT_CP2)
    assert d.direction is OpKind.MERGE and d.plan is None
    assert "merge refused" in d.reason
    # The condition still persists (streak 3), but admission is judged on the largest demand
    # of the last two windows (max(66, 61) = 66 > 61.2): still refused.
    d = p.observe(win(2, 61.0), EIGHT_CP2)
    assert d.streak == 3 and d.plan is None
    # Two windows at 61 ≤ 61.2: admitted.
    d = p.observe(win(3, 61.0), EIGHT_CP2)
    assert d.streak == 4 and d.plan is not None


def test_no_split_possible_from_the_smallest_degree() -> None:
    p = Planner(PROFILE, ControllerConfig(persistence=1))
    d = p.observe(win(0, 100.0), EIGHT_CP2)
    assert d.direction is OpKind.SPLIT and d.plan is None
    assert "no split is possible" in d.reason


def test_unavailable_workers_are_not_planned() -> None:
    p = Planner(PROFILE, ControllerConfig(persistence=1))
    busy = [W("w-cp4-g0"), W("w-cp4-g4"), W("w-cp4-g8")]
    plan = p.observe(win(0, 60.0), FOUR_CP4, unavailable=busy).plan
    assert plan is not None and plan.sources == (GpuGroup(12, 4),)


def test_reconfiguring_holds_and_resets() -> None:
    p = Planner(PROFILE)
    p.observe(win(0, 60.0), FOUR_CP4)
    d = p.observe(win(1, 60.0), FOUR_CP4, reconfiguring=True)
    assert d.plan is None and d.reason == "reconfiguration in flight"
    assert p.observe(win(2, 60.0), FOUR_CP4).streak == 1


def test_composition_change_drops_reference_and_streak() -> None:
    p = Planner(PROFILE)
    p.observe(win(0, 60.0), FOUR_CP4)
    d = p.observe(win(1, 70.0), Composition.from_counts(LAT, {2: 2, 4: 3}))  # K = 68
    assert d.streak == 1 and d.plan is None


@pytest.mark.parametrize(
    "kwargs",
    [
        {"upper": 0.5, "lower": 0.9},
        {"lower": 0.0},
        {"merge_headroom": 0.95},  # above upper
        {"persistence": 0},
        {"persistence": 1.5},
        {"long_fraction_delta": 0.0},
        {"demand_stability": -0.1},
        {"window_s": 0.0},
        {"window_s": 1e-6},  # a window per microsecond: a simulation without memory bound
        {"window_s": 1e-300},
        {"upper": math.nan},
        {"long_threshold_tokens": 0},
    ],
)
def test_config_validation(kwargs: dict) -> None:
    with pytest.raises(InvalidInput):
        ControllerConfig(**kwargs)


def test_bad_estimates_change_nothing() -> None:
    p = Planner(PROFILE)
    p.observe(win(0, 60.0), FOUR_CP4)
    before = (p.streak, p.reference)
    with pytest.raises(InvalidInput):
        p.observe(win(1, 60.0), FOUR_CP4, drain_s={W("w-cp4-g0"): -1.0})
    with pytest.raises(InvalidInput):
        p.observe(win(1, 60.0), FOUR_CP4, traffic=lambda op: math.nan)
    with pytest.raises(InvalidInput):
        p.observe("not a window", FOUR_CP4)  # type: ignore[arg-type]
    assert (p.streak, p.reference) == before


def test_unavailable_workers_count_no_capacity() -> None:
    p = Planner(PROFILE, ControllerConfig(persistence=1))
    # 4CP4 with g0 failed: K = 48, u·K = 43.2 < 50 -> split one of the live workers.
    d = p.observe(win(0, 50.0), FOUR_CP4, unavailable=[W("w-cp4-g0")])
    assert d.capacity_s == 48.0
    assert d.plan is not None and d.plan.sources == (GpuGroup(4, 4),)
    assert d.composition == "4CP4"


# --- invariants over random demand sequences ----------------------------------------------
@settings(max_examples=50, deadline=None)
@given(
    start=st.integers(0, 8),
    windows=st.lists(
        st.tuples(st.floats(0.0, 150.0), st.integers(0, 20), st.integers(0, 20)), max_size=30
    ),
)
def test_plans_are_adjacent_admitted_and_do_not_invite_an_immediate_reversal(
    start: int, windows: list[tuple[float, int, int]]
) -> None:
    lat = Lattice(16, {2, 4, 8})
    prof = Profile(kappa={2: 10.0, 4: 16.0, 8: 24.0})
    cfg = ControllerConfig()
    starts = sorted(lat.achievable_counts())
    vec = starts[start % len(starts)]
    comp = Composition.from_counts(lat, dict(zip(lat.sorted_degrees, vec, strict=True)))
    p = Planner(prof, cfg)
    for k, (demand, n, n_long) in enumerate(windows):
        d = p.observe(win(k, demand, n, min(n, n_long)), comp)
        if d.plan is None:
            continue
        assert d.streak >= cfg.persistence
        assert d.plan.op in comp.adjacent()
        after = comp.apply(d.plan.op)
        k_after = capacity(after, prof)
        if d.plan.kind is OpKind.MERGE:
            # Admitted merges keep D ≤ 0.8·K' < 0.9·K': no capacity split right after.
            assert demand <= cfg.merge_headroom * k_after + 1e-9
            assert not demand > cfg.upper * k_after
        elif d.capacity_signal is None:
            # A mix-driven split never leaves the pool below the merge threshold.
            assert demand >= cfg.lower * k_after - 1e-9
        comp = after


def test_momentum_continues_a_direction_and_any_other_window_ends_it() -> None:
    """After an operation, the next window with the same signal acts at once; a window
    without it ends the momentum, so the next operation needs persistence again."""
    from services.controller.lattice import Composition, Lattice
    from services.controller.planner import ControllerConfig, Planner
    from services.controller.windows import WindowSummary
    from shared.costmodel import Profile

    lat = Lattice(16, {2, 4})
    prof = Profile(kappa={2: 10.0, 4: 16.0})
    planner = Planner(prof, ControllerConfig(persistence=2))
    comp = Composition.from_counts(lat, {4: 4})  # K = 64, u·K = 57.6

    def win(i: int, d: float) -> WindowSummary:
        return WindowSummary(i, 20.0 * i, 20.0 * (i + 1), d, 10, 0)

    assert planner.observe(win(0, 70.0), comp).plan is None  # 1/2
    plan = planner.observe(win(1, 70.0), comp).plan
    assert plan is not None and plan.kind.value == "split"
    comp = comp.apply(plan.op)  # 2CP2/3CP4: K = 68, u·K = 61.2
    plan2 = planner.observe(win(2, 70.0), comp).plan
    assert plan2 is not None and plan2.kind.value == "split"  # momentum: no second wait
    comp = comp.apply(plan2.op)  # K = 72, u·K = 64.8; l·K = 36
    assert planner.observe(win(3, 50.0), comp).plan is None  # no signal: momentum ends
    assert planner.observe(win(4, 70.0), comp).plan is None  # split pending 1/2 again
    assert planner.observe(win(5, 70.0), comp).plan is not None
