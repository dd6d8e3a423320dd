"""The torch engine's per-rank prefix cache and rankd's BlockCache stay in lockstep.

A rank daemon (RankdService, real nats-server) on the torch backend with a 2-rank gloo world.
rankd's BlockCache decides the cached prefix P of every request and publishes cache events;
the engine must reuse exactly that P and hold exactly the blocks the events describe. Small
capacities force evictions on both sides: rankd's LRU (5 blocks per worker, applied to the
engine before its next step) and the engine's pages per rank (3, its evictions removed from
the BlockCache and published). Checked after every request: FirstToken.prefix_tokens = the
prefix the engine reused = the expected P; the engine's actual index (asked from the rank
processes) = the BlockCache = the set rebuilt from the published events; first tokens equal
the single-process model's greedy tokens (a partially reused last page included).
"""

from __future__ import annotations

import asyncio
import json
import time

import torch
from engine_live_support import assignment, first_token, host_settings, until_workers
from nats.aio.client import Client
from service_support import service_running

from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.model import Qwen3ForCausalLM
from services.rankd.service import RankdService, kv_capacity
from services.rankd.settings import RankdSettings
from services.rankd.torch_backend import (
    TINY_MODEL,
    TorchSettings,
    single_worker_backend,
    start_torch_host,
)
from shared.blockhash import chain_hashes
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    AssignmentAck,
    CacheCleared,
    CacheCommandResult,
    CacheEvent,
    CacheRemoved,
    CacheStored,
    DemoteCommand,
    EpochRecord,
    EpochWorker,
    FirstToken,
    ReclaimCommand,
    ReconcileCommand,
    ReplicateCommand,
    decode,
    to_json,
)
from shared.service import call
from shared.subjects import Subjects
from shared.worker import Lifecycle

WAIT_S = 120.0  # hang guard only
B = 16
# The project's tiny random Qwen3 (TINY_MODEL), with a smaller vocabulary and context.
CFG = {**TINY_MODEL, "vocab_size": 256, "max_position_embeddings": 512}
SEED = 5
WID = "w-cp2-g0"


def toks(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG["vocab_size"], (n,), generator=g).tolist()


