"""A request that needs more than one attempt reads whole in its trace and in the scheduler's
metrics (real nats-server, the scheduler in-process, fake workers; spans from the in-memory
exporter, the trace context in the intake message's headers as a publisher other than the
gateway puts it).

* A retry's wait (``retry_delay_s`` after a NAK) is ``intake_wait`` (``vtm.retry``), from the
  NAK to the redelivery's dequeue: the stage spans of the attempts follow each other with no
  gap. Before, a later delivery recorded an intake wait only if it was held, and the trace of
  a request with retries had holes of ``retry_delay_s`` each.
* The attempt that failed has ERROR status on its own span (``dispatch`` with
  ``vtm.dispatch_error``, ``schedule`` with ``vtm.no_eligible_worker``), not the retry's.
  Before, those spans' status was UNSET.
* A request handed back for a lost worker: a ``handed_back`` span from its assignment on that
  worker to the hand-back (worker, cause), and the hand-back's ``intake_wait`` starts there.
  Before, that intake wait started again at the gateway's arrival, covering the time on the
  dead worker, and the log line of the hand-back had no trace id (nor had a delivery's lines
  when the trace context was in the message's headers only).
* Counters: ``vtm.scheduler.retries{reason}``, ``vtm.scheduler.redeliveries``,
  ``vtm.scheduler.handbacks{cause}``.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from live_sched_support import FakeWorker, Services, heartbeats, results_for, wait_until
from metricsread import total
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro.request import Request
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from structlog.contextvars import merge_contextvars
from structlog.testing import capture_logs

from shared.blockhash import chain_hashes
from shared.schemas import Assignment, IntakeRequest, decode, encode
from shared.subjects import Subjects

B = 16
W1, W2 = "w-cp2-g0", "w-cp2-g2"
SPAN = "b7ad6b7169203331"


def traceparent(trace: str) -> dict[str, str]:
    return {"traceparent": f"00-{trace}-{SPAN}-01"}


async def publish(nc: Client, uniq: str, rid: str, trace: str) -> IntakeRequest:
    tokens = list(range(40))
    req = IntakeRequest(request_id=rid, input_len=40, block_hashes=chain_hashes(tokens, B),
                        block_size=B, arrival_s=time.time())
    data, headers = encode(req)
    headers.update(traceparent(trace))
    headers["Nats-Msg-Id"] = rid
    await nc.jetstream().publish(Subjects(uniq).intake_requests(), data, headers=headers)
    return req


def of_trace(spans: InMemorySpanExporter, trace: str, name: str) -> list[ReadableSpan]:
    """The trace's finished spans named ``name``, by start time."""
    return sorted((s for s in spans.get_finished_spans()
                   if s.name == name and format(s.context.trace_id, "032x") == trace),
                  key=lambda s: s.start_time)


def status(span: ReadableSpan) -> StatusCode:
    return span.status.status_code


class RefusesOnce(FakeWorker):
    """Refuses the first assignment of each request with a micro error (503), takes the rest."""

    refused: set[str]

    async def _on_assign(self, msg: Msg) -> None:
        a = decode(Assignment, msg.data, msg.headers)
        if a.request.request_id not in self.refused:
            self.refused.add(a.request.request_id)
            self.assignments.append(a)
            await Request(msg).respond_error("503", "engine refused the request")
            return
        await super()._on_assign(msg)


