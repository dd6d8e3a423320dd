"""A rank daemon's own hand-backs read whole in the request's trace (real nats-server, rankd
in-process on the sim backend, spans from the in-memory exporter).

Every intake message a worker hands back itself -- its queue on a drain, on a stop, its
running and queued requests on a worker fault, and a later attempt that joined one of them --
carries the hand-back's stamp (``Vtm-Handed-Back-At``, Unix seconds as the scheduler parses
it) and cause (``Vtm-Handback-Cause``: ``draining``, ``stopping``, ``worker_fault``), the
headers a scheduler replica puts on the hand-backs it publishes for a lost worker; and a
sampled request gets a ``handed_back`` span, a child of its root, from its acceptance on the
worker to that stamp (``vtm.request_id``, ``vtm.worker_id``, ``vtm.cause``), where the
scheduler starts the hand-back delivery's ``intake_wait``. Before, a worker's own hand-back
carried neither header (the scheduler fell back on the stream's stored stamp) and the time on
that worker was in no span. An unsampled request gets the headers and no span.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rankd_support import until
from service_support import until_started

from services.rankd.backend import PrefillResult, SimBackend
from services.rankd.core import (
    HANDBACK_AT_HEADER,
    HANDBACK_CAUSE_HEADER,
    HANDED_BACK_CODE,
    HANDED_BACK_SPAN,
    INTAKE_MSG_HEADER,
    REDIRECTING_CODE,
    handback_msg_id,
)
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.ids import WorkerFault
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
    AssignmentAck,
    EpochRecord,
    EpochWorker,
    IntakeRequest,
    decode,
    to_json,
)
from shared.service import RemoteError, call, ensure_intake_stream
from shared.subjects import Subjects
from shared.worker import Lifecycle

WID = "w-cp2-g2"
WAIT_S = 20.0  # hang guard only; nothing asserts on speed
ROOT_SPAN = "10f067aa0ba902b7"


def trace_of(n: int) -> str:
    return f"{n:032x}"


def assignment(rid: str, trace_id: str | None, *, sampled: bool = True,
               arrival: float | None = None) -> Assignment:
    """A request of 2 blocks for ``WID`` under epoch 0, its root ``trace_id`` (None: none)."""
    now = time.time()
    ctx = {} if trace_id is None else {
        "traceparent": f"00-{trace_id}-{ROOT_SPAN}-{'01' if sampled else '00'}"}
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=1024, block_hashes=[1, 2],
                              arrival_s=arrival if arrival is not None else now - 0.01,
                              trace_context=ctx),
        worker_id=WID, epoch=0, degree=2, prefix_tokens=512, recompute_tokens=512,
        predicted_s=0.01, dequeued_at_s=now - 0.005, assigned_at_s=now)


class Gated(SimBackend):
    """Prefills that wait for :attr:`release` (the first one holds the worker while the test
    acts), then raise :attr:`fault` if set, else run as the sim does."""

    def __init__(self) -> None:
        super().__init__(time_scale=1.0)
        self.running = asyncio.Event()
        self.release = asyncio.Event()
        self.fault: WorkerFault | None = None

    async def prefill(self, assignment: Assignment) -> PrefillResult:
        self.running.set()
        await self.release.wait()
        if self.fault is not None:
            raise self.fault
        return await super().prefill(assignment)


class Worker:
    """One rank daemon over an intake stream, its first request (``q-1``) running and held
    by the backend: what is assigned next stays queued."""

    def __init__(self, svc: RankdService, task: asyncio.Task[None], backend: Gated,
                 nc: Client, s: Subjects) -> None:
        self.svc, self.task, self.backend, self.nc, self.s = svc, task, backend, nc, s

    async def assign(self, a: Assignment, source: str) -> None:
        await call(self.nc, self.s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S,
                   headers={INTAKE_MSG_HEADER: source})

    def accepted(self, rid: str) -> float:
        """Where the job's ``handed_back`` span starts: its assignment's stamp (the end of
        the scheduler's ``schedule`` span), or its acceptance here should that be earlier."""
        job = self.svc.core.job(rid)
        assert job is not None
        return min(job.accepted_at_s, job.assignment.assigned_at_s)

    async def stop(self) -> None:
        self.backend.release.set()
        if not self.task.done():
            self.svc.request_stop()
        await asyncio.wait({self.task}, timeout=WAIT_S)


@contextlib.asynccontextmanager
async def busy_worker(url: str, nc: Client, uniq: str, *, stream: bool = True,
                      **settings: object) -> AsyncIterator[Worker]:
    """A :class:`Worker` (over a real intake stream unless ``stream`` is False), stopped on
    the way out."""
    s = Subjects(uniq)
    if stream:
        await ensure_intake_stream(nc.jetstream(), s)
    backend = Gated()
    svc = RankdService(RankdSettings(nats_url=url, subject_prefix=uniq, worker_id=WID,
                                     heartbeat_s=0.2, drain_timeout_s=0.5,
                                     **settings), backend)  # type: ignore[arg-type]
    task = asyncio.create_task(svc.run(handle_signals=False))
    await until_started(svc, task, timeout_s=WAIT_S)
    w = Worker(svc, task, backend, nc, s)
    try:
        await w.assign(assignment("q-1", trace_of(0x60)), "m-q-1")
        await asyncio.wait_for(backend.running.wait(), timeout=WAIT_S)
        yield w
    finally:
        await w.stop()


@pytest.fixture
async def worker(nats_server: EmbeddedNats, nc: Client, uniq: str) -> AsyncIterator[Worker]:
    async with busy_worker(nats_server.url, nc, uniq) as w:
        yield w


async def drain(nc: Client, s: Subjects) -> None:
    """Commit epoch 1, in which the worker drains."""
    epochs = await nc.jetstream().key_value(s.epoch_bucket())
    await epochs.put(s.epoch_key(), to_json(EpochRecord(
        epoch=1, committed_at_s=time.time(), workers=[
            EpochWorker(worker_id=WID, first_gpu=2, degree=2, lifecycle=Lifecycle.DRAINING)])))


async def intake(nc: Client, s: Subjects, n: int) -> list[Msg]:
    """The next ``n`` messages in intake (acked), in order."""
    consumer = await nc.jetstream().pull_subscribe(s.intake_requests(), durable="sched")
    got: list[Msg] = []
    async with asyncio.timeout(WAIT_S):
        while len(got) < n:
            for m in await consumer.fetch(n - len(got), timeout=WAIT_S):
                got.append(m)
                await m.ack()
    return got


def stamp(m: Msg) -> tuple[float, str]:
    """A hand-back's (stamp, cause) from its headers, parsed as the scheduler does."""
    h = m.headers or {}
    return float(h[HANDBACK_AT_HEADER]), h[HANDBACK_CAUSE_HEADER]


async def handed_back_spans(spans: InMemorySpanExporter, trace_id: str,
                            n: int = 1) -> list[ReadableSpan]:
    """The trace's ``handed_back`` spans, once ``n`` have ended."""
    def of_trace() -> list[ReadableSpan]:
        return [x for x in spans.get_finished_spans()
                if x.name == HANDED_BACK_SPAN and format(x.context.trace_id, "032x") == trace_id]
    await until(lambda: len(of_trace()) >= n, f"{n} handed_back span(s) of {trace_id}")
    return of_trace()


def check_span(span: ReadableSpan, rid: str, cause: str, accepted: float, at: float) -> None:
    """From the acceptance to the hand-back's stamp, a child of the request's root."""
    assert span.parent is not None and format(span.parent.span_id, "016x") == ROOT_SPAN
    assert (span.start_time, span.end_time) == (int(accepted * 1e9), int(at * 1e9))
    assert {k: span.attributes[k] for k in ("vtm.request_id", "vtm.worker_id", "vtm.cause")} \
        == {"vtm.request_id": rid, "vtm.worker_id": WID, "vtm.cause": cause}


async def test_a_drain_hands_queued_requests_back_stamped_and_traced(
        worker: Worker, spans: InMemorySpanExporter) -> None:
    """x (sampled), a later attempt of x that joined it (its own trace) and u (unsampled)
    wait behind q-1; a drain hands the three back: each message carries the stamp and the
    cause, and x and its later attempt each get one ``handed_back`` span up to that stamp."""
    tx, tl, tu = trace_of(0x61), trace_of(0x62), trace_of(0x63)
    x = assignment("q-x", tx)
    later = assignment("q-x", tl, arrival=x.request.arrival_s + 0.5)
    await worker.assign(x, "m-x")
    await worker.assign(later, "m-x-again")
    await worker.assign(assignment("q-u", tu, sampled=False), "m-u")
    accepted_x = worker.accepted("q-x")
    accepted_later = worker.svc._attempts["q-x"][later.request.arrival_s][2]
    sent = time.time()
    await drain(worker.nc, worker.s)
    got = await intake(worker.nc, worker.s, 3)
    by_id = {(m.headers or {})["Nats-Msg-Id"]: m for m in got}
    assert set(by_id) >= {handback_msg_id("q-x", "m-x", WID, 1),
                          handback_msg_id("q-u", "m-u", WID, 1)}
    stamps = {(r.request_id, r.arrival_s): stamp(m)
              for r, m in ((decode(IntakeRequest, m.data, m.headers), m) for m in got)}
    at_x, cause_x = stamps["q-x", x.request.arrival_s]
    at_later, cause_later = stamps["q-x", later.request.arrival_s]
    ((at_u, cause_u),) = [v for (rid, _), v in stamps.items() if rid == "q-u"]
    assert cause_x == cause_later == cause_u == "draining"
    # Stamped once the drain came, after each was accepted.
    assert accepted_x <= sent <= at_x and accepted_later <= sent <= at_later and sent <= at_u
    (span_x,) = await handed_back_spans(spans, tx)
    check_span(span_x, "q-x", "draining", accepted_x, at_x)
    (span_later,) = await handed_back_spans(spans, tl)
    check_span(span_later, "q-x", "draining", accepted_later, at_later)
    assert span_later.attributes["vtm.joined"] is True
    # The unsampled request: the headers, no span (nor any other of its trace).
    assert not [x for x in spans.get_finished_spans()
                if format(x.context.trace_id, "032x") == tu]


async def test_a_stop_hands_queued_requests_back_stamped_and_traced(
        worker: Worker, spans: InMemorySpanExporter) -> None:
    tx = trace_of(0x64)
    await worker.assign(assignment("q-x", tx), "m-x")
    accepted = worker.accepted("q-x")
    worker.svc.request_stop()  # q-1 still runs: its drain times out, it is failed
    await asyncio.wait({worker.task}, timeout=WAIT_S)
    (m,) = await intake(worker.nc, worker.s, 1)
    assert (m.headers or {})["Nats-Msg-Id"] == handback_msg_id("q-x", "m-x", WID, 0)
    at, cause = stamp(m)
    assert cause == "stopping" and accepted <= at
    (span,) = await handed_back_spans(spans, tx)
    check_span(span, "q-x", "stopping", accepted, at)


async def test_a_worker_fault_hands_back_the_running_and_queued_requests_stamped_and_traced(
        worker: Worker, spans: InMemorySpanExporter) -> None:
    tx = trace_of(0x65)
    await worker.assign(assignment("q-x", tx), "m-x")
    accepted = {rid: worker.accepted(rid) for rid in ("q-1", "q-x")}
    worker.backend.fault = WorkerFault("rank 1 died (on purpose)")
    worker.backend.release.set()  # q-1 meets the fault
    got = await intake(worker.nc, worker.s, 2)
    await asyncio.wait({worker.task}, timeout=WAIT_S)
    assert isinstance(worker.task.exception(), WorkerFault)  # the service ends with it
    stamps = {decode(IntakeRequest, m.data, m.headers).request_id: stamp(m) for m in got}
    assert {rid: cause for rid, (_, cause) in stamps.items()} \
        == {"q-1": "worker_fault", "q-x": "worker_fault"}
    for rid, trace_id in (("q-1", trace_of(0x60)), ("q-x", tx)):
        (span,) = await handed_back_spans(spans, trace_id)
        check_span(span, rid, "worker_fault", accepted[rid], stamps[rid][0])


class StandInIntake:
    """Answers each publish on the intake subject as the stream would: 503 "temporarily
    unavailable" while :attr:`refusing` (intake may or may not have stored it), else a
    PubAck. Keeps every try's headers."""

    def __init__(self) -> None:
        self.refusing = True
        self.tries: list[dict[str, str]] = []

    async def answer(self, msg: Msg) -> None:
        self.tries.append(dict(msg.headers or {}))
        body = {"error": {"code": 503, "err_code": 10008,
                          "description": "JetStream system temporarily unavailable"}} \
            if self.refusing else {"stream": "INTAKE", "seq": len(self.tries)}
        await msg.respond(json.dumps(body).encode())


async def test_a_hand_back_of_unknown_outcome_published_again_keeps_its_stamp(
        nats_server: EmbeddedNats, nc: Client, uniq: str,
        spans: InMemorySpanExporter) -> None:
    """x's hand-back meets 503s until its deadline (outcome unknown: intake may hold it);
    a re-sent assignment of x publishes it again until intake acknowledges it (425, then
    410). Every try carries the same stamp and cause -- one hand-back, whichever try intake
    stored -- and x gets one ``handed_back`` span, recorded by the re-send that settled it."""
    tx = trace_of(0x66)
    intake = StandInIntake()
    await nc.subscribe(Subjects(uniq).intake_requests(), cb=intake.answer)
    async with busy_worker(nats_server.url, nc, uniq, stream=False,
                           redirect_timeout_s=1.0) as worker:
        x = assignment("q-x", tx)
        await worker.assign(x, "m-x")
        accepted = worker.accepted("q-x")
        await drain(worker.nc, worker.s)
        await until(lambda: worker.svc.core.lifecycle is Lifecycle.DRAINING
                    and not worker.svc.core.redirecting and not worker.svc._redirects,
                    "x's hand-back given up, its outcome unknown")
        assert intake.tries
        again = x.model_copy(update={"epoch": 1})
        codes = []
        for refusing in (True, False):
            intake.refusing = refusing
            with pytest.raises(RemoteError) as err:
                await worker.assign(again, "m-x")
            codes.append(err.value.code)
        assert codes == [int(REDIRECTING_CODE), int(HANDED_BACK_CODE)]
    assert {t["Nats-Msg-Id"] for t in intake.tries} == {handback_msg_id("q-x", "m-x", WID, 1)}
    ((at, cause),) = {(float(t[HANDBACK_AT_HEADER]), t[HANDBACK_CAUSE_HEADER])
                      for t in intake.tries}
    assert cause == "draining" and accepted <= at
    (span,) = await handed_back_spans(spans, tx)
    check_span(span, "q-x", "draining", accepted, at)
