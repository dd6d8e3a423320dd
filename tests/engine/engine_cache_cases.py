"""Body run on every spawned gloo rank by test_engine_kvcache_world.py: a degree-2 worker
whose cache is too small for its requests (2 pages per rank), driven through RankEngine as
rankd drives it (prefill steps and protected imports, every call SPMD on both ranks).

Returns per-rank records; the parent test compares the ranks' records with each other (the
ranks must agree on every stored / evicted block and on the cached set) and the CP results
with the single-process oracle (reused prefixes must carry the right KV).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from engine_rank_cases import CFG, _ids, compare

from services.rankd.engine.groups import RankGroups
from services.rankd.engine.kvcache import RankKVCache
from services.rankd.engine.model import Qwen3ForCausalLM
from services.rankd.engine.rank import RankEngine, StepOutput
from shared.blockhash import chain_hashes

B = 4


def _step(out: StepOutput) -> dict[str, Any]:
    return {
        "P": out.prefix_len,
        "stored": [int(h) for h in out.stored],
        "evicted": [int(h) for h in out.evicted],
    }


def tight_cache_world(rank: int, world: int) -> dict[str, Any]:
    groups = RankGroups((2,), initial_degree=2)
    model = Qwen3ForCausalLM.random(CFG, seed=11, dtype=torch.float64)
    engine = RankEngine(model, groups, block_size=B, pages_per_rank=2)
    rec: dict[str, Any] = {"records": []}

    # 1. Five full blocks: rank 0 owns pages 0, 2, 4 but holds 2 pages -- the chain is cut
    #    after page 3 on both ranks (the ranks' page needs differ: 3 vs 2).
    doc = _ids(21, 70)
    first = engine.prefill(doc)
    rec["first"] = _step(first)
    hd = chain_hashes(doc, B)
    # 2. The next turn reuses the 4 stored blocks (P = 16) and must match the oracle.
    turn = doc + [first.next_token] + _ids(3, 71)
    second = engine.prefill(turn)
    rec["second"] = _step(second)
    rec["records"].append(compare("tight-turn2", model, second, turn, second.prefix_len, engine))

    # 3. A replicated prefix (2 blocks: page 0 on rank 0, page 1 on rank 1) while rankd
    #    protects doc's first 3 blocks: rank 0 (pages of blocks 0 and 2) cannot get room, so
    #    nothing can be stored -- and nothing may be evicted on rank 1 (doc's block 3).
    other = _ids(9, 72)
    src = RankKVCache(
        "src",
        1,
        0,
        B,
        8,
        CFG.num_hidden_layers,
        CFG.num_key_value_heads,
        CFG.head_dim,
        torch.float64,
    )
    look = src.lookup(other)
    src.store(look, model.reference_forward(torch.tensor(other)).new_kv)
    ho = chain_hashes(other, B)
    chain, pages = src.chain_of(ho), src.export_pages(ho)
    stored, evicted = engine.import_prefix(chain, pages, protect=hd[:3])
    rec["protected_import"] = {
        "stored": [int(h) for h in stored],
        "evicted": [int(h) for h in evicted],
    }
    rec["blocks_after_protected"] = sorted(int(h) for h in engine.cached_blocks())
    # doc's 4 blocks are all still there: the next turn reuses 16 tokens.
    again = engine.prefill(doc + _ids(2, 73))
    rec["again"] = _step(again)

    # 4. Unprotected, the import takes LRU room; the prefix is then reused by a prefill.
    stored, evicted = engine.import_prefix(chain, pages)
    rec["plain_import"] = {"stored": [int(h) for h in stored], "evicted": [int(h) for h in evicted]}
    q = other + _ids(3, 74)
    out = engine.prefill(q)
    rec["reuse"] = _step(out)
    rec["records"].append(compare("tight-imported", model, out, q, out.prefix_len, engine))
    rec["blocks"] = sorted(int(h) for h in engine.cached_blocks())
    rec["pool"] = len(engine.cache.pool)
    rec["hashes"] = {"doc": [int(h) for h in hd], "other": [int(h) for h in ho]}
    return rec


def shared_pool_world(rank: int, world: int) -> dict[str, Any]:
    """A degree-2 worker split into two degree-1 workers and merged back, on 4 pages per rank.

    Every cache of a rank (active, retired) lives in the rank's one page pool. After the split
    only rank 0's new worker needs more room than is free (a 13-block prompt: the pages its
    retired CP2 cache holds are reclaimed), rank 1's does not; the merge back must then start a
    new cache on *both* ranks -- reviving the retired one on rank 1 alone would leave the
    members' indices different -- and the merged worker must still compute correctly.
    """
    groups = RankGroups((1, 2), initial_degree=2)
    model = Qwen3ForCausalLM.random(CFG, seed=11, dtype=torch.float64)
    engine = RankEngine(model, groups, block_size=B, pages_per_rank=4)
    rec: dict[str, Any] = {"records": []}
    pool = engine.pool
    doc = _ids(25, 80)  # 6 full blocks: 3 pages on each rank, one slot free
    engine.prefill(doc)
    rec["before_split"] = {"pool": len(pool), "blocks": len(engine.cached_blocks())}

    engine.switch(1, 1)
    rec["retired_after_split"] = sorted(engine.retired)
    if rank == 0:  # 4 full blocks: the active cache needs every slot of the pool
        out = engine.prefill(_ids(17, 81))
        rec["records"].append(compare("split-r0", model, out, _ids(17, 81), out.prefix_len,
                                      engine))
    else:  # 1 full block: fits beside the retired pages
        engine.prefill(_ids(5, 82))
    rec["retired_before_merge"] = sorted(engine.retired)
    rec["caches_share_the_pool"] = engine.cache.pool is pool and all(
        c.pool is pool for c in engine.retired.values())

    engine.switch(2, 2)
    rec["merged_blocks"] = sorted(int(h) for h in engine.cached_blocks())
    every: list[Any] = [None] * world
    dist.all_gather_object(every, rec["merged_blocks"])
    # Fail here, not in a step's collective: members with different indices would hang it.
    assert all(b == every[0] for b in every), f"the merged worker's members differ: {every}"
    q = doc + _ids(6, 83)
    out = engine.prefill(q)
    rec["merged_P"] = out.prefix_len
    rec["records"].append(compare("merged", model, out, q, out.prefix_len, engine))
    again = engine.prefill(q + [out.next_token])
    rec["again_P"] = again.prefix_len
    rec["records"].append(compare("merged-again", model, again, q + [out.next_token],
                                  again.prefix_len, engine))
    rec["pool_capacity"] = pool.capacity
    return rec
