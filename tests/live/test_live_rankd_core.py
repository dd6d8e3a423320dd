"""The rankd core (pure): admission rules, FIFO, idempotence, epoch adoption, state."""

from __future__ import annotations

import contextlib
import math
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rankd.core import (
    EpochAhead,
    HandBackUnknown,
    HandedBack,
    NotAccepting,
    QueueFull,
    Redirecting,
    WorkerCore,
    attempt_mark,
    handback_msg_id,
    is_handback_msg_id,
    joined_handback_msg_id,
)
from shared.ids import InvalidInput, UnknownWorker
from shared.schemas import (
    Assignment,
    DemoteCommand,
    EpochRecord,
    EpochWorker,
    IntakeRequest,
    ReclaimCommand,
    ReconcileCommand,
    ReplicateCommand,
)
from shared.worker import Lifecycle

WID = "w-cp4-g4"


def assignment(
    rid: str,
    *,
    worker: str = WID,
    epoch: int = 0,
    degree: int = 4,
    predicted: float = 1.0,
    length: int = 1000,
    prefix: int = 0,
    hashes: tuple[int, ...] = (),
) -> Assignment:
    return Assignment(
        request=IntakeRequest(
            request_id=rid,
            input_len=length,
            arrival_s=10.0,
            block_size=256,
            block_hashes=list(hashes),
        ),
        worker_id=worker,
        epoch=epoch,
        degree=degree,
        prefix_tokens=prefix,
        recompute_tokens=length - prefix,
        predicted_s=predicted,
        assigned_at_s=11.0,
    )


def record(epoch: int, lifecycle: Lifecycle | None) -> EpochRecord:
    workers = [EpochWorker(worker_id="w-cp4-g0", first_gpu=0, degree=4, lifecycle=Lifecycle.ACTIVE)]
    if lifecycle is not None:
        workers.append(EpochWorker(worker_id=WID, first_gpu=4, degree=4, lifecycle=lifecycle))
    return EpochRecord(epoch=epoch, workers=workers, committed_at_s=1.0)


def test_fifo_positions_and_idempotent_readmission() -> None:
    core = WorkerCore(WID, max_queue=3)
    assert [core.admit(assignment(r), 0.0) for r in ("a", "b", "c")] == [0, 1, 2]
    assert core.admit(assignment("b"), 0.0) == 1  # redelivery: same place, no duplicate
    with pytest.raises(QueueFull):
        core.admit(assignment("d"), 0.0)
    first = core.start_next(1.0)
    assert first is not None and first.request_id == "a"
    assert core.start_next(1.0) is None  # one at a time
    assert core.admit(assignment("a"), 2.0) == 0  # running: position 0
    assert core.admit(assignment("c"), 2.0) == 2
    core.finish("a")
    assert [core.start_next(3.0).request_id for _ in range(1)] == ["b"]  # type: ignore[union-attr]
    with pytest.raises(InvalidInput):
        core.finish("c")  # not running
    assert len(core) == 2


def test_a_finished_request_is_admitted_as_done_unless_asked_to_run_again() -> None:
    """A finished request's id is remembered with the arrival stamp of the attempt run: an
    assignment under it is admitted as done (not run twice) unless the adapter says
    ``again`` (a later attempt it cannot answer from what it kept), which then runs like a
    new request and is remembered by its own stamp once finished."""
    core = WorkerCore(WID, max_queue=3)
    assert core.finished_arrival("a") is None
    core.admit(assignment("a"), 0.0)
    core.start_next(1.0)
    core.finish("a")
    assert core.answered("a") and core.finished_arrival("a") == 10.0
    assert core.admit(assignment("a"), 2.0) == 0 and len(core) == 0  # done: nothing queued
    later = assignment("a")
    later = later.model_copy(update={"request": later.request.model_copy(
        update={"arrival_s": 20.0})})
    assert core.admit(later, 3.0, again=True) == 0 and len(core) == 1
    assert not core.answered("a")  # queued to run again
    assert core.admit(later, 3.5, again=True) == 0 and len(core) == 1  # a re-send: no copy
    assert core.start_next(4.0) is not None
    core.finish("a")
    assert core.finished_arrival("a") == 20.0 and core.served == 2


def test_a_refused_run_again_keeps_the_request_finished() -> None:
    """``again`` with an assignment the worker refuses (here: another degree) changes
    nothing: the id stays finished with its first attempt's stamp."""
    core = WorkerCore(WID, max_queue=3)
    core.admit(assignment("a"), 0.0)
    core.start_next(1.0)
    core.finish("a")
    with pytest.raises(InvalidInput):
        core.admit(assignment("a", degree=2), 2.0, again=True)
    assert core.finished_arrival("a") == 10.0 and len(core) == 0


