"""Exactly once when a dispatch's outcome is unknown (real nats-server, services in-process).

1. *The worker's answer is lost.* The scheduler sends x's assignment to W; W admits it, but
   the scheduler sees a timeout. Before the fix the scheduler deleted its record and NAK'ed,
   and the next delivery placed x afresh — with the ``round_robin`` policy, on W2: x ran
   twice. Now the ``dispatching`` record is kept and the next delivery re-sends to W under
   the same intake message id, which W answers idempotently (x still running), or — if this
   scheduler saw x's first token meanwhile — is acked without a re-send.
2. *The worker stopped.* Scheduler A places x (message M1) on W, which queues it behind a long
   request; A dies before its ``dispatched`` record. W is stopped: it hands x back to intake
   (message M2, ``Nats-Msg-Id`` ``{M1}>{W}``) and leaves a final UNAVAILABLE state with an
   empty queue. Scheduler B handles M1's redeliveries before M2. Before the fix B re-sent the
   assignment, got "no responders", deleted the record and NAK'ed, and the next delivery of
   M1 was placed afresh (on W2) beside M2 (on W3): x ran twice. Now B knows W is gone and
   hands x back on W's behalf under the same id, which intake de-duplicates against W's own
   hand-back; B acks M1 and x runs once (M2, on W3).

Nothing is left to chance: a scheduler subclass loses exactly one answer after the worker
admitted (1); a gated scheduler holds M2 until M1 is settled and only W3 is ACTIVE, so a
second placement shows on a worker of its own (2). Waits are bounded by events (the
scheduler's acks), never timed assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import nats
import nats.errors
import pytest
from live_accept_support import (
    BLOCKER_LEN,
    CRASH_MAX_DELIVER,
    ActingController,
    DiesBeforeDispatchedRecord,
    InProcess,
    ResultTap,
    wait_until,
)
from nats.aio.msg import Msg
from nats.micro.request import Request
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.rankd.service import RankdService
from services.scheduler.service import SchedulerService
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
    AssignmentAck,
    FirstToken,
    IntakeRequest,
    TtftStages,
    decode,
    encode,
)
from shared.service import epoch_kv
from shared.worker import Lifecycle

W, W2, W3 = "w-cp2-g0", "w-cp2-g2", "w-cp2-g4"


class RecordingRankd(RankdService):
    """rankd that remembers the request id of every assignment it answered with an ack."""

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.admitted: list[str] = []

    async def _on_assign(self, request: Request) -> AssignmentAck:
        ack = await super()._on_assign(request)
        self.admitted.append(ack.request_id)
        return ack


async def start_rankd(live: InProcess, wid: str, **kw: Any) -> RecordingRankd:
    svc: RecordingRankd = await live.blocked_rankd(wid, cls=RecordingRankd, **kw)
    return svc


async def publish_intake(nc: Any, live: InProcess, rid: str, length: int = 40, *,
                         traceparent: str | None = None) -> None:
    req = IntakeRequest(request_id=rid, input_len=length, block_size=16, arrival_s=time.time())
    data, headers = encode(req)
    headers["Nats-Msg-Id"] = rid
    if traceparent is not None:
        headers["traceparent"] = traceparent
    await nc.jetstream().publish(live.subjects.intake_requests(), data, headers=headers)


@contextlib.asynccontextmanager
async def running(nats_server: EmbeddedNats) -> AsyncIterator[tuple[InProcess, Any, ResultTap]]:
    """Services in this process under a fresh prefix, a client and a tap of every result;
    everything closed afterwards."""
    live = InProcess(nats_server.url, "t" + os.urandom(5).hex())
    nc = await nats.connect(nats_server.url, connect_timeout=5)
    tap = await ResultTap(nc, live.subjects).start()
    try:
        yield live, nc, tap
    finally:
        await live.close()
        await tap.stop()
        await nc.drain()


class LosesOneAnswer(SchedulerService):
    """The worker admits x's first assignment, but its answer never reaches us: a timeout is
    raised instead — at once, or (``after_result``) once x's first token was seen here."""

    rid = "lost-x"
    after_result = False

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.lost = 0

    async def _dispatch(self, a: Assignment, headers: dict[str, str]) -> AssignmentAck:
        ack = await super()._dispatch(a, headers)
        if a.request.request_id == self.rid and not self.lost:
            self.lost += 1
            if self.after_result:
                await wait_until(lambda: self.rid in self._served, "x served")
            raise nats.errors.TimeoutError
        return ack


