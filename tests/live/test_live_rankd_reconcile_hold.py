"""rankd's pull hold on a real server (sim backend) and the reconcile copies: a request J
placed counting on a copy waits past the hold's bound for a reconcile copy with a source that
brings its prefix, as for a replicate copy -- as the simulator's request does (sim/simulator.py
``SimConfig.pull_wait`` with ``pending_credit``: it waits for every copy in flight to its worker
with a part of its credited prefix, reconcile copies included). A command that brings no copy
of it (a reconcile without a source, or one of other blocks) is not waited for past the bound.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client
from service_support import service_running

from services.rankd.backend import SimBackend
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
    AssignmentAck,
    CacheCommandResult,
    FirstToken,
    IntakeRequest,
    ReconcileCommand,
    decode,
)
from shared.service import call
from shared.subjects import Subjects

WID = "w-cp2-g2"
SIBLING = "w-cp2-g0"
WAIT_S = 20.0  # hang guard only; nothing asserts on speed
PULL_COPY_S = 1e-6  # the hold's bound (slack 1, grace 0): passed as soon as it is admitted


class SlowCopies(SimBackend):
    """A sim backend whose cache commands take until the test releases them (as a real
    engine's ``prepare_cache_command`` moves the pages before the command is applied); every
    prefill's (R, P) is recorded."""

    def __init__(self) -> None:
        super().__init__(prefill_time=self._time, time_scale=1.0)
        self.copying = asyncio.Event()
        self.release = asyncio.Event()
        self.prefills: list[tuple[int, int]] = []

    def _time(self, r: int, p: int, degree: int, *, kind: str = "cp") -> float:
        self.prefills.append((r, p))
        return 0.01

    async def prepare_cache_command(self, cmd: object) -> object:
        self.copying.set()
        await self.release.wait()
        return cmd


def held(rid: str) -> Assignment:
    """A request of 2 full blocks ([1, 2], blocks of 512) priced with P = 512: J counted on a
    copy of block 1 to ``WID``, whose cache is empty."""
    now = time.time()
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=1024, block_hashes=[1, 2],
                              arrival_s=now - 0.01),
        worker_id=WID, epoch=0, degree=2, prefix_tokens=512, recompute_tokens=512,
        predicted_s=0.01, assigned_at_s=now, pull_copy_s=PULL_COPY_S,
    )


def service(url: str, prefix: str, backend: SimBackend) -> RankdService:
    return RankdService(RankdSettings(nats_url=url, subject_prefix=prefix, worker_id=WID,
                                      heartbeat_s=0.2, pull_hold_slack=1.0,
                                      pull_hold_grace_s=0.0), backend)


async def test_past_its_bound_a_request_waits_for_a_reconcile_copy_that_is_arriving(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """A reconcile command with a source (the worker's pending prefix after a split, copied
    on its first reuse) is executing when a request J priced with that prefix arrives: the
    request is held past the bound until the copy lands, then reuses it (P = 512). Before,
    only a replicate copy held it past the bound: it started at once and recomputed the
    block (P = 0) while the copy was still arriving."""
    s = Subjects(uniq)
    backend = SlowCopies()
    svc = service(nats_server.url, uniq, backend)
    async with service_running(svc, timeout_s=WAIT_S):
        try:
            sub = await nc.subscribe(s.result("rc-held"))
            rc = ReconcileCommand(command_id="rc-1", worker_id=WID, epoch=0, blocks=[1],
                                  source_worker=SIBLING)
            copy = asyncio.create_task(call(nc, s.cache_cmd(WID), rc, CacheCommandResult,
                                            timeout_s=WAIT_S))
            await asyncio.wait_for(backend.copying.wait(), timeout=WAIT_S)
            a = held("rc-held")
            await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S)
            # Past the bound (1 µs) from here on: only a copy arriving holds it.
            for _ in range(10):  # still queued (an ordering check, not a timing one)
                await asyncio.sleep(0.02)
                assert backend.prefills == [] and svc.core.running is None
            backend.release.set()
            done = await copy
            assert done.ok and done.blocks_done == 1
            ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
        finally:
            backend.release.set()
    assert ft.error is None and ft.prefix_tokens == 512
    assert backend.prefills == [(512, 512)]


@pytest.mark.parametrize("rc", [
    # No valid copy left anywhere: the pending part is dropped, nothing arrives.
    ReconcileCommand(command_id="rc-2", worker_id=WID, epoch=0, blocks=[1]),
    # A copy of another prefix: nothing of this request's arrives.
    ReconcileCommand(command_id="rc-3", worker_id=WID, epoch=0, blocks=[7],
                     source_worker=SIBLING),
], ids=["no-source", "other-blocks"])
async def test_a_reconcile_command_that_brings_no_copy_of_the_prefix_holds_only_to_the_bound(
    nats_server: EmbeddedNats, nc: Client, uniq: str, rc: ReconcileCommand
) -> None:
    """The hold stays bounded for a copy that does not come: a reconcile command without a
    source, or with blocks the request does not begin with, still executing past the bound
    does not hold the request, which starts and recomputes what its cache lacks."""
    s = Subjects(uniq)
    backend = SlowCopies()
    svc = service(nats_server.url, uniq, backend)
    async with service_running(svc, timeout_s=WAIT_S):
        try:
            sub = await nc.subscribe(s.result("rc-free"))
            copy = asyncio.create_task(call(nc, s.cache_cmd(WID), rc, CacheCommandResult,
                                            timeout_s=WAIT_S))
            await asyncio.wait_for(backend.copying.wait(), timeout=WAIT_S)
            await call(nc, s.worker_assign(WID), held("rc-free"), AssignmentAck,
                       timeout_s=WAIT_S)
            # Answered while the command is still held up: the hold did not wait for it.
            ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
            assert not copy.done()
            backend.release.set()
            assert (await copy).ok
        finally:
            backend.release.set()
    assert ft.error is None and ft.prefix_tokens == 0
    assert backend.prefills == [(1024, 0)]