async def test_a_retry_after_a_refused_dispatch_is_traced_without_a_gap(
        live: Services, nc: Client, uniq: str, spans: InMemorySpanExporter,
        metric_reader: InMemoryMetricReader) -> None:
    trace = "1af7651916cd43dd8448eb211c80319c"
    w = RefusesOnce(nc, Subjects(uniq), W1, 2, 0)
    w.refused = set()
    await w.start()
    try:
        sched = await live.scheduler(block_size=B, retry_delay_s=0.3, max_deliver=5)
        await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
        retries = total(metric_reader, "vtm.scheduler.retries", reason="worker_refused")
        redeliveries = total(metric_reader, "vtm.scheduler.redeliveries")
        got = await results_for(nc, uniq, "x")
        with capture_logs(processors=[merge_contextvars]) as logs:
            await publish(nc, uniq, "x", trace)
            await wait_until(lambda: got, "x's answer")
        assert [(t.worker_id, t.error) for t in got] == [(W1, None)], got
        # The trace context only in the message's headers: its log lines name it all the same.
        (line,) = [e for e in logs if e["event"] == "intake retry"]
        assert line["request_id"] == "x" and line["trace_id"] == trace
        await wait_until(lambda: len(of_trace(spans, trace, "dispatch")) == 2,
                         "both attempts' spans ended")
    finally:
        await w.stop()
    waits = of_trace(spans, trace, "intake_wait")
    scheds = of_trace(spans, trace, "schedule")
    dispatches = of_trace(spans, trace, "dispatch")
    assert (len(waits), len(scheds)) == (2, 2), (waits, scheds)
    # The first attempt's dispatch failed: its span says so, the rest are not errors.
    assert status(dispatches[0]) is StatusCode.ERROR
    assert "engine refused" in dispatches[0].attributes["vtm.dispatch_error"]
    assert [status(s) for s in (*scheds, dispatches[1])] == [StatusCode.UNSET] * 3
    # The retry's wait is intake wait, from the NAK on: the spans follow each other.
    retry = waits[1]
    assert retry.attributes["vtm.retry"] is True and retry.attributes["vtm.delivery"] == 2
    chain = [waits[0], scheds[0], dispatches[0], waits[1], scheds[1], dispatches[1]]
    for before, after in zip(chain, chain[1:], strict=False):
        assert before.end_time == after.start_time, (before.name, after.name)
    assert retry.end_time - retry.start_time > 0
    for s in (*waits, *scheds):
        assert format(s.parent.span_id, "016x") == SPAN
    for s, d in zip(scheds, dispatches, strict=True):
        assert d.parent.span_id == s.context.span_id
    assert total(metric_reader, "vtm.scheduler.retries", reason="worker_refused") \
        - retries == 1
    assert total(metric_reader, "vtm.scheduler.redeliveries") - redeliveries == 1


async def test_deliveries_that_find_no_worker_are_error_spans(
        live: Services, nc: Client, uniq: str, spans: InMemorySpanExporter,
        metric_reader: InMemoryMetricReader) -> None:
    trace = "2af7651916cd43dd8448eb211c80319c"
    sched = await live.scheduler(block_size=B, hold_s=0.05, retry_delay_s=0.05,
                                 max_deliver=2)
    retries = total(metric_reader, "vtm.scheduler.retries", reason="no_eligible_worker")
    got = await results_for(nc, uniq, "x")
    await publish(nc, uniq, "x", trace)
    await wait_until(lambda: got and len(of_trace(spans, trace, "schedule")) == 2,
                     "x failed after both deliveries")
    assert sched.stats.failed == 1
    scheds = of_trace(spans, trace, "schedule")
    for s in scheds:
        assert status(s) is StatusCode.ERROR, s.status
        assert s.attributes["vtm.no_eligible_worker"]
    waits = of_trace(spans, trace, "intake_wait")
    assert len(waits) == 2 and waits[1].attributes["vtm.retry"] is True
    assert waits[1].start_time == scheds[0].end_time  # from the first delivery's NAK
    assert waits[1].end_time == scheds[1].start_time
    assert total(metric_reader, "vtm.scheduler.retries", reason="no_eligible_worker") \
        - retries == 1



