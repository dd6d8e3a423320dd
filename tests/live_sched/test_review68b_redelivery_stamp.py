"""A give-back's stamp (``AssignmentRecord.naked_at_s``) times the one redelivery it gave
back, never a later one (real nats-server, a scheduler in-process, a worker whose state is
fresh but who answers no assignment).

A dead replica's record of a ``dispatching`` assignment (it died mid-dispatch) is given back
by the next process of that replica, stamped. The redelivery re-sends the assignment; the
worker does not answer (no responders: outcome unknown), so the record is kept as it is and
the message NAK'ed for a retry (once the worker's lease runs out; that delivery then hands
it back for the gone worker). The retry's delivery read the same stamp and recorded a
second ``intake_redelivery_wait`` from the old NAK -- overlapping the first one and the retry's
own spans (its wait is the ``vtm.retry`` intake wait) -- and so on for every later delivery.
"""

from __future__ import annotations

import time

from live_sched_support import FakeWorker, Services, wait_until
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_trace68_redelivery_wait import ACK_WAIT_S, W1, B, dead_replica_takes, publish, waits

from services.scheduler.service import AssignmentRecord, SchedulerService, assignment_bucket
from shared.schemas import to_json
from shared.service import ensure_intake_stream
from shared.subjects import Subjects


async def test_a_stamp_times_only_the_redelivery_it_gave_back(
        live: Services, nc: Client, uniq: str, spans: InMemorySpanExporter,
        fake_worker) -> None:  # type: ignore[no-untyped-def]
    trace = "aaf7651916cd43dd8448eb211c80319c"
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    await js.add_consumer(s.intake_stream(), ConsumerConfig(
        durable_name=s.intake_consumer(), ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S,
        max_deliver=5, max_ack_pending=1000, filter_subject=s.intake_requests()))
    w: FakeWorker = await fake_worker(W1, 2, 0, reply_results=False)
    await w.stop()  # its state stays fresh (not gone), but nobody answers its assignments
    req = await publish(nc, uniq, "orphan", trace)
    held = await dead_replica_takes(nc, uniq)
    kv = await js.create_key_value(bucket=assignment_bucket(s))
    await kv.put("orphan", to_json(AssignmentRecord(
        request_id="orphan", stream_seq=held.metadata.sequence.stream, msg_id="orphan",
        worker_id=W1, epoch=0, degree=2, predicted_s=0.01, state="dispatching",
        scheduler="sched-dead", assigned_at_s=req.arrival_s, ack_subject=held.reply)))
    b: SchedulerService = await live.scheduler(block_size=B, ack_wait_s=ACK_WAIT_S,
                                               instance_id="sched-dead", retry_delay_s=0.05)
    assert b.stats.predecessor_naked == 1
    # Delivery 2 (the give-back's) re-sent it; the retry's delivery (once the worker's lease
    # ran out: outcome unknown waits for that) finds the worker gone and hands it back.
    await wait_until(lambda: b.stats.dispatch_unknown >= 1 and b.stats.gone_handed_back >= 1,
                     "the retry's delivery handed back", timeout_s=60)
    got = waits(spans, trace)
    # The give-back's redelivery only (before: the retry's delivery 3 as well, from that NAK).
    assert [x.attributes["vtm.delivery"] for x in got if x.attributes] == [2]
    (wait,) = got
    assert wait.end_time is not None and wait.end_time <= int(time.time() * 1e9)
