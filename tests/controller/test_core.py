"""The wired controller core: assignments -> windows -> decisions -> plan -> epoch protocol."""

from __future__ import annotations

import pytest

from services.controller.core import ControllerCore
from services.controller.lattice import Composition, Lattice, OpKind
from services.controller.lifecycle import IllegalTransition
from services.controller.planner import ControllerConfig, Plan
from shared.costmodel import Profile
from shared.ids import InvalidInput, RequestId, WorkerId
from shared.worker import GpuGroup

PROFILE = Profile(kappa={2: 10.0, 4: 16.0})
LAT = Lattice(16, {2, 4})


def _load(core: ControllerCore, start: float, demand: float, n: int = 10) -> None:
    """n assignments spread over the window starting at ``start`` summing to ``demand``."""
    for i in range(n):
        core.assigned(start + 1.0 + i, demand / n, 2_000, degree=4)


def test_overload_splits_after_two_windows_and_completes() -> None:
    core = ControllerCore(Composition.uniform(LAT, 4), PROFILE)  # K = 64, u·K = 57.6
    _load(core, 0.0, 60.0)
    assert core.tick(10.0) == []  # the window is still open
    _load(core, 20.0, 60.0)  # first assignment at 21 closes window 0 (buffered)
    (d0,) = core.tick(39.0)
    assert d0.window.demand_s == pytest.approx(60.0) and d0.plan is None and d0.streak == 1
    drain = {WorkerId("w-cp4-g0"): 0.5}
    (d1,) = core.tick(40.0, drain_s=drain)
    plan = d1.plan
    assert plan is not None and plan.kind is OpKind.SPLIT
    # Every CP4 ties on drain except g0 (0.5 s); the others have 0 -> lowest GPU among them.
    assert plan.sources == (GpuGroup(4, 4),)
    assert core.pending_plan == plan

    # While the plan is pending, later windows make no new plan.
    _load(core, 40.0, 60.0)
    (d2,) = core.tick(60.0)
    assert d2.plan is None and d2.reason == "reconfiguration in flight"

    res = core.start(plan, 60.0, queued={WorkerId("w-cp4-g4"): [RequestId("q")]})
    assert res.redirected == ((WorkerId("w-cp4-g4"), RequestId("q")),) and res.drained
    assert core.pending_plan is None
    proto = core.protocol
    proto.switch_started(res.reconfiguration, 60.2)
    for gpu in range(4, 8):
        proto.ack(gpu, 1, 2)
    proto.exposed(res.reconfiguration, 60.5)
    assert proto.composition.describe() == "2CP2/3CP4"
    # The planner now judges the new composition (K = 68, band [34, 61.2]).
    _load(core, 60.0, 60.0)
    (d3,) = core.tick(80.0)
    assert d3.capacity_s == 68.0 and d3.direction is None
    assert len(core.decisions) == 4


def test_only_the_pending_plan_can_start_and_it_can_be_discarded() -> None:
    core = ControllerCore(Composition.uniform(LAT, 2), PROFILE)
    with pytest.raises(InvalidInput):
        core.discard_plan()
    decisions = core.tick(40.0)  # two empty windows -> merge after persistence
    plan = decisions[-1].plan
    assert plan is not None and plan.kind is OpKind.MERGE
    other = decisions[-1].plan.__class__(plan.kind, plan.sources, plan.targets, "forged", 0.0, 0.0)
    with pytest.raises(IllegalTransition):
        core.start(other, 41.0)
    core.discard_plan()
    assert core.pending_plan is None
    with pytest.raises(IllegalTransition):
        core.start(plan, 41.0)


def _complete(core: ControllerCore, plan: Plan, now: float) -> None:
    """Carry a plan through the protocol at once (nothing in flight, every rank acks)."""
    res = core.start(plan, now)
    rec = core.protocol.switch_started(res.reconfiguration, now)
    for g in plan.targets:
        for gpu in g.gpus:
            core.protocol.ack(gpu, rec.epoch, g.degree)
    core.protocol.exposed(res.reconfiguration, now)


