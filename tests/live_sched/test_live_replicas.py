"""Several scheduler replicas share the intake, and each reserves only what it placed: a worker
reports its outstanding work per replica (``WorkerState.outstanding_by``, keyed by
``Assignment.scheduler_id``), and each replica counts the rest as other replicas' load in q_w.
Real nats-server, scheduler services in-process, fake workers publishing their states."""

from __future__ import annotations

import time

from live_sched_support import Services, wait_until
from nats.aio.client import Client

from shared.blockhash import chain_hashes
from shared.ids import WorkerId
from shared.schemas import IntakeRequest, encode
from shared.subjects import Subjects

B = 16


async def publish(nc: Client, uniq: str, rid: str) -> None:
    tokens = list(range(40))
    req = IntakeRequest(request_id=rid, input_len=len(tokens),
                        block_hashes=chain_hashes(tokens, B), block_size=B,
                        arrival_s=time.time())
    data, headers = encode(req)
    headers["Nats-Msg-Id"] = rid
    await nc.jetstream().publish(Subjects(uniq).intake_requests(), data, headers=headers)


async def test_each_replica_counts_the_others_share_of_a_worker(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    w = await fake_worker("w-cp2-g0", 2, 0, reply_results=False)
    a = await live.scheduler(block_size=B, instance_id="sched-a")
    b = await live.scheduler(block_size=B, instance_id="sched-b")
    for s in (a, b):
        await wait_until(lambda s=s: len(s.core.view) == 1, "the worker in each view")
    wid = WorkerId("w-cp2-g0")
    w.outstanding_s, w.outstanding_by = 5.0, {"sched-a": 2.0, "sched-b": 3.0}
    await w.publish_state()
    await wait_until(lambda: a.core.loads[wid].foreign_s == 3.0
                     and b.core.loads[wid].foreign_s == 2.0, "each replica's foreign share")
    # Work no replica claims (an older scheduler's) is foreign to all.
    w.outstanding_s, w.outstanding_by = 4.0, {"sched-a": 1.0}
    await w.publish_state()
    await wait_until(lambda: a.core.loads[wid].foreign_s == 3.0
                     and b.core.loads[wid].foreign_s == 4.0, "the new report")

    # Every assignment names the replica that placed it.
    for i in range(6):
        await publish(nc, uniq, f"rep-{i}")
    await wait_until(lambda: len(w.assignments) == 6, "six assignments")
    by = {x.request.request_id: x.scheduler_id for x in w.assignments}
    assert set(by.values()) <= {"sched-a", "sched-b"}
    # The worker has each before its scheduler has the ack: the counts follow the acks.
    await wait_until(lambda: a.stats.dispatched + b.stats.dispatched == 6,
                     "every dispatch recorded (acks received)")
    assert sum(1 for v in by.values() if v == "sched-a") == a.stats.dispatched


async def test_a_replica_places_away_from_a_worker_busy_with_others_work(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """Two idle-looking workers of one degree; the other replicas have 60 s queued on one of
    them. This replica's J sends a request to the other one, every time."""
    busy = await fake_worker("w-cp2-g0", 2, 0, outstanding_s=60.0,
                             outstanding_by={"sched-x": 60.0})
    free = await fake_worker("w-cp2-g2", 2, 2)
    sched = await live.scheduler(block_size=B, instance_id="sched-a")
    await wait_until(lambda: len(sched.core.view) == 2
                     and sched.core.loads[WorkerId("w-cp2-g0")].foreign_s == 60.0,
                     "both workers, the busy one's foreign work")
    for i in range(4):
        await publish(nc, uniq, f"away-{i}")
    await wait_until(lambda: len(free.assignments) + len(busy.assignments) == 4,
                     "four assignments")
    assert len(free.assignments) == 4 and not busy.assignments


async def test_another_replicas_placement_keeps_a_conversation_on_its_worker(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """Another replica placed four conversations' turns on w-cp2-g2 (its RequestStats went
    by) and they are still queued there. Each next turn, pulled by this replica, goes to the
    same worker: their prefixes will be cached there when they start. After the results the
    other replica's requests are forgotten."""
    from shared.schemas import FirstToken, RequestStats, TtftStages

    s = Subjects(uniq)
    w0 = await fake_worker("w-cp2-g0", 2, 0)
    w2 = await fake_worker("w-cp2-g2", 2, 2)
    sched = await live.scheduler(block_size=B, instance_id="sched-a")
    await wait_until(lambda: len(sched.core.view) == 2, "both workers in the view")
    turns = [list(range(1000 * k, 1000 * k + 64)) for k in range(4)]  # 4 full blocks each
    for k, tokens in enumerate(turns):
        stats = RequestStats(
            request_id=f"peer-{k}", reporter="sched-x", worker_id="w-cp2-g2", degree=2,
            input_len=len(tokens), block_hashes=chain_hashes(tokens, B), reused_blocks=0,
            prefix_tokens=0, preferred_degree=2, preferred_worker="w-cp2-g2",
            predicted_s=0.001, policy="vertumnus", at_s=time.time())
        data, headers = encode(stats)
        await nc.publish(s.cache_stats("sched-x"), data, headers=headers)
    await wait_until(lambda: sched.core.foreign_requests == 4, "the peer's four placements")
    # Their predicted work counts on w-cp2-g2 at once (until its next report): 4 × 1 ms,
    # less what the clock ran down meanwhile (short: so J's load term does not outweigh the
    # few cached blocks of these small prompts).
    assert 0.0 < sched.core.loads[WorkerId("w-cp2-g2")].foreign_s <= 0.004
    for k, tokens in enumerate(turns):
        nxt = tokens + list(range(5000 + 100 * k, 5000 + 100 * k + 20))
        req = IntakeRequest(request_id=f"next-{k}", input_len=len(nxt),
                            block_hashes=chain_hashes(nxt, B), block_size=B,
                            arrival_s=time.time())
        data, headers = encode(req)
        headers["Nats-Msg-Id"] = req.request_id
        await nc.jetstream().publish(s.intake_requests(), data, headers=headers)
        await wait_until(lambda k=k: len(w0.assignments) + len(w2.assignments) == k + 1,
                         f"turn {k} placed")
    assert [a.request.request_id for a in w2.assignments] == [f"next-{k}" for k in range(4)]
    assert all(a.prefix_tokens == 4 * B for a in w2.assignments) and not w0.assignments
    for k in range(4):  # the other replica's requests finish
        done = FirstToken(request_id=f"peer-{k}", token=1, worker_id="w-cp2-g2", epoch=0,
                          stages=TtftStages(total_s=0.1), finished_at_s=time.time())
        data, headers = encode(done)
        await nc.publish(s.result(f"peer-{k}"), data, headers=headers)
    await wait_until(lambda: sched.core.foreign_requests == 0, "the peer's requests forgotten")
    assert sched.stats.peer_placements == 4
