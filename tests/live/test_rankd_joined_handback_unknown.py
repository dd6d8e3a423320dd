"""A later attempt that joined a handed-back job, whose own hand-back's outcome is unknown or
still open, on a real nats-server with a real RankdService (sim backend), and the worker core's
bookkeeping of it.

A worker hands back each later attempt that joined a job (a client retry the intake stored
anew after a store loss) as an intake message of its own
(:func:`~services.rankd.core.joined_handback_msg_id`). A scheduler that crashed after the
worker's ack re-sends that attempt's assignment when its intake message is redelivered. The
worker must answer it as it answers the job's: 425 while the hand-back's outcome is open (the
scheduler keeps its record and tries again), 410 once intake holds the hand-back (the scheduler
acks its old message) -- never admit it (a second prefill beside the stored hand-back), never
refuse it as "not ACTIVE" (the scheduler places it afresh beside the stored hand-back), never
410 while intake may not hold it (the attempt is then lost and its client never answered).

Before, a joined attempt whose hand-back outcome was unknown (every try timed out or met a 5xx
until ``redirect_timeout_s``) was forgotten, as was one whose hand-back was still under way.

The intake stream is a stand-in subscriber on the intake subject answering each JetStream
publish as the stream would (a PubAck, an API error) or not at all (a lost ack)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from rankd_support import plain_assignment, stopped, until

from services.rankd.backend import PrefillResult, SimBackend
from services.rankd.core import (
    HANDED_BACK_CODE,
    INTAKE_MSG_HEADER,
    JOINED_MARK,
    REDIRECTING_CODE,
    HandBackUnknown,
    HandedBack,
    Job,
    WorkerCore,
    handback_msg_id,
    joined_handback_msg_id,
)
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.ids import InvalidInput
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
from shared.service import RemoteError, call
from shared.subjects import Subjects
from shared.worker import GpuGroup, Lifecycle

WID = "w-cp2-g2"
WAIT_S = 20.0  # bound for correctness waits only; nothing asserts on speed
UNAVAILABLE = {"code": 503, "err_code": 10008,
               "description": "JetStream system temporarily unavailable"}


def later_attempt(a: Assignment, arrival: float, *, epoch: int | None = None) -> Assignment:
    """A later attempt of ``a``'s request (the same id and content), arrived at ``arrival``;
    of ``epoch`` when given."""
    update: dict[str, object] = {"request": a.request.model_copy(update={"arrival_s": arrival})}
    if epoch is not None:
        update["epoch"] = epoch
    return a.model_copy(update=update)


def of_epoch(a: Assignment, epoch: int) -> Assignment:
    return a.model_copy(update={"epoch": epoch})


# -- the core ---------------------------------------------------------------------------------


def record(epoch: int, lifecycle: Lifecycle) -> EpochRecord:
    g = GpuGroup.from_worker_id(WID)
    return EpochRecord(epoch=epoch, committed_at_s=0.0, workers=[
        EpochWorker(worker_id=WID, first_gpu=g.first_gpu, degree=g.degree,
                    lifecycle=lifecycle)])


def attempt_job(job: Job, later: Assignment, source: str | None) -> Job:
    """A later attempt that joined ``job`` (its request ``later.request``, from ``source``),
    as the adapter describes it to the core."""
    return Job(job.assignment.model_copy(update={"request": later.request}),
               accepted_at_s=job.accepted_at_s, source=source)


def drained_x(*others: str) -> tuple[WorkerCore, Assignment, Assignment, Job]:
    """A core whose job x (from intake message "x") is being handed back by a drain (epoch
    1), with a later attempt of x (0.5 s later, not yet admitted); ``others``: more requests
    admitted before the drain, each from its own id as source. Returns (the core, x's first
    assignment, the later attempt's, x's job)."""
    core = WorkerCore(WID)
    first = plain_assignment("x", WID)
    later = later_attempt(first, first.request.arrival_s + 0.5)
    core.admit(first, 0.0, source="x")
    for rid in others:
        core.admit(plain_assignment(rid, WID), 0.0, source=rid)
    job = core.job("x")
    assert job is not None
    core.adopt(record(1, Lifecycle.DRAINING))
    return core, first, later, job


def test_a_joined_attempt_of_unknown_outcome_is_remembered_until_confirmed() -> None:
    """The core remembers a joined attempt whose hand-back outcome is unknown by its source
    and arrival stamp: its re-sent assignment raises HandBackUnknown naming it (``joined``,
    the attempt's request) until the adapter confirms intake holds it, then HandedBack. Its
    source being the job's (the usual case) does not make the job's confirmed hand-back
    answer for it, nor the attempt's unknown outcome the job's. A refusal changes nothing;
    an attempt without a source is not remembered (nothing could match it)."""
    core, first, later, job = drained_x("y")
    other = core.job("y")
    assert other is not None
    core.redirect_settled("x", in_intake=True)
    core.redirect_settled("y", in_intake=True)
    core.joined_handback_unknown(attempt_job(job, later, "x"))
    core.joined_handback_unknown(attempt_job(other, later_attempt(
        other.assignment, 9.0), None))  # no source: nothing remembered
    for epoch, lifecycle in ((1, None), (2, Lifecycle.ACTIVE)):
        if lifecycle is not None:
            core.adopt(record(epoch, lifecycle))
        with pytest.raises(HandBackUnknown) as exc:
            core.admit(of_epoch(later, epoch), 1.0, source="x")
        assert exc.value.joined and exc.value.job.source == "x"
        assert exc.value.job.assignment.request == later.request
        with pytest.raises(HandedBack):  # the job's own hand-back is in intake
            core.admit(of_epoch(first, epoch), 1.0, source="x")
        assert len(core) == 0
    core.joined_handback_confirmed(exc.value.job)
    with pytest.raises(InvalidInput):
        core.joined_handback_confirmed(exc.value.job)  # nothing unknown left
    with pytest.raises(HandedBack):
        core.admit(of_epoch(later, 2), 2.0, source="x")
    assert len(core) == 0


def test_a_joined_attempt_and_its_job_both_of_unknown_outcome_are_told_apart() -> None:
    """The job's hand-back and its joined attempt's are both of unknown outcome under one
    source: a re-sent assignment of each attempt names that attempt's hand-back (the job's
    is no longer ``joined``); confirming one leaves the other unknown."""
    core, first, later, job = drained_x()
    core.redirect_settled("x", unknown=True)
    core.joined_handback_unknown(attempt_job(job, later, "x"))
    with pytest.raises(HandBackUnknown) as mine:
        core.admit(of_epoch(later, 1), 1.0, source="x")
    assert mine.value.joined
    with pytest.raises(HandBackUnknown) as its:
        core.admit(of_epoch(first, 1), 1.0, source="x")
    assert not its.value.joined and its.value.job is job
    core.handback_confirmed("x")
    with pytest.raises(HandBackUnknown) as still:
        core.admit(of_epoch(later, 1), 1.0, source="x")
    assert still.value.joined
    with pytest.raises(HandedBack):
        core.admit(of_epoch(first, 1), 1.0, source="x")


def test_a_joined_attempt_of_unknown_outcome_comes_before_finished_here() -> None:
    """x's job and a later attempt of x (sharing its source, the usual case) were handed
    back: the job's is in intake, the attempt's of unknown outcome. Then x came back here
    (the job's hand-back, placed back) and finished. A re-sent assignment of the later
    attempt still raises HandBackUnknown naming it (``joined``): it must be settled by
    publishing its hand-back again, not admitted as done (position 0) -- intake may hold
    that hand-back, to be run and answered elsewhere. Every other re-send is admitted as done
    as before: the job's own, another arrival, one with no or another source. Before, the
    later attempt's too was admitted as done ("finished here" came first), and the adapter
    answered it from the kept answer besides its hand-back."""
    core, first, later, job = drained_x()
    core.redirect_settled("x", in_intake=True)
    core.joined_handback_unknown(attempt_job(job, later, "x"))
    core.adopt(record(2, Lifecycle.ACTIVE))
    back = handback_msg_id("x", "x", WID, 1)
    assert core.admit(of_epoch(first, 2), 1.0, source=back) == 0  # the job's hand-back
    started = core.start_next(1.0)
    assert started is not None and started.request_id == "x"
    core.finish("x")
    assert core.finished_arrival("x") == first.request.arrival_s
    for again in (False, True):
        with pytest.raises(HandBackUnknown) as exc:
            core.admit(of_epoch(later, 2), 2.0, source="x", again=again)
        assert exc.value.joined and exc.value.job.assignment.request == later.request
    assert len(core) == 0
    third = later_attempt(first, first.request.arrival_s + 1.0, epoch=2)
    for a, source in ((of_epoch(first, 2), "x"), (of_epoch(first, 2), back),
                      (of_epoch(later, 2), None), (of_epoch(later, 2), "x@other"),
                      (third, "x")):
        assert core.admit(a, 2.0, source=source) == 0  # as done, unchanged
    assert len(core) == 0
    core.joined_handback_confirmed(exc.value.job)


# -- the service ------------------------------------------------------------------------------


class StandInIntake:
    """Answers each publish on the intake subject: a joined attempt's hand-back (its id has
    :data:`JOINED_MARK`) with :attr:`joined` -- a JetStream API error, ``"drop"`` (no answer:
    the try times out) or None (a PubAck) -- any other with a PubAck. Records every
    ``Nats-Msg-Id``."""

    def __init__(self, joined: dict | str | None) -> None:
        self.joined = joined
        self.tries: list[str] = []

    async def answer(self, msg: Msg) -> None:
        mid = (msg.headers or {}).get("Nats-Msg-Id", "")
        self.tries.append(mid)
        error = self.joined if JOINED_MARK in mid else None
        if error == "drop":
            return
        body = {"error": error} if error is not None else {"stream": "INTAKE",
                                                            "seq": len(self.tries)}
        await msg.respond(json.dumps(body).encode())

    def joined_tries(self) -> list[str]:
        return [m for m in self.tries if JOINED_MARK in m]


class HeldFirst(SimBackend):
    """Prefills take ``predicted_s`` (0.01 s), but q-1's waits for :attr:`release` first."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def prefill(self, assignment: Assignment) -> PrefillResult:
        if assignment.request.request_id == "q-1":
            await self.release.wait()
        return await super().prefill(assignment)


