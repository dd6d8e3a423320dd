"""A scheduler stopped while its NATS server vanishes does not wait out the dispatches in flight.

``vertumnus up`` killed with requests in flight: the kernel sends SIGTERM to the services and
to nats-server at once. The scheduler's stop lets the dispatches already sent finish (the
worker's AssignmentAck), bounded by ``dispatch_timeout_s`` -- but nats-py forgets a request
whose connection drops rather than failing it, so with the server gone each stop waited out
the whole bound (5 s by default; seen in 6 of 14 such stops) before it went on, and likewise
for the store acknowledgements of the records sent without waiting. Here the bound is made
far longer than the test's own wait, so the old stop fails the test; the fixed one gives up
the wait as soon as the connection is lost (the intake message stays unacked: redelivered,
its record makes the re-send idempotent).

A real nats-server is killed (SIGKILL) while the fake worker holds the assignment unanswered.
The assertion is on the outcome (the stop ends; the dispatch was cancelled, not answered).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import nats
import pytest
from nats.aio.msg import Msg

from services.scheduler.service import SchedulerService, SchedulerSettings
from shared.blockhash import chain_hashes
from shared.natsserver import EmbeddedNats
from shared.schemas import Assignment, IntakeRequest, WorkerState, decode, encode, to_json
from shared.service import worker_state_kv
from shared.subjects import Subjects
from shared.worker import Lifecycle

WAIT_S = 30.0  # a liveness bound (the old stop took dispatch_timeout_s), not a speed check
DISPATCH_TIMEOUT_S = 120.0  # far past WAIT_S: a stop that waits it out fails the test
B = 16
TOKENS = list(range(40))
WORKER = "w-cp2-g0"


async def wait_until(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def test_a_scheduler_whose_server_vanishes_with_a_dispatch_in_flight_stops(
        own_nats_server: EmbeddedNats, uniq: str) -> None:
    s = Subjects(uniq)
    nc = await nats.connect(own_nats_server.url, max_reconnect_attempts=0,
                            allow_reconnect=False)
    assigned: list[Assignment] = []

    async def on_assign(msg: Msg) -> None:  # holds every assignment: never acks
        assigned.append(decode(Assignment, msg.data, msg.headers))

    async def on_snapshot(msg: Msg) -> None:  # an empty cache
        body = {"type": "snapshot", "worker": WORKER, "last_event_id": 0, "blocks": []}
        await msg.respond(json.dumps(body).encode())

    try:
        await nc.subscribe(s.worker_assign(WORKER), cb=on_assign)
        await nc.subscribe(s.cache_snapshot(WORKER), cb=on_snapshot)
        kv = await worker_state_kv(nc.jetstream(), s)
        await kv.put(WORKER, to_json(WorkerState(
            worker_id=WORKER, degree=2, gpus=[0, 1], epoch=0, lifecycle=Lifecycle.ACTIVE,
            queue_len=0, outstanding_s=0.0, kv_free_blocks=4096, kv_total_blocks=4096,
            hit_tokens=0, input_tokens=0, served=0, heartbeat_s=time.time())))

        sched = SchedulerService(SchedulerSettings(
            nats_url=own_nats_server.url, subject_prefix=uniq, instance_id="sched-stoptest",
            block_size=B, dispatch_timeout_s=DISPATCH_TIMEOUT_S, drain_timeout_s=WAIT_S))
        task = asyncio.create_task(sched.run(handle_signals=False))
        try:
            await wait_until(lambda: sched.started.is_set() or task.done(), "the scheduler")
            await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
            req = IntakeRequest(request_id="stop-1", input_len=len(TOKENS),
                                block_hashes=chain_hashes(TOKENS, B), block_size=B,
                                arrival_s=time.time())
            data, headers = encode(req)
            headers["Nats-Msg-Id"] = req.request_id
            await nc.jetstream().publish(s.intake_requests(), data, headers=headers)
            await wait_until(lambda: bool(assigned), "the dispatch")  # in flight, unanswered

            own_nats_server.kill()
            await wait_until(lambda: not sched.nc.is_connected, "the connection's loss")
            sched.request_stop()
            await asyncio.wait_for(asyncio.shield(task), WAIT_S)
        finally:
            if not task.done():
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        task.result()  # the stop raised nothing
        assert [a.request.request_id for a in assigned] == ["stop-1"]
    finally:
        await nc.close()
