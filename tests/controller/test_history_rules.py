"""Planner rules 11-15 (with rule 12's per-degree admission) and rule 6's newest-first key:
decisions that look past one window.

Hand-derived with κ_2 = 10 s, κ_4 = 16 s per 20-s window (K = 10n + 16m for n CP2 and m CP4
workers), defaults u = 0.9, l = 0.5, merge headroom 0.8, persistence 2, unless a test says
otherwise. Each rule is off unless its setting is given, so every test also checks the decision
without it.
"""

from __future__ import annotations

import math

import pytest

from services.controller.lattice import Composition, Lattice, OpKind
from services.controller.planner import ControllerConfig, Decision, Planner, degree_load
from services.controller.windows import WindowSummary
from shared.costmodel import Profile
from shared.ids import InvalidInput

PROFILE = Profile(kappa={2: 10.0, 4: 16.0})
LAT16 = Lattice(16, {2, 4})
LAT24 = Lattice(24, {2, 4})
EIGHT_CP2 = Composition.uniform(LAT16, 2)


def win(k: int, demand: float, *, requests: int = 10, long: int = 0,
        preferred: dict[int, float] | None = None) -> WindowSummary:
    return WindowSummary(
        k, 20.0 * k, 20.0 * (k + 1), demand, requests, long,
        demand_by_preferred=tuple(sorted((preferred or {}).items())),
    )


# --- rule 11: a preference-shift merge must fit the recent peak -------------------------------
SHIFT = ControllerConfig(persistence=2, max_ops=8, merge_speedup=1.2, preference_shift=0.25)


@pytest.mark.parametrize("memory, merges", [(None, True), (3, False)])
def test_shift_merge_is_judged_against_the_peak_of_the_last_windows(
    memory: int | None, merges: bool
) -> None:
    # 8CP2, K = 80. Window 0: D = 71 < u·K = 72, all of it preferring CP2: no signal. Windows
    # 1, 2: D = 50, all preferring CP4: rule 10's MERGE, admitted by the streak's peak
    # 50 ≤ u·K' = 0.9·76 = 68.4. With merge_memory 3 the peak is window 0's 71 > 68.4: refused,
    # so the merge is not undone by the next window as busy as window 0.
    from dataclasses import replace

    p = Planner(PROFILE, replace(SHIFT, merge_memory=memory))
    assert p.observe(win(0, 71.0, preferred={2: 71.0}), EIGHT_CP2).direction is None
    p.observe(win(1, 50.0, preferred={4: 50.0}), EIGHT_CP2)
    d = p.observe(win(2, 50.0, preferred={4: 50.0}), EIGHT_CP2)
    assert d.direction is OpKind.MERGE and d.streak == 2
    assert bool(d.plans) is merges
    if not merges:
        assert "0.90·capacity" in d.reason


def test_merge_memory_leaves_capacity_merges_to_their_streak() -> None:
    # D = 30 < l·K = 40 twice after a busy window (D = 71): a capacity merge, admitted by the
    # streak's peak 30 ≤ 0.8·76 = 60.8 although the remembered peak 71 is above it.
    p = Planner(PROFILE, ControllerConfig(persistence=2, max_ops=1, merge_memory=3))
    p.observe(win(0, 71.0), EIGHT_CP2)
    p.observe(win(1, 30.0), EIGHT_CP2)
    d = p.observe(win(2, 30.0), EIGHT_CP2)
    assert d.capacity_signal is OpKind.MERGE and len(d.plans) == 1


# --- rule 12: long fraction against the composition's own earlier windows --------------------
LONG = ControllerConfig(persistence=2, max_ops=8, long_shift=0.05)


def test_long_share_rise_merges_once_after_persistence() -> None:
    # 8CP2, D = 50 in [40, 72] throughout (no capacity signal). Windows 0, 1: no long request
    # (the memory). Windows 2, 3: 1 of 10 long, 0.10 − 0 ≥ 0.05 -> MERGE, one operation.
    p = Planner(PROFILE, LONG)
    for k in range(2):
        assert p.observe(win(k, 50.0), EIGHT_CP2).direction is None
    d = p.observe(win(2, 50.0, long=1), EIGHT_CP2)
    assert (d.fraction_signal, d.streak, d.plans) == (OpKind.MERGE, 1, ())
    d = p.observe(win(3, 50.0, long=1), EIGHT_CP2)
    assert len(d.plans) == 1 and "long fraction" in d.reason
    merged = EIGHT_CP2.apply(d.plans[0].op)
    assert merged.describe() == "6CP2/1CP4"
    # On the new composition the memory starts again: the same share is no longer a shift
    # (K = 76, D = 50 in [38, 68.4]).
    for k in range(4, 8):
        d = p.observe(win(k, 50.0, long=1), merged)
        assert d.direction is None and not d.plans


