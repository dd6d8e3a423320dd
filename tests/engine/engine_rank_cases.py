"""Bodies run on every spawned gloo rank by test_engine_cp.py (see engine_dist.run_world).

Each body checks the CP engine against the single-process oracle (``reference_forward`` over
the whole sequence, plain softmax attention) on its own rank and returns records; the parent
test asserts on them so failures name the case.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from services.rankd.engine.checkpoint import load_model
from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.cp_prefill import cp_prefill, shard_prefix, stack_kv
from services.rankd.engine.decode import ChunkedBytesTransport, decode_step
from services.rankd.engine.errors import (
    CheckpointError,
    GroupError,
    SequenceTooLong,
    TokenOutOfVocab,
)
from services.rankd.engine.groups import RankGroups
from services.rankd.engine.model import Qwen3ForCausalLM
from services.rankd.engine.rank import RankEngine
from shared.blockhash import chain_hashes

CFG = Qwen3Config(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=96,
)
MOE = dataclasses.replace(CFG, num_experts=4, num_experts_per_tok=2, mlp_only_layers=(0,))
B = 4  # cache block / page size in tokens

Record = dict[str, Any]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(
        0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


def compare(
    case: str,
    model: Qwen3ForCausalLM,
    out: Any,
    full_ids: list[int],
    p: int,
    engine: RankEngine | None = None,
) -> Record:
    """Record the CP result's errors against the oracle over all ``full_ids``."""
    ref = model.reference_forward(torch.tensor(full_ids))
    res = getattr(out, "result", out)
    rec: Record = {
        "case": case,
        "dtype": str(model.dtype),
        "P": p,
        "R": len(full_ids) - p,
        "hidden": _rel(res.hidden, ref.hidden[p:]),
        "logits": _rel(res.logits, ref.logits),
        "kv": max(
            max(_rel(k, rk[p:]), _rel(v, rv[p:]))
            for (k, v), (rk, rv) in zip(res.new_kv, ref.new_kv, strict=True)
        ),
        "token_ok": res.next_token == ref.next_token,
    }
    # What the decode role gets (prefix + new tokens, natural order): the oracle's whole KV.
    full = res.full_kv()
    rec["full_kv"] = max(
        max(_rel(k, rk), _rel(v, rv)) for (k, v), (rk, rv) in zip(full, ref.new_kv, strict=True)
    )
    rec["full_kv_ok"] = all(k.shape[0] == len(full_ids) and k.dtype == model.dtype
                            for k, _ in full)
    if engine is not None:
        # The pages this rank holds equal the oracle's KV rows of their block (post-RoPE).
        full = stack_kv(ref.new_kv)
        pages = engine.cache.export_pages(chain_hashes(full_ids, B))
        rec["cached"] = max(
            [_rel(pg.kv, full[:, :, pg.page * B : (pg.page + 1) * B]) for pg in pages], default=0.0
        )
        rec["pages_here_ok"] = all(
            pg.page % engine.group.degree == engine.group.rank for pg in pages
        )
    return rec


def explicit_prefix_cases(model: Qwen3ForCausalLM, groups: RankGroups, tag: str) -> list[Record]:
    """cp_prefill with an explicit page-sharded prefix: P = 0, unaligned P, R < 2C, R = 1."""
    grp = groups.active
    c = grp.degree
    recs = []
    for p, r in ((0, 11), (7, 13), (5, 2 * c - 1), (9, 1)):
        ids = _ids(p + r, seed=100 + p + r)
        ref = model.reference_forward(torch.tensor(ids[:p])) if p else None
        local = shard_prefix(stack_kv(ref.new_kv), B, c, grp.rank) if ref else None
        out = cp_prefill(model, grp, torch.tensor(ids[p:]), local, p, B)
        recs.append(compare(f"{tag}-C{c}-P{p}-R{r}", model, out, ids, p))
    return recs


def multi_turn_cases(engine: RankEngine, tag: str, seed: int) -> list[Record]:
    """Three turns; turns 2-3 reuse KV that the CP ranks wrote in earlier turns."""
    m = engine.model
    seq = _ids(14, seed)
    recs = []
    for turn in range(3):
        out = engine.prefill(seq)
        recs.append(
            compare(f"{tag}-C{engine.group.degree}-turn{turn}", m, out, seq, out.prefix_len, engine)
        )
        recs[-1]["hit"] = out.prefix_len
        seq = seq + [out.next_token] + _ids(5 + turn, seed + turn + 1)
    return recs


