"""A dispatch whose outcome is unknown, and its worker then lost (real nats-server, the
scheduler in-process, fake workers): the request is handed back to a live worker instead of
failing, or of waiting for ever.

1. The worker dies with the assignment: the send times out and every re-send meets "no
   responders". Before, the scheduler NAK'ed every retry_delay_s, used up max_deliver long
   before the dead worker's lease ran out and answered the client with an error while a live
   worker was free. Now a re-send that meets "no responders" waits for the lease, and the next
   delivery hands the request back.
2. On the last delivery the worker lists the request (the scheduler acks and sends no error),
   and then dies. Before, the request was in no ledger and held by nobody: nothing handed it
   back and its client never got an answer. Now it is in the ledger, held, and handed back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import nats.errors
from live_sched_support import (
    FakeWorker,
    Services,
    heartbeats,
    publish_intake,
    results_for,
    wait_until,
)
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.scheduler.service import SchedulerService, SchedulerSettings
from shared.schemas import Assignment, AssignmentAck, decode
from shared.subjects import Subjects

W1, W2 = "w-cp2-g0", "w-cp2-g2"



class DiesWithIt(FakeWorker):
    """Takes its first assignment and dies: no answer, its subjects gone, no more states."""

    async def _on_assign(self, msg: Msg) -> None:
        self.assignments.append(decode(Assignment, msg.data, msg.headers))
        asyncio.get_running_loop().create_task(self.stop())


async def test_a_worker_that_dies_with_the_assignment_costs_a_lease_not_the_request(
        live: Services, nc: Client, uniq: str) -> None:
    w1 = await DiesWithIt(nc, Subjects(uniq), W1, 2, 0).start()
    workers = [w1]
    async with heartbeats(workers):
        sched = await live.scheduler(block_size=16, policy="round_robin", lease_s=4.0,
                                     dispatch_timeout_s=1.0, retry_delay_s=0.2, max_deliver=5)
        await wait_until(lambda: len(sched.core.view) == 1, "W1 in the view")
        got = await results_for(nc, uniq, "x")
        await publish_intake(nc, uniq, "x")
        await wait_until(lambda: w1.assignments, "W1 took x")
        w2 = await FakeWorker(nc, Subjects(uniq), W2, 2, 2).start()
        workers.append(w2)
        await wait_until(lambda: got, "x's answer", timeout_s=60)
        try:
            assert [(t.worker_id, t.error) for t in got] == [(W2, None)], got
            assert sched.stats.failed == 0 and sched.stats.gone_handed_back == 1, sched.stats
        finally:
            await w2.stop()


class AnswerLost(SchedulerService):
    """Every answer about x's dispatch is lost after the worker admitted it."""

    async def _dispatch(self, a: Assignment, headers: dict[str, str]) -> AssignmentAck:
        ack = await super()._dispatch(a, headers)
        if a.request.request_id == "x":
            raise nats.errors.TimeoutError
        return ack


async def test_a_request_held_on_its_last_delivery_is_handed_back_when_its_worker_is_lost(
        live: Services, nc: Client, uniq: str,
        fake_worker: Callable[..., Awaitable[FakeWorker]]) -> None:
    w1 = await fake_worker(W1, 2, 0, reply_results=False)
    workers = [w1]
    async with heartbeats(workers):
        sched: Any = await live._run(AnswerLost(SchedulerSettings(
            nats_url=live.url, subject_prefix=live.prefix, instance_id="sched-held",
            block_size=16, policy="round_robin", max_deliver=2, retry_delay_s=0.05,
            lease_s=2.0)))
        await wait_until(lambda: len(sched.core.view) == 1, "W1 in the view")
        got = await results_for(nc, uniq, "x")
        await publish_intake(nc, uniq, "x")
        await wait_until(lambda: sched.stats.unknown_held == 1, "x's last delivery settled")
        assert "x" in sched.ledger and not got
        workers.append(await fake_worker(W2, 2, 2))
        await wait_until(lambda: len(sched.core.view) == 2, "W2 in the view")
        await w1.stop()  # lost, x with it
        await wait_until(lambda: got, "x's answer", timeout_s=60)
        assert [(t.worker_id, t.error) for t in got] == [(W2, None)], got
        assert sched.stats.lost_handed_back == 1, sched.stats


async def test_a_restarted_worker_of_a_degree_outside_the_pool_leaves_the_state_watch_alive(
        live: Services, nc: Client, uniq: str,
        fake_worker: Callable[..., Awaitable[FakeWorker]]) -> None:
    """A new incarnation under a known id whose state gives a degree the scheduler does not
    serve (it contradicts its own id): the replica trie is not asked to track it. Before, the
    trie refused it with InvalidInput, which ended the worker-state watch for good: no later
    state was seen and every worker drifted out of the view by lease."""
    w1 = await fake_worker(W1, 2, 0, incarnation="first")
    sched = await live.scheduler(block_size=16, degrees=[2, 4])
    await wait_until(lambda: W1 in sched.trie.workers(), "W1 tracked")
    w1.incarnation, w1.degree = "again", 8  # 8 GPUs from GPU 0: no degree of this pool
    await w1.publish_state()
    await wait_until(lambda: sched.stats.workers_restarted == 1, "the restart seen")
    assert W1 not in sched.trie.workers()
    await fake_worker(W2, 2, 2)  # the watch goes on
    await wait_until(lambda: W2 in sched.trie.workers(), "W2 tracked")