def test_refusals_change_nothing() -> None:
    core = WorkerCore(WID, epoch=3)
    with pytest.raises(UnknownWorker):
        core.admit(assignment("x", worker="w-cp4-g0"), 0.0)
    with pytest.raises(InvalidInput):
        core.admit(assignment("x", degree=2), 0.0)
    with pytest.raises(EpochAhead):
        core.admit(assignment("x", epoch=4), 0.0)
    assert core.admit(assignment("x", epoch=2), 0.0) == 0  # lagging scheduler view is fine
    handed = core.set_lifecycle(Lifecycle.DRAINING)
    assert [j.request_id for j in handed] == ["x"]  # leaving ACTIVE handed "x" back
    with pytest.raises(NotAccepting):
        core.admit(assignment("y", epoch=3), 0.0)
    assert len(core) == 1  # "x" is still this worker's until its redirect settles
    core.redirect_settled("x")
    assert len(core) == 0


def test_epoch_adoption_and_redirects() -> None:
    core = WorkerCore(WID)
    for r in ("a", "b", "c"):
        core.admit(assignment(r), 0.0)
    core.start_next(0.0)
    adoption = core.adopt(record(1, Lifecycle.ACTIVE))
    assert adoption.adopted and adoption.member and adoption.redirected == ()
    assert not core.adopt(record(1, Lifecycle.DRAINING)).adopted  # not newer: ignored
    assert core.lifecycle is Lifecycle.ACTIVE
    adoption = core.adopt(record(2, Lifecycle.DRAINING))
    assert [j.request_id for j in adoption.redirected] == ["b", "c"]
    assert core.running is not None and core.running.request_id == "a"  # finishes in place
    gone = core.adopt(record(3, None))
    assert not gone.member and gone.lifecycle is Lifecycle.UNAVAILABLE and core.epoch == 3


def test_redirecting_jobs_stay_owned_until_settled_and_never_start() -> None:
    core = WorkerCore(WID, time_scale=1.0)
    for r, predicted in (("a", 1.0), ("b", 2.0), ("c", 4.0)):
        core.admit(assignment(r, predicted=predicted), 0.0)
    core.start_next(0.0)
    handed = core.adopt(record(1, Lifecycle.DRAINING)).redirected
    assert [j.request_id for j in handed] == ["b", "c"]
    assert [j.request_id for j in core.redirecting] == ["b", "c"]
    # Still counted: the state must not show an empty (drained) queue before intake has them.
    assert len(core) == 3 and core.state(0.0).queue_len == 3
    assert core.outstanding_s(0.0) == pytest.approx(1.0 + 2.0 + 4.0)
    # Never executed here: the FIFO no longer holds them, even after the running one ends.
    core.finish("a")
    assert core.start_next(1.0) is None
    # A new assignment of an id being redirected is refused, whatever the lifecycle.
    core.set_lifecycle(Lifecycle.ACTIVE)
    with pytest.raises(NotAccepting):
        core.admit(assignment("b", epoch=1), 1.0)
    assert core.redirect_settled("b").request_id == "b"
    with pytest.raises(InvalidInput):
        core.redirect_settled("b")  # settled once
    with pytest.raises(InvalidInput):
        core.redirect_settled("a")  # finished, never redirected
    assert [j.request_id for j in core.redirecting] == ["c"] and len(core) == 1
    # Once settled, the id may come back through intake and run here (not "finished").
    assert core.admit(assignment("b", epoch=1), 2.0) == 0
    assert core.start_next(2.0).request_id == "b"  # type: ignore[union-attr]
    core.redirect_settled("c")
    assert len(core) == 1 and core.outstanding_s(2.0) == pytest.approx(1.0)  # "b" running