@pytest.mark.parametrize("x_state", ["running", "finished"])
async def test_lost_answer_is_not_placed_again(nats_server: EmbeddedNats, x_state: str) -> None:
    rid = LosesOneAnswer.rid
    async with running(nats_server) as (live, nc, tap):
        w = await start_rankd(live, W)
        w2 = await start_rankd(live, W2)
        LosesOneAnswer.after_result = x_state == "finished"
        # round_robin: a fresh placement after W is W2, so a second placement shows.
        sched = await live.scheduler(cls=LosesOneAnswer, policy="round_robin", block_size=16,
                                     retry_delay_s=0.05)
        await wait_until(lambda: len(sched.core.view) == 2, "both workers in the view")
        # "running": x holds W for the whole test; "finished": it is done in a moment.
        await publish_intake(nc, live, rid, BLOCKER_LEN if x_state == "running" else 40)
        # The message is acked only once settled: a re-send W answered, or x's token seen.
        await wait_until(lambda: sched.stats.dispatched + sched.stats.finished_acked == 1,
                         "x's message settled")
        assert w2.admitted == []  # never placed a second time
        assert sched.lost == 1 and sched.stats.dispatch_unknown == 1, sched.stats
        if x_state == "running":
            # The send whose answer was lost, then the re-send W answered idempotently.
            assert w.admitted == [rid, rid]
            assert sched.stats.resent == 1 and sched.stats.dispatched == 1, sched.stats
            assert [j.request_id for j in (w.core.running, *w.core.queued) if j] == [rid]
        else:
            assert w.admitted == [rid]
            assert sched.stats.finished_acked == 1 and sched.stats.resent == 0, sched.stats
            # The scheduler saw x's first token on its own connection: the tap's copy may be
            # later.
            await wait_until(lambda: any(r.request_id == rid for r in tap.results),
                             "x's first token at the tap")
            runs = [(r.worker_id, r.error) for r in tap.results if r.request_id == rid]
            assert runs == [(W, None)], runs


class NeverHearsBack(SchedulerService):
    """Every answer about x is lost: after the worker admitted it (``admit``), or because the
    assignment never reached it (not ``admit``)."""

    rid = "unheard-x"
    admit = True

    async def _dispatch(self, a: Assignment, headers: dict[str, str]) -> AssignmentAck:
        if a.request.request_id != self.rid:
            return await super()._dispatch(a, headers)
        if self.admit:
            await super()._dispatch(a, headers)
        raise nats.errors.TimeoutError


@pytest.mark.parametrize("admitted", [True, False])
async def test_last_delivery_asks_the_worker_before_failing(nats_server: EmbeddedNats,
                                                            admitted: bool) -> None:
    """On its last delivery x's outcome is still unknown. The scheduler asks W's ``queue``
    endpoint: W runs x, so no error goes to the client (W's first token will answer) and the
    message is acked; W never got x, so the client gets an error FirstToken as before."""
    rid = NeverHearsBack.rid
    async with running(nats_server) as (live, nc, tap):
        w = await start_rankd(live, W)
        NeverHearsBack.admit = admitted
        sched = await live.scheduler(cls=NeverHearsBack, policy="round_robin", block_size=16,
                                     retry_delay_s=0.05, max_deliver=2)
        await wait_until(lambda: len(sched.core.view) == 1, "W in the view")
        await publish_intake(nc, live, rid, BLOCKER_LEN)
        await wait_until(lambda: sched.stats.unknown_held + sched.stats.failed == 1,
                         "x's last delivery settled")
        assert sched.stats.dispatch_unknown == 2 and sched.stats.resent == 1, sched.stats
        if admitted:
            assert sched.stats.unknown_held == 1 and sched.stats.failed == 0, sched.stats
            assert [j.request_id for j in (w.core.running, *w.core.queued) if j] == [rid]
            assert not [r for r in tap.results if r.request_id == rid]  # no error sent
        else:
            assert sched.stats.failed == 1 and w.admitted == [], sched.stats
            await wait_until(lambda: any(r.request_id == rid for r in tap.results),
                             "the error FirstToken")
            [err] = [r for r in tap.results if r.request_id == rid]
            assert err.error is not None and "did not answer" in err.error


class RanBeforeAsked(SchedulerService):
    """x's assignment reaches W once, and W's answer is lost; the re-send is lost outright;
    this replica misses x's first token (a core message lost, say). W has run x by the time
    the last delivery asks W whether it holds x."""

    rid = "ran-x"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.sent = 0

    async def _dispatch(self, a: Assignment, headers: dict[str, str]) -> AssignmentAck:
        if a.request.request_id != self.rid:
            return await super()._dispatch(a, headers)
        self.sent += 1
        if self.sent == 1:
            await super()._dispatch(a, headers)
        raise nats.errors.TimeoutError

    async def _on_result(self, msg: Msg) -> None:
        if msg.subject != self.subjects.result(self.rid):
            await super()._on_result(msg)

    async def _worker_holds(self, worker_id: str, request_id: str, arrival_s: float) -> bool:
        while request_id == self.rid and not await self._result_kept(request_id):
            await asyncio.sleep(0.02)  # W has not run x yet
        return await super()._worker_holds(worker_id, request_id, arrival_s)