def bad_input_then_good(engine: RankEngine) -> Record:
    errs = []
    for bad, exc in (
        ([1, 2, CFG.vocab_size], TokenOutOfVocab),
        ([-3, 1], TokenOutOfVocab),
        ([1] * (CFG.max_position_embeddings + 1), SequenceTooLong),
    ):
        try:
            engine.prefill(bad)
            errs.append(f"{bad[:3]} accepted")
        except exc:
            pass
    ids = _ids(9, 7)
    out = engine.prefill(ids)
    rec = compare(
        f"after-bad-input-C{engine.group.degree}", engine.model, out, ids, out.prefix_len, engine
    )
    rec["bad_input_errors"] = errs
    return rec


def world2(rank: int, world: int) -> dict[str, Any]:
    """C in {1, 2} over 2 ranks; split 2 -> 1+1 and merge back in place; replication between
    two degree-1 workers; decode hand-off; bad input. float64 and float32."""
    pid = os.getpid()
    groups = RankGroups((1, 2), initial_degree=2)
    # A malformed model directory is a typed error; the rank goes on serving below.
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(CFG.to_dict()))
        try:
            load_model(d)
            guard = ["checkpoint without tensors accepted"]
        except CheckpointError:
            guard = []
    recs: list[Record] = []
    switches = []
    for dt in (torch.float64, torch.float32):
        model = Qwen3ForCausalLM.random(CFG, seed=11, dtype=dt)
        recs += explicit_prefix_cases(model, groups, f"{dt}")
    model = Qwen3ForCausalLM.random(CFG, seed=11, dtype=torch.float64)
    engine = RankEngine(model, groups, block_size=B, pages_per_rank=32)
    recs += multi_turn_cases(engine, "cp2", seed=20)
    recs.append(bad_input_then_good(engine))

    # Decode hand-off: rank 0 serialises prefix + new KV in <=512 KiB chunks; decode equals
    # single-process greedy decoding of the same sequence.
    ids = _ids(17, 33)
    out = engine.prefill(ids)
    decode_ok = None
    if rank == 0:
        transport = ChunkedBytesTransport(max_chunk=4096)
        transport.send("req-1", out.result.full_kv(), {"token": out.next_token})
        kv, meta = transport.recv("req-1", timeout=5)
        d1 = decode_step(model, kv, meta["token"])
        d2 = decode_step(model, d1.kv, d1.next_token)
        decode_ok = (
            [out.next_token, d1.next_token, d2.next_token]
            == model.greedy_generate(torch.tensor(ids), 3)
            and transport.largest_chunk <= 4096
            and transport.chunks_sent > 1
        )

    # Split in place: each rank becomes its own degree-1 worker (same process, same weights).
    w_before = id(model.model.layers[0].self_attn.q_proj.weight)
    switches.append(engine.switch(1, 1).seconds)
    recs += explicit_prefix_cases(model, groups, "split")
    recs += multi_turn_cases(engine, f"split-r{rank}", seed=40 + rank)
    # Replication between the two degree-1 workers: rank 0 exports a prefix, rank 1 installs
    # it and reuses it.
    shared = _ids(13, 55)
    if rank == 0:
        engine.prefill(shared)
    hashes = chain_hashes(shared, B)
    payload = [(engine.cache.chain_of(hashes), engine.cache.export_pages(hashes))]
    got: list[Any] = [None, None]
    dist.all_gather_object(got, payload[0])
    if rank == 1:
        chain, pages = got[0]
        engine.cache.import_prefix(chain, pages)
        ev = engine.take_events()
        assert ev and ev[-1]["type"] == "stored" and ev[-1]["worker"] == "w-cp1-g1", ev
    q = shared + _ids(4, 56)
    out = engine.prefill(q)
    rec = compare(f"replicated-r{rank}", model, out, q, out.prefix_len, engine)
    rec["hit"] = out.prefix_len
    recs.append(rec)

    # Merge back in place: the CP2 worker's cache (retired at the split) is revived.
    switches.append(engine.switch(2, 2).seconds)
    recs += multi_turn_cases(engine, "merged", seed=20)  # turn 0 hits the revived cache
    recs.append(bad_input_then_good(engine))
    # Illegal switches are refused without changing anything (no collective runs).
    groups.begin_step()
    try:
        engine.switch(3, 1)
        guard.append("switch inside a step accepted")
    except GroupError:
        pass
    finally:
        groups.end_step()
    for epoch, degree in ((2, 1), (5, 8)):
        try:
            engine.switch(epoch, degree)
            guard.append(f"switch({epoch}, {degree}) accepted")
        except GroupError:
            pass
    out = engine.prefill(ids)
    recs.append(compare("after-refused-switch", model, out, ids, out.prefix_len, engine))
    return {
        "pid": pid,
        "guard": guard,
        "pid_after": os.getpid(),
        "records": recs,
        "switch_s": switches,
        "decode_ok": decode_ok,
        "same_weights": w_before == id(model.model.layers[0].self_attn.q_proj.weight),
    }


