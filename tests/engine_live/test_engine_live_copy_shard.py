"""``TorchWorld.copy_prefix`` sends each destination member only the pages it keeps.

Page i of a cached prefix lives on CP rank i mod C (kvcache.py), so a copy into a worker of
degree C' need give each member only its 1/C' of the chain's pages (the chain metadata goes to
every member, so their indices stay identical). On one real gloo world of four ranks (float64,
degrees 1, 2, 4) the test re-shards CP2 -> CP4, CP4 -> CP2 and CP1 -> CP2 and checks for each:
the pages and KV bytes each destination rank was sent (the world's counters) and received
(each rank's own count, ``RankInfo``) are exactly its share; every member installed the whole
chain; the destination's prefill on that prefix reuses it and matches the model's
single-process forward (next token; the whole sequence's KV, within float64 round-off) -- so
the pages each member kept are the right ones.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.decode import kv_from_bytes
from services.rankd.engine.model import Qwen3ForCausalLM
from services.rankd.torch_world import TorchWorld, WorldSpec
from shared.blockhash import chain_hashes

CFG = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
           num_attention_heads=2, num_key_value_heads=1, head_dim=16,
           max_position_embeddings=256)
B = 4
SEED = 3
TOL = 1e-10  # float64, as tests/engine/test_engine_cp.py
# One page: (layers, 2, B, Hkv, D) float64.
PAGE_BYTES = CFG["num_hidden_layers"] * 2 * B * CFG["num_key_value_heads"] * CFG["head_dim"] * 8


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def model() -> Qwen3ForCausalLM:
    return Qwen3ForCausalLM.random(Qwen3Config.from_dict(CFG), seed=SEED, dtype=torch.float64)


@pytest.fixture(scope="module")
def world() -> Iterator[TorchWorld]:
    spec = WorldSpec(world_size=4, degrees=(1, 2, 4), initial_degrees=(2,), model_config=CFG,
                     seed=SEED, dtype="float64", block_size=B, pages_per_rank=32,
                     collective_timeout_s=120)
    with TorchWorld(spec, reply_timeout_s=240) as w:
        yield w


def copy_and_check(w: TorchWorld, model: Qwen3ForCausalLM, src: list[int], src_worker: str,
                   dst: list[int], doc: list[int]) -> list[int]:
    """Copy ``doc``'s cached chain from ``src_worker`` into the worker of ``dst``; check what
    each member was sent and that the worker's prefill of ``doc`` then reuses the copy and
    matches the reference. Returns the pages each member of ``dst`` was sent."""
    hashes = chain_hashes(doc, B)
    n, degree = len(hashes), len(dst)
    pages0, bytes0 = list(w.pages_sent), list(w.kv_bytes_sent)
    got0 = {i.rank: (i.received_pages, i.received_kv_bytes) for i in w.info()}
    stored, evicted = w.copy_prefix(src, src_worker, dst, hashes)
    assert (stored, evicted) == (hashes, [])
    sent = [w.pages_sent[r] - pages0[r] for r in dst]
    # What arrived on each rank (its own count) is what the leader says it sent.
    got = {i.rank: (i.received_pages - got0[i.rank][0], i.received_kv_bytes - got0[i.rank][1])
           for i in w.info()}
    assert [got[r] for r in dst] == [(s, s * PAGE_BYTES) for s in sent]
    assert all(got[r] == (0, 0) for r in got if r not in dst)
    # Member k of the worker (CP rank k) keeps pages k, k + C', ...: that and nothing else.
    assert sent == [len(range(k, n, degree)) for k in range(degree)]
    assert sum(sent) == n  # the whole chain once, not once per member
    assert [w.kv_bytes_sent[r] - bytes0[r] for r in dst] == [s * PAGE_BYTES for s in sent]
    untouched = [r for r in range(w.spec.world_size) if r not in dst]
    assert all(w.pages_sent[r] == pages0[r] for r in untouched)
    # Every member installed the whole chain (identical indices, as the engine requires).
    held = w.engine_blocks(dst)
    assert all(blocks == held[0][1] and set(hashes) <= blocks for _, blocks in held)
    assert w.cached_blocks(held[0][0]) == held[0][1]  # the leader's mirror follows

    replies = w.prefill(dst, doc, want_kv=True, chain=hashes)
    assert replies[0].prefix_len == n * B  # the copied prefix is reused, not recomputed
    ref = model.reference_forward(torch.tensor(doc))
    assert {r.token for r in replies} == {ref.next_token}
    assert replies[0].kv_blob is not None
    kv, _ = kv_from_bytes(replies[0].kv_blob)
    for (k, v), (rk, rv) in zip(kv, ref.new_kv, strict=True):
        assert k.shape == rk.shape and v.shape == rv.shape
        assert (k - rk).abs().max().item() <= TOL and (v - rv).abs().max().item() <= TOL
    return sent


def test_each_destination_member_is_sent_only_the_pages_it_keeps(
    world: TorchWorld, model: Qwen3ForCausalLM
) -> None:
    w = world
    # CP2 -> CP4: w-cp2-g0 caches 10 blocks, ranks 0-3 merge into w-cp4-g0 (w-cp2-g0 stays
    # resident, retired, on ranks 0-1) and copy from it.
    a = ids(10 * B + 3, 1)
    w.prefill([0, 1], a)
    w.switch([0, 1, 2, 3], 1, 4)
    assert copy_and_check(w, model, [0, 1], "w-cp2-g0", [0, 1, 2, 3], a) == [3, 3, 2, 2]

    # CP4 -> CP2: w-cp4-g0 caches 9 blocks, ranks 2-3 split off into w-cp2-g2 and copy from
    # it (active on ranks 0-1, retired on 2-3).
    b = ids(9 * B + 2, 2)
    w.prefill([0, 1, 2, 3], b)
    w.switch([2, 3], 2, 2)
    assert copy_and_check(w, model, [0, 1, 2, 3], "w-cp4-g0", [2, 3], b) == [5, 4]

    # CP1 -> CP2: rank 0 splits off into w-cp1-g0, caches 7 blocks; copy into w-cp2-g2.
    c = ids(7 * B + 1, 3)
    w.step([0], 3, c)
    assert copy_and_check(w, model, [0], "w-cp1-g0", [2, 3], c) == [4, 3]
    assert w.broken is None
