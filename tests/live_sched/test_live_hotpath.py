"""The request hot path after the performance work: pipelined dispatch keeps intake order, the
scheduler's queue view follows a FIFO worker's starts, the gateway's one result subscription
serves concurrent waiters, and the sampling test that lets unsampled requests skip span work."""

from __future__ import annotations

import asyncio
import time

from live_sched_support import Services, wait_until
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.scheduler.service import AssignmentRecord, assignment_bucket, with_trace_context
from shared.blockhash import chain_hashes
from shared.schemas import (
    Assignment,
    AssignmentAck,
    CompletionRequest,
    FirstToken,
    IntakeRequest,
    TtftStages,
    decode,
    encode,
    from_json,
)
from shared.subjects import Subjects
from shared.telemetry import is_sampled

B = 16
TRACE = "0af7651916cd43dd8448eb211c80319c"
SPAN = "b7ad6b7169203331"


def intake(rid: str, n_tokens: int = 40) -> IntakeRequest:
    tokens = list(range(n_tokens))
    return IntakeRequest(request_id=rid, input_len=n_tokens,
                         block_hashes=chain_hashes(tokens, B), block_size=B,
                         arrival_s=time.time())


async def publish(nc: Client, s: Subjects, req: IntakeRequest,
                  headers: dict[str, str] | None = None) -> None:
    data, hdrs = encode(req)
    headers = {**hdrs, **(headers or {})}
    headers["Nats-Msg-Id"] = req.request_id
    await nc.jetstream().publish(s.intake_requests(), data, headers=headers)


def first_token(rid: str, worker: str, finished_at_s: float) -> FirstToken:
    return FirstToken(request_id=rid, token=7, worker_id=worker, epoch=0,
                      predicted_prefill_s=0.1, stages=TtftStages(total_s=0.2),
                      finished_at_s=finished_at_s)


def test_is_sampled_reads_the_traceparent_flag() -> None:
    assert is_sampled({"traceparent": f"00-{TRACE}-{SPAN}-01"})
    assert is_sampled({"Traceparent": f"00-{TRACE}-{SPAN}-03"})  # other flag bits set too
    assert not is_sampled({"traceparent": f"00-{TRACE}-{SPAN}-00"})
    assert not is_sampled({"traceparent": f"00-{TRACE}-{SPAN}-02"})
    assert not is_sampled({"traceparent": "garbage"})
    assert not is_sampled({"traceparent": f"00-{TRACE}-{SPAN}-zz"})
    assert not is_sampled({"tracestate": "k=v"})
    assert not is_sampled({})
    assert not is_sampled(None)


def test_with_trace_context_carries_the_deliverys_context() -> None:
    """The assignment's request carries the context the scheduler's spans hang from (the
    root's), so the worker's stage spans hang from it too; no copy when it does already."""
    tp = f"00-{TRACE}-{SPAN}-01"
    req = intake("ctx-1")
    assert with_trace_context(req, {}) is req
    moved = with_trace_context(req, {"Traceparent": tp})  # a header key in another case
    assert moved.trace_context == {"traceparent": tp} and moved.request_id == "ctx-1"
    assert with_trace_context(moved, {"traceparent": tp}) is moved
    # A value the schema refuses leaves the request as it was.
    assert with_trace_context(req, {"traceparent": tp, "tracestate": "a\nb"}) is req