@contextlib.asynccontextmanager
async def running_worker(url: str, prefix: str, *, redirect_timeout_s: float = 1.0,
                         backend: SimBackend | None = None) -> AsyncIterator[RankdService]:
    """A rankd whose prefills take 30 s (the first request runs for the whole test; the next
    ones stay queued for a drain to hand back) unless ``backend`` is given, stopped on the way
    out."""
    settings = RankdSettings(nats_url=url, subject_prefix=prefix, worker_id=WID,
                             heartbeat_s=0.2, drain_timeout_s=0.5,
                             redirect_timeout_s=redirect_timeout_s)
    if backend is None:
        backend = SimBackend(prefill_time=lambda r, p, c, kind="cp": 30.0)
    svc = RankdService(settings, backend)
    task = asyncio.create_task(svc.run(handle_signals=False))
    try:
        await asyncio.wait_for(svc.started.wait(), timeout=WAIT_S)
        yield svc
    finally:
        await stopped(svc, task, timeout_s=WAIT_S)


@pytest.fixture
async def worker(nats_server: EmbeddedNats, uniq: str) -> AsyncIterator[RankdService]:
    """:func:`running_worker` whose hand-backs give up after 1 s."""
    async with running_worker(nats_server.url, uniq) as svc:
        yield svc


