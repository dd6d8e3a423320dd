"""A replicate command that lands while a prefill's KV hand-off is still in progress never
evicts the blocks that request holds in the engine (its pinned prefix and the blocks its step
just stored, which rankd records when the request finishes).

Real torch world (2 gloo ranks: workers w-cp1-g0 and w-cp1-g1, 4 pages each), real rankd
host on a real nats-server; only the KV hand-off is held open by a gate, as a slow decode
role would hold it. On w-cp1-g0: request ``a0`` caches a1 a2; request ``a1`` reuses them
(rankd pins a1 a2) and stores b3; while its hand-off is held, a replicate of 4 blocks from
w-cp1-g1 arrives: the engine has 1 free page, so the copy would need 3 evictions and the only
candidates are a1 a2 b3. Before the fix the engine evicted all three (its index knew nothing
of rankd's pins), rankd kept the pinned a1 a2 (BlockCache.remove skips pinned blocks) and
recorded b3 at the finish: the next request reusing them was told P = 48 and the engine
reused 0 (a prefix shortfall). Now the copy installs what fits around them.
"""

from __future__ import annotations

import asyncio
import json

import torch
from engine_live_support import assignment, host_settings
from nats.aio.client import Client
from nats.errors import NoRespondersError

from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.model import Qwen3ForCausalLM
from services.rankd.torch_backend import (
    TINY_MODEL,
    HandoffResult,
    KVHandoff,
    TorchSettings,
    start_torch_host,
)
from shared.blockhash import chain_hashes
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    AssignmentAck,
    CacheCommandResult,
    FirstToken,
    ReplicateCommand,
    decode,
)
from shared.service import call
from shared.subjects import Subjects

WAIT_S = 120.0  # hang guard only
B = 16
CFG = {**TINY_MODEL, "vocab_size": 256, "max_position_embeddings": 512}
SEED = 7
DST, SRC = "w-cp1-g0", "w-cp1-g1"


def toks(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG["vocab_size"], (n,), generator=g).tolist()


class GatedHandoff:
    """The pool's hand-off, held open for the requests in ``hold`` until ``release`` is set
    (a slow decode role): rankd's pins of that request stay held meanwhile."""

    def __init__(self, inner: KVHandoff) -> None:
        self.inner = inner
        self.hold: set[str] = set()
        self.entered = asyncio.Event()
        self.release = asyncio.Event()

    async def transfer(self, request_id: str, blob: bytes) -> HandoffResult:
        if request_id in self.hold:
            self.entered.set()
            await self.release.wait()
        return await self.inner.transfer(request_id, blob)

    async def close(self) -> None:
        await self.inner.close()


async def test_a_replicate_during_a_handoff_never_evicts_the_blocks_the_request_holds(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    s = Subjects(uniq)
    settings = host_settings(nats_server.url, uniq, DST, SRC)
    ts = TorchSettings(
        model_json=json.dumps(CFG),
        seed=SEED,
        degrees="1,2",
        block_size=B,
        pages_per_rank=4,
        handoff="local",
    )
    host, pool = await start_torch_host(settings, ts, nc=nc)
    assert pool.handoff is not None
    gate = GatedHandoff(pool.handoff)
    pool.handoff = gate  # type: ignore[assignment]  # the workers' backends are built later
    task = asyncio.create_task(host.run(nc, handle_signals=False))
    model = Qwen3ForCausalLM.random(Qwen3Config.from_dict(CFG), seed=SEED)
    world = pool.world

    async def assign(rid: str, wid: str, tokens: list[int]) -> asyncio.Task[FirstToken]:
        sub = await nc.subscribe(s.result(rid))
        async with asyncio.timeout(WAIT_S):
            while True:  # the worker's endpoints subscribe just after it is listed
                try:
                    a = assignment(rid, wid, tokens, hashes=chain_hashes(tokens, B))
                    await call(nc, s.worker_assign(wid), a, AssignmentAck, timeout_s=WAIT_S)
                    break
                except NoRespondersError:
                    await asyncio.sleep(0.05)

        async def first_token() -> FirstToken:
            try:
                ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
            finally:
                await sub.unsubscribe()
            assert ft.error is None, (rid, ft.error)
            assert ft.token == model.reference_forward(torch.tensor(tokens)).next_token, rid
            return ft

        return asyncio.create_task(first_token())

    async def run(rid: str, wid: str, tokens: list[int]) -> FirstToken:
        return await (await assign(rid, wid, tokens))

    def pages(wid: str, hashes: list[int]) -> dict[int, torch.Tensor]:
        ranks = host.services[wid].backend.ranks  # type: ignore[attr-defined]
        # The rank's own export (copies of its pages), as a replicate would read them.
        [(chain, pgs)] = world._round(ranks, ("export", wid, hashes))
        return {pg.hash: pg.kv for pg in pgs}

    a = toks(1, 40)  # a1 a2 (+ 8 tokens)
    b = toks(2, 17)
    doc = toks(3, 65)  # s1..s4 (+ 1 token)
    held = chain_hashes(a[:32] + b, B)  # a1 a2 b3
    src_chain = chain_hashes(doc, B)
    try:
        async with asyncio.timeout(WAIT_S):
            while host.worker_ids != {DST, SRC}:
                host.changed.clear()
                await host.changed.wait()
        assert (await run("s0", SRC, doc)).prefix_tokens == 0  # the replica's source
        assert (await run("a0", DST, a)).prefix_tokens == 0
        gate.hold.add("a1")
        first = await assign("a1", DST, a[:32] + b)
        async with asyncio.timeout(WAIT_S):
            await gate.entered.wait()  # a1 prefilled; its hand-off holds rankd's pins
        svc = host.services[DST]
        cache = svc.core.cache
        assert cache is not None
        assert [cache.pins(h) for h in held] == [1, 1, 0]  # a1 a2 pinned; b3 not yet recorded
        before = pages(DST, held)
        assert set(before) == set(held)

        res = await call(
            nc,
            s.cache_cmd(DST),
            ReplicateCommand(
                command_id="c1", worker_id=DST, epoch=0, blocks=src_chain, source_worker=SRC
            ),
            CacheCommandResult,
            timeout_s=WAIT_S,
        )
        [(_, engine)] = world.engine_blocks(svc.backend.ranks)  # type: ignore[attr-defined]
        assert set(held) <= engine, "blocks held by the request in its hand-off were evicted"
        # Room for one page without touching what a1 holds: that much is installed.
        assert res.ok and res.blocks_done == 1
        after = pages(DST, held)
        assert all(torch.equal(before[h], after[h]) for h in held)
        assert src_chain[0] in engine and cache.blocks() == {*held[:2], src_chain[0]}

        gate.release.set()
        assert (await first).prefix_tokens == 32
        # rankd recorded b3 at the finish: it is in the engine too, so all 48 tokens are reused.
        assert (await run("a2", DST, a[:32] + b[:16] + [5] * 3)).prefix_tokens == 48
        assert svc.backend.prefix_shortfall() == {}  # type: ignore[attr-defined]
        [(_, engine)] = world.engine_blocks(svc.backend.ranks)  # type: ignore[attr-defined]
        assert engine == cache.blocks()
    finally:
        gate.release.set()
        host.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)
        await pool.close()
