"""The live system's control-plane overhead and sustained request rate. Prints figures only.

Everything runs for real on this machine: :class:`vertumnus.live.stack.LiveStack` starts an
embedded ``nats-server`` and every service as its own process (gateway, scheduler, controller,
cache manager, a rank-daemon host on the ``sim`` backend timed by the ground truth × a time
scale), 8 GPUs, degrees {2, 4}, starting from 4×CP2, policy ``vertumnus``. The load is
open-loop: one ``POST /v1/completions`` every 1/rate s through the gateway's HTTP API (a fresh
connection per request, as ``vertumnus replay`` does), each with a client-chosen id.

1. **Control-plane overhead** (``--part overhead``): per request, from the gateway's answer
   (its TTFT, received → first token there, and the worker's FirstToken stage breakdown):
   overhead = TTFT − intake wait − worker queue wait − prefill − KV transfer − first decode,
   i.e. what scheduling, dispatch and result delivery add. Prompts share one of four
   1024-token prefixes plus a unique 200–2500-token tail. The pool's modelled capacity is
   estimated from the ground truth (4 CP2 workers, prefix cached) and the load offered at
   ``--moderate`` (default 0.3) and ``--near`` (default 0.85) of it, with time scale
   ``--overhead-time-scale`` (default 0.5: modelled seconds run 2× faster). Prints p50 / p99
   (and mean, max) of the overhead, of the schedule stage alone, of TTFT and queue wait.
   Targets of the issue: overhead p50 ≤ 2 ms, p99 ≤ 10 ms.

2. **Highest sustained rate** (``--part throughput``): zero-time backend (time scale 1e-6;
   the controller window and cache scan kept at 20 wall seconds so they do not spin), short
   prompts (600 tokens: one full block), a ladder of offered rates, ``--seconds`` each. A
   level is *sustained* when every request completes (HTTP 200) and the answers keep up with
   the offer (completions per second ≥ 95% of the offered rate, measured from the first send
   to the last answer). Run twice: tracing sampled at 1% and at 100% (spans exported with the
   console exporter into each service's log, so export costs CPU as a real exporter would;
   ``--exporter none`` records sampled spans without exporting). Target: ≥ 500 req/s.

    .venv/bin/python bench/bench_live.py [--part overhead|throughput|all] [--n 300]
        [--rates 100,150,200,250,300,350,400,500,600,800] [--seconds 3]
        [--sampling 0.01,1.0]

The load generator shares the machine's cores with every service and the NATS server, so on a
2-core machine the figures are a floor: the client's own CPU seconds are printed, and for the
throughput ladder the CPU milliseconds each process spent per request (from /proc), which
say which component a faster machine or an optimisation would have to relieve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from vertumnus.live.http import HttpError, request  # noqa: E402
from vertumnus.live.stack import LiveStack, UpConfig, notation  # noqa: E402

VOCAB = 151_936
PREFIX_LEN = 1024
GPUS = 8


# -- prompts ---------------------------------------------------------------------------------


def prefixed_prompt(rid: str, rng: random.Random) -> list[int]:
    """One of four shared 1024-token prefixes + a unique 200-2500-token tail."""
    k = rng.randrange(4)
    pre = random.Random(1000 + k)
    head = [pre.randrange(VOCAB) for _ in range(PREFIX_LEN)]
    t = random.Random(rid)
    return head + [t.randrange(VOCAB) for _ in range(rng.randint(200, 2500))]


def short_prompt(rid: str, length: int = 600) -> list[int]:
    t = random.Random(rid)
    return [t.randrange(VOCAB) for _ in range(length)]


def modelled_capacity(prompts: Sequence[list[int]], workers: int = 4, degree: int = 2) -> float:
    """Requests per modelled second ``workers`` degree-``degree`` workers serve, from the
    ground truth's mean service time (prefill of the tail after a cached prefix + handoff)."""
    from sim.groundtruth import DEFAULT_GROUND_TRUTH as gt

    s = [gt.prefill_time(len(p) - PREFIX_LEN, PREFIX_LEN, degree)
         + gt.external_time(len(p), degree) for p in prompts]
    return workers / float(np.mean(s))


