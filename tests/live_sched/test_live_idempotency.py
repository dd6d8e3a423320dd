"""At-least-once intake, at-most-once dispatch: duplicate publishes are de-duplicated by the
stream, a redelivered message is acked without a second dispatch (also by a restarted
scheduler), and a redirect (same request id, new message id) is placed again."""

from __future__ import annotations

import asyncio
import time

from live_sched_support import Services, wait_until
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.rankd.core import handback_msg_id, joined_handback_msg_id
from services.scheduler.service import (
    AssignmentRecord,
    SchedulerService,
    SchedulerSettings,
    assignment_bucket,
)
from shared.blockhash import chain_hashes
from shared.ids import RequestId
from shared.schemas import (
    Assignment,
    AssignmentAck,
    FirstToken,
    IntakeRequest,
    TtftStages,
    WindowReport,
    decode,
    encode,
    from_json,
)
from shared.subjects import Subjects

B = 16
TOKENS = list(range(40))


def intake(rid: str) -> IntakeRequest:
    return IntakeRequest(request_id=rid, input_len=len(TOKENS),
                         block_hashes=chain_hashes(TOKENS, B), block_size=B,
                         arrival_s=time.time())


async def publish(nc: Client, s: Subjects, req: IntakeRequest, msg_id: str | None = None):  # type: ignore[no-untyped-def]
    data, headers = encode(req)
    headers["Nats-Msg-Id"] = msg_id or req.request_id
    return await nc.jetstream().publish(s.intake_requests(), data, headers=headers)


async def test_duplicate_publish_is_deduplicated(live: Services, fake_worker, nc: Client,  # type: ignore[no-untyped-def]
                                                 uniq: str) -> None:
    s = Subjects(uniq)
    w = await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    first = await publish(nc, s, intake("dup-1"))
    second = await publish(nc, s, intake("dup-1"))
    assert first.duplicate is None and second.duplicate is True
    assert first.seq == second.seq
    # A later request is dispatched after anything queued before it (one consumer, in order),
    # so once it is, a second copy of dup-1 would have been dispatched too.
    await publish(nc, s, intake("after-1"))
    await wait_until(lambda: len(w.assignments) == 2, "both requests dispatched")
    assert [a.request.request_id for a in w.assignments] == ["dup-1", "after-1"]
    # The scheduler counts a dispatch when the worker's ack reaches it, just after the worker.
    await wait_until(lambda: sched.stats.dispatched >= 2, "both dispatches recorded")
    assert sched.stats.dispatched == 2


class CrashBeforeAck(SchedulerService):
    """A scheduler that 'dies' between dispatching and acking its first intake message: the
    ack never reaches the server, so the message is redelivered after ack_wait."""

    dropped = 0

    async def handle_intake(self, msg: Msg) -> None:
        if self.dropped == 0:
            self.dropped += 1

            async def lost_ack(*_a: object, **_k: object) -> None:
                return None

            msg.ack = lost_ack  # type: ignore[method-assign]
        await super().handle_intake(msg)


