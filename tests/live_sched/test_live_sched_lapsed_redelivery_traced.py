"""A request whose intake message a replica took and never answered (it died: no ack, NAK or
in-progress) is redelivered after the consumer's ``ack_wait`` to another replica, and its
trace covers that wait (real nats-server, the scheduler in-process, fake workers; the dead
replica is a raw pull consumer on the scheduler's durable that fetches and never acks).

The redelivery's ``intake_wait`` (``vtm.redelivered``, ``vtm.delivery``) starts at
``max(arrival, dequeue - ack_wait)``, ``ack_wait`` the consumer's own (not the replica's
setting): the previous delivery was no later than that, so the span overlaps none of the
trace's earlier stage spans. Before, a redelivery that this replica had not NAK'ed recorded
only a hold, and a scheduler crash left a hole of ``ack_wait`` in each trace it touched while
the gateway's ``vtm.request.stage{intake_wait}`` (dequeue - arrival) counted it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from live_sched_support import FakeWorker, Services, results_for, wait_until
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared.blockhash import chain_hashes
from shared.schemas import IntakeRequest, encode
from shared.service import ensure_intake_stream
from shared.subjects import Subjects
from shared.telemetry import Stage

B = 16
W1 = "w-cp2-g0"
SPAN = "b7ad6b7169203331"
ACK_WAIT_S = 1.0  # the consumer's; the replicas' own setting says otherwise (2.0)
SETTING_S = 2.0
STAGES = (str(Stage.INTAKE_WAIT), str(Stage.SCHEDULE))


async def intake_consumer(nc: Client, uniq: str) -> None:
    """The intake stream and the schedulers' durable, as a replica makes it, with a short
    ack_wait: every replica started later binds to it and keeps it."""
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    await js.add_consumer(s.intake_stream(), ConsumerConfig(
        durable_name=s.intake_consumer(), ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S,
        max_deliver=5, max_ack_pending=1000, filter_subject=s.intake_requests()))


async def publish(nc: Client, uniq: str, rid: str, trace: str) -> IntakeRequest:
    req = IntakeRequest(request_id=rid, input_len=40, block_hashes=chain_hashes(range(40), B),
                        block_size=B, arrival_s=time.time())
    data, headers = encode(req)
    headers["traceparent"] = f"00-{trace}-{SPAN}-01"
    headers["Nats-Msg-Id"] = rid
    await nc.jetstream().publish(Subjects(uniq).intake_requests(), data, headers=headers)
    return req


async def dead_replica_takes(nc: Client, uniq: str) -> Msg:
    """One delivery to a 'replica' that dies with it: fetched on the schedulers' durable,
    never acked, NAK'ed nor marked in progress."""
    s = Subjects(uniq)
    sub = await nc.jetstream().pull_subscribe_bind(durable=s.intake_consumer(),
                                                   stream=s.intake_stream())
    try:
        (msg,) = await sub.fetch(1, timeout=20)
    finally:
        await sub.unsubscribe()
    return msg


def stage_spans(spans: InMemorySpanExporter, trace: str) -> list[ReadableSpan]:
    """The trace's finished TTFT stage spans (a scheduler's), by start time."""
    return sorted((s for s in spans.get_finished_spans()
                   if s.name in STAGES and format(s.context.trace_id, "032x") == trace),
                  key=lambda s: s.start_time)


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


async def test_a_redelivery_after_a_dead_replica_waits_in_intake_from_its_lapse(
        live: Services, nc: Client, uniq: str, spans: InMemorySpanExporter,
        fake_worker: Callable[..., Awaitable[FakeWorker]]) -> None:
    trace = "5af7651916cd43dd8448eb211c80319c"
    await intake_consumer(nc, uniq)
    w = await fake_worker(W1, 2, 0)
    got = await results_for(nc, uniq, "x")
    req = await publish(nc, uniq, "x", trace)
    first = await dead_replica_takes(nc, uniq)
    assert first.metadata.num_delivered == 1
    stored = first.metadata.timestamp.timestamp()  # the server's stored stamp
    sched = await live.scheduler(block_size=B, ack_wait_s=SETTING_S)
    await wait_until(lambda: got and named(stage_spans(spans, trace), "schedule"),
                     "x redelivered and placed")
    assert [(t.worker_id, t.error) for t in got] == [(W1, None)], got
    # The dispatch is counted after the worker's ack is settled, which may come after the
    # worker's result reached this test (CI saw 0 here once).
    await wait_until(lambda: sched.stats.dispatched >= 1, "the dispatch recorded")
    assert sched.stats.dispatched == 1
    (a,) = w.assignments
    dequeued = a.dequeued_at_s
    assert dequeued is not None
    (wait,) = named(stage_spans(spans, trace), "intake_wait")
    (sched_span,) = named(stage_spans(spans, trace), "schedule")
    assert sched_span.attributes["vtm.delivery"] == 2
    assert wait.attributes["vtm.redelivered"] is True
    assert wait.attributes["vtm.delivery"] == 2
    assert "vtm.retry" not in wait.attributes
    # From the lapse on: the consumer's ack_wait back from the redelivery's dequeue, which
    # is after the first delivery (after the message was stored and arrived).
    lapse = dequeued - ACK_WAIT_S
    assert lapse >= stored >= req.arrival_s
    assert wait.start_time == int(max(req.arrival_s, lapse) * 1e9)
    assert wait.end_time == int(dequeued * 1e9) == sched_span.start_time
    assert format(wait.parent.span_id, "016x") == SPAN
    # The breakdown's intake wait (dequeue - arrival) holds the span: what it leaves out is
    # the dead replica's delivery, from the arrival to the lapse bound.
    (ft,) = got
    covered = (wait.end_time - wait.start_time) / 1e9
    assert covered <= ft.stages.intake_wait_s + 1e-6
    assert abs(ft.stages.intake_wait_s - covered - (lapse - req.arrival_s)) < 1e-6