# -- load --------------------------------------------------------------------------------------


@dataclass
class Answer:
    rid: str
    sent: float
    done: float
    status: int
    vtm: dict[str, Any] | None


async def open_loop(url: str, bodies: Sequence[tuple[str, bytes]], rate: float,
                    timeout_s: float = 300.0) -> tuple[list[Answer], float]:
    """Send body i at start + i/rate; returns (answers, start)."""
    endpoint = url.rstrip("/") + "/v1/completions"
    start = time.monotonic() + 0.05
    out: list[Answer] = []

    async def one(i: int, rid: str, body: bytes) -> None:
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        sent = time.monotonic()
        try:
            r = await request(endpoint, "POST", body, timeout_s=timeout_s)
            try:
                vtm = (r.json() or {}).get("vtm")
            except ValueError:
                vtm = None
            out.append(Answer(rid, sent, time.monotonic(), r.status, vtm))
        except (HttpError, TimeoutError):
            out.append(Answer(rid, sent, time.monotonic(), 0, None))

    await asyncio.gather(*(one(i, rid, b) for i, (rid, b) in enumerate(bodies)))
    return out, start


def body(rid: str, prompt: list[int]) -> bytes:
    return json.dumps({"prompt": prompt, "request_id": rid}, separators=(",", ":")).encode()


