"""After a split or merge, the cache manager's trie and the new workers' own caches agree.

§6.2 / design.md "Prefix pages under CP": retained prefix pages stay resident, so the cache
manager's reconciliation (services/cachemgr/reconcile.py) registers each new worker with the
whole prefixes it physically holds on the right ranks as *valid*. The rank daemon of that worker
must index exactly those blocks (services/rankd/host.py seeds its BlockCache with the same
``reconciled_index``), or the trie claims prefixes the worker recomputes (phantom hits that stay
until the blocks are stored again or a gap forces a snapshot). The simulator does the same with
``BlockCache.adopt(trie.held_nodes(...))``.

A real nats-server, one in-process rank host with the ``sim`` backend (GPUs 0-3) and the cache
manager; the test writes the epoch records. Every wait is a bounded poll of a condition.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager

from live_ctl_support import eventually
from nats.aio.client import Client
from nats.errors import NoRespondersError

from services.cachemgr.service import CacheMgrService, CacheMgrSettings
from services.rankd.backend import SimBackend
from services.rankd.host import RankdHost
from services.rankd.settings import RankdSettings
from shared.ids import WorkerFault, WorkerId
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
    AssignmentAck,
    EpochRecord,
    EpochWorker,
    IntakeRequest,
    to_json,
)
from shared.service import MicroService, call, epoch_kv
from shared.subjects import Subjects
from shared.worker import GpuGroup, Lifecycle

CAPACITY = 64  # blocks; the same on both sides, so capacity never makes them differ
WAIT_S = 30.0
BLOCK = 512


def record(epoch: int, *wids: str) -> bytes:
    workers = [
        EpochWorker(worker_id=w, first_gpu=GpuGroup.from_worker_id(w).first_gpu,
                    degree=GpuGroup.from_worker_id(w).degree, lifecycle=Lifecycle.ACTIVE)
        for w in wids
    ]
    return to_json(EpochRecord(epoch=epoch, workers=workers, committed_at_s=time.time()))


def assignment(rid: str, wid: str, epoch: int, hashes: Sequence[int]) -> Assignment:
    now = time.time()
    n = BLOCK * len(hashes) + 10  # every listed block is full
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=n, block_hashes=list(hashes),
                              arrival_s=now),
        worker_id=wid,
        epoch=epoch,
        degree=GpuGroup.from_worker_id(wid).degree,
        prefix_tokens=0,
        recompute_tokens=n,
        predicted_s=0.001,
        assigned_at_s=now,
    )


class Pool:
    """The rank host and the cache manager of one test, with the probes the checks need."""

    def __init__(self, nc: Client, subjects: Subjects, host: RankdHost,
                 cachemgr: CacheMgrService) -> None:
        self.nc = nc
        self.subjects = subjects
        self.host = host
        self.cachemgr = cachemgr
        self.epoch = 0

    def worker_blocks(self, wid: str) -> frozenset[int]:
        """The blocks the worker's own cache index holds (what it reuses and reports)."""
        svc = self.host.services[wid]
        assert svc.core.cache is not None
        return frozenset(svc.core.cache.blocks())

    def trie_blocks(self, wid: str) -> frozenset[int]:
        """The blocks the cache manager's trie says the worker holds (valid, whole prefixes)."""
        return frozenset(self.cachemgr.trie.held_nodes(WorkerId(wid)))

    async def serve(self, rid: str, wid: str, hashes: Sequence[int]) -> None:
        """Run one request on ``wid`` and wait until it finished there."""
        svc = self.host.services[wid]
        served = svc.core.served

        async def placed() -> bool:
            try:
                await call(self.nc, self.subjects.worker_assign(wid),
                           assignment(rid, wid, self.epoch, hashes), AssignmentAck,
                           timeout_s=WAIT_S)
            except NoRespondersError:  # the worker's endpoint is not subscribed yet
                return False
            return True

        await eventually(placed, what=f"{wid} accepts {rid}", timeout=WAIT_S)

        async def done() -> bool:
            return svc.core.served > served and svc.core.running is None

        await eventually(done, what=f"{wid} served {rid}", timeout=WAIT_S)

    async def in_step(self, wid: str, blocks: set[int]) -> None:
        """Wait until ``wid``'s cache holds ``blocks`` and the trie has seen all of it."""
        async def agreed() -> bool:
            return (blocks <= self.worker_blocks(wid)
                    and self.trie_blocks(wid) == self.worker_blocks(wid))

        await eventually(agreed, what=f"the trie has {wid}'s blocks", timeout=WAIT_S)

    async def reconfigure(self, *wids: str) -> None:
        """Write the next epoch record (the new composition) and wait until the rank host
        runs exactly ``wids`` and the cache manager has reconciled the record. No request
        runs meanwhile, so after this neither side changes any more."""
        self.epoch += 1
        kv = await epoch_kv(self.nc.jetstream(), self.subjects)
        await kv.put(self.subjects.epoch_key(), record(self.epoch, *wids))

        async def applied() -> bool:
            rec = self.cachemgr.record
            return (rec is not None and rec.epoch == self.epoch
                    and self.host.worker_ids == set(wids)
                    and set(self.host.services) == set(wids)
                    and all(self.host.services[w].started.is_set() for w in wids))

        await eventually(applied, what=f"epoch {self.epoch} applied", timeout=WAIT_S)

    def disagreements(self, *wids: str) -> dict[str, dict[str, list[int]]]:
        """Per worker: blocks only the trie lists, blocks only the worker's cache holds."""
        out = {}
        for w in wids:
            trie, own = self.trie_blocks(w), self.worker_blocks(w)
            if trie != own:
                out[w] = {"trie_only": sorted(trie - own), "worker_only": sorted(own - trie)}
        return out


