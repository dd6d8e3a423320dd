"""Every background task a worker serves with (the request executor, the state publisher, the
epoch watcher, the epoch-ack re-sender, the health probe) must not end silently while the
service serves, on a real nats-server with a real RankdService on the sim backend.

Before, only the request executor's end was a worker fault
(tests/live/test_live_rankd_executor_death.py); the other tasks' failures were collected at
the stop. Their loops catch ``Exception`` per step, but a BaseException (or anything raised
outside that step) ended them and the worker went on admitting requests as ACTIVE:

* a dead state publisher: no WorkerState after it (no heartbeat, the scheduler placing on a
  stale view until the lease expires);
* a dead epoch watcher: no later epoch record adopted -- a controller draining the worker
  waits for an EpochAck that never comes (its drain times out and aborts) while the worker
  keeps admitting under the old composition.

Now each of them ending while the service is not stopping is a worker fault
(services/rankd/service.py ``RankdService._task_ended``): the queued requests are handed back,
the worker publishes UNAVAILABLE and stops, and ``run`` raises the fault so its supervisor
restarts it. Only the executor's end hands back the running request too (nothing will finish
it); otherwise the executor still runs it to its end.

Causes used here are real inputs of the service, not patches of it: a backend whose
``max_seq_len`` (read by every state publication) or ``health()`` raises, and, for the
watcher, the injected ``clock``: nothing on the NATS side ends the watcher (deleting the
epoch bucket under it leaves it silent, not ended), and the only way a caller can end it is
an adoption raising a BaseException past its ``except Exception``."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client
from rankd_support import assign, handed_back, last_state, results_of, stopped, until
from service_support import service_running

from services.rankd.backend import PrefillResult, SimBackend
from services.rankd.service import WATCH_TASK, RankdService
from services.rankd.settings import RankdSettings
from shared.ids import WorkerFault
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
    EpochRecord,
    EpochWorker,
    to_json,
)
from shared.service import ensure_intake_stream, epoch_kv
from shared.subjects import Subjects
from shared.worker import GpuGroup, Lifecycle

WAIT_S = 15.0  # bound for correctness waits only; nothing asserts on speed
WID = "w-cp2-g2"


class Abort(BaseException):
    """What a broken dependency might raise past ``except Exception`` (not a WorkerFault)."""


class Breakable:
    """A sim engine (instant prefills) whose prefill waits while :attr:`hold` is clear, and
    whose ``max_seq_len`` and ``health()`` raise, once each, what the test arms them with."""

    name = "sim"

    def __init__(self) -> None:
        self._sim = SimBackend(prefill_time=lambda r, p, c, kind="cp": 0.0)
        self.hold = asyncio.Event()
        self.hold.set()
        self.running = asyncio.Event()
        self.limit_raises: BaseException | None = None
        self.health_raises: BaseException | None = None
        self.raised = asyncio.Event()

    @property
    def max_seq_len(self) -> int | None:
        exc, self.limit_raises = self.limit_raises, None
        if exc is not None:
            self.raised.set()
            raise exc
        return None

    def health(self) -> WorkerFault | None:
        exc, self.health_raises = self.health_raises, None
        if exc is not None:
            self.raised.set()
            raise exc
        return None

    async def prefill(self, a: Assignment) -> PrefillResult:
        self.running.set()
        await self.hold.wait()
        return await self._sim.prefill(a)

    async def close(self) -> None:
        await self._sim.close()


class Clock:
    """``time.time``, but the next call made inside the task named :attr:`armed` raises
    :class:`Abort` (once)."""

    def __init__(self) -> None:
        self.armed: str | None = None
        self.raised = asyncio.Event()

    def __call__(self) -> float:
        task = asyncio.current_task()
        if self.armed is not None and task is not None and task.get_name() == self.armed:
            self.armed = None
            self.raised.set()
            raise Abort("clock aborted")
        return time.time()


def record(epoch: int, lifecycle: Lifecycle) -> bytes:
    g = GpuGroup.from_worker_id(WID)
    return to_json(EpochRecord(
        epoch=epoch, committed_at_s=time.time(),
        workers=[EpochWorker(worker_id=WID, first_gpu=g.first_gpu, degree=g.degree,
                             lifecycle=lifecycle)]))


def service(url: str, prefix: str, backend: Breakable, clock: Clock | None = None
            ) -> RankdService:
    return RankdService(
        RankdSettings(nats_url=url, subject_prefix=prefix, worker_id=WID, heartbeat_s=0.2,
                      redirect_timeout_s=5.0, drain_timeout_s=WAIT_S),
        backend, clock=clock or time.time,
    )


def serving_tasks() -> str:
    """The worker's background tasks still running (a failure message's detail: a dead one
    is missing from it)."""
    return ", ".join(sorted(t.get_name() for t in asyncio.all_tasks()
                            if t.get_name().startswith("rankd-") and not t.done()))


async def fault_of(svc: RankdService, task: asyncio.Task[None], what: str) -> None:
    """Wait (bounded) until ``svc`` faulted; fail with what the worker looks like if not."""
    await until(lambda: svc.fault is not None or task.done(),
                f"{what}: the worker still serves ({svc.core.lifecycle.value}, epoch "
                f"{svc.core.epoch}) and no fault; tasks running: {serving_tasks()}")


async def ended_by_fault(task: asyncio.Task[None], match: str) -> None:
    """Wait (bounded) for the worker's run to end: it raised a WorkerFault matching ``match``."""
    await asyncio.wait({task}, timeout=WAIT_S)
    assert task.done()
    with pytest.raises(WorkerFault, match=match):
        task.result()


