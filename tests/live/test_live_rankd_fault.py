"""A worker fault (the backend says the *worker* can no longer compute, e.g. a rank process
died) on a real nats-server: no request is failed for it. The running and queued requests are
handed back to intake under their hand-back ids, the worker publishes UNAVAILABLE and stops,
and the service (or the whole rank host) ends with the fault so its process exits non-zero.
The real torch world version is tests/engine_live/test_engine_live_fault.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError
from rankd_support import assign, handed_back, last_state, results_of

from services.rankd import main as rankd_main
from services.rankd.backend import PrefillResult, SimBackend
from services.rankd.core import handback_msg_id
from services.rankd.host import RankdHost
from services.rankd.service import RankdService
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
from shared.worker import Lifecycle

WAIT_S = 20.0  # bound for correctness waits only; nothing asserts on speed
CAUSE = "rank 1 (GPU 1, pid 4242) was killed by SIGKILL"


class Gated:
    """An execution backend whose prefills wait for :attr:`release`; then each raises
    ``fault`` (the worker can no longer compute) or returns an instant sim result."""

    name = "sim"

    def __init__(self, fault: WorkerFault | None = None) -> None:
        self.fault = fault
        self.release = asyncio.Event()
        self.running = asyncio.Event()
        self._sim = SimBackend(prefill_time=lambda r, p, c, kind="cp": 0.0)

    async def prefill(self, assignment: Assignment) -> PrefillResult:
        self.running.set()
        await self.release.wait()
        if self.fault is not None:
            raise self.fault
        return await self._sim.prefill(assignment)

    async def close(self) -> None:
        await self._sim.close()


async def test_a_worker_fault_hands_back_instead_of_failing(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    wid = "w-cp2-g2"
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    backend = Gated(WorkerFault(CAUSE))
    svc = RankdService(
        RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, worker_id=wid,
                      heartbeat_s=0.2, redirect_timeout_s=5.0, drain_timeout_s=5.0),
        backend,
    )
    task = asyncio.create_task(svc.run(handle_signals=False))
    await asyncio.wait_for(svc.started.wait(), timeout=WAIT_S)
    results, sub = await results_of(nc, s)
    for rid in ("q-1", "q-2", "q-3"):
        await assign(nc, s, rid, wid)
    await asyncio.wait_for(backend.running.wait(), timeout=WAIT_S)  # q-1 runs, q-2, q-3 wait
    backend.release.set()  # q-1's prefill meets the fault

    with pytest.raises(WorkerFault, match="killed by SIGKILL"):
        await asyncio.wait_for(task, timeout=WAIT_S)
    assert svc.fault is not None and svc.core.served == 0 and len(svc.core) == 0
    intake = await handed_back(js, s, 3)
    assert intake == {rid: handback_msg_id(rid, f"m-{rid}", wid, 0)
                      for rid in ("q-1", "q-2", "q-3")}
    await nc.flush()  # the service drained its connection: whatever it published is here
    assert results == []  # nobody was answered with an error for the worker's fault
    state = await last_state(js, s, wid)
    assert (state.lifecycle, state.queue_len) == (Lifecycle.UNAVAILABLE, 0)
    await sub.unsubscribe()  # type: ignore[attr-defined]


async def host_ended_by_the_fault(task, nc, js, s, backends, results, sub, *,  # type: ignore[no-untyped-def]
                                  completed: str) -> None:
    """The host's run ends with the fault; only ``completed`` got a (good) result; every
    worker's last state is UNAVAILABLE."""
    with pytest.raises(WorkerFault, match="killed by SIGKILL"):
        await asyncio.wait_for(task, timeout=WAIT_S)
    await nc.flush()
    assert [(r.request_id, r.error) for r in results] == [(completed, None)]
    for wid in backends:
        assert (await last_state(js, s, wid)).lifecycle is Lifecycle.UNAVAILABLE
    await sub.unsubscribe()


async def test_a_worker_fault_stops_every_worker_of_the_host(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """One worker meets the fault: every worker of the host hands its queue back; a request
    running elsewhere may still complete (its answer is valid); the host ends with the fault."""
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    backends = {"w-cp1-g0": Gated(WorkerFault(CAUSE)), "w-cp1-g1": Gated()}
    settings = RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, heartbeat_s=0.2,
                             redirect_timeout_s=5.0, drain_timeout_s=WAIT_S)
    host = RankdHost(settings, range(0, 2), lambda wid, kind: backends[wid],
                     initial=list(backends))
    task = asyncio.create_task(host.run(nc, handle_signals=False))
    results, sub = await results_of(nc, s)
    for rid, wid in (("f-1", "w-cp1-g0"), ("f-2", "w-cp1-g0"), ("b-1", "w-cp1-g1"),
                     ("b-2", "w-cp1-g1")):
        await assign(nc, s, rid, wid)
    for b in backends.values():
        await asyncio.wait_for(b.running.wait(), timeout=WAIT_S)  # f-1 and b-1 run
    backends["w-cp1-g0"].release.set()

    intake = await handed_back(js, s, 3)
    assert intake == {rid: handback_msg_id(rid, f"m-{rid}", wid, 0)
                      for rid, wid in (("f-1", "w-cp1-g0"), ("f-2", "w-cp1-g0"),
                                       ("b-2", "w-cp1-g1"))}
    backends["w-cp1-g1"].release.set()  # b-1 was not at fault and completes
    await host_ended_by_the_fault(task, nc, js, s, backends, results, sub, completed="b-1")