async def test_a_lapsed_redelivery_does_not_overlap_an_earlier_attempt(
        live: Services, nc: Client, uniq: str, spans: InMemorySpanExporter,
        fake_worker: Callable[..., Awaitable[FakeWorker]]) -> None:
    """Delivery 1: a replica finds no worker and NAKs (its spans end at the NAK), then
    stops; delivery 2: a replica that dies with it; delivery 3: a replica with a worker. The
    third delivery's wait starts after every stage span of the first."""
    trace = "6af7651916cd43dd8448eb211c80319c"
    await intake_consumer(nc, uniq)
    first = await live.scheduler(block_size=B, hold_s=0.05, retry_delay_s=2.0,
                                 ack_wait_s=SETTING_S)
    got = await results_for(nc, uniq, "x")
    req = await publish(nc, uniq, "x", trace)
    await wait_until(lambda: first.stats.retried == 1
                     and named(stage_spans(spans, trace), "schedule"), "x NAK'ed")
    await live.stop(first)  # before its NAK's delay is over: delivery 2 is the dead one's
    earlier = stage_spans(spans, trace)
    assert [s.name for s in earlier] == list(STAGES), earlier
    second = await dead_replica_takes(nc, uniq)
    assert second.metadata.num_delivered == 2
    w = await fake_worker(W1, 2, 0)
    await live.scheduler(block_size=B, ack_wait_s=SETTING_S)
    await wait_until(lambda: got and len(named(stage_spans(spans, trace), "schedule")) == 2,
                     "x redelivered and placed")
    assert [(t.worker_id, t.error) for t in got] == [(W1, None)], got
    (a,) = w.assignments
    assert a.dequeued_at_s is not None
    later = [s for s in stage_spans(spans, trace) if s not in earlier]
    wait, sched_span = later
    assert wait.name == "intake_wait" and sched_span.name == "schedule"
    assert wait.attributes["vtm.redelivered"] is True
    assert wait.attributes["vtm.delivery"] == sched_span.attributes["vtm.delivery"] == 3
    assert "vtm.retry" not in wait.attributes
    assert wait.start_time == int(max(req.arrival_s, a.dequeued_at_s - ACK_WAIT_S) * 1e9)
    assert wait.end_time == sched_span.start_time
    # No overlap: it starts after the first attempt's spans ended (at that replica's NAK).
    assert wait.start_time >= max(s.end_time for s in earlier)


async def test_held_messages_are_kept_in_progress_by_the_consumers_ack_wait(
        live: Services, nc: Client, uniq: str,
        fake_worker: Callable[..., Awaitable[FakeWorker]]) -> None:
    """A replica whose own ``ack_wait_s`` is longer than the durable's (made by another
    replica, it keeps the ack_wait it was made with) marks its held messages in progress by
    the durable's: a dispatched request whose result is slow is not redelivered meanwhile.
    Before, the renewal period was the setting's third (3 s here) while the durable gave up
    after 1 s: the message came back, and its assignment was re-sent to the worker."""
    await intake_consumer(nc, uniq)  # ack_wait 1 s
    w = await fake_worker(W1, 2, 0, reply_results=False)
    got = await results_for(nc, uniq, "slow")
    sched = await live.scheduler(block_size=B, ack_wait_s=9.0)
    await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
    await publish(nc, uniq, "slow", "6af7651916cd43dd8448eb211c80319c")
    await wait_until(lambda: len(w.assignments) == 1, "slow dispatched")
    s = Subjects(uniq)
    # Three of the durable's ack_waits: long enough for a redelivery without renewals.
    await asyncio.sleep(3 * ACK_WAIT_S)
    info = await nc.jetstream().consumer_info(s.intake_stream(), s.intake_consumer())
    assert info.num_redelivered == 0 and len(w.assignments) == 1
    await w.answer(w.assignments[0])
    await wait_until(lambda: got, "slow answered")
    assert (sched.stats.dispatched, sched.stats.adopted) == (1, 0)
