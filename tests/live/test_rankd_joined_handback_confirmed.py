"""A later attempt that joined a job and was handed back with it, once intake holds its
hand-back, and where joined attempts' intake message ids come from.

A worker hands back each later attempt that joined a job (a client retry the intake stored
anew after a store loss; it usually shares the job's intake message id, the gateway's) as an
intake message of its own (:func:`~services.rankd.core.joined_handback_msg_id`). Once intake
acknowledged it, a re-sent assignment of that attempt (a scheduler that crashed, or whose 410
was lost, re-sends it when its intake message is redelivered) must be answered 410: intake
holds the attempt, to run and answer it elsewhere. That holds even when the request has since
come back (the job's own hand-back placed back here) and finished here as another attempt.
Before, the confirmed attempt was remembered by request id and source only, checked after
"finished here": its re-send was admitted as done and answered from the kept answer, stamped
for it -- the attempt answered here, and again wherever its hand-back runs. A genuine new
attempt (another arrival) still gets the kept answer.

Attempts without an intake message id are not remembered at all (core module rules): the
scheduler sends one with every assignment, so only tests and pre-header schedulers send none
(and those cannot act on 410 / 425). The last test holds the scheduler to it for a joined
attempt whose intake messages carry no ``Nats-Msg-Id``."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from rankd_support import WAIT_S, plain_assignment, results_of, stopped, until

from services.rankd import core as rankd_core
from services.rankd.backend import PrefillResult, SimBackend
from services.rankd.core import (
    HANDED_BACK_CODE,
    INTAKE_MSG_HEADER,
    HandedBack,
    Job,
    Redirecting,
    WorkerCore,
    handback_msg_id,
)
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from services.scheduler.service import SchedulerService, SchedulerSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import Assignment, AssignmentAck, EpochRecord, EpochWorker, to_json
from shared.service import RemoteError, call, ensure_intake_stream
from shared.subjects import Subjects
from shared.worker import GpuGroup, Lifecycle

WID = "w-cp2-g2"  # WAIT_S (rankd_support) bounds correctness waits only, never speed


def attempt(a: Assignment, arrival_after: float = 0.0, *, epoch: int | None = None) -> Assignment:
    """``a``'s request arrived ``arrival_after`` s after it (the same id and content: a later
    attempt when > 0), under ``epoch`` when given."""
    req = a.request.model_copy(update={"arrival_s": a.request.arrival_s + arrival_after})
    return a.model_copy(update={"request": req, "epoch": a.epoch if epoch is None else epoch})


def epoch_record(epoch: int, lifecycle: Lifecycle) -> EpochRecord:
    g = GpuGroup.from_worker_id(WID)
    return EpochRecord(epoch=epoch, committed_at_s=time.time(), workers=[EpochWorker(
        worker_id=WID, first_gpu=g.first_gpu, degree=g.degree, lifecycle=lifecycle)])


# -- the core ---------------------------------------------------------------------------------


def handed_back_then_finished(how: str) -> tuple[WorkerCore, Assignment, Assignment]:
    """x's job and a later attempt of x that joined it (both from intake message "x") were
    handed back, and intake holds both hand-backs (the attempt's confirmed ``how``: "at once"
    by its publish's ack, or "later", its outcome unknown until a re-send settled it). Then
    x's hand-back was placed back here and x finished here. Returns (the core, x's first
    assignment, the later attempt's), both of epoch 2."""
    core = WorkerCore(WID)
    first = plain_assignment("x", WID)
    later = attempt(first, 0.5)
    core.admit(first, 0.0, source="x")
    job = core.job("x")
    assert job is not None
    core.adopt(epoch_record(1, Lifecycle.DRAINING))
    core.redirect_settled("x", in_intake=True)
    joined = Job(job.assignment.model_copy(update={"request": later.request}),
                 accepted_at_s=job.accepted_at_s, source="x")
    if how == "at once":
        core.remember_handed_back("x", "x", arrival_s=later.request.arrival_s)
    else:
        core.joined_handback_unknown(joined)
        core.joined_handback_confirmed(joined)
    core.adopt(epoch_record(2, Lifecycle.ACTIVE))
    assert core.admit(attempt(first, epoch=2), 1.0, source=handback_msg_id("x", "x", WID, 1)) == 0
    assert core.start_next(1.0) is not None
    core.finish("x")
    return core, attempt(first, epoch=2), attempt(later, epoch=2)


@pytest.mark.parametrize("how", ["at once", "later"])
def test_a_confirmed_joined_attempt_comes_before_finished_here(how: str) -> None:
    """The later attempt's re-sent assignment is HandedBack (410), ``again`` or not, though
    x finished here since: matched by request id, source and arrival stamp, before "finished
    here". Every other re-send is admitted as done, as before: x's own (its source or its
    hand-back's), the later attempt from no or another source, a genuine new attempt (another
    arrival, the same source). Before, the later attempt's was admitted as done too."""
    core, first, later = handed_back_then_finished(how)
    for again in (False, True):
        with pytest.raises(HandedBack):
            core.admit(later, 2.0, source="x", again=again)
    assert len(core) == 0
    for a, source in ((first, "x"), (first, handback_msg_id("x", "x", WID, 1)),
                      (later, None), (later, "x@other"), (attempt(first, 1.0), "x")):
        assert core.admit(a, 2.0, source=source) == 0  # done, nothing queued
    assert len(core) == 0 and core.finished_arrival("x") == first.request.arrival_s


@pytest.mark.parametrize("how", ["at once", "later"])
def test_a_confirmed_joined_attempt_comes_before_its_jobs_redirect(how: str) -> None:
    """x finished here, then came back again and is being redirected by a new drain: the
    later attempt's re-send is still HandedBack (410: intake holds it), as the adapter
    answers it, not Redirecting (425, "retry later") as x's own re-send is. Before, the core
    answered the redirect first, against the adapter's order."""
    core, first, later = handed_back_then_finished(how)
    again_ = attempt(first, 1.0, epoch=2)  # x once more, a new intake message: runs here
    assert core.admit(again_, 2.0, source="x2", again=True) == 0
    core.adopt(epoch_record(3, Lifecycle.DRAINING))  # x queued: being redirected
    assert any(j.request_id == "x" for j in core.redirecting)
    with pytest.raises(HandedBack):
        core.admit(attempt(later, epoch=3), 3.0, source="x")
    with pytest.raises(Redirecting):
        core.admit(attempt(again_, epoch=3), 3.0, source="x2")


def test_confirmed_joined_attempts_are_remembered_within_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The latest ``FINISHED_MEMORY`` confirmed joined attempts are remembered by arrival
    (a bound, as every memory of the core has); an older one falls back to what its request id
    and source say (here: finished here, admitted as done)."""
    monkeypatch.setattr(rankd_core, "FINISHED_MEMORY", 2)
    core, _, later = handed_back_then_finished("at once")
    for n in (1, 2):
        core.remember_handed_back(f"y{n}", "y", arrival_s=float(n))
    assert core.admit(later, 2.0, source="x") == 0


# -- the service ------------------------------------------------------------------------------


class Gated(SimBackend):
    """Prefills of 0.01 s that start only once :attr:`gate` is set."""

    gate: asyncio.Event

    async def prefill(self, assignment: Assignment) -> PrefillResult:
        await self.gate.wait()
        return await super().prefill(assignment)


@contextlib.asynccontextmanager
async def gated_worker(url: str, prefix: str) -> AsyncIterator[tuple[RankdService, Gated]]:
    backend = Gated(prefill_time=lambda r, p, c, kind="cp": 0.01)
    backend.gate = asyncio.Event()
    svc = RankdService(RankdSettings(nats_url=url, subject_prefix=prefix, worker_id=WID,
                                     heartbeat_s=0.2, drain_timeout_s=0.5), backend)
    task = asyncio.create_task(svc.run(handle_signals=False))
    try:
        await asyncio.wait_for(svc.started.wait(), timeout=WAIT_S)
        yield svc, backend
    finally:
        await stopped(svc, task, timeout_s=WAIT_S)


async def adopted(svc: RankdService, nc: Client, s: Subjects, epoch: int,
                  lifecycle: Lifecycle) -> None:
    epochs = await nc.jetstream().key_value(s.epoch_bucket())
    await epochs.put(s.epoch_key(), to_json(epoch_record(epoch, lifecycle)))
    await until(lambda: svc.core.epoch == epoch, f"epoch {epoch} adopted")


async def assigned(nc: Client, s: Subjects, a: Assignment, source: str) -> AssignmentAck:
    return await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S,
                      headers={INTAKE_MSG_HEADER: source})


async def test_a_resent_confirmed_joined_attempt_is_410_after_its_request_finished_here(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """x (intake message "q-x") and a later attempt of x from the same message joined it
    are handed back by a drain; intake (a real stream) acknowledges both. ACTIVE again, x's
    hand-back is placed back here and x finishes here (answered once, for x). A scheduler
    re-sends the later attempt's assignment: 410, no answer sent -- intake holds it. x's own
    re-send is done (nothing sent) and a genuine new attempt gets the kept answer stamped for
    it, as before. Before, the later attempt's re-send was acked as done and the kept answer
    sent to it: answered here and again wherever its hand-back runs."""
    s = Subjects(uniq)
    await ensure_intake_stream(nc.jetstream(), s)
    results, _ = await results_of(nc, s)
    async with gated_worker(nats_server.url, uniq) as (svc, backend):
        await assigned(nc, s, plain_assignment("q-1", WID), "q-1")
        await until(lambda: svc.core.running is not None, "q-1 running")
        first = plain_assignment("q-x", WID)
        for a in (first, attempt(first, 0.5)):
            assert (await assigned(nc, s, a, "q-x")).queue_position == 1
        await adopted(svc, nc, s, 1, Lifecycle.DRAINING)
        await until(lambda: not (svc.core.redirecting or svc._redirects or svc._joined_out),
                    "both hand-backs in intake")
        await adopted(svc, nc, s, 2, Lifecycle.ACTIVE)
        await assigned(nc, s, attempt(first, epoch=2), handback_msg_id("q-x", "q-x", WID, 1))
        backend.gate.set()
        await until(lambda: len(results) == 2, "q-1 and x answered here")
        with pytest.raises(RemoteError) as err:
            await assigned(nc, s, attempt(first, 0.5, epoch=2), "q-x")
        assert err.value.code == int(HANDED_BACK_CODE)
        for a in (attempt(first, epoch=2), attempt(first, 1.0, epoch=2)):
            assert (await assigned(nc, s, a, "q-x")).queue_position == 0
        await until(lambda: len(results) == 3, "the new attempt answered")
        await svc.nc.flush()
        await nc.flush()
    arrival = first.request.arrival_s
    assert [(r.request_id, r.arrival_s) for r in results[1:]] \
        == [("q-x", arrival), ("q-x", arrival + 1.0)]


async def test_a_joined_attempt_placed_by_the_scheduler_carries_its_intake_message_id(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """Two intake messages of one request (two attempts, the same content) published with no
    ``Nats-Msg-Id`` at all: the scheduler places both on the one worker, and each assignment
    carries the intake message id it stands for (the request id, the scheduler's fallback),
    so the later attempt joins x's job with a source -- a joined attempt the worker hands
    back is always one the core can remember and match (module rules of the core)."""
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    async with gated_worker(nats_server.url, uniq) as (svc, _), \
            contextlib.AsyncExitStack() as stack:
        first = plain_assignment("q-x", WID)
        sched = SchedulerService(SchedulerSettings(
            nats_url=nats_server.url, subject_prefix=uniq, instance_id="sched-" + uniq[-6:],
            block_size=first.request.block_size))
        task = asyncio.create_task(sched.run(handle_signals=False))
        stack.push_async_callback(asyncio.wait_for, task, WAIT_S)
        stack.callback(sched.request_stop)
        await asyncio.wait_for(sched.started.wait(), timeout=WAIT_S)
        await until(lambda: len(sched.core.view) == 1, "the worker in the scheduler's view")
        for a in (first, attempt(first, 0.5)):
            await js.publish(s.intake_requests(), to_json(a.request))  # no Nats-Msg-Id
        await until(lambda: bool(svc._attempts.get("q-x")), "the later attempt joined x")
        job = svc.core.job("q-x")
        assert job is not None and job.source == "q-x"
        assert [src for _, src, *_ in svc._attempts["q-x"].values()] == ["q-x"]