def test_long_share_needs_memory_and_the_threshold() -> None:
    p = Planner(PROFILE, LONG)
    # No memory yet on this composition: a long-heavy first window says nothing.
    for k in range(2):
        d = p.observe(win(k, 50.0, long=5), EIGHT_CP2)
        assert d.fraction_signal is None
    # Memory at 0.5; 0.54 is a rise of 0.04 < 0.05: hold.
    p = Planner(PROFILE, LONG)
    for k in range(2):
        p.observe(win(k, 50.0, requests=100, long=50), EIGHT_CP2)
    for k in range(2, 5):
        d = p.observe(win(k, 50.0, requests=100, long=54), EIGHT_CP2)
        assert d.direction is None and not d.plans
    # Off unless set (0.10 is below rule 2's δ 0.15, so nothing else signals).
    p = Planner(PROFILE, ControllerConfig(persistence=2, max_ops=8))
    for k in range(2):
        p.observe(win(k, 50.0), EIGHT_CP2)
    for k in range(2, 5):
        assert p.observe(win(k, 50.0, long=1), EIGHT_CP2).direction is None


def test_long_share_persistence_of_its_own() -> None:
    # As above with long_shift_persistence 1: the first window of the rise merges; other
    # signals still wait `persistence` windows (a capacity merge, D = 30 < l·K = 40).
    cfg = ControllerConfig(persistence=2, max_ops=8, long_shift=0.05, long_shift_persistence=1)
    p = Planner(PROFILE, cfg)
    for k in range(2):
        p.observe(win(k, 50.0), EIGHT_CP2)
    d = p.observe(win(2, 50.0, long=1), EIGHT_CP2)
    assert len(d.plans) == 1 and "long fraction" in d.reason
    assert EIGHT_CP2.apply(d.plans[0].op).describe() == "6CP2/1CP4"
    p = Planner(PROFILE, cfg)
    d = p.observe(win(0, 30.0), EIGHT_CP2)
    assert d.capacity_signal is OpKind.MERGE and d.plans == () and "(1/2)" in d.reason


def test_preference_headroom_does_not_bound_a_long_share_merge() -> None:
    # Rule 12's merge is admitted under upper, whatever rule 10's own bound says.
    cfg = ControllerConfig(persistence=2, max_ops=8, long_shift=0.05, long_shift_persistence=1,
                           preference_headroom=0.1)
    p = Planner(PROFILE, cfg)
    for k in range(2):
        p.observe(win(k, 50.0), EIGHT_CP2)
    d = p.observe(win(2, 50.0, long=1), EIGHT_CP2)
    assert len(d.plans) == 1 and "long fraction" in d.reason


# --- rule 12's per-degree admission (long_shift_by_degree) ------------------------------------
FOUR_TWO = Composition.parse(LAT16, "4CP2/2CP4")  # K = 4·10 + 2·16 = 72; merged 2CP2/3CP4 K' = 68


def by_degree_window(k: int, demand: float, by_degree: dict[int, float],
                     long: int = 0) -> WindowSummary:
    return WindowSummary(k, 20.0 * k, 20.0 * (k + 1), demand, 10, long,
                         demand_by_degree=tuple(sorted(by_degree.items())))