def _sim_backend(wid: str, kind: object) -> SimBackend:
    return SimBackend(prefill_time=lambda r, p, c, kind="cp": 0.001)


@asynccontextmanager
async def pool(nats_server: EmbeddedNats, nc: Client, uniq: str,
               services: Callable[[MicroService], Awaitable[MicroService]],
               initial: Sequence[str],
               backend: Callable[[str, object], SimBackend] = _sim_backend,
               ) -> AsyncIterator[Pool]:
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    await kv.put(s.epoch_key(), record(0, *initial))
    cachemgr = await services(CacheMgrService(CacheMgrSettings(
        nats_url=nats_server.url, subject_prefix=uniq, degrees=[2, 4],
        scan_interval_s=3600.0,  # no scan: only events and reconciliation change the trie
        default_capacity_blocks=CAPACITY,
    )))
    assert isinstance(cachemgr, CacheMgrService)
    settings = RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, heartbeat_s=0.2,
                             drain_timeout_s=5, kv_total_blocks=CAPACITY)
    host = RankdHost(settings, range(0, 4), backend)  # type: ignore[arg-type]
    task = asyncio.create_task(host.run(handle_signals=False))
    p = Pool(nc, s, host, cachemgr)
    try:
        async def up() -> bool:
            rec = cachemgr.record
            # ... and the cache manager holds no snapshot request of the first workers open
            # (asked before they were up): a late answer would settle what a test checks.
            return (rec is not None and host.worker_ids == set(initial)
                    and all(host.services[w].started.is_set() for w in initial)
                    and not cachemgr._snapshot_retry and not cachemgr._snapshotting)

        await eventually(up, what="the pool is up", timeout=WAIT_S)
        yield p
    finally:
        host.request_stop()
        async with asyncio.timeout(WAIT_S):
            await task


# Chains of block hashes (root first). Lengths 1..5 cover every page position of a CP4 worker.
A = [101, 102, 103, 104, 105]
B = [201, 202, 203]
C = [301, 302]
D = [401]


async def test_split_children_start_with_what_the_trie_says(
    nats_server: EmbeddedNats, nc: Client, uniq: str, services
) -> None:
    async with pool(nats_server, nc, uniq, services, ["w-cp4-g0"]) as p:
        for i, chain in enumerate((A, B, C, D)):
            await p.serve(f"s-{i}", "w-cp4-g0", chain)
        await p.in_step("w-cp4-g0", set(A + B + C + D))

        await p.reconfigure("w-cp2-g0", "w-cp2-g2")

        # Page p of a CP4 prefix sits on GPU p mod 4: the left child (GPUs 0-1) holds pages
        # 0 and 1 of every prefix on its own ranks; the right child no whole prefix.
        left = p.trie_blocks("w-cp2-g0")
        assert left == {101, 102, 201, 202, 301, 302, 401}, sorted(left)
        assert not p.disagreements("w-cp2-g0", "w-cp2-g2"), p.disagreements(
            "w-cp2-g0", "w-cp2-g2")

        # And the worker reuses what the trie promised: a request on A reuses its 2 pages.
        svc = p.host.services["w-cp2-g0"]
        hits = svc.core.hit_tokens
        await p.serve("s-reuse", "w-cp2-g0", A[:3])
        assert svc.core.hit_tokens - hits == 2 * BLOCK


async def test_merged_worker_starts_with_what_the_trie_says(
    nats_server: EmbeddedNats, nc: Client, uniq: str, services
) -> None:
    async with pool(nats_server, nc, uniq, services, ["w-cp2-g0", "w-cp2-g2"]) as p:
        # A on both halves: together they hold every page of it on its CP4 rank.
        for i, (wid, chain) in enumerate((("w-cp2-g0", A), ("w-cp2-g2", A),
                                          ("w-cp2-g0", B), ("w-cp2-g2", C))):
            await p.serve(f"m-{i}", wid, chain)
        await p.in_step("w-cp2-g0", set(A + B))
        await p.in_step("w-cp2-g2", set(A + C))

        await p.reconfigure("w-cp4-g0")

        merged = p.trie_blocks("w-cp4-g0")
        # A: pages 0, 1, 4 from the left half, 2, 3 from the right; B: pages 0, 1 (page 2
        # belongs on GPU 2, the left half held it on GPU 0); C: nothing (its root page was on
        # the right half, GPU 2, and belongs on GPU 0).
        assert merged == {101, 102, 103, 104, 105, 201, 202}, sorted(merged)
        assert not p.disagreements("w-cp4-g0"), p.disagreements("w-cp4-g0")


