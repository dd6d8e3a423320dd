"""A torch worker made by a live split or merge starts with its retained prefixes (§6.2).

The cache manager's reconciliation marks a new worker's retained whole prefixes *valid*
(``services/cachemgr/reconcile.py``); the rank host seeds the worker's BlockCache with the same
``reconciled_index`` (services/rankd/host.py). With the torch backend the engine must hold
those pages too, or rankd tells the scheduler a prefix the engine recomputes (a prefix
shortfall). ``TorchBackend.inherit_prefixes`` installs them from the predecessors' pages,
which stay resident in a retired engine cache after the switch.

A real nats-server and a RankdHost over GPUs 0-1 on one gloo world (degrees 1 and 2); the test
writes the epoch records and sends the assignments as the scheduler would (with the prefix a
cache match gives). Token ids are synthesised from the block hashes, so equal chains are equal
prompts, and every first token is checked against the model's single-process forward.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import torch
from engine_live_support import first_token, host_settings, record, until_workers
from nats.aio.client import Client

from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.model import Qwen3ForCausalLM
from services.rankd.torch_backend import (
    TINY_MODEL,
    TorchBackend,
    TorchSettings,
    request_token_ids,
    start_torch_host,
)
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
    FirstToken,
    IntakeRequest,
)
from shared.subjects import Subjects
from shared.worker import GpuGroup

WAIT_S = 120.0  # hang guard only
CFG = {**TINY_MODEL, "vocab_size": 256, "max_position_embeddings": 512}
SEED = 5
BLOCK = 16


def request(rid: str, chain: Sequence[int]) -> IntakeRequest:
    """A prompt of ``len(chain)`` full blocks and a 5-token tail (every listed block is full)."""
    return IntakeRequest(request_id=rid, input_len=BLOCK * len(chain) + 5,
                         block_hashes=list(chain), block_size=BLOCK, arrival_s=time.time())


async def test_torch_split_and_merge_keep_the_retained_prefixes(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    s = Subjects(uniq)
    settings = host_settings(nats_server.url, uniq, "w-cp2-g0")
    ts = TorchSettings(model_json=json.dumps(CFG), seed=SEED, block_size=BLOCK,
                       pages_per_rank=64, degrees="1,2", handoff="local",
                       decode_timeout_s=WAIT_S)
    model = Qwen3ForCausalLM.random(Qwen3Config.from_dict(CFG), seed=SEED)
    host, pool = await start_torch_host(settings, ts, nc=nc)
    task = asyncio.create_task(host.run(nc, handle_signals=False))

    def backend(wid: str) -> TorchBackend:
        b = host.services[wid].backend
        assert isinstance(b, TorchBackend)
        return b

    def rankd_blocks(wid: str) -> set[int]:
        cache = host.services[wid].core.cache
        assert cache is not None
        return set(cache.blocks())

    def engine_blocks(wid: str) -> set[int]:
        """The engine's own index on every member (asked of the ranks, not the mirror)."""
        answers = pool.world.engine_blocks(list(backend(wid).ranks))
        assert {w for w, _ in answers} == {wid}, answers
        assert len({b for _, b in answers}) == 1, f"members differ: {answers}"
        return set(answers[0][1])

    async def run(rid: str, wid: str, epoch: int, chain: Sequence[int], prefix_blocks: int
                  ) -> FirstToken:
        req = request(rid, chain)
        p = BLOCK * prefix_blocks
        now = time.time()
        a = Assignment(request=req, worker_id=wid, epoch=epoch,
                       degree=GpuGroup.from_worker_id(wid).degree, prefix_tokens=p,
                       recompute_tokens=req.input_len - p, predicted_s=0.01, assigned_at_s=now)
        ft = await first_token(nc, s, a, WAIT_S)
        ids = request_token_ids(req, CFG["vocab_size"])
        assert ft.error is None and ft.token == model.reference_forward(
            torch.tensor(ids)).next_token, (rid, ft)
        # The engine reused exactly the prefix the assignment named (no shortfall).
        assert backend(wid).outcomes[rid].prefix_len == p, backend(wid).outcomes[rid]
        return ft

    a_chain, b_chain = [101, 102, 103, 104], [201, 202]
    try:
        await until_workers(host, {"w-cp2-g0"}, WAIT_S)
        epochs = await nc.jetstream().key_value(s.epoch_bucket())  # made by the host
        await run("a", "w-cp2-g0", 0, a_chain, 0)
        await run("b", "w-cp2-g0", 0, b_chain, 0)
        await run("a2", "w-cp2-g0", 0, [*a_chain[:2], 105], 2)
        assert rankd_blocks("w-cp2-g0") == engine_blocks("w-cp2-g0") == {
            101, 102, 103, 104, 105, 201, 202}

        # Split: a page at depth d stays on the left child's GPU iff d mod 2 < 1; the left
        # child keeps the whole prefixes of those (the chains' first blocks), the right none.
        await epochs.put(s.epoch_key(), record(1, "w-cp1-g0", "w-cp1-g1"))
        await until_workers(host, {"w-cp1-g0", "w-cp1-g1"}, WAIT_S)
        assert rankd_blocks("w-cp1-g0") == engine_blocks("w-cp1-g0") == {101, 201}
        assert rankd_blocks("w-cp1-g1") == engine_blocks("w-cp1-g1") == set()
        await run("c", "w-cp1-g0", 1, [101, 102, 106], 1)  # the retained block is a hit
        await run("d", "w-cp1-g1", 1, [101, 107], 0)
        assert rankd_blocks("w-cp1-g0") == engine_blocks("w-cp1-g0") == {101, 102, 106, 201}
        assert rankd_blocks("w-cp1-g1") == engine_blocks("w-cp1-g1") == {101, 107}

        # Merge back to w-cp2-g0, whose pre-split engine cache these ranks revive: depth 0
        # comes from the left child (101, 201), depth 1 from the right (107 under 101); 102 is
        # on the wrong rank (left child, depth 1), so 106 under it is no whole prefix. The
        # revived cache's stale blocks (103, 104, 105, 202, and 102) are dropped.
        await epochs.put(s.epoch_key(), record(2, "w-cp2-g0"))
        await until_workers(host, {"w-cp2-g0"}, WAIT_S)
        assert rankd_blocks("w-cp2-g0") == engine_blocks("w-cp2-g0") == {101, 107, 201}
        # Every retained page was already on the rank that needs it: shared in place (101 and
        # 201 at the split, 107 at the merge; the revived cache kept 101 and 201), none moved.
        assert (pool.world.adopted_pages, pool.world.copied_pages) == (3, 0)
        assert [pool.world.geometry(r) for r in (0, 1)] == [(2, 2), (2, 2)]  # switched eagerly
        await run("e", "w-cp2-g0", 2, [101, 107, 108], 2)  # the copied page is reused
        await run("f", "w-cp2-g0", 2, [201, 202], 1)
        assert backend("w-cp2-g0").prefix_shortfall() == {}
        assert rankd_blocks("w-cp2-g0") == engine_blocks("w-cp2-g0") == {
            101, 107, 108, 201, 202}
    finally:
        host.request_stop()
        await asyncio.wait_for(task, timeout=WAIT_S)
        await pool.close()