def test_resent_assignment_of_a_handed_back_message_is_recognised() -> None:
    """A scheduler that crashed after our ack re-sends the assignment of the same intake
    message (source): while the redirect is unsettled it is Redirecting; once intake holds the
    redirect it is HandedBack — even after the worker is ACTIVE again — while the redirect's
    own message (another source) is admitted; a redirect that failed remembers nothing."""
    core = WorkerCore(WID)
    for r in ("x", "y"):
        core.admit(assignment(r), 0.0, source=r)
    core.start_next(0.0)
    core.admit(assignment("z"), 0.0, source="z")
    core.adopt(record(1, Lifecycle.DRAINING))
    assert [j.request_id for j in core.redirecting] == ["y", "z"]
    with pytest.raises(Redirecting):
        core.admit(assignment("y", epoch=1), 1.0, source="y")
    with pytest.raises(Redirecting):  # any source: it may already be in intake
        core.admit(assignment("y", epoch=1), 1.0, source="y-r1-" + WID)
    core.redirect_settled("y", in_intake=True)
    core.redirect_settled("z")  # failed / outcome unknown: nothing remembered
    with pytest.raises(HandedBack):
        core.admit(assignment("y", epoch=1), 1.0, source="y")
    with pytest.raises(NotAccepting) as exc:  # not ACTIVE, and not this source
        core.admit(assignment("z", epoch=1), 1.0, source="z")
    assert not isinstance(exc.value, HandedBack)
    core.adopt(record(2, Lifecycle.ACTIVE))
    with pytest.raises(HandedBack):
        core.admit(assignment("y", epoch=2), 2.0, source="y")
    with pytest.raises(HandedBack):
        core.admit(assignment("y", epoch=2), 2.0, source="y")  # refused, nothing changed
    assert len(core) == 1  # "x" still running
    # The redirect's own message placed back here, and a scheduler sending no source: admitted.
    assert core.admit(assignment("y", epoch=2), 2.0, source="y-r1-" + WID) == 1
    assert core.admit(assignment("z", epoch=2), 2.0) == 2
    assert [j.source for j in core.queued] == ["y-r1-" + WID, None]


def test_every_handed_back_source_of_a_request_is_remembered() -> None:
    """The adapter hands back a later attempt that joined a job as its own intake message,
    and remembers its source (remember_handed_back) beside the job's: a re-sent assignment
    of either source is HandedBack, even with the worker ACTIVE again; a third source (the
    hand-back's own message placed back here) is admitted. Before, one source was kept per
    request, and the joined attempt's none: its re-sent assignment ran here a second time."""
    core = WorkerCore(WID)
    core.admit(assignment("y"), 0.0, source="y")
    core.adopt(record(1, Lifecycle.DRAINING))
    core.redirect_settled("y", in_intake=True)
    core.remember_handed_back("y", "y-other")
    core.remember_handed_back("y", "y-other")  # once is enough; twice changes nothing
    core.adopt(record(2, Lifecycle.ACTIVE))
    for source in ("y", "y-other"):
        with pytest.raises(HandedBack):
            core.admit(assignment("y", epoch=2), 2.0, source=source)
    assert len(core) == 0
    assert core.admit(assignment("y", epoch=2), 2.0, source="y@a-hand-back") == 0
    # The job's own hand-back of unknown outcome, its joined attempt's in intake, one source
    # (the usual case): a re-sent assignment of it has the job's hand-back published again
    # (HandBackUnknown), not taken as in intake, until that is confirmed.
    core.admit(assignment("u"), 2.0, source="u")
    core.adopt(record(3, Lifecycle.DRAINING))
    core.redirect_settled("u", unknown=True)
    core.remember_handed_back("u", "u")
    with pytest.raises(HandBackUnknown):
        core.admit(assignment("u", epoch=3), 3.0, source="u")
    core.handback_confirmed("u")
    with pytest.raises(HandedBack):
        core.admit(assignment("u", epoch=3), 3.0, source="u")


def test_a_handback_of_unknown_outcome_is_remembered_until_confirmed() -> None:
    """A redirect whose publish outcome is unknown: a re-sent assignment of its source raises
    HandBackUnknown (carrying the job to publish again) — not a plain "not ACTIVE", which
    would let the scheduler place it afresh beside a stored redirect — until the adapter
    confirms intake holds it; then HandedBack. Other sources are unaffected."""
    core = WorkerCore(WID)
    core.admit(assignment("x"), 0.0, source="x")
    core.start_next(0.0)
    core.admit(assignment("u"), 0.0, source="u")
    core.adopt(record(1, Lifecycle.DRAINING))
    with pytest.raises(InvalidInput):
        core.redirect_settled("u", in_intake=True, unknown=True)
    assert [j.request_id for j in core.redirecting] == ["u"]  # the refusal changed nothing
    core.redirect_settled("u", unknown=True)
    assert len(core) == 1  # only "x": u is no longer this worker's
    with pytest.raises(HandBackUnknown) as exc:
        core.admit(assignment("u", epoch=1), 1.0, source="u")
    assert isinstance(exc.value, Redirecting)  # an adapter that cannot settle it answers 425
    assert exc.value.job.request_id == "u" and exc.value.job.source == "u"
    with pytest.raises(NotAccepting) as other:  # another source: just not ACTIVE
        core.admit(assignment("u", epoch=1), 1.0, source="u>" + WID)
    assert not isinstance(other.value, Redirecting)
    core.handback_confirmed("u")
    with pytest.raises(HandedBack):
        core.admit(assignment("u", epoch=1), 1.0, source="u")
    with pytest.raises(InvalidInput):
        core.handback_confirmed("u")  # nothing unknown left
    assert len(core) == 1