async def test_split_then_merge_back_agrees_once_the_merged_worker_answers(
    nats_server: EmbeddedNats, nc: Client, uniq: str, services
) -> None:
    """The one case the shared rule cannot settle: after a split, the child not given a
    retained prefix keeps its pages of it as *donors* (resident outside its index, known to
    the trie only), and at a merge back the trie counts them while the rank daemons, who never
    knew them, do not seed them. The cache manager asks every worker a split or merge made for
    its snapshot, which brings the trie to the worker's own index."""
    async with pool(nats_server, nc, uniq, services, ["w-cp4-g0"]) as p:
        await p.serve("b-0", "w-cp4-g0", A)
        await p.in_step("w-cp4-g0", set(A))
        await p.reconfigure("w-cp2-g0", "w-cp2-g2")
        assert not p.disagreements("w-cp2-g0", "w-cp2-g2")
        await p.reconfigure("w-cp4-g0")

        async def agreed() -> bool:
            return not p.disagreements("w-cp4-g0")

        await eventually(agreed, what="the trie agrees with the merged worker's cache",
                         timeout=WAIT_S)
        assert p.worker_blocks("w-cp4-g0") <= set(A)


class Holding(SimBackend):
    """A sim backend that, like the torch one, must hold a new worker's retained pages
    before rankd seeds them (``inherit_prefixes``): it holds the first ``keep`` of them, or
    meets ``fault`` (e.g. the torch world broke while copying)."""

    def __init__(self, keep: int, fault: WorkerFault | None = None) -> None:
        super().__init__(prefill_time=lambda r, p, c, kind="cp": 0.001)
        self.keep, self.fault = keep, fault
        self.calls: list[tuple[list[tuple[int, int | None]], int]] = []

    async def inherit_prefixes(self, pairs: Sequence[tuple[int, int | None]], epoch: int
                               ) -> list[tuple[int, int | None]]:
        self.calls.append((list(pairs), epoch))
        if self.fault is not None:
            raise self.fault
        return list(pairs[: self.keep])


async def test_a_backend_holding_real_kv_seeds_only_what_it_holds(
    nats_server: EmbeddedNats, nc: Client, uniq: str, services
) -> None:
    """The rank host seeds a new worker with what ``inherit_prefixes`` says its backend now
    holds, not the whole reconciled index; a backend fault while copying leaves the worker
    empty and running. Either way the trie comes to agree (the snapshot it asks for)."""
    backends: dict[str, Holding] = {}

    def backend(wid: str, kind: object) -> Holding:
        # The CP4 worker made by the merge meets the fault (the first one is never seeded).
        backends[wid] = Holding(keep=3, fault=WorkerFault("a rank died") if wid == "w-cp4-g0"
                                else None)
        return backends[wid]

    async with pool(nats_server, nc, uniq, services, ["w-cp4-g0"], backend) as p:
        for i, chain in enumerate((A, B, C, D)):
            await p.serve(f"h-{i}", "w-cp4-g0", chain)
        await p.in_step("w-cp4-g0", set(A + B + C + D))
        await p.reconfigure("w-cp2-g0", "w-cp2-g2")

        (pairs, epoch), = backends["w-cp2-g0"].calls
        assert {h for h, _ in pairs} == {101, 102, 201, 202, 301, 302, 401} and epoch == 1
        assert p.worker_blocks("w-cp2-g0") == {h for h, _ in pairs[:3]}
        assert backends["w-cp2-g2"].calls == [([], 1)]  # no whole prefix

        async def agreed() -> bool:
            return not p.disagreements("w-cp2-g0", "w-cp2-g2")

        await eventually(agreed, what="the trie agrees with what the workers hold",
                         timeout=WAIT_S)

        # A merge whose copy meets a fault: the merged worker starts empty, and runs.
        backends.clear()
        await p.serve("h-left", "w-cp2-g0", A[:2])
        await p.reconfigure("w-cp4-g0")
        (pairs, epoch), = backends["w-cp4-g0"].calls
        assert pairs and epoch == 2
        assert p.worker_blocks("w-cp4-g0") == frozenset()

        async def merged_agreed() -> bool:
            return not p.disagreements("w-cp4-g0")

        await eventually(merged_agreed, what="the trie agrees with the merged worker",
                         timeout=WAIT_S)
        await p.serve("h-after", "w-cp4-g0", A)
        assert p.worker_blocks("w-cp4-g0") == set(A)