async def test_last_delivery_of_a_request_already_answered_sends_no_error(
        nats_server: EmbeddedNats) -> None:
    """Every answer about x's dispatch is lost, and W runs x before the last delivery gives
    up: x's first token has gone out, so no error FirstToken follows it (it would replace x's
    answer in the results stream, where a client asking again reads it); the message is
    acked."""
    rid = RanBeforeAsked.rid
    async with running(nats_server) as (live, nc, tap):
        w = await start_rankd(live, W)
        sched = await live.scheduler(cls=RanBeforeAsked, policy="round_robin", block_size=16,
                                     retry_delay_s=0.05, max_deliver=2)
        await wait_until(lambda: len(sched.core.view) == 1, "W in the view")
        await publish_intake(nc, live, rid)
        await wait_until(lambda: sched.stats.fail_found_answered + sched.stats.failed == 1,
                         "x's last delivery settled")
        assert sched.stats.fail_found_answered == 1 and sched.stats.failed == 0, sched.stats
        assert sched.stats.unknown_held == 0 and w.admitted == [rid], sched.stats
        # What a client asking again reads: x's answer, not an error after it.
        kept = await nc.jetstream().get_last_msg(live.subjects.results_stream(),
                                                 live.subjects.result(rid))
        assert decode(FirstToken, kept.data, kept.headers).error is None
        # The scheduler read x's first token from the results stream: the tap's copy (a
        # delivery of its own) may be later.
        await wait_until(lambda: any(r.request_id == rid for r in tap.results),
                         "x's first token at the tap")
        assert [(r.worker_id, r.error) for r in tap.results if r.request_id == rid] \
            == [(W, None)]


class LaggingView(LosesOneAnswer):
    """As LosesOneAnswer, with a worker-state view that judges W gone (a heartbeat it has not
    seen yet, say) while W is alive and running x."""

    rid = "lagging-x"

    def worker_gone(self, worker_id: str) -> bool:
        return worker_id == W or super().worker_gone(worker_id)


async def test_a_worker_judged_gone_that_holds_the_request_gets_it_re_sent(
    nats_server: EmbeddedNats,
) -> None:
    """x's first answer is lost and the view says W is gone. W's ``queue`` endpoint still lists
    x, so the redelivery re-sends it to W (answered idempotently) instead of handing x back
    for another worker: x is placed once. Handing it back put it on W2 as well."""
    rid = LaggingView.rid
    async with running(nats_server) as (live, nc, _):
        w = await start_rankd(live, W)
        w2 = await start_rankd(live, W2)
        LaggingView.after_result = False
        sched = await live.scheduler(cls=LaggingView, policy="round_robin", block_size=16,
                                     retry_delay_s=0.05)
        await wait_until(lambda: len(sched.core.view) == 2, "both workers in the view")
        await publish_intake(nc, live, rid, BLOCKER_LEN)
        await wait_until(lambda: sched.stats.dispatched == 1, "x's re-send answered")
        assert sched.stats.gone_handed_back == 0 and sched.stats.resent == 1, sched.stats
        assert w.admitted == [rid, rid] and w2.admitted == []


class GatedScheduler(SchedulerService):
    """Scheduler B: handles nothing before its worker-state view has loaded; deliveries of M1
    (the original message) at once; M2 (W's hand-back) only once ``later`` is set."""

    rid = "gone-x"

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.later = asyncio.Event()
        self.handled: list[str] = []

    async def handle_intake(self, msg: Msg) -> None:
        await wait_until(lambda: self._states_loaded, "B's worker-state view loaded")
        kind = "M1" if (msg.headers or {}).get("Nats-Msg-Id") == self.rid else "M2"
        if kind == "M2":
            await self.later.wait()
        await super().handle_intake(msg)
        self.handled.append(kind)