async def test_a_health_probe_fault_stops_every_worker_of_the_host(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """A backend's health probe (the torch world: a rank died, here under an idle worker)
    reports a fault: every worker of the host hands its queue back, a running request may
    still finish, the host ends with the fault."""
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    backends = {"w-cp1-g0": Gated(), "w-cp1-g1": Gated()}
    broken: list[WorkerFault] = []
    backends["w-cp1-g1"].health = lambda: broken[0] if broken else None  # type: ignore[attr-defined]
    settings = RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, heartbeat_s=0.2,
                             redirect_timeout_s=5.0, drain_timeout_s=WAIT_S)
    host = RankdHost(settings, range(0, 2), lambda wid, kind: backends[wid],
                     initial=list(backends))
    task = asyncio.create_task(host.run(nc, handle_signals=False))
    results, sub = await results_of(nc, s)
    for rid in ("a-1", "a-2"):
        await assign(nc, s, rid, "w-cp1-g0")
    await asyncio.wait_for(backends["w-cp1-g0"].running.wait(), timeout=WAIT_S)
    broken.append(WorkerFault(CAUSE))
    assert await handed_back(js, s, 1) == {"a-2": handback_msg_id("a-2", "m-a-2", "w-cp1-g0", 0)}
    backends["w-cp1-g0"].release.set()
    await host_ended_by_the_fault(task, nc, js, s, backends, results, sub, completed="a-1")


def test_main_exits_non_zero_after_a_worker_fault(monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m services.rankd.main`` ends with WORKER_FAULT_EXIT (not 0, no traceback) when
    its service or host raised a worker fault, so its supervisor restarts it."""

    def faulted(settings: object, serve: object) -> None:
        raise WorkerFault(CAUSE)

    monkeypatch.setattr(rankd_main, "run_service", faulted)
    with pytest.raises(SystemExit) as exc:
        rankd_main.main([])
    assert exc.value.code == rankd_main.WORKER_FAULT_EXIT != 0


def test_the_sim_launcher_exits_for_a_restart_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """``vertumnus up``'s sim rank daemon (its own ``serve`` with the ground truth) ends a
    worker fault the same way as the real main: exit status WORKER_FAULT_EXIT."""
    from vertumnus.live import rankd_sim

    def faulted(settings: object, serve: object) -> None:
        raise WorkerFault(CAUSE)

    monkeypatch.setattr(rankd_main, "run_service", faulted)
    with pytest.raises(SystemExit) as exc:
        rankd_sim.main([])
    assert exc.value.code == rankd_main.WORKER_FAULT_EXIT


async def test_a_fault_while_a_new_worker_inherits_its_pages_starts_nothing_more(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """A split's children install their retained pages before they start (torch:
    ``inherit_prefixes``, which runs on a thread); if the host fails meanwhile (another worker
    met a fault), the child is not started: the host stops and ends with the fault."""
    s = Subjects(uniq)
    js = nc.jetstream()
    await ensure_intake_stream(js, s)
    hosts: list[RankdHost] = []
    inherited: list[str] = []

    class Inheriting(SimBackend):
        def __init__(self, wid: str) -> None:
            super().__init__(prefill_time=lambda r, p, c, kind="cp": 0.0)
            self.wid = wid

        async def inherit_prefixes(self, pairs: list[tuple[int, int | None]], epoch: int
                                   ) -> list[tuple[int, int | None]]:
            inherited.append(self.wid)
            hosts[0].fail(WorkerFault(CAUSE))
            return list(pairs)

    settings = RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, heartbeat_s=0.2,
                             redirect_timeout_s=5.0, drain_timeout_s=WAIT_S, kv_total_blocks=64)
    host = RankdHost(settings, range(0, 2), lambda wid, kind: Inheriting(wid),
                     initial=["w-cp2-g0"])
    hosts.append(host)
    task = asyncio.create_task(host.run(nc, handle_signals=False))
    async with asyncio.timeout(WAIT_S):
        while host.worker_ids != {"w-cp2-g0"}:
            host.changed.clear()
            await host.changed.wait()
    epochs = await epoch_kv(js, s)
    children = [EpochWorker(worker_id=w, first_gpu=g, degree=1, lifecycle=Lifecycle.ACTIVE)
                for w, g in (("w-cp1-g0", 0), ("w-cp1-g1", 1))]
    await epochs.put(s.epoch_key(), to_json(EpochRecord(epoch=1, workers=children,
                                                       committed_at_s=time.time())))
    with pytest.raises(WorkerFault, match="killed by SIGKILL"):
        await asyncio.wait_for(task, timeout=WAIT_S)
    assert inherited == ["w-cp1-g0"]  # the first child met it; neither child started
    assert host.services == {}
    states = await js.key_value(s.worker_state_bucket())
    for child in ("w-cp1-g0", "w-cp1-g1"):
        with pytest.raises(KeyNotFoundError):
            await states.get(child)  # never published a state: never ran
