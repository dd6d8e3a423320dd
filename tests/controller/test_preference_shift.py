"""Planner rule 10: the preference-shift merge.

Hand-derived on 16 GPUs, degrees {2, 4}, κ_2 = 10 s, κ_4 = 16 s per 20-s window (K = 10n + 16m
for n CP2 and m CP4 workers: 8CP2 = 80, 6CP2/1CP4 = 76), defaults u = 0.9, l = 0.5, merge
headroom 0.8; ``merge_speedup`` 1.2 and ``preference_shift`` 0.25 unless a test says otherwise.
"""

from __future__ import annotations

import math

import pytest

from services.controller.lattice import Composition, Lattice, OpKind
from services.controller.planner import ControllerConfig, Planner
from services.controller.windows import WindowSummary
from shared.costmodel import Profile
from shared.ids import InvalidInput

PROFILE = Profile(kappa={2: 10.0, 4: 16.0})
LAT = Lattice(16, {2, 4})
EIGHT_CP2 = Composition.uniform(LAT, 2)
SIX_ONE = Composition.parse(LAT, "6CP2/1CP4")
CFG = ControllerConfig(persistence=2, max_ops=8, merge_speedup=1.2, preference_shift=0.25)


def pwin(k: int, demand: float, preferred: dict[int, float]) -> WindowSummary:
    return WindowSummary(
        k,
        20.0 * k,
        20.0 * (k + 1),
        demand,
        10,
        0,
        demand_by_preferred=tuple(sorted(preferred.items())),
    )


def test_shift_toward_the_larger_degree_merges_once_after_persistence() -> None:
    # 8CP2, D = 50 within [0.5·80, 0.9·80] = [40, 72]: no capacity signal. 60% of the demand
    # prefers CP4, 0% of the GPUs are at CP4: 0.6 ≥ 0.25 -> MERGE, pending for one window.
    p = Planner(PROFILE, CFG)
    d = p.observe(pwin(0, 50.0, {2: 20.0, 4: 30.0}), EIGHT_CP2)
    assert (d.capacity_signal, d.fraction_signal, d.plans) == (None, OpKind.MERGE, ())
    assert d.streak == 1
    d = p.observe(pwin(1, 50.0, {2: 20.0, 4: 30.0}), EIGHT_CP2)
    # Admitted: D̂ = 50 ≤ u·K' = 0.9·76 = 68.4; the gate allows ⌈0.6·16/4⌉·4 = 12 GPUs at CP4.
    # One merge although max_ops is 8 and two more would pass both: a mix move is one step.
    assert len(d.plans) == 1 and d.plan is not None and d.plan.kind is OpKind.MERGE
    assert "prefer" in d.reason and d.trigger == "preference_shift"
    assert EIGHT_CP2.apply(d.plan.op).describe() == "6CP2/1CP4"


def test_shift_is_judged_against_the_gpus_already_at_the_larger_degree() -> None:
    # 6CP2/1CP4 holds 4 of 16 GPUs (0.25) at CP4. K = 76, D = 45 in [38, 68.4].
    # 45% of the demand prefers CP4: 0.45 − 0.25 = 0.20 < 0.25 -> hold.
    p = Planner(PROFILE, CFG)
    for k in range(3):
        d = p.observe(pwin(k, 45.0, {2: 24.75, 4: 20.25}), SIX_ONE)
        assert d.fraction_signal is None and d.direction is None and not d.plans
    # 55%: 0.30 ≥ 0.25 -> a merge on the second window.
    p = Planner(PROFILE, CFG)
    p.observe(pwin(0, 45.0, {2: 20.25, 4: 24.75}), SIX_ONE)
    d = p.observe(pwin(1, 45.0, {2: 20.25, 4: 24.75}), SIX_ONE)
    assert len(d.plans) == 1 and SIX_ONE.apply(d.plans[0].op).describe() == "4CP2/2CP4"


def test_shift_merge_needs_room_under_the_upper_threshold() -> None:
    # 8CP2, D = 70 < u·K = 72 (no capacity signal), but a merge leaves K' = 76 and
    # 70 > 0.9·76 = 68.4: refused, and the decision says by which bound.
    p = Planner(PROFILE, CFG)
    p.observe(pwin(0, 70.0, {4: 70.0}), EIGHT_CP2)
    d = p.observe(pwin(1, 70.0, {4: 70.0}), EIGHT_CP2)
    assert d.direction is OpKind.MERGE and d.plans == ()
    assert "0.90·capacity" in d.reason