def test_closed_loop_follows_load_phases_like_section_9_3() -> None:
    """40 GPUs, degrees {4, 8}, κ_4 = 16, κ_8 = 24 (hand-picked); start at 6CP4/2CP8.

    Capacity of n8 CP8 workers: 16·(10 − 2·n8) + 24·n8 = 160 − 8·n8.
    High phase, D = 140/window: 6CP4/2CP8 (K 144, u·K 129.6) splits -> 8CP4/1CP8 (152,
    136.8) splits -> 10CP4 (160, 144) holds. Low phase, D = 60: merges while D < l·K, i.e.
    down to 5CP8 (K 120, l·K = 60: not below) — each merge admitted (60 ≤ 0.8·K').
    """
    lat = Lattice(40, {4, 8})
    core = ControllerCore(
        Composition.from_counts(lat, {4: 6, 8: 2}), Profile(kappa={4: 16.0, 8: 24.0})
    )
    trajectory = [core.protocol.composition.describe()]
    t = 0.0
    for demand in [140.0] * 8 + [60.0] * 14:
        core.assigned(t + 1.0, demand, 4_000)
        t += 20.0
        for d in core.tick(t):
            if d.plan is not None:
                _complete(core, d.plan, t)
                trajectory.append(core.protocol.composition.describe())
    assert trajectory == [
        "6CP4/2CP8",
        "8CP4/1CP8",
        "10CP4",
        "8CP4/1CP8",
        "6CP4/2CP8",
        "4CP4/3CP8",
        "2CP4/4CP8",
        "5CP8",
    ]
    assert core.protocol.epoch == 7
    # The first operation of a direction needs two persistent windows (split at window 1,
    # first merge at 9, the first low window being 8); momentum then continues one operation
    # per window while the signal holds: split at 2, merges at 10, 11, 12, 13 (0-based).
    planned = [d.window.index for d in core.decisions if d.plan is not None]
    assert planned == [1, 2, 9, 10, 11, 12, 13]


def test_a_discarded_plan_earns_no_momentum_but_a_started_one_keeps_it() -> None:
    """Rule 4's momentum is earned by an operation carried out: a plan dropped with none of
    its operations started (the adapter lost the epoch compare-and-set) takes it back, so the
    next window in that direction waits for persistence again; once an operation of the plan
    started, dropping the rest keeps it."""
    core = ControllerCore(Composition.uniform(LAT, 4), PROFILE)  # u·K = 57.6
    for k in range(2):
        _load(core, 20.0 * k, 70.0)
    assert [d.plan is not None for d in core.tick(40.0)] == [False, True]
    assert core.planner.momentum is OpKind.SPLIT  # set with the plan
    core.discard_plan()
    assert core.planner.momentum is None
    _load(core, 40.0, 70.0)  # still overloaded: a split again, but after two windows
    (d,) = core.tick(60.0)
    assert d.plan is None and d.direction is OpKind.SPLIT and d.streak == 1

    # A plan of several operations (persistence 1, up to 8 at once), one of them started.
    core = ControllerCore(Composition.uniform(LAT, 4), PROFILE,
                          ControllerConfig(persistence=1, max_ops=8))
    core.assigned(1.0, 75.0, 2_000, degree=4)
    core.tick(20.0)
    assert len(core.pending_plans) > 1
    core.start(core.pending_plans[0], 20.0)
    core.discard_plan()
    assert core.planner.momentum is OpKind.SPLIT


def test_hold_measures_every_window_and_plans_nothing() -> None:
    """tick(hold=True): a fixed deployment's controller. Windows close with their D(k) and
    the pool's capacity, but neither an overload nor an idle pool gives a plan."""
    from services.controller.core import HELD_REASON

    core = ControllerCore(Composition.uniform(LAT, 4), PROFILE)  # K = 64
    for k in range(4):  # far above u·K for four windows: would split after two
        _load(core, 20.0 * k, 200.0)
    held = core.tick(80.0, hold=True)
    assert [d.window.demand_s for d in held] == pytest.approx([200.0] * 4)
    assert all(d.plan is None and d.direction is None and d.reason == HELD_REASON
               and d.capacity_s == 64.0 and d.composition == "4CP4" for d in held)
    assert core.tick(200.0, hold=True)[-1].plan is None  # idle windows: no merge either
    assert core.pending_plan is None and len(core.decisions) == 10
    # The same windows unheld split (the hold is what stopped it).
    free = ControllerCore(Composition.uniform(LAT, 4), PROFILE)
    for k in range(4):
        _load(free, 20.0 * k, 200.0)
    assert any(d.plan is not None for d in free.tick(80.0))


def test_a_profiles_kappa_per_window_of_another_length() -> None:
    """κ_C is service per window of the profile's length; Profile.for_window restates it per
    window of another length (what the simulator and the live controller hand the core,
    which takes κ as given: its windows' clock is the adapter's)."""
    p10 = Profile(kappa={2: 5.0, 4: 8.0}, window_s=10.0)
    p20 = p10.for_window(20.0)
    assert (p20.window_s, dict(p20.kappa)) == (20.0, {2: 10.0, 4: 16.0})
    assert p20.kappa_for(8) == pytest.approx(0.7 * 20.0)  # the fallback follows the window
    assert p10.for_window(10.0) is p10
    with pytest.raises(InvalidInput):
        p10.for_window(0.0)
    core = ControllerCore(Composition.uniform(LAT, 4), p10, ControllerConfig(window_s=20.0))
    assert core.planner.profile is p10