def test_a_worker_fault_hands_back_the_running_job_and_the_queue() -> None:
    """fault(running): the request that met the fault becomes a redirect, not a finish (not
    served, its pinned blocks released, nothing cached, not remembered as finished), handed
    back first, then the FIFO in order; the worker is UNAVAILABLE and admits nothing."""
    core = WorkerCore(WID, kv_total_blocks=8)
    core.admit(assignment("warm", hashes=(1, 2)), 0.0)
    core.start_next(0.0)
    core.finish("warm")
    core.take_cache_events()
    core.admit(assignment("a", hashes=(1, 2, 3), predicted=1.0), 1.0, source="a")
    for r in ("b", "c"):
        core.admit(assignment(r, predicted=2.0), 1.0, source=r)
    job = core.start_next(1.0)
    assert job is not None and job.pinned and core.state(1.0).kv_free_blocks == 6
    with pytest.raises(InvalidInput):
        core.fault("b")  # not the running request: nothing changes
    assert core.lifecycle is Lifecycle.ACTIVE and core.running is job and not core.faulted
    handed = core.fault("a")
    assert [j.request_id for j in handed] == ["a", "b", "c"]
    assert [j.request_id for j in core.redirecting] == ["a", "b", "c"]
    assert core.running is None and core.queued == () and core.faulted
    assert core.lifecycle is Lifecycle.UNAVAILABLE
    st = core.state(1.0)  # still this worker's until settled, and nothing counted as served
    assert (st.lifecycle, st.queue_len, st.served, st.kv_free_blocks) == (
        Lifecycle.UNAVAILABLE, 3, 1, 8)
    assert core.outstanding_s(1.0) == pytest.approx(5.0)
    assert core.take_cache_events() == []  # the faulted request stored nothing
    with pytest.raises(NotAccepting):
        core.admit(assignment("d"), 2.0)
    with pytest.raises(Redirecting):
        core.admit(assignment("a"), 2.0, source="a")
    with pytest.raises(InvalidInput):
        core.finish("a")  # no longer running: it can never be finished (or answered) here
    for r in ("a", "b", "c"):
        core.redirect_settled(r, in_intake=True)
    assert len(core) == 0 and core.state(2.0).queue_len == 0
    with pytest.raises(HandedBack):  # a re-sent assignment of the old message: in intake
        core.admit(assignment("a"), 3.0, source="a")


def test_a_faulted_worker_stays_unavailable_and_a_fault_elsewhere_spares_the_running_job() -> None:
    """fault() without a running id (another worker of the host met it): the running request
    stays and may finish; a newer epoch record or a local change never re-activates."""
    core = WorkerCore(WID)
    for r in ("a", "b"):
        core.admit(assignment(r), 0.0)
    core.start_next(0.0)
    assert [j.request_id for j in core.fault()] == ["b"]
    assert core.running is not None and core.running.request_id == "a"
    adoption = core.adopt(record(1, Lifecycle.ACTIVE))
    assert adoption.adopted and adoption.member and core.epoch == 1
    assert adoption.lifecycle is Lifecycle.UNAVAILABLE and core.lifecycle is Lifecycle.UNAVAILABLE
    assert core.set_lifecycle(Lifecycle.ACTIVE) == () and core.lifecycle is Lifecycle.UNAVAILABLE
    with pytest.raises(NotAccepting):
        core.admit(assignment("c", epoch=1), 1.0)
    assert core.fault() == ()  # again: nothing new to hand back
    core.finish("a")  # the running request completed after all: it is served
    assert core.served == 1 and core.fault() == ()


def test_handback_ids_are_one_per_hop_and_computable_by_the_scheduler() -> None:
    assert handback_msg_id("x", "x", WID, 3) == "x>" + WID
    hop2 = handback_msg_id("x", "x>" + WID, "w-cp4-g4", 4)
    assert hop2 == f"x>{WID}>w-cp4-g4"
    assert handback_msg_id("x", None, WID, 3) == f"x-r3-{WID}"  # no source: the epoch form
    long_source = ">".join(["w-cp2-g0"] * 40)
    a = handback_msg_id("x", long_source, WID, 1)
    assert len(a) <= 200 and a.endswith(">" + WID)
    assert a == handback_msg_id("x", long_source, WID, 9)  # deterministic, epoch-free
    assert a != handback_msg_id("x", long_source + "!", WID, 1)