@pytest.mark.parametrize(
    "by_degree_on, placed, merges",
    [
        # CP4 at 40/32 = 1.25 of its κ, CP2 at 23/40 = 0.58; merged: 23/20 = 1.15, 40/48 = 0.83.
        # The worst load falls 1.25 -> 1.15: admitted although D = 63 > u·K' = 61.2.
        (True, {2: 23.0, 4: 40.0}, True),
        # The other way round (CP2 at 1.0, CP4 at 0.72): merged, CP2 at 2.0 -- refused.
        (True, {2: 40.0, 4: 23.0}, False),
        # Off: the aggregate bound alone refuses.
        (False, {2: 23.0, 4: 40.0}, False),
        # No breakdown (an older report): the aggregate bound alone.
        (True, {}, False),
    ],
)
def test_long_share_merge_over_the_bound_needs_a_lower_worst_degree_load(
    by_degree_on: bool, placed: dict[int, float], merges: bool
) -> None:
    cfg = ControllerConfig(persistence=2, max_ops=8, long_shift=0.05, long_shift_persistence=1,
                           long_shift_by_degree=by_degree_on)
    p = Planner(PROFILE, cfg)
    for k in range(2):  # the memory: no long request; D = 50 in [36, 64.8]
        assert p.observe(by_degree_window(k, 50.0, {2: 20.0, 4: 30.0}), FOUR_TWO).plans == ()
    # D = 63 ≤ u·K = 64.8: no capacity signal; 1 of 10 long: rule 12's MERGE.
    d = p.observe(by_degree_window(2, 63.0, placed, long=1), FOUR_TWO)
    assert d.fraction_signal is OpKind.MERGE and d.trigger == "long_shift"
    assert bool(d.plans) is merges
    if merges:
        assert FOUR_TWO.apply(d.plans[0].op).describe() == "2CP2/3CP4"
    else:
        assert "0.90·capacity" in d.reason


def test_the_per_degree_admission_is_for_long_share_merges_only() -> None:
    # A capacity merge (D = 30 < l·K = 36 twice) over its headroom 0.4·K' = 27.2 stays refused
    # whatever the breakdown says.
    cfg = ControllerConfig(persistence=2, max_ops=1, merge_headroom=0.4,
                           long_shift_by_degree=True)
    p = Planner(PROFILE, cfg)
    p.observe(by_degree_window(0, 30.0, {2: 5.0, 4: 25.0}), FOUR_TWO)
    d = p.observe(by_degree_window(1, 30.0, {2: 5.0, 4: 25.0}), FOUR_TWO)
    assert d.capacity_signal is OpKind.MERGE and d.plans == ()


def test_degree_load() -> None:
    # 4CP2/2CP4: K_2 = 40, K_4 = 32.
    assert degree_load(FOUR_TWO, {2: 20.0, 4: 48.0}, PROFILE) == pytest.approx(1.5)
    assert degree_load(FOUR_TWO, {2: 20.0, 4: 0.0}, PROFILE) == pytest.approx(0.5)
    assert degree_load(FOUR_TWO, {}, PROFILE) == 0.0
    # Demand at a degree with no (available) worker is an infinite load.
    assert degree_load(FOUR_TWO, {8: 1.0}, PROFILE) == math.inf
    cp4 = [g.worker_id for g in FOUR_TWO.groups if g.degree == 4]
    assert degree_load(FOUR_TWO, {4: 16.0}, PROFILE, excluded=cp4[:1]) == pytest.approx(1.0)
    assert degree_load(FOUR_TWO, {4: 16.0}, PROFILE, excluded=cp4) == math.inf


def test_capacity_signal_overrides_the_long_share() -> None:
    # D = 75 > u·K = 72 -> SPLIT although the long share rose.
    p = Planner(PROFILE, LONG)
    for k in range(2):
        p.observe(win(k, 50.0), EIGHT_CP2)
    d = p.observe(win(2, 75.0, long=5), EIGHT_CP2)
    assert d.capacity_signal is OpKind.SPLIT and d.fraction_signal is None


# --- rule 15: a fall of the long fraction against the composition's own windows --------------
DROP = ControllerConfig(persistence=2, max_ops=8, long_drop=0.05)


def six_one() -> Composition:
    """6CP2/1CP4 on 16 GPUs (the CP4 worker on GPUs 0-3): K = 76, l·K = 38, u·K = 68.4."""
    return Composition.parse(LAT16, "6CP2/1CP4")


def after_memory(cfg: ControllerConfig, window: WindowSummary,
                 memory_demand: float = 50.0) -> Decision:
    """The decision on ``window`` (index 2) of a planner on 6CP2/1CP4 whose two earlier
    windows held 1 long request of 10 each (the memory: 0.10)."""
    comp = six_one()
    p = Planner(PROFILE, cfg)
    for k in range(2):
        p.observe(win(k, memory_demand, long=1), comp)
    return p.observe(window, comp)


