"""Acceptance (c): SIGKILL of the scheduler process mid-run, then a restart, loses no request
and executes none twice.

``test_scheduler_sigkill_and_restart_lose_nothing``: the stack runs every service as its own
process; a steady load flows through the gateway while the scheduler is SIGKILLed (no drain,
no ack of what it had fetched) and started again with the same configuration and durable
consumer — twice, each time mid-run: once that process has dispatched requests itself and
holds some not answered yet (intake messages delivered to it and not acked, read again after
its death). What keeps the promise: the durable JetStream intake (requests published
while no scheduler runs wait in the work queue; messages fetched but not acked are redelivered
after ``ack_wait``) and the idempotent assignment (the assignment-record KV bucket and rankd's
admission by request id). Checked: every HTTP answer 200, exactly once; at least one
FirstToken per id on the wire, none failed, none for ids never sent (nothing lost).

A kill between the worker's AssignmentAck and the ``dispatched`` record leaves a
``dispatching`` record; the restarted scheduler re-sends the assignment to the same worker, whose
admission is idempotent on request id (queued, running, or remembered as finished) — see
``test_resent_dispatching_assignment_runs_once``. The controller runs too and may reconfigure
while the scheduler is down, so a worker may hand a request back to intake that a dead scheduler
had left ``dispatching``: see ``test_resent_assignment_of_redirected_request_runs_once``
(tests/live_accept/test_accept_redirect_resend.py). So the test demands exactly one
FirstToken per id, none failed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

from live_accept_support import (
    CRASH_MAX_DELIVER,
    WAIT_S,
    DiesBeforeDispatchedRecord,
    EpochLog,
    InProcess,
    ResultTap,
    answered_once_ok,
    connect,
    fire_until,
    geometry_violations,
    running_stack,
    small_config,
    wait_quiescent,
    wait_until,
)
from nats.aio.client import Client

from shared.natsserver import EmbeddedNats
from shared.schemas import IntakeRequest, encode
from vertumnus.live.observe import ping, service_stats
from vertumnus.live.report import summed_counters
from vertumnus.live.stack import LiveStack

RATE = 30.0
KILLS = 2
DISPATCHED_BEFORE_KILL = 3
"""Requests a scheduler process dispatches itself before it is killed: the load flows through
it (the first process, or the one started again after the previous kill)."""
KILL_TRIES = 5
"""Kills tried for each of :data:`KILLS`: one can land just after the last request the
scheduler held was answered; it is started again and killed again."""


async def held_intake(nc: Client, stack: LiveStack) -> int:
    """How many intake messages are delivered to the scheduler and not acknowledged: with
    ``hold_intake`` (the default) a dispatched request's message is acked only with its
    result or hand-back, so these are requests in flight."""
    s = stack.subjects
    info = await nc.jetstream().consumer_info(s.intake_stream(), s.intake_consumer())
    return int(info.num_ack_pending)


async def dispatched(nc: Client, stack: LiveStack) -> int:
    """Requests the running scheduler process has dispatched (its own count, from 0 at its
    start)."""
    answers = await service_stats(nc, "vtm-scheduler", prefix=stack.config.prefix,
                                  window_s=0.2)
    return summed_counters(answers, ["dispatched"])["dispatched"]


async def kill_mid_run(nc: Client, stack: LiveStack) -> int:
    """SIGKILL the scheduler child mid-run: once it has dispatched
    :data:`DISPATCHED_BEFORE_KILL` requests and holds some not answered yet. Returns how many
    intake messages it held at its death (> 0), after at most :data:`KILL_TRIES` kills."""
    for _ in range(KILL_TRIES):
        deadline = time.monotonic() + WAIT_S
        while await dispatched(nc, stack) < DISPATCHED_BEFORE_KILL:
            assert time.monotonic() < deadline, "the scheduler dispatched nothing"
        while not await held_intake(nc, stack):
            assert time.monotonic() < deadline, "the scheduler never held a request"
            await asyncio.sleep(0.01)
        _, code = stack.kill_child("scheduler")
        assert code == -signal.SIGKILL, code
        # Read after its death (its connection closed with it: nothing is delivered to it
        # since, nothing it held is acked): what it held when the SIGKILL landed. A message
        # it kept (marked in progress every ack_wait / 3) had two thirds of ack_wait (2 s) or
        # more left, so none of them has gone back to the stream yet.
        held = await held_intake(nc, stack)
        if held:
            return held
        await restart_scheduler(stack)  # the kill came between requests: try again
    raise AssertionError(f"none of {KILL_TRIES} kills landed with a request in flight")


async def restart_scheduler(stack: LiveStack) -> None:
    """Start the killed scheduler again with the same spec; wait until the new one answers
    ``$SRV.PING``."""
    stack.restart_child("scheduler")
    assert stack.nc is not None
    deadline = time.monotonic() + 90
    while not await ping(stack.nc, "vtm-scheduler", prefix=stack.config.prefix, window_s=0.2):
        stack.children.check()
        assert time.monotonic() < deadline, "restarted scheduler not up"


async def test_scheduler_sigkill_and_restart_lose_nothing(tmp_path: Path) -> None:
    # A short ack_wait so the redelivery of what the dead scheduler had fetched comes soon.
    cfg = small_config(env={"scheduler": {"VTM_ACK_WAIT_S": "2"}})
    async with running_stack(cfg, tmp_path / "logs") as stack:
        nc = await connect(stack)
        tap = await ResultTap(nc, stack.subjects).start()
        epochs = await EpochLog(nc, stack.subjects).start()
        try:
            assert stack.gateway_url is not None
            done = asyncio.Event()
            held: list[int] = []  # intake messages the scheduler held at each death

            async def crashes() -> None:
                try:
                    for _ in range(KILLS):
                        held.append(await kill_mid_run(nc, stack))
                        await restart_scheduler(stack)
                    await asyncio.sleep(1.0)
                finally:
                    done.set()

            task = asyncio.create_task(crashes())
            sent, answers = await fire_until(stack.gateway_url, "acc-k", RATE, done)
            ids = list(sent)
            await task
            # Each kill landed mid-run: the dead scheduler held requests not answered yet.
            assert len(held) == KILLS and min(held) > 0, held
            problems = answered_once_ok(ids, answers, sent)
            assert not problems, problems[:10]
            await wait_until(lambda: tap.ok_ids() >= set(ids), "every FirstToken on the wire")
            # Settled: intake holds nothing (every message acked: no redelivery can come) and
            # no worker of any composition holds anything, so a re-execution would show.
            workers = {*stack.config.workers(),
                       *(w.worker_id for rec in epochs.records.values() for w in rec.workers)}
            await wait_quiescent(nc, stack.subjects, sorted(workers))

            by_id = {rid: rs for rid, rs in tap.by_id().items() if rid in set(ids)}
            assert not set(tap.by_id()) - set(sent), "FirstTokens for ids never sent"
            failed = [(r.request_id, r.error) for r in tap.results if r.error is not None]
            assert not failed, failed[:10]  # nothing lost, nothing failed
            twice = {rid: [(r.worker_id, r.epoch, r.finished_at_s) for r in rs]
                     for rid, rs in by_id.items() if len(rs) > 1}
            assert not twice, f"executed more than once: {twice}"
            bad = geometry_violations([rs[0] for rs in by_id.values()], epochs.records)
            assert not bad, bad[:10]
        finally:
            await epochs.stop()
            await tap.stop()
            await nc.drain()


async def test_resent_dispatching_assignment_runs_once(nats_server: EmbeddedNats) -> None:
    live = InProcess(nats_server.url, "t" + os.urandom(5).hex())
    nc = await connect_url(nats_server.url)
    tap = await ResultTap(nc, live.subjects).start()
    try:
        rankd = await live.rankd("w-cp2-g0")
        a = await live.scheduler(cls=DiesBeforeDispatchedRecord, block_size=16, ack_wait_s=1.0,
                                 max_deliver=CRASH_MAX_DELIVER, instance_id="sched-a")
        await wait_until(lambda: len(a.core.view) == 1, "worker in A's view")
        req = IntakeRequest(request_id="once-1", input_len=40, block_size=16,
                            arrival_s=time.time())
        data, headers = encode(req)
        headers["Nats-Msg-Id"] = req.request_id
        await nc.jetstream().publish(live.subjects.intake_requests(), data, headers=headers)
        await wait_until(lambda: len(tap.results) == 1, "the first (only legitimate) run")
        await live.stop(a)  # A is gone; its message waits for redelivery
        b = await live.scheduler(block_size=16, ack_wait_s=1.0, max_deliver=CRASH_MAX_DELIVER,
                                 instance_id="sched-b")
        await wait_until(lambda: b.stats.dispatched + b.stats.redelivered_acked >= 1,
                         "B handled the redelivery")
        await wait_until(lambda: rankd.core.running is None and len(rankd.core) == 0,
                         "the worker idle again")
        # The worker had served it: B sees the kept result and acks the message rather than
        # holding it for a result that already went out (before, it was held and renewed for
        # good). Settled: intake has nothing waiting and nothing unacknowledged, and the
        # worker holds nothing, so a second run would show.
        await wait_until(lambda: b.stats.resent_served == 1, "B acked the served re-send")
        assert "once-1" not in b._held and b.ledger.get("once-1") is None
        await wait_quiescent(nc, live.subjects, ("w-cp2-g0",))
        assert [r.request_id for r in tap.results] == ["once-1"], (
            f"executed {len(tap.results)} times")
    finally:
        await live.close()
        await tap.stop()
        await nc.drain()


async def connect_url(url: str):  # type: ignore[no-untyped-def]
    import nats

    return await nats.connect(url, connect_timeout=5)