async def test_pipelined_dispatch_keeps_intake_order(live: Services, fake_worker,  # type: ignore[no-untyped-def]
                                                     nc: Client, uniq: str) -> None:
    """Many requests in flight at once reach the worker in intake order, each exactly once,
    every intake message is acked, and each ends with a ``dispatched`` record."""
    s = Subjects(uniq)
    w = await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=B, fetch_batch=8)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    rids = [f"pipe-{i:03d}" for i in range(40)]
    for rid in rids:
        await publish(nc, s, intake(rid))
    await wait_until(lambda: len(w.assignments) == len(rids), "every request dispatched")
    assert [a.request.request_id for a in w.assignments] == rids
    # (A result can overtake its own dispatch bookkeeping: the fake worker answers at once.)
    await wait_until(lambda: sched.stats.finished == len(rids), "every result seen")
    await wait_until(lambda: sched.stats.dispatched == len(rids), "every dispatch recorded")
    assert sched.stats.placed == len(rids)
    # The scheduler acks each message after both counts (its ack a plain publish on its own
    # connection, the work queue's removal the server's): stream_info on this one may come
    # first.
    deadline = time.monotonic() + 20
    while (await nc.jetstream().stream_info(s.intake_stream())).state.messages \
            and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    info = await nc.jetstream().stream_info(s.intake_stream())
    assert info.state.messages == 0  # all acked
    kv = await nc.jetstream().key_value(assignment_bucket(s))

    async def states() -> set[str]:
        out = set()
        for rid in (rids[0], rids[17], rids[-1]):
            out.add(from_json(AssignmentRecord, (await kv.get(rid)).value).state)
        return out

    deadline = time.monotonic() + 20
    while (got := await states()) != {"dispatched"} and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert got == {"dispatched"}


async def test_queue_view_follows_the_fifo(live: Services, nc: Client, uniq: str) -> None:
    """A FIFO worker acks requests behind others with queue position > 0; when one's result
    comes out, the scheduler counts the next one as running from the worker's finish time
    (not placed-but-waiting with its whole prediction), as the simulator sees it."""
    s = Subjects(uniq)
    wid = "w-cp2-g0"
    admitted: list[str] = []

    async def on_assign(msg: Msg) -> None:
        a = decode(Assignment, msg.data, msg.headers)
        admitted.append(a.request.request_id)
        ack = AssignmentAck(request_id=a.request.request_id, worker_id=wid, epoch=a.epoch,
                            queue_position=len(admitted) - 1)
        data, _ = encode(ack)
        await msg.respond(data)

    sub = await nc.subscribe(s.worker_assign(wid), cb=on_assign)
    try:
        from live_sched_support import FakeWorker

        state_only = FakeWorker(nc, s, wid, 2, 0)
        await state_only.publish_state()
        sched = await live.scheduler(block_size=B)
        await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
        for rid in ("f-1", "f-2", "f-3"):
            await publish(nc, s, intake(rid, 400))
        await wait_until(lambda: sched.stats.dispatched == 3, "three dispatched")
        load = sched.core.loads[wid]
        assert (load.running, load.waiting) == (1, 2)  # f-1 started at its ack
        full = load.queue_delay(time.time())

        t1 = time.time()
        data, headers = encode(first_token("f-1", wid, t1))
        await nc.publish(s.result("f-1"), data, headers=headers)
        await wait_until(lambda: sched.stats.finished == 1, "f-1's result")
        assert (load.running, load.waiting) == (1, 1)
        started = load.assignment("f-2").started_at
        assert started is not None
        assert started == max(t1, load.assignment("f-2").reserved_at)
        assert sched.stats.starts_inferred == 1
        # f-1's share is gone and f-2 now only counts what remains of it.
        assert load.queue_delay(time.time()) < full

        data, headers = encode(first_token("f-2", wid, time.time()))
        await nc.publish(s.result("f-2"), data, headers=headers)
        await wait_until(lambda: sched.stats.finished == 2, "f-2's result")
        assert (load.running, load.waiting) == (1, 0)
        data, headers = encode(first_token("f-3", wid, time.time()))
        await nc.publish(s.result("f-3"), data, headers=headers)
        await wait_until(lambda: sched.stats.finished == 3, "f-3's result")
        assert len(load) == 0 and sched.stats.starts_inferred == 2
    finally:
        await sub.unsubscribe()


