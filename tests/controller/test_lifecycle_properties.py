"""Properties of the reconfiguration protocol (§6.2, §8) and of the wired controller core.

test_lifecycle.py checks the transition tables, hand-made flows and, over random runs, that
refusals are typed and change nothing. Here random runs — wrong acks, stale and future epochs,
failures, recoveries, aborts, time going backwards — are checked against a model kept by the
test:

* a worker is schedulable only once every one of its ranks acknowledged the epoch its geometry
  was committed at (or it was serving at that epoch from the start);
* the composition is the start composition with the committed operations applied, in commit
  order: drains and aborts change no group, and an aborted operation's surviving sources are
  back active at the epoch they had;
* a reconfiguration drains exactly when the last of its sources' in-flight requests finished;
  its timestamps are ordered; epochs count commits and recoveries;
* the core makes a plan only on active workers outside any operation, and only when nothing
  is pending or in flight; every assignment's demand is decided once; a refused tick loses no
  window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.core import ControllerCore
from services.controller.lattice import Composition, Lattice, LatticeOp, OpKind
from services.controller.lifecycle import EpochProtocol, Phase
from services.controller.planner import ControllerConfig, Decision
from shared.costmodel import Profile
from shared.ids import InvalidInput, RequestId, VertumnusError, WorkerId
from shared.worker import GpuGroup, Lifecycle

LATTICES = [Lattice(16, {2, 4, 8}), Lattice(16, {2, 4}), Lattice(24, {2, 4}, gpus_per_node=8)]


def _snapshot(p: EpochProtocol) -> tuple:
    return (p.epoch, p.workers(), p.history(), p.control_record(), p.composition)


@dataclass
class Model:
    """What the test knows independently of the protocol."""

    composition: Composition
    epoch: int
    serving: set[tuple[GpuGroup, int]]  # (group, epoch) active from the start without acks
    acked: set[tuple[int, int]] = field(default_factory=set)  # (gpu, epoch) acknowledged
    in_flight: dict[int, dict[WorkerId, set[RequestId]]] = field(default_factory=dict)
    ops: dict[int, LatticeOp] = field(default_factory=dict)
    before: dict[int, dict[WorkerId, int]] = field(default_factory=dict)  # source -> its epoch


def _forged(comp: Composition, k: int) -> LatticeOp:
    """An operation that is usually not adjacent (a merge of non-siblings or of workers of
    different degree, a split of a worker into the wrong halves)."""
    gs = comp.groups
    a, b = gs[k % len(gs)], gs[(k // 7) % len(gs)]
    if k % 2 and a.degree >= 2:
        half = a.degree // 2
        return LatticeOp(OpKind.SPLIT, (a,), (GpuGroup(a.first_gpu + half, half),) * 2)
    return LatticeOp(OpKind.MERGE, (a, b), (GpuGroup(0, min(8, 2 * a.degree)),))


# (kind, choice, perturbation). Kinds: 0 start, 1 finish, 2 commit, 3 ack, 4 expose, 5 fail,
# 6 recover, 7 abort, 8 the next step of the oldest reconfiguration (whichever of 1-4 it
# waits for: most runs go all the way to exposure), 9 the clock steps back. A perturbation
# of 0 is the usual event; others forge it (a non-adjacent operation, a stale, future or
# wrong-degree ack, an unknown request).
KINDS = [0, 0, 1, 2, 3, 3, 4, 5, 6, 7, 9] + [8] * 8


def _next_step(p: EpochProtocol, k: int) -> tuple[int, int, int]:
    """(kind, reconfiguration, choice) of the event the oldest reconfiguration waits for:
    a finish (choice 0: its first pending request), its commit, an ack (choice 0: its first
    awaiting rank) or its exposure; a start when none is in flight."""
    if not p.in_progress():
        return 0, 0, k
    r = p.reconfiguration(p.in_progress()[0])
    kind = {Phase.DRAINING: 1, Phase.DRAINED: 2, Phase.COMMITTED: 3, Phase.READY: 4}[r.phase]
    return kind, r.id, 0


events = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.integers(0, 10_000),
        st.sampled_from([0] * 9 + [-1, 1, 2]),
    ),
    min_size=10,
    max_size=90,
)


@settings(max_examples=200, deadline=None)
@given(lat_idx=st.integers(0, len(LATTICES) - 1), start_degree=st.integers(0, 2),
       acknowledged=st.booleans(), epoch0=st.integers(0, 3), events=events)
def test_random_protocol_runs_match_the_model(
    lat_idx: int,
    start_degree: int,
    acknowledged: bool,
    epoch0: int,
    events: list[tuple[int, int, int]],
) -> None:
    """Under any event sequence (valid or not): refusals are typed and change nothing; the
    composition is the model's; no worker is active before all its ranks acked its epoch;
    a drain completes exactly when its last in-flight request finished; an abort restores the
    sources; epochs count commits and recoveries; timestamps within a reconfiguration are
    ordered; an exposed reconfiguration's live targets all acknowledged."""
    lat = LATTICES[lat_idx]
    degs = lat.sorted_degrees
    comp0 = Composition.uniform(lat, degs[start_degree % len(degs)])
    p = EpochProtocol(comp0, epoch=epoch0, acknowledged=acknowledged)
    m = Model(comp0, epoch0, {(g, epoch0) for g in comp0.groups} if acknowledged else set())
    now = 0.0
    aborted: set[int] = set()
    # Until the first failure, recovery, abort, clock step back or forged event the history is
    # clean, and then the model knows some events must be accepted: the next step of the oldest
    # reconfiguration, and an adjacent operation started on an idle pool. (Without this a
    # protocol that wrongly refused them would agree with the model, which only follows
    # accepted events.)
    clean = acknowledged  # else the workers wait for their acks: a start is refused
    steps_done = 0
    for kind, k, x in events:
        now += 0.25 if kind != 9 else -0.4  # kind 9: the clock steps back (then a no-op)
        if kind in (5, 6, 7, 9) or x != 0:
            clean = False
        before = _snapshot(p)
        ws = p.workers()
        rids = p.in_progress() or (k % 5 + 1,)  # an unknown id when none is in flight
        rid = rids[k % len(rids)]
        must = clean and (kind == 8 or (kind == 0 and not p.in_progress()))
        if kind == 8:  # the next step of the oldest reconfiguration, as an event of kind 1-4
            kind, rid, k = _next_step(p, k)
        try:
            if kind == 0:
                ops = p.composition.adjacent()
                op = ops[k % len(ops)] if ops and x == 0 else _forged(p.composition, k)
                flights = {w: {RequestId(f"{w}-r{i}") for i in range(k % 3)}
                           for w in op.source_ids}
                res = p.start(op, now, in_flight=flights,
                              queued={w: [RequestId(f"{w}-q")] for w in op.source_ids})
                m.in_flight[res.reconfiguration] = flights
                m.ops[res.reconfiguration] = op
                m.before[res.reconfiguration] = {w: p.worker(w).epoch for w in op.source_ids}
                assert len(res.redirected) == len(op.sources)
                assert res.drained == all(not f for f in flights.values())
            elif kind == 1:
                pending = sorted((w, r) for fl in m.in_flight.values() for w, rs in fl.items()
                                 for r in rs)
                if pending and x == 0:
                    w, req = pending[k % len(pending)]
                else:  # any worker, any request (usually not one it runs)
                    w, req = ws[k % len(ws)].worker_id, RequestId(f"r{x}")
                p.finished(w, req, now)
                for fl in m.in_flight.values():
                    if w in fl and p.worker(w).reconfiguration is not None:
                        fl[w].discard(req)
            elif kind == 2:
                p.switch_started(rid, now)
                m.composition = m.composition.apply(m.ops[rid])
                m.epoch += 1
            elif kind == 3:
                waiting = [gpu for r in p.in_progress()
                           for gpu in p.reconfiguration(r).awaiting_acks]
                waiting += [gpu for w in ws if w.state is Lifecycle.SWITCHING
                            and w.reconfiguration is None for gpu in w.group.gpus]
                gpu = waiting[k % len(waiting)] if waiting and k % 5 != 4 else k % lat.num_gpus
                w = p.worker(p.worker_of_gpu(gpu))
                epoch = w.epoch + (x if x in (-1, 1) else 0)
                degree = w.group.degree * (2 if x == 2 else 1)
                p.ack(gpu, epoch, degree)
                m.acked.add((gpu, epoch))
            elif kind == 4:
                p.exposed(rid, now)
            elif kind == 5:
                p.fail(ws[k % len(ws)].worker_id, now)
            elif kind == 6:
                down = [w for w in ws if w.state is Lifecycle.UNAVAILABLE] or ws
                p.recover(down[k % len(down)].worker_id, now)
                m.epoch += 1
            elif kind == 7:
                p.abort(rid, now)
        except VertumnusError as exc:
            assert not must, f"a valid event (kind {kind}) was refused: {exc!r}"
            assert _snapshot(p) == before  # typed, and nothing changed
            continue
        if must:
            steps_done += 1

        assert p.composition == m.composition
        assert p.epoch == m.epoch == p.control_record().epoch
        active = [w for w in p.workers() if w.state is Lifecycle.ACTIVE]
        assert p.schedulable() == tuple(w.worker_id for w in active)
        for w in active:  # schedulable only once every rank acknowledged its epoch
            assert w.reconfiguration is None
            assert (w.group, w.epoch) in m.serving or all(
                (gpu, w.epoch) in m.acked for gpu in w.group.gpus
            )
        for w in p.workers():
            assert w.epoch <= p.epoch
        for r in p.history():
            times = [t for t in (r.started_at, r.drained_at, r.switch_started_at, r.exposed_at)
                     if t is not None]
            assert times == sorted(times)
            if r.aborted_at is not None:
                assert r.phase is Phase.ABORTED and r.aborted_at >= r.started_at
                assert r.switch_started_at is None and r.epoch is None
                if r.id not in aborted:  # just aborted: surviving sources back as they were
                    aborted.add(r.id)
                    for wid, e in m.before[r.id].items():
                        if p.worker(wid).state is not Lifecycle.UNAVAILABLE:
                            assert p.worker(wid).state is Lifecycle.ACTIVE
                            assert p.worker(wid).epoch == e
                            assert p.worker(wid).reconfiguration is None
            if r.phase is Phase.DRAINING:
                assert any(m.in_flight[r.id].values())
                assert r.in_flight == {w: len(s) for w, s in m.in_flight[r.id].items()}
            if r.phase is Phase.DRAINED:
                assert not any(m.in_flight[r.id].values())
                assert all(p.state(g.worker_id) is Lifecycle.SWITCHING for g in r.sources)
            if r.phase in (Phase.DRAINING, Phase.DRAINED):
                assert all(g in p.composition for g in r.sources)  # nothing retired yet
            if r.phase is Phase.EXPOSED:
                for g in r.targets:
                    assert g.worker_id in r.failed_targets or all(
                        (gpu, r.epoch) in m.acked for gpu in g.gpus
                    )


