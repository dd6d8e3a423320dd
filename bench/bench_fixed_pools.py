"""Fixed compositions under Vertumnus's J scheduler at one rate, with and without the cache
manager (with: its scan, reclamation and route-time pull, as vertumnus runs them). Prints
figures; asserts nothing.

What it answers: at a given load, which worker composition would the best possible controller
hold, and what does the cache manager add there? The conversation preset's highest rate (×4.7)
is the case in point: if no mixed pool beats all-CP2 there, no controller can beat the
``homo_cp2`` baseline (the same J on all-CP2) by composition, whatever it does.

Each pool runs the same trace, profile (Ê fitted on the sim backend, κ measured on the trace, as
``vertumnus simulate`` does without ``--profile``), calibrated β / λ and seed as the sweep;
composition held fixed (no controller). Columns: mean / P90 TTFT (s), token-weighted SLO
attainment (%), GPU-seconds of prefill, replications and reclamations.

    .venv/bin/python bench/bench_fixed_pools.py [--trace PATH] [--rate-scale 4.7]
        [--pools 20CP2,18CP2/1CP4,16CP2/2CP4,12CP2/4CP4] [--gpus 40] [--seed 0] [--out DIR]
        [--hardware FILE]

``--hardware``: the simulated model and GPUs (``sim/hardware.py``); the profile is fitted on
them, as ``vertumnus simulate --hardware`` does.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.controller.lattice import Composition, Lattice  # noqa: E402
from shared.ids import InvalidInput  # noqa: E402
from sim import calibration  # noqa: E402
from sim.experiments import (  # noqa: E402
    Deployment,
    ExperimentSpec,
    oracle_ttfts,
    run_deployment,
    summarize_run,
)
from sim.groundtruth import GroundTruth  # noqa: E402
from sim.hardware import load_ground_truth  # noqa: E402
from sim.runner import load_trace, obtain_trace_profile  # noqa: E402
from sim.workloads import default_traces_dir  # noqa: E402
from sim.workloads.workload import scale_rate  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default=str(default_traces_dir() / "mooncake" /
                                           "conversation_trace.jsonl"))
    ap.add_argument("--format", default="auto")
    ap.add_argument("--rate-scale", type=float, default=4.7)
    ap.add_argument("--pools", default="20CP2,18CP2/1CP4,16CP2/2CP4,12CP2/4CP4")
    ap.add_argument("--gpus", type=int, default=40)
    ap.add_argument("--degrees", default="2,4")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None,
                    help="where the profile is cached (default: a temporary folder)")
    ap.add_argument("--hardware", type=Path, default=None,
                    help="simulated model and GPUs, a .json or .toml file (sim/hardware.py)")
    args = ap.parse_args(argv)
    try:
        degrees = tuple(sorted(int(x) for x in args.degrees.split(",") if x))
        lattice = Lattice(args.gpus, degrees)
        pools = [Composition.parse(lattice, p) for p in args.pools.split(",") if p]
        wl0 = load_trace(args.trace, args.format, seed=args.seed, rate=None, max_requests=None)
        truth = GroundTruth() if args.hardware is None else load_ground_truth(args.hardware)
    except (InvalidInput, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = args.out or Path(tempfile.mkdtemp(prefix="vtm-fixed-"))
    profile, _ = obtain_trace_profile(out, degrees, args.seed, wl0, truth)
    # κ measured on the trace is already a pooled capacity (sim/runner.py run_simulate).
    spec = ExperimentSpec(gpus=args.gpus, degrees=degrees, seed=args.seed, kappa_scale=1.0)
    wl = scale_rate(wl0, args.rate_scale) if args.rate_scale != 1.0 else wl0
    oracle = oracle_ttfts(wl, truth, degrees)
    print(f"{wl0.name} ×{args.rate_scale:g}: {len(wl)} requests, {args.gpus} {truth.gpu.name} "
          f"GPUs, J with "
          f"β {calibration.BETA} / λ {calibration.LAM} / busy power {calibration.BETA_BUSY_POWER}, "
          f"seed {args.seed}")
    print(f"{'pool':<14} {'cache mgr':<9} {'mean s':>8} {'P90 s':>8} {'SLO %':>6} "
          f"{'GPU-s':>9} {'repl':>5} {'recl':>5} {'wall s':>7}")
    for comp in pools:
        for cm in (False, True):
            dep = Deployment(comp.describe(), "vertumnus", comp, adaptive=False,
                             cache_manager=cm, params=calibration.policy_params("vertumnus"))
            t0 = time.perf_counter()
            res = run_deployment(wl, dep, profile, spec, truth)
            wall = time.perf_counter() - t0
            r = summarize_run(res, policy=comp.describe(), rate_scale=args.rate_scale,
                              slo=spec.slo, oracle=oracle, wall_s=wall)
            print(f"{comp.describe():<14} {'on' if cm else 'off':<9} {r['mean_ttft_s']:>8.3f} "
                  f"{r['p90_ttft_s']:>8.2f} {100 * r['slo_attainment']:>6.1f} "
                  f"{r['gpu_seconds']:>9.0f} {r['replications']:>5} {r['reclamations']:>5} "
                  f"{wall:>7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