def test_long_share_drop_splits_once_after_persistence() -> None:
    # Windows 0, 1: 1 of 10 long (the memory, 0.10). Windows 2, 3: none, 0.10 − 0 ≥ 0.05 (and
    # under rule 2's 0.15) -> SPLIT after persistence 2, one operation; D = 50 ≥ l·K' = 0.5·80
    # = 40 admits it.
    comp = six_one()
    p = Planner(PROFILE, DROP)
    for k in range(2):
        assert p.observe(win(k, 50.0, long=1), comp).direction is None
    d = p.observe(win(2, 50.0), comp)
    assert (d.fraction_signal, d.trigger, d.streak, d.plans) == (
        OpKind.SPLIT, "long_drop", 1, ())
    d = p.observe(win(3, 50.0), comp)
    assert len(d.plans) == 1 and d.trigger == "long_drop" and "below" in d.reason
    split = comp.apply(d.plans[0].op)
    assert split.describe() == "8CP2"
    # On the new composition the memory starts again: short windows are no longer a fall.
    for k in range(4, 8):
        d = p.observe(win(k, 50.0), split)
        assert d.direction is None and not d.plans


@pytest.mark.parametrize(
    "cfg, requests, long, signal",
    [(ControllerConfig(persistence=2, max_ops=8), 10, 0, None),  # rule 15 off
     (DROP, 25, 2, None),  # 0.10 → 0.08: under the threshold
     (DROP, 20, 1, OpKind.SPLIT)],  # 0.10 → 0.05: at it
)
def test_long_share_drop_is_off_by_default_and_needs_the_threshold(
    cfg: ControllerConfig, requests: int, long: int, signal: OpKind | None
) -> None:
    d = after_memory(cfg, win(2, 50.0, requests=requests, long=long))
    assert d.direction is signal


@pytest.mark.parametrize(
    "requests, long, z, signal",
    [(20, 0, None, OpKind.SPLIT),  # no significance asked
     # 0.10 → 0.0 at n = 20: se = √(0.1·0.9/20) = 0.067, the fall 1.49 se
     (20, 0, 1.4, OpKind.SPLIT), (20, 0, 1.6, None),
     # the same fall at n = 400: se = 0.015, 6.7 se
     (400, 0, 6.0, OpKind.SPLIT), (400, 0, 7.0, None),
     # 0.10 → 0.05 at n = 400: 3.3 se; big enough, not significant at 4
     (400, 20, 3.0, OpKind.SPLIT), (400, 20, 4.0, None)],
)
def test_long_share_drop_needs_the_significance_asked(
    requests: int, long: int, z: float | None, signal: OpKind | None
) -> None:
    cfg = ControllerConfig(persistence=2, max_ops=8, long_drop=0.05, long_drop_z=z)
    assert after_memory(cfg, win(2, 50.0, requests=requests, long=long)).direction is signal


@pytest.mark.parametrize("floor, signal", [(None, OpKind.SPLIT), (0.6, OpKind.SPLIT),
                                            (0.7, None)])
def test_long_share_drop_acts_only_near_capacity_when_asked(
    floor: float | None, signal: OpKind | None
) -> None:
    # D = 50 on K = 76: 0.66·K, at or above a floor of 0.6·K, below one of 0.7·K.
    cfg = ControllerConfig(persistence=2, max_ops=8, long_drop=0.05, long_drop_demand=floor)
    assert after_memory(cfg, win(2, 50.0)).direction is signal


def test_long_share_drop_split_is_admitted_only_above_the_lower_threshold() -> None:
    # D = 39: no capacity merge (39 ≥ l·K = 38), but after the split 39 < l·K' = 40, which
    # would call for the merge right back (rule 5): refused.
    cfg = ControllerConfig(persistence=2, max_ops=8, long_drop=0.05, long_shift_persistence=1)
    d = after_memory(cfg, win(2, 39.0), memory_demand=39.0)
    assert d.direction is OpKind.SPLIT and d.plans == ()
    assert "below the lower threshold" in d.reason


