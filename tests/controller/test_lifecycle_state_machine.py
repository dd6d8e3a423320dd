"""The controller's cores driven as their callers drive them, checked against their contracts.

A hypothesis state machine runs a :class:`ControllerCore` (windows, planner, epoch protocol)
the way the simulator (``sim/simulator.py``) and the live controller
(``services/controller/service.py``) do, and interleaves at random what those callers see:
assignments and ticks that make plans; a plan's operations started one at a time, all
together (the service's ``_carry_out``: what cannot start is discarded) or discarded; another
operation started on the protocol while one is in flight (conflicting or disjoint); requests
finishing on draining sources, late (after an abort), twice, or queued ones that were
redirected; commits; rank acknowledgements that are valid, repeated, late (an older epoch, a
retired source's rank), early (a future epoch), of the wrong degree, for a failed worker or
for workers nobody waits for; ranks that never answer until the worker fails (the lease path);
drain timeouts (abort); recoveries; events for retired workers and unknown reconfigurations;
a clock stepping back within a reconfiguration.

The test keeps its own model of the pool, written from the contracts (module docstrings of
``lifecycle.py``, ``core.py`` and ``lattice.py``), and after every step checks:

* the composition is a tiling of every GPU by lattice groups: the GPU count is conserved and
  every GPU belongs to exactly one worker (no overlap, no loss) across splits and merges; it
  is the start composition with the committed operations applied, in commit order, and the
  control record lists exactly its groups;
* the epoch is the start epoch plus the commits and recoveries so far (each takes the next
  one, so epochs only increase) and no worker is ahead of it;
* every worker's lifecycle, epoch and reconfiguration are the model's (the two tables of
  ``lifecycle.py``); a worker is schedulable only if it is active, and active only once every
  one of its ranks acknowledged the epoch it is at (or it served at the start epoch);
* each reconfiguration is in the model's phase, awaits exactly the ranks of its live targets
  that have not acknowledged, and its timestamps are ordered; no worker is in two of them;
* an event the contracts refuse raises one of the documented typed errors and changes
  nothing (protocol and core snapshots compared before and after); a no-op (a repeated ack,
  an unknown request finishing) changes nothing either;
* the core makes a plan only when nothing is pending or in flight, of disjoint operations
  each adjacent to the composition left by the ones before it, on active workers outside any
  operation; a refused start leaves the plan pending; every window is decided once.

It found no defect in the cores. Defects seeded by hand to check it (a worker exposed after
one rank's ack, a failed target exposed with the others, a recovery without a fresh epoch, an
abort leaving its sources marked reconfiguring, a one-epoch-old ack accepted, a plan made
while an operation is in flight, a started operation dropping the rest of its plan) each made
it fail within the default run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from services.controller.core import ControllerCore
from services.controller.lattice import Composition, Lattice, LatticeOp, OpKind
from services.controller.lifecycle import (
    ControlRecord,
    EpochMismatch,
    IllegalTransition,
    Phase,
    ReconfigurationConflict,
    StaleEpoch,
    StartResult,
    UnknownReconfiguration,
    WrongDegree,
)
from services.controller.planner import ControllerConfig, Plan
from shared.costmodel import Profile
from shared.ids import InvalidInput, RequestId, UnknownWorker, VertumnusError, WorkerId
from shared.worker import GpuGroup, Lifecycle

LATTICES = (
    Lattice(16, {2, 4, 8}),
    Lattice(16, {2, 4}),
    Lattice(12, {2, 4}, gpus_per_node=8),  # a partial last node
    Lattice(8, {1, 2, 4}, gpus_per_node=4),
)
WINDOW_S = 4.0
# κ per window of WINDOW_S (what the adapters hand the core: Profile.for_window).
PROFILE = Profile(kappa={1: 6.0, 2: 10.0, 4: 16.0, 8: 24.0}, window_s=WINDOW_S)
# A window's demand, in fractions of the pool's capacity: idle and light (merges), moderate
# (holds), heavy (splits).
LOADS = (0.0, 0.2, 0.7, 1.5, 3.0)
A, D, S, U = Lifecycle.ACTIVE, Lifecycle.DRAINING, Lifecycle.SWITCHING, Lifecycle.UNAVAILABLE
LIVE = (Phase.DRAINING, Phase.DRAINED, Phase.COMMITTED, Phase.READY)

Errors = tuple[type[VertumnusError], ...]


@dataclass
class MWorker:
    """The model's worker: the worker table of ``lifecycle.py`` and the ranks that acked."""

    group: GpuGroup
    state: Lifecycle
    epoch: int
    reconf: int | None = None
    acked: set[int] = field(default_factory=set)  # ranks that acknowledged ``epoch``


@dataclass
class MReconf:
    """The model's reconfiguration: the phase table of ``lifecycle.py``."""

    op: LatticeOp
    phase: Phase
    in_flight: dict[WorkerId, set[RequestId]]
    queued: tuple[tuple[WorkerId, RequestId], ...]  # redirected at the start
    epoch: int | None = None
    failed: list[WorkerId] = field(default_factory=list)