async def test_a_hand_back_for_a_lost_worker_is_traced_and_logged(
        live: Services, nc: Client, uniq: str, spans: InMemorySpanExporter,
        metric_reader: InMemoryMetricReader,
        fake_worker: Callable[..., Awaitable[FakeWorker]]) -> None:
    trace = "3af7651916cd43dd8448eb211c80319c"
    w1 = await fake_worker(W1, 2, 0, reply_results=False)  # admits x, never answers
    workers = [w1]
    handbacks = total(metric_reader, "vtm.scheduler.handbacks", cause="lost_silent")
    logs: list[dict[str, Any]]
    async with heartbeats(workers):
        sched = await live.scheduler(block_size=B, policy="round_robin", lease_s=2.0)
        await wait_until(lambda: len(sched.core.view) == 1, "W1 in the view")
        got = await results_for(nc, uniq, "x")
        req = await publish(nc, uniq, "x", trace)
        await wait_until(lambda: sched.stats.dispatched == 1, "x dispatched to W1")
        workers.append(await fake_worker(W2, 2, 2))
        await wait_until(lambda: len(sched.core.view) == 2, "W2 in the view")
        with capture_logs(processors=[merge_contextvars]) as logs:
            await w1.stop()  # lost (its lease runs out, nobody answers its queue), x with it
            await wait_until(lambda: got, "x's answer", timeout_s=60)
        assert [(t.worker_id, t.error) for t in got] == [(W2, None)], got
        await wait_until(lambda: len(of_trace(spans, trace, "dispatch")) == 2,
                         "the second placement's spans ended")
    (lost,) = of_trace(spans, trace, "handed_back")
    assert lost.attributes["vtm.worker_id"] == W1
    assert lost.attributes["vtm.cause"] == "lost_silent"
    assert format(lost.parent.span_id, "016x") == SPAN
    assert lost.start_time == int(w1.assignments[0].assigned_at_s * 1e9)
    first, again = of_trace(spans, trace, "intake_wait")
    assert first.start_time == int(req.arrival_s * 1e9)
    # The hand-back's wait starts where the time on the lost worker ends, not at arrival.
    assert again.start_time == lost.end_time > first.end_time
    assert again.attributes["vtm.handed_back"] is True
    assert again.attributes["vtm.handed_back_by"] == W1
    assert again.attributes["vtm.handback_cause"] == "lost_silent"
    scheds = of_trace(spans, trace, "schedule")
    assert again.end_time == scheds[1].start_time
    # Its log line names the request's trace (it is logged by housekeeping, not a delivery).
    (line,) = [e for e in logs if e["event"] == "request handed back: its worker was lost"]
    assert line["request_id"] == "x" and line["trace_id"] == trace
    assert total(metric_reader, "vtm.scheduler.handbacks", cause="lost_silent") \
        - handbacks == 1


async def test_a_workers_own_hand_back_waits_in_intake_from_its_publish(
        live: Services, nc: Client, uniq: str, spans: InMemorySpanExporter,
        fake_worker: Callable[..., Awaitable[FakeWorker]]) -> None:
    """A hand-back a worker published itself (a draining worker's redirect: no replica's
    stamp on it) waits in intake from when the stream stored it, not from the arrival."""
    trace = "4af7651916cd43dd8448eb211c80319c"
    await fake_worker(W1, 2, 0)
    sched = await live.scheduler(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 1, "W1 in the view")
    tokens = list(range(40))
    arrival = time.time() - 5.0  # placed on another worker before, which handed it back
    req = IntakeRequest(request_id="x", input_len=40, block_hashes=chain_hashes(tokens, B),
                        block_size=B, arrival_s=arrival)
    data, headers = encode(req)
    headers.update(traceparent(trace))
    headers["Nats-Msg-Id"] = "x>w-cp2-g4"  # rankd's handback_msg_id: {source}>{worker}
    got = await results_for(nc, uniq, "x")
    before = time.time()
    await nc.jetstream().publish(Subjects(uniq).intake_requests(), data, headers=headers)
    await wait_until(lambda: got and of_trace(spans, trace, "schedule"), "x placed")
    (wait,) = of_trace(spans, trace, "intake_wait")
    assert wait.start_time >= int(before * 1e9) > int(arrival * 1e9)
    assert wait.attributes["vtm.handed_back"] is True
    assert wait.attributes["vtm.handed_back_by"] == "w-cp2-g4"
    assert wait.attributes["vtm.handback_cause"] == "worker"
    assert not of_trace(spans, trace, "handed_back")  # the worker's to record, not a replica's


async def test_a_placements_cache_stats_carry_its_request_context(
        live: Services, nc: Client, uniq: str,
        fake_worker: Callable[..., Awaitable[FakeWorker]]) -> None:
    """The cache statistics of a placement carry the request's root context in their
    headers: a copy the cache manager starts for that placement (a route-time pull) links
    its span to the request's trace (services/cachemgr/tracing.py). Before, they carried
    none, and the link was never made."""
    trace = "4af7651916cd43dd8448eb211c80319c"
    await fake_worker(W1, 2, 0)
    stats: list[Msg] = []
    sub = await nc.subscribe(Subjects(uniq).cache_stats_all(), cb=_keep(stats))
    try:
        sched = await live.scheduler(block_size=B)
        await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
        got = await results_for(nc, uniq, "x")
        await publish(nc, uniq, "x", trace)
        await wait_until(lambda: got and stats, "x's answer and its stats")
    finally:
        await sub.unsubscribe()
    assert (stats[0].headers or {}).get("traceparent") == traceparent(trace)["traceparent"]


def _keep(into: list[Msg]) -> Callable[[Msg], Awaitable[None]]:
    async def cb(msg: Msg) -> None:
        into.append(msg)
    return cb
