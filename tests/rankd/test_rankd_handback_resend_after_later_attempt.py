"""A job this worker handed back, a later attempt of its request that then finished here, and
the job's own assignment re-sent (a scheduler that crashed after the worker's ack, or whose
410 was lost, re-sends it when its intake message is redelivered: the same source, the same
arrival stamp).

Intake holds the job's hand-back (or may: its outcome unknown), which runs and answers the
job's attempt wherever it is placed. So the re-send is HandedBack (410) or settles the
hand-back of unknown outcome, as it is when nothing finished here since. Before, the request
finishing here (as the later attempt, another stamp) came first: the re-send was admitted as
done and the adapter sent it the later attempt's kept answer, stamped for the job's attempt
-- two answers for one attempt, the second one from wherever intake ran the hand-back (the
gateway dropped it as a duplicate).

Still admitted as done: the later attempt's own re-send (its stamp finished here), a genuine
new attempt (another stamp), and the job's re-send once its own hand-back finished here
(tests/live/test_rankd_joined_handback_confirmed.py)."""

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
from shared.schemas import Assignment, AssignmentAck, EpochRecord, EpochWorker, to_json
from shared.service import RemoteError, call, ensure_intake_stream
from shared.subjects import Subjects
from shared.worker import GpuGroup, Lifecycle

WID = "w-cp2-g2"  # WAIT_S bounds correctness waits only, never speed


def attempt(a: Assignment, arrival_after: float = 0.0, *, epoch: int) -> Assignment:
    """``a``'s request arrived ``arrival_after`` s after it (the same id and content: a later
    attempt when > 0), under ``epoch``."""
    req = a.request.model_copy(update={"arrival_s": a.request.arrival_s + arrival_after})
    return a.model_copy(update={"request": req, "epoch": epoch})


def epoch_record(epoch: int, lifecycle: Lifecycle) -> EpochRecord:
    g = GpuGroup.from_worker_id(WID)
    return EpochRecord(epoch=epoch, committed_at_s=time.time(), workers=[EpochWorker(
        worker_id=WID, first_gpu=g.first_gpu, degree=g.degree, lifecycle=lifecycle)])


# -- the core ---------------------------------------------------------------------------------


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
    resent = attempt(first, epoch=2)
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
    assert core.admit(attempt(first, epoch=2), 1.0, source="x>w-cp2-g2") == 0
    assert core.start_next(1.0) is not None
    core.finish("x")
    resent = attempt(first, epoch=2)
    core.check_handback(resent, source="x")
    assert core.admit(resent, 2.0, source="x") == 0


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
        await send(nc, s, attempt(first, epoch=2), "x")
    assert err.value.code == int(HANDED_BACK_CODE)
    await svc.nc.flush()
    await nc.flush()
    assert [(r.request_id, r.arrival_s) for r in results] == [
        ("q-1", results[0].arrival_s), ("x", later.request.arrival_s)]
    assert svc.answers_resent == 0