async def put_record(nc: Client, s: Subjects, epoch: int, lifecycle: Lifecycle) -> None:
    epochs = await nc.jetstream().key_value(s.epoch_bucket())
    await epochs.put(s.epoch_key(), to_json(EpochRecord(
        epoch=epoch, committed_at_s=time.time(),
        workers=[EpochWorker(worker_id=WID, first_gpu=2, degree=2, lifecycle=lifecycle)])))


async def send(nc: Client, s: Subjects, a: Assignment, source: str) -> AssignmentAck:
    return await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S,
                      headers={INTAKE_MSG_HEADER: source})


async def refused(nc: Client, s: Subjects, a: Assignment, source: str) -> int:
    """The error code a re-sent assignment is answered (fails the test if it is admitted)."""
    try:
        ack = await send(nc, s, a, source)
    except RemoteError as exc:
        return exc.code
    pytest.fail(f"re-sent assignment of {a.request.request_id} (arrival "
                f"{a.request.arrival_s}, intake message {source}) admitted: {ack}")


async def x_with_a_joined_attempt(svc: RankdService, nc: Client, s: Subjects, *,
                                  later_source: str) -> tuple[Assignment, Assignment]:
    """q-1 runs; x is queued behind it and a later attempt of x (from ``later_source``) joins
    it. Returns (x's assignment, the later attempt's)."""
    await send(nc, s, plain_assignment("q-1", WID), "q-1")
    await until(lambda: svc.core.running is not None, "q-1 running")
    first = plain_assignment("q-x", WID)
    later = later_attempt(first, first.request.arrival_s + 0.5)
    await send(nc, s, first, "q-x")
    ack = await send(nc, s, later, later_source)
    assert ack.queue_position == 1 and len(svc.core) == 2  # joined x's job, not queued
    return first, later


