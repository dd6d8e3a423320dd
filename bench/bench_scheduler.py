"""Decision-time benchmark of the Vertumnus placement (§5.3), and trie.match + placement.

Usage::

    .venv/bin/python bench/bench_scheduler.py [--iters N] [--json out.json]

Measures, with ``time.perf_counter_ns`` around each call (one decision per sample):

1. ``place`` of a 64-block request (L = 64·512 − 100 tokens) given ``held_blocks``, over 40 and
   512 workers (degrees cycling 2, 4, 8; a few workers hold part of the prefix; every worker has
   a running request and 0–3 queued ones). Targets: median ≤ 100 µs at 40 workers, ≤ 1 ms at 512.
2. If ``services/cachemgr/trie.py`` is importable: ``PrefixTrie.match`` + ``place`` end to end on
   a trie of ≥ 100,000 blocks built by replaying the Mooncake conversation trace's ``hash_ids``
   as ``Stored`` events (each trace request stored on one worker, chosen by its second block so
   conversations stick), queried with (a) the 64-block request extending a stored prefix and
   (b) the trace requests that follow the replayed part.

Prints median and p99 in microseconds; ``--json`` also writes them machine-readably. No figure is
asserted anywhere: speed is reported, never tested (conventions.md).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.scheduler import (  # noqa: E402
    ClusterView,
    RequestInfo,
    WorkerLoad,
    WorkerView,
    make_policy,
)
from shared.costmodel import DEFAULT_PROFILE  # noqa: E402
from shared.ids import BlockHash, RequestId, WorkerId  # noqa: E402

TRACE = Path("/work/shared/data/traces/mooncake/conversation_trace.jsonl")
BLOCK = 512
DEGREES = (2, 4, 8)


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))
    return s[k]


def timed(fn: Callable[[int], object], iters: int, warmup: int = 200) -> dict[str, float]:
    for i in range(warmup):
        fn(i)
    samples: list[float] = []
    clock = time.perf_counter_ns
    for i in range(iters):
        t0 = clock()
        fn(i)
        samples.append((clock() - t0) / 1000.0)
    return {
        "median_us": statistics.median(samples),
        "p99_us": percentile(samples, 0.99),
        "mean_us": statistics.fmean(samples),
        "n": float(iters),
    }


def make_cluster(
    n_workers: int, rng: random.Random
) -> tuple[ClusterView, dict[WorkerId, WorkerLoad]]:
    workers = tuple(
        WorkerView(
            WorkerId(f"w{k:03d}-cp{DEGREES[k % 3]}"),
            DEGREES[k % 3],
            max_seq_len=262_144,
            kv_capacity_tokens=4_000_000,
        )
        for k in range(n_workers)
    )
    view = ClusterView(workers, block_size=BLOCK)
    loads = {w.worker_id: WorkerLoad(w.worker_id) for w in workers}
    for w in workers:
        ld = loads[w.worker_id]
        ld.reserve(
            RequestId("run"), rng.uniform(0.2, 3.0), tokens=8000, uncached_tokens=6000, blocks=16
        )
        ld.start(RequestId("run"), 0.0)
        for j in range(rng.randint(0, 3)):
            ld.reserve(
                RequestId(f"q{j}"),
                rng.uniform(0.1, 2.0),
                tokens=8000,
                uncached_tokens=4000,
                blocks=16,
            )
    return view, loads


def bench_placement(n_workers: int, iters: int) -> dict[str, float]:
    rng = random.Random(7)
    view, loads = make_cluster(n_workers, rng)
    policy = make_policy("vertumnus", profile=DEFAULT_PROFILE)
    L = 64 * BLOCK - 100
    reqs = [
        RequestInfo(RequestId(f"r{i}"), L, tuple(BlockHash(i * 100 + k) for k in range(64)))
        for i in range(16)
    ]
    ids = [w.worker_id for w in view.workers]
    helds = [
        {ids[rng.randrange(n_workers)]: rng.randint(1, 64) for _ in range(4)} for _ in range(16)
    ]
    now = 0.5

    def one(i: int) -> object:
        return policy.place(reqs[i & 15], view, helds[i & 15], loads, now)

    return timed(one, iters)


def _trie_case(
    rows: list[dict], n_workers: int, iters: int, target_blocks: int
) -> dict[str, object]:
    from services.cachemgr.events import Stored
    from services.cachemgr.trie import PrefixTrie

    rng = random.Random(11)
    view, loads = make_cluster(n_workers, rng)
    trie = PrefixTrie(DEGREES, block_size=BLOCK)
    for w in view.workers:
        trie.add_worker(w.worker_id, w.degree, capacity_blocks=10_000_000)
    eid = {w.worker_id: 0 for w in view.workers}
    ids = [w.worker_id for w in view.workers]
    t0 = time.perf_counter()
    used = 0
    for r in rows:
        if len(trie) >= target_blocks:
            break
        hs = r["hash_ids"]
        w = ids[hash(hs[1] if len(hs) > 1 else hs[0]) % n_workers]
        eid[w] += 1
        trie.apply(Stored(w, eid[w], None, tuple(BlockHash(h) for h in hs)))
        used += 1
    build_s = time.perf_counter() - t0
    policy = make_policy("vertumnus", profile=DEFAULT_PROFILE)
    # (a) 64-block requests extending the longest stored chains (48 stored blocks + 16 new)
    long_rows = sorted(rows[:used], key=lambda r: -len(r["hash_ids"]))[:16]
    reqs64 = []
    for i, r in enumerate(long_rows):
        hs = [BlockHash(h) for h in r["hash_ids"][:48]]
        hs += [BlockHash(10_000_000 + i * 100 + k) for k in range(64 - len(hs))]
        reqs64.append(RequestInfo(RequestId(f"e{i}"), 64 * BLOCK - 100, tuple(hs)))
    # (b) the trace requests after the replayed part
    tail = [
        RequestInfo(
            RequestId(f"t{i}"),
            max(1, r["input_length"]),
            tuple(BlockHash(h) for h in r["hash_ids"]),
        )
        for i, r in enumerate(rows[used : used + 512])
    ]
    now = 0.5

    def e2e64(i: int) -> object:
        q = reqs64[i & 15]
        return policy.place(q, view, trie.match(q.block_hashes).held_blocks, loads, now)

    def e2e_trace(i: int) -> object:
        q = tail[i % len(tail)]
        return policy.place(q, view, trie.match(q.block_hashes).held_blocks, loads, now)

    def match_only(i: int) -> object:
        return trie.match(reqs64[i & 15].block_hashes)

    hits = sum(1 for q in tail if trie.match(q.block_hashes).held_blocks)
    return {
        "trie_blocks": len(trie),
        "trace_requests_replayed": used,
        "build_s": build_s,
        "trace_queries_with_a_hit": f"{hits}/{len(tail)}",
        "match_only_64": timed(match_only, iters),
        "match_plus_place_64": timed(e2e64, iters),
        "match_plus_place_trace": timed(e2e_trace, iters),
    }


def bench_trie(iters: int, target_blocks: int = 100_000) -> dict[str, object]:
    try:
        import services.cachemgr.events  # noqa: F401
        import services.cachemgr.trie  # noqa: F401
    except Exception as exc:  # the trie is another engineer's module; report, don't fail
        return {"skipped": f"services.cachemgr.trie not importable: {exc!r}"}
    if not TRACE.exists():
        return {"skipped": f"trace not found: {TRACE}"}
    rows = [json.loads(line) for line in TRACE.open()]
    return {f"workers_{n}": _trie_case(rows, n, iters, target_blocks) for n in (40, 512)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-trie", action="store_true")
    args = ap.parse_args()
    res: dict[str, object] = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "placement": {f"workers_{n}": bench_placement(n, args.iters) for n in (40, 512)},
    }
    print(f"vertumnus placement, 64-block request (python {res['python']}, {res['machine']})")
    targets = {40: 100.0, 512: 1000.0}
    for n in (40, 512):
        r = res["placement"][f"workers_{n}"]  # type: ignore[index]
        ok = "meets" if r["median_us"] <= targets[n] else "MISSES"
        print(
            f"  {n:4d} workers: median {r['median_us']:8.1f} us   p99 {r['p99_us']:8.1f} us   "
            f"({ok} target median <= {targets[n]:.0f} us)"
        )
    if not args.no_trie:
        tr = bench_trie(args.iters)
        res["trie"] = tr
        if tr and "skipped" in tr:
            print(f"trie.match + placement: skipped ({tr['skipped']})")
        elif tr:
            for key, r in tr.items():
                print(
                    f"trie.match + placement, {key.replace('_', ' ')}: "
                    f"trie {r['trie_blocks']} blocks (built from "
                    f"{r['trace_requests_replayed']} trace requests in {r['build_s']:.1f} s), "
                    f"trace queries with a hit {r['trace_queries_with_a_hit']}"
                )
                for name in ("match_only_64", "match_plus_place_64", "match_plus_place_trace"):
                    m = r[name]
                    print(
                        f"    {name:24s} median {m['median_us']:8.1f} us  p99 {m['p99_us']:8.1f} us"
                    )
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