def test_a_joined_attempts_hand_back_id_is_its_own_and_names_its_attempt() -> None:
    """Attempts of one request share their source (the gateway's id, the request id): a
    joined attempt's hand-back id differs from the job's by its arrival stamp, stays a
    hand-back id, and keeps naming that attempt on later hops; the job's own ids name none."""
    job = handback_msg_id("x", "x", WID, 3)
    later = joined_handback_msg_id("x", "x", WID, 3, 1796551338.25)
    assert later != job and later != joined_handback_msg_id("x", "x", WID, 3, 1796551338.5)
    assert is_handback_msg_id(later)
    assert later == joined_handback_msg_id("x", "x", WID, 9, 1796551338.25)  # epoch-free
    assert attempt_mark(later) == "1796551338.25"
    assert attempt_mark(handback_msg_id("x", later, "w-cp4-g4", 4)) == "1796551338.25"
    assert attempt_mark("x") is None and attempt_mark(job) is None
    assert attempt_mark(handback_msg_id("x", job, "w-cp4-g4", 4)) is None
    # Without a source (the epoch form) the stamp still tells the two apart.
    assert joined_handback_msg_id("x", None, WID, 3, 2.5) != handback_msg_id("x", None, WID, 3)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "start", "finish", "drain", "activate",
                                           "settle"]), st.integers(0, 5)), max_size=60))
def test_a_handed_back_job_never_starts_and_is_counted_until_settled(
        ops: list[tuple[str, int]]) -> None:
    core = WorkerCore(WID)
    # Job objects handed back, kept alive so identities stay unique (re-admission = new Job).
    handed: dict[int, object] = {}
    epoch = 0
    for op, k in ops:
        rid = f"r{k}"
        if op == "admit":
            with contextlib.suppress(NotAccepting):
                core.admit(assignment(rid, epoch=epoch), 0.0)
        elif op == "start":
            job = core.start_next(0.0)
            assert job is None or id(job) not in handed  # never both redirected and run
        elif op == "finish" and core.running is not None:
            core.finish(core.running.request_id)
        elif op in ("drain", "activate"):
            epoch += 1
            lc = Lifecycle.DRAINING if op == "drain" else Lifecycle.ACTIVE
            handed.update({id(j): j for j in core.adopt(record(epoch, lc)).redirected})
        elif op == "settle" and core.redirecting:
            core.redirect_settled(core.redirecting[k % len(core.redirecting)].request_id)
        queued = core.state(0.0).queue_len - len(core.redirecting) - (core.running is not None)
        assert queued >= 0 and len(core) == core.state(0.0).queue_len
        assert all(id(j) in handed for j in core.redirecting)


def test_first_record_adopted_even_at_same_epoch() -> None:
    core = WorkerCore(WID, epoch=5)
    assert core.adopt(record(5, Lifecycle.SWITCHING)).adopted
    assert core.lifecycle is Lifecycle.SWITCHING


def test_state_and_outstanding() -> None:
    core = WorkerCore(WID, kv_total_blocks=100, time_scale=0.5)
    core.admit(assignment("a", predicted=2.0, prefix=512), 0.0)
    core.admit(assignment("b", predicted=3.0), 0.0)
    core.start_next(10.0)
    # a ran 0.5 wall s at scale 0.5 = 1 modelled s: 1 s of a left + 3 s of b
    assert core.outstanding_s(10.5) == pytest.approx(4.0)
    s1 = core.state(10.5)
    assert (s1.queue_len, s1.degree, s1.gpus, s1.kv_free_blocks) == (2, 4, [4, 5, 6, 7], 100)
    # Joined attempts the adapter still hands back count as queued (not the core's jobs).
    assert core.state(10.5, handing_back=3).queue_len == 5
    for bad in (-1, 1.0, True):
        with pytest.raises(InvalidInput):
            core.state(10.5, handing_back=bad)  # type: ignore[arg-type]
    core.finish("a")
    s2 = core.state(11.0)
    assert s2.seq == s1.seq + 2 and s2.served == 1
    # the scheduler claimed P = 512 but this worker's cache was empty: P executed = 0
    assert (s2.hit_tokens, s2.input_tokens) == (0, 1000)


def test_outstanding_work_is_itemised_by_scheduler_replica() -> None:
    """Each scheduler replica reads its own share of the worker's outstanding work off the
    state (the rest is other replicas' load); requests without a replica id are in none."""
    core = WorkerCore(WID, time_scale=0.5)
    core.admit(assignment("a", predicted=2.0).model_copy(update={"scheduler_id": "s1"}), 0.0)
    core.admit(assignment("b", predicted=3.0).model_copy(update={"scheduler_id": "s2"}), 0.0)
    core.admit(assignment("c", predicted=1.5).model_copy(update={"scheduler_id": "s1"}), 0.0)
    core.admit(assignment("d", predicted=4.0), 0.0)  # an older scheduler: no id
    core.start_next(10.0)
    # a ran 0.5 wall s at scale 0.5 = 1 modelled s: 1 s of a left
    assert core.outstanding_by(10.5) == pytest.approx({"s1": 1.0 + 1.5, "s2": 3.0})
    st = core.state(10.5)
    assert st.outstanding_by == pytest.approx({"s1": 2.5, "s2": 3.0})
    assert st.outstanding_s == pytest.approx(2.5 + 3.0 + 4.0)
    assert WorkerCore(WID).state(0.0).outstanding_by == {}