# --- the wired core -------------------------------------------------------------------------
PROFILE = Profile(kappa={2: 10.0, 4: 16.0, 8: 24.0})
# 0-2 an assignment, 3 a tick, 4 start a pending operation, 5 the next step of an operation in
# flight (finish, commit and acks, more acks, expose), 6 fail, 7 recover, 8 abort, 9 discard.
CORE_KINDS = [0, 1, 2, 0, 1, 2, 3, 3, 4, 4, 5, 5, 5, 5, 6, 7, 8, 9]


@settings(max_examples=75, deadline=None)
@given(
    lat_idx=st.integers(0, len(LATTICES) - 1),
    start_degree=st.integers(0, 2),
    max_ops=st.integers(1, 3),
    persistence=st.integers(1, 2),
    faults=st.booleans(),
    events=st.lists(
        st.tuples(st.sampled_from(CORE_KINDS), st.integers(0, 10_000), st.floats(0.0, 1.0)),
        min_size=40,
        max_size=120,
    ),
)
def test_core_plans_only_idle_active_workers_and_decides_every_window_once(
    lat_idx: int,
    start_degree: int,
    max_ops: int,
    persistence: int,
    faults: bool,
    events: list[tuple[int, int, float]],
) -> None:
    """Driving the core with assignments, ticks and protocol events in any order: a plan is
    made only when nothing is pending or in flight, on active workers outside any operation;
    a started operation is one of the pending ones; the decided windows are consecutive and
    their demand is every assignment's demand, each counted once. Without ``faults`` (no
    failure, recovery or abort) every protocol event is valid and must be accepted."""
    lat = LATTICES[lat_idx]
    degs = lat.sorted_degrees
    cfg = ControllerConfig(persistence=persistence, max_ops=max_ops, window_s=10.0)
    core = ControllerCore(Composition.uniform(lat, degs[start_degree % len(degs)]), PROFILE, cfg)
    proto = core.protocol
    full = 16.0 * lat.num_gpus / 4  # about one pool's capacity per window
    now, assigned, decided = 0.0, 0.0, 0
    running: dict[WorkerId, RequestId] = {}  # the request a started source has in flight
    # Without faults, starting a pending plan, the next step of an operation in flight and
    # discarding a plan are all valid: they must be accepted (a core that refused them would
    # otherwise pass, every refusal being allowed below).
    for kind, k, u in events:
        ws = proto.workers()
        rids = proto.in_progress()
        if not faults and kind in (6, 7, 8):
            continue
        must = not faults and ((kind in (4, 9) and bool(core.pending_plans))
                               or (kind == 5 and bool(rids)))
        if kind in (0, 1, 2):  # assignments: a load that moves between phases
            now += 0.5 + 2.0 * u
            pred = full * u * (0.05 if (k // 40) % 2 else 0.004)
            core.assigned(now, pred, 100 + k, degree=degs[0])
            assigned += pred
        elif kind == 3:  # the timer: valid input, so it never raises
            busy = bool(core.pending_plans) or bool(rids)
            now += 10.0 * u
            out = core.tick(now, drain_s={w.worker_id: u * (k % 4) for w in ws})
            assert [d.window.index for d in out] == list(range(decided, decided + len(out)))
            decided += len(out)
            with_plans = [d for d in out if d.plans]
            assert len(with_plans) <= (0 if busy else 1)
            for d in with_plans:
                assert d.plans == core.pending_plans
                for pl in d.plans:
                    for wid in pl.source_ids:
                        w = proto.worker(wid)
                        assert w.state is Lifecycle.ACTIVE and w.reconfiguration is None
        try:  # protocol events, some refused in the state they meet (e.g. abort after commit)
            if kind == 4 and core.pending_plans:
                pl = core.pending_plans[k % len(core.pending_plans)]
                reqs = {w: RequestId(f"{w}-{k}") for w in pl.source_ids}
                core.start(pl, now, in_flight={w: [r] for w, r in reqs.items()})
                running.update(reqs)
                assert pl not in core.pending_plans
            elif kind == 5 and rids:  # in-flight requests finish, switch or expose
                r = proto.reconfiguration(rids[k % len(rids)])
                if r.phase is Phase.DRAINING:
                    for wid, n in r.in_flight.items():
                        if n:
                            proto.finished(wid, running[wid], now)
                elif r.phase is Phase.DRAINED:
                    rec = proto.switch_started(r.id, now)
                    for g in r.targets if u < 0.8 else r.targets[:1]:  # some acks lag
                        for gpu in g.gpus:
                            proto.ack(gpu, rec.epoch, g.degree)
                elif r.phase is Phase.COMMITTED:
                    for g in r.targets:
                        w = proto.worker(g.worker_id) if g.worker_id in proto.composition else None
                        if w is not None and w.state is Lifecycle.SWITCHING:
                            for gpu in g.gpus:
                                proto.ack(gpu, w.epoch, g.degree)
                elif r.phase is Phase.READY:
                    proto.exposed(r.id, now)
            elif kind == 6 and ws:
                proto.fail(ws[k % len(ws)].worker_id, now)
            elif kind == 7 and ws:
                w = ws[k % len(ws)]
                if w.state is Lifecycle.UNAVAILABLE:
                    rec = proto.recover(w.worker_id, now)
                    for gpu in w.group.gpus:
                        proto.ack(gpu, rec.epoch, w.group.degree)
            elif kind == 8 and rids:
                proto.abort(rids[k % len(rids)], now)
            elif kind == 9 and core.pending_plans:
                core.discard_plan()
        except VertumnusError as exc:
            assert not must, f"a valid event (kind {kind}) was refused: {exc!r}"
    out = core.tick(now + 3 * cfg.window_s)
    decided += len(out)
    assert [d.window.index for d in core.decisions] == list(range(decided))
    total = math.fsum(d.window.demand_s for d in core.decisions)
    assert math.isclose(total, assigned, rel_tol=1e-9, abs_tol=1e-9)


@settings(max_examples=100, deadline=None)
@given(
    loads=st.lists(st.floats(0.0, 80.0), min_size=1, max_size=12),
    refuse=st.lists(st.sampled_from([None, "drain", "traffic"]), min_size=12, max_size=12),
)
def test_a_refused_tick_loses_no_window(loads: list[float], refuse: list[str | None]) -> None:
    """A tick refused for a bad estimate (a negative drain, a NaN traffic score) raises
    InvalidInput and loses nothing: the next good tick decides every window, exactly as a core
    that never saw the refused tick."""
    lat = LATTICES[1]
    cfg = ControllerConfig(persistence=1, window_s=10.0)
    comp = Composition.uniform(lat, 4)
    core, twin = ControllerCore(comp, PROFILE, cfg), ControllerCore(comp, PROFILE, cfg)

    def bad_traffic(op: LatticeOp) -> float:
        return math.nan

    got: list[Decision] = []
    want: list[Decision] = []
    for i, load in enumerate(loads):
        t = 10.0 * i
        for c in (core, twin):
            c.assigned(t + 1.0, load, 1_000, degree=4)
        try:
            if refuse[i] == "drain":
                core.tick(t + 10.0, drain_s={WorkerId("w-cp4-g0"): -1.0})
            elif refuse[i] == "traffic":
                got += core.tick(t + 10.0, traffic=bad_traffic)
                want += twin.tick(t + 10.0)  # accepted: no plan asked for a score
        except InvalidInput:
            pass
        got += core.tick(t + 10.0)
        want += twin.tick(t + 10.0)
        assert got == want
        for c in (core, twin):  # the plan is not carried out
            if c.pending_plans:
                c.discard_plan()
    assert [d.window.index for d in core.decisions] == list(range(len(loads)))


def test_regression_a_refused_tick_keeps_its_windows() -> None:
    """Minimal case of the property above (found by it): a tick refused for a negative drain
    estimate had already taken the closed window from the windows, so no later tick decided
    it. Window 0 is decided; the tick closing window 1 is refused; the next tick decides it."""
    cfg = ControllerConfig(persistence=1, window_s=10.0)
    core = ControllerCore(Composition.uniform(LATTICES[1], 4), PROFILE, cfg)
    assert [d.window.index for d in core.tick(10.0)] == [0]
    try:
        core.tick(20.0, drain_s={WorkerId("w-cp4-g0"): -1.0})
    except InvalidInput:
        pass
    else:
        raise AssertionError("a negative drain estimate must be refused")
    (d,) = core.tick(20.0)
    assert d.window.index == 1 and d.window.start_s == 10.0
    assert [d.window.index for d in core.decisions] == [0, 1]
