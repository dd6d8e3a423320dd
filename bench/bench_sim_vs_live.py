"""Does the simulator predict the live system? One workload, one policy, one seed, both ways.

The same synthetic workload (the built-in generator, one steady phase, seed 0) runs

* through the **simulator** (:func:`sim.experiments.run_deployment`): policy ``vertumnus``
  (``--policy``: any policy of the comparisons, on the pool its source deploys, held) with its
  controller and cache manager, 8 GPUs, degrees {2, 4}, starting from 4×CP2, the
  built-in cost-model profile (what the live scheduler loads by default), the noisy ground
  truth (seed 0, σ 0.04);
* through the **live stack** (:class:`vertumnus.live.stack.LiveStack`: nats-server, gateway,
  scheduler, controller, cache manager, rank daemons on the ``sim`` backend timed by the same
  noisy ground truth × a time scale), replayed through the gateway's HTTP API at the
  workload's arrival times × the time scale (``vertumnus.live.replay``); TTFTs divided by the
  time scale are modelled seconds.

Same policy means the same settings: both sides run the calibrated values
(``services/calibration.py``: the policy's β, λ and busy-share power, the controller's
thresholds), which are the live services' defaults too; the bench also passes them as
``VTM_*`` settings (``live_env``), so that a live default changed later cannot make the two
sides differ unseen. κ is the profile's default (0.7·H) in both.

Load levels: light (ρ ≈ 0.2) and about 70% of capacity (ρ ≈ 0.7), where ρ = GPU-seconds the
workload demands on CP2 workers (ground truth, every earlier prefix cached) / GPU-seconds the
pool offers over the workload's span. Prints each run's mean TTFT (and P50 / P90), the
relative difference of the means (target: within 10%), the reconfigurations of each side.

    .venv/bin/python bench/bench_sim_vs_live.py [--duration 100] [--time-scale 1.0]
        [--loads 0.2,0.7] [--seed 0] [--policy vertumnus] [--workload FILE.toml]

``--workload`` runs a synthetic workload file instead (``vertumnus synthetic`` writes one):
phases of load and prompt length make the controller split and merge, so the comparison then
covers reconfiguration (drain, switch, the caches' reconcile) too, and prints each side's
splits and merges.

Wall time ≈ 2 × duration × time scale + start-up (≈ 4 min at the defaults). The default time
scale is 1 (modelled seconds are wall seconds): with a scale s < 1 every wall millisecond the
control plane spends (intake, dispatch, result delivery — what the simulator does not model)
counts 1/s modelled milliseconds, so a faster replay compares the simulator with a control
plane 1/s times slower than the real one (and amplifies this shared machine's scheduling
noise the same way); ``--time-scale 0.5`` halves the wall time for a quick look.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from services.controller.lattice import Composition, Lattice  # noqa: E402
from shared.costmodel import DEFAULT_PROFILE  # noqa: E402
from shared.ids import InvalidInput  # noqa: E402
from sim import calibration  # noqa: E402
from sim.experiments import ExperimentSpec, deployment_for, run_deployment  # noqa: E402
from sim.groundtruth import DEFAULT_GROUND_TRUTH  # noqa: E402
from sim.workloads import generate  # noqa: E402
from sim.workloads.synthetic import SyntheticConfig  # noqa: E402
from sim.workloads.synthetic_file import load_synthetic_config  # noqa: E402
from sim.workloads.workload import Workload, history_reuse, scale_rate  # noqa: E402
from vertumnus.live.replay import ReplayConfig, prepare_bodies, replay  # noqa: E402
from vertumnus.live.stack import (  # noqa: E402
    WINDOW_S,
    LiveStack,
    UpConfig,
    default_composition,
)

GPUS = 8
DEGREES = (2, 4)


def demand_rho(wl: Workload, gpus: int = GPUS, degree: int = 2) -> float:
    """GPU-seconds demanded at CP``degree`` (ideal cache) / GPU-seconds over the span."""
    gpu_s = 0.0
    for r, p in zip(wl.requests, history_reuse(wl), strict=True):
        s = (DEFAULT_GROUND_TRUTH.prefill_time(r.input_len - p, p, degree)
             + DEFAULT_GROUND_TRUTH.external_time(r.input_len, degree))
        gpu_s += s * degree
    ts = [r.arrival_s for r in wl.requests]
    span = max(ts) - min(ts) if len(ts) > 1 else 1.0
    return gpu_s / (gpus * span)


def workload_at(rho: float, duration: float, seed: int, long_share: float,
                config: SyntheticConfig | None = None) -> tuple[Workload, float]:
    """The workload scaled (arrival times compressed or stretched) to demand ρ: the built-in
    generator's steady phase of ``duration`` s, or ``config`` as given (its phases, lengths
    and duration; ``--workload``)."""
    cfg = config if config is not None else SyntheticConfig(
        duration_s=duration, rate=4.0, phases=(), long_share=long_share)
    base = generate(cfg, seed=seed)
    r0 = demand_rho(base)
    wl = scale_rate(base, rho / r0)
    return wl, demand_rho(wl)


def stats(ttfts: Sequence[float]) -> dict[str, float]:
    a = np.asarray(ttfts, dtype=float)
    return {"n": float(a.size), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90))}


def run_sim(wl: Workload, seed: int, policy: str = "vertumnus"
            ) -> tuple[dict[str, float], dict[str, Any]]:
    spec = ExperimentSpec(gpus=GPUS, degrees=DEGREES, seed=seed)
    lattice = Lattice(GPUS, DEGREES, gpus_per_node=spec.gpus_per_node)
    initial = Composition.parse(lattice, f"{GPUS // min(DEGREES)}CP{min(DEGREES)}")
    dep = deployment_for(policy, lattice, initial, spec)
    res = run_deployment(wl, dep, DEFAULT_PROFILE, spec)
    done = [r.ttft_s for r in res.records if r.ttft_s >= 0]
    info = {"failed": len(res.records) - len(done),
            "splits": sum(rc.kind == "split" for rc in res.reconfigurations),
            "merges": sum(rc.kind == "merge" for rc in res.reconfigurations),
            "timeline": [f"{rc.decided_s:.0f} s {rc.kind} ({rc.reason})"
                         for rc in res.reconfigurations],
            "params": dict(dep.params)}
    return stats(done), info


def live_env(policy: str = "vertumnus") -> dict[str, dict[str, str]]:
    c = calibration.CONTROLLER
    return {
        # The simulator's parameters of the policy (β, λ for the J family; none otherwise).
        "scheduler": {"VTM_POLICY_PARAMS": json.dumps(calibration.policy_params(policy))},
        "controller": {"VTM_UPPER": f"{c.upper:g}", "VTM_LOWER": f"{c.lower:g}",
                       "VTM_MERGE_HEADROOM": f"{c.merge_headroom:g}",
                       "VTM_PERSISTENCE": str(c.persistence),
                       "VTM_DEMAND_STABILITY": f"{c.demand_stability:g}",
                       "VTM_LONG_FRACTION_DELTA": f"{c.long_fraction_delta:g}"},
    }


def window_aligned_delay(now: float, first_arrival_wall_s: float, window_wall_s: float) -> float:
    """Seconds to wait, from wall time ``now`` (Unix), before starting a replay whose first
    request is sent ``first_arrival_wall_s`` after the workload's time 0, so that time 0 falls
    on a window boundary of the live services' grid (multiples of ``window_wall_s`` since the
    Unix epoch), as the simulator's windows start at 0. In [0, window_wall_s)."""
    return (first_arrival_wall_s - now) % window_wall_s