async def test_engine_cache_follows_rankd_block_cache(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    s = Subjects(uniq)
    settings = RankdSettings(
        nats_url=nats_server.url,
        subject_prefix=uniq,
        worker_id=WID,
        kv_total_blocks=5,
        drain_timeout_s=10,
    )
    ts = TorchSettings(
        model_json=json.dumps(CFG),
        seed=SEED,
        degrees="1,2",
        block_size=B,
        pages_per_rank=3,
        handoff="local",
    )
    backend = await asyncio.to_thread(single_worker_backend, settings, ts)
    world = backend.world
    # The engine holds C × pages_per_rank blocks, which sizes rankd's cache unless the
    # setting is given (here it is, smaller: the lockstep must then follow rankd's LRU).
    assert backend.kv_capacity_blocks == 2 * 3
    assert kv_capacity(RankdSettings(worker_id=WID), backend) == 6
    assert kv_capacity(settings, backend) == 5
    svc = RankdService(settings, backend)
    model = Qwen3ForCausalLM.random(Qwen3Config.from_dict(CFG), seed=SEED)

    published: set[int] = set()
    events = await nc.subscribe(s.cache_events(WID))

    async def drain_events(until: frozenset[int]) -> None:
        """Apply the cache events received until they describe ``until`` (rankd's cache: its
        events for a request are published just after the result, so some may still be on
        their way), or WAIT_S passed; the caller's assertion then tells which."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + WAIT_S
        while published != until and loop.time() < deadline:
            try:
                msg = await events.next_msg(timeout=0.3)
            except Exception:  # nats TimeoutError: nothing yet; look again
                continue
            ev = decode(CacheEvent, msg.data)
            if isinstance(ev, CacheStored):
                published.update(ev.block_hashes)
            elif isinstance(ev, CacheRemoved):
                published.difference_update(ev.block_hashes)
            elif isinstance(ev, CacheCleared):
                published.clear()

    async def run(rid: str, tokens: list[int]) -> FirstToken:
        sub = await nc.subscribe(s.result(rid))
        try:
            await call(
                nc, s.worker_assign(WID),
                assignment(rid, WID, tokens, hashes=chain_hashes(tokens, B)),
                AssignmentAck, timeout_s=WAIT_S
            )
            return decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
        finally:
            await sub.unsubscribe()

    a = toks(1, 40)  # blocks a1 a2 (+ 8 tokens)
    b = toks(2, 17)
    c = toks(3, 64)  # blocks c1..c4
    steps = [
        ("r0", a, 0),
        ("r1", a[:32] + b, 32),  # a1 a2 reused, b3 stored
        ("r2", a[:32] + b[:16], 47),  # every block cached, n = 3B: the last page partially
        ("r3", c, 0),  # the engine evicts b3 (rank 0 full), rankd evicts a2 (5 blocks)
        # a2 is gone on both sides: only a1 reused; a2 stored again, rankd evicts c4 (LRU)
        ("r4", a[:32] + [7] * 5, 16),
    ]
    try:
        async with service_running(svc, nc, timeout_s=WAIT_S):
            for rid, tokens, want_p in steps:
                ft = await run(rid, tokens)
                assert ft.error is None, (rid, ft.error)
                out = backend.outcomes[rid]
                assert ft.token == model.reference_forward(torch.tensor(tokens)).next_token, rid
                assert ft.prefix_tokens == out.prefix_len == want_p, (rid, ft.prefix_tokens, out)
                await drain_events(svc.core.cache.blocks())
                await backend.sync_cache()  # what the next step does first
                actual = world.engine_blocks(backend.ranks)
                assert [w for w, _ in actual] == [WID, WID]
                assert actual[0][1] == actual[1][1] == svc.core.cache.blocks() == published, rid
            assert backend.prefix_shortfall() == {}
            assert published == {*chain_hashes(a, B), *chain_hashes(c, B)[:3]}
    finally:
        await events.unsubscribe()
    assert not any(world.alive())


async def test_replicate_and_reconcile_move_real_kv(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    """Cache-manager commands on the torch backend move KV between the workers of one world
    before rankd records the blocks: a replicate w-cp1-g0 → w-cp1-g1 makes a request on g1
    reuse the copied prefix (and get the single-process token); a replicate from a worker
    outside the world records nothing; a merge into w-cp2-g0 retains in place the prefixes
    whose pages are already on the right rank, and a reconcile from the retired w-cp1-g0
    re-shards a page that is not. Engine and BlockCache agree after each.
    """
    s = Subjects(uniq)
    settings = host_settings(nats_server.url, uniq, "w-cp1-g0", "w-cp1-g1")
    ts = TorchSettings(
        model_json=json.dumps(CFG), seed=SEED, degrees="1,2", block_size=B, handoff="local"
    )
    host, pool = await start_torch_host(settings, ts, nc=nc)
    task = asyncio.create_task(host.run(nc, handle_signals=False))
    model = Qwen3ForCausalLM.random(Qwen3Config.from_dict(CFG), seed=SEED)

    async def run(rid: str, wid: str, epoch: int, tokens: list[int]) -> FirstToken:
        ft = await first_token(nc, s, assignment(rid, wid, tokens, epoch=epoch,
                                                  hashes=chain_hashes(tokens, B)),
                               WAIT_S)
        assert ft.error is None, (rid, ft.error)
        assert ft.token == model.reference_forward(torch.tensor(tokens)).next_token, rid
        return ft

    async def command(wid: str, cmd: object) -> CacheCommandResult:
        return await call(nc, s.cache_cmd(wid), cmd, CacheCommandResult, timeout_s=WAIT_S)

    def agree(wid: str) -> frozenset[int]:
        svc = host.services[wid]
        backend = svc.backend
        actual = pool.world.engine_blocks(backend.ranks)
        assert {w for w, _ in actual} == {wid}
        assert all(b == svc.core.cache.blocks() for _, b in actual), wid
        return svc.core.cache.blocks()

    doc = toks(11, 48)  # 3 blocks
    chain = chain_hashes(doc, B)
    try:
        await until_workers(host, {"w-cp1-g0", "w-cp1-g1"}, WAIT_S)
        assert (await run("p0", "w-cp1-g0", 0, doc + [1, 2])).prefix_tokens == 0
        res = await command(
            "w-cp1-g1",
            ReplicateCommand(
                command_id="c1",
                worker_id="w-cp1-g1",
                epoch=0,
                blocks=chain,
                source_worker="w-cp1-g0",
            ),
        )
        assert res.ok and res.blocks_done == 3
        assert agree("w-cp1-g1") == frozenset(chain)
        assert (await run("p1", "w-cp1-g1", 0, doc + [9] * 7)).prefix_tokens == 48

        far = await command(
            "w-cp1-g0",
            ReplicateCommand(
                command_id="c2",
                worker_id="w-cp1-g0",
                epoch=0,
                blocks=chain_hashes(toks(12, 32), B),
                source_worker="w-cp1-g5",
            ),
        )  # not in this world: no KV reachable, nothing recorded
        assert far.ok and far.blocks_done == 0
        assert agree("w-cp1-g0") == frozenset(chain)

        rec = EpochRecord(
            epoch=1,
            committed_at_s=time.time(),
            workers=[
                EpochWorker(worker_id="w-cp2-g0", first_gpu=0, degree=2, lifecycle=Lifecycle.ACTIVE)
            ],
        )
        doc2 = toks(14, 48)  # 3 blocks on w-cp1-g0 only
        chain2 = chain_hashes(doc2, B)
        assert (await run("p2", "w-cp1-g0", 0, doc2 + [4])).prefix_tokens == 0
        epochs = await nc.jetstream().key_value(s.epoch_bucket())
        await epochs.put(s.epoch_key(), to_json(rec))
        await until_workers(host, {"w-cp2-g0"}, WAIT_S)
        # Retained in place at the merge: doc's pages (its block 1 on w-cp1-g1's rank, where
        # the merged worker keeps page 1) and doc2's block 0; doc2's block 1 is on rank 0.
        assert agree("w-cp2-g0") == frozenset(chain) | {chain2[0]}
        copied = pool.world.copied_pages
        other = toks(13, 20)
        await run("m0", "w-cp2-g0", 1, other)
        res = await command(
            "w-cp2-g0",
            ReconcileCommand(
                command_id="c3",
                worker_id="w-cp2-g0",
                epoch=1,
                blocks=chain2[:2],
                source_worker="w-cp1-g0",
            ),
        )  # the retired degree-1 cache, re-sharded to degree 2: its page 1 moves to rank 1
        assert res.ok and res.blocks_done == 2
        assert pool.world.copied_pages == copied + 1
        assert set(chain2[:2]) <= agree("w-cp2-g0")
        assert (await run("m1", "w-cp2-g0", 1, doc2[:32] + [5] * 9)).prefix_tokens == 32
        assert (await run("m2", "w-cp2-g0", 1, doc + [6] * 3)).prefix_tokens == 48

        # Reclaimed from the merged worker, then reconciled again: the page (doc's block 2,
        # page 2: rank 0) is still in rank 0's pool, held by the retired w-cp1-g0: shared in
        # place, nothing sent.
        res = await command("w-cp2-g0", ReclaimCommand(command_id="c4", worker_id="w-cp2-g0",
                                                       epoch=1, blocks=[chain[2]]))
        assert res.ok
        # The engine drops it at its next step, or now (the backend's sync_cache).
        assert await host.services["w-cp2-g0"].backend.sync_cache() == 1
        assert chain[2] not in agree("w-cp2-g0")
        copied, adopted = pool.world.copied_pages, pool.world.adopted_pages
        res = await command("w-cp2-g0", ReconcileCommand(
            command_id="c5", worker_id="w-cp2-g0", epoch=1, blocks=chain,
            source_worker="w-cp1-g0"))
        assert res.ok and res.blocks_done == 3 and chain[2] in agree("w-cp2-g0")
        assert (pool.world.copied_pages, pool.world.adopted_pages) == (copied, adopted + 1)
        assert (await run("m3", "w-cp2-g0", 1, doc + [7] * 3)).prefix_tokens == 48
        agree("w-cp2-g0")

        # A demote (a pull's source) passes the engine unchanged: only rankd's LRU order
        # moves; nothing is dropped from either side.
        res = await command("w-cp2-g0", DemoteCommand(command_id="c6", worker_id="w-cp2-g0",
                                                      epoch=1, blocks=chain))
        assert res.ok and res.blocks_done == 3
        assert await host.services["w-cp2-g0"].backend.sync_cache() == 0
        assert set(chain) <= agree("w-cp2-g0")
    finally:
        host.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)
        await pool.close()