def test_bad_construction() -> None:
    with pytest.raises(InvalidInput):
        WorkerCore("worker-7")
    with pytest.raises(InvalidInput):
        WorkerCore(WID, max_queue=0)


def test_prefix_cache_decides_reuse_and_reports_events() -> None:
    core = WorkerCore(WID, kv_total_blocks=8)
    # 1000 tokens at B = 256: three full blocks (+ a partial one whose hash is ignored)
    core.admit(assignment("a", hashes=(1, 2, 3, 4), prefix=768), 0.0)
    job = core.start_next(0.0)
    assert job is not None and job.executed is not None
    assert (job.executed.prefix_tokens, job.executed.recompute_tokens) == (0, 1000)
    core.finish("a")
    (stored,) = core.take_cache_events()
    assert (stored.event_id, stored.parent_hash, stored.block_hashes) == (1, None, (1, 2, 3))

    core.admit(assignment("b", hashes=(1, 2, 9)), 1.0)
    job = core.start_next(1.0)
    assert job is not None and job.executed is not None
    assert (job.executed.prefix_tokens, job.executed.recompute_tokens) == (512, 488)
    assert core.state(1.0).kv_free_blocks == 6  # two blocks pinned while it runs
    core.finish("b")
    assert core.state(2.0).kv_free_blocks == 8
    (stored,) = core.take_cache_events()
    assert (stored.parent_hash, stored.block_hashes) == (2, (9,))
    assert core.hit_tokens == 512

    # a full-prefix hit still recomputes its last token
    core.admit(assignment("c", length=768, hashes=(1, 2, 3)), 3.0)
    job = core.start_next(3.0)
    assert job is not None and job.executed is not None
    assert (job.executed.prefix_tokens, job.executed.recompute_tokens) == (767, 1)
    core.finish("c", ok=False)
    assert core.take_cache_events() == []  # failed: nothing stored
    snap = core.cache_snapshot()
    assert sorted(snap.blocks) == [(1, None), (2, 1), (3, 2), (9, 2)]


def test_cache_commands() -> None:
    core = WorkerCore(WID, kv_total_blocks=8, epoch=2)
    rep = core.apply_command(
        ReplicateCommand(
            command_id="c1", worker_id=WID, epoch=2, blocks=[5, 6], source_worker="w-cp4-g0"
        )
    )
    assert rep.ok and rep.blocks_done == 2
    again = core.apply_command(
        ReplicateCommand(
            command_id="c2", worker_id=WID, epoch=1, blocks=[5, 6, 7], source_worker="w-cp4-g0"
        )
    )
    assert again.blocks_done == 3  # path length now cached; only 7 was new
    rec = core.apply_command(ReclaimCommand(command_id="c3", worker_id=WID, epoch=2, blocks=[6]))
    assert rec.blocks_done == 0  # 6 still has a retained child (7)
    rec = core.apply_command(ReclaimCommand(command_id="c4", worker_id=WID, epoch=2, blocks=[6, 7]))
    assert rec.blocks_done == 2
    dropped = core.apply_command(
        ReconcileCommand(command_id="c5", worker_id=WID, epoch=2, blocks=[8])
    )
    assert dropped.blocks_done == 0
    kinds = [type(e).__name__ for e in core.take_cache_events()]
    assert kinds == ["Stored", "Stored", "Removed"]
    with pytest.raises(EpochAhead):
        core.apply_command(ReclaimCommand(command_id="c6", worker_id=WID, epoch=3, blocks=[5]))
    with pytest.raises(UnknownWorker):
        core.apply_command(
            ReclaimCommand(command_id="c7", worker_id="w-cp4-g0", epoch=2, blocks=[5])
        )
    with pytest.raises(InvalidInput):  # 5 is cached at the root, not under 9
        core.apply_command(
            ReplicateCommand(
                command_id="c8", worker_id=WID, epoch=2, blocks=[9, 5], source_worker="w-cp4-g0"
            )
        )