def test_long_share_drop_keeps_the_floor_and_yields_to_capacity() -> None:
    # Rule 13: a split would leave no CP4 worker (floor 1), and the pool is not backlogged.
    cfg = ControllerConfig(persistence=2, max_ops=8, long_drop=0.05, long_shift_persistence=1,
                           large_floor=1, backlog_s=1.0)
    d = after_memory(cfg, win(2, 50.0))
    assert d.direction is OpKind.SPLIT and d.plans == () and "fewer than 1" in d.reason
    # Rule 3: D = 30 < l·K = 38 is a capacity MERGE, whatever the long share did.
    d = after_memory(DROP, win(2, 30.0))
    assert d.capacity_signal is OpKind.MERGE and d.fraction_signal is None


def test_a_rise_and_a_fall_use_the_same_memory() -> None:
    # Both rules on, the memory at 0.10: a window at 0.20 is a rise (MERGE, rule 12), one at
    # 0.0 a fall (SPLIT, rule 15); both under rule 2's 0.15.
    cfg = ControllerConfig(persistence=2, max_ops=8, long_shift=0.05, long_drop=0.05)
    for long, want, trigger in ((2, OpKind.MERGE, "long_shift"), (0, OpKind.SPLIT, "long_drop")):
        d = after_memory(cfg, win(2, 50.0, long=long))
        assert (d.fraction_signal, d.trigger) == (want, trigger)


# --- rules 13 and 14: the floor of larger-degree workers, and the backlog ---------------------
FLOOR = ControllerConfig(persistence=2, max_ops=8, large_floor=3, backlog_s=1.0)
FOUR_FOUR = Composition.parse(LAT24, "4CP2/4CP4")  # K = 40 + 64 = 104


def split_plans(cfg: ControllerConfig, comp: Composition, demand: float,
                drains: dict | None = None) -> tuple:
    p = Planner(PROFILE, cfg)
    p.observe(win(0, demand), comp, drain_s=drains)
    return p.observe(win(1, demand), comp, drain_s=drains)


def test_split_stops_at_the_floor_unless_backlogged() -> None:
    # 4CP2/4CP4, D = 120 > u·K = 93.6: a capacity split. The target (D ≤ K) would need all
    # four splits (K: 108, 112, 116, 120), but only 4 -> 3 CP4 keeps the floor of 3.
    d = split_plans(FLOOR, FOUR_FOUR, 120.0)
    assert len(d.plans) == 1
    assert FOUR_FOUR.apply(d.plans[0].op).describe() == "6CP2/3CP4"
    # From 3CP4 itself no split is admitted, and the decision says why.
    three = FOUR_FOUR.apply(d.plans[0].op)
    d = split_plans(FLOOR, three, 120.0)
    assert d.direction is OpKind.SPLIT and d.plans == ()
    assert "fewer than 3" in d.reason
    # Backlogged (median outstanding work 2 s ≥ 1 s): the floor yields, splits to the target.
    busy = {w: 2.0 for w in FOUR_FOUR.worker_ids}
    d = split_plans(FLOOR, FOUR_FOUR, 120.0, busy)
    assert len(d.plans) == 4
    # Without the setting, the same.
    d = split_plans(ControllerConfig(persistence=2, max_ops=8), FOUR_FOUR, 120.0)
    assert len(d.plans) == 4


def test_floor_only_guards_the_crossing() -> None:
    # 10CP2/1CP4 is already below the floor: splitting its last CP4 worker is allowed.
    comp = Composition.parse(LAT24, "10CP2/1CP4")  # K = 116, D = 120 > 104.4
    d = split_plans(FLOOR, comp, 120.0)
    assert len(d.plans) == 1 and comp.apply(d.plans[0].op).describe() == "12CP2"


def test_backlog_is_the_median_worker() -> None:
    # One worker with a long queue does not make the pool backlogged.
    drains = {w: 0.0 for w in FOUR_FOUR.worker_ids}
    drains[FOUR_FOUR.worker_ids[0]] = 50.0
    assert len(split_plans(FLOOR, FOUR_FOUR, 120.0, drains).plans) == 1


@pytest.mark.parametrize("queued, merges", [(0.0, True), (0.99, True), (1.0, False)])
def test_no_merge_into_a_backlog(queued: float, merges: bool) -> None:
    # 8CP2, D = 20 < l·K = 40 twice (arrivals have stopped) with every worker holding `queued`
    # seconds of outstanding work: the merge waits until the median is under backlog_s.
    cfg = ControllerConfig(persistence=2, max_ops=1, backlog_s=1.0)
    p = Planner(PROFILE, cfg)
    drains = {w: queued for w in EIGHT_CP2.worker_ids}
    p.observe(win(0, 20.0), EIGHT_CP2, drain_s=drains)
    d = p.observe(win(1, 20.0), EIGHT_CP2, drain_s=drains)
    assert d.capacity_signal is OpKind.MERGE
    assert bool(d.plans) is merges
    if not merges:
        assert "backlogged" in d.reason