async def test_stopped_worker_request_is_handed_back_once(
        nats_server: EmbeddedNats, spans: InMemorySpanExporter) -> None:
    rid = GatedScheduler.rid
    trace = "8af7651916cd43dd8448eb211c80319c"
    async with running(nats_server) as (live, nc, tap):
        w = await start_rankd(live, W)
        await live.occupy(nc, w, "gone-blocker")
        a = await live.scheduler(cls=DiesBeforeDispatchedRecord, block_size=16,
                                 ack_wait_s=1.0, max_deliver=CRASH_MAX_DELIVER,
                                 instance_id="sched-a")
        await wait_until(lambda: len(a.core.view) == 1, "W in A's view")
        await publish_intake(nc, live, rid, traceparent=f"00-{trace}-b7ad6b7169203331-01")
        await wait_until(lambda: any(j.request_id == rid for j in w.core.queued),
                         "x queued on W")
        await live.stop(a)  # M1 unacked, its record "dispatching" on W

        w2 = await start_rankd(live, W2)
        w3 = await start_rankd(live, W3)
        kv = await epoch_kv(nc.jetstream(), live.subjects)
        rec = ActingController._make(1, {W: Lifecycle.ACTIVE, W2: Lifecycle.ACTIVE},
                                     "W and W2")
        await kv.put(live.subjects.epoch_key(), rec.model_dump_json().encode())
        await wait_until(lambda: all(s.core.epoch == 1 for s in (w, w2, w3)),
                         "epoch 1 adopted")
        # W stops: x goes back to intake as M2; its last state is UNAVAILABLE, queue empty.
        await live.stop(w)

        b = await live.scheduler(cls=GatedScheduler, block_size=16, ack_wait_s=1.0,
                                 max_deliver=CRASH_MAX_DELIVER,
                                 retry_delay_s=0.05, instance_id="sched-b")
        # M1 is settled: acked after handing x back for W (or, before the fix, after placing
        # it afresh on W2, the only ACTIVE worker).
        await wait_until(lambda: b.stats.gone_handed_back + b.stats.dispatched >= 1,
                         "M1 settled at B")
        # From here only W3 is ACTIVE: M2's placement lands there.
        rec = ActingController._make(2, {W2: Lifecycle.DRAINING, W3: Lifecycle.ACTIVE},
                                     "drain W2")
        await kv.put(live.subjects.epoch_key(), rec.model_dump_json().encode())
        await wait_until(lambda: any(v.worker_id == W3 and v.lifecycle is Lifecycle.ACTIVE
                                     for v in b.core.view.workers), "W3 ACTIVE in B's view")
        b.later.set()
        await wait_until(lambda: "M2" in b.handled, "B handled M2")
        await wait_until(lambda: rid in tap.ok_ids(), "x's first token")
        # W2 never saw x; W3 ran it once (M2); B handed x back for W under W's own id, which
        # intake had stored already (so no third message exists).
        assert w2.admitted == [] and w3.admitted == [rid]
        assert b.stats.gone_handed_back == 1 and b.stats.gone_in_intake == 1, b.stats
        assert b.stats.dispatched == 1, b.stats  # M2 only
        runs = [(r.worker_id, r.error) for r in tap.results if r.request_id == rid]
        assert runs == [(W3, None)], runs
        await wait_until(lambda: any(s.attributes.get("vtm.handed_back")
                                     for s in of_trace(spans, trace, "intake_wait")),
                         "M2's intake wait traced")
    # One hand-back, one span: W's own (M2, stored first), up to its stamp, where M2's intake
    # wait starts; B's publish for the gone W, a duplicate of it, records none. Before, the
    # only span was B's (cause "gone"), ending after M2's intake wait had begun; with W's
    # own span and no check of the duplicate, there were two.
    (back,) = of_trace(spans, trace, "handed_back")
    assert (back.attributes["vtm.worker_id"], back.attributes["vtm.cause"]) == (W, "stopping")
    (wait,) = [s for s in of_trace(spans, trace, "intake_wait")
               if s.attributes.get("vtm.handed_back")]
    assert wait.start_time == back.end_time
    assert wait.attributes["vtm.handback_cause"] == "stopping"


def of_trace(spans: InMemorySpanExporter, trace: str, name: str) -> list[Any]:
    """The trace's finished spans named ``name``, by start time."""
    return sorted((s for s in spans.get_finished_spans()
                   if s.name == name and format(s.context.trace_id, "032x") == trace),
                  key=lambda s: s.start_time)


async def test_an_earlier_requests_answer_under_the_same_id_does_not_count(
        nats_server: EmbeddedNats) -> None:
    """The results stream keeps a first token for x's id that finished before x arrived (an
    earlier request that used the id). x cannot be placed (no worker): its last delivery
    sends the error FirstToken as usual -- that old answer is not x's."""
    rid = "reused-x"
    async with running(nats_server) as (live, nc, tap):
        sched = await live.scheduler(policy="round_robin", block_size=16, retry_delay_s=0.05,
                                     max_deliver=2, hold_s=0.05)
        old = FirstToken(request_id=rid, token=7, worker_id=W,
                         finished_at_s=time.time() - 600.0, stages=TtftStages(total_s=0.1))
        data, headers = encode(old)
        await nc.jetstream().publish(live.subjects.result(rid), data, headers=headers)
        await publish_intake(nc, live, rid)
        await wait_until(lambda: sched.stats.fail_found_answered + sched.stats.failed == 1,
                         "x's last delivery settled")
        assert sched.stats.failed == 1 and sched.stats.fail_found_answered == 0, sched.stats
        await wait_until(lambda: any(r.request_id == rid and r.error for r in tap.results),
                         "the error FirstToken")