async def drained(svc: RankdService, nc: Client, s: Subjects) -> None:
    """Epoch 1 drains the worker; return once its hand-backs are settled."""
    await put_record(nc, s, 1, Lifecycle.DRAINING)
    await until(lambda: svc.core.lifecycle is Lifecycle.DRAINING, "the drain adopted")
    await until(lambda: not svc.core.redirecting and not svc._redirects,
                "the hand-backs settled")


async def test_a_resent_joined_attempt_of_unknown_outcome_is_published_again(
    nats_server: EmbeddedNats, nc: Client, uniq: str, worker: RankdService
) -> None:
    """x's later attempt came from another intake message and joined x's job; a drain hands
    both back: intake acknowledges x's, and answers 503 to the later attempt's until the
    deadline (outcome unknown: no error answer). A scheduler re-sends the later attempt's
    assignment: its hand-back is published again under its own id, 425 while intake refuses,
    410 once it acknowledges -- and 410 still with the worker ACTIVE again; nothing runs
    twice, nobody is answered. Before, the re-send was refused 409 "not ACTIVE" (the
    scheduler places it afresh beside a hand-back intake may hold) and, with the worker
    ACTIVE again, admitted: a second prefill of an attempt whose hand-back runs elsewhere."""
    svc = worker
    s = Subjects(uniq)
    intake = StandInIntake(UNAVAILABLE)
    await nc.subscribe(s.intake_requests(), cb=intake.answer)
    results: list[FirstToken] = []

    async def answered(msg: Msg) -> None:
        results.append(decode(FirstToken, msg.data, msg.headers))

    await nc.subscribe(s.result("q-x"), cb=answered)
    first, later = await x_with_a_joined_attempt(svc, nc, s, later_source="q-x@other")
    await drained(svc, nc, s)
    mid = joined_handback_msg_id("q-x", "q-x@other", WID, 1, later.request.arrival_s)
    assert handback_msg_id("q-x", "q-x", WID, 1) in intake.tries
    assert intake.joined_tries() and set(intake.joined_tries()) == {mid}
    await until(lambda: not svc._joined_out, "the joined hand-back settled")
    tried = len(intake.tries)
    assert await refused(nc, s, of_epoch(later, 1), "q-x@other") == int(REDIRECTING_CODE)
    assert intake.tries[tried:] == [mid]
    intake.joined = None  # intake acknowledges from now on
    assert await refused(nc, s, of_epoch(later, 1), "q-x@other") == int(HANDED_BACK_CODE)
    assert intake.tries[tried + 1:] == [mid]
    await put_record(nc, s, 2, Lifecycle.ACTIVE)
    await until(lambda: svc.core.lifecycle is Lifecycle.ACTIVE, "ACTIVE again")
    for a, source in ((later, "q-x@other"), (first, "q-x")):
        assert await refused(nc, s, of_epoch(a, 2), source) == int(HANDED_BACK_CODE)
    assert intake.tries[tried + 2:] == []  # in intake: nothing published again
    assert svc.core.queued == () and svc.core.running is not None  # only q-1
    await svc.nc.flush()
    await nc.flush()
    assert results == []