async def test_a_state_publisher_that_dies_is_a_worker_fault(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """The backend's ``max_seq_len``, read by each state publication, raises a BaseException:
    the publisher ends. A worker fault: the queued request is handed back, the running one
    finishes (the executor still runs), the last state is UNAVAILABLE, ``run`` raises."""
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    backend = Breakable()
    svc = service(nats_server.url, uniq, backend)
    task = asyncio.create_task(svc.run(handle_signals=False))
    sub = None
    try:
        await asyncio.wait_for(svc.started.wait(), timeout=WAIT_S)
        results, sub = await results_of(nc, s)
        backend.hold.clear()
        await assign(nc, s, "p-1", WID)
        await asyncio.wait_for(backend.running.wait(), timeout=WAIT_S)  # p-1 runs
        await assign(nc, s, "p-2", WID)  # queued behind it
        backend.limit_raises = Abort("engine limit unreadable")  # the next heartbeat reads it
        await asyncio.wait_for(backend.raised.wait(), timeout=WAIT_S)
        await fault_of(svc, task, "state publisher ended")
        assert set(await handed_back(js, s, 1)) == {"p-2"}
        backend.hold.set()  # p-1 was not at fault: it completes
        await ended_by_fault(task, "state publisher ended: Abort")
        await nc.flush()  # the service drained its connection: whatever it published is here
        assert [(r.request_id, r.error, r.token is not None) for r in results] == [
            ("p-1", None, True)]
        state = await last_state(js, s, WID)  # published by the stop itself
        assert (state.lifecycle, state.queue_len) == (Lifecycle.UNAVAILABLE, 0)
    finally:
        backend.hold.set()
        await stopped(svc, task)
        if sub is not None:
            await sub.unsubscribe()  # type: ignore[attr-defined]


async def test_an_epoch_watcher_that_dies_is_a_worker_fault(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """The adoption of a record raises a BaseException (here out of the injected clock,
    inside the watcher only): the watcher ends. Before, the worker adopted no later record
    (the controller's DRAINING record below was never acknowledged) and served on ACTIVE;
    now it is a worker fault: the queued request is handed back, ``run`` raises."""
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    backend = Breakable()
    clock = Clock()
    svc = service(nats_server.url, uniq, backend, clock)
    task = asyncio.create_task(svc.run(handle_signals=False))
    epochs = await epoch_kv(js, s)
    sub = None
    try:
        await asyncio.wait_for(svc.started.wait(), timeout=WAIT_S)
        results, sub = await results_of(nc, s)
        backend.hold.clear()
        await assign(nc, s, "e-1", WID)
        await asyncio.wait_for(backend.running.wait(), timeout=WAIT_S)  # e-1 runs
        await assign(nc, s, "e-2", WID)  # queued behind it
        clock.armed = WATCH_TASK
        await epochs.put(s.epoch_key(), record(1, Lifecycle.ACTIVE))
        await asyncio.wait_for(clock.raised.wait(), timeout=WAIT_S)  # its adoption raised
        # The controller drains the worker next; a live watcher adopts this (or faults).
        await epochs.put(s.epoch_key(), record(2, Lifecycle.DRAINING))
        await fault_of(svc, task, "epoch watcher ended")
        assert set(await handed_back(js, s, 1)) == {"e-2"}
        backend.hold.set()
        await ended_by_fault(task, "epoch watcher ended: Abort")
        await nc.flush()
        assert [(r.request_id, r.error) for r in results] == [("e-1", None)]
        state = await last_state(js, s, WID)
        assert (state.lifecycle, state.queue_len) == (Lifecycle.UNAVAILABLE, 0)
    finally:
        backend.hold.set()
        await stopped(svc, task)
        if sub is not None:
            await sub.unsubscribe()  # type: ignore[attr-defined]


async def test_a_health_probe_that_dies_is_a_worker_fault(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """``health()`` raises a BaseException: the probe ends, and a rank dying under the idle
    worker would go unnoticed. A worker fault."""
    s = Subjects(uniq)
    js = nc.jetstream()
    backend = Breakable()
    svc = service(nats_server.url, uniq, backend)
    task = asyncio.create_task(svc.run(handle_signals=False))
    try:
        await asyncio.wait_for(svc.started.wait(), timeout=WAIT_S)
        backend.health_raises = Abort("probe aborted")
        await asyncio.wait_for(backend.raised.wait(), timeout=WAIT_S)
        await fault_of(svc, task, "health probe ended")
        await ended_by_fault(task, "health probe ended: Abort")
        state = await last_state(js, s, WID)
        assert state.lifecycle is Lifecycle.UNAVAILABLE
    finally:
        await stopped(svc, task)


async def test_a_probe_that_fails_with_an_exception_only_stops_probing(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """A ``health()`` that raises an Exception is a broken probe, not a broken worker: the
    probe ends on purpose (logged) and the worker serves on -- its normal end is not a fault
    (a probe bug would otherwise restart the worker for ever)."""
    s = Subjects(uniq)
    backend = Breakable()
    svc = service(nats_server.url, uniq, backend)
    sub = None
    try:
        async with service_running(svc, timeout_s=WAIT_S) as task:
            results, sub = await results_of(nc, s)
            backend.health_raises = RuntimeError("probe bug")
            await asyncio.wait_for(backend.raised.wait(), timeout=WAIT_S)
            # Round trips after the probe's end: it was noticed by now.
            await assign(nc, s, "h-1", WID)
            await until(lambda: len(results) == 1, "h-1 answered")
            assert results[0].token is not None and results[0].error is None
            assert not task.done() and svc.fault is None
            assert svc.core.lifecycle is Lifecycle.ACTIVE
    finally:
        if sub is not None:
            await sub.unsubscribe()  # type: ignore[attr-defined]
    assert task.done() and task.exception() is None  # a clean stop


async def test_a_start_that_fails_after_its_tasks_began_is_no_worker_fault(
    nats_server: EmbeddedNats, uniq: str
) -> None:
    """The start fails after the background tasks were made (here the first state
    publication, in ``serving``): its undoing stops the epoch watcher while the service is
    not stopping. That end is the undoing's, not a fault: ``run`` raises the start's own
    error (a rank host tries such a start again) and no fault is reported."""
    backend = Breakable()
    backend.limit_raises = RuntimeError("limit not known yet")  # the first read: serving()
    faults: list[WorkerFault] = []
    svc = RankdService(
        RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, worker_id=WID,
                      heartbeat_s=0.2, redirect_timeout_s=5.0, drain_timeout_s=5.0),
        backend, on_fault=faults.append)
    with pytest.raises(RuntimeError, match="limit not known yet"):
        await asyncio.wait_for(svc.run(handle_signals=False), timeout=WAIT_S)
    assert backend.raised.is_set()
    assert svc.fault is None and faults == []
