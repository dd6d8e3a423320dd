"""A later attempt of a request whose job this worker handed back, sharing the job's intake
message id (the usual case: a gateway publishes every attempt under the request id, and a
later one is stored anew where the first one's message no longer de-duplicates it -- a store
loss), on a real nats-server with a real RankdService (sim backend), and the worker core's
bookkeeping of it.

A re-sent assignment of the job itself (a scheduler that crashed after the worker's ack, its
intake message redelivered: the same request, the same arrival stamp) is answered 410 once
intake holds the job's hand-back, or settles a hand-back of unknown outcome (410 / 425) -- the
request lives on under the hand-back's message. A later attempt (another arrival stamp) is not
that message: its gateway waits for an answer stamped with its own arrival, which the job's
hand-back never gives. It must be admitted and answered like any attempt.

Before, the job's hand-back was remembered by its source alone: the later attempt was
answered 410 (the scheduler acks its message and places nothing: the attempt lost, its client
answered by no one) or taken for a re-send of the job's hand-back of unknown outcome (the job's
hand-back published again, the attempt answered 410 or 425 and never admitted)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from gated_backend import GatedBackend
from nats.aio.client import Client
from rankd_support import WAIT_S, handed_back, plain_assignment, results_of, until
from service_support import service_running

from services.rankd.core import (
    HANDED_BACK_CODE,
    INTAKE_MSG_HEADER,
    HandBackUnknown,
    HandedBack,
    WorkerCore,
)
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
    AssignmentAck,
    EpochRecord,
    EpochWorker,
    FirstToken,
    decode,
    to_json,
)
from shared.service import RemoteError, call, ensure_intake_stream
from shared.subjects import Subjects
from shared.worker import GpuGroup, Lifecycle

WID = "w-cp2-g2"


def attempt(a: Assignment, arrival_after: float, *, epoch: int) -> Assignment:
    """``a``'s request arrived ``arrival_after`` s after it (the same id and content), under
    ``epoch``."""
    req = a.request.model_copy(update={"arrival_s": a.request.arrival_s + arrival_after})
    return a.model_copy(update={"request": req, "epoch": epoch})


def epoch_record(epoch: int, lifecycle: Lifecycle) -> EpochRecord:
    g = GpuGroup.from_worker_id(WID)
    return EpochRecord(epoch=epoch, committed_at_s=time.time(), workers=[EpochWorker(
        worker_id=WID, first_gpu=g.first_gpu, degree=g.degree, lifecycle=lifecycle)])


# -- the core ---------------------------------------------------------------------------------


@pytest.mark.parametrize("outcome", ["in_intake", "unknown"])
def test_a_later_attempt_under_the_jobs_source_is_not_taken_for_its_re_send(
    outcome: str,
) -> None:
    """x (intake message "x") was handed back (intake acknowledged it, or the outcome is
    unknown); the worker is ACTIVE again. x's re-sent assignment (its arrival) is still
    HandedBack / HandBackUnknown; a later attempt of x from the same message id (another
    arrival) is admitted."""
    core = WorkerCore(WID)
    first = plain_assignment("x", WID)
    core.admit(first, 0.0, source="x")
    core.adopt(epoch_record(1, Lifecycle.DRAINING))
    core.redirect_settled("x", **{outcome: True})
    core.adopt(epoch_record(2, Lifecycle.ACTIVE))
    resent = first.model_copy(update={"epoch": 2})
    with pytest.raises(HandBackUnknown if outcome == "unknown" else HandedBack):
        core.admit(resent, 1.0, source="x")
    later = attempt(first, 5.0, epoch=2)
    assert core.admit(later, 1.0, source="x") == 0
    assert core.job("x") is not None
    assert core.job("x").assignment.request.arrival_s == later.request.arrival_s


def test_a_confirmed_handback_keeps_answering_the_re_send_after_its_settling() -> None:
    """A hand-back of unknown outcome settled by a re-send (handback_confirmed) answers the
    job's re-send HandedBack from then on, and a later attempt under its source is still
    admitted."""
    core = WorkerCore(WID)
    first = plain_assignment("x", WID)
    core.admit(first, 0.0, source="x")
    core.adopt(epoch_record(1, Lifecycle.DRAINING))
    core.redirect_settled("x", unknown=True)
    core.handback_confirmed("x")
    core.adopt(epoch_record(2, Lifecycle.ACTIVE))
    with pytest.raises(HandedBack):
        core.admit(first.model_copy(update={"epoch": 2}), 1.0, source="x")
    assert core.admit(attempt(first, 5.0, epoch=2), 1.0, source="x") == 0


def test_a_joined_attempts_hand_back_does_not_answer_for_the_jobs_own() -> None:
    """x's job and a later attempt that joined it share intake message "x"; the job's own
    hand-back failed for good (its client was told), the attempt's was acknowledged. x's
    re-sent assignment is then answered as after any failed hand-back (admitted by an ACTIVE
    worker), not 410 on the strength of the attempt's hand-back; the attempt's own re-send
    is HandedBack. Before: 410 for both (the leftover docs/evaluation.md recorded)."""
    core = WorkerCore(WID)
    first = plain_assignment("x", WID)
    later = attempt(first, 5.0, epoch=0)
    core.admit(first, 0.0, source="x")
    core.adopt(epoch_record(1, Lifecycle.DRAINING))
    core.redirect_settled("x")  # a definite failure: nothing remembered
    core.remember_handed_back("x", "x", arrival_s=later.request.arrival_s)
    core.adopt(epoch_record(2, Lifecycle.ACTIVE))
    with pytest.raises(HandedBack):
        core.admit(later.model_copy(update={"epoch": 2}), 1.0, source="x")
    assert core.admit(first.model_copy(update={"epoch": 2}), 1.0, source="x") == 0


def test_two_attempts_handed_back_with_unknown_outcomes_are_both_remembered() -> None:
    """x (arrival a1, intake message "x") and then a later attempt of x under the same
    message id (a2, admitted once x was handed back) are both handed back with unknown
    outcomes: a re-send of each settles its own hand-back (HandBackUnknown naming that
    attempt's job), and confirming one leaves the other unknown. Remembering them by request
    id alone, the second replaced the first: x's re-send was then admitted beside a hand-back
    intake may hold."""
    core = WorkerCore(WID)
    first = plain_assignment("x", WID)
    core.admit(first, 0.0, source="x")
    core.adopt(epoch_record(1, Lifecycle.DRAINING))
    core.redirect_settled("x", unknown=True)
    core.adopt(epoch_record(2, Lifecycle.ACTIVE))
    later = attempt(first, 5.0, epoch=2)
    core.admit(later, 1.0, source="x")
    core.adopt(epoch_record(3, Lifecycle.DRAINING))
    core.redirect_settled("x", unknown=True)
    core.adopt(epoch_record(4, Lifecycle.ACTIVE))
    for a in (first, later):
        with pytest.raises(HandBackUnknown) as exc:
            core.admit(a.model_copy(update={"epoch": 4}), 2.0, source="x")
        assert exc.value.job.assignment.request.arrival_s == a.request.arrival_s
    core.handback_confirmed("x", arrival_s=first.request.arrival_s)
    with pytest.raises(HandedBack):
        core.admit(first.model_copy(update={"epoch": 4}), 2.0, source="x")
    with pytest.raises(HandBackUnknown):
        core.admit(later.model_copy(update={"epoch": 4}), 2.0, source="x")
    assert len(core) == 0  # the refusals changed nothing


# -- the service --------------------------------------------------------------------------------


@pytest.fixture
async def gated(nats_server: EmbeddedNats, uniq: str) -> AsyncIterator[tuple[RankdService,
                                                                              GatedBackend]]:
    backend = GatedBackend()
    svc = RankdService(RankdSettings(nats_url=nats_server.url, subject_prefix=uniq,
                                     worker_id=WID, heartbeat_s=0.2), backend)
    try:
        async with service_running(svc, timeout_s=WAIT_S):
            yield svc, backend
    finally:
        backend.gate.set()


async def send(nc: Client, s: Subjects, a: Assignment, source: str) -> AssignmentAck:
    return await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S,
                      headers={INTAKE_MSG_HEADER: source})


async def test_a_later_attempt_of_a_handed_back_request_is_run_and_answered_with_its_stamp(
    gated: tuple[RankdService, GatedBackend], nc: Client, uniq: str
) -> None:
    """q-1 runs (held), x queues behind it and is handed back by a drain: intake acknowledges
    it. Once the worker is ACTIVE again, a later attempt of x under x's message id is
    admitted, runs, and gets its own answer (its arrival stamp). Before: 410, never run."""
    svc, backend = gated
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    epochs = await js.key_value(s.epoch_bucket())
    await send(nc, s, plain_assignment("q-1", WID), "q-1")
    await until(lambda: svc.core.running is not None, "q-1 running")
    first = plain_assignment("x", WID)
    await send(nc, s, first, "x")
    await epochs.put(s.epoch_key(), to_json(epoch_record(1, Lifecycle.DRAINING)))
    assert set(await handed_back(js, s, 1)) == {"x"}  # intake holds x's hand-back
    await until(lambda: not svc.core.redirecting, "x's hand-back settled")
    backend.gate.set()
    await until(lambda: svc.core.running is None, "q-1 done")
    await epochs.put(s.epoch_key(), to_json(epoch_record(2, Lifecycle.ACTIVE)))
    await until(lambda: svc.core.lifecycle is Lifecycle.ACTIVE, "ACTIVE again")
    sub = await nc.subscribe(s.result("x"))
    later = attempt(first, 5.0, epoch=2)
    ack = await send(nc, s, later, "x")
    assert ack.queue_position == 0
    ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
    assert ft.error is None and ft.arrival_s == later.request.arrival_s


# -- the job's re-send after a later attempt finished here ------------------------------------
# A job this worker handed back, a later attempt of its request that then finished here, and
# the job's own assignment re-sent (a scheduler that crashed after the worker's ack, or whose
# 410 was lost, re-sends it when its intake message is redelivered: the same source, the same
# arrival stamp).
#
# Intake holds the job's hand-back (or may: its outcome unknown), which runs and answers the
# job's attempt wherever it is placed. So the re-send is HandedBack (410) or settles the
# hand-back of unknown outcome, as it is when nothing finished here since. Before, the request
# finishing here (as the later attempt, another stamp) came first: the re-send was admitted as
# done and the adapter sent it the later attempt's kept answer, stamped for the job's attempt
# -- two answers for one attempt, the second one from wherever intake ran the hand-back (the
# gateway dropped it as a duplicate).
#
# Still admitted as done: the later attempt's own re-send (its stamp finished here), a genuine
# new attempt (another stamp), and the job's re-send once its own hand-back finished here
# (tests/live/test_rankd_joined_handback_confirmed.py).




@pytest.mark.parametrize("later_source", ["x", "y"], ids=["same-message-id", "another"])
@pytest.mark.parametrize("outcome", ["in_intake", "unknown"])
def test_the_jobs_re_send_is_its_hand_backs_though_a_later_attempt_finished_here(
        outcome: str, later_source: str) -> None:
    core = WorkerCore(WID)
    first = plain_assignment("x", WID)
    core.admit(first, 0.0, source="x")
    core.adopt(epoch_record(1, Lifecycle.DRAINING))
    core.redirect_settled("x", **{outcome: True})
    core.adopt(epoch_record(2, Lifecycle.ACTIVE))
    later = attempt(first, 5.0, epoch=2)
    assert core.admit(later, 1.0, source=later_source) == 0
    assert core.start_next(1.0) is not None
    core.finish("x")
    resent = attempt(first, 0.0, epoch=2)
    expected = HandBackUnknown if outcome == "unknown" else HandedBack
    for again in (False, True):
        with pytest.raises(expected):
            core.admit(resent, 2.0, source="x", again=again)
    # What the adapter asks before it answers a re-send from the answer it kept.
    with pytest.raises(expected):
        core.check_handback(resent, source="x")
    assert len(core) == 0  # the refusals changed nothing
    # Unchanged: the later attempt's own re-send and a genuine new attempt are done here
    # (the adapter answers the new one from its kept answer); so is a re-send without source.
    core.check_handback(later, source=later_source)
    assert core.admit(later, 2.0, source=later_source) == 0
    newer = attempt(first, 9.0, epoch=2)
    core.check_handback(newer, source="x")
    assert core.admit(newer, 2.0, source="x") == 0
    assert core.admit(resent, 2.0, source=None) == 0
    assert len(core) == 0 and core.finished_arrival("x") == later.request.arrival_s


def test_the_jobs_re_send_is_done_once_its_own_hand_back_finished_here() -> None:
    """The job's hand-back placed back here finished here (the same stamp): the job's attempt
    was answered here, so its re-send is done, nothing sent -- as before."""
    core = WorkerCore(WID)
    first = plain_assignment("x", WID)
    core.admit(first, 0.0, source="x")
    core.adopt(epoch_record(1, Lifecycle.DRAINING))
    core.redirect_settled("x", in_intake=True)
    core.adopt(epoch_record(2, Lifecycle.ACTIVE))
    assert core.admit(attempt(first, 0.0, epoch=2), 1.0, source="x>w-cp2-g2") == 0
    assert core.start_next(1.0) is not None
    core.finish("x")
    resent = attempt(first, 0.0, epoch=2)
    core.check_handback(resent, source="x")
    assert core.admit(resent, 2.0, source="x") == 0


async def test_the_jobs_re_send_gets_410_and_no_second_answer(
    gated: tuple[RankdService, GatedBackend], nc: Client, uniq: str
) -> None:
    """q-1 runs (held), x queues behind it and is handed back by a drain: intake (a real
    stream) acknowledges it. ACTIVE again, a later attempt of x under x's message id runs
    here and is answered with its own stamp. x's re-sent assignment is then 410 and no answer
    goes out for x's stamp: intake's hand-back answers it. Before: acked as done, and the
    kept answer was sent stamped for x's attempt."""
    svc, backend = gated
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    epochs = await js.key_value(s.epoch_bucket())
    results, _ = await results_of(nc, s)
    await send(nc, s, plain_assignment("q-1", WID), "q-1")
    await until(lambda: svc.core.running is not None, "q-1 running")
    first = plain_assignment("x", WID)
    await send(nc, s, first, "x")
    await epochs.put(s.epoch_key(), to_json(epoch_record(1, Lifecycle.DRAINING)))
    assert set(await handed_back(js, s, 1)) == {"x"}  # intake holds x's hand-back
    await until(lambda: not svc.core.redirecting, "x's hand-back settled")
    backend.gate.set()
    await until(lambda: svc.core.running is None, "q-1 done")
    await epochs.put(s.epoch_key(), to_json(epoch_record(2, Lifecycle.ACTIVE)))
    await until(lambda: svc.core.lifecycle is Lifecycle.ACTIVE, "ACTIVE again")
    later = attempt(first, 5.0, epoch=2)
    assert (await send(nc, s, later, "x")).queue_position == 0
    await until(lambda: any(r.request_id == "x" for r in results), "the later attempt answered")
    with pytest.raises(RemoteError) as err:
        await send(nc, s, attempt(first, 0.0, epoch=2), "x")
    assert err.value.code == int(HANDED_BACK_CODE)
    await svc.nc.flush()
    await nc.flush()
    assert [(r.request_id, r.arrival_s) for r in results] == [
        ("q-1", results[0].arrival_s), ("x", later.request.arrival_s)]
    assert svc.answers_resent == 0