def world4(rank: int, world: int) -> dict[str, Any]:
    """C = 4 and C = 2 over 4 ranks: a prefix written at degree 2, re-sharded and reused at
    degree 4 after an in-place merge; then a split back to 2 + 2; MoE model at C = 4."""
    pid = os.getpid()
    groups = RankGroups((2, 4), initial_degree=2)
    model = Qwen3ForCausalLM.random(CFG, seed=11, dtype=torch.float64)
    engine = RankEngine(model, groups, block_size=B, pages_per_rank=32)
    recs: list[Record] = []
    # Degree 2: worker g0 writes a 5-block prefix; worker g2 serves another request.
    prefix = _ids(21, 70)
    seq = prefix if rank < 2 else _ids(15, 71)
    out = engine.prefill(seq)
    recs.append(compare(f"cp2-{engine.worker_id}", model, out, seq, 0, engine))
    # Export worker g0's pages (page p on its rank p mod 2) for re-sharding to degree 4.
    hashes = chain_hashes(prefix, B)
    mine = (engine.cache.chain_of(hashes), engine.cache.export_pages(hashes)) if rank < 2 else None
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    chain = everyone[0][0]
    pages = [pg for item in everyone[:2] for pg in item[1]]

    switches = [engine.switch(1, 4).seconds]  # merge 2 + 2 -> 4 in place
    engine.cache.import_prefix(chain, pages)  # page p -> rank p mod 4
    q = prefix + _ids(6, 72)
    out = engine.prefill(q)
    rec = compare("resharded-2to4", model, out, q, out.prefix_len, engine)
    rec["hit"] = out.prefix_len
    recs.append(rec)
    recs += explicit_prefix_cases(model, groups, "cp4-f64")
    recs += multi_turn_cases(engine, "cp4", seed=80)
    f32 = Qwen3ForCausalLM.random(CFG, seed=11, dtype=torch.float32)
    recs += explicit_prefix_cases(f32, groups, "cp4-f32")[1:3]
    moe = Qwen3ForCausalLM.random(MOE, seed=12, dtype=torch.float64)
    recs += explicit_prefix_cases(moe, groups, "cp4-moe")[1:2]
    recs.append(bad_input_then_good(engine))

    switches.append(engine.switch(2, 2).seconds)  # split 4 -> 2 + 2 in place
    seq = _ids(18, 90 + rank // 2)
    out = engine.prefill(seq)
    recs.append(compare(f"split-{engine.worker_id}", model, out, seq, out.prefix_len, engine))
    return {
        "pid": pid,
        "pid_after": os.getpid(),
        "records": recs,
        "switch_s": switches,
        "workers": engine.worker_id,
    }


def group_timeouts(rank: int, world: int, seconds: float) -> dict[int, float]:
    """Each lattice group's gloo collective timeout on this rank, by degree (a rank body: it
    lives here, not in the test module, so that spawned ranks can unpickle it by name)."""
    from services.rankd.engine.groups import RankGroups

    groups = RankGroups((1, 2), 2, timeout=timedelta(seconds=seconds))
    out = {}
    for d in (1, 2):
        pg = groups.group(d).pg
        if pg is not None:
            backend = pg._get_backend(torch.device("cpu"))
            out[d] = backend.options._timeout.total_seconds()
    return out
