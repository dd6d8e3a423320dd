"""rankd with the sim backend on a real server: FIFO execution, results, state, epochs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import nats.errors
import pytest
import structlog.testing
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from service_support import service_running, until_started

from services.rankd.backend import ExecutionBackend, PrefillResult, SimBackend, fake_token
from services.rankd.core import (
    HANDED_BACK_CODE,
    INTAKE_MSG_HEADER,
    REDIRECTING_CODE,
    Job,
    handback_msg_id,
)
from services.rankd.service import JoinedAnswer, RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
    AssignmentAck,
    CacheCommandResult,
    CacheEvent,
    CacheSnapshot,
    CacheStored,
    DemoteCommand,
    EpochAck,
    EpochRecord,
    EpochWorker,
    FirstToken,
    IntakeRequest,
    QueueQuery,
    QueueReport,
    ReclaimCommand,
    ReplicateCommand,
    WorkerState,
    decode,
    from_json,
    to_json,
)
from shared.service import (
    PART_HEADER,
    RemoteError,
    call,
    ensure_intake_stream,
    epoch_kv,
    request_in_parts,
    worker_state_kv,
)
from shared.subjects import Subjects
from shared.telemetry import tracer
from shared.worker import Lifecycle

WID = "w-cp2-g2"
ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 20.0  # bound for correctness waits only; nothing asserts on speed


def assignment(
    rid: str,
    *,
    epoch: int = 0,
    predicted: float = 0.2,
    worker: str = WID,
    degree: int = 2,
    arrival: float | None = None,
) -> Assignment:
    now = time.time()
    return Assignment(
        request=IntakeRequest(
            request_id=rid,
            input_len=1024,
            block_hashes=[1, 2],
            arrival_s=arrival if arrival is not None else now - 0.01,
        ),
        worker_id=worker,
        epoch=epoch,
        degree=degree,
        prefix_tokens=512,
        recompute_tokens=512,
        predicted_s=predicted,
        dequeued_at_s=now - 0.005,
        assigned_at_s=now,
    )


def reattempt(a: Assignment, arrival: float, **update: object) -> Assignment:
    """A later attempt of ``a``'s request (the same id): arrival ``arrival``, the request's
    other fields as in ``a`` unless ``update`` changes them (other content)."""
    return a.model_copy(update={"request": a.request.model_copy(
        update={"arrival_s": arrival, **update})})


class Gate:
    """A sim time function that blocks nothing but records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, str]] = []

    def __call__(self, r: int, p: int, degree: int, *, kind: str = "cp") -> float:
        self.calls.append((r, p, degree, kind))
        return 0.05


def rankd_service(
    url: str, prefix: str, backend: ExecutionBackend, *,
    cls: type[RankdService] = RankdService, **kw: object
) -> RankdService:
    """A rank daemon of worker ``WID`` (not started)."""
    settings = RankdSettings(
        nats_url=url, subject_prefix=prefix, worker_id=WID, heartbeat_s=0.2, **kw
    )  # type: ignore[arg-type]
    return cls(settings, backend)


async def start_rankd(
    url: str, prefix: str, backend: ExecutionBackend, *,
    cls: type[RankdService] = RankdService, **kw: object
) -> tuple[RankdService, asyncio.Task[None]]:
    """:func:`rankd_service`, started; the caller stops it (a test whose stop is part of
    what it checks). Otherwise :func:`running_rankd`."""
    svc = rankd_service(url, prefix, backend, cls=cls, **kw)
    task = asyncio.create_task(svc.run(handle_signals=False))
    await until_started(svc, task, timeout_s=WAIT_S)
    return svc, task


@contextlib.asynccontextmanager
async def running_rankd(url: str, prefix: str, backend: ExecutionBackend, *,
                        cls: type[RankdService] = RankdService,
                        **kw: object) -> AsyncIterator[RankdService]:
    """:func:`rankd_service`, running for the body (:func:`service_support.service_running`)."""
    svc = rankd_service(url, prefix, backend, cls=cls, **kw)
    async with service_running(svc, timeout_s=WAIT_S):
        yield svc


async def drain_worker(nc: Client, s: Subjects, epoch: int = 1,
                       lifecycle: Lifecycle = Lifecycle.DRAINING) -> None:
    """Commit an epoch record (``epoch``) in which the worker drains (or is ``lifecycle``)."""
    epochs = await nc.jetstream().key_value(s.epoch_bucket())
    await epochs.put(s.epoch_key(), to_json(EpochRecord(
        epoch=epoch, committed_at_s=time.time(), workers=[
            EpochWorker(worker_id=WID, first_gpu=2, degree=2, lifecycle=lifecycle)])))


async def all_sent(svc: RankdService, nc: Client) -> None:
    """Wait until every answer ``svc`` sends has gone out and reached ``nc``'s client."""
    async with asyncio.timeout(WAIT_S):
        while svc._handoffs or svc._redirects:
            await asyncio.sleep(0.01)
    await svc.nc.flush()
    await nc.flush()


@pytest.fixture
async def rankd(nats_server: EmbeddedNats, uniq: str) -> AsyncIterator[tuple[RankdService, Gate]]:
    gate = Gate()
    async with running_rankd(
        nats_server.url, uniq, SimBackend(prefill_time=gate, time_scale=1.0)
    ) as svc:
        yield svc, gate


async def collect(nc: Client, subject: str, n: int, model: object) -> list:
    got: list = []
    done = asyncio.Event()

    async def cb(msg: Msg) -> None:
        got.append(decode(model, msg.data, msg.headers))
        if len(got) >= n:
            done.set()

    sub = await nc.subscribe(subject, cb=cb)
    return [sub, got, done]