@pytest.mark.parametrize("demote", [True, False])
def test_a_demote_command_makes_its_blocks_the_first_evicted(demote: bool) -> None:
    """Chain [1, 2, 3] is cached before [4, 5, 6], so the LRU would evict it first; a demote
    of [4, 5, 6] (the source of a pull) reverses that, visibly in the Removed event of the
    next insert that needs room. It removes nothing, emits nothing, and counts only the
    blocks still cached."""
    core = WorkerCore(WID, kv_total_blocks=6, epoch=2)
    for cid, chain in (("c1", [1, 2, 3]), ("c2", [4, 5, 6])):
        core.apply_command(ReplicateCommand(command_id=cid, worker_id=WID, epoch=2,
                                            blocks=chain, source_worker="w-cp4-g0"))
    core.take_cache_events()
    if demote:
        res = core.apply_command(
            DemoteCommand(command_id="d1", worker_id=WID, epoch=1, blocks=[4, 5, 6, 99])
        )
        assert res.ok and res.blocks_done == 3  # 99 is not cached: skipped
        assert core.take_cache_events() == []  # nothing removed, nothing to tell
        assert len(core.cache_snapshot().blocks) == 6
    core.apply_command(ReplicateCommand(command_id="c3", worker_id=WID, epoch=2,
                                        blocks=[7, 8, 9], source_worker="w-cp4-g0"))
    removed = [e for e in core.take_cache_events() if type(e).__name__ == "Removed"]
    assert len(removed) == 1
    evicted = [4, 5, 6] if demote else [1, 2, 3]
    assert sorted(removed[0].block_hashes) == evicted
    none = core.apply_command(
        DemoteCommand(command_id="d2", worker_id=WID, epoch=2, blocks=evicted)
    )
    assert none.ok and none.blocks_done == 0  # evicted meanwhile: nothing to demote


def test_a_demote_command_is_refused_as_the_other_commands_are() -> None:
    core = WorkerCore(WID, kv_total_blocks=6, epoch=2)
    with pytest.raises(UnknownWorker):
        core.apply_command(DemoteCommand(command_id="d", worker_id="w-cp4-g0", epoch=2,
                                         blocks=[1]))
    with pytest.raises(EpochAhead):
        core.apply_command(DemoteCommand(command_id="d", worker_id=WID, epoch=3, blocks=[1]))
    with pytest.raises(InvalidInput, match="no KV cache"):
        WorkerCore(WID, epoch=2).apply_command(
            DemoteCommand(command_id="d", worker_id=WID, epoch=2, blocks=[1]))


def test_rank_shares_follow_the_zigzag_partition() -> None:
    from services.rankd.core import rank_shares

    # Hand-derived: R = 10, C = 2 → L = 3, chunks [0,3) [3,6) [6,9) [9,10); rank 0 owns
    # chunks 0 and 3 (3 + 1), rank 1 chunks 1 and 2 (3 + 3).
    assert rank_shares(10, 2) == (4, 6)
    assert rank_shares(13, 4) == (2, 3, 4, 4)  # L = 2, R_pad = 16: padding in chunks 6, 7
    assert rank_shares(8, 4) == (2, 2, 2, 2)
    assert rank_shares(1, 4) == (1, 0, 0, 0)
    assert rank_shares(7, 1) == (7,)
    for bad in ((0, 2), (5, 0)):
        with pytest.raises(InvalidInput):
            rank_shares(*bad)