async def test_a_joined_attempt_of_unknown_outcome_is_not_run_when_active_again(
    nats_server: EmbeddedNats, nc: Client, uniq: str, worker: RankdService
) -> None:
    """As above, but the worker is ACTIVE again before the scheduler re-sends the later
    attempt, and intake acknowledges the hand-back published again: 410, nothing queued.
    Before, the re-sent attempt was admitted and queued to run here a second time."""
    svc = worker
    s = Subjects(uniq)
    intake = StandInIntake(UNAVAILABLE)
    await nc.subscribe(s.intake_requests(), cb=intake.answer)
    _, later = await x_with_a_joined_attempt(svc, nc, s, later_source="q-x@other")
    await drained(svc, nc, s)
    await until(lambda: not svc._joined_out, "the joined hand-back settled")
    await put_record(nc, s, 2, Lifecycle.ACTIVE)
    await until(lambda: svc.core.lifecycle is Lifecycle.ACTIVE, "ACTIVE again")
    intake.joined = None
    assert await refused(nc, s, of_epoch(later, 2), "q-x@other") == int(HANDED_BACK_CODE)
    assert svc.core.queued == ()


async def test_a_joined_attempt_sharing_its_jobs_source_is_not_taken_as_in_intake(
    nats_server: EmbeddedNats, nc: Client, uniq: str, worker: RankdService
) -> None:
    """The usual case: both attempts' intake messages have the gateway's id (the later one
    stored anew after a store loss). x's hand-back is in intake, the later attempt's of
    unknown outcome. The later attempt's re-sent assignment publishes its own hand-back again
    (425 while intake refuses); x's is 410 without publishing anything. Before, the later
    attempt's was answered 410 as x's: the scheduler acked its message, and the attempt --
    maybe in intake, maybe not -- could be lost, its client never answered."""
    svc = worker
    s = Subjects(uniq)
    intake = StandInIntake(UNAVAILABLE)
    await nc.subscribe(s.intake_requests(), cb=intake.answer)
    first, later = await x_with_a_joined_attempt(svc, nc, s, later_source="q-x")
    await drained(svc, nc, s)
    await until(lambda: not svc._joined_out, "the joined hand-back settled")
    mid = joined_handback_msg_id("q-x", "q-x", WID, 1, later.request.arrival_s)
    tried = len(intake.tries)
    assert await refused(nc, s, of_epoch(later, 1), "q-x") == int(REDIRECTING_CODE)
    assert intake.tries[tried:] == [mid]
    assert await refused(nc, s, of_epoch(first, 1), "q-x") == int(HANDED_BACK_CODE)
    assert intake.tries[tried + 1:] == []
    intake.joined = None
    assert await refused(nc, s, of_epoch(later, 1), "q-x") == int(HANDED_BACK_CODE)
    assert intake.tries[tried + 1:] == [mid]