def pct(xs: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if len(xs) else math.nan


def overheads(answers: Sequence[Answer]) -> dict[str, list[float]]:
    ok = [a.vtm for a in answers if a.status == 200 and a.vtm]
    out: dict[str, list[float]] = {"overhead": [], "schedule": [], "ttft": [], "queue": [],
                                   "intake": []}
    for v in ok:
        st = v["stages"]
        ttft = float(v["ttft_s"])
        work = (st["intake_wait_s"] + st["queue_wait_s"] + st["prefill_s"]
                + st["kv_transfer_s"] + st["first_decode_s"])
        out["overhead"].append(ttft - work)
        out["schedule"].append(st["schedule_s"])
        out["ttft"].append(ttft)
        out["queue"].append(st["queue_wait_s"])
        out["intake"].append(st["intake_wait_s"])
    return out


def ms(x: float) -> str:
    return f"{1e3 * x:8.2f}"


# -- stacks ------------------------------------------------------------------------------------


async def start_stack(cfg: UpConfig) -> LiveStack:
    stack = LiveStack(cfg, log_dir=Path(tempfile.mkdtemp(prefix="vtm-bench-live-")))
    try:
        await stack.start()
    except BaseException:
        await stack.stop()
        raise
    return stack


async def composition_now(stack: LiveStack) -> str:
    from shared.schemas import EpochRecord, decode
    from shared.service import epoch_kv

    assert stack.nc is not None
    kv = await epoch_kv(stack.nc.jetstream(), stack.subjects)
    entry = await kv.get(stack.subjects.epoch_key())
    rec = decode(EpochRecord, entry.value)
    return f"epoch {rec.epoch}: {notation([w.worker_id for w in rec.workers])}"


# -- part 1 --------------------------------------------------------------------------------------


async def part_overhead(args: argparse.Namespace) -> None:
    ts = args.overhead_time_scale
    rng = random.Random(0)
    prompts = {f"ov-{i:05d}": prefixed_prompt(f"ov-{i:05d}", rng) for i in range(args.n)}
    cap_m = modelled_capacity(list(prompts.values()))
    cap_w = cap_m / ts
    print(f"\n== control-plane overhead: {GPUS} GPUs from 4xCP2, policy vertumnus, time scale "
          f"{ts:g}, {args.n} requests per level ==")
    print(f"prompts: 1024-token shared prefix (4 kinds) + 200-2500 unique tokens "
          f"(mean {np.mean([len(p) for p in prompts.values()]):.0f} tokens)")
    print(f"modelled pool capacity (ground truth, 4xCP2, prefix cached): {cap_m:.1f} req/s "
          f"modelled = {cap_w:.1f} req/s wall")
    for label, frac in (("moderate", args.moderate), ("near saturation", args.near)):
        rate = frac * cap_w
        cfg = UpConfig(gpus=GPUS, degrees=(2, 4), time_scale=ts, log_level="warning",
                       duration_s=max(60.0, args.n / rate / ts * 2), health_timeout_wall_s=180)
        stack = await start_stack(cfg)
        try:
            assert stack.gateway_url is not None
            # Warm-up: a few requests so every prefix is cached somewhere (not measured).
            warm = [(f"warm-{k}", body(f"warm-{k}", prefixed_prompt(f"warm-{k}",
                                                                     random.Random(k))))
                    for k in range(8)]
            await open_loop(stack.gateway_url, warm, 5.0)
            ru0 = resource.getrusage(resource.RUSAGE_SELF)
            answers, t0 = await open_loop(
                stack.gateway_url, [(rid, body(rid, p)) for rid, p in prompts.items()], rate)
            ru1 = resource.getrusage(resource.RUSAGE_SELF)
            comp = await composition_now(stack)
        finally:
            await stack.stop()
        ok = sum(a.status == 200 for a in answers)
        o = overheads(answers)
        span = max(a.done for a in answers) - t0
        print(f"\n-- {label}: offered {rate:.1f} req/s wall ({frac:.0%} of modelled capacity); "
              f"{ok}/{len(answers)} OK; completed at {len(answers) / span:.1f} req/s; "
              f"composition at the end {comp}; client CPU "
              f"{ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime:.1f} s")
        print(f"   {'wall ms':<34}{'p50':>8} {'p99':>8} {'mean':>8} {'max':>8}")
        for key, name in (("overhead", "overhead (TTFT - waits - work)"),
                          ("schedule", "  of which schedule stage"),
                          ("intake", "intake wait"), ("queue", "worker queue wait"),
                          ("ttft", "TTFT (gateway)")):
            xs = o[key]
            print(f"   {name:<34}{ms(pct(xs, 50))} {ms(pct(xs, 99))} "
                  f"{ms(float(np.mean(xs)) if xs else math.nan)} "
                  f"{ms(max(xs) if xs else math.nan)}")


# -- part 2 --------------------------------------------------------------------------------------


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process (Linux /proc), 0 if unreadable."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def stack_pids(stack: LiveStack) -> dict[str, int]:
    pids = {c.name: c.pid for c in stack.children.children}
    if stack.nats is not None and stack.nats.pid is not None:
        pids["nats-server"] = stack.nats.pid
    return pids


async def ladder(stack: LiveStack, rates: Sequence[float], seconds: float, tag: str
                 ) -> float:
    assert stack.gateway_url is not None
    best = 0.0
    pids = stack_pids(stack)
    cpu_rows: list[str] = []
    print(f"   {'offered':>8} {'n':>6} {'ok':>6} {'done/s':>8} {'sustained':>9} "
          f"{'ttft p50':>9} {'ttft p99':>9} {'ovh p50':>8} {'ovh p99':>8} {'client cpu':>10}")
    for rate in rates:
        n = int(rate * seconds)
        bodies = [(f"{tag}-{int(rate)}-{i:06d}",
                   body(f"{tag}-{int(rate)}-{i:06d}", short_prompt(f"{tag}-{i}")))
                  for i in range(n)]
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        c0 = {k: proc_cpu_s(p) for k, p in pids.items()}
        answers, t0 = await open_loop(stack.gateway_url, bodies, rate, timeout_s=120)
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        c1 = {k: proc_cpu_s(p) for k, p in pids.items()}
        client = ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime
        cpu_rows.append(f"   {rate:8.0f}  " + "  ".join(
            f"{k} {1e3 * (c1[k] - c0[k]) / n:.2f}" for k in pids)
            + f"  client {1e3 * client / n:.2f}  total "
            f"{1e3 * (sum(c1.values()) - sum(c0.values()) + client) / n:.2f}")
        ok = sum(a.status == 200 for a in answers)
        span = max(a.done for a in answers) - t0
        done_rate = ok / span
        sustained = ok == n and done_rate >= 0.95 * rate
        o = overheads(answers)
        cpu = ru1.ru_utime + ru1.ru_stime - ru0.ru_utime - ru0.ru_stime
        print(f"   {rate:8.0f} {n:6d} {ok:6d} {done_rate:8.1f} {str(sustained):>9} "
              f"{ms(pct(o['ttft'], 50))} {ms(pct(o['ttft'], 99))} "
              f"{ms(pct(o['overhead'], 50))} {ms(pct(o['overhead'], 99))} {cpu:9.1f}s")
        if sustained:
            best = max(best, rate)
        else:
            break
        await asyncio.sleep(1.0)
    print("   CPU ms per request, by process (user + system, this level's window):")
    for row in cpu_rows:
        print(row)
    return best


async def part_throughput(args: argparse.Namespace) -> None:
    rates = [float(x) for x in args.rates.split(",")]
    print(f"\n== highest sustained rate: gateway -> scheduler -> rankd, zero-time backend "
          f"(time scale 1e-6), {GPUS} GPUs from 4xCP2, 600-token prompts, {args.seconds:g} s "
          f"per level, exporter {args.exporter} ==")
    results = {}
    for ratio in (float(x) for x in args.sampling.split(",")):
        tele = {"VTM_TELEMETRY__SAMPLING_RATIO": f"{ratio:g}",
                "VTM_TELEMETRY__EXPORTER": args.exporter}
        env = {name: dict(tele) for name in ("gateway", "scheduler", "controller", "cachemgr",
                                             "rankd")}
        env["scheduler"]["VTM_WINDOW_S"] = "20"
        env["controller"].update({"VTM_WINDOW_S": "20", "VTM_TICK_S": "1",
                                  "VTM_REPORT_GRACE_S": "2"})
        env["cachemgr"]["VTM_SCAN_INTERVAL_S"] = "20"
        cfg = UpConfig(gpus=GPUS, degrees=(2, 4), time_scale=1e-6, log_level="warning",
                       duration_s=1e7, health_timeout_wall_s=180, env=env)
        stack = await start_stack(cfg)
        try:
            print(f"\n-- tracing sampled at {ratio:.0%}")
            results[ratio] = await ladder(stack, rates, args.seconds, f"tp{int(ratio * 100)}")
            comp = await composition_now(stack)
        finally:
            await stack.stop()
        print(f"   highest sustained: {results[ratio]:.0f} req/s (composition at the end: "
              f"{comp})")
    print("\nsummary: highest sustained rate " + ", ".join(
        f"{r:.0%} sampling: {v:.0f} req/s" for r, v in results.items()))


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("overhead", "throughput", "all"), default="all")
    ap.add_argument("--n", type=int, default=300, help="requests per overhead level")
    ap.add_argument("--overhead-time-scale", type=float, default=0.5)
    ap.add_argument("--moderate", type=float, default=0.3)
    ap.add_argument("--near", type=float, default=0.85)
    ap.add_argument("--rates", default="100,150,200,250,300,350,400,500,600,800")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--sampling", default="0.01,1.0")
    ap.add_argument("--exporter", choices=("console", "none"), default="console")
    args = ap.parse_args(argv)
    print(f"bench_live: {os.cpu_count()} CPUs; python {sys.version.split()[0]}")
    if args.part in ("overhead", "all"):
        asyncio.run(part_overhead(args))
    if args.part in ("throughput", "all"):
        asyncio.run(part_throughput(args))


if __name__ == "__main__":
    main()