async def test_fifo_results_state_and_spans(
    rankd: tuple[RankdService, Gate], nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    svc, gate = rankd
    s = Subjects(uniq)
    sub, results, done = await collect(nc, s.result_all(), 3, FirstToken)
    ev_sub, events, got_event = await collect(nc, s.cache_events(WID), 1, CacheEvent)
    acks = []
    arrived = time.time()
    with tracer().start_as_current_span("schedule") as sched:
        for rid in ("r-a", "r-b", "r-c"):
            acks.append(
                await call(nc, s.worker_assign(WID), assignment(rid, arrival=arrived),
                           AssignmentAck, timeout_s=WAIT_S)
            )
    assert [a.queue_position for a in acks] == [0, 1, 2]
    await asyncio.wait_for(done.wait(), timeout=WAIT_S)
    await sub.unsubscribe()

    assert [r.request_id for r in results] == ["r-a", "r-b", "r-c"]  # FIFO
    # The scheduler claimed P = 512 each time; the worker's own cache decides: a miss first,
    # then both full blocks hit (P = L - 1: the last token is always recomputed).
    assert gate.calls == [(1024, 0, 2, "cp"), (1, 1023, 2, "cp"), (1, 1023, 2, "cp")]
    assert [r.prefix_tokens for r in results] == [0, 1023, 1023]
    await asyncio.wait_for(got_event.wait(), timeout=WAIT_S)
    await ev_sub.unsubscribe()
    assert events[0] == CacheStored(worker=WID, event_id=1, parent_hash=None, block_hashes=[1, 2])
    for r in results:
        assert r.token == fake_token(r.request_id) and r.worker_id == WID
        assert r.arrival_s == arrived  # the answered attempt's stamp, echoed
        st = r.stages
        assert st.prefill_s > 0 and st.total_s >= st.prefill_s
        assert st.intake_wait_s >= 0 and st.schedule_s >= 0
    # later requests waited behind earlier ones (ordering, not speed)
    assert results[2].stages.queue_wait_s >= results[1].stages.prefill_s

    kv = await nc.jetstream().key_value(s.worker_state_bucket())
    state = None
    for _ in range(200):
        state = from_json(WorkerState, (await kv.get(WID)).value)
        if state.served == 3 and state.queue_len == 0:
            break
        await asyncio.sleep(0.05)
    assert state is not None and state.served == 3 and state.queue_len == 0
    assert (state.hit_tokens, state.input_tokens, state.gpus) == (2046, 3072, [2, 3])
    assert state.lifecycle is Lifecycle.ACTIVE

    prefills = [x for x in spans.get_finished_spans() if x.name == "prefill"]
    assert len(prefills) == 3
    assert all(p.context.trace_id == sched.get_span_context().trace_id for p in prefills)
    assert prefills[0].attributes["vtm.predicted_s"] == 0.2
    assert any(x.name == "queue_wait" for x in spans.get_finished_spans())


async def test_stage_spans_are_children_of_the_requests_root(
    rankd: tuple[RankdService, Gate], nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    """conventions.md: one root per request, one child per TTFT stage. The assignment carries
    the root's context (``request.trace_context``, as the gateway and scheduler send it):
    every stage span the worker records is the root's child, not the child of its ``assign``
    server span (which is the dispatch's, under the caller's ``schedule`` span); the per-rank
    spans stay under ``prefill``. Without a context in the request they hang under the
    assign span, as before (test_fifo_results_state_and_spans)."""
    s = Subjects(uniq)
    root_trace, root_span = "6bf92f3577b34da6a3ce929d0e0e4736", "10f067aa0ba902b7"
    base = assignment("root-1")
    a = base.model_copy(update={"request": base.request.model_copy(update={
        "trace_context": {"traceparent": f"00-{root_trace}-{root_span}-01"}})})
    sub, results, done = await collect(nc, s.result(a.request.request_id), 1, FirstToken)
    with tracer().start_as_current_span("schedule") as sched:  # another trace: the headers'
        await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S)
    await asyncio.wait_for(done.wait(), timeout=WAIT_S)
    await sub.unsubscribe()
    assert results[0].error is None
    stages = {"queue_wait", "prefill", "kv_transfer", "first_decode"}
    await wait_for_spans(spans, stages)
    finished = spans.get_finished_spans()
    by_name = {x.name: x for x in finished
               if format(x.context.trace_id, "032x") == root_trace}
    assert stages <= set(by_name), sorted(by_name)
    for name in stages:
        assert by_name[name].parent is not None
        assert format(by_name[name].parent.span_id, "016x") == root_span, name
    ranks = [x for x in finished if x.name == "prefill_rank"
             and format(x.context.trace_id, "032x") == root_trace]
    assert len(ranks) == 2  # degree 2
    assert {x.parent.span_id for x in ranks} == {by_name["prefill"].context.span_id}
    (server,) = [x for x in finished if x.name.endswith(".assign")]
    assert server.parent is not None
    assert server.parent.span_id == sched.get_span_context().span_id


async def wait_for_spans(spans: InMemorySpanExporter, names: set[str]) -> None:
    """Until spans of every name in ``names`` have ended (bounded by WAIT_S)."""
    async with asyncio.timeout(WAIT_S):
        while not names <= {x.name for x in spans.get_finished_spans()}:
            await asyncio.sleep(0.01)


async def test_unsampled_request_is_served_without_spans_and_keeps_the_decision(
    rankd: tuple[RankdService, Gate], nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    """An assignment whose trace context is *not sampled* (the usual case at a 1% ratio) is
    served like any other — FIFO result, stage breakdown, cache event in the wire schema —
    while no span of its trace is recorded; one with a sampled context is traced. The
    worker keeps the caller's decision (it does not start a root of its own)."""
    svc, gate = rankd
    s = Subjects(uniq)
    trace_hex, parent = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    sampled_trace = "5bf92f3577b34da6a3ce929d0e0e4736"
    sub, results, done = await collect(nc, s.result_all(), 2, FirstToken)
    ev_sub, events, got_event = await collect(nc, s.cache_events(WID), 1, CacheEvent)
    await call(nc, s.worker_assign(WID), assignment("u-1"), AssignmentAck, timeout_s=WAIT_S,
               headers={"traceparent": f"00-{trace_hex}-{parent}-00"})
    await call(nc, s.worker_assign(WID), assignment("s-1"), AssignmentAck, timeout_s=WAIT_S,
               headers={"traceparent": f"00-{sampled_trace}-{parent}-01"})
    await asyncio.wait_for(done.wait(), timeout=WAIT_S)
    await asyncio.wait_for(got_event.wait(), timeout=WAIT_S)
    await sub.unsubscribe()
    await ev_sub.unsubscribe()
    assert [r.request_id for r in results] == ["u-1", "s-1"]
    assert results[0].error is None and results[0].stages.prefill_s > 0
    assert isinstance(events[0], CacheStored) and events[0].worker == WID
    finished = spans.get_finished_spans()
    # Nothing of the unsampled request, not even a root of the worker's own.
    assert {format(x.context.trace_id, "032x") for x in finished} == {sampled_trace}
    traced = {x.name for x in finished if format(x.context.trace_id, "032x") == sampled_trace}
    assert {"prefill", "queue_wait", "kv_transfer", "first_decode"} <= traced


async def test_bad_assignments_get_micro_errors(
    rankd: tuple[RankdService, Gate], nc: Client, uniq: str
) -> None:
    s = Subjects(uniq)
    for body, code in (
        (b'{"worker_id": 1}', 400),
        (b"\x00", 400),
        (assignment("x", worker="w-cp2-g0"), 404),
        (assignment("x", epoch=9), 409),
    ):
        with pytest.raises(RemoteError) as err:
            await call(nc, s.worker_assign(WID), body, AssignmentAck, timeout_s=WAIT_S)
        assert err.value.code == code
    ack = await call(nc, s.worker_assign(WID), assignment("ok"), AssignmentAck, timeout_s=WAIT_S)
    assert ack.request_id == "ok"  # still serving


async def test_queue_endpoint_lists_running_and_queued_requests(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """``{prefix}.worker.queue.{wid}``: what executes now and the FIFO in order (the
    controller's step 1); a query for another worker is a 404, a malformed one a 400."""
    first = asyncio.Event()

    def slow_first(r: int, p: int, degree: int, *, kind: str = "cp") -> float:
        if first.is_set():
            return 0.05
        first.set()
        return 30.0  # holds the worker for the whole test; the stop does not wait for it

    s = Subjects(uniq)
    async with running_rankd(nats_server.url, uniq,
                             SimBackend(prefill_time=slow_first, time_scale=1.0),
                             drain_timeout_s=0.5):
        sent = [assignment(rid) for rid in ("q-a", "q-b", "q-c")]
        for a in sent:
            await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S)
        await asyncio.wait_for(first.wait(), timeout=WAIT_S)
        # A later attempt of q-b (the same content) joins q-b's job: both attempts held.
        later = reattempt(sent[1], sent[1].request.arrival_s + 0.5)
        await call(nc, s.worker_assign(WID), later, AssignmentAck, timeout_s=WAIT_S)
        rep = await call(nc, s.worker_queue(WID), QueueQuery(worker_id=WID), QueueReport,
                         timeout_s=WAIT_S)
        assert (rep.worker_id, rep.in_flight, rep.queued) == (WID, ["q-a"], ["q-b", "q-c"])
        # The attempts of each listed request it holds, by arrival stamp.
        assert rep.arrivals == [[sent[0].request.arrival_s],
                                [sent[1].request.arrival_s, later.request.arrival_s],
                                [sent[2].request.arrival_s]]
        for body, code in ((QueueQuery(worker_id="w-cp2-g0"), 404), (b"\x00", 400),
                           (b'{"worker_id": "Bad Id"}', 400)):
            with pytest.raises(RemoteError) as err:
                await call(nc, s.worker_queue(WID), body, QueueReport, timeout_s=WAIT_S)
            assert err.value.code == code
        again = await call(nc, s.worker_queue(WID), QueueQuery(worker_id=WID), QueueReport,
                           timeout_s=WAIT_S)
        assert again == rep  # still serving, nothing changed


class SlowToServe(RankdService):
    """A rank daemon whose endpoints come up half a second after its setup (a loaded
    machine): what it announces in between must not send anyone to endpoints not there."""

    async def setup(self, stack: contextlib.AsyncExitStack) -> None:
        await super().setup(stack)
        await asyncio.sleep(0.5)


async def test_a_new_worker_acks_and_announces_itself_only_once_it_answers(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """A worker a split or merge made: its EpochAck (the controller's go-ahead) and its
    first WorkerState (the scheduler's and the cache manager's cue to assign to it and ask
    for its snapshot) go out once its endpoints exist. Before, both went out during the
    setup, and a request sent on either met "no responders"."""
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    epochs = await epoch_kv(js, s)
    await worker_state_kv(js, s)
    await epochs.put(s.epoch_key(), to_json(EpochRecord(
        epoch=1, committed_at_s=time.time(),
        workers=[EpochWorker(worker_id=WID, first_gpu=2, degree=2, lifecycle=Lifecycle.ACTIVE)])))
    asked: list[asyncio.Task[str]] = []

    async def ask() -> str:
        try:
            await call(nc, s.worker_queue(WID), QueueQuery(worker_id=WID), QueueReport,
                       timeout_s=WAIT_S)
            return "answered"
        except nats.errors.NoRespondersError:
            return "no responders"

    async def on_announce(msg: Msg) -> None:
        asked.append(asyncio.create_task(ask()))

    await nc.subscribe(s.epoch_ack_all(), cb=on_announce)
    await nc.subscribe(f"$KV.{s.worker_state_bucket()}.{WID}", cb=on_announce)
    await nc.flush()
    async with running_rankd(nats_server.url, uniq, SimBackend(), cls=SlowToServe):
        async with asyncio.timeout(WAIT_S):
            while len(asked) < 3:  # two acks (GPUs 2 and 3) and the first state at least
                await asyncio.sleep(0.01)
        # (The final, UNAVAILABLE state of the stop follows the endpoints' end: not counted.)
        outcomes = await asyncio.gather(*asked)
    assert set(outcomes) == {"answered"}, outcomes


async def test_epoch_adoption_acks_drain_and_redirect(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    # Slow prefills (modelled 30 s) so queued requests are still queued when the drain lands.
    svc, task = await start_rankd(
        nats_server.url,
        uniq,
        SimBackend(prefill_time=lambda r, p, c, kind="cp": 30.0),
        drain_timeout_s=0.5,
    )
    sub, acks, acked = await collect(nc, s.epoch_ack_all(), 2, EpochAck)
    epochs = await js.key_value(s.epoch_bucket())

    def rec(epoch: int, lifecycle: Lifecycle) -> bytes:
        return to_json(
            EpochRecord(
                epoch=epoch,
                committed_at_s=time.time(),
                workers=[EpochWorker(worker_id=WID, first_gpu=2, degree=2, lifecycle=lifecycle)],
            )
        )

    await epochs.put(s.epoch_key(), rec(1, Lifecycle.ACTIVE))
    await asyncio.wait_for(acked.wait(), timeout=WAIT_S)
    assert sorted((a.gpu, a.epoch, a.worker_id) for a in acks) == [(2, 1, WID), (3, 1, WID)]
    await sub.unsubscribe()

    arrived = time.time()
    for rid in ("q-1", "q-2", "q-3"):
        await call(nc, s.worker_assign(WID), assignment(rid, epoch=1, arrival=arrived),
                   AssignmentAck, timeout_s=WAIT_S)
    consumer = await js.pull_subscribe(s.intake_requests(), durable="sched")
    await epochs.put(s.epoch_key(), rec(2, Lifecycle.DRAINING))
    redirected = []
    while len(redirected) < 2:
        for m in await consumer.fetch(2, timeout=WAIT_S):
            redirected.append(decode(IntakeRequest, m.data, m.headers).request_id)
            await m.ack()
    assert redirected == ["q-2", "q-3"]  # q-1 is running and finishes in place
    with pytest.raises(RemoteError) as err:
        await call(
            nc, s.worker_assign(WID), assignment("late", epoch=2), AssignmentAck, timeout_s=WAIT_S
        )
    assert err.value.code == 409
    ping = json.loads(
        (await nc.request(f"$SRV.PING.vtm-rankd.{svc.service.id}", b"", timeout=WAIT_S)).data
    )
    assert (ping["metadata"]["lifecycle"], ping["metadata"]["epoch"]) == ("draining", "2")

    # Shutdown with q-1 still in prefill: bounded drain, then q-1 fails explicitly.
    res_sub, failures, failed = await collect(nc, s.result("q-1"), 1, FirstToken)
    svc.request_stop()
    await asyncio.wait_for(task, timeout=WAIT_S)
    await asyncio.wait_for(failed.wait(), timeout=WAIT_S)
    assert failures[0].token is None and "stopped" in failures[0].error
    assert failures[0].arrival_s == arrived  # which attempt it answers
    state = from_json(
        WorkerState, (await (await js.key_value(s.worker_state_bucket())).get(WID)).value
    )
    assert state.lifecycle is Lifecycle.UNAVAILABLE and state.epoch == 2
    await res_sub.unsubscribe()


async def test_redirect_that_cannot_reach_intake_is_answered_not_lost(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """No intake stream: each handed-back request gets exactly one error FirstToken (never a
    silent loss), and the worker keeps counting it until then (its state never shows an empty
    queue with requests unaccounted for)."""
    s = Subjects(uniq)
    async with running_rankd(
        nats_server.url, uniq, SimBackend(prefill_time=lambda r, p, c, kind="cp": 30.0),
        # A short retry bound keeps the failed redirects' answers well inside WAIT_S on a
        # loaded machine (the default 10 s plus attempts came close to it).
        drain_timeout_s=0.5, redirect_timeout_s=2.0,
    ) as svc:
        sub, results, done = await collect(nc, s.result_all(), 2, FirstToken)
        for rid in ("q-1", "q-2", "q-3"):
            await call(nc, s.worker_assign(WID), assignment(rid), AssignmentAck, timeout_s=WAIT_S)
        assert len(svc.core) == 3
        await drain_worker(nc, s)
        await asyncio.wait_for(done.wait(), timeout=WAIT_S)
        assert sorted(r.request_id for r in results) == ["q-2", "q-3"]  # q-1 runs in place
        assert all(r.token is None and "redirect failed" in (r.error or "") for r in results)
        assert svc.core.redirecting == () and len(svc.core) == 1
        # Settled: no redirect task is left to answer anything, and what the worker published
        # has reached this client -- nothing else arrived for them.
        async with asyncio.timeout(WAIT_S):
            while svc._redirects:
                await asyncio.sleep(0.01)
        await svc.nc.flush()
        await nc.flush()
        assert len(results) == 2
        await sub.unsubscribe()


async def test_main_process_stops_on_sigterm(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    env = {
        **os.environ,
        "VTM_NATS_URL": nats_server.url,
        "VTM_SUBJECT_PREFIX": uniq,
        "VTM_WORKER_ID": "w-cp1-g5",
        "VTM_LOG__FORMAT": "json",
        "VTM_HEARTBEAT_S": "0.2",
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.rankd.main"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        s = Subjects(uniq)
        info = None
        for _ in range(400):  # wait (bounded) until the service answers discovery
            try:
                replies = json.loads(
                    (await nc.request("$SRV.INFO.vtm-rankd", b"", timeout=0.5)).data
                )
                if replies["metadata"].get("prefix") == uniq:
                    info = replies
                    break
            except Exception:
                await asyncio.sleep(0.05)
        assert info is not None, proc.stderr.read1().decode() if proc.stderr else ""
        assert info["endpoints"][0]["subject"] == s.worker_assign("w-cp1-g5")
        ack = await call(
            nc,
            s.worker_assign("w-cp1-g5"),
            assignment("p-1", worker="w-cp1-g5", degree=1),
            AssignmentAck,
            timeout_s=WAIT_S,
        )
        assert ack.queue_position == 0
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, WAIT_S)
        assert rc == 0
        _, err = proc.communicate()
        lines = [json.loads(x) for x in err.decode().splitlines() if x.startswith("{")]
        assert any(x.get("event") == "service stopping" for x in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()



def _console_spans(stdout: str) -> list[dict]:
    """The spans an OpenTelemetry ConsoleSpanExporter printed: indented JSON objects, each
    starting at column 0 (other output is skipped)."""
    decoder = json.JSONDecoder()
    spans, offset = [], 0
    for line in stdout.splitlines(keepends=True):
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                obj, _ = decoder.raw_decode(stdout, offset)
                if isinstance(obj, dict) and "context" in obj and "attributes" in obj:
                    spans.append(obj)
        offset += len(line)
    return spans


async def test_vertumnus_rankd_sleeps_for_the_ground_truth_by_default(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """A standalone ``vertumnus rankd`` on the sim backend (no flag, no VTM_TRUTH) is timed by
    the simulator's ground truth — prefill (noisy, seed 0), KV handoff and first decode — not
    by the scheduler's prediction. Checked on the modelled values the process records (its
    spans) and on the stages it reports, which for the handoff are the modelled times × the
    time scale; nothing here bounds a wall-clock duration from above."""
    from sim.groundtruth import DEFAULT_GROUND_TRUTH, NoisyGroundTruth

    # A tiny prediction: a worker that slept for it (0.01 × scale) would fall far short of the
    # ground truth's lower bounds below, so the bounds tell the two apart.
    scale, wid, length, predicted = 0.01, "w-cp2-g4", 16_384, 0.01
    env = {k: v for k, v in os.environ.items() if not k.startswith("VTM_")}
    env.update({
        "VTM_NATS_URL": nats_server.url,
        "VTM_SUBJECT_PREFIX": uniq,
        "VTM_WORKER_ID": wid,
        "VTM_LOG__FORMAT": "json",
        "VTM_HEARTBEAT_S": "0.2",
        "VTM_TIME_SCALE": str(scale),
        "VTM_TELEMETRY__EXPORTER": "console",  # spans on stdout, flushed at exit
    })
    proc = subprocess.Popen([sys.executable, "-m", "vertumnus", "rankd"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        s = Subjects(uniq)
        ready = False
        for _ in range(400):  # wait (bounded) until the service answers discovery
            try:
                info = json.loads((await nc.request("$SRV.INFO.vtm-rankd", b"",
                                                    timeout=0.5)).data)
                if info["metadata"].get("prefix") == uniq:
                    ready = True
                    break
            except Exception:
                await asyncio.sleep(0.05)
        assert ready, proc.stderr.read1().decode() if proc.stderr else ""
        sub, results, done = await collect(nc, s.result_all(), 1, FirstToken)
        now = time.time()
        a = Assignment(
            request=IntakeRequest(request_id="gt-1", input_len=length, arrival_s=now - 0.01,
                                  block_hashes=list(range(1, length // 512 + 1))),
            worker_id=wid, epoch=0, degree=2, prefix_tokens=0, recompute_tokens=length,
            predicted_s=predicted, dequeued_at_s=now - 0.005, assigned_at_s=now,
        )
        await call(nc, s.worker_assign(wid), a, AssignmentAck, timeout_s=WAIT_S)
        await asyncio.wait_for(done.wait(), timeout=WAIT_S)
        await sub.unsubscribe()
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.to_thread(proc.wait, WAIT_S)
        out, err = proc.communicate()
        assert rc == 0, err.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # The ground truth of this request on a fresh worker (P = 0): the process's noise stream
    # is seeded 0 and this is its first draw; handoff and decode are noise-free.
    prefill_m = NoisyGroundTruth(DEFAULT_GROUND_TRUTH, seed=0, sigma=0.04).prefill_time(
        length, 0, 2)
    kv_m = DEFAULT_GROUND_TRUTH.kv_handoff_time(length, 2)
    decode_m = DEFAULT_GROUND_TRUTH.surroundings.first_decode_s
    assert kv_m > 0 and decode_m > 0 and prefill_m * 0.9 > 100 * predicted

    (res,) = results
    assert res.token is not None and res.prefix_tokens == 0
    assert res.predicted_prefill_s == predicted  # carried, but not what the worker slept for
    st = res.stages
    # The KV handoff runs off the worker: its stage is the modelled time × scale, exactly.
    assert st.kv_transfer_s == pytest.approx(kv_m * scale, rel=1e-9)
    # The first decode is the modelled step × scale, lengthened only by a late timer; the
    # prefill slept the modelled time × scale (lower bounds: sleeps never end early).
    assert st.first_decode_s >= decode_m * scale * (1 - 1e-6)
    assert st.prefill_s >= prefill_m * scale * 0.9

    spans = {x["name"]: x["attributes"] for x in _console_spans(out.decode())}
    assert spans["prefill"]["vtm.predicted_s"] == predicted
    assert spans["prefill"]["vtm.modelled_prefill_s"] == pytest.approx(prefill_m, rel=1e-12)
    # What the worker actually slept, in modelled seconds: the ground truth, not the prediction.
    assert spans["prefill"]["vtm.actual_prefill_model_s"] >= 0.9 * prefill_m
    assert spans["kv_transfer"]["vtm.modelled_handoff_s"] == pytest.approx(
        kv_m + decode_m, rel=1e-12)
    # No prediction-timed fallback was taken (services.rankd.main warns when it is).
    from services.rankd.main import PREDICTED_TIME_WARNING

    assert PREDICTED_TIME_WARNING not in err.decode()

async def test_cache_snapshot_and_commands(
    rankd: tuple[RankdService, Gate], nc: Client, uniq: str
) -> None:
    s = Subjects(uniq)
    ev_sub, events, got = await collect(nc, s.cache_events(WID), 2, CacheEvent)
    empty = await call(nc, s.cache_snapshot(WID), b"", CacheSnapshot, timeout_s=WAIT_S)
    assert (empty.worker, empty.last_event_id, empty.blocks) == (WID, 0, [])
    rep = ReplicateCommand(
        command_id="c-1", worker_id=WID, epoch=0, blocks=[7, 8], source_worker="w-cp2-g0"
    )
    done = await call(nc, s.cache_cmd(WID), rep, CacheCommandResult, timeout_s=WAIT_S)
    assert done.ok and done.blocks_done == 2
    rec = ReclaimCommand(command_id="c-2", worker_id=WID, epoch=0, blocks=[8])
    done = await call(nc, s.cache_cmd(WID), rec, CacheCommandResult, timeout_s=WAIT_S)
    assert done.blocks_done == 1
    snap = await call(nc, s.cache_snapshot(WID), b"", CacheSnapshot, timeout_s=WAIT_S)
    assert (snap.last_event_id, snap.blocks) == (2, [(7, None)])
    await asyncio.wait_for(got.wait(), timeout=WAIT_S)
    await ev_sub.unsubscribe()
    assert [(e.type, e.event_id) for e in events] == [("stored", 1), ("removed", 2)]
    # a contradicting chain is bad input; the endpoint keeps serving
    bad = ReplicateCommand(
        command_id="c-3", worker_id=WID, epoch=0, blocks=[9, 7], source_worker="w-cp2-g0"
    )
    with pytest.raises(RemoteError) as err:
        await call(nc, s.cache_cmd(WID), bad, CacheCommandResult, timeout_s=WAIT_S)
    assert err.value.code == 400
    with pytest.raises(RemoteError) as err:
        await call(nc, s.cache_cmd(WID), b'{"op": "nope"}', CacheCommandResult, timeout_s=WAIT_S)
    assert err.value.code == 400


async def test_a_full_cache_snapshot_over_max_payload_comes_in_parts(
    rankd: tuple[RankdService, Gate], nc: Client, uniq: str
) -> None:
    """40,000 blocks of 64-bit hashes are about 1.7 MB of JSON, over the server's 1 MiB
    max_payload (the sim default holds 65,536 blocks; torch's 32,768): the snapshot comes in
    parts and reassembles to the whole index. It was a single message, answered 500, so a
    stale view of a full worker was never repaired."""
    s = Subjects(uniq)
    chain = [(1 << 63) + 12_345_678_901 * i for i in range(40_000)]
    rep = ReplicateCommand(command_id="c-big", worker_id=WID, epoch=0, blocks=chain,
                           source_worker="w-cp2-g0")
    done = await call(nc, s.cache_cmd(WID), rep, CacheCommandResult, timeout_s=WAIT_S)
    assert done.ok and done.blocks_done == len(chain)
    first = await nc.request(s.cache_snapshot(WID), b"", timeout=WAIT_S)
    n = int(first.headers[PART_HEADER].split("/")[1])
    assert n >= 2
    data, headers = await request_in_parts(nc, s.cache_snapshot(WID), b"", timeout_s=WAIT_S)
    snap = decode(CacheSnapshot, data, headers)
    assert snap.worker == WID and snap.last_event_id == 1
    assert sorted(snap.blocks) == sorted(zip(chain, [None, *chain[:-1]], strict=True))
    # A small snapshot is still one plain message.
    rec = ReclaimCommand(command_id="c-small", worker_id=WID, epoch=0, blocks=chain[1:])
    assert (await call(nc, s.cache_cmd(WID), rec, CacheCommandResult, timeout_s=WAIT_S)).ok
    small = await call(nc, s.cache_snapshot(WID), b"", CacheSnapshot, timeout_s=WAIT_S)
    assert (small.last_event_id, small.blocks) == (2, [(chain[0], None)])


async def test_a_request_priced_with_a_pull_waits_for_the_copy_over_nats(
    rankd: tuple[RankdService, Gate], nc: Client, uniq: str
) -> None:
    """An assignment that counts on a route-time pull (``pull_copy_s``, J's pull credit with
    its wait) is held at the head of the queue while the worker's cache lacks its prefix; the
    copy's replicate command releases it, and it runs with the pulled block reused."""
    svc, gate = rankd
    s = Subjects(uniq)
    sub, results, done = await collect(nc, s.result_all(), 1, FirstToken)
    held = assignment("r-p").model_copy(update={"pull_copy_s": 60.0})  # capped: ~4 s
    ack = await call(nc, s.worker_assign(WID), held, AssignmentAck, timeout_s=WAIT_S)
    assert ack.queue_position == 0
    for _ in range(10):  # it stays queued, not started (an ordering check, not a timing one)
        await asyncio.sleep(0.02)
        assert gate.calls == [] and svc.core.running is None and len(svc.core.queued) == 1
    rep = ReplicateCommand(
        command_id="c-1", worker_id=WID, epoch=0, blocks=[1], source_worker="w-cp2-g0"
    )
    assert (await call(nc, s.cache_cmd(WID), rep, CacheCommandResult, timeout_s=WAIT_S)).ok
    await asyncio.wait_for(done.wait(), timeout=WAIT_S)
    await sub.unsubscribe()
    assert gate.calls == [(512, 512, 2, "cp")]
    assert [(r.request_id, r.prefix_tokens) for r in results] == [("r-p", 512)]


class SlowCopies(SimBackend):
    """A sim backend whose copies take until the test releases them (as a real engine's
    ``prepare_cache_command`` moves the pages before the command is applied)."""

    def __init__(self, gate: Gate) -> None:
        super().__init__(prefill_time=gate, time_scale=1.0)
        self.copying = asyncio.Event()
        self.release = asyncio.Event()

    async def prepare_cache_command(self, cmd: object) -> object:
        self.copying.set()
        await self.release.wait()
        return cmd


async def test_past_its_bound_a_request_still_waits_for_a_copy_that_is_arriving(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """The hold's bound (admitted + slack·min(pull_copy_s, cap) + grace) is for a copy that
    may never be sent. A copy the worker is executing holds the request on past it: the
    request starts only when the copy has landed, and reuses it."""
    gate = Gate()
    backend = SlowCopies(gate)
    async with running_rankd(nats_server.url, uniq, backend, pull_hold_grace_s=0.0) as svc:
        try:
            s = Subjects(uniq)
            sub, results, done = await collect(nc, s.result_all(), 1, FirstToken)
            rep = ReplicateCommand(
                command_id="c-1", worker_id=WID, epoch=0, blocks=[1], source_worker="w-cp2-g0"
            )
            copy = asyncio.create_task(call(nc, s.cache_cmd(WID), rep, CacheCommandResult,
                                            timeout_s=WAIT_S))
            await asyncio.wait_for(backend.copying.wait(), timeout=WAIT_S)
            held = assignment("r-p").model_copy(update={"pull_copy_s": 1e-6})  # bound ≈ now
            await call(nc, s.worker_assign(WID), held, AssignmentAck, timeout_s=WAIT_S)
            for _ in range(10):  # past the bound, and still queued: the copy is arriving
                await asyncio.sleep(0.02)
                assert gate.calls == [] and svc.core.running is None
            backend.release.set()
            assert (await copy).ok
            await asyncio.wait_for(done.wait(), timeout=WAIT_S)
            await sub.unsubscribe()
            assert gate.calls == [(512, 512, 2, "cp")]
            assert [r.prefix_tokens for r in results] == [512]
        finally:
            backend.release.set()


class CountingCopies(SimBackend):
    """A sim backend that records every command its ``prepare_cache_command`` was given (a
    real engine moves KV pages there)."""

    def __init__(self, gate: Gate) -> None:
        super().__init__(prefill_time=gate, time_scale=1.0)
        self.prepared: list[object] = []

    async def prepare_cache_command(self, cmd: object) -> object:
        self.prepared.append(cmd)
        return cmd


async def test_a_refused_cache_command_moves_no_kv(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """Another worker's command (404) and one from a newer epoch (409) are refused before
    the engine moves any KV for them: a real engine's copy or eviction would otherwise have
    changed its cache for a command the cache manager is told failed."""
    backend = CountingCopies(Gate())
    async with running_rankd(nats_server.url, uniq, backend):
        s = Subjects(uniq)
        for cmd, code in (
            (ReplicateCommand(command_id="c-1", worker_id="w-cp2-g0", epoch=0, blocks=[1],
                              source_worker="w-cp4-g4"), 404),
            (ReplicateCommand(command_id="c-2", worker_id=WID, epoch=5, blocks=[1],
                              source_worker="w-cp2-g0"), 409),
            (ReclaimCommand(command_id="c-3", worker_id=WID, epoch=5, blocks=[1]), 409),
        ):
            with pytest.raises(RemoteError) as err:
                await call(nc, s.cache_cmd(WID), cmd, CacheCommandResult, timeout_s=WAIT_S)
            assert err.value.code == code, cmd
        assert backend.prepared == []
        ok = ReplicateCommand(command_id="c-4", worker_id=WID, epoch=0, blocks=[1],
                              source_worker="w-cp2-g0")
        assert (await call(nc, s.cache_cmd(WID), ok, CacheCommandResult, timeout_s=WAIT_S)).ok
        assert [c.command_id for c in backend.prepared] == ["c-4"]  # type: ignore[attr-defined]


class FailingPrefill(SimBackend):
    """A sim backend whose prefill fails."""

    async def prefill(self, assignment: Assignment) -> PrefillResult:
        raise RuntimeError("engine exploded")


async def test_a_jobs_log_lines_carry_its_request_and_trace_ids(
    nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    """conventions.md: request id and trace id bound per message. The executor's lines about
    a job (here its failed prefill) carry both, without the call passing them."""
    import structlog

    async with running_rankd(nats_server.url, uniq, FailingPrefill(prefill_time=Gate())):
        s = Subjects(uniq)
        sub, results, done = await collect(nc, s.result_all(), 1, FirstToken)
        with structlog.testing.capture_logs(
                processors=[structlog.contextvars.merge_contextvars]) as logs:
            with tracer().start_as_current_span("client") as span:
                await call(nc, s.worker_assign(WID), assignment("r-log"), AssignmentAck,
                           timeout_s=WAIT_S)
            await asyncio.wait_for(done.wait(), timeout=WAIT_S)
        await sub.unsubscribe()
        assert results[0].error is not None
        tid = format(span.get_span_context().trace_id, "032x")
        failed = [e for e in logs if e["event"] == "prefill failed"]
        assert failed, [e["event"] for e in logs]
        assert {(e.get("request_id"), e.get("trace_id")) for e in failed} == {("r-log", tid)}


async def test_a_later_attempt_of_a_failed_request_runs_again(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """A request whose prefill failed is answered with the failure; a later attempt of it (a
    client's retry, taken as new by the intake) is run again, not answered with the kept
    failure: each attempt gets a failure of its own prefill, stamped for it."""
    async with running_rankd(nats_server.url, uniq,
                             FailingPrefill(prefill_time=Gate())) as svc:
        s = Subjects(uniq)
        sub, results, done = await collect(nc, s.result_all(), 2, FirstToken)
        first = assignment("r-f", arrival=time.time() - 1.0)
        retry = reattempt(first, first.request.arrival_s + 0.5)
        with structlog.testing.capture_logs() as logs:
            await call(nc, s.worker_assign(WID), first, AssignmentAck, timeout_s=WAIT_S)
            await wait_for_results(results, 1)
            await call(nc, s.worker_assign(WID), retry, AssignmentAck, timeout_s=WAIT_S)
            await asyncio.wait_for(done.wait(), timeout=WAIT_S)
        await sub.unsubscribe()
        assert [(r.error is not None, r.arrival_s) for r in results] \
            == [(True, first.request.arrival_s), (True, retry.request.arrival_s)]
        assert len([e for e in logs if e["event"] == "prefill failed"]) == 2
        assert svc.answers_resent == 0


async def test_a_demote_command_over_nats(
    rankd: tuple[RankdService, Gate], nc: Client, uniq: str
) -> None:
    """A DemoteCommand on the worker's cache.cmd subject is answered ok with the blocks it
    demoted (the uncached one skipped); the index and its event ids are unchanged (no event
    follows a demote). Another worker's demote is a 404 and a malformed one a 400, as for
    every command, and the endpoint keeps serving."""
    s = Subjects(uniq)
    rep = ReplicateCommand(
        command_id="c-1", worker_id=WID, epoch=0, blocks=[7, 8], source_worker="w-cp2-g0"
    )
    assert (await call(nc, s.cache_cmd(WID), rep, CacheCommandResult, timeout_s=WAIT_S)).ok
    dem = DemoteCommand(command_id="c-2", worker_id=WID, epoch=0, blocks=[7, 8, 99])
    done = await call(nc, s.cache_cmd(WID), dem, CacheCommandResult, timeout_s=WAIT_S)
    assert (done.command_id, done.worker_id, done.ok, done.blocks_done) == ("c-2", WID, True, 2)
    snap = await call(nc, s.cache_snapshot(WID), b"", CacheSnapshot, timeout_s=WAIT_S)
    assert (snap.last_event_id, sorted(snap.blocks)) == (1, [(7, None), (8, 7)])
    other = DemoteCommand(command_id="c-3", worker_id="w-cp2-g0", epoch=0, blocks=[7])
    with pytest.raises(RemoteError) as err:
        await call(nc, s.cache_cmd(WID), other, CacheCommandResult, timeout_s=WAIT_S)
    assert err.value.code == 404
    bad = b'{"op":"demote","command_id":"c-4","worker_id":"w-cp2-g2","epoch":0,"blocks":["x"]}'
    with pytest.raises(RemoteError) as err:
        await call(nc, s.cache_cmd(WID), bad, CacheCommandResult, timeout_s=WAIT_S)
    assert err.value.code == 400
    done = await call(nc, s.cache_cmd(WID), dem, CacheCommandResult, timeout_s=WAIT_S)
    assert done.ok and done.blocks_done == 2


async def test_a_worker_measures_its_prefills_queue_and_cache(
    rankd: tuple[RankdService, Gate], nc: Client, uniq: str, metric_reader
) -> None:  # type: ignore[no-untyped-def]
    """vtm.worker.*: each prefill against the prediction (the sim backend takes 0.05 s where
    the assignment predicted 0.2: a ratio of at least 0.25), the cache's blocks, its capacity
    and its queue."""
    from metricsread import points, total

    svc, _ = rankd
    s = Subjects(uniq)
    sub, results, done = await collect(nc, s.result_all(), 2, FirstToken)
    prefills = total(metric_reader, "vtm.worker.prefill", worker=WID, degree="2")
    ratios = points(metric_reader, "vtm.worker.prediction_ratio").get((("degree", "2"),), (0, 0.0))
    for rid in ("m-a", "m-b"):
        await call(nc, s.worker_assign(WID), assignment(rid), AssignmentAck, timeout_s=WAIT_S)
    await asyncio.wait_for(done.wait(), timeout=WAIT_S)
    await sub.unsubscribe()
    assert total(metric_reader, "vtm.worker.prefill", worker=WID, degree="2") - prefills == 2
    count, sum_ = points(metric_reader, "vtm.worker.prediction_ratio")[(("degree", "2"),)]
    assert count - ratios[0] == 2
    # Measured (≥ the 0.05 s slept) over predicted (0.2 s): no upper bound, a busy machine
    # may sleep longer.
    assert (sum_ - ratios[1]) / 2 > 0.2
    assert points(metric_reader, "vtm.worker.kv_blocks")[(("worker", WID),)] == 2
    assert points(metric_reader, "vtm.worker.kv_capacity")[(("worker", WID),)] == \
        svc.core.kv_total_blocks > 0
    assert points(metric_reader, "vtm.worker.queue")[(("worker", WID),)] == 0


async def test_a_scaled_worker_gives_each_figure_in_one_unit(
    nats_server: EmbeddedNats, uniq: str, nc: Client, spans: InMemorySpanExporter,
    metric_reader,  # type: ignore[no-untyped-def]
) -> None:
    """At time scale 0.1 (what ``vertumnus up`` runs) a prefill modelled at 0.5 s sleeps
    0.05 wall s. The FirstToken's stages stay wall seconds and say the scale; the prefill span
    has the wall figure and the modelled one (÷ the scale: the unit of ``vtm.predicted_s``);
    the prediction ratio compares modelled with modelled (≈ 1, where wall over modelled would
    read ≈ the scale)."""
    from metricsread import points

    scale, modelled = 0.1, 0.5
    s = Subjects(uniq)
    async with running_rankd(
            nats_server.url, uniq,
            SimBackend(prefill_time=lambda r, p, c, kind="cp": modelled, time_scale=scale)):
        ratios = points(metric_reader, "vtm.worker.prediction_ratio").get(
            (("degree", "2"),), (0, 0.0))
        sub, results, done = await collect(nc, s.result_all(), 1, FirstToken)
        with tracer().start_as_current_span("schedule"):
            await call(nc, s.worker_assign(WID), assignment("ts-1", predicted=modelled),
                       AssignmentAck, timeout_s=WAIT_S)
        await asyncio.wait_for(done.wait(), timeout=WAIT_S)
        await sub.unsubscribe()
    (r,) = results
    assert (r.time_scale, r.predicted_prefill_s) == (scale, modelled)
    wall = r.stages.prefill_s
    # It slept the scaled time (no upper bound: a busy machine may sleep longer).
    assert wall >= 0.9 * modelled * scale
    (pre,) = [x for x in spans.get_finished_spans()
              if x.name == "prefill" and x.attributes["vtm.request_id"] == "ts-1"]
    at = pre.attributes
    assert at["vtm.time_scale"] == scale
    assert (at["vtm.predicted_s"], at["vtm.modelled_prefill_s"]) == (modelled, modelled)
    assert at["vtm.actual_prefill_s"] == pytest.approx(wall)  # wall, as the stages
    assert at["vtm.actual_prefill_model_s"] == pytest.approx(wall / scale)
    assert at["vtm.actual_prefill_model_s"] >= 0.9 * at["vtm.predicted_s"]
    count, sum_ = points(metric_reader, "vtm.worker.prediction_ratio")[(("degree", "2"),)]
    assert count - ratios[0] == 1
    assert sum_ - ratios[1] >= 0.9


async def test_a_later_attempt_of_an_answered_request_gets_the_answer_stamped_for_it(
    rankd: tuple[RankdService, Gate], nc: Client, uniq: str
) -> None:
    """x is answered; a later attempt of x with the same content (a client retry the intake
    took as new: the server lost its store) is assigned here: the worker does not run it
    again and sends its kept answer stamped with the later attempt's arrival -- a gateway
    takes only the results of the attempt it waits for. An attempt under the id with other
    content (a new request reusing the id once its claim expired) is run and answered:
    before, it was admitted as done and never answered. Then the first content again: the
    kept answer is the other content's now, so it runs too."""
    svc, gate = rankd
    s = Subjects(uniq)
    sub, results, done = await collect(nc, s.result_all(), 4, FirstToken)
    first = assignment("r-x", arrival=time.time() - 1.0)
    later = first.request.arrival_s + 0.5
    sent = [first, reattempt(first, later), reattempt(first, later + 0.1, block_hashes=[1, 3]),
            reattempt(first, later + 0.2)]
    for n, a in enumerate(sent, 1):
        await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S)
        await wait_for_results(results, n)
    await asyncio.wait_for(done.wait(), timeout=WAIT_S)
    await sub.unsubscribe()
    assert [r.arrival_s for r in results] == [a.request.arrival_s for a in sent]
    assert {r.token for r in results} == {fake_token("r-x")}
    assert results[1].stages.total_s >= 0.0 and results[1].stages.prefill_s == 0.0
    assert len(gate.calls) == 3 and svc.answers_resent == 1  # the retry was not run
    assert svc.core.served == 3


class SlowGate(Gate):
    """A Gate whose prefills take a second (a request stays running while a test acts)."""

    def __call__(self, r: int, p: int, degree: int, *, kind: str = "cp") -> float:
        super().__call__(r, p, degree, kind=kind)
        return 1.0


async def test_a_later_attempt_while_the_first_runs_is_answered_by_its_run(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """A later attempt of x (the same content) assigned while x runs here joins x's job: x
    runs once, and its answer goes to both attempts, each stamped with its own arrival (a
    gateway that lost x's claim with the store waits for the later stamp only). Other
    content under the id meanwhile is refused for now (REDIRECTING: the scheduler tries
    again), and once x is answered it runs."""
    gate = SlowGate()
    async with running_rankd(nats_server.url, uniq,
                             SimBackend(prefill_time=gate, time_scale=1.0)) as svc:
        s = Subjects(uniq)
        sub, results, done = await collect(nc, s.result_all(), 3, FirstToken)
        first = assignment("r-y", arrival=time.time() - 1.0)
        later = reattempt(first, first.request.arrival_s + 0.5)
        other = reattempt(first, first.request.arrival_s + 0.6, block_hashes=[1, 3])
        await call(nc, s.worker_assign(WID), first, AssignmentAck, timeout_s=WAIT_S)
        ack = await call(nc, s.worker_assign(WID), later, AssignmentAck, timeout_s=WAIT_S)
        assert ack.queue_position == 0 and len(svc.core) == 1  # joined, not queued
        with pytest.raises(RemoteError) as err:
            await call(nc, s.worker_assign(WID), other, AssignmentAck, timeout_s=WAIT_S)
        assert err.value.code == int(REDIRECTING_CODE)
        await wait_for_results(results, 2)
        assert len(gate.calls) == 1
        await call(nc, s.worker_assign(WID), other, AssignmentAck, timeout_s=WAIT_S)
        await asyncio.wait_for(done.wait(), timeout=WAIT_S)
        await sub.unsubscribe()
        assert [r.arrival_s for r in results] \
            == [first.request.arrival_s, later.request.arrival_s, other.request.arrival_s]
        assert all(r.error is None for r in results)
        assert len(gate.calls) == 2 and svc.answers_resent == 0


def slow_backend() -> SimBackend:
    """Prefills of 30 s: a request queued behind the first stays queued while a test acts."""
    return SimBackend(prefill_time=lambda r, p, c, kind="cp": 30.0)


@contextlib.asynccontextmanager
async def busy_rankd(url: str, nc: Client, uniq: str) -> AsyncIterator[tuple[RankdService, float]]:
    """rankd over an intake stream, its worker busy with q-1 (a 30 s prefill): what is
    assigned next stays queued. Yields the service and q-1's arrival stamp."""
    s = Subjects(uniq)
    await ensure_intake_stream(nc.jetstream(), s)
    async with running_rankd(url, uniq, slow_backend(), drain_timeout_s=0.5) as svc:
        arrived = time.time() - 1.0
        await call(nc, s.worker_assign(WID), assignment("q-1", arrival=arrived),
                   AssignmentAck, timeout_s=WAIT_S)
        yield svc, arrived


async def test_a_later_attempt_that_joined_a_handed_back_job_is_handed_back_too(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """x is queued behind a long prefill, and a later attempt of x (the same content) joins
    it; a drain hands x back: intake gets both attempts, each with its own arrival stamp and
    message id (the gateway waiting for the later one takes no other stamp). Before, the
    hand-back carried the first attempt only, and the later one was never answered."""
    s = Subjects(uniq)
    js = nc.jetstream()
    async with busy_rankd(nats_server.url, nc, uniq) as (svc, arrived):
        first = assignment("q-x", arrival=arrived)
        # The later attempt's own trace (its gateway's root span) goes with its hand-back.
        later = reattempt(first, arrived + 0.5, trace_context={
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"})
        for a in (first, later):
            # Both attempts' intake messages have the gateway's id, the request id (the later
            # one was stored anew after a store loss).
            await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S,
                       headers={INTAKE_MSG_HEADER: "q-x"})
        assert len(svc.core) == 2  # q-1 running, x queued once
        consumer = await js.pull_subscribe(s.intake_requests(), durable="sched")
        await drain_worker(nc, s)
        redirected: list[tuple[IntakeRequest, str]] = []
        while len(redirected) < 2:
            for m in await consumer.fetch(2, timeout=WAIT_S):
                redirected.append((decode(IntakeRequest, m.data, m.headers),
                                   (m.headers or {})["Nats-Msg-Id"]))
                await m.ack()
        assert [(r.request_id, r.arrival_s) for r, _ in redirected] \
            == [("q-x", arrived), ("q-x", arrived + 0.5)]
        assert redirected[1][0].trace_context == later.request.trace_context
        # The job's hand-back has its usual id; the joined attempt's is its own (under the
        # same id the intake would have dropped it as a duplicate).
        assert redirected[0][1] == handback_msg_id("q-x", "q-x", WID, 1)
        assert redirected[1][1] != redirected[0][1]
        # Both settled: the worker counts only q-1 again (the joined attempt counted while
        # its hand-back was under way).
        await all_sent(svc, nc)
        assert svc.current_state().queue_len == 1


async def test_a_resent_assignment_of_a_handed_back_joined_attempt_is_not_run_again(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """x's later attempt came from another intake message than x (a hand-back's, say) and
    joined x's job; a drain hands both back, and intake holds both. With the worker ACTIVE
    again, a scheduler that crashed before its record re-sends either attempt's assignment:
    each is told HandedBack (410: it acks its old message), and nothing runs. Before, the
    joined attempt's was admitted, and ran here while its hand-back ran elsewhere."""
    s = Subjects(uniq)
    js = nc.jetstream()
    async with busy_rankd(nats_server.url, nc, uniq) as (svc, arrived):
        first = assignment("q-x", arrival=arrived)
        later = reattempt(first, arrived + 0.5)
        sources = [(first, "q-x"), (later, "q-x@other-message")]
        for a, source in sources:
            await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S,
                       headers={INTAKE_MSG_HEADER: source})
        consumer = await js.pull_subscribe(s.intake_requests(), durable="sched")
        await drain_worker(nc, s)
        got = 0
        while got < 2:
            got += len(await consumer.fetch(2, timeout=WAIT_S))
        await all_sent(svc, nc)
        await drain_worker(nc, s, 2, Lifecycle.ACTIVE)
        async with asyncio.timeout(WAIT_S):
            while svc.core.epoch < 2:
                await asyncio.sleep(0.01)
        for a, source in sources:
            with pytest.raises(RemoteError) as err:
                await call(nc, s.worker_assign(WID), a.model_copy(update={"epoch": 2}),
                           AssignmentAck, timeout_s=WAIT_S, headers={INTAKE_MSG_HEADER: source})
            assert err.value.code == int(HANDED_BACK_CODE), source
        assert [j.request_id for j in svc.core.queued] == []


class HeldJoinedHandBack(RankdService):
    """rankd whose hand-backs of joined attempts wait for ``release`` before they publish
    (an intake slow to acknowledge); the job's own hand-backs go out at once."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.release = asyncio.Event()

    async def _publish_handback(self, req: IntakeRequest, msg_id: str, epoch: int,
                                deadline: float, **kw: Any) -> tuple[str | None, bool, bool]:
        if "@a" in msg_id:
            await self.release.wait()
        return await super()._publish_handback(req, msg_id, epoch, deadline, **kw)


async def test_a_joined_attempt_being_handed_back_is_counted_and_logged_at_stop(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """While a joined attempt's hand-back is unsettled, the worker's published queue_len
    counts it (the controller waits for an empty queue before it calls a drain done; the
    scheduler calls an UNAVAILABLE worker gone only then): before, only the core's jobs
    counted. A stop that gives that hand-back up logs its outcome as unknown, with the
    attempt's stamp, as it does a job's: before, nothing was logged."""
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    svc, task = await start_rankd(nats_server.url, uniq, slow_backend(), cls=HeldJoinedHandBack,
                                  drain_timeout_s=0.5, redirect_timeout_s=0.5)
    assert isinstance(svc, HeldJoinedHandBack)
    try:
        arrived = time.time() - 1.0
        await call(nc, s.worker_assign(WID), assignment("q-1", arrival=arrived),
                   AssignmentAck, timeout_s=WAIT_S)
        first = assignment("q-x", arrival=arrived)
        for a in (first, reattempt(first, arrived + 0.5)):
            await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S,
                       headers={INTAKE_MSG_HEADER: "q-x"})
        await drain_worker(nc, s)
        async with asyncio.timeout(WAIT_S):
            while svc.core.redirecting or len(svc.core) != 1:  # x's own hand-back settled
                await asyncio.sleep(0.01)
        assert svc.current_state().queue_len == 2  # q-1 running, x's later attempt
        with structlog.testing.capture_logs() as logs:
            svc.request_stop()
            await asyncio.wait_for(task, timeout=WAIT_S)
    finally:
        svc.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)
    unknown = [e for e in logs if e["event"] == "redirect outcome unknown at stop"]
    assert [(e["request_id"], e["arrival_s"]) for e in unknown] == [("q-x", arrived + 0.5)]
    assert svc.current_state().queue_len == 0


async def test_a_joined_attempt_whose_hand_back_fails_gets_its_own_error(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """No intake stream: the drain's hand-back of x fails, and each attempt of x -- the
    first, and the later one that joined it -- gets one error answer, stamped for it."""
    s = Subjects(uniq)
    async with running_rankd(nats_server.url, uniq, slow_backend(), drain_timeout_s=0.5,
                             redirect_timeout_s=2.0) as svc:
        sub, results, done = await collect(nc, s.result("q-x"), 2, FirstToken)
        arrived = time.time() - 1.0
        await call(nc, s.worker_assign(WID), assignment("q-1", arrival=arrived),
                   AssignmentAck, timeout_s=WAIT_S)
        first = assignment("q-x", arrival=arrived)
        for a in (first, reattempt(first, arrived + 0.5)):
            await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S)
        await drain_worker(nc, s)
        await asyncio.wait_for(done.wait(), timeout=WAIT_S)
        await all_sent(svc, nc)
        assert sorted(r.arrival_s for r in results) == [arrived, arrived + 0.5]
        assert all(r.token is None and "redirect failed" in (r.error or "") for r in results)
        await sub.unsubscribe()


async def test_a_later_attempt_refused_while_its_job_is_handed_back_is_answered_once(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """A later attempt of x assigned while x's hand-back is still unsettled is refused for
    now (REDIRECTING); once the hand-back settled, its retry runs here and is answered once.
    Before, the refused attempt was noted as joining x all the same, and its run answered it
    twice."""
    s = Subjects(uniq)
    # The long request (2,048 tokens) holds the worker for 2 s, so x stays queued.
    backend = SimBackend(prefill_time=lambda r, p, c, kind="cp": 2.0 if r + p > 1024 else 0.05,
                         time_scale=1.0)
    async with running_rankd(nats_server.url, uniq, backend) as svc:
        sub, results, _ = await collect(nc, s.result("q-x"), 1, FirstToken)
        arrived = time.time() - 1.0
        long = assignment("q-1", arrival=arrived)
        long = long.model_copy(update={
            "request": long.request.model_copy(update={"input_len": 2048,
                                                       "block_hashes": [7, 8, 9, 10]}),
            "prefix_tokens": 0, "recompute_tokens": 2048})
        await call(nc, s.worker_assign(WID), long, AssignmentAck, timeout_s=WAIT_S)
        first = assignment("q-x", arrival=arrived)
        await call(nc, s.worker_assign(WID), first, AssignmentAck, timeout_s=WAIT_S)
        # The core hands x back; its redirect is not settled yet (no task publishes it).
        assert [j.request_id for j in svc.core.take_queued()] == ["q-x"]
        later = reattempt(first, arrived + 0.5)
        with pytest.raises(RemoteError) as err:
            await call(nc, s.worker_assign(WID), later, AssignmentAck, timeout_s=WAIT_S)
        assert err.value.code == int(REDIRECTING_CODE)
        svc.core.redirect_settled("q-x", in_intake=True)
        await call(nc, s.worker_assign(WID), later, AssignmentAck, timeout_s=WAIT_S)
        await wait_for_results(results, 1)
        await all_sent(svc, nc)
        assert [(r.arrival_s, r.error) for r in results] == [(arrived + 0.5, None)]
        await sub.unsubscribe()


class FailsFirstPublish(RankdService):
    """rankd whose first answer fails to go out (a publish on a closing connection, say):
    the request's bookkeeping fails, and the worker serves on."""

    failed = False

    def _publish_result(self, job: Job, result: PrefillResult,
                        joined: Sequence[JoinedAnswer]) -> None:
        if not self.failed:
            self.failed = True
            raise RuntimeError("publish failed")
        super()._publish_result(job, result, joined)


async def test_attempts_that_joined_a_job_whose_bookkeeping_failed_are_forgotten(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """x's later attempt joined x's job, whose answer then failed to go out: each attempt is
    answered once with an error (the executor's bookkeeping failure). A new request under
    the id (other content) runs and is answered once, with its own stamp: before, the later
    attempt's note outlived the job, and the new request's answer went to it too."""
    async with running_rankd(nats_server.url, uniq,
                             SimBackend(prefill_time=SlowGate(), time_scale=1.0),
                             cls=FailsFirstPublish) as svc:
        assert isinstance(svc, FailsFirstPublish)
        s = Subjects(uniq)
        sub, results, _ = await collect(nc, s.result("r-z"), 1, FirstToken)
        first = assignment("r-z", arrival=time.time() - 1.0)
        for a in (first, reattempt(first, first.request.arrival_s + 0.5)):
            await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S)
        async with asyncio.timeout(WAIT_S):
            while not svc.failed or svc.core.running is not None:
                await asyncio.sleep(0.01)
        other = reattempt(first, first.request.arrival_s + 0.6, block_hashes=[1, 3])
        await call(nc, s.worker_assign(WID), other, AssignmentAck, timeout_s=WAIT_S)
        await wait_for_results(results, 3)
        await all_sent(svc, nc)
        assert sorted((r.arrival_s, r.error is None) for r in results) == [
            (first.request.arrival_s, False), (first.request.arrival_s + 0.5, False),
            (other.request.arrival_s, True)]
        await sub.unsubscribe()


async def test_a_late_answer_goes_only_to_the_attempts_that_joined_its_own_job(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """x's first token goes out 2 s after its prefill (the KV handoff runs off the worker).
    Meanwhile a new request under the id (other content) starts a job of its own, and a
    later attempt of that one joins it. x's late answer goes to x alone; the joined attempt
    gets its own job's answer. Before, the late answer took the new job's joined attempts
    along (answered with the other content's result)."""
    backend = SimBackend(prefill_time=lambda r, p, c, kind="cp": 3.0 if r + p > 1024 else 0.05,
                         handoff_time=lambda tokens, c: 2.0, handoff_off_worker=True,
                         time_scale=1.0)
    async with running_rankd(nats_server.url, uniq, backend) as svc:
        s = Subjects(uniq)
        sub, results, _ = await collect(nc, s.result("r-late"), 3, FirstToken)
        first = assignment("r-late", arrival=time.time() - 1.0)
        await call(nc, s.worker_assign(WID), first, AssignmentAck, timeout_s=WAIT_S)
        async with asyncio.timeout(WAIT_S):
            while svc.core.finished_arrival("r-late") is None:
                await asyncio.sleep(0.005)
        assert not results  # finished here, its first token still to come
        other = reattempt(first, first.request.arrival_s + 0.5, input_len=2048,
                          block_hashes=[7, 8, 9, 10])
        other = other.model_copy(update={"prefix_tokens": 0, "recompute_tokens": 2048,
                                         "predicted_s": 0.9})
        joins = reattempt(other, other.request.arrival_s + 0.1)
        for a in (other, joins):
            await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S)
        await wait_for_results(results, 3)
        await all_sent(svc, nc)
        got = {r.arrival_s: r.predicted_prefill_s for r in results}
        assert got == {first.request.arrival_s: 0.2, other.request.arrival_s: 0.9,
                       joins.request.arrival_s: 0.9}
        assert len(results) == 3
        await sub.unsubscribe()


async def wait_for_results(results: list, n: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while len(results) < n:
        assert time.monotonic() < deadline, f"timed out waiting for {n} results"
        await asyncio.sleep(0.01)
