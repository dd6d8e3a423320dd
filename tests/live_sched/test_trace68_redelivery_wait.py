"""The wait of a held intake message between the NAK that gives it back and its delivery to
the replica that takes it over is in the request's trace (real nats-server, schedulers
in-process, a fake worker that does not answer, so the message stays held).

A replica that stops NAKs what it holds; a replica that starts with a fixed id NAKs what its
dead predecessor held. Each stamps that NAK in the message's AssignmentRecord (``naked_at_s``,
``naked_by``; sampled traces only), and the replica that gets the redelivery records an
``intake_redelivery_wait`` span from the stamp to its dequeue, a child of the gateway's root.
Before, that wait was in no span: the stopped replica's spans ended at its dispatch, and the
adopter recorded nothing for a ``dispatched`` redelivery.
"""

from __future__ import annotations

import asyncio
import time

from live_sched_support import FakeWorker, Services, wait_until
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.scheduler.service import (
    REDELIVERY_WAIT_SPAN,
    AssignmentRecord,
    SchedulerService,
    assignment_bucket,
)
from shared.blockhash import chain_hashes
from shared.schemas import IntakeRequest, encode, from_json, to_json
from shared.service import ensure_intake_stream
from shared.subjects import Subjects

B = 16
W1 = "w-cp2-g0"
SPAN = "b7ad6b7169203331"
ACK_WAIT_S = 3600.0  # far above any wait here: only a NAK brings a message back


async def publish(nc: Client, uniq: str, rid: str, trace: str, *,
                  sampled: bool = True) -> IntakeRequest:
    req = IntakeRequest(request_id=rid, input_len=40, block_hashes=chain_hashes(range(40), B),
                        block_size=B, arrival_s=time.time())
    data, headers = encode(req)
    headers["traceparent"] = f"00-{trace}-{SPAN}-{'01' if sampled else '00'}"
    headers["Nats-Msg-Id"] = rid
    await nc.jetstream().publish(Subjects(uniq).intake_requests(), data, headers=headers)
    return req


async def record_of(nc: Client, uniq: str, rid: str) -> AssignmentRecord:
    kv = await nc.jetstream().key_value(assignment_bucket(Subjects(uniq)))
    entry = await kv.get(rid)
    assert entry.value
    return from_json(AssignmentRecord, entry.value)


def waits(spans: InMemorySpanExporter, trace: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == REDELIVERY_WAIT_SPAN
            and format(s.context.trace_id, "032x") == trace]


def dispatch_end(spans: InMemorySpanExporter, trace: str) -> int:
    (d,) = [s for s in spans.get_finished_spans() if s.name == "dispatch"
            and format(s.context.trace_id, "032x") == trace]
    assert d.end_time is not None
    return d.end_time


