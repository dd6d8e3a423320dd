"""The worker's request executor (the task that takes the next queued request and runs the
backend's prefill) must never end silently while the service serves, on a real nats-server.

Before, a backend whose ``prefill`` raised ``asyncio.CancelledError`` without the service
cancelling anything (say an internal future of the engine's cancelled under it), or any other
BaseException the executor does not catch, ended the executor task: the worker went on
admitting requests and publishing ACTIVE heartbeats, so the scheduler kept placing requests
there and none of them ever ran (failures of background tasks were only collected at stop).

Now a CancelledError from the backend, while the service is not cancelling the executor, is
the request's failure like any other exception of one prefill (an error FirstToken, the
worker serves on); an executor that ends for any other reason while the service is not
stopping is a worker fault (services/rankd/service.py): the running and queued requests are
handed back to intake, the worker publishes UNAVAILABLE and stops, and ``run`` raises the
fault so its supervisor restarts it."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from rankd_support import assign, handed_back, last_state, results_of, stopped, until
from service_support import service_running

from services.rankd.backend import PrefillResult, SimBackend
from services.rankd.core import handback_msg_id
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.ids import WorkerFault
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
)
from shared.service import ensure_intake_stream
from shared.subjects import Subjects
from shared.worker import Lifecycle

WAIT_S = 15.0  # bound for correctness waits only; nothing asserts on speed
WID = "w-cp2-g2"


class EngineAbort(BaseException):
    """What a broken engine might raise past ``except Exception`` (not a WorkerFault)."""


class FailsFirst:
    """A fake engine: its first prefill waits for :attr:`release`, then ends with what
    ``first`` makes (raises it); every later prefill is an instant sim result."""

    name = "sim"

    def __init__(self, first: str) -> None:
        self.first = first
        self.release = asyncio.Event()
        self.running = asyncio.Event()
        self.calls = 0
        self._sim = SimBackend(prefill_time=lambda r, p, c, kind="cp": 0.0)

    async def prefill(self, a: Assignment) -> PrefillResult:
        self.calls += 1
        if self.calls == 1:
            self.running.set()
            await self.release.wait()
            if self.first == "cancelled":
                # An internal future of the engine's cancelled under it (e.g. its pool shut
                # down): awaiting it raises CancelledError in a task nobody cancelled.
                inner = asyncio.get_running_loop().create_future()
                inner.cancel()
                await inner
            raise EngineAbort("engine aborted")
        return await self._sim.prefill(a)

    async def close(self) -> None:
        await self._sim.close()


def service(url: str, prefix: str, backend: FailsFirst) -> RankdService:
    return RankdService(
        RankdSettings(nats_url=url, subject_prefix=prefix, worker_id=WID, heartbeat_s=0.2,
                      redirect_timeout_s=5.0, drain_timeout_s=5.0),
        backend,
    )


async def test_a_cancelled_error_from_the_backend_fails_only_its_request(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """CancelledError out of ``prefill`` while the service cancels nothing: that request is
    answered with an error, the requests queued behind it run, the worker stays ACTIVE."""
    s = Subjects(uniq)
    backend = FailsFirst("cancelled")
    svc = service(nats_server.url, uniq, backend)
    sub = None
    try:
        async with service_running(svc, timeout_s=WAIT_S) as task:
            results, sub = await results_of(nc, s)
            await assign(nc, s, "c-1", WID)
            await asyncio.wait_for(backend.running.wait(), timeout=WAIT_S)  # c-1 runs
            await assign(nc, s, "c-2", WID)  # queued behind it
            backend.release.set()  # c-1's prefill ends with CancelledError
            await until(lambda: {r.request_id for r in results} == {"c-1", "c-2"},
                        "both requests answered")
            await assign(nc, s, "c-3", WID)  # the worker still serves new requests
            await until(lambda: len(results) == 3, "c-3 answered")
            by_id = {r.request_id: r for r in results}
            assert by_id["c-1"].token is None and "prefill failed" in (by_id["c-1"].error or "")
            assert [(by_id[r].error, by_id[r].token is not None) for r in ("c-2", "c-3")] == [
                (None, True), (None, True)]
            assert not task.done() and svc.fault is None
            assert svc.core.lifecycle is Lifecycle.ACTIVE and svc.core.running is None
            assert svc.core.served == 2
    finally:
        if sub is not None:
            await sub.unsubscribe()  # type: ignore[attr-defined]
    assert task.done() and task.exception() is None  # a clean stop


async def test_an_executor_that_dies_is_a_worker_fault(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """A BaseException the executor does not catch ends it while the service serves: a
    worker fault. The running and queued requests go back to intake under their hand-back
    ids, nobody is answered with an error, the last state is UNAVAILABLE and ``run`` raises
    the fault (the supervisor restarts the process)."""
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    backend = FailsFirst("abort")
    svc = service(nats_server.url, uniq, backend)
    task = asyncio.create_task(svc.run(handle_signals=False))
    sub = None
    try:
        await asyncio.wait_for(svc.started.wait(), timeout=WAIT_S)
        results, sub = await results_of(nc, s)
        await assign(nc, s, "e-1", WID)
        await asyncio.wait_for(backend.running.wait(), timeout=WAIT_S)  # e-1 runs
        for rid in ("e-2", "e-3"):
            await assign(nc, s, rid, WID)  # queued behind it
        backend.release.set()  # e-1's prefill raises EngineAbort: the executor ends
        await asyncio.wait({task}, timeout=WAIT_S)
        assert task.done(), "the worker went on serving with a dead executor"
        with pytest.raises(WorkerFault, match="EngineAbort"):
            task.result()
        assert svc.fault is not None and svc.core.served == 0 and len(svc.core) == 0
        intake = await handed_back(js, s, 3)
        assert intake == {rid: handback_msg_id(rid, f"m-{rid}", WID, 0)
                          for rid in ("e-1", "e-2", "e-3")}
        await nc.flush()  # the service drained its connection: whatever it published is here
        assert results == []  # handed back, not failed
        state = await last_state(js, s, WID)
        assert (state.lifecycle, state.queue_len) == (Lifecycle.UNAVAILABLE, 0)
        assert backend.calls == 1  # nothing else ran here
    finally:
        await stopped(svc, task)
        if sub is not None:
            await sub.unsubscribe()  # type: ignore[attr-defined]
