"""Multi-operation plans (planner rule 8) and the merge-admission peak (rule 5).

Hand-derived cases use 16 GPUs, degrees {2, 4}, κ_2 = 10 s, κ_4 = 16 s per 20-s window, so a
composition with n CP2 and m CP4 workers has K = 10n + 16m (4CP4 = 64, 8CP2 = 80; each split
adds 4, each merge removes 4). Properties run on a {2, 4, 8} lattice as well.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.composition import capacity
from services.controller.core import ControllerCore
from services.controller.lattice import Composition, Lattice, OpKind
from services.controller.planner import ControllerConfig, Decision, Plan, Planner
from services.controller.windows import WindowSummary
from shared.costmodel import Profile
from shared.ids import InvalidInput, RequestId, WorkerId
from shared.worker import GpuGroup

PROFILE = Profile(kappa={2: 10.0, 4: 16.0})
LAT = Lattice(16, {2, 4})
FOUR_CP4 = Composition.uniform(LAT, 4)
EIGHT_CP2 = Composition.uniform(LAT, 2)


def win(k: int, demand: float, requests: int = 10, long: int = 0) -> WindowSummary:
    return WindowSummary(k, 20.0 * k, 20.0 * (k + 1), demand, requests, long)


def apply_all(comp: Composition, plans: tuple[Plan, ...]) -> Composition:
    for p in plans:
        comp = comp.apply(p.op)
    return comp


# --- hand-derived ----------------------------------------------------------------------------
def test_capacity_split_goes_to_the_headroom_target_in_one_plan() -> None:
    # D = 60 > u·K = 0.9·64. Split targets D ≤ split_target·K = 0.8·K: after 1 split
    # 0.8·68 = 54.4, after 2
    # 57.6 (both < 60), after 3 0.8·76 = 60.8 ≥ 60 -> three splits, lowest GPUs first (no
    # estimates), 4CP4 -> 6CP2/1CP4.
    p = Planner(PROFILE, ControllerConfig(persistence=1, max_ops=8))
    d = p.observe(win(0, 60.0), FOUR_CP4)
    assert [pl.sources for pl in d.plans] == [
        (GpuGroup(0, 4),),
        (GpuGroup(4, 4),),
        (GpuGroup(8, 4),),
    ]
    assert d.plan == d.plans[0]
    assert apply_all(FOUR_CP4, d.plans).describe() == "6CP2/1CP4"
    assert d.reason.startswith("3 splits (4CP4 -> 6CP2/1CP4)")


def test_split_plan_stops_when_nothing_is_left_to_split() -> None:
    # D = 75: even 8CP2 (0.8·80 = 64) is short; all four CP4 split, no more is possible.
    p = Planner(PROFILE, ControllerConfig(persistence=1, max_ops=8))
    d = p.observe(win(0, 75.0), FOUR_CP4)
    assert len(d.plans) == 4 and apply_all(FOUR_CP4, d.plans) == EIGHT_CP2


def test_max_ops_caps_the_plan() -> None:
    p = Planner(PROFILE, ControllerConfig(persistence=1, max_ops=2))
    d = p.observe(win(0, 60.0), FOUR_CP4)
    assert len(d.plans) == 2


def test_default_is_one_operation_per_plan() -> None:
    p = Planner(PROFILE, ControllerConfig(persistence=1))
    d = p.observe(win(0, 75.0), FOUR_CP4)
    assert len(d.plans) == 1 and d.plans == (d.plan,)


def test_capacity_merge_goes_as_far_as_admission_allows() -> None:
    # lower 0.7: D = 52 < 0.7·80 = 56 -> merge. Admitted while 52 ≤ 0.8·K': K' = 76, 72, 68
    # give 60.8, 57.6, 54.4 (admitted); K' = 64 gives 51.2 < 52 -> three merges.
    p = Planner(PROFILE, ControllerConfig(persistence=1, lower=0.7, max_ops=8))
    d = p.observe(win(0, 52.0), EIGHT_CP2)
    assert d.direction is OpKind.MERGE and len(d.plans) == 3
    after = apply_all(EIGHT_CP2, d.plans)
    assert after.describe() == "2CP2/3CP4"
    # The merged pool is inside the hold band: no split (52 ≤ 0.9·68) and no further merge.
    assert 52.0 <= 0.9 * capacity(after, PROFILE)


def test_merge_admission_uses_the_peak_of_the_persistence_windows() -> None:
    # Persistence 2: windows 50 then 20, both < l·K = 0.7·80 = 56. The plan is sized for
    # max(50, 20) = 50 (K' = 64 gives 51.2 ≥ 50 -> four merges), not for 20 alone.
    cfg = ControllerConfig(persistence=2, lower=0.7, max_ops=8)
    p = Planner(PROFILE, cfg)
    assert p.observe(win(0, 50.0), EIGHT_CP2).plans == ()
    d = p.observe(win(1, 20.0), EIGHT_CP2)
    assert len(d.plans) == 4
    # With 53 in the streak instead: 53 > 0.8·64 = 51.2, so only three merges (54.4 ≥ 53).
    p = Planner(PROFILE, cfg)
    p.observe(win(0, 53.0), EIGHT_CP2)
    assert len(p.observe(win(1, 20.0), EIGHT_CP2).plans) == 3


def test_a_mix_shift_moves_one_operation() -> None:
    # The long-fraction case of test_planner (MIXED, K = 72) with max_ops 8: still one merge.
    mixed = Composition.from_counts(LAT, {2: 4, 4: 2})
    p = Planner(PROFILE, ControllerConfig(max_ops=8))
    p.observe(win(0, 50.0, 10, 1), mixed)
    p.observe(win(1, 52.0, 10, 4), mixed)
    d = p.observe(win(2, 52.0, 10, 4), mixed)
    assert d.capacity_signal is None and d.fraction_signal is OpKind.MERGE
    assert len(d.plans) == 1


def test_unavailable_and_drained_workers_are_not_reused() -> None:
    p = Planner(PROFILE, ControllerConfig(persistence=1, max_ops=8))
    busy = [WorkerId("w-cp4-g4")]
    d = p.observe(win(0, 75.0), FOUR_CP4, unavailable=busy)
    sources = [g for pl in d.plans for g in pl.sources]
    assert GpuGroup(4, 4) not in sources and len(sources) == len(set(sources)) == 3


def test_decision_plan_must_be_the_first_of_plans() -> None:
    p = Planner(PROFILE, ControllerConfig(persistence=1, max_ops=8))
    d = p.observe(win(0, 75.0), FOUR_CP4)
    with pytest.raises(InvalidInput):
        Decision(
            d.window,
            d.capacity_s,
            d.capacity_signal,
            d.fraction_signal,
            d.direction,
            d.streak,
            d.plans[1],
            d.reason,
            d.composition,
            d.plans,
        )


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_max_ops_validation(bad: object) -> None:
    with pytest.raises(InvalidInput):
        ControllerConfig(max_ops=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0.0, -0.5, 0.95, float("nan")])  # 0.95 > upper 0.9
def test_split_target_validation(bad: float) -> None:
    with pytest.raises(InvalidInput):
        ControllerConfig(split_target=bad)


def test_split_target_sets_how_far_a_split_plan_goes() -> None:
    # split_target 0.6, D = 60: 0.6·K ≥ 60 needs K ≥ 100 > 80 -> all four CP4 split.
    p = Planner(PROFILE, ControllerConfig(persistence=1, max_ops=8, split_target=0.6))
    assert len(p.observe(win(0, 60.0), FOUR_CP4).plans) == 4
    # split_target 0.9 = u: one split (0.9·68 = 61.2 ≥ 60).
    p = Planner(PROFILE, ControllerConfig(persistence=1, max_ops=8, split_target=0.9))
    assert len(p.observe(win(0, 60.0), FOUR_CP4).plans) == 1


def test_core_starts_every_operation_and_plans_nothing_until_all_are_exposed() -> None:
    core = ControllerCore(FOUR_CP4, PROFILE, ControllerConfig(persistence=1, max_ops=8))
    core.assigned(1.0, 60.0, 2_000, degree=4)
    (d,) = core.tick(20.0)
    assert len(d.plans) == 3 and core.pending_plans == d.plans
    assert core.pending_plan == d.plans[0]
    starts = []
    for i, plan in enumerate(reversed(d.plans)):  # any order: the operations are disjoint
        starts.append(core.start(plan, 20.0, in_flight={plan.source_ids[0]: [RequestId(f"r{i}")]}))
        # Still outstanding: the next window plans nothing.
    assert core.pending_plans == ()
    core.assigned(21.0, 100.0, 2_000, degree=4)
    (d2,) = core.tick(40.0)
    assert d2.plans == () and d2.reason == "reconfiguration in flight"
    for i, (plan, res) in enumerate(zip(reversed(d.plans), starts, strict=True)):
        core.protocol.finished(plan.source_ids[0], RequestId(f"r{i}"), 41.0)
        rec = core.protocol.switch_started(res.reconfiguration, 42.0)
        for g in plan.targets:
            for gpu in g.gpus:
                core.protocol.ack(gpu, rec.epoch, g.degree)
        core.protocol.exposed(res.reconfiguration, 42.0)
    assert core.protocol.composition.describe() == "6CP2/1CP4"
    assert core.protocol.epoch == 3  # one commit per operation


def test_core_discard_drops_every_pending_operation() -> None:
    core = ControllerCore(FOUR_CP4, PROFILE, ControllerConfig(persistence=1, max_ops=8))
    core.assigned(1.0, 75.0, 2_000, degree=4)
    core.tick(20.0)
    first = core.pending_plans[0]
    core.start(first, 20.0)
    assert len(core.pending_plans) == 3
    core.discard_plan()
    assert core.pending_plans == () and core.pending_plan is None


# --- properties ------------------------------------------------------------------------------
LAT3 = Lattice(16, {2, 4, 8})
PROF3 = Profile(kappa={2: 10.0, 4: 16.0, 8: 24.0})


def _start(lat: Lattice, i: int) -> Composition:
    vecs = sorted(lat.achievable_counts())
    v = vecs[i % len(vecs)]
    return Composition.from_counts(lat, dict(zip(lat.sorted_degrees, v, strict=True)))


@settings(max_examples=80, deadline=None)
@given(
    three=st.booleans(),
    start=st.integers(0, 50),
    max_ops=st.integers(1, 8),
    windows=st.lists(
        st.tuples(st.floats(0.0, 150.0), st.integers(0, 20), st.integers(0, 20)), max_size=25
    ),
    failed=st.sets(st.integers(0, 15), max_size=2),
    split_target=st.floats(0.3, 0.9),
)
def test_every_plan_is_a_sequence_of_disjoint_lattice_ops_within_the_budget(
    three: bool,
    start: int,
    max_ops: int,
    windows: list[tuple[float, int, int]],
    failed: set[int],
    split_target: float,
) -> None:
    lat, prof = (LAT3, PROF3) if three else (LAT, PROFILE)
    cfg = ControllerConfig(max_ops=max_ops, split_target=split_target)
    comp = _start(lat, start)
    p = Planner(prof, cfg)
    for k, (demand, n, n_long) in enumerate(windows):
        unavailable = {comp.groups[i % len(comp.groups)].worker_id for i in failed}
        d = p.observe(win(k, demand, n, min(n, n_long)), comp, unavailable=unavailable)
        assert len(d.plans) <= max_ops
        if not d.plans:
            continue
        assert {pl.kind for pl in d.plans} == {d.direction}
        touched: set[WorkerId] = set(unavailable)
        virtual = comp
        for pl in d.plans:
            assert pl.op in virtual.adjacent()  # a lattice op on the composition so far
            assert not touched.intersection(pl.source_ids)  # no draining/new worker reused
            touched.update(pl.source_ids)
            touched.update(pl.target_ids)
            virtual = virtual.apply(pl.op)
            assert sum(g.degree for g in virtual.groups) == lat.num_gpus
        k_after = capacity(virtual, prof, unavailable)
        if d.direction is OpKind.MERGE:
            # Admitted merges leave the hold band's headroom: no capacity split right after.
            assert demand <= cfg.merge_headroom * k_after + 1e-9
        elif d.capacity_signal is OpKind.SPLIT and len(d.plans) > 1:
            # Minimal: the composition before the last split still lacked the headroom.
            before = apply_all(comp, d.plans[:-1])
            assert demand > cfg.split_target * capacity(before, prof, unavailable) - 1e-9
        comp = virtual


@settings(max_examples=60, deadline=None)
@given(
    three=st.booleans(),
    start=st.integers(0, 50),
    max_ops=st.integers(1, 64),
    persistence=st.integers(1, 3),
    demand=st.floats(0.0, 150.0),
    n_long=st.integers(0, 10),
    merge_headroom=st.floats(0.3, 0.9),
    split_target=st.floats(0.3, 0.9),
    prefer_large=st.one_of(st.none(), st.floats(0.0, 1.0)),
)
def test_constant_demand_converges_and_never_flaps(
    three: bool,
    start: int,
    max_ops: int,
    persistence: int,
    demand: float,
    n_long: int,
    merge_headroom: float,
    split_target: float,
    prefer_large: float | None,
) -> None:
    """Applying every plan at once, constant demand: splits (if any) come before merges (if
    any), the composition settles, and it never returns to a composition it left."""
    lat, prof = (LAT3, PROF3) if three else (LAT, PROFILE)
    cfg = ControllerConfig(
        max_ops=max_ops,
        persistence=persistence,
        merge_headroom=merge_headroom,
        split_target=split_target,
        merge_speedup=None if prefer_large is None else 1.2,
    )
    p = Planner(prof, cfg)
    # A constant mix: ``prefer_large`` of the demand prefers the largest degree.
    pref: tuple[tuple[int, float], ...] = ()
    if prefer_large is not None:
        big, small = lat.sorted_degrees[-1], lat.sorted_degrees[0]
        pref = ((small, demand * (1 - prefer_large)), (big, demand * prefer_large))

    def win(k: int, demand: float, requests: int, n_long: int) -> WindowSummary:
        return WindowSummary(
            k, 20.0 * k, 20.0 * (k + 1), demand, requests, n_long, demand_by_preferred=pref
        )

    comp = _start(lat, start)
    seen = [comp]
    kinds: list[OpKind] = []
    for k in range(40):
        d = p.observe(win(k, demand, 10, n_long), comp)
        if d.plans:
            comp = apply_all(comp, d.plans)
            assert comp not in seen  # no flapping back
            seen.append(comp)
            kinds.append(d.direction)  # type: ignore[arg-type]
    assert kinds == sorted(kinds, key=lambda x: x is OpKind.MERGE)  # splits, then merges
    # Converged: the last windows made no plan.
    assert all(not p.observe(win(40 + i, demand, 10, n_long), comp).plans for i in range(6))
    if max_ops >= 8 and not three:
        # {2, 4} with enough operations per plan: at most one plan per direction.
        assert kinds.count(OpKind.SPLIT) <= 1 and kinds.count(OpKind.MERGE) <= 1


# --- merge gate (planner rule 9) --------------------------------------------------------------
def _pref_win(k: int, demand: float, preferred: dict[int, float]) -> WindowSummary:
    return WindowSummary(
        k,
        20.0 * k,
        20.0 * (k + 1),
        demand,
        10,
        0,
        demand_by_preferred=tuple(sorted(preferred.items())),
    )


def test_merge_gate_caps_large_degree_gpus_at_the_preferring_share() -> None:
    # 8CP2, D = 20 < l·K = 40; without the gate all four merges are admitted (20 ≤ 0.8·64).
    cfg = ControllerConfig(persistence=1, max_ops=8, merge_speedup=1.2)
    assert (
        len(
            Planner(PROFILE, ControllerConfig(persistence=1, max_ops=8))
            .observe(_pref_win(0, 20.0, {2: 15.0, 4: 5.0}), EIGHT_CP2)
            .plans
        )
        == 4
    )
    # A quarter of the demand prefers CP4: ⌈0.25·16 / 4⌉·4 = 4 GPUs at degree 4 -> one merge.
    d = Planner(PROFILE, cfg).observe(_pref_win(0, 20.0, {2: 15.0, 4: 5.0}), EIGHT_CP2)
    assert len(d.plans) == 1
    # Half of it: 8 GPUs -> two merges.
    d = Planner(PROFILE, cfg).observe(_pref_win(0, 20.0, {2: 10.0, 4: 10.0}), EIGHT_CP2)
    assert len(d.plans) == 2
    # Nothing prefers CP4: no merge, and the decision says why.
    d = Planner(PROFILE, cfg).observe(_pref_win(0, 20.0, {2: 20.0}), EIGHT_CP2)
    assert d.plans == () and "do not prefer the larger degree" in d.reason


def test_merge_gate_needs_the_breakdown_and_the_setting() -> None:
    # No breakdown in the window (e.g. the live adapter): the gate admits as before.
    cfg = ControllerConfig(persistence=1, max_ops=8, merge_speedup=1.2)
    assert len(Planner(PROFILE, cfg).observe(win(0, 20.0), EIGHT_CP2).plans) == 4
    # A breakdown but the gate off: admitted as before.
    off = ControllerConfig(persistence=1, max_ops=8)
    assert len(Planner(PROFILE, off).observe(_pref_win(0, 20.0, {2: 20.0}), EIGHT_CP2).plans) == 4


@pytest.mark.parametrize("bad", [0.5, float("nan"), -1.0])
def test_merge_speedup_validation(bad: float) -> None:
    with pytest.raises(InvalidInput):
        ControllerConfig(merge_speedup=bad)


def test_core_reports_each_requests_preferred_degree() -> None:
    from shared.costmodel import Coefficients

    # Ê_C(R, P) = 1 + 1e-4·R / C: R = 1,000 gains 1.05/1.025 ≈ 1.02 from CP4 (prefers 2);
    # R = 100,000 gains 6/3.5 ≈ 1.7 (prefers 4); a 100,000-token input with 99,000 cached is
    # R = 1,000 again (prefers 2).
    prof = Profile(Coefficients(d=1.0, a=0.0, b=0.0, c=1e-4, alpha=0.0), kappa={2: 10.0, 4: 16.0})
    core = ControllerCore(EIGHT_CP2, prof, ControllerConfig(merge_speedup=1.2))
    core.assigned(1.0, 2.0, 1_000, degree=2)
    core.assigned(2.0, 3.0, 100_000, degree=2)
    core.assigned(3.0, 4.0, 100_000, degree=2, cached_tokens=99_000)
    (d,) = core.tick(20.0)
    assert d.window.demand_by_preferred == ((2, 6.0), (4, 3.0))
    # Without the setting no preference is computed.
    core = ControllerCore(EIGHT_CP2, prof)
    core.assigned(1.0, 2.0, 100_000, degree=2)
    (d,) = core.tick(20.0)
    assert d.window.demand_by_preferred == ()
    with pytest.raises(InvalidInput):
        core.assigned(21.0, 1.0, 10, cached_tokens=-1)


@pytest.mark.parametrize("bad", [0, -2, 2.0, True])
def test_windows_reject_a_bad_preferred_degree(bad: object) -> None:
    from services.controller.windows import DemandWindows

    w = DemandWindows()
    with pytest.raises(InvalidInput):
        w.record(1.0, 1.0, 100, degree=2, preferred=bad)  # type: ignore[arg-type]
    assert w.open_demand_s == 0.0  # nothing was counted


def test_merge_gate_remembers_the_mix_over_an_idle_window() -> None:
    # Persistence 2: a busy window where nothing prefers CP4, then an idle one (no requests,
    # no breakdown). The idle window says nothing about the mix: the gate still refuses.
    cfg = ControllerConfig(persistence=2, max_ops=8, merge_speedup=1.2)
    p = Planner(PROFILE, cfg)
    p.observe(_pref_win(0, 20.0, {2: 20.0}), EIGHT_CP2)
    d = p.observe(WindowSummary(1, 20.0, 40.0, 0.0, 0, 0), EIGHT_CP2)
    assert d.direction is OpKind.MERGE and d.plans == ()
    # Two windows with half the demand preferring CP4 (10 of 20, then 10 of 20): two merges.
    p = Planner(PROFILE, cfg)
    p.observe(_pref_win(0, 20.0, {2: 10.0, 4: 10.0}), EIGHT_CP2)
    assert len(p.observe(_pref_win(1, 20.0, {2: 10.0, 4: 10.0}), EIGHT_CP2).plans) == 2