async def test_a_stopping_replicas_give_back_is_traced_to_the_next_delivery(
        live: Services, nc: Client, uniq: str, spans: InMemorySpanExporter,
        fake_worker) -> None:  # type: ignore[no-untyped-def]
    trace = "7af7651916cd43dd8448eb211c80319c"
    quiet = "8af7651916cd43dd8448eb211c80319c"
    w: FakeWorker = await fake_worker(W1, 2, 0, reply_results=False)
    a = await live.scheduler(block_size=B, ack_wait_s=ACK_WAIT_S, instance_id="sched-a")
    await wait_until(lambda: len(a.core.view) == 1, "worker in A's view")
    await publish(nc, uniq, "traced", trace)
    await publish(nc, uniq, "unsampled", quiet, sampled=False)
    await wait_until(lambda: {"traced", "unsampled"} <= set(a._held), "both held by A")
    before_stop = time.time()
    await live.stop(a)  # NAKs both; waits for the stamped records' store acknowledgements
    after_stop = time.time()
    stamped = await record_of(nc, uniq, "traced")
    assert stamped.naked_by == "sched-a" and stamped.naked_at_s is not None
    assert before_stop <= stamped.naked_at_s <= after_stop
    plain = await record_of(nc, uniq, "unsampled")  # no span to feed: no read, no stamp
    assert plain.naked_at_s is None and plain.naked_by == ""
    b = await live.scheduler(block_size=B, ack_wait_s=ACK_WAIT_S, instance_id="sched-b")
    await wait_until(lambda: b.stats.adopted == 2 and waits(spans, trace), "both adopted by B")
    adopted = time.time()
    assert len(w.assignments) == 2  # not dispatched again
    (wait,) = waits(spans, trace)
    assert format(wait.parent.span_id, "016x") == SPAN  # type: ignore[union-attr]
    assert wait.attributes is not None
    assert wait.attributes["vtm.naked_by"] == wait.attributes["vtm.holder"] == "sched-a"
    assert wait.attributes["vtm.worker_id"] == W1
    assert wait.attributes["vtm.delivery"] == 2
    assert wait.attributes["vtm.request_id"] == "traced"
    # From A's NAK (its stamp) to B's dequeue: after A's own spans of the request ended.
    assert wait.start_time == int(stamped.naked_at_s * 1e9)
    assert wait.start_time >= dispatch_end(spans, trace)
    assert wait.end_time is not None
    assert wait.start_time <= wait.end_time <= int(adopted * 1e9)
    assert not waits(spans, quiet)
    # The adoption rewrote the record without the stamp: a later hand-over of it (B dying,
    # say) is never timed from A's NAK.
    for _ in range(200):  # the adopter's record write is not awaited
        rec = await record_of(nc, uniq, "traced")
        if rec.holder == "sched-b":
            break
        await asyncio.sleep(0.05)
    assert rec.holder == "sched-b" and rec.naked_at_s is None and rec.naked_by == ""


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


async def test_a_dead_predecessors_give_back_is_traced_to_the_next_delivery(
        live: Services, nc: Client, uniq: str, spans: InMemorySpanExporter,
        fake_worker) -> None:  # type: ignore[no-untyped-def]
    """A replica with a fixed id NAKs at start what its dead predecessor (a raw consumer
    here, whose record says it dispatched the request and holds the message) held: the
    redelivery's wait is timed from that NAK, stamped by the new process."""
    trace = "9af7651916cd43dd8448eb211c80319c"
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    await js.add_consumer(s.intake_stream(), ConsumerConfig(
        durable_name=s.intake_consumer(), ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S,
        max_deliver=5, max_ack_pending=1000, filter_subject=s.intake_requests()))
    await fake_worker(W1, 2, 0, reply_results=False)
    req = await publish(nc, uniq, "orphan", trace)
    held = await dead_replica_takes(nc, uniq)
    assert held.metadata.num_delivered == 1
    kv = await js.create_key_value(bucket=assignment_bucket(s))
    await kv.put("orphan", to_json(AssignmentRecord(
        request_id="orphan", stream_seq=held.metadata.sequence.stream, msg_id="orphan",
        worker_id=W1, epoch=0, degree=2, predicted_s=0.01, state="dispatched",
        scheduler="sched-dead", assigned_at_s=req.arrival_s, ack_subject=held.reply)))
    before_start = time.time()
    b: SchedulerService = await live.scheduler(block_size=B, ack_wait_s=ACK_WAIT_S,
                                               instance_id="sched-dead")
    assert b.stats.predecessor_naked == 1
    await wait_until(lambda: waits(spans, trace), "the redelivery's wait recorded")
    (wait,) = waits(spans, trace)
    assert wait.attributes is not None
    assert wait.attributes["vtm.naked_by"] == wait.attributes["vtm.holder"] == "sched-dead"
    assert wait.attributes["vtm.delivery"] == 2
    assert format(wait.parent.span_id, "016x") == SPAN  # type: ignore[union-attr]
    assert wait.end_time is not None
    assert int(before_start * 1e9) <= wait.start_time <= wait.end_time