# --- rule 6: newest first ---------------------------------------------------------------------
def merge_at(comp: Composition, first_gpu: int) -> Composition:
    op = next(o for o in comp.adjacent()
              if o.kind is OpKind.MERGE and o.sources[0].first_gpu == first_gpu)
    return comp.apply(op)


@pytest.mark.parametrize("newest_first, expected_gpu", [(True, 12), (False, 0)])
def test_split_takes_the_newest_larger_worker(newest_first: bool, expected_gpu: int) -> None:
    # 8CP2 -> (merge GPUs 0-3) 6CP2/1CP4 -> (merge GPUs 12-15) 4CP2/2CP4, one window each; then
    # D = 66 > u·K = 0.9·72 = 64.8 twice: one split (66 ≤ 0.9·K' = 68.4). Equal drains, no traffic
    # estimate: newest first splits the CP4 worker on GPUs 12-15, otherwise the lowest GPU.
    cfg = ControllerConfig(persistence=2, max_ops=8, split_target=0.9, newest_first=newest_first)
    p = Planner(PROFILE, cfg)
    one = merge_at(EIGHT_CP2, 0)
    two = merge_at(one, 12)
    p.observe(win(0, 50.0), EIGHT_CP2)
    p.observe(win(1, 50.0), one)
    p.observe(win(2, 66.0), two)
    d = p.observe(win(3, 66.0), two)
    assert len(d.plans) == 1 and d.plans[0].kind is OpKind.SPLIT
    assert d.plans[0].sources[0].first_gpu == expected_gpu


@pytest.mark.parametrize(
    "field, bad",
    [("merge_memory", 0), ("merge_memory", 1.5), ("merge_memory", True),
     ("long_shift", 0.0), ("long_shift", 1.5), ("long_shift", math.nan),
     ("long_shift_persistence", 0), ("long_shift_persistence", 1.0),
     ("long_shift_persistence", True),
     ("long_drop", 0.0), ("long_drop", 1.5), ("long_drop", math.nan), ("long_drop", True),
     ("long_drop_z", 0.0), ("long_drop_z", -1.0), ("long_drop_z", math.inf),
     ("long_drop_demand", 0.0), ("long_drop_demand", 1.5), ("long_drop_demand", math.nan),
     ("large_floor", 0), ("large_floor", "3"), ("backlog_s", 0.0), ("backlog_s", -1.0),
     ("backlog_s", math.inf), ("newest_first", 1), ("long_shift_by_degree", 1),
     ("long_shift_by_degree", None)],
)
def test_validation(field: str, bad: object) -> None:
    with pytest.raises(InvalidInput):
        ControllerConfig(**{field: bad})  # type: ignore[arg-type]


@pytest.mark.parametrize("newest_first, expected_gpu", [(True, 12), (False, 0)])
def test_newest_first_comes_before_the_drain(newest_first: bool, expected_gpu: int) -> None:
    # As above, but the newest CP4 worker (GPUs 12-15) has 3 s of outstanding work and the
    # older one none: the drain key alone would pick GPUs 0-3; newest first still splits 12-15.
    cfg = ControllerConfig(persistence=2, max_ops=8, split_target=0.9, newest_first=newest_first)
    p = Planner(PROFILE, cfg)
    one = merge_at(EIGHT_CP2, 0)
    two = merge_at(one, 12)
    drains = {g.worker_id: (3.0 if g.first_gpu == 12 else 0.0) for g in two.groups}
    p.observe(win(0, 50.0), EIGHT_CP2)
    p.observe(win(1, 50.0), one)
    p.observe(win(2, 66.0), two, drain_s=drains)
    d = p.observe(win(3, 66.0), two, drain_s=drains)
    assert len(d.plans) == 1 and d.plans[0].sources[0].first_gpu == expected_gpu
    assert d.plans[0].predicted_drain_s == (3.0 if newest_first else 0.0)
