"""A rank process of a real torch world (gloo, 2 ranks, a tiny random model) is killed while a
CP2 worker of the rank host has a request running and two queued: none of them is answered
with an error; all three are republished to intake under their hand-back ids, the worker's last
published state is UNAVAILABLE, and the host ends with ``WorldBroken`` naming the dead rank
(the process would exit non-zero for its supervisor to restart it).

The rank is stopped (SIGSTOP) before the requests arrive, so the first one is provably running
(its step waits on the stopped member) and the others queued when it is killed: no timing is
assumed. The fast, fake-backend version of the same contract is
tests/live/test_live_rankd_fault.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time

import pytest
from engine_live_support import assignment, host_settings
from frozen import until_stopped
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError

from services.rankd.core import INTAKE_MSG_HEADER, handback_msg_id
from services.rankd.torch_backend import TINY_MODEL, TorchSettings, start_torch_host
from services.rankd.torch_world import WorldBroken, start_shielded
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    AssignmentAck,
    FirstToken,
    IntakeRequest,
    WorkerState,
    decode,
    from_json,
)
from shared.service import call, ensure_intake_stream
from shared.subjects import Subjects
from shared.worker import Lifecycle

WAIT_S = 120.0  # hang guard only
WID = "w-cp2-g0"
# The project's tiny random Qwen3 (TINY_MODEL), with a smaller vocabulary and context.
CFG = {**TINY_MODEL, "vocab_size": 256, "max_position_embeddings": 512}


async def test_a_killed_rank_hands_every_request_back_and_ends_the_host(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    settings = host_settings(nats_server.url, uniq, WID, drain_timeout_s=WAIT_S)
    ts = TorchSettings(model_json=json.dumps(CFG), seed=3, block_size=16, pages_per_rank=64,
                       degrees="1,2", decode_timeout_s=WAIT_S)
    host, pool = await start_torch_host(settings, ts, nc=nc)
    task = asyncio.create_task(host.run(nc, handle_signals=False))
    victim = pool.world.pids[1]
    results: list[FirstToken] = []

    async def on_result(msg: Msg) -> None:
        results.append(decode(FirstToken, msg.data, msg.headers))

    sub = await nc.subscribe(s.result_all(), cb=on_result)
    rids = ("q-1", "q-2", "q-3")
    try:
        os.kill(victim, signal.SIGSTOP)  # q-1's step will wait on this member
        until_stopped(victim)  # kill() returns before the stop takes hold
        async with asyncio.timeout(WAIT_S):
            for i, rid in enumerate(rids):
                while True:  # the worker's endpoints subscribe just after host start (bounded)
                    try:
                        await call(nc, s.worker_assign(WID),
                                   assignment(rid, WID, list(range(10 + i, 50 + i))), AssignmentAck,
                                   timeout_s=WAIT_S, headers={INTAKE_MSG_HEADER: f"m-{rid}"})
                        break
                    except NoRespondersError:
                        await asyncio.sleep(0.05)
            svc = host.services[WID]
            while svc.core.running is None:  # the executor picks q-1 up (bounded)
                await asyncio.sleep(0.02)
        assert svc.core.running.request_id == "q-1"
        assert [j.request_id for j in svc.core.queued] == ["q-2", "q-3"]

        os.kill(victim, signal.SIGKILL)
        cause = rf"rank 1 \(GPU 1, pid {victim}\) was killed by SIGKILL"
        with pytest.raises(WorldBroken, match=cause):
            await asyncio.wait_for(task, timeout=WAIT_S)
        assert re.search(cause, pool.world.broken or "")

        consumer = await js.pull_subscribe(s.intake_requests(), durable="sched")
        intake: dict[str, str] = {}
        async with asyncio.timeout(WAIT_S):
            while len(intake) < len(rids):
                for m in await consumer.fetch(len(rids) - len(intake), timeout=WAIT_S):
                    rid = decode(IntakeRequest, m.data, m.headers).request_id
                    intake[rid] = (m.headers or {}).get("Nats-Msg-Id", "")
                    await m.ack()
        assert intake == {rid: handback_msg_id(rid, f"m-{rid}", WID, 0) for rid in rids}
        await nc.flush()
        assert results == []  # no error FirstToken for requests that were never at fault
        kv = await js.key_value(s.worker_state_bucket())
        state = from_json(WorkerState, (await kv.get(WID)).value)
        assert (state.lifecycle, state.queue_len, state.served) == (Lifecycle.UNAVAILABLE, 0, 0)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
        await sub.unsubscribe()
        if not task.done():
            host.request_stop()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, timeout=WAIT_S)
        await pool.close()
    assert not any(pool.world.alive())


async def test_a_stop_sent_to_the_whole_process_group_is_no_world_fault(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """The rank processes share the rank daemon's process group, so a stop sent to the group
    (``vertumnus up``, systemd, a Ctrl-C) reaches them as well as the daemon. They leave it to
    the daemon: alive and serving after SIGTERM and SIGINT, no fault for its health probe, and
    the host's stop ends without one, its ranks stopped by the pool (status 0). Before, the
    signal killed the ranks while the workers were still stopping, and a probe that ran then
    made the orderly stop a world fault (exit status 75)."""
    s = Subjects(uniq)
    await ensure_intake_stream(nc.jetstream(), s)
    settings = host_settings(nats_server.url, uniq, WID, drain_timeout_s=WAIT_S)
    ts = TorchSettings(model_json=json.dumps(CFG), seed=3, block_size=16, pages_per_rank=64,
                       degrees="1,2", decode_timeout_s=WAIT_S)
    host, pool = await start_torch_host(settings, ts, nc=nc)
    task = asyncio.create_task(host.run(nc, handle_signals=False))
    try:
        async with asyncio.timeout(WAIT_S):
            while WID not in host.services:
                await asyncio.sleep(0.02)
        for pid in pool.world.pids:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGINT)
        # Answered after the signals were delivered (a rank takes them before it returns from
        # waiting on its pipe): a rank they ended would be gone by now.
        infos = await asyncio.to_thread(pool.world.info)
        assert [i.pid for i in infos] == list(pool.world.pids)
        assert host.services[WID].backend.health() is None  # type: ignore[attr-defined]

        host.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)  # returns: no WorldBroken raised
        assert host.fault is None and pool.world.broken is None
    finally:
        if not task.done():
            host.request_stop()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(task, timeout=WAIT_S)
        await pool.close()
    assert [p.exitcode for p in pool.world._procs] == [0, 0]


def test_a_rank_spawned_shielded_outlives_a_stop_in_its_first_instant() -> None:
    """A group stop that lands before a rank's code runs (its interpreter still starting)
    stays pending, blocked by the mask the rank was spawned with, and never kills it. The
    control: the same signal kills a process spawned plainly."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    shielded = ctx.Process(target=time.sleep, args=(0.5,))
    start_shielded(shielded)
    assert signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # restored here
    os.kill(shielded.pid, signal.SIGTERM)  # type: ignore[arg-type]
    plain = ctx.Process(target=time.sleep, args=(0.5,))
    plain.start()
    os.kill(plain.pid, signal.SIGTERM)  # type: ignore[arg-type]
    shielded.join(60)
    plain.join(60)
    assert (shielded.exitcode, plain.exitcode) == (0, -signal.SIGTERM)
