"""A request that starts on a draining source after the controller's queue query.

The controller asks each source of a plan for its queue (QueueQuery), then writes the drain
record; a rank daemon stops admitting only once it adopts that record. A request assigned in
between is admitted and may start before the drain record reaches the worker. Before, the
controller judged the source by the answer it had (idle: drained at once) and wrote the commit
record right after the drain record, while that request still ran on the source's GPUs (the
rank host then starts the targets there). The switch must wait for every request that started
before the source stopped accepting.

Made deterministic with a merge of a real rank daemon (``w-cp2-g0``, rankd, sim backend whose
prefills wait for a gate) and a worker the test plays (``w-cp2-g2``: its queue endpoint, acks
and heartbeats): the controller asks both at once and waits for both answers; the test holds
``w-cp2-g2``'s answer until a request assigned to the real worker after it answered has started
there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from gated_backend import GatedBackend
from live_ctl_support import Collector, FakeScheduler, eventually
from nats.aio.client import Client
from nats.aio.msg import Msg
from test_live_controller import H, settings
from test_live_controller_leases import heartbeats

from services.controller.service import (
    ControllerService,
    QueueReport,
    reconf_subject,
    worker_queue_subject,
)
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.schemas import (
    Assignment,
    AssignmentAck,
    EpochAck,
    EpochRecord,
    IntakeRequest,
    QueueQuery,
    SchemaError,
    decode,
    encode,
)
from shared.service import call, epoch_kv, worker_state_kv
from shared.subjects import Subjects
from shared.worker import Lifecycle

REAL, PLAYED = "w-cp2-g0", "w-cp2-g2"




def assignment(rid: str, wid: str) -> Assignment:
    now = time.time()
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=100, arrival_s=now - 0.01),
        worker_id=wid,
        epoch=0,
        degree=2,
        prefix_tokens=0,
        recompute_tokens=100,
        predicted_s=0.01,
        dequeued_at_s=now,
        assigned_at_s=now,
    )


class PlayedWorker:
    """``w-cp2-g2`` as a rank daemon looks on the bus, idle: answers queue queries (the
    first one only once :meth:`answer_first` is called) and acknowledges, for its GPUs, every
    record that names it (as rankd acks each record it adopts as a member)."""

    def __init__(self, nc: Client, s: Subjects) -> None:
        self.nc, self.s = nc, s
        self.first: Msg | None = None
        self.asked = asyncio.Event()
        self._release = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._watcher: Any = None

    async def start(self) -> None:
        await self.nc.subscribe(worker_queue_subject(self.s, PLAYED), cb=self._on_query)
        kv = await epoch_kv(self.nc.jetstream(), self.s)
        self._watcher = await kv.watch(self.s.epoch_key())
        self._tasks.append(asyncio.create_task(self._follow()))

    async def _on_query(self, msg: Msg) -> None:
        if self.first is None:
            self.first = msg
            self.asked.set()
            self._tasks.append(asyncio.create_task(self._answer_later(msg)))
            return
        await self._answer(msg)

    async def _answer_later(self, msg: Msg) -> None:
        await self._release.wait()
        await self._answer(msg)

    async def _answer(self, msg: Msg) -> None:
        data, headers = encode(QueueReport(worker_id=PLAYED, queued=[], in_flight=[]))
        await self.nc.publish(msg.reply, data, headers=headers)

    def answer_first(self) -> None:
        self._release.set()

    async def _follow(self) -> None:
        last = -1
        async for entry in self._watcher:
            if entry is None or not entry.value:
                continue
            try:
                rec = decode(EpochRecord, entry.value)
            except SchemaError:
                continue
            if rec.epoch <= last:
                continue
            last = rec.epoch
            mine = next((w for w in rec.workers if w.worker_id == PLAYED), None)
            if mine is None:
                continue
            for gpu in mine.group.gpus:
                data, headers = encode(EpochAck(gpu=gpu, epoch=rec.epoch, degree=mine.degree,
                                                worker_id=PLAYED, adopted_at_s=time.time()))
                await self.nc.publish(self.s.epoch_ack(gpu), data, headers=headers)

    async def stop(self) -> None:
        self._release.set()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()


async def test_a_request_started_after_the_queue_query_delays_the_switch(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    reconfs = Collector()
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    # Who answered the controller's queue query of the real worker: every reply on the bus.
    queries: list[Msg] = []
    replies: list[Msg] = []

    async def on_query(msg: Msg) -> None:
        queries.append(msg)

    async def on_reply(msg: Msg) -> None:
        replies.append(msg)

    await nc.subscribe(worker_queue_subject(s, REAL), cb=on_query)
    await nc.subscribe("_INBOX.>", cb=on_reply)
    played = PlayedWorker(nc, s)
    await played.start()
    await nc.flush()
    # 2CP2 under little demand: merged into w-cp4-g0. The played worker's answer is held, so
    # the controller's wait for it is long (a bound, not a timing).
    ctl = await services(ControllerService(settings(
        nats_server.url, uniq, "ctl-late", num_gpus=4, initial_composition="2CP2",
        queue_query_timeout_s=60.0)))
    backend = GatedBackend()
    real = await services(RankdService(
        RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, worker_id=REAL,
                      heartbeat_s=0.2, kv_total_blocks=64),
        backend))
    states = await worker_state_kv(nc.jetstream(), s)
    sched = FakeScheduler(nc, s, H, lambda: 0.1)
    try:
        async with heartbeats(states, [PLAYED]):
            async def both_known() -> bool:
                return REAL in ctl._states and PLAYED in ctl._states

            await eventually(both_known, what="both workers' states at the controller")
            await sched.start()
            await asyncio.wait_for(played.asked.wait(), 30)

            async def real_answered() -> bool:
                return any(q.reply and any(r.subject == q.reply for r in replies)
                           for q in queries)

            await eventually(real_answered, what="the real worker answered the queue query")
            # Assigned after its answer, before any drain record: admitted and started.
            await call(nc, s.worker_assign(REAL), assignment("r-late", REAL), AssignmentAck)

            async def running() -> bool:
                rep = await call(nc, s.worker_queue(REAL), QueueQuery(worker_id=REAL),
                                 QueueReport)
                return rep.in_flight == ["r-late"]

            await eventually(running, what="r-late running on the real worker")
            played.answer_first()

            def committed() -> bool:
                return any(r["phase"] == "committed" for r in reconfs.items)

            async def awaited_or_committed() -> bool:
                waits = any("r-late" in per.get(REAL, ()) for per in ctl._awaiting.values())
                return waits or committed()

            await eventually(awaited_or_committed,
                             what="r-late awaited by the drain (or the switch committed)")
            assert not committed(), "the switch committed while r-late ran on its source"
            assert real.core.lifecycle is not Lifecycle.ACTIVE  # it stopped admitting
            backend.gate.set()
            done = await reconfs.first(lambda r: r["phase"] == "committed",
                                       what="commit once r-late finished")
            assert done["sources"] == [REAL, PLAYED] and done["targets"] == ["w-cp4-g0"]
            assert real.core.served == 1 and real.core.running is None
            assert ctl.counters["finished"] >= 1
    finally:
        backend.gate.set()
        await sched.stop()
        await played.stop()