async def run_live(wl: Workload, seed: int, time_scale: float, policy: str = "vertumnus",
                   log_level: str = "warning", align: bool = True
                   ) -> tuple[dict[str, float], dict[str, Any]]:
    requests = list(wl)
    # A baseline runs on the pool its source deploys, held, as in run_sim (UpConfig.deployment).
    cfg = UpConfig(gpus=GPUS, degrees=DEGREES, time_scale=time_scale, seed=seed,
                   policy=policy, log_level=log_level,
                   duration_s=max(60.0, wl.duration_s or 60.0),
                   health_timeout_wall_s=180, env=live_env(policy))
    if policy == "vertumnus":
        assert cfg.workers() == default_composition(GPUS, DEGREES)
    rcfg = ReplayConfig(time_scale=time_scale, id_prefix=f"svl{int(time.time()) % 100000}-")
    bodies = await asyncio.to_thread(prepare_bodies, requests, rcfg)
    log_dir = Path(tempfile.mkdtemp(prefix="vtm-sim-vs-live-"))
    stack = LiveStack(cfg, log_dir=log_dir)
    try:
        await stack.start()
        assert stack.gateway_url is not None and stack.observer is not None
        if align:
            # The controller's decisions depend on where the window boundaries fall in the
            # workload (docs/evaluation.md "The simulator against the live stack"): start
            # where the simulator's fall.
            t0 = min((r.arrival_s for r in requests), default=0.0)
            await asyncio.sleep(window_aligned_delay(time.time(), t0 * time_scale,
                                                     WINDOW_S * time_scale))
        stack.observer.mark_start()
        records = await replay(stack.gateway_url, requests, rcfg, bodies=bodies)
        changes = list(stack.observer.changes)
    finally:
        await stack.stop()
    ok = [r.ttft_s / time_scale for r in records if r.ok]
    from vertumnus.live.report import describe_change

    moves = [(b, describe_change(a, b).split(" ", 1)[0])
             for a, b in zip(changes, changes[1:], strict=False)
             if set(a.workers) != set(b.workers)]
    kinds = [k for _, k in moves]
    overhead = [r.overhead_s for r in records if r.ok]
    # Wall time the control plane adds on a request's path (intake wait + scheduling,
    # dispatch and result delivery), in modelled seconds: what the simulator does not model.
    ctl = [(r.overhead_s + r.intake_wait_s) / time_scale for r in records if r.ok]
    info = {"failed": len(records) - len(ok), "splits": kinds.count("split"),
            "merges": kinds.count("merge"),
            # The epoch record's commit as the observer saw it (modelled s since the replay
            # began), to set beside the simulator's decision times.
            "timeline": [f"{b.at_s / time_scale:.0f} s {k} ({b.reason})" for b, k in moves],
            "log_dir": str(log_dir),
            "control_plane_mean_s": float(np.mean(ctl)) if ctl else math.nan,
            "overhead_p50_ms": 1e3 * float(np.percentile(overhead, 50)) if overhead else math.nan}
    return stats(ok), info


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=100.0, help="modelled seconds")
    ap.add_argument("--time-scale", type=float, default=1.0)
    ap.add_argument("--loads", default="0.2,0.7", help="target ρ per level")
    ap.add_argument("--long-share", type=float, default=0.0,
                    help="share of long (>32K-token) document requests (default 0: short "
                    "chat only, so a 100 s run is not dominated by a few huge prefills)")
    ap.add_argument("--workload", type=Path, default=None,
                    help="a synthetic workload file (`vertumnus synthetic` TOML) instead of the "
                    "steady built-in one: its phases, e.g. load and length changes that make "
                    "the controller split and merge, run on both sides (scaled to each --loads "
                    "ρ; --duration and --long-share do not apply)")
    ap.add_argument("--log-level", default="warning",
                    help="the live services' log level (info: each controller window's "
                    "decision, e.g. to see why a reconfiguration came when it did); the logs' "
                    "folder is printed")
    ap.add_argument("--align", action=argparse.BooleanOptionalAction, default=True,
                    help="start the live replay so that the workload's time 0 falls on a "
                    "boundary of the live windows, as the simulator's windows start at 0 "
                    "(default); --no-align starts it at once, at whatever phase")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="vertumnus",
                    help="any policy of the simulator's comparisons; both sides deploy its pool")
    args = ap.parse_args(argv)
    config: SyntheticConfig | None = None
    if args.workload is not None:
        try:
            config = load_synthetic_config(args.workload)
        except (OSError, InvalidInput) as exc:
            raise SystemExit(f"--workload {args.workload}: {exc}") from exc
    what = (f"synthetic workload {args.workload} ({len(config.phases)} phases over "
            f"{config.duration_s:g} s before scaling)" if config is not None else
            f"synthetic steady workload over {args.duration:g} modelled s (long share "
            f"{args.long_share:g})")
    print(f"sim vs live: {GPUS} GPUs, degrees {list(DEGREES)}, from "
          f"{GPUS // min(DEGREES)}xCP{min(DEGREES)}, policy {args.policy} (calibrated "
          f"parameters {calibration.policy_params(args.policy)}), seed {args.seed}, "
          f"{what}, live time scale {args.time_scale:g}")
    rows = []
    for rho in (float(x) for x in args.loads.split(",")):
        wl, got = workload_at(rho, args.duration, args.seed, args.long_share, config)
        t0 = time.monotonic()
        s_sim, i_sim = run_sim(wl, args.seed, args.policy)
        t_sim = time.monotonic() - t0
        t0 = time.monotonic()
        s_live, i_live = asyncio.run(run_live(wl, args.seed, args.time_scale, args.policy,
                                              args.log_level, args.align))
        t_live = time.monotonic() - t0
        rel = (s_live["mean"] - s_sim["mean"]) / s_sim["mean"]
        rate = len(wl) / max(1e-9, wl.requests[-1].arrival_s - wl.requests[0].arrival_s)
        print(f"\n-- load ρ ≈ {got:.2f}: {len(wl)} requests, {rate:.2f} req/s modelled, mean "
              f"input {np.mean([r.input_len for r in wl.requests]):.0f} tokens")
        print(f"   {'':6}{'mean TTFT':>10} {'P50':>8} {'P90':>8} {'done':>6} {'failed':>6} "
              f"{'splits':>6} {'merges':>6} {'wall s':>7}")
        for name, s, i, t in (("sim", s_sim, i_sim, t_sim), ("live", s_live, i_live, t_live)):
            print(f"   {name:6}{s['mean']:10.3f} {s['p50']:8.3f} {s['p90']:8.3f} "
                  f"{int(s['n']):6d} {i['failed']:6d} {i['splits']:6d} {i['merges']:6d} "
                  f"{t:7.1f}")
        print(f"   live logs: {i_live['log_dir']}")
        for name, i in (("sim", i_sim), ("live", i_live)):
            if i["timeline"]:
                print(f"   {name} reconfigurations: " + "; ".join(i["timeline"]))
        print(f"   relative difference of mean TTFT (live − sim) / sim: {rel:+.1%}   "
              f"(live control-plane overhead p50 {i_live['overhead_p50_ms']:.1f} wall ms = "
              f"{i_live['overhead_p50_ms'] / 1e3 / args.time_scale:.3f} modelled s)")
        net = s_live["mean"] - i_live["control_plane_mean_s"]
        print(f"   live mean TTFT less its mean control-plane time (intake wait + overhead, "
              f"{i_live['control_plane_mean_s']:.3f} modelled s): {net:.3f} → "
              f"{(net - s_sim['mean']) / s_sim['mean']:+.1%} vs sim")
        rows.append((got, rel))
    print("\nsummary: " + "; ".join(f"ρ {g:.2f}: {r:+.1%}" for g, r in rows)
          + " (target: within ±10%)")


if __name__ == "__main__":
    main()
