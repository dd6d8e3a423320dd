"""Benchmark of rankd's torch engine on CPU: prefill time vs R (and P) for C in {1, 2, 4},
in-place split/merge switch times, and a cost-model fit (shared.costmodel.fit_profile) on the
measured (R, P, C) samples with its MAPE.

Usage:  .venv/bin/python bench/bench_engine.py [--lengths 16 64 256] [--prefixes 0 128]
        [--repeats 3] [--hidden 64] [--out runs/bench_engine.json]

NOTE: ranks are processes on this machine's cores. With fewer cores than ranks (e.g. 4 ranks
on 2 cores) the C = 4 figures measure oversubscription and gloo overhead, not CP speedup.
Speed is only printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.rankd.engine.config import Qwen3Config  # noqa: E402
from services.rankd.engine.cp_prefill import cp_prefill, shard_prefix, stack_kv  # noqa: E402
from services.rankd.engine.groups import RankGroups  # noqa: E402
from services.rankd.engine.model import Qwen3ForCausalLM  # noqa: E402
from shared.costmodel import DEFAULT_PROFILE, fit_profile  # noqa: E402

PAGE = 16


def _rank_main(rank: int, world: int, store: str, args: argparse.Namespace, q: Any) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=300),
    )
    try:
        q.put((rank, _measure(rank, world, args)))
    finally:
        dist.destroy_process_group()


def _measure(rank: int, world: int, args: argparse.Namespace) -> dict[str, Any]:
    cfg = Qwen3Config(
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        num_hidden_layers=2,
        max_position_embeddings=8192,
    )
    model = Qwen3ForCausalLM.random(cfg, seed=0, dtype=torch.float32)
    groups = RankGroups(args.degrees, initial_degree=max(args.degrees))
    g = torch.Generator().manual_seed(1)
    epoch = 0
    samples = []
    for c in sorted(args.degrees):
        epoch += 1
        groups.switch(epoch, c)
        grp = groups.active
        busy = grp.members[0] == 0  # only worker g0 runs; other workers idle (no contention)
        for p in args.prefixes:
            for r in args.lengths:
                ids = torch.randint(0, cfg.vocab_size, (p + r,), generator=g)
                if busy:
                    local = None
                    if p:
                        pre = stack_kv(model.reference_forward(ids[:p]).new_kv)
                        local = shard_prefix(pre, PAGE, c, grp.rank)
                    times = []
                    for i in range(args.repeats + 1):
                        grp.barrier()
                        t0 = time.perf_counter()
                        cp_prefill(model, grp, ids[p:], local, p, PAGE)
                        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                        slowest = max(float(x) for x in grp.all_gather(dt))
                        if i:  # first run is warm-up
                            times.append(slowest)
                    if grp.rank == 0:
                        samples.append((r, p, c, statistics.median(times)))
                dist.barrier()
    # Switch times: split 4 -> 2 -> 1 and merge 1 -> 2 -> 4, repeated; every rank switches.
    switches: dict[str, list[float]] = {}
    order = sorted(args.degrees, reverse=True)
    for _ in range(args.repeats):
        cur = groups.active.degree
        for target in order[1:] + order[::-1][1:]:
            epoch += 1
            rep = groups.switch(epoch, target)
            t = torch.tensor([rep.seconds], dtype=torch.float64)
            gathered = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(gathered, t)
            kind = "split" if target < cur else "merge"
            switches.setdefault(f"{kind} {cur}->{target}", []).append(
                max(float(x) for x in gathered)
            )
            cur = target
    return {"samples": samples, "switches": switches}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 256, 512])
    ap.add_argument("--prefixes", type=int, nargs="+", default=[0, 256])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    args = ap.parse_args()
    world = max(args.degrees)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, store, args, q)) for r in range(world)
        ]
        for pr in procs:
            pr.start()
        results = dict(q.get(timeout=1800) for _ in range(world))
        for pr in procs:
            pr.join()
    samples = results[0]["samples"]
    cores = os.cpu_count()
    print(
        f"# engine prefill on CPU: Qwen3-arch 2 layers, hidden {args.hidden}, 4 heads "
        f"(2 KV), float32, gloo; {world} rank processes on {cores} cores"
    )
    if cores is not None and cores < world:
        print(
            f"# NOTE: {world} ranks on {cores} cores: C > {cores} figures measure "
            "oversubscription (and gloo overhead), not CP speedup"
        )
    print(f"{'P':>6} {'R':>6} " + " ".join(f"{'C=' + str(c) + ' ms':>10}" for c in args.degrees))
    by = {(r, p, c): t for r, p, c, t in samples}
    for p in args.prefixes:
        for r in args.lengths:
            print(
                f"{p:>6} {r:>6} " + " ".join(f"{by[(r, p, c)] * 1e3:>10.2f}" for c in args.degrees)
            )
    print("# in-place switch (max over ranks, includes the new group's barrier), ms:")
    sw = results[0]["switches"]
    for k, v in sw.items():
        print(
            f"  {k:>14}: median {statistics.median(v) * 1e3:.3f}"
            f"  max {max(v) * 1e3:.3f}  (n={len(v)})"
        )
    base = replace(DEFAULT_PROFILE, model="qwen3-tiny-cpu", hardware=f"cpu-{cores}c")
    glob = fit_profile(samples, base=base)
    prof = fit_profile(samples, per_degree=True, base=base)
    co = glob.coefficients
    print(
        f"# cost-model fit (Eq. 2, one set for all C) on {len(samples)} samples: d={co.d:.3g}s "
        f"a={co.a:.3g} b={co.b:.3g} c={co.c:.3g} alpha={co.alpha:.3g}"
    )
    for name, pr in (("global fit", glob), ("per-degree fit", prof)):
        print(
            f"# {name} MAPE: {pr.fit_mape * 100:.1f}% overall; "
            + ", ".join(f"C={c}: {m * 100:.1f}%" for c, m in pr.fit_mape_per_degree.items())
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(
            json.dumps(
                {
                    "samples": [{"R": r, "P": p, "C": c, "seconds": t} for r, p, c, t in samples],
                    "switch_s": sw,
                    "profile_global": glob.to_dict(),
                    "profile": prof.to_dict(),
                    "cores": cores,
                    "world": world,
                },
                indent=2,
            )
            + "\n"
        )
        print(f"# wrote {args.out}")


if __name__ == "__main__":
    main()