def test_capacity_signal_suppresses_the_shift() -> None:
    # 6CP2/1CP4, D = 70 > u·K = 68.4 -> SPLIT by capacity, although 90% prefers CP4.
    p = Planner(PROFILE, CFG)
    d = p.observe(pwin(0, 70.0, {2: 7.0, 4: 63.0}), SIX_ONE)
    assert d.capacity_signal is OpKind.SPLIT and d.fraction_signal is None
    assert d.direction is OpKind.SPLIT


def test_off_unless_set_and_needs_a_breakdown() -> None:
    off = ControllerConfig(persistence=2, max_ops=8, merge_speedup=1.2)
    p = Planner(PROFILE, off)
    for k in range(3):
        d = p.observe(pwin(k, 50.0, {2: 20.0, 4: 30.0}), EIGHT_CP2)
        assert d.direction is None and not d.plans
    # A window without the breakdown (e.g. merge_speedup unset at the adapter) signals nothing.
    p = Planner(PROFILE, CFG)
    for k in range(3):
        d = p.observe(WindowSummary(k, 20.0 * k, 20.0 * (k + 1), 50.0, 10, 0), EIGHT_CP2)
        assert d.direction is None and not d.plans


def test_unavailable_workers_count_no_gpus_at_their_degree() -> None:
    # 6CP2/1CP4 with its CP4 worker failed: 0 of the 12 available GPUs at CP4. K = 60, D = 40
    # in [30, 54]. 30% prefers CP4: 0.30 ≥ 0.25 (with the CP4 worker available, K = 76 and D
    # in [38, 68.4]: 0.30 − 0.25 = 0.05, no signal). Admitted: 40 ≤ 0.9·56 = 50.4.
    cp4 = next(g.worker_id for g in SIX_ONE.groups if g.degree == 4)
    p = Planner(PROFILE, CFG)
    pref = {2: 28.0, 4: 12.0}
    p.observe(pwin(0, 40.0, pref), SIX_ONE, unavailable=[cp4])
    d = p.observe(pwin(1, 40.0, pref), SIX_ONE, unavailable=[cp4])
    assert len(d.plans) == 1 and cp4 not in d.plans[0].source_ids
    p = Planner(PROFILE, CFG)
    for k in range(3):
        assert p.observe(pwin(k, 40.0, pref), SIX_ONE).direction is None


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.5, math.nan, True])
def test_preference_shift_validation(bad: object) -> None:
    with pytest.raises(InvalidInput):
        ControllerConfig(merge_speedup=1.2, preference_shift=bad)  # type: ignore[arg-type]


def test_core_without_merge_speedup_reports_no_breakdown_so_no_shift() -> None:
    # The live controller fed by window reports runs with merge_speedup None: the core computes
    # no preferred degree, so rule 10 stays silent however long the requests are.
    from services.controller.core import ControllerCore

    core = ControllerCore(EIGHT_CP2, PROFILE, ControllerConfig(preference_shift=0.25))
    for k in range(3):
        core.assigned(20.0 * k + 1.0, 50.0, 100_000, degree=2)
        (d,) = core.tick(20.0 * (k + 1))
        assert d.window.demand_by_preferred == () and d.direction is None


@pytest.mark.parametrize("demand, admitted", [(58.0, True), (62.0, False)])
def test_preference_headroom_bounds_the_merge(demand: float, admitted: bool) -> None:
    # 8CP2, D in [40, 72]: no capacity signal; all of it prefers CP4. A merge leaves K' = 76.
    # Under u = 0.9 both demands are admitted (≤ 68.4); with preference_headroom 0.8 only
    # D ≤ 60.8 is: 58 merges, 62 is refused by the 0.80 bound.
    for cfg, ok in ((CFG, True),
                    (ControllerConfig(persistence=2, max_ops=8, merge_speedup=1.2,
                                      preference_shift=0.25, preference_headroom=0.8), admitted)):
        p = Planner(PROFILE, cfg)
        p.observe(pwin(0, demand, {4: demand}), EIGHT_CP2)
        d = p.observe(pwin(1, demand, {4: demand}), EIGHT_CP2)
        assert d.direction is OpKind.MERGE
        assert (len(d.plans) == 1) is ok, d.reason
        if not ok:
            assert "0.80·capacity" in d.reason


@pytest.mark.parametrize("bad", [0.0, -0.1, 0.95, math.nan, True, "0.8"])
def test_preference_headroom_validation(bad: object) -> None:
    # (0, upper]: upper is 0.9 by default.
    with pytest.raises(InvalidInput):
        ControllerConfig(preference_headroom=bad)  # type: ignore[arg-type]
