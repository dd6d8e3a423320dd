"""Benchmark of the global prefix trie (§7): build, match, record, scan, memory. Prints figures.

Builds a ~100,000-block trie by replaying the Mooncake conversation trace's ``hash_ids``
(prefix-chained 512-token block ids) across N workers: each request's blocks are stored on 1-3
workers drawn by a seeded RNG (degrees alternate 2 / 4), as ``Stored`` events of the missing
tail, so holder sets look like a real pool's. Then it times ``match`` for 64-block requests
(a trace request's blocks padded with fresh ids to 64), Algorithm 1 (``record_request``), one
Algorithm 2 scan with selection, and measures trie memory per block with tracemalloc.

    .venv/bin/python bench/bench_trie.py [--trace PATH] [--workers 40 512] [--blocks 100000]

No assertions: speed is reported, not tested.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
import tracemalloc
from pathlib import Path

from services.cachemgr.events import Stored
from services.cachemgr.scan import ScanConfig
from services.cachemgr.trie import PrefixTrie
from shared.costmodel import DEFAULT_PROFILE
from shared.ids import BlockHash, WorkerId

DEFAULT_TRACE = (Path(__file__).resolve().parents[2]
                 / "shared/data/traces/mooncake/conversation_trace.jsonl")


def load_trace(path: Path) -> list[tuple[int, list[int]]]:
    out = []
    with path.open() as fh:
        for line in fh:
            if line.strip():
                r = json.loads(line)
                out.append((int(r["input_length"]), [int(h) for h in r["hash_ids"]]))
    return out


def build(trace, n_workers: int, target_blocks: int, seed: int):
    rng = random.Random(seed)
    t = PrefixTrie([2, 4])
    workers = [WorkerId(f"w{i}") for i in range(n_workers)]
    for i, w in enumerate(workers):
        t.add_worker(w, 2 if i % 2 == 0 else 4, 10**9)
    have: dict[WorkerId, set[int]] = {w: set() for w in workers}
    ids = dict.fromkeys(workers, 0)
    used = []
    events = 0
    t0 = time.perf_counter()
    for length, hs in trace:
        if len(t) >= target_blocks:
            break
        used.append((length, hs))
        for w in rng.sample(workers, rng.randint(1, 3)):
            s = have[w]
            i = 0
            while i < len(hs) and hs[i] in s:
                i += 1
            if i == len(hs):
                continue
            ids[w] += 1
            t.apply(Stored(w, ids[w], BlockHash(hs[i - 1]) if i else None,
                           tuple(BlockHash(h) for h in hs[i:])))
            s.update(hs[i:])
            events += 1
    dt = time.perf_counter() - t0
    return t, used, events, dt


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(trace, n_workers: int, target: int, seed: int, queries: int) -> None:
    gc.collect()
    t, used, events, build_s = build(trace, n_workers, target, seed)
    holders = sum(len(t.holders(h)) for h in t.node_hashes())
    print(f"\n== {n_workers} workers: {len(t):,} blocks from {len(used):,} requests, "
          f"{events:,} Stored events in {build_s:.2f} s ({events / build_s:,.0f} events/s), "
          f"mean holders/block {holders / len(t):.2f}, holders of block {used[0][1][0]}: "
          f"{len(t.holders(BlockHash(used[0][1][0])))}")
    rng = random.Random(seed + 1)
    fresh = 10**12
    reqs = []
    for _ in range(queries):
        length, hs = rng.choice(used)
        q = hs[:64]
        while len(q) < 64:
            fresh += 1
            q = q + [fresh]
        reqs.append((length, q))
    match = t.match
    for _, q in reqs[:200]:  # warm up
        match(q)
    times = []
    matched = []
    pc = time.perf_counter_ns
    for _, q in reqs:
        a = pc()
        m = match(q)
        times.append((pc() - a) / 1e3)
        matched.append(m.matched_blocks)
    print(f"match (64-block requests, {queries} queries, mean matched "
          f"{statistics.mean(matched):.1f} blocks): median {statistics.median(times):.1f} us, "
          f"p99 {pct(times, 0.99):.1f} us, max {max(times):.1f} us")

    predict = DEFAULT_PROFILE.predict_fast
    rec = []
    for length, q in reqs:
        m = match(q)
        if m.held_blocks:
            w, k = max(m.held_blocks.items(), key=lambda x: x[1])
        else:
            w, k = WorkerId("w0"), 0
        c = t.worker_degree(w)
        a = pc()
        t.record_request(m, w, c, k, 4 if c == 2 else 2, max(length, 1), predict)
        rec.append((pc() - a) / 1e3)
    print(f"record_request (Algorithm 1): median {statistics.median(rec):.1f} us, "
          f"p99 {pct(rec, 0.99):.1f} us")

    load = {w: rng.random() * 5 for w in t.workers()}
    cfg = ScanConfig(theta_inter=0.05, theta_intra=3.0, theta_reclaim=0.5, decay=0.5,
                     max_actions_per_list=4)
    a = time.perf_counter()
    res = t.scan(cfg, load=load)
    scan_s = time.perf_counter() - a
    print(f"scan (Algorithm 2 + selection + GC): {scan_s * 1e3:.0f} ms; lists inter "
          f"{len(res.inter):,} intra {len(res.intra):,} reclaim {len(res.reclaim):,}; "
          f"{len(res.actions)} actions; {res.collected} nodes collected")
    a = time.perf_counter()
    t.scan(cfg, load=load)
    print(f"second scan: {(time.perf_counter() - a) * 1e3:.0f} ms")


def memory(trace, n_workers: int, target: int, seed: int) -> None:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t, _, _, _ = build(trace, n_workers, target, seed)
    gc.collect()
    cur = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    # NOTE: includes the workers' valid sets (one entry per (worker, block) held).
    print(f"memory ({n_workers} workers): {(cur - base) / 2**20:.1f} MiB for {len(t):,} blocks "
          f"= {(cur - base) / len(t):.0f} B/block (trie + per-worker views)")
    del t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE,
                    help="Mooncake-format JSONL with hash_ids (default: %(default)s)")
    ap.add_argument("--workers", type=int, nargs="+", default=[40, 512])
    ap.add_argument("--blocks", type=int, default=100_000, help="target trie size in blocks")
    ap.add_argument("--queries", type=int, default=5000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-memory", action="store_true")
    args = ap.parse_args()
    trace = load_trace(args.trace)
    print(f"trace {args.trace} ({len(trace):,} requests), seed {args.seed}")
    for n in args.workers:
        run(trace, n, args.blocks, args.seed, args.queries)
        if not args.no_memory:
            memory(trace, n, args.blocks, args.seed)


if __name__ == "__main__":
    main()