@given(st.integers(1, 100_000), st.sampled_from([1, 2, 4, 8]))
def test_rank_shares_sum_to_r_and_are_balanced(r: int, c: int) -> None:
    from services.rankd.core import rank_shares

    shares = rank_shares(r, c)
    assert len(shares) == c and sum(shares) == r
    ell = -(-r // (2 * c))
    assert all(0 <= s <= 2 * ell for s in shares)


def test_rank_shares_match_the_engine_partition() -> None:
    torch = pytest.importorskip("torch")  # the engine extra
    from services.rankd.core import rank_shares
    from services.rankd.engine.zigzag import ZigzagPlan

    del torch
    for r in (*range(1, 70), 511, 512, 513, 4097):
        for c in (1, 2, 4, 8):
            plan = ZigzagPlan(r, c)
            assert rank_shares(r, c) == tuple(int(plan.real_rows(k).sum()) for k in range(c))


@pytest.mark.parametrize("bad", [(9,), (7, 7), (7, 9, 7)], ids=["reparented", "repeated", "loop"])
def test_a_chain_contradicting_the_cache_starts_as_a_miss(bad: tuple[int, ...]) -> None:
    """A request whose block hashes contradict the cache (bad input, a collision) is not an
    error of the worker: it starts with P = 0, runs, and the cache is left as it was."""
    core = WorkerCore(WID, kv_total_blocks=8)
    core.admit(assignment("a", length=512, hashes=(7, 9)), 0.0)
    assert core.start_next(0.0) is not None
    core.finish("a")
    core.take_cache_events()
    core.admit(assignment("b", length=256 * len(bad), hashes=bad), 1.0)
    job = core.start_next(1.0)
    assert job is not None and job.executed is not None and job.executed.prefix_tokens == 0
    assert job.pinned == () and core.running is job
    core.finish("b")
    assert core.cache is not None and core.cache.blocks() == frozenset({7, 9})
    assert core.cache.parent_of(9) == 7 and core.cache.pins(7) == core.cache.pins(9) == 0
    assert len(core) == 0 and core.state(2.0).kv_free_blocks == 8


def test_outstanding_work_of_huge_predictions_stays_publishable() -> None:
    """Each predicted_s is finite (the schema's bound) but two near the float maximum sum to
    inf, which the WorkerState schema refuses: the state (the worker's liveness heartbeat)
    must still be built, saturated at the largest float."""
    core = WorkerCore(WID)
    for rid in ("a", "b", "c"):
        a = assignment(rid, predicted=1.5e308).model_copy(update={"scheduler_id": "s-1"})
        core.admit(a, 0.0)
    core.start_next(0.0)
    state = core.state(1.0)
    assert state.outstanding_s == state.outstanding_by["s-1"] == sys.float_info.max
    assert state.queue_len == 3


def test_a_request_priced_with_a_pull_waits_for_it_at_the_head_of_the_queue() -> None:
    """``Assignment.pull_copy_s`` (J's pull credit with its wait): the head of the FIFO is held
    (:meth:`WorkerCore.pull_hold` > 0) while the cache lacks the prefix it was priced with, at
    most until its admission + time_scale·slack·pull_copy_s + grace; the pull's copy landing
    (a replicate command) releases it, and it then reuses the pulled blocks."""
    core = WorkerCore(WID, kv_total_blocks=8, time_scale=0.5, pull_hold_slack=2.0,
                      pull_hold_grace_s=0.1)
    a = assignment("a", hashes=(1, 2, 3, 4), prefix=768).model_copy(
        update={"pull_copy_s": 1.0})  # admitted at 11.0: held until 11 + 0.5·2·1 + 0.1
    core.admit(a, 11.0)
    assert core.pull_hold(11.0) == pytest.approx(1.1)
    assert core.pull_hold(11.6) == pytest.approx(0.5)
    core.apply_command(ReplicateCommand(command_id="c1", worker_id=WID, epoch=0, blocks=[1, 2],
                                        source_worker="w-cp4-g0"))
    assert core.pull_hold(11.6) == pytest.approx(0.5)  # 512 of the 768 tokens: still short
    core.apply_command(ReplicateCommand(command_id="c2", worker_id=WID, epoch=0,
                                        blocks=[1, 2, 3], source_worker="w-cp4-g0"))
    assert core.pull_hold(11.6) == 0.0
    job = core.start_next(11.6)
    assert job is not None and job.executed is not None
    assert job.executed.prefix_tokens == 768
    assert core.pull_hold(11.6) == 0.0  # something runs: nothing to hold


def test_a_pull_that_does_not_come_is_waited_for_only_so_long() -> None:
    core = WorkerCore(WID, kv_total_blocks=8, pull_hold_grace_s=0.0)  # slack 2, time scale 1
    core.admit(assignment("a", hashes=(1, 2, 3, 4), prefix=768).model_copy(
        update={"pull_copy_s": 0.25}), 11.0)
    assert core.pull_hold(11.4) == pytest.approx(0.1)
    assert core.pull_hold(11.5) == 0.0
    # Past the bound it waits on only while a copy of its first missing block is arriving.
    assert core.pull_hold(11.5, incoming={1, 2, 3}) == math.inf
    assert core.pull_hold(11.5, incoming={2, 3}) == 0.0
    job = core.start_next(11.5)
    assert job is not None and job.executed is not None
    assert job.executed.prefix_tokens == 0  # it recomputes what did not come
    # Without a pull (or without a cache) nothing is ever held.
    core.finish("a")
    core.admit(assignment("b", hashes=(7, 8), prefix=512), 11.5)
    assert core.pull_hold(11.5) == 0.0
    bare = WorkerCore(WID)
    bare.admit(assignment("c", prefix=512).model_copy(update={"pull_copy_s": 5.0}), 11.0)
    assert bare.pull_hold(11.0) == 0.0


@pytest.mark.parametrize("kw", [{"pull_hold_slack": 0.5}, {"pull_hold_slack": float("inf")},
                                {"pull_hold_grace_s": -1.0}, {"pull_hold_grace_s": float("nan")}])
def test_bad_pull_hold_bounds_are_refused(kw: dict) -> None:
    with pytest.raises(InvalidInput, match="pull_hold"):
        WorkerCore(WID, **kw)


def test_an_assignment_with_a_bad_pull_copy_time_is_refused() -> None:
    from pydantic import ValidationError
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValidationError, match="pull_copy_s"):
            Assignment.model_validate({**assignment("a").model_dump(), "pull_copy_s": bad})