async def test_redelivered_message_is_not_dispatched_twice(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    s = Subjects(uniq)
    w = await fake_worker("w-cp2-g0", 2, 0)
    settings = SchedulerSettings(nats_url=live.url, subject_prefix=uniq, block_size=B,
                                 ack_wait_s=1.0, instance_id="crashy")
    sched = await live._run(CrashBeforeAck(settings))
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    await publish(nc, s, intake("re-1"))
    await wait_until(lambda: sched.stats.redelivered_acked == 1, "the redelivery")
    assert [a.request.request_id for a in w.assignments] == ["re-1"]
    assert sched.stats.dispatched == 1
    # The record that made it idempotent is in the KV bucket (a restart would see it too).
    kv = await nc.jetstream().key_value(assignment_bucket(s))
    rec = from_json(AssignmentRecord, (await kv.get("re-1")).value)
    assert (rec.state, rec.msg_id, rec.worker_id) == ("dispatched", "re-1", "w-cp2-g0")
    assert rec.stream_seq == 1
    # And the message is gone from the work queue (acked the second time).
    info = await nc.jetstream().stream_info(s.intake_stream())
    assert info.state.messages == 0


async def test_restarted_scheduler_sees_the_record(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """Scheduler A dispatches and dies before its ack reaches the server; scheduler B (a fresh
    process state) gets the redelivery and acks it without dispatching, from A's KV record."""
    s = Subjects(uniq)
    w = await fake_worker("w-cp2-g0", 2, 0)
    settings = SchedulerSettings(nats_url=live.url, subject_prefix=uniq, block_size=B,
                                 ack_wait_s=1.0, instance_id="sched-a")
    a = await live._run(CrashBeforeAck(settings))
    await wait_until(lambda: len(a.core.view) == 1, "worker in A's view")
    await publish(nc, s, intake("old-1"))
    await wait_until(lambda: a.stats.dispatched == 1, "A's dispatch")
    await live.stop(a)
    b = await live.scheduler(block_size=B, instance_id="sched-b")
    await wait_until(lambda: b.stats.redelivered_acked == 1, "the redelivery at B")
    await publish(nc, s, intake("new-1"))
    await wait_until(lambda: len(w.assignments) == 2, "the new request")
    assert [x.request.request_id for x in w.assignments] == ["old-1", "new-1"]
    # B counts its dispatch when the worker's ack reaches it, a moment after the worker got it.
    await wait_until(lambda: b.stats.dispatched >= 1, "B's dispatch of the new request")
    assert b.stats.dispatched == 1


async def test_redirect_is_placed_again(live: Services, fake_worker, nc: Client,  # type: ignore[no-untyped-def]
                                        uniq: str) -> None:
    """rankd redirects queued requests of a draining worker under a new Nats-Msg-Id:
    same request id, a new message → a fresh placement, the old reservation released."""
    s = Subjects(uniq)
    w = await fake_worker("w-cp2-g0", 2, 0, reply_results=False)
    sched = await live.scheduler(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    await publish(nc, s, intake("rd-1"))
    await wait_until(lambda: len(w.assignments) == 1, "first placement")
    assert len(sched.core.loads["w-cp2-g0"]) == 1
    await publish(nc, s, intake("rd-1"), msg_id="rd-1-r1")
    await wait_until(lambda: len(w.assignments) == 2, "placement of the redirect")
    assert sched.stats.redirected == 1
    assert len(sched.core.loads["w-cp2-g0"]) == 1  # old reservation released, new one held


async def test_hand_back_is_not_counted_twice_in_demand(live: Services, fake_worker,  # type: ignore[no-untyped-def]
                                                        nc: Client, uniq: str) -> None:
    """A hand-back (``{source}>{worker}``) is placed again but was counted in D(k) at its
    first placement: the window reports count the request once, as the simulator does."""
    s = Subjects(uniq)
    reports: list[WindowReport] = []

    async def on_report(msg: Msg) -> None:
        reports.append(decode(WindowReport, msg.data, msg.headers))

    sub = await nc.subscribe(s.window_demand_all(), cb=on_report)
    w = await fake_worker("w-cp2-g0", 2, 0, reply_results=False)
    sched = await live.scheduler(block_size=B, window_s=0.5)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    await publish(nc, s, intake("hb-1"))
    await wait_until(lambda: len(w.assignments) == 1, "first placement")
    await publish(nc, s, intake("hb-1"), msg_id=handback_msg_id("hb-1", "hb-1", "w-cp2-g0", 1))
    await wait_until(lambda: len(w.assignments) == 2, "placement of the hand-back")
    await wait_until(lambda: sched.stats.dispatched >= 2, "both dispatches recorded")
    # A window that opened after both placements has closed: every count is in the reports.
    after = time.time()
    await wait_until(lambda: any(r.window_start_s >= after for r in reports),
                     "a later window reported")
    await sub.unsubscribe()
    assert sum(r.requests for r in reports) == 1


async def test_a_hand_back_of_a_later_attempt_is_placed_though_an_earlier_one_is_answered(
        live: Services, fake_worker, nc: Client, uniq: str) -> None:  # type: ignore[no-untyped-def]
    """A worker that hands x back hands back the later attempts that joined x's job with it,
    each as a message of its own (rankd ``_hand_back``). x's first attempt is answered before
    the later attempt's hand-back is handled: that one is placed all the same (its gateway
    takes only its own attempt's answer), while a hand-back of the answered attempt itself
    is acked unplaced (it would run for nobody). Before, the answer of any attempt made
    every hand-back of the id acked unplaced: the later attempt's client got a 504."""
    s = Subjects(uniq)
    w = await fake_worker("w-cp2-g0", 2, 0, reply_results=False)
    sched = await live.scheduler(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    first = intake("jn-1")
    await publish(nc, s, first)
    await wait_until(lambda: len(w.assignments) == 1, "first placement")
    await _answer(nc, s, "jn-1", w.worker_id, arrival_s=first.arrival_s)
    await wait_until(lambda: "jn-1" in sched._served, "the first attempt's answer seen")
    await publish(nc, s, first, msg_id=handback_msg_id("jn-1", "jn-1", w.worker_id, 1))
    await wait_until(lambda: sched.stats.finished_acked == 1, "the answered hand-back acked")
    later = first.model_copy(update={"arrival_s": first.arrival_s + 0.5})
    await publish(nc, s, later, msg_id=joined_handback_msg_id("jn-1", "jn-1", w.worker_id, 1,
                                                              later.arrival_s))
    await wait_until(lambda: len(w.assignments) == 2, "the later attempt placed")
    assert w.assignments[1].request.arrival_s == later.arrival_s
    assert sched.stats.finished_acked == 1
    # The other way round: only y's later attempt was answered (it ran elsewhere), and y's
    # first attempt is handed back: placed, not taken as answered.
    y = intake("jn-2")
    await publish(nc, s, y)
    await wait_until(lambda: len(w.assignments) == 3, "y placed")
    await _answer(nc, s, "jn-2", w.worker_id, arrival_s=y.arrival_s + 0.5)
    await wait_until(lambda: "jn-2" in sched._served, "y's later attempt's answer seen")
    await publish(nc, s, y, msg_id=handback_msg_id("jn-2", "jn-2", w.worker_id, 1))
    await wait_until(lambda: len(w.assignments) == 4, "y's first attempt placed again")
    assert sched.stats.finished_acked == 1


async def test_a_hand_back_placed_after_another_attempts_is_not_taken_as_superseded(
        live: Services, fake_worker, nc: Client, uniq: str) -> None:  # type: ignore[no-untyped-def]
    """A worker hands back x (attempt 1) and the later attempt 2 that joined x's job, each
    its own message. Attempt 1's is refused at first (a worker not yet active, say) and
    comes back after attempt 2's was placed: it is placed too. A newer placed message of
    the id supersedes an older one only when it is a hand-back of the same attempt; before,
    attempt 1 was acked unplaced as superseded, and its client got a 504."""
    s = Subjects(uniq)
    w = await fake_worker("w-cp2-g0", 2, 0, reply_results=False)
    await w.stop()  # its assign subscriber: this test answers assignments itself
    first = intake("sp-1")
    later = first.model_copy(update={"arrival_s": first.arrival_s + 0.5})
    got: list[Assignment] = []
    refused: list[float] = []

    async def assign(msg: Msg) -> None:
        a = decode(Assignment, msg.data, msg.headers)
        if a.request.arrival_s == first.arrival_s and not refused:
            refused.append(a.request.arrival_s)
            await nc.publish(msg.reply, b"", headers={
                "Nats-Service-Error": "w-cp2-g0 is switching", "Nats-Service-Error-Code": "409"})
            return
        got.append(a)
        data, _ = encode(AssignmentAck(request_id=a.request.request_id, worker_id=w.worker_id,
                                       epoch=a.epoch, queue_position=0))
        await msg.respond(data)

    sub = await nc.subscribe(s.worker_assign(w.worker_id), cb=assign)
    sched = await live.scheduler(block_size=B, retry_delay_s=0.5)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    await publish(nc, s, first, msg_id=handback_msg_id("sp-1", "sp-1", "w-cp2-g1", 1))
    await wait_until(lambda: bool(refused), "attempt 1's hand-back refused")
    await publish(nc, s, later, msg_id=joined_handback_msg_id("sp-1", "sp-1", "w-cp2-g1", 1,
                                                              later.arrival_s))
    await wait_until(lambda: len(got) == 2 or sched.stats.superseded_acked > 0,
                     "attempt 1's hand-back settled")
    assert sched.stats.superseded_acked == 0
    assert [a.request.arrival_s for a in got] == [later.arrival_s, first.arrival_s]
    await sub.unsubscribe()


async def test_an_earlier_attempts_answer_leaves_a_later_ones_dispatch_waiting(
        live: Services, fake_worker, nc: Client, uniq: str) -> None:  # type: ignore[no-untyped-def]
    """x's first attempt is dispatched, then a later attempt of x (a client retry the
    intake took as new after a store loss) is dispatched too. The first attempt's answer
    leaves the later one's dispatch as it was: in the ledger (so a death of its worker is
    still recovered), its intake message held, its reservation kept. Its own answer
    releases them. Before, the first answer let go of all three, and the later attempt's
    client got a 504 when its worker then died."""
    s = Subjects(uniq)
    w = await fake_worker("w-cp2-g0", 2, 0, reply_results=False)
    sched = await live.scheduler(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    first = intake("la-1")
    await publish(nc, s, first)
    await wait_until(lambda: len(w.assignments) == 1, "the first attempt dispatched")
    later = first.model_copy(update={"arrival_s": first.arrival_s + 0.5})
    await publish(nc, s, later, msg_id="la-1 stored anew")
    await wait_until(lambda: len(w.assignments) == 2 and "la-1" in sched._held,
                     "the later attempt dispatched and held")
    await _answer(nc, s, "la-1", w.worker_id, arrival_s=first.arrival_s)
    await wait_until(lambda: "la-1" in sched._served, "the first attempt's answer seen")
    sent = sched.ledger.get("la-1")
    assert sent is not None and sent.request.arrival_s == later.arrival_s
    assert "la-1" in sched._held and sched.stats.finished == 0
    assert sched.core.worker_of(RequestId("la-1")) == w.worker_id
    assert sched.stats.other_attempt_results == 1
    await _answer(nc, s, "la-1", w.worker_id, arrival_s=later.arrival_s)
    await wait_until(lambda: sched.stats.finished == 1, "the later attempt's answer seen")
    assert "la-1" not in sched.ledger and "la-1" not in sched._held
    assert sched._served["la-1"] == (first.arrival_s, later.arrival_s)


async def _intake_messages(nc: Client, s: Subjects) -> int:
    return (await nc.jetstream().stream_info(s.intake_stream())).state.messages


async def _answer(nc: Client, s: Subjects, rid: str, worker: str,
                  arrival_s: float | None = None) -> None:
    result = FirstToken(request_id=rid, token=7, worker_id=worker, epoch=0,
                        predicted_prefill_s=0.1, stages=TtftStages(total_s=0.2),
                        finished_at_s=time.time(), arrival_s=arrival_s)
    data, headers = encode(result)
    await nc.publish(s.result(rid), data, headers=headers)


async def test_a_dispatched_message_is_held_until_its_result(
        live: Services, fake_worker, nc: Client, uniq: str) -> None:  # type: ignore[no-untyped-def]
    """hold_intake (the default): the intake message of a dispatched request stays unacked
    -- renewed every ack_wait / 3, so never redelivered -- until its result; off, it is
    acked at dispatch."""
    s = Subjects(uniq)
    w = await fake_worker("w-cp2-g0", 2, 0, reply_results=False)
    sched = await live.scheduler(block_size=B, ack_wait_s=1.5)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    await publish(nc, s, intake("held-1"))
    await wait_until(lambda: "held-1" in sched._held, "the message held")
    # Four renewal rounds (every ack_wait / 3) span over two ack_waits: still held, never
    # redelivered (the renewals reach the server).
    await wait_until(lambda: sched.stats.held_renewals >= 4, "four renewal rounds")
    consumer = await nc.jetstream().consumer_info(s.intake_stream(), s.intake_consumer())
    assert consumer.num_redelivered == 0 and consumer.num_ack_pending == 1
    assert await _intake_messages(nc, s) == 1
    assert len(w.assignments) == 1 and sched.stats.adopted == 0
    assert sched.stats.redelivered_acked == 0
    await _answer(nc, s, "held-1", w.worker_id)
    await wait_until(lambda: "held-1" not in sched._held, "released by its result")
    for _ in range(100):
        if await _intake_messages(nc, s) == 0:
            break
        await asyncio.sleep(0.05)
    assert await _intake_messages(nc, s) == 0
    await live.stop(sched)

    off = await live.scheduler(block_size=B, hold_intake=False)
    await wait_until(lambda: len(off.core.view) == 1, "worker in the view")
    await publish(nc, s, intake("acked-1"))
    await wait_until(lambda: off.stats.dispatched == 1, "dispatched")
    for _ in range(100):
        if await _intake_messages(nc, s) == 0:
            break
        await asyncio.sleep(0.05)
    assert await _intake_messages(nc, s) == 0  # acked though the worker has not answered
    assert not off._held and "acked-1" in off.ledger


async def test_a_stopping_replica_hands_its_held_messages_to_the_next(
        live: Services, fake_worker, nc: Client, uniq: str) -> None:  # type: ignore[no-untyped-def]
    """A replica that stops NAKs what it holds; the next one gets it at once and adopts it
    (the fake worker has no ``queue`` endpoint: its fresh state keeps the request adopted),
    and acks it when the result comes."""
    s = Subjects(uniq)
    w = await fake_worker("w-cp2-g0", 2, 0, reply_results=False)
    # ack_wait an hour, far above any wait here: only the NAK can bring the message back.
    a = await live.scheduler(block_size=B, ack_wait_s=3600.0, instance_id="sched-a")
    await wait_until(lambda: len(a.core.view) == 1, "worker in A's view")
    info = await nc.jetstream().consumer_info(s.intake_stream(), s.intake_consumer())
    assert info.config.ack_wait == 3600.0  # the premise: no redelivery by timeout here
    await publish(nc, s, intake("pass-1"))
    await wait_until(lambda: "pass-1" in a._held, "held by A")
    await live.stop(a)
    b = await live.scheduler(block_size=B, ack_wait_s=3600.0, instance_id="sched-b")
    # Far inside ack_wait: only a NAK can have brought it back -- A's at its stop, not one B
    # sends for a replica it finds gone (that comes later, after A is unseen for a while).
    await wait_until(lambda: b.stats.adopted == 1, "adopted by B")
    assert (b.stats.peer_naked, b.stats.predecessor_naked) == (0, 0)
    assert "pass-1" in b.ledger and "pass-1" in b._held
    assert b.ledger.get("pass-1").worker_id == w.worker_id  # type: ignore[union-attr]
    assert len(w.assignments) == 1  # not dispatched again
    await _answer(nc, s, "pass-1", w.worker_id)
    await wait_until(lambda: "pass-1" not in b.ledger and not b._held, "released")
    for _ in range(100):
        if await _intake_messages(nc, s) == 0:
            break
        await asyncio.sleep(0.05)
    assert await _intake_messages(nc, s) == 0


async def test_re_sent_messages_after_a_store_loss_share_one_listing_of_the_workers(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """The gateways' re-sends after a store loss come in a burst: the scheduler asks each
    worker for its queue once for the burst, not once per message (before: 6 messages, 6
    queries per worker). A request a worker lists is adopted, not placed again; the others are
    placed."""
    from shared.service import REPUBLISHED_HEADER

    s = Subjects(uniq)
    a = await fake_worker("w-cp2-g0", 2, 0)
    b = await fake_worker("w-cp2-g2", 2, 2)
    # A listing answers for the whole test: the burst is one however slow this machine is.
    sched = await live.scheduler(block_size=B, republished_listing_s=600.0)
    await wait_until(lambda: len(sched.core.view) == 2, "both workers in the view")
    held = intake("held-1")
    await publish(nc, s, held)
    await wait_until(lambda: len(a.assignments) + len(b.assignments) == 1, "held-1 dispatched")
    for rid in ("held-1", *(f"resent-{i}" for i in range(5))):
        # A gateway re-sends a request as it was (its arrival stamp too).
        data, headers = encode(held if rid == "held-1" else intake(rid))
        headers["Nats-Msg-Id"] = f"{rid}-again"  # the new stream's copy (no duplicate here)
        headers[REPUBLISHED_HEADER] = "1"
        await nc.jetstream().publish(s.intake_requests(), data, headers=headers)
    st = sched.stats
    await wait_until(lambda: st.republished_held + st.republished_placed == 6,
                     "every re-sent message decided")
    assert st.republished_held == 1 and st.republished_placed == 5
    # A message is counted as placed when decided, before its assignment reaches a worker.
    await wait_until(lambda: len(a.assignments) + len(b.assignments) >= 6,
                     "the placed ones dispatched")
    placed = [r.request.request_id for w in (a, b) for r in w.assignments]
    assert sorted(placed) == sorted(["held-1", *(f"resent-{i}" for i in range(5))])  # once each
    assert st.republished_listings == 1 and a.queue_queries == b.queue_queries == 1


async def test_a_re_sent_later_attempt_is_placed_though_a_worker_holds_an_earlier_one(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """After a second store loss a gateway re-sends a later attempt of x (a client retry
    the intake took as new after the first loss), while a worker still holds x's first
    attempt. The worker's queue report names the attempts it holds (``arrivals``): the later
    one is not among them, so it is placed (the worker then runs it, or joins it to x's job
    and answers it stamped for it), not adopted. Before, the id listed for the first attempt
    counted as holding the later one, which was never sent to any worker: its client got a
    504. The first attempt re-sent as it was is adopted."""
    from shared.service import REPUBLISHED_HEADER

    s = Subjects(uniq)
    w = await fake_worker("w-cp2-g0", 2, 0, reply_results=False)
    sched = await live.scheduler(block_size=B, republished_listing_s=600.0)
    await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
    first = intake("ra-1")
    await publish(nc, s, first)
    await wait_until(lambda: len(w.assignments) == 1, "the first attempt dispatched")
    later = first.model_copy(update={"arrival_s": first.arrival_s + 0.5})
    for req, msg_id in ((later, "ra-1 later"), (first, "ra-1 again")):
        data, headers = encode(req)
        headers["Nats-Msg-Id"] = msg_id
        headers[REPUBLISHED_HEADER] = "1"
        await nc.jetstream().publish(s.intake_requests(), data, headers=headers)
    st = sched.stats
    await wait_until(lambda: st.republished_held + st.republished_placed == 2,
                     "both re-sent messages decided")
    assert (st.republished_placed, st.republished_held) == (1, 1)
    # The later attempt is counted as placed when decided, before its assignment reaches w.
    await wait_until(lambda: len(w.assignments) >= 2, "the later attempt dispatched")
    assert [a.request.arrival_s for a in w.assignments] == [first.arrival_s, later.arrival_s]


async def test_a_kept_answer_counts_although_bad_input_followed_it(
    live: Services, nc: Client, uniq: str
) -> None:
    """The scheduler's look-up of a kept answer (a re-sent or last delivery already answered)
    passes over a stray message published after the answer (before: the stray was the only
    message kept, so the answer did not count and the request would run again)."""
    s = Subjects(uniq)
    sched = await live.scheduler(block_size=B)
    stages = TtftStages(intake_wait_s=0, schedule_s=0, queue_wait_s=0, prefill_s=0,
                        kv_transfer_s=0, first_decode_s=0, total_s=0)
    answer = FirstToken(request_id="ans-1", token=5, stages=stages, finished_at_s=time.time())
    data, headers = encode(answer)
    js = nc.jetstream()
    await js.publish(s.result("ans-1"), data, headers=headers)  # stored, as workers do
    assert await sched._result_kept("ans-1")
    other = answer.model_copy(update={"request_id": "someone-else"})
    await js.publish(s.result("ans-1"), encode(other)[0])  # valid, but not ans-1's
    await js.publish(s.result("ans-1"), b"\x00 not a result")
    assert await sched._result_kept("ans-1")
    assert not await sched._result_kept("never-answered")


async def test_a_kept_answer_is_matched_to_its_attempt_by_the_gateways_clock(
    live: Services, nc: Client, uniq: str
) -> None:
    """Whether a kept answer answers this attempt of a request id is judged by the arrival
    stamp the answer echoes (the gateway's clock), not by when the worker finished it (its
    host's clock): an answer from a worker whose clock is a minute behind still counts for
    its own attempt (before: it did not, and the request was placed again), and an answer to
    an earlier attempt under the same id does not count for a later one."""
    s = Subjects(uniq)
    sched = await live.scheduler(block_size=B)
    stages = TtftStages(intake_wait_s=0, schedule_s=0, queue_wait_s=0, prefill_s=0,
                        kv_transfer_s=0, first_decode_s=0, total_s=0)
    arrival = time.time()
    behind = FirstToken(request_id="skew-1", token=5, stages=stages,
                        finished_at_s=arrival - 60.0, arrival_s=arrival)
    data, headers = encode(behind)
    js = nc.jetstream()
    await js.publish(s.result("skew-1"), data, headers=headers)
    assert await sched._result_kept("skew-1", since_s=arrival)
    assert not await sched._result_kept("skew-1", since_s=arrival + 1.0)  # a later attempt
    # An answer without the echo (an older worker) is judged by when it finished.
    old = encode(behind.model_copy(update={"arrival_s": None}))
    await js.publish(s.result("skew-1"), old[0], headers=old[1])
    assert not await sched._result_kept("skew-1", since_s=arrival)
    assert await sched._result_kept("skew-1", since_s=arrival - 60.0)


async def test_a_result_on_another_requests_subject_finishes_nothing(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """A FirstToken of request a published on b's result subject (bad input) does not release
    a's reservation: the scheduler takes a result only on its own request's subject (before:
    a counted as finished, its worker's queue estimate short by a's work)."""
    s = Subjects(uniq)
    w = await fake_worker("w-cp2-g0", 2, 0, reply_results=False)
    sched = await live.scheduler(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    for rid in ("a-1", "c-1"):
        await publish(nc, s, intake(rid))
    await wait_until(lambda: len(w.assignments) == 2, "both dispatched")
    a, c = w.assignments
    stages = TtftStages(intake_wait_s=0, schedule_s=0, queue_wait_s=0, prefill_s=0,
                        kv_transfer_s=0, first_decode_s=0, total_s=0)
    stray = FirstToken(request_id="a-1", token=1, stages=stages, finished_at_s=time.time())
    await nc.publish(s.result("b-1"), encode(stray)[0])
    await w.answer(c)  # after the stray on the same connection: handled after it
    await wait_until(lambda: sched.stats.finished == 1, "c finished")
    assert sched.core.worker_of(RequestId("a-1")) == "w-cp2-g0"  # a still in flight there
    await w.answer(a)
    await wait_until(lambda: sched.stats.finished == 2, "a finished on its own subject")
