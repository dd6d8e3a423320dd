"""Properties of the split/merge planner (§6.2, rules 1-14 of planner.py) under random configs.

test_planner.py and test_multiop.py check hand-derived cases and, for the default thresholds,
that plans are adjacent and admitted. Here every optional rule may be switched on, workers may
be unavailable, estimates are drawn, and the plans are applied as they come (or not), and what
a user of the controller relies on is checked against a model kept by the test:

* safety — every plan is a sequence of disjoint lattice operations on available workers that
  keeps the GPU budget; none while a reconfiguration is in flight;
* the capacity signal is D > u·K / D < l·K with K over the available workers, and it decides the
  direction whenever it is present (capacity takes precedence);
* persistence — no operation from fewer consecutive signalling windows than the settings ask
  for (momentum, rule 4, is the only shortcut);
* admission — a merge leaves capacity for the demand of the windows that asked for it, a
  backlogged pool is never merged, a split never crosses the large-worker floor;
* determinism — equal inputs give equal decisions, whatever the object identities and the
  order of the mappings; a refused window (bad estimate) changes nothing.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.composition import capacity
from services.controller.lattice import Composition, Lattice, LatticeOp, OpKind
from services.controller.planner import ControllerConfig, Decision, Planner, degree_load
from services.controller.windows import WindowSummary
from shared.costmodel import Profile
from shared.ids import InvalidInput, WorkerId

EPS = 1e-9

# (lattice, profile): a {2, 4} pool, a three-degree pool and the paper's {4, 8} on 40 GPUs.
POOLS = [
    (Lattice(16, {2, 4}), Profile(kappa={2: 10.0, 4: 16.0})),
    (Lattice(16, {2, 4, 8}), Profile(kappa={2: 10.0, 4: 16.0, 8: 24.0})),
    (Lattice(40, {4, 8}), Profile(kappa={4: 16.0, 8: 24.0})),
]


@st.composite
def configs(draw: st.DrawFn) -> ControllerConfig:
    """A valid ControllerConfig with any subset of the optional rules switched on."""
    upper = draw(st.floats(0.6, 1.2))
    lower = draw(st.floats(0.1, upper - 0.05))
    opt = st.booleans()
    return ControllerConfig(
        upper=upper,
        lower=lower,
        merge_headroom=draw(st.floats(0.3, upper)),
        long_fraction_delta=draw(st.floats(0.05, 0.5)),
        demand_stability=draw(st.floats(0.0, 0.6)),
        persistence=draw(st.integers(1, 3)),
        max_ops=draw(st.integers(1, 4)),
        split_target=draw(st.floats(0.3, upper)),
        momentum=draw(st.booleans()),
        merge_speedup=1.2 if draw(opt) else None,
        preference_shift=draw(st.floats(0.05, 0.5)) if draw(opt) else None,
        preference_headroom=draw(st.floats(0.3, upper)) if draw(opt) else None,
        merge_memory=draw(st.integers(1, 4)) if draw(opt) else None,
        long_shift=draw(st.floats(0.05, 0.5)) if draw(opt) else None,
        long_shift_persistence=draw(st.integers(1, 3)) if draw(opt) else None,
        long_drop=draw(st.floats(0.05, 0.5)) if draw(opt) else None,
        long_drop_z=draw(st.floats(0.5, 6.0)) if draw(opt) else None,
        long_drop_demand=draw(st.floats(0.3, upper)) if draw(opt) else None,
        large_floor=draw(st.integers(1, 2)) if draw(opt) else None,
        backlog_s=draw(st.floats(0.5, 5.0)) if draw(opt) else None,
        newest_first=draw(st.booleans()),
        long_shift_by_degree=draw(st.booleans()),
    )


@dataclass(frozen=True)
class Step:
    """One window and what the caller passes with it."""

    load: float  # demand as a share of the current composition's capacity (all workers)
    requests: int
    long: int
    prefer_large: float | None  # share of demand preferring the largest degree (None: no data)
    placed_large: float | None  # share of demand placed at the largest degree (None: no data)
    unavailable: frozenset[int]  # indices into the composition's workers
    drains: tuple[float, ...]  # per worker (cycled)
    traffic: tuple[float, ...]  # per worker (cycled)
    reconfiguring: bool
    apply: bool  # carry the plan out before the next window


steps = st.builds(
    Step,
    load=st.one_of(st.floats(0.0, 1.6), st.sampled_from([0.0, 0.5, 0.9, 1.2])),
    requests=st.integers(0, 20),
    long=st.integers(0, 20),
    prefer_large=st.one_of(st.none(), st.floats(0.0, 1.0)),
    placed_large=st.one_of(st.none(), st.floats(0.0, 1.0)),
    unavailable=st.frozensets(st.integers(0, 19), max_size=2),
    drains=st.lists(st.floats(0.0, 8.0), min_size=1, max_size=6).map(tuple),
    traffic=st.lists(st.floats(0.0, 100.0), min_size=1, max_size=6).map(tuple),
    reconfiguring=st.integers(0, 9).map(lambda x: x == 0),
    apply=st.integers(0, 5).map(lambda x: x != 0),
)



def _phases(phases: list[tuple[Step, int, int]]) -> list[Step]:
    """Each phase repeats its step; its second half may change the long-request count only
    (the mix shifts at stable demand)."""
    out: list[Step] = []
    for s, n, long2 in phases:
        out += [s] * (n // 2) + [replace(s, long=long2)] * (n - n // 2)
    return out[:40]


# Load regimes persist over phases of 1-8 windows (so signals can), ≤ 40 windows in all.
step_seqs = st.lists(st.tuples(steps, st.integers(1, 8), st.integers(0, 20)), max_size=10).map(
    _phases
)


def _start(lat: Lattice, i: int) -> Composition:
    vecs = sorted(lat.achievable_counts())
    v = vecs[i % len(vecs)]
    return Composition.from_counts(lat, dict(zip(lat.sorted_degrees, v, strict=True)))


@dataclass(frozen=True)
class Inputs:
    """Everything ``Planner.observe`` is given for one window."""

    window: WindowSummary
    composition: Composition
    drain_s: dict[WorkerId, float]
    traffic: dict[WorkerId, float]
    unavailable: frozenset[WorkerId]
    reconfiguring: bool


def _inputs(k: int, s: Step, comp: Composition, prof: Profile) -> Inputs:
    lat = comp.lattice
    demand = s.load * capacity(comp, prof)
    pref: tuple[tuple[int, float], ...] = ()
    if s.prefer_large is not None and s.requests:
        small, big = lat.sorted_degrees[0], lat.sorted_degrees[-1]
        pref = ((small, demand * (1 - s.prefer_large)), (big, demand * s.prefer_large))
    placed: tuple[tuple[int, float], ...] = ()
    if s.placed_large is not None and s.requests:
        small, big = lat.sorted_degrees[0], lat.sorted_degrees[-1]
        placed = ((small, demand * (1 - s.placed_large)), (big, demand * s.placed_large))
    win = WindowSummary(
        k, 20.0 * k, 20.0 * (k + 1), demand, s.requests, min(s.long, s.requests),
        demand_by_degree=placed, demand_by_preferred=pref,
    )
    ids = comp.worker_ids
    return Inputs(
        win,
        comp,
        {w: s.drains[i % len(s.drains)] for i, w in enumerate(ids)},
        {w: s.traffic[i % len(s.traffic)] for i, w in enumerate(ids)},
        frozenset(ids[i % len(ids)] for i in s.unavailable),
        s.reconfiguring,
    )


def _observe(p: Planner, x: Inputs) -> Decision:
    return p.observe(
        x.window,
        x.composition,
        drain_s=x.drain_s,
        traffic=x.traffic,
        unavailable=x.unavailable,
        reconfiguring=x.reconfiguring,
    )


def _run(p: Planner, prof: Profile, comp: Composition, plan_steps: list[Step]):
    """Drive ``p`` through the windows; yield (inputs, decision, composition after)."""
    for k, s in enumerate(plan_steps):
        x = _inputs(k, s, comp, prof)
        d = _observe(p, x)
        after = comp
        for pl in d.plans:
            after = after.apply(pl.op)
        yield x, d, after
        if s.apply:
            comp = after


# What each window-sequence property draws: a pool (POOLS), a start composition on it
# (``_start``), a controller configuration and the windows (``_run``).
WINDOW_SEQUENCES = dict(
    pool=st.integers(0, len(POOLS) - 1),
    start=st.integers(0, 50),
    cfg=configs(),
    plan_steps=step_seqs,
)


def _large_counts(comp: Composition) -> dict[int, int]:
    """Workers at degree ≥ c, for every degree c of the lattice."""
    return {c: sum(g.degree >= c for g in comp.groups) for c in comp.lattice.sorted_degrees}


@settings(max_examples=150, deadline=None)
@given(**WINDOW_SEQUENCES)
def test_any_window_sequence_gives_safe_plans_and_capacity_first(
    pool: int, start: int, cfg: ControllerConfig, plan_steps: list[Step]
) -> None:
    """Valid inputs never raise. Every plan is a sequence of disjoint lattice operations in one
    direction, on available workers not touched earlier in the plan, each keeping the GPU
    budget; none while reconfiguring. The capacity signal is D vs u·K / l·K over the available
    workers and, when present, is the direction; a merge plan leaves the demand of its windows
    within the admission bound of the merged composition (or, by rule 12's per-degree
    admission, lowers the worst per-degree load) and, with the merge gate on, no more
    GPUs at the merged degree or above than the recent demand preferring them asks for; a
    mix-driven split leaves D ≥ l·K'; no merge into a backlogged pool; no split across the
    large-worker floor otherwise."""
    lat, prof = POOLS[pool]
    comp = _start(lat, start)
    p = Planner(prof, cfg)
    history: list[tuple[Inputs, Decision]] = []
    pref_rows: list[tuple[tuple[int, float], ...]] = []  # last windows' demand by preference
    for x, d, after in _run(p, prof, comp, plan_steps):
        comp = x.composition
        if x.window.demand_by_preferred:
            pref_rows = [*pref_rows, x.window.demand_by_preferred][-cfg.persistence :]
        k_now = sum(prof.kappa_for(g.degree) for g in comp.groups
                    if g.worker_id not in x.unavailable)
        dem = x.window.demand_s
        assert math.isclose(d.capacity_s, k_now) and d.composition == comp.describe()
        assert len(d.plans) <= cfg.max_ops
        if x.reconfiguring:
            assert d.plans == () and d.direction is None
            history.append((x, d))
            continue
        # Capacity signal, computed here, and its precedence.
        want = (OpKind.SPLIT if dem > cfg.upper * k_now + EPS
                else OpKind.MERGE if dem < cfg.lower * k_now - EPS else None)
        if want is not None:
            assert d.capacity_signal is want
        if d.capacity_signal is not None:
            assert d.direction is d.capacity_signal
        if not d.plans:
            history.append((x, d))
            continue
        assert d.plan == d.plans[0]
        assert {pl.kind for pl in d.plans} == {d.direction}
        if d.capacity_signal is None:
            assert len(d.plans) == 1  # a mix move is one operation (rule 8)
        # Safety: disjoint lattice operations on available, untouched workers.
        touched = set(x.unavailable)
        virtual = comp
        for pl in d.plans:
            assert pl.op in virtual.adjacent()
            assert all(w in comp for w in pl.source_ids)  # never a target of this plan
            assert not touched.intersection(pl.source_ids)
            touched.update(pl.source_ids)
            virtual = virtual.apply(pl.op)
            assert sum(g.degree for g in virtual.groups) == lat.num_gpus
            assert pl.predicted_drain_s == max(x.drain_s[w] for w in pl.source_ids)
            assert pl.reconcile_traffic == pytest.approx(sum(x.traffic[w] for w in pl.source_ids))
        assert virtual == after
        k_after = capacity(after, prof, x.unavailable)
        if d.direction is OpKind.MERGE:
            # Admission (rule 5 / 10 / 12): the merged pool keeps capacity for the demand of
            # the windows of the streak that asked for it (at least this one); a capacity
            # merge with merge_headroom, a mix-driven one at most up to u.
            bound = cfg.merge_headroom if d.capacity_signal is OpKind.MERGE else cfg.upper
            n = min(_independent_streak(history, x, d), cfg.persistence)
            peak = max([dem, *(h[0].window.demand_s for h in history[len(history) - n + 1 :])])
            if peak > bound * k_after + EPS:
                # Only rule 12's per-degree admission goes over: one long-share merge that
                # lowers the worst per-degree load of this window's demand.
                assert cfg.long_shift_by_degree and d.trigger == "long_shift"
                placed = dict(x.window.demand_by_degree)
                assert degree_load(after, placed, prof, x.unavailable) < degree_load(
                    comp, placed, prof, x.unavailable)
            # Rule 9, the merge gate (a capacity merge: never driven by the long share): the
            # GPUs at the merged degree C or above stay within the share of the recent demand
            # preferring ≥ C, in whole degree-C workers.
            totals: dict[int, float] = {}
            for row in pref_rows:
                for c, v in row:
                    totals[c] = totals.get(c, 0.0) + v
            total = sum(totals.values())
            if cfg.merge_speedup is not None and d.capacity_signal is OpKind.MERGE and total > 0:
                for pl in d.plans:
                    big = pl.targets[0].degree
                    share = sum(v for c, v in totals.items() if c >= big) / total
                    allowed = math.ceil(share * lat.num_gpus / big - EPS) * big
                    assert sum(g.degree for g in after.groups if g.degree >= big) <= allowed
            # Rule 14: no merge into a backlog (the median available worker's queue).
            if cfg.backlog_s is not None:
                avail = sorted(x.drain_s[w] for w in comp.worker_ids if w not in x.unavailable)
                if avail:
                    assert avail[(len(avail) - 1) // 2] < cfg.backlog_s
        else:
            if d.capacity_signal is None:  # a mix-driven split does not invite a merge back
                assert dem >= cfg.lower * k_after - EPS
            # Rule 13: the floor of larger-degree workers holds unless the pool is backlogged.
            not_backlogged = cfg.backlog_s is None or all(
                x.drain_s[w] < cfg.backlog_s for w in comp.worker_ids if w not in x.unavailable
            )
            if cfg.large_floor is not None and not_backlogged:
                before, later = _large_counts(comp), _large_counts(after)
                for c in lat.sorted_degrees[1:]:
                    if before[c] >= cfg.large_floor:
                        assert later[c] >= cfg.large_floor
        history.append((x, d))


def _independent_streak(history: list[tuple[Inputs, Decision]], x: Inputs, d: Decision) -> int:
    """Consecutive windows, this one included, on this composition and outside a
    reconfiguration, that signalled ``d.direction`` without a plan before this one."""
    n = 1
    for hx, hd in reversed(history):
        if (
            hx.reconfiguring
            or hx.composition != x.composition
            or hd.direction is not d.direction
            or hd.plans
        ):
            break
        n += 1
    return n


@settings(max_examples=100, deadline=None)
@given(**WINDOW_SEQUENCES)
def test_no_operation_before_the_condition_persisted(
    pool: int, start: int, cfg: ControllerConfig, plan_steps: list[Step]
) -> None:
    """Rule 4: a plan needs ``persistence`` consecutive windows signalling its direction on the
    same composition (``long_shift_persistence`` for a long-share merge or split), counted here
    from the windows themselves. The only shortcut is momentum: right after a plan in a
    direction, each window that still signals it (reconfiguring ones aside) may act at once."""
    lat, prof = POOLS[pool]
    p = Planner(prof, cfg)
    need = cfg.persistence
    if ((cfg.long_shift is not None or cfg.long_drop is not None)
            and cfg.long_shift_persistence is not None):
        need = min(need, cfg.long_shift_persistence)
    history: list[tuple[Inputs, Decision]] = []
    momentum: OpKind | None = None  # the model of rule 4's momentum
    for x, d, _ in _run(p, prof, _start(lat, start), plan_steps):
        if not x.reconfiguring and d.direction is not momentum:
            momentum = None  # a window without the signal ends the momentum
        streak = _independent_streak(history, x, d)
        if d.direction is not None and momentum is None:
            assert d.streak == streak
        if d.plans:
            assert streak >= need or momentum is d.direction
            momentum = d.direction if cfg.momentum else None
        history.append((x, d))


def _permuted(x: Inputs) -> Inputs:
    """The same inputs as new objects, mappings in reverse insertion order."""
    return Inputs(
        x.window,
        Composition(x.composition.lattice, tuple(reversed(x.composition.groups))),
        dict(reversed(list(x.drain_s.items()))),
        dict(reversed(list(x.traffic.items()))),
        frozenset(sorted(x.unavailable, reverse=True)),
        x.reconfiguring,
    )


@settings(max_examples=75, deadline=None)
@given(**WINDOW_SEQUENCES)
def test_equal_inputs_give_equal_decisions(
    pool: int, start: int, cfg: ControllerConfig, plan_steps: list[Step]
) -> None:
    """Determinism: a second planner fed equal inputs — fresh composition objects (no shared
    memo), mappings in another order — makes exactly the same decisions."""
    lat, prof = POOLS[pool]
    twin = Planner(prof, cfg)
    for x, d, _ in _run(Planner(prof, cfg), prof, _start(lat, start), plan_steps):
        assert _observe(twin, _permuted(x)) == d


def _bad_traffic(op: LatticeOp) -> float:
    return math.nan


def _copy(p: Planner) -> Planner:
    """A deep copy of the planner's state (the profile and the lattices, frozen, shared: a
    lattice keeps its node tilings, which are slow to copy)."""
    return copy.deepcopy(p, {id(x): x for x in (p.profile, *(lat for lat, _ in POOLS))})


@settings(max_examples=100, deadline=None)
@given(
    **WINDOW_SEQUENCES,
    refusals=st.lists(st.sampled_from([None, "traffic", "drain"]), min_size=40, max_size=40),
)
def test_a_refused_window_changes_nothing(
    pool: int,
    start: int,
    cfg: ControllerConfig,
    plan_steps: list[Step],
    refusals: list[str | None],
) -> None:
    """A window refused for a bad estimate (a traffic score that is NaN, a negative drain)
    raises InvalidInput and leaves the planner as it was: offered again with good estimates,
    it is decided exactly as by a twin that never saw the refused call, and so is every later
    window."""
    lat, prof = POOLS[pool]
    p, twin = Planner(prof, cfg), Planner(prof, cfg)
    comp = _start(lat, start)
    for k, s in enumerate(plan_steps):
        x = _inputs(k, s, comp, prof)
        bad = refusals[k]
        before = _copy(p)
        if bad == "traffic" and not x.reconfiguring:
            try:
                p.observe(x.window, comp, drain_s=x.drain_s, traffic=_bad_traffic,
                          unavailable=x.unavailable)
            except InvalidInput:
                assert p == before  # the planner's whole state (a dataclass compares it)
            else:
                p = before  # accepted (no operation was admitted): nothing was refused
        elif bad == "drain":
            worst = {**x.drain_s, comp.worker_ids[0]: -1.0}
            with pytest.raises(InvalidInput):
                p.observe(x.window, comp, drain_s=worst, unavailable=x.unavailable)
            assert p == before
        d = _observe(p, x)
        assert _observe(twin, x) == d
        if s.apply:
            for pl in d.plans:
                comp = comp.apply(pl.op)



def test_regression_a_refused_window_is_not_counted_in_the_histories() -> None:
    """Minimal case of the property above (found by it): a traffic score refused while a merge
    was being chosen left the window counted in the long-share memory (rule 12), so its retry
    counted it twice. 8CP2 (K = 80, l·K = 40), persistence 2, long_shift 0.25: windows 0-1 are
    quiet (merge), window 1 all long; window 2 (D = 50, hold) has 80% long requests. Against
    windows 0-1 (f_mem = 10/20 = 0.5) that is a rise of 0.3 ≥ 0.25: a long-share merge signal;
    with window 1 counted twice (f_mem = 20/30) it was none."""
    lat, prof = POOLS[0]
    eight_cp2 = Composition.uniform(lat, 2)
    cfg = ControllerConfig(persistence=2, long_shift=0.25, merge_memory=2)

    def win(k: int, demand: float, long: int) -> WindowSummary:
        return WindowSummary(k, 20.0 * k, 20.0 * (k + 1), demand, 10, long)

    p, twin = Planner(prof, cfg), Planner(prof, cfg)
    for planner in (p, twin):
        assert planner.observe(win(0, 20.0, 0), eight_cp2).plan is None
    before = _copy(p)
    with pytest.raises(InvalidInput):
        p.observe(win(1, 20.0, 10), eight_cp2, traffic=_bad_traffic)
    assert p == before
    for planner in (p, twin):  # the retry: a merge plan (discarded by the caller)
        assert planner.observe(win(1, 20.0, 10), eight_cp2).plan is not None
    d = p.observe(win(2, 50.0, 8), eight_cp2)
    assert d == twin.observe(win(2, 50.0, 8), eight_cp2)
    assert d.capacity_signal is None and d.fraction_signal is OpKind.MERGE
    assert "above this composition's earlier windows" in d.reason
    assert d.trigger == "long_shift"


def test_regression_a_refused_window_keeps_the_momentum() -> None:
    """Minimal case of the same property (found by it): a refused window whose direction
    differed from the momentum's ended the momentum (rule 4) although it was never decided.
    It shows when a signal acts after one window while the momentum's needs more: 4CP4
    (K = 64), persistence 2, a long-share merge (rule 12) after 1. Two busy windows split
    (momentum: split) into 2CP2/3CP4 (K = 68, u·K = 61.2); two windows during the split
    record no long requests; a window with half of them long signals a merge, which is
    admitted and then refused for a NaN traffic score, and skipped by the caller; the next
    busy window continues the split at once, as for a planner that never saw the refused one."""
    lat, prof = POOLS[0]
    comp = Composition.uniform(lat, 4)
    cfg = ControllerConfig(persistence=2, long_shift=0.2, long_shift_persistence=1)
    p, twin = Planner(prof, cfg), Planner(prof, cfg)

    def win(k: int, demand: float, long: int = 0) -> WindowSummary:
        return WindowSummary(k, 20.0 * k, 20.0 * (k + 1), demand, 10, long)

    for planner in (p, twin):
        assert planner.observe(win(0, 60.0), comp).plan is None
        plan = planner.observe(win(1, 60.0), comp).plan
        assert plan is not None and plan.kind is OpKind.SPLIT
    comp = comp.apply(plan.op)
    for planner in (p, twin):
        for k in (2, 3):
            assert planner.observe(win(k, 50.0), comp, reconfiguring=True).plan is None
    before = _copy(p)
    with pytest.raises(InvalidInput):
        p.observe(win(4, 50.0, long=5), comp, traffic=_bad_traffic)
    assert p == before
    d = p.observe(win(5, 62.0), comp)
    assert d == twin.observe(win(5, 62.0), comp)
    assert d.plan is not None and d.plan.kind is OpKind.SPLIT
