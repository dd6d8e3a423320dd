"""A rank host applying an epoch record that re-creates a worker id whose previous instance
is still stopping (it must end first: one service per worker id) starts the record's other
new workers without waiting for it, on a real nats-server.

Before, the host walked the record's workers in order and awaited the old instance before
starting the re-created one, so every new worker after it in the record waited too -- for as
long as that old instance's stop takes: its running request (``drain_timeout_s``), its
hand-backs (``redirect_timeout_s``), the final state and the endpoints' stop on a slow bus.
Their EpochAcks waited with them (a controller exposes an operation's targets on their acks).
Now only the re-created worker waits, each for its own predecessor."""

from __future__ import annotations

import asyncio
import contextlib
import time

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from rankd_host_support import record

from services.rankd.backend import PrefillResult, SimBackend
from services.rankd.core import INTAKE_MSG_HEADER
from services.rankd.host import RankdHost
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
    AssignmentAck,
    FirstToken,
    IntakeRequest,
    decode,
)
from shared.service import call, epoch_kv
from shared.subjects import Subjects
from shared.worker import GpuGroup, WorkerKind

WAIT_S = 20.0  # bound for correctness waits only; nothing asserts on speed
SLOW_STOP_S = 120.0  # the old instance's drain bound: far beyond any wait of the test


class Gated:
    """A sim backend (instant prefills) whose prefills wait for :attr:`release` when made
    with ``gated``."""

    name = "sim"

    def __init__(self, gated: bool) -> None:
        self.release = asyncio.Event()
        if not gated:
            self.release.set()
        self.running = asyncio.Event()
        self._sim = SimBackend(prefill_time=lambda r, p, c, kind="cp": 0.0)

    async def prefill(self, a: Assignment) -> PrefillResult:
        self.running.set()
        await self.release.wait()
        return await self._sim.prefill(a)

    async def close(self) -> None:
        await self._sim.close()




def assignment(rid: str, wid: str, epoch: int) -> Assignment:
    now = time.time()
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=100, arrival_s=now - 0.01),
        worker_id=wid, epoch=epoch, degree=GpuGroup.from_worker_id(wid).degree,
        prefix_tokens=0, recompute_tokens=100, predicted_s=0.01, assigned_at_s=now)


async def assign(nc: Client, s: Subjects, rid: str, wid: str, epoch: int) -> AssignmentAck:
    """Assign once the worker's endpoint is up (a host's worker shows up just before)."""
    async with asyncio.timeout(WAIT_S):
        while True:
            try:
                return await call(nc, s.worker_assign(wid), assignment(rid, wid, epoch),
                                  AssignmentAck, timeout_s=WAIT_S,
                                  headers={INTAKE_MSG_HEADER: f"m-{rid}"})
            except NoRespondersError:
                await asyncio.sleep(0.05)


async def serving(host: RankdHost, wanted: set[str], what: str) -> None:
    """Until the host's running (not stopping) workers are ``wanted``, each started (bounded)."""
    def ready() -> bool:
        return host.worker_ids == wanted and all(
            host.services[w].started.is_set() for w in wanted)
    try:
        async with asyncio.timeout(WAIT_S):
            while not ready():
                host.changed.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(0.1):  # started is not a host change
                        await host.changed.wait()
    except TimeoutError:
        started = sorted(w for w, svc in host.services.items()
                         if svc.started.is_set() and not svc.stopping)
        raise AssertionError(f"not within {WAIT_S} s: {what}; started: {started}") from None


async def test_a_recreated_worker_does_not_hold_up_the_records_other_workers(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    s = Subjects(uniq)
    js = nc.jetstream()
    epochs = await epoch_kv(js, s)
    made: dict[str, list[Gated]] = {}

    def factory(wid: str, kind: WorkerKind) -> Gated:
        # The first instance of w-cp1-g0 runs a request that the test holds.
        backend = Gated(gated=wid == "w-cp1-g0" and wid not in made)
        made.setdefault(wid, []).append(backend)
        return backend

    await epochs.put(s.epoch_key(), record(1, "w-cp1-g0", "w-cp1-g1", "w-cp2-g2"))
    settings = RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, heartbeat_s=0.2,
                             drain_timeout_s=SLOW_STOP_S)
    host = RankdHost(settings, range(0, 4), factory)
    task = asyncio.create_task(host.run(nc, handle_signals=False))
    results: list[FirstToken] = []

    async def cb(msg: Msg) -> None:
        results.append(decode(FirstToken, msg.data, msg.headers))

    sub = await nc.subscribe(s.result_all(), cb=cb)
    made_first: Gated | None = None
    try:
        await serving(host, {"w-cp1-g0", "w-cp1-g1", "w-cp2-g2"}, "epoch 1's workers")
        old_g0: RankdService = host.services["w-cp1-g0"]
        made_first = made["w-cp1-g0"][0]
        await assign(nc, s, "r-1", "w-cp1-g0", 1)
        await asyncio.wait_for(made_first.running.wait(), timeout=WAIT_S)  # held

        # Merge g0+g1: the old w-cp1-g0 stops, but its running request holds its stop.
        await epochs.put(s.epoch_key(), record(2, "w-cp2-g0", "w-cp2-g2"))
        await serving(host, {"w-cp2-g0", "w-cp2-g2"}, "epoch 2's workers")
        assert old_g0.stopping and old_g0.core.running is not None

        # Split both back: w-cp1-g0 is re-created (its old instance still stops); the
        # others -- w-cp1-g1 (its old instance gone) and the halves of w-cp2-g2 -- start now.
        await epochs.put(s.epoch_key(),
                         record(3, "w-cp1-g0", "w-cp1-g1", "w-cp1-g2", "w-cp1-g3"))
        await serving(host, {"w-cp1-g1", "w-cp1-g2", "w-cp1-g3"},
                      "the record's other workers, while the old w-cp1-g0 still stops")
        assert old_g0.core.running is not None  # they did not wait for it
        assert len(made["w-cp1-g0"]) == 1  # nor was it re-created before its old one ended

        made_first.release.set()  # r-1 finishes; the old instance's stop ends
        await serving(host, {"w-cp1-g0", "w-cp1-g1", "w-cp1-g2", "w-cp1-g3"},
                      "the re-created w-cp1-g0 once its old instance ended")
        assert host.services["w-cp1-g0"] is not old_g0 and len(made["w-cp1-g0"]) == 2
        async with asyncio.timeout(WAIT_S):
            while not results:
                await asyncio.sleep(0.02)
        assert [(r.request_id, r.error) for r in results] == [("r-1", None)]
        ack = await assign(nc, s, "r-2", "w-cp1-g0", 3)  # the new instance serves
        assert ack.worker_id == "w-cp1-g0"
    finally:
        if made_first is not None:
            made_first.release.set()
        host.request_stop()
        await asyncio.wait({task}, timeout=WAIT_S)
        await sub.unsubscribe()
    assert task.done() and task.exception() is None