async def test_a_joined_attempt_whose_hand_back_is_under_way_is_redirecting(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """While the later attempt's hand-back waits for intake's acknowledgement (a lost ack:
    tried again until the deadline), its re-sent assignment is answered 425, as a job's being
    handed back is: the scheduler keeps its record and tries again. Once intake holds it:
    410. Before, it was refused 409 "not ACTIVE", and the scheduler placed it afresh beside
    the hand-back."""
    s = Subjects(uniq)
    intake = StandInIntake("drop")
    await nc.subscribe(s.intake_requests(), cb=intake.answer)
    async with running_worker(nats_server.url, uniq, redirect_timeout_s=8.0) as svc:
        _, later = await x_with_a_joined_attempt(svc, nc, s, later_source="q-x@other")
        await drained_until_joined_tried(svc, nc, s, intake)
        assert svc._joined_out  # unsettled: intake has not answered
        assert await refused(nc, s, of_epoch(later, 1), "q-x@other") == int(REDIRECTING_CODE)
        intake.joined = None  # the next try is acknowledged
        await until(lambda: not svc._joined_out, "the joined hand-back settled")
        assert await refused(nc, s, of_epoch(later, 1), "q-x@other") == int(HANDED_BACK_CODE)


async def drained_until_joined_tried(svc: RankdService, nc: Client, s: Subjects,
                                     intake: StandInIntake) -> None:
    """Epoch 1 drains the worker; return once the joined attempt's hand-back was tried."""
    await put_record(nc, s, 1, Lifecycle.DRAINING)
    await until(lambda: bool(intake.joined_tries()), "the joined hand-back tried")


async def test_a_joined_attempt_of_unknown_outcome_is_settled_after_its_request_finished_here(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """x's later attempt shares x's source and joined its job; a drain hands both back (x's
    in intake, the attempt's of unknown outcome). ACTIVE again, x's hand-back is placed back
    here and x finishes here (answered once, for x's arrival). A scheduler then re-sends the
    later attempt's assignment: its hand-back is published again (425 while intake refuses,
    410 once it acknowledges), and it is not answered here. The job's own re-send and another
    attempt's are answered from what this worker kept, as before. Before, the later attempt's
    re-send was answered from the kept answer (stamped for it) and acked as done: the attempt
    answered here, and again wherever the hand-back intake may hold runs."""
    s = Subjects(uniq)
    intake = StandInIntake(UNAVAILABLE)
    await nc.subscribe(s.intake_requests(), cb=intake.answer)
    results: list[FirstToken] = []

    async def answered(msg: Msg) -> None:
        results.append(decode(FirstToken, msg.data, msg.headers))

    await nc.subscribe(s.result("q-x"), cb=answered)
    backend = HeldFirst()
    async with running_worker(nats_server.url, uniq, backend=backend) as svc:
        first, later = await x_with_a_joined_attempt(svc, nc, s, later_source="q-x")
        await drained(svc, nc, s)
        await until(lambda: not svc._joined_out, "the joined hand-back settled")
        await put_record(nc, s, 2, Lifecycle.ACTIVE)
        await until(lambda: svc.core.lifecycle is Lifecycle.ACTIVE, "ACTIVE again")
        await send(nc, s, of_epoch(first, 2), handback_msg_id("q-x", "q-x", WID, 1))
        backend.release.set()
        await until(lambda: len(results) == 1, "x answered here")
        assert results[0].arrival_s == first.request.arrival_s
        mid = joined_handback_msg_id("q-x", "q-x", WID, 1, later.request.arrival_s)
        tried = len(intake.tries)
        assert await refused(nc, s, of_epoch(later, 2), "q-x") == int(REDIRECTING_CODE)
        assert intake.tries[tried:] == [mid]
        intake.joined = None
        assert await refused(nc, s, of_epoch(later, 2), "q-x") == int(HANDED_BACK_CODE)
        assert intake.tries[tried + 1:] == [mid]
        await svc.nc.flush()
        await nc.flush()
        assert [r.arrival_s for r in results] == [first.request.arrival_s]
        # Anything else as before: the job's own re-send is done (nothing sent), another
        # attempt gets the kept answer stamped for it.
        third = later_attempt(first, first.request.arrival_s + 1.0, epoch=2)
        for a in (of_epoch(first, 2), third):
            assert (await send(nc, s, a, "q-x")).queue_position == 0
        await until(lambda: len(results) == 2, "the third attempt answered")
        assert [r.arrival_s for r in results] == [first.request.arrival_s,
                                                  third.request.arrival_s]
        assert intake.tries[tried + 2:] == []
        assert svc.core.queued == () and svc.core.running is None