class ControllerMachine(RuleBasedStateMachine):
    """A controller core and its callers' events, against a model of the contracts."""

    # --- set-up -------------------------------------------------------------------------
    @initialize(
        lat_idx=st.integers(0, len(LATTICES) - 1),
        counts_idx=st.integers(0, 1_000),
        epoch0=st.integers(0, 3),
        acknowledged=st.sampled_from([True, True, True, False]),
        max_ops=st.integers(1, 3),
        persistence=st.integers(1, 2),
    )
    def setup(
        self,
        lat_idx: int,
        counts_idx: int,
        epoch0: int,
        acknowledged: bool,
        max_ops: int,
        persistence: int,
    ) -> None:
        lat = LATTICES[lat_idx]
        vectors = sorted(lat.achievable_counts())
        vec = vectors[counts_idx % len(vectors)]
        comp = Composition.from_counts(lat, dict(zip(lat.sorted_degrees, vec, strict=True)))
        cfg = ControllerConfig(window_s=WINDOW_S, persistence=persistence, max_ops=max_ops)
        self.lat = lat
        self.max_ops = max_ops
        self.core = ControllerCore(comp, PROFILE, cfg, epoch=epoch0, acknowledged=acknowledged)
        self.proto = self.core.protocol
        # Demand of one fully loaded window, about the pool's capacity.
        self.full = sum(PROFILE.kappa_for(g.degree) for g in comp.groups)
        self.now = 0.0
        self.epoch = epoch0
        self.seen_epoch = epoch0
        self.workers: dict[WorkerId, MWorker] = {
            g.worker_id: MWorker(g, A if acknowledged else S, epoch0) for g in comp.groups
        }
        # (group, epoch) that serve without acknowledgements: a pool already serving.
        self.serving = {(g, epoch0) for g in comp.groups} if acknowledged else set()
        self.accepted: set[tuple[int, int]] = set()  # (rank, epoch) acks the protocol took
        self.reconfs: dict[int, MReconf] = {}
        self.retired: list[WorkerId] = []  # sources replaced by a commit
        self.finished_reqs: list[tuple[WorkerId, RequestId]] = []  # already reported finished
        self.decided = 0  # windows decided so far
        # Operations started on the protocol behind the core's back (start_direct), in all
        # and when the pending plan was made; and whether an operation of that plan started.
        self.foreign = self.plan_foreign = 0
        self.plan_started = False
        self.next_req = 0

    # --- helpers ------------------------------------------------------------------------
    def _clock(self, dt: float = 0.25) -> float:
        self.now += dt
        return self.now

    def _req(self, wid: WorkerId) -> RequestId:
        self.next_req += 1
        return RequestId(f"{wid}-r{self.next_req}")

    def _snapshot(self) -> tuple[object, ...]:
        p, c = self.proto, self.core
        return (
            p.epoch, p.workers(), p.history(), p.control_record(), p.composition,
            p.schedulable(), p.in_progress(),
            c.pending_plans, len(c.decisions), c.planner.streak, c.planner.momentum,
            c.planner.reference,
        )

    def _refused(self, call: Callable[[], object], allowed: Errors) -> None:
        """``call`` must raise one of ``allowed`` (exactly that type: StaleEpoch is an
        EpochMismatch, yet a future epoch must not be called stale) and change nothing."""
        before = self._snapshot()
        try:
            call()
        except VertumnusError as exc:
            assert type(exc) in allowed, f"{type(exc).__name__}: {exc}; expected {allowed}"
        else:
            raise AssertionError(f"expected one of {allowed}, nothing was raised")
        assert self._snapshot() == before, "a refused event changed the state"

    def _groups(self) -> tuple[GpuGroup, ...]:
        return tuple(sorted(w.group for w in self.workers.values()))

    def _model_composition(self) -> Composition:
        return Composition(self.lat, self._groups())

    def _complete(self, w: MWorker) -> bool:
        return len(w.acked) == w.group.degree

    def _parked_source(self, w: MWorker) -> bool:
        return w.reconf is not None and self.reconfs[w.reconf].phase in (
            Phase.DRAINING, Phase.DRAINED)

    def _live_targets(self, rid: int) -> list[MWorker]:
        """Targets of ``rid`` still waiting on it (not failed since the commit)."""
        out = []
        for g in self.reconfs[rid].op.targets:
            w = self.workers.get(g.worker_id)
            if w is not None and w.reconf == rid and w.state is S:
                out.append(w)
        return out

    def _awaiting(self, rid: int) -> tuple[int, ...]:
        if self.reconfs[rid].phase is not Phase.COMMITTED:
            return ()
        return tuple(gpu for w in self._live_targets(rid) for gpu in w.group.gpus
                     if gpu not in w.acked)

    def _maybe_ready(self, rid: int) -> bool:
        r = self.reconfs[rid]
        if r.phase is Phase.COMMITTED and not self._awaiting(rid):
            r.phase = Phase.READY
            return True
        return False

    def _abort_model(self, rid: int, failed: WorkerId | None) -> tuple[WorkerId, ...]:
        r = self.reconfs[rid]
        r.phase = Phase.ABORTED
        back = []
        for wid in r.op.source_ids:
            if wid == failed:
                continue
            w = self.workers[wid]
            assert w.state in (D, S)
            w.state, w.reconf = A, None
            back.append(wid)
        r.in_flight = {w: set() for w in r.in_flight}
        return tuple(back)

    def _start_errors(self, op: LatticeOp) -> Errors:
        """What ``EpochProtocol.start`` must refuse ``op`` with (empty: it must start)."""
        try:
            self._model_composition().apply(op)
        except InvalidInput:
            return (InvalidInput,)
        errs: set[type[VertumnusError]] = set()
        for wid in op.source_ids:
            w = self.workers[wid]
            if w.reconf is not None:
                errs.add(ReconfigurationConflict)
            elif w.state is not A:
                errs.add(IllegalTransition)
        return tuple(errs)

    def _do_start(self, op: LatticeOp, call: Callable[..., StartResult], k: int) -> bool:
        """Start ``op`` through ``call`` (the core or the protocol) with some requests queued
        and in flight on its sources (and on a bystander, which must be ignored). Returns
        whether it started (the model says whether it must)."""
        now = self._clock()
        queued = {wid: [self._req(wid) for _ in range((k >> (2 * i)) % 3)]
                  for i, wid in enumerate(op.source_ids)}
        in_flight = {wid: [self._req(wid) for _ in range((k >> (2 * i + 5)) % 3)]
                     for i, wid in enumerate(op.source_ids)}
        bystander = next(iter(self.workers))
        if bystander not in op.source_ids:
            queued[bystander] = [self._req(bystander)]
            in_flight[bystander] = [self._req(bystander)]
        errs = self._start_errors(op)
        if errs:
            self._refused(lambda: call(now, queued=queued, in_flight=in_flight), errs)
            return False
        res = call(now, queued=queued, in_flight=in_flight)
        rid = res.reconfiguration
        assert rid not in self.reconfs
        # Only the sources' queues come back, in queue order, source by source.
        assert res.redirected == tuple(
            (wid, q) for wid in op.source_ids for q in queued[wid])
        flights = {wid: set(in_flight[wid]) for wid in op.source_ids}
        drained = not any(flights.values())
        assert res.drained == drained
        self.reconfs[rid] = MReconf(
            op, Phase.DRAINED if drained else Phase.DRAINING, flights,
            tuple((wid, q) for wid in op.source_ids for q in queued[wid]))
        for wid in op.source_ids:
            w = self.workers[wid]
            w.state, w.reconf = (S if not flights[wid] else D), rid
        # What was in flight on the bystander finishes at some point: never drain-relevant.
        if bystander not in op.source_ids:
            self.finished_reqs.extend((bystander, q) for q in in_flight[bystander])
        return True

    def _reconf_choice(self, k: int) -> int:
        """A known reconfiguration id, usually a live one."""
        live = sorted(rid for rid, r in self.reconfs.items() if r.phase in LIVE)
        if live and k % 4:
            return live[k % len(live)]
        return sorted(self.reconfs)[k % len(self.reconfs)]

    def _worker_choice(self, k: int) -> WorkerId:
        """A worker of the composition, now and then a retired one."""
        ids = sorted(self.workers, key=lambda w: self.workers[w].group)
        if self.retired and k % 7 == 6:
            return self.retired[k % len(self.retired)]
        return ids[k % len(ids)]

    # --- the core: windows, plans -------------------------------------------------------
    @rule(level=st.sampled_from(LOADS), n=st.integers(1, 6), close=st.booleans())
    def load(self, level: float, n: int, close: bool) -> None:
        """A window's placements as the scheduler reports them (the simulator's ``_place``,
        the service's RequestStats): ``level`` of the pool's capacity, spread over the
        window; ``close``: the timer ticks after it."""
        for i in range(n):
            self.core.assigned(self._clock(WINDOW_S / n), self.full * level / n,
                               100 + 1000 * i, degree=self.lat.sorted_degrees[0])
        if close:
            self.tick(0.05, 0.0)

    @rule(frac=st.floats(0.1, 2.0), drain=st.floats(0.0, 5.0))
    def tick(self, frac: float, drain: float) -> None:
        """The timer: close and decide the windows that ended."""
        busy = bool(self.core.pending_plans) or any(
            r.phase in LIVE for r in self.reconfs.values())
        pending_before = self.core.pending_plans
        drains = {wid: drain * (i % 3) for i, wid in enumerate(sorted(self.workers))}
        out = self.core.tick(self._clock(WINDOW_S * frac), drain_s=drains)
        assert [d.window.index for d in out] == list(range(self.decided, self.decided + len(out)))
        self.decided += len(out)
        # The planner judges the protocol's current composition, counting no capacity for
        # workers that are not active (they serve nothing).
        kappa = sum(PROFILE.kappa_for(w.group.degree) for w in self.workers.values()
                    if w.state is A)
        for d in out:
            assert d.composition == self._model_composition().describe()
            assert math.isclose(d.capacity_s, kappa, rel_tol=1e-9, abs_tol=1e-9)
        with_plans = [d for d in out if d.plans]
        if busy:  # at most one plan outstanding, none while anything is in flight
            assert not with_plans and self.core.pending_plans == pending_before
            return
        assert len(with_plans) <= 1
        if not with_plans:
            assert self.core.pending_plans == pending_before
            return
        (dec,) = with_plans
        self.plan_foreign, self.plan_started = self.foreign, False
        assert dec.plans == self.core.pending_plans and dec.plan == dec.plans[0]
        assert 1 <= len(dec.plans) <= self.max_ops
        comp = self._model_composition()
        used: set[WorkerId] = set()
        for plan in dec.plans:  # each adjacent to what the ones before it leave
            comp = comp.apply(plan.op)
            assert not used & set(plan.source_ids), "plan operations overlap"
            used |= set(plan.source_ids) | set(plan.target_ids)
            for wid in plan.source_ids:
                w = self.workers[wid]
                assert w.state is A and w.reconf is None, f"plan on {wid} ({w.state})"

    @precondition(lambda self: bool(self.core.pending_plans))
    @rule(k=st.integers(0, 2**12))
    def start_one_pending(self, k: int) -> None:
        """Start one operation of the pending plan (the adapter may start them in any
        order, at different times)."""
        plans = self.core.pending_plans
        plan = plans[k % len(plans)]
        left = [p for p in plans if p != plan]
        if self._do_start(plan.op, lambda now, **kw: self.core.start(plan, now, **kw), k):
            assert list(self.core.pending_plans) == left
            self.plan_started = True
        else:  # refused: the plan stays pending (the adapter discards it or retries)
            assert self.core.pending_plans == plans

    @precondition(lambda self: bool(self.core.pending_plans))
    @rule(k=st.integers(0, 2**12))
    def carry_out_plan(self, k: int) -> None:
        """The service's ``_carry_out`` (the simulator's ``_begin``): start every operation;
        whatever could not start is discarded."""
        for plan in self.core.pending_plans:
            if self._do_start(plan.op, lambda now, _p=plan, **kw: self.core.start(_p, now, **kw),
                              k):
                self.plan_started = True
        if self.core.pending_plans:
            self.discard_plan()
        assert self.core.pending_plans == ()

    @rule()
    def discard_plan(self) -> None:
        """The adapter drops the plan (a lost compare-and-set); with none, InvalidInput. A
        plan none of whose operations started earns no momentum."""
        if not self.core.pending_plans:
            self._refused(self.core.discard_plan, (InvalidInput,))
            return
        self.core.discard_plan()
        assert self.core.pending_plans == ()
        if not self.plan_started:
            assert self.core.planner.momentum is None

    @rule(k=st.integers(0, 2**12))
    def start_unplanned(self, k: int) -> None:
        """The core refuses an operation it did not plan (IllegalTransition), even an
        adjacent one on idle workers."""
        ops = self._model_composition().adjacent()
        if not ops:
            return
        op = ops[k % len(ops)]
        plan = Plan(op.kind, op.sources, op.targets, reason="not planned",
                    predicted_drain_s=0.0, reconcile_traffic=0.0)
        if plan in self.core.pending_plans:
            return
        self._refused(lambda: self.core.start(plan, self._clock()), (IllegalTransition,))

    # --- the protocol: events, checked against the model --------------------------------
    def _finish(self, wid: WorkerId, req: RequestId) -> None:
        """``finished``: only a draining source's tracked request counts; anything else (a
        late or repeated report, a redirected or unknown request) is a no-op."""
        now = self._clock()
        if wid not in self.workers:
            self._refused(lambda: self.proto.finished(wid, req, now), (UnknownWorker,))
            return
        w = self.workers[wid]
        r = self.reconfs[w.reconf] if w.reconf is not None else None
        if not (w.state is D and r is not None and req in r.in_flight.get(wid, set())):
            before = self._snapshot()
            prog = self.proto.finished(wid, req, now)
            assert prog.drained_workers == () and prog.drained_reconfiguration is None
            assert self._snapshot() == before
            return
        prog = self.proto.finished(wid, req, now)
        r.in_flight[wid].discard(req)
        self.finished_reqs.append((wid, req))
        if r.in_flight[wid]:
            assert prog.drained_workers == () and prog.drained_reconfiguration is None
            return
        w.state = S  # parked at the boundary
        assert prog.drained_workers == (wid,)
        if any(r.in_flight.values()):
            assert prog.drained_reconfiguration is None
        else:
            r.phase = Phase.DRAINED
            assert prog.drained_reconfiguration == w.reconf

    def _commit(self, rid: int) -> None:
        """``switch_started``: legal once every source drained; the sources are retired, the
        targets appear switching under the next epoch."""
        now = self._clock()
        if rid not in self.reconfs:
            self._refused(lambda: self.proto.switch_started(rid, now), (UnknownReconfiguration,))
            return
        r = self.reconfs[rid]
        if r.phase is not Phase.DRAINED:
            self._refused(lambda: self.proto.switch_started(rid, now), (IllegalTransition,))
            return
        rec = self.proto.switch_started(rid, now)
        self.epoch += 1
        r.phase, r.epoch = Phase.COMMITTED, self.epoch
        for wid in r.op.source_ids:
            assert self.workers.pop(wid).state is S  # only parked sources are retired
            self.retired.append(wid)
        for g in r.op.targets:
            assert g.worker_id not in self.workers
            self.workers[g.worker_id] = MWorker(g, S, self.epoch, rid)
        assert rec == self.proto.control_record() and rec.epoch == self.epoch
        assert ControlRecord.from_dict(rec.to_dict()) == rec

    def _ack(self, gpu: int, epoch: int, degree: int) -> None:
        """``ack``: refused (typed) for a GPU outside the pool, an older epoch, another epoch,
        the wrong degree, an unavailable worker; a no-op when repeated or nobody waits;
        otherwise counted, exposing a recovering worker once all its ranks acked and making
        an operation ready once all its live targets' ranks did."""
        if not 0 <= gpu < self.lat.num_gpus:
            self._refused(lambda: self.proto.ack(gpu, epoch, degree), (InvalidInput,))
            return
        w = next(w for w in self.workers.values() if gpu in w.group.gpus)
        # Any error that applies may be the one raised: the contract orders none of them.
        errs: set[type[VertumnusError]] = set()
        if epoch < 0 or degree < 0:
            errs.add(InvalidInput)
        if epoch < w.epoch:
            errs.add(StaleEpoch)
        elif epoch > w.epoch:
            errs.add(EpochMismatch)
        if degree != w.group.degree:
            errs.add(WrongDegree)
        if w.state is U:
            errs.add(IllegalTransition)
        if errs:
            self._refused(lambda: self.proto.ack(gpu, epoch, degree), tuple(errs))
            return
        awaiting = w.state is S and not self._parked_source(w)
        if not awaiting or gpu in w.acked:  # a repeated ack, or one nobody waits for: no-op
            before = self._snapshot()
            res = self.proto.ack(gpu, epoch, degree)
            assert res.duplicate and res.activated == () and res.ready is None
            assert self._snapshot() == before
            return
        res = self.proto.ack(gpu, epoch, degree)
        assert not res.duplicate and res.worker == w.group.worker_id
        w.acked.add(gpu)
        self.accepted.add((gpu, epoch))
        assert res.worker_complete == self._complete(w)
        if not self._complete(w):
            assert res.activated == () and res.ready is None
            return
        if w.reconf is None:  # a recovering (or cold-started) worker
            w.state = A
            w.acked.clear()
            assert res.activated == (w.group.worker_id,) and res.ready is None
            return
        assert res.activated == ()
        assert res.ready == (w.reconf if self._maybe_ready(w.reconf) else None)

    def _expose(self, rid: int) -> None:
        """``exposed``: legal once every live target acked; those targets become active."""
        now = self._clock()
        if rid not in self.reconfs:
            self._refused(lambda: self.proto.exposed(rid, now), (UnknownReconfiguration,))
            return
        r = self.reconfs[rid]
        if r.phase is not Phase.READY:
            self._refused(lambda: self.proto.exposed(rid, now), (IllegalTransition,))
            return
        live = self._live_targets(rid)
        snap = self.proto.exposed(rid, now)
        r.phase = Phase.EXPOSED
        for w in live:
            assert self._complete(w)
            w.state, w.reconf = A, None
            w.acked.clear()
        assert snap.phase is Phase.EXPOSED and snap.failed_targets == tuple(r.failed)

    def _abort(self, rid: int) -> None:
        """``abort`` (the service's drain timeout): legal before the commit only; the sources
        are back active at the epoch they had."""
        now = self._clock()
        if rid not in self.reconfs:
            self._refused(lambda: self.proto.abort(rid, now), (UnknownReconfiguration,))
            return
        r = self.reconfs[rid]
        if r.phase not in (Phase.DRAINING, Phase.DRAINED):
            self._refused(lambda: self.proto.abort(rid, now), (IllegalTransition,))
            return
        snap = self.proto.abort(rid, now)
        self._abort_model(rid, failed=None)
        assert snap.phase is Phase.ABORTED and snap.epoch is None

    def _fail(self, wid: WorkerId) -> None:
        """``fail`` (a lease expires, a rank dies): aborts an uncommitted operation the worker
        is a source of; a committed one goes on without it (ready if it was the last one
        awaited)."""
        now = self._clock()
        if wid not in self.workers:
            self._refused(lambda: self.proto.fail(wid, now), (UnknownWorker,))
            return
        w = self.workers[wid]
        if w.state is U:
            self._refused(lambda: self.proto.fail(wid, now), (IllegalTransition,))
            return
        res = self.proto.fail(wid, now)
        assert res.worker == wid
        rid = w.reconf
        w.state, w.reconf = U, None
        w.acked.clear()
        if rid is None:
            assert res.aborted is None and res.ready is None and res.reactivated == ()
            return
        r = self.reconfs[rid]
        if r.phase in (Phase.DRAINING, Phase.DRAINED):
            back = self._abort_model(rid, failed=wid)
            assert res.aborted == rid and res.reactivated == back and res.ready is None
            return
        r.failed.append(wid)
        assert res.aborted is None and res.reactivated == ()
        assert res.ready == (rid if self._maybe_ready(rid) else None)

    def _recover(self, wid: WorkerId) -> None:
        """``recover``: an unavailable worker is re-admitted switching under the next epoch."""
        now = self._clock()
        if wid not in self.workers:
            self._refused(lambda: self.proto.recover(wid, now), (UnknownWorker,))
            return
        w = self.workers[wid]
        if w.state is not U:
            self._refused(lambda: self.proto.recover(wid, now), (IllegalTransition,))
            return
        rec = self.proto.recover(wid, now)
        self.epoch += 1
        w.state, w.epoch, w.reconf = S, self.epoch, None
        w.acked.clear()
        assert rec.epoch == self.epoch and (w.group, self.epoch) in rec.workers

    def _awaited_ranks(self) -> list[int]:
        """Ranks whose ack is awaited: of committed targets and of recovering workers."""
        return sorted(gpu for w in self.workers.values() if w.state is S
                      and not self._parked_source(w)
                      for gpu in w.group.gpus if gpu not in w.acked)

    # --- the protocol: rules ------------------------------------------------------------
    def _step(self, k: int) -> None:
        """The next event the oldest live operation waits for, as the simulator produces
        them: one of its requests finishes, its commit, an awaited rank's ack, its exposure;
        with none in flight, a recovering worker's rank acks."""
        live = [rid for rid, r in self.reconfs.items() if r.phase in LIVE]
        if not live:
            awaited = self._awaited_ranks()
            if awaited:
                gpu = awaited[k % len(awaited)]
                w = next(w for w in self.workers.values() if gpu in w.group.gpus)
                self._ack(gpu, w.epoch, w.group.degree)
            return
        rid = live[0]
        r = self.reconfs[rid]
        if r.phase is Phase.DRAINING:
            wid, req = next((w, q) for w, qs in sorted(r.in_flight.items()) for q in sorted(qs))
            self._finish(wid, req)
        elif r.phase is Phase.DRAINED:
            self._commit(rid)
        elif r.phase is Phase.COMMITTED:
            gpu = self._awaiting(rid)[0]
            w = next(w for w in self.workers.values() if gpu in w.group.gpus)
            self._ack(gpu, w.epoch, w.group.degree)
        else:
            self._expose(rid)

    @rule(k=st.integers(0, 2**12))
    def next_step(self, k: int) -> None:
        self._step(k)

    @rule(k=st.integers(0, 2**12), n=st.integers(1, 6))
    def next_steps(self, k: int, n: int) -> None:
        """Several steps at once (the simulator commits, acks and exposes in one event)."""
        for i in range(n):
            self._step(k + i)

    @rule(k=st.integers(0, 2**12))
    def start_direct(self, k: int) -> None:
        """Another operation on the protocol while others are in flight: a disjoint one on
        active workers starts (its own epoch later); one touching a reconfiguring worker is a
        ReconfigurationConflict; one on a worker not active, IllegalTransition."""
        ops = self._model_composition().adjacent()
        idle = [op for op in ops if all(self.workers[w].state is A for w in op.source_ids)]
        pool = idle if idle and k % 3 else ops
        if not pool:
            return
        op = pool[k % len(pool)]
        if self._do_start(op, lambda now, **kw: self.proto.start(op, now, **kw), k):
            self.foreign += 1

    @rule(k=st.integers(0, 2**12))
    def start_forged(self, k: int) -> None:
        """An operation that is not a lattice split or merge of this composition."""
        gs = self._groups()
        a, b = gs[k % len(gs)], gs[(k // 7) % len(gs)]
        if k % 2 and a.degree >= 2:
            half = a.degree // 2
            op = LatticeOp(OpKind.SPLIT, (a,), (GpuGroup(a.first_gpu + half, half),) * 2)
        else:
            parent = GpuGroup(a.first_gpu - a.first_gpu % (2 * a.degree), 2 * a.degree)
            op = LatticeOp(OpKind.MERGE, (a, b), (parent,))
        if op in self._model_composition().adjacent():
            return
        self._refused(lambda: self.proto.start(op, self._clock()), (InvalidInput,))

    @rule(k=st.integers(0, 2**12),
          kind=st.sampled_from(["pending"] * 3 + ["late", "queued", "unknown", "retired"]))
    def finish(self, k: int, kind: str) -> None:
        """A request leaves a worker (the simulator reports draining sources'; the service
        the results it awaits): a tracked one, a late one (already reported, or after an
        abort), a redirected one, an unknown one, one of a retired worker."""
        pending = sorted((wid, q) for r in self.reconfs.values()
                         for wid, qs in r.in_flight.items() for q in qs)
        queued = sorted(q for r in self.reconfs.values() for q in r.queued)
        if kind == "pending" and pending:
            wid, req = pending[k % len(pending)]
        elif kind == "late" and self.finished_reqs:
            wid, req = self.finished_reqs[k % len(self.finished_reqs)]
        elif kind == "queued" and queued:
            wid, req = queued[k % len(queued)]
        elif kind == "retired" and self.retired:
            wid, req = self.retired[k % len(self.retired)], RequestId("late")
        else:
            wid, req = self._worker_choice(k), RequestId(f"unknown-{k}")
        self._finish(wid, req)

    @precondition(lambda self: bool(self.reconfs))
    @rule(k=st.integers(0, 2**12))
    def commit(self, k: int) -> None:
        self._commit(self._reconf_choice(k))

    @rule(
        k=st.integers(0, 2**12),
        variant=st.sampled_from(["awaited"] * 4 + ["any", "stale", "future", "negative",
                                                   "degree", "record", "nogpu"]),
    )
    def ack(self, k: int, variant: str) -> None:
        """A rank acknowledges (epoch, degree). Ranks ack every record they adopt, so acks
        come for awaited ranks, for workers nobody waits for, twice, late (an older epoch:
        e.g. a retired source's rank acking the record it knew) and early."""
        awaited = self._awaited_ranks()
        if variant == "nogpu":
            self._ack(self.lat.num_gpus + k % 3, self.epoch, 2)
            return
        gpu = awaited[k % len(awaited)] if variant == "awaited" and awaited else \
            k % self.lat.num_gpus
        w = next(w for w in self.workers.values() if gpu in w.group.gpus)
        epoch, degree = w.epoch, w.group.degree
        if variant == "stale":
            epoch -= 1 + k % 2
        elif variant == "future":
            epoch += 1 + k % 2
        elif variant == "negative":
            epoch = -1
        elif variant == "degree":
            degree = degree * 2 if k % 2 else degree // 2 or 3
        elif variant == "record":  # the latest record's epoch, whatever the worker's
            epoch = self.epoch
        self._ack(gpu, epoch, degree)

    @precondition(lambda self: bool(self.reconfs))
    @rule(k=st.integers(0, 2**12))
    def expose(self, k: int) -> None:
        self._expose(self._reconf_choice(k))

    @precondition(lambda self: bool(self.reconfs))
    @rule(k=st.integers(0, 2**12))
    def abort(self, k: int) -> None:
        self._abort(self._reconf_choice(k))

    @rule(k=st.integers(0, 100), what=st.sampled_from(["commit", "expose", "abort"]))
    def unknown_reconfiguration(self, k: int, what: str) -> None:
        rid = len(self.reconfs) + 1 + k  # never handed out
        {"commit": self._commit, "expose": self._expose, "abort": self._abort}[what](rid)

    @precondition(lambda self: sum(w.state is U for w in self.workers.values()) < 2)
    @rule(k=st.integers(0, 2**12))
    def fail(self, k: int) -> None:
        """A lease expires or a rank dies: a source of an operation not yet committed (it is
        aborted), a worker some rank of which has not acked (the rank that never answers: its
        worker fails, the lease path), or any worker."""
        draining = sorted(w for rid, r in self.reconfs.items()
                          if r.phase in (Phase.DRAINING, Phase.DRAINED) for w in r.op.source_ids)
        awaited = self._awaited_ranks()
        silent = sorted({w.group.worker_id for w in self.workers.values()
                         if any(gpu in awaited for gpu in w.group.gpus)})
        pool = (draining, silent, [])[k % 3]
        self._fail(pool[k % len(pool)] if pool else self._worker_choice(k))

    @rule(k=st.integers(0, 2**12))
    def recover(self, k: int) -> None:
        """A worker heartbeats again: usually a failed one (re-admitted), else any."""
        down = sorted(w for w, m in self.workers.items() if m.state is U)
        self._recover(down[k % len(down)] if down and k % 3 else self._worker_choice(k))

    @rule(k=st.integers(0, 2**12))
    def readmit(self, k: int) -> None:
        """The service's ``_readmit_leftovers``: an active worker failed and re-admitted at
        once; it serves again only after its ranks ack the fresh epoch."""
        active = sorted(w for w, m in self.workers.items() if m.state is A)
        if active:
            wid = active[k % len(active)]
            self._fail(wid)
            self._recover(wid)

    @precondition(lambda self: any(r.phase in (Phase.DRAINING, Phase.DRAINED, Phase.READY)
                                   for r in self.reconfs.values()))
    @rule(k=st.integers(0, 2**12))
    def clock_back(self, k: int) -> None:
        """An event stamped before the reconfiguration started (a clock stepping back) is
        refused: it would order the reconfiguration's timestamps backwards."""
        rids = sorted(rid for rid, r in self.reconfs.items()
                      if r.phase in (Phase.DRAINING, Phase.DRAINED, Phase.READY))
        rid = rids[k % len(rids)]
        r = self.reconfs[rid]
        early = self.proto.reconfiguration(rid).started_at - 1.0
        if r.phase is Phase.DRAINING:
            wid, req = next((w, q) for w, qs in sorted(r.in_flight.items()) for q in sorted(qs))
            call: Callable[[], object] = lambda: self.proto.finished(wid, req, early)  # noqa: E731
        elif r.phase is Phase.DRAINED:
            call = (lambda: self.proto.switch_started(rid, early)) if k % 2 else (
                lambda: self.proto.abort(rid, early))
        else:
            call = lambda: self.proto.exposed(rid, early)  # noqa: E731
        self._refused(call, (InvalidInput,))

    # --- invariants ---------------------------------------------------------------------
    @invariant()
    def composition_tiles_every_gpu_once(self) -> None:
        comp = self.proto.composition
        gpus = sorted(gpu for g in comp.groups for gpu in g.gpus)
        assert gpus == list(range(self.lat.num_gpus)), "a GPU is lost or owned twice"
        assert comp.groups == self._groups()
        assert sorted(comp.worker_ids) == sorted(self.workers)
        for w in self.workers.values():
            for gpu in w.group.gpus:
                assert self.proto.worker_of_gpu(gpu) == w.group.worker_id
        assert self.proto.control_record().workers == tuple(
            (w.group, w.epoch) for w in sorted(self.workers.values(), key=lambda w: w.group))

    @invariant()
    def epochs_count_commits_and_recoveries(self) -> None:
        assert self.proto.epoch == self.epoch == self.proto.control_record().epoch
        assert self.epoch >= self.seen_epoch
        self.seen_epoch = self.epoch
        assert all(w.epoch <= self.epoch for w in self.proto.workers())

    @invariant()
    def workers_follow_the_tables(self) -> None:
        got = {w.worker_id: (w.group, w.state, w.epoch, w.reconfiguration)
               for w in self.proto.workers()}
        want = {wid: (w.group, w.state, w.epoch, w.reconf) for wid, w in self.workers.items()}
        assert got == want
        active = [w for w in self.proto.workers() if w.state is A]
        assert self.proto.schedulable() == tuple(w.worker_id for w in active)
        assert set(self.proto.unavailable()) == set(self.workers) - {w.worker_id for w in active}
        for w in active:  # schedulable only once every rank acknowledged its epoch
            assert w.reconfiguration is None
            assert (w.group, w.epoch) in self.serving or all(
                (gpu, w.epoch) in self.accepted for gpu in w.group.gpus
            ), f"{w.worker_id} active at epoch {w.epoch} without every rank's ack"

    @invariant()
    def reconfigurations_follow_their_phases(self) -> None:
        assert self.proto.in_progress() == tuple(
            rid for rid, r in self.reconfs.items() if r.phase in LIVE)
        busy: set[int] = set()
        for snap in self.proto.history():
            r = self.reconfs[snap.id]
            assert snap.phase is r.phase and snap.epoch == r.epoch
            assert (snap.sources, snap.targets) == (r.op.sources, r.op.targets)
            assert snap.awaiting_acks == self._awaiting(snap.id)
            assert snap.in_flight == {w: len(q) for w, q in r.in_flight.items()}
            assert snap.failed_targets == tuple(r.failed)
            times = [t for t in (snap.started_at, snap.drained_at, snap.switch_started_at,
                                 snap.exposed_at) if t is not None]
            assert times == sorted(times)
            if snap.aborted_at is not None:
                assert snap.aborted_at >= snap.started_at and snap.switch_started_at is None
            if r.phase in (Phase.DRAINING, Phase.DRAINED):  # nothing retired yet
                assert all(g in self.proto.composition for g in r.op.sources)
                gpus = set(r.op.gpus)
                assert not busy & gpus, "a GPU in two reconfigurations"
                busy |= gpus
            if r.phase is Phase.DRAINED:
                assert all(self.workers[w].state is S for w in r.op.source_ids)

    @invariant()
    def every_window_is_decided_once(self) -> None:
        assert [d.window.index for d in self.core.decisions] == list(range(self.decided))

    @invariant()
    def pending_operations_stay_adjacent(self) -> None:
        """The operations of a plan are disjoint, so each one not yet started is adjacent to
        the composition whatever the others did (core.py) -- unless an operation the core
        did not plan was started meanwhile, which no caller does."""
        if self.foreign != self.plan_foreign:
            return
        comp = self._model_composition()
        for plan in self.core.pending_plans:
            comp.apply(plan.op)  # raises InvalidInput if not adjacent


ControllerMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=60,
                                               deadline=None)
test_controller_state_machine = ControllerMachine.TestCase