async def test_one_result_subscription_serves_concurrent_waiters(live: Services, nc: Client,
                                                                 uniq: str) -> None:
    """A retried request id waits for the original's result; both callers get it from the
    gateway's single wildcard subscription; a result nobody waits for is ignored; nothing
    is left registered afterwards."""
    s = Subjects(uniq)
    gw = await live.gateway(block_size=B)
    body = CompletionRequest(prompt_tokens=list(range(40)), request_id="same-1")
    first = asyncio.create_task(gw.complete(body))
    await wait_until(lambda: len(gw._waiting.get("same-1", ())) == 1, "first waiting")
    second = asyncio.create_task(gw.complete(body))
    await wait_until(lambda: len(gw._waiting.get("same-1", ())) == 2, "second waiting")
    stray, headers = encode(first_token("nobody-waits", "w-cp2-g0", time.time()))
    await nc.publish(s.result("nobody-waits"), stray, headers=headers)
    data, headers = encode(first_token("same-1", "w-cp2-g0", time.time()))
    await nc.publish(s.result("same-1"), data, headers=headers)
    a, b = await asyncio.wait_for(asyncio.gather(first, second), timeout=20)
    assert (a.result.token, b.result.token) == (7, 7)
    assert (a.duplicate, b.duplicate) == (False, True)
    assert gw._waiting == {}


async def test_request_held_until_a_worker_is_eligible(live: Services, fake_worker,  # type: ignore[no-untyped-def]
                                                       nc: Client, uniq: str,
                                                       spans: InMemorySpanExporter) -> None:
    """No eligible worker (as while every worker switches): the message is kept and placed
    when the worker view changes, not NAKed for retry_delay_s; past hold_s it is NAKed.
    The hold is intake wait in the spans as in the breakdown: the ``intake_wait`` span ends
    at the placement's dequeue stamp, where the ``schedule`` span starts."""
    s = Subjects(uniq)
    sched = await live.scheduler(block_size=B, hold_s=10.0, retry_delay_s=5.0)
    # The trace context in the headers only (a publisher other than the gateway).
    await publish(nc, s, intake("held-1"),
                  headers={"traceparent": f"00-{TRACE}-{SPAN}-01"})
    # Fetched and held: the scheduler waits for a change of its worker view (a future that
    # exists only while a request is held), rather than NAKing it for retry_delay_s.
    await wait_until(lambda: sched._view_changed is not None, "the request held")
    assert sched.stats.retried == 0 and sched.stats.placed == 0
    w = await fake_worker("w-cp2-g0", 2, 0)
    await wait_until(lambda: len(w.assignments) == 1, "placed once the worker appeared")
    await wait_until(lambda: sched.stats.dispatched >= 1, "the dispatch recorded (ack received)")
    assert sched.stats.retried == 0 and sched.stats.dispatched == 1
    # The hold counts as intake wait: dequeued (placed) after the worker came.
    a = w.assignments[0]
    assert a.dequeued_at_s is not None and a.dequeued_at_s >= a.request.arrival_s
    # The assignment carries the root's context to the worker (its stage spans' parent).
    assert a.request.trace_context == {"traceparent": f"00-{TRACE}-{SPAN}-01"}
    await wait_until(lambda: {"intake_wait", "schedule"} <= {
        x.name for x in spans.get_finished_spans()}, "the scheduler's spans ended")
    by_name = {x.name: x for x in spans.get_finished_spans()
               if format(x.context.trace_id, "032x") == TRACE}
    wait, sched_span = by_name["intake_wait"], by_name["schedule"]
    for x in (wait, sched_span):
        assert x.parent is not None and format(x.parent.span_id, "016x") == SPAN
    placed_ns = int(a.dequeued_at_s * 1e9)
    assert wait.start_time == int(a.request.arrival_s * 1e9)
    assert wait.end_time == placed_ns == sched_span.start_time
    # Held from its first dequeue (after its arrival) until the worker came.
    assert 0 < wait.attributes["vtm.held_s"] <= a.dequeued_at_s - a.request.arrival_s


async def test_hold_expires_into_a_retry(live: Services, nc: Client, uniq: str) -> None:
    s = Subjects(uniq)
    sched = await live.scheduler(block_size=B, hold_s=0.2, retry_delay_s=0.05, max_deliver=2)
    await publish(nc, s, intake("never-1"))
    await wait_until(lambda: sched.stats.failed == 1, "failed after its deliveries")
    assert sched.stats.retried == 1 and sched.stats.dispatched == 0
