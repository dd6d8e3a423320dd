"""Worker lifecycle and the epoch protocol: tables, split/merge flows, acks, failures."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.lattice import Composition, Lattice, LatticeOp, OpKind, adjacent
from services.controller.lifecycle import (
    ABSENT,
    PHASE_TRANSITIONS,
    WORKER_TRANSITIONS,
    EpochMismatch,
    EpochProtocol,
    IllegalTransition,
    Phase,
    PhaseEvent,
    ReconfigurationConflict,
    StaleEpoch,
    UnknownReconfiguration,
    WorkerEvent,
    WrongDegree,
    phase_transition,
    worker_transition,
)
from shared.ids import InvalidInput, RequestId, UnknownWorker, VertumnusError, WorkerId
from shared.worker import GpuGroup, Lifecycle

LAT = Lattice(16, {2, 4})
A, D, S, U = Lifecycle.ACTIVE, Lifecycle.DRAINING, Lifecycle.SWITCHING, Lifecycle.UNAVAILABLE

SPLIT_G8 = LatticeOp(OpKind.SPLIT, (GpuGroup(8, 4),), (GpuGroup(8, 2), GpuGroup(10, 2)))
SPLIT_G0 = LatticeOp(OpKind.SPLIT, (GpuGroup(0, 4),), (GpuGroup(0, 2), GpuGroup(2, 2)))
MERGE_G8 = LatticeOp(OpKind.MERGE, (GpuGroup(8, 2), GpuGroup(10, 2)), (GpuGroup(8, 4),))


def W(s: str) -> WorkerId:
    return WorkerId(s)


def R(s: str) -> RequestId:
    return RequestId(s)


# --- the tables ---------------------------------------------------------------------------
LEGAL_WORKER = {
    (ABSENT, WorkerEvent.CREATE): S,
    (A, WorkerEvent.DRAIN): D,
    (D, WorkerEvent.DRAINED): S,
    (D, WorkerEvent.ABORT): A,
    (S, WorkerEvent.ABORT): A,
    (S, WorkerEvent.RETIRE): ABSENT,
    (S, WorkerEvent.EXPOSE): A,
    (A, WorkerEvent.FAIL): U,
    (D, WorkerEvent.FAIL): U,
    (S, WorkerEvent.FAIL): U,
    (U, WorkerEvent.RECOVER): S,
}


@pytest.mark.parametrize(
    ("state", "event"), list(itertools.product([ABSENT, *Lifecycle], list(WorkerEvent)))
)
def test_worker_table(state: Lifecycle | None, event: WorkerEvent) -> None:
    if (state, event) in LEGAL_WORKER:
        assert worker_transition(state, event) == LEGAL_WORKER[(state, event)]
    else:
        with pytest.raises(IllegalTransition):
            worker_transition(state, event)
    assert dict(WORKER_TRANSITIONS) == LEGAL_WORKER


LEGAL_PHASE = {
    (Phase.DRAINING, PhaseEvent.DRAINED): Phase.DRAINED,
    (Phase.DRAINED, PhaseEvent.COMMIT): Phase.COMMITTED,
    (Phase.COMMITTED, PhaseEvent.ACKED): Phase.READY,
    (Phase.READY, PhaseEvent.EXPOSE): Phase.EXPOSED,
    (Phase.DRAINING, PhaseEvent.ABORT): Phase.ABORTED,
    (Phase.DRAINED, PhaseEvent.ABORT): Phase.ABORTED,
}


@pytest.mark.parametrize(("phase", "event"), list(itertools.product(Phase, PhaseEvent)))
def test_phase_table(phase: Phase, event: PhaseEvent) -> None:
    if (phase, event) in LEGAL_PHASE:
        assert phase_transition(phase, event) == LEGAL_PHASE[(phase, event)]
    else:
        with pytest.raises(IllegalTransition):
            phase_transition(phase, event)
    assert dict(PHASE_TRANSITIONS) == LEGAL_PHASE


# --- a split, end to end ------------------------------------------------------------------
def _snapshot(p: EpochProtocol) -> tuple:
    return (p.epoch, p.workers(), p.history(), p.control_record())


def test_split_flow_with_drain_acks_and_exposure() -> None:
    p = EpochProtocol(Composition.uniform(LAT, 4))
    assert p.epoch == 0 and len(p.schedulable()) == 4
    res = p.start(
        SPLIT_G8,
        100.0,
        queued={W("w-cp4-g8"): [R("r1"), R("r2")], W("w-cp4-g0"): [R("x")]},
        in_flight={W("w-cp4-g8"): [R("r0")]},
    )
    rid = res.reconfiguration
    # Only the source's queue is redirected, in order.
    assert res.redirected == ((W("w-cp4-g8"), R("r1")), (W("w-cp4-g8"), R("r2")))
    assert not res.drained
    assert p.state(W("w-cp4-g8")) is D
    assert W("w-cp4-g8") not in p.schedulable()

    # Committing before the drain completes is illegal and changes nothing.
    before = _snapshot(p)
    with pytest.raises(IllegalTransition):
        p.switch_started(rid, 101.0)
    assert _snapshot(p) == before

    # Finishing an unrelated request, or one on another worker, is a no-op.
    assert p.finished(W("w-cp4-g8"), R("nope"), 101.0).drained_workers == ()
    assert p.finished(W("w-cp4-g0"), R("x"), 101.0).drained_workers == ()
    prog = p.finished(W("w-cp4-g8"), R("r0"), 102.5)
    assert prog.drained_workers == (W("w-cp4-g8"),) and prog.drained_reconfiguration == rid
    assert p.state(W("w-cp4-g8")) is S  # parked
    assert p.reconfiguration(rid).phase is Phase.DRAINED

    rec = p.switch_started(rid, 103.0)
    assert rec.epoch == 1 == p.epoch
    assert p.composition.describe() == "2CP2/3CP4"
    assert (GpuGroup(8, 2), 1) in rec.workers and (GpuGroup(0, 4), 0) in rec.workers
    with pytest.raises(UnknownWorker):
        p.state(W("w-cp4-g8"))  # retired
    assert p.state(W("w-cp2-g8")) is S and p.state(W("w-cp2-g10")) is S
    assert p.reconfiguration(rid).awaiting_acks == (8, 9, 10, 11)

    # Exposure before every ack is illegal.
    with pytest.raises(IllegalTransition):
        p.exposed(rid, 103.2)

    # Ack rules.
    before = _snapshot(p)
    with pytest.raises(StaleEpoch):
        p.ack(8, 0, 2)
    with pytest.raises(EpochMismatch):
        p.ack(8, 2, 2)
    with pytest.raises(WrongDegree):
        p.ack(8, 1, 4)
    with pytest.raises(InvalidInput):
        p.ack(99, 1, 2)
    assert _snapshot(p) == before

    a = p.ack(8, 1, 2)
    assert not a.duplicate and not a.worker_complete and a.ready is None
    assert p.ack(8, 1, 2).duplicate
    assert p.ack(9, 1, 2).worker_complete  # w-cp2-g8 complete, but not the operation
    assert p.state(W("w-cp2-g8")) is S  # not schedulable before the whole op is exposed
    assert p.ack(10, 1, 2).ready is None
    assert p.ack(11, 1, 2).ready == rid
    assert p.reconfiguration(rid).phase is Phase.READY
    assert W("w-cp2-g8") not in p.schedulable()

    done = p.exposed(rid, 103.6)
    assert done.phase is Phase.EXPOSED
    assert done.drain_s == pytest.approx(2.5)
    assert done.switch_s == pytest.approx(1.1)
    assert done.redirected == 2
    assert p.schedulable() == (
        W("w-cp4-g0"),
        W("w-cp4-g4"),
        W("w-cp2-g8"),
        W("w-cp2-g10"),
        W("w-cp4-g12"),
    )
    assert p.in_progress() == ()
    # Acks for the now-active workers' epoch are harmless repeats.
    assert p.ack(8, 1, 2).duplicate


def test_merge_parks_both_siblings_before_commit() -> None:
    comp = Composition.from_counts(LAT, {2: 4, 4: 2})  # CP4 g0,g4; CP2 g8,g10,g12,g14
    p = EpochProtocol(comp, epoch=7)
    rid = p.start(
        MERGE_G8,
        10.0,
        in_flight={W("w-cp2-g8"): [R("a")], W("w-cp2-g10"): [R("b"), R("c")]},
    ).reconfiguration
    assert p.finished(W("w-cp2-g8"), R("a"), 10.5).drained_workers == (W("w-cp2-g8"),)
    assert p.state(W("w-cp2-g8")) is S and p.state(W("w-cp2-g10")) is D
    assert p.reconfiguration(rid).phase is Phase.DRAINING
    with pytest.raises(IllegalTransition):
        p.switch_started(rid, 10.6)
    p.finished(W("w-cp2-g10"), R("b"), 11.0)
    assert p.finished(W("w-cp2-g10"), R("c"), 12.0).drained_reconfiguration == rid
    assert p.switch_started(rid, 12.5).epoch == 8
    for gpu in range(8, 12):
        res = p.ack(gpu, 8, 4)
    assert res.ready == rid
    snap = p.exposed(rid, 13.0)
    assert (snap.drain_s, snap.switch_s) == (2.0, 1.0)
    assert p.composition.describe() == "2CP2/3CP4"
    assert p.state(W("w-cp4-g8")) is A


def test_start_with_nothing_in_flight_is_drained_at_once() -> None:
    p = EpochProtocol(Composition.uniform(LAT, 4))
    res = p.start(SPLIT_G0, 5.0)
    assert res.drained and res.redirected == ()
    assert p.state(W("w-cp4-g0")) is S
    assert p.reconfiguration(res.reconfiguration).drain_s == 0.0


def test_one_reconfiguration_per_worker_but_disjoint_ones_run_together() -> None:
    p = EpochProtocol(Composition.uniform(LAT, 4))
    r1 = p.start(SPLIT_G8, 1.0).reconfiguration
    before = _snapshot(p)
    with pytest.raises(ReconfigurationConflict):
        p.start(SPLIT_G8, 1.5)
    assert _snapshot(p) == before
    r2 = p.start(SPLIT_G0, 2.0).reconfiguration
    assert p.switch_started(r2, 3.0).epoch == 1
    assert p.switch_started(r1, 3.5).epoch == 2  # epochs are global and increasing
    # A target that is still switching cannot be merged again yet.
    with pytest.raises(ReconfigurationConflict):
        p.start(MERGE_G8, 4.0)
    assert set(p.in_progress()) == {r1, r2}


def test_plans_must_be_adjacent_to_the_current_composition() -> None:
    p = EpochProtocol(Composition.uniform(LAT, 4))
    with pytest.raises(InvalidInput):
        p.start(MERGE_G8, 1.0)  # no CP2 workers yet
    with pytest.raises(InvalidInput):
        p.start("split g8", 1.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        p.start(SPLIT_G8, float("nan"))
    assert p.history() == ()


def test_explicit_abort_returns_sources_to_active() -> None:
    p = EpochProtocol(Composition.uniform(LAT, 4))
    rid = p.start(SPLIT_G8, 1.0, in_flight={W("w-cp4-g8"): [R("a")]}).reconfiguration
    snap = p.abort(rid, 2.0)
    assert snap.phase is Phase.ABORTED and snap.aborted_at == 2.0
    assert p.state(W("w-cp4-g8")) is A and p.epoch == 0
    with pytest.raises(IllegalTransition):
        p.abort(rid, 3.0)
    with pytest.raises(UnknownReconfiguration):
        p.abort(42, 3.0)


def test_source_failure_aborts_the_uncommitted_merge() -> None:
    comp = Composition.from_counts(LAT, {2: 4, 4: 2})
    p = EpochProtocol(comp)
    rid = p.start(
        MERGE_G8, 1.0, in_flight={W("w-cp2-g8"): [R("a")], W("w-cp2-g10"): [R("b")]}
    ).reconfiguration
    p.finished(W("w-cp2-g8"), R("a"), 1.5)  # g8 parked
    res = p.fail(W("w-cp2-g10"), 2.0)
    assert res.aborted == rid and res.reactivated == (W("w-cp2-g8"),)
    assert p.state(W("w-cp2-g8")) is A and p.state(W("w-cp2-g10")) is U
    assert p.reconfiguration(rid).phase is Phase.ABORTED
    with pytest.raises(IllegalTransition):
        p.fail(W("w-cp2-g10"), 2.5)  # already unavailable
    with pytest.raises(IllegalTransition):
        p.start(MERGE_G8, 3.0)  # an unavailable source cannot drain


def test_target_failure_after_commit_and_recovery_under_a_new_epoch() -> None:
    p = EpochProtocol(Composition.uniform(LAT, 4))
    rid = p.start(SPLIT_G8, 1.0).reconfiguration
    p.switch_started(rid, 1.0)  # epoch 1
    p.ack(8, 1, 2)
    p.ack(9, 1, 2)
    p.ack(10, 1, 2)
    res = p.fail(W("w-cp2-g10"), 1.2)  # GPU 11 never acked
    assert res.ready == rid  # the surviving target is fully acknowledged
    assert p.state(W("w-cp2-g10")) is U
    with pytest.raises(IllegalTransition):
        p.ack(11, 1, 2)  # an unavailable worker's ranks must wait for recovery
    snap = p.exposed(rid, 1.5)
    assert snap.failed_targets == (W("w-cp2-g10"),)
    assert p.state(W("w-cp2-g8")) is A and p.state(W("w-cp2-g10")) is U

    rec = p.recover(W("w-cp2-g10"), 5.0)
    assert rec.epoch == 2 and (GpuGroup(10, 2), 2) in rec.workers
    assert p.state(W("w-cp2-g10")) is S
    with pytest.raises(StaleEpoch):
        p.ack(10, 1, 2)  # the pre-failure epoch
    assert p.ack(10, 2, 2).activated == ()
    assert p.ack(11, 2, 2).activated == (W("w-cp2-g10"),)
    assert p.state(W("w-cp2-g10")) is A


def test_cold_start_workers_activate_as_their_ranks_ack() -> None:
    p = EpochProtocol(Composition.uniform(LAT, 4), epoch=3, acknowledged=False)
    assert p.schedulable() == ()
    for gpu in range(3):
        assert p.ack(gpu, 3, 4).activated == ()
    assert p.ack(3, 3, 4).activated == (W("w-cp4-g0"),)
    assert p.schedulable() == (W("w-cp4-g0"),)
    with pytest.raises(IllegalTransition):
        p.start(SPLIT_G8, 1.0)  # g8 is not active yet


def test_time_going_backwards_within_a_reconfiguration_is_rejected() -> None:
    p = EpochProtocol(Composition.uniform(LAT, 4))
    rid = p.start(SPLIT_G8, 10.0, in_flight={W("w-cp4-g8"): [R("a")]}).reconfiguration
    with pytest.raises(InvalidInput):
        p.finished(W("w-cp4-g8"), R("a"), 9.0)
    assert p.reconfiguration(rid).in_flight == {W("w-cp4-g8"): 1}


def test_bad_constructor_arguments() -> None:
    with pytest.raises(InvalidInput):
        EpochProtocol("4CP4")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        EpochProtocol(Composition.uniform(LAT, 4), epoch=-1)


# --- invariant: random event sequences keep the pool consistent ---------------------------
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(0, 1000)), max_size=60))
def test_random_protocol_runs_keep_invariants(events: list[tuple[int, int]]) -> None:
    lat = Lattice(16, {2, 4, 8})
    p = EpochProtocol(Composition.uniform(lat, 4))
    now = 0.0
    last_epoch = 0
    for kind, k in events:
        now += 0.5
        before = _snapshot(p)
        try:
            if kind == 0:
                ops = adjacent(p.composition)
                op = ops[k % len(ops)]
                p.start(op, now, in_flight={w: [R(f"{w}-r")] for w in op.source_ids})
            elif kind == 1:
                ws = p.workers()
                w = ws[k % len(ws)].worker_id
                p.finished(w, R(f"{w}-r"), now)
            elif kind in (2, 4):
                rids = p.in_progress()
                if rids:
                    rid = rids[k % len(rids)]
                    (p.switch_started if kind == 2 else p.exposed)(rid, now)
            elif kind == 3:
                gpu = k % lat.num_gpus
                w = p.worker(p.worker_of_gpu(gpu))
                p.ack(gpu, w.epoch, w.group.degree)
            elif kind == 5:
                ws = p.workers()
                p.fail(ws[k % len(ws)].worker_id, now)
            elif kind == 6:
                ws = p.workers()
                p.recover(ws[k % len(ws)].worker_id, now)
            else:
                rids = p.in_progress()
                if rids:
                    p.abort(rids[k % len(rids)], now)
        except VertumnusError:
            # Every refusal is typed and changes nothing.
            assert _snapshot(p) == before
        comp = p.composition  # validates coverage and node boundaries
        assert sorted(gpu for g in comp.groups for gpu in g.gpus) == list(range(16))
        assert p.epoch >= last_epoch
        last_epoch = p.epoch
        for w in p.workers():
            assert w.epoch <= p.epoch
            if w.state is Lifecycle.ACTIVE:
                assert w.reconfiguration is None
        # No worker belongs to two live reconfigurations.
        live = [p.reconfiguration(r) for r in p.in_progress()]
        gpus = [gpu for r in live for g in r.sources for gpu in g.gpus]
        assert len(gpus) == len(set(gpus))


def test_control_record_and_report_serialise() -> None:
    import json

    from services.controller.lifecycle import ControlRecord

    p = EpochProtocol(Composition.uniform(LAT, 4))
    rid = p.start(SPLIT_G8, 1.0).reconfiguration
    rec = p.switch_started(rid, 2.0)
    wire = json.loads(json.dumps(rec.to_dict()))
    assert ControlRecord.from_dict(wire) == rec
    assert wire["workers"][2] == {"first_gpu": 8, "degree": 2, "epoch": 1}
    with pytest.raises(InvalidInput):
        ControlRecord.from_dict({"epoch": 1, "workers": [{"first_gpu": 3, "degree": 2}]})
    with pytest.raises(InvalidInput):
        ControlRecord.from_dict(
            {"epoch": 0, "workers": [{"first_gpu": 0, "degree": 4, "epoch": 1}]}
        )
    report = json.loads(json.dumps(p.reconfiguration(rid).to_dict()))
    assert report["phase"] == "committed" and report["drain_s"] == 0.0


def test_composition_is_one_object_until_a_commit() -> None:
    start = Composition.uniform(LAT, 4)
    p = EpochProtocol(start)
    assert p.composition is p.composition == start
    rid = p.start(SPLIT_G8, 1.0).reconfiguration  # nothing in flight: drained at once
    assert p.composition is p.composition == start  # draining changes no groups
    p.switch_started(rid, 2.0)
    after = p.composition
    assert after == start.apply(SPLIT_G8) and after.describe() == "2CP2/3CP4"
    assert p.composition is after
