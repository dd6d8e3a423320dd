"""Speed of the discrete-event simulator: simulated requests per wall second. Prints figures.

Runs the Mooncake conversation trace at a rate scale (default 2) through
:func:`sim.experiments.run_deployment` for each policy (default ``vertumnus`` and ``homo``) on
the experiment spec's cluster (40 GPUs), with the profile :func:`sim.runner.sweep_profile` gives
at seed 0 -- what ``vertumnus simulate --gpus 40 --degrees 2,4`` does for one (policy, rate)
cell (Ê fitted on the sim backend, κ measured on the trace by a routed pool, as ``simulate``
does without ``--profile``). Prints requests per wall second (best of ``--repeat`` runs, and
every run), and a digest of the result rows so a speed change can be checked to leave the
results bit-identical. The process CPU time of each run is printed too (the machine may be
shared: CPU seconds are less sensitive to other load than wall seconds). Each run starts from a
collected heap, and the full garbage collection after it is timed as well ("with the collection
of its garbage"): garbage a run leaves behind (reference cycles) is paid at the next collection,
i.e. by whatever a sweep does next, so a run that leaves less is faster end to end even where
its own timed region is not.

    .venv/bin/python bench/bench_sim.py [TRACE] [--rate-scale 2] [--policies vertumnus homo]
        [--repeat 1] [--max-requests N] [--profile] [--rows FILE] [--pull-credit-blocks N]
        [--pull-demote/--no-pull-demote] [--pull-wait/--no-pull-wait]

``--profile`` runs each policy once more under cProfile and prints the top 20 functions by
internal time (and by cumulative time). ``--rows FILE`` writes the full result rows (without the
wall-clock fields) as JSON, for a before/after comparison. No assertion anywhere: speed is
reported, not tested.

Before/after in one run, under the same load: ``--against DIR`` times this checkout and the
checkout at ``DIR`` (e.g. an unpacked ``git archive`` of the old commit) alternately, each side
in its own child process (``--root``: which checkout's ``sim`` / ``services`` / ``shared`` are
imported), ``--repeat`` rounds, and prints both sides' best times, the speed-up ratios and
whether the digests agree::

    git archive HEAD~1 | tar -x -C /tmp/old && .venv/bin/python bench/bench_sim.py \
        --against /tmp/old --repeat 3
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import io
import json
import pstats
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any


def _root_from_argv(argv: list[str]) -> Path:
    """The checkout to import the simulator from (``--root DIR``; default: this one). Read
    before the imports below, which is why it is not left to argparse."""
    for i, a in enumerate(argv):
        if a == "--root" and i + 1 < len(argv):
            return Path(argv[i + 1]).resolve()
        if a.startswith("--root="):
            return Path(a.split("=", 1)[1]).resolve()
    return Path(__file__).resolve().parents[1]


ROOT = _root_from_argv(sys.argv[1:])
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from services.controller.lattice import Lattice  # noqa: E402
from sim.experiments import (  # noqa: E402
    ExperimentSpec,
    deployment_for,
    historical_composition,
    oracle_ttfts,
    run_deployment,
    summarize_run,
)
from sim.profiling import run_profile  # noqa: E402
from sim.simulator import SimResult  # noqa: E402
from sim.workloads import load_workload  # noqa: E402
from sim.workloads.workload import scale_rate, truncate  # noqa: E402

DEFAULT_TRACE = Path("/work/shared/data/traces/mooncake/conversation_trace.jsonl")
_WALL_KEYS = ("wall_s", "sim_requests_per_wall_s")


def records_digest(res: SimResult) -> str:
    """SHA-256 over every request record (all fields, floats by repr): bit-identical check."""
    h = hashlib.sha256()
    for r in res.records:
        h.update(repr((r.request_id, r.arrival_s, r.input_len, r.worker, r.degree,
                       r.reused_tokens, r.predicted_s, r.actual_s, r.start_s, r.finish_s,
                       r.ttft_s, r.redirected, r.failed)).encode())
    for rc in res.reconfigurations:
        h.update(repr((rc.kind, rc.sources, rc.targets, rc.decided_s, rc.reason, rc.rid,
                       rc.drained_s, rc.exposed_s)).encode())
    h.update(repr((res.composition_timeline, res.gpu_seconds, res.replications,
                   res.reclamations, res.reconcile_transfers, res.end_s)).encode())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", nargs="?", default=str(DEFAULT_TRACE))
    ap.add_argument("--rate-scale", type=float, default=2.0)
    ap.add_argument("--policies", nargs="+", default=["vertumnus", "homo"])
    ap.add_argument("--gpus", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=1, help="timed runs per policy (best reported)")
    ap.add_argument("--max-requests", type=int, default=None)
    ap.add_argument("--pull-credit-blocks", type=int, default=None,
                    help="J's pull credit for the J pools (default: the calibrated one)")
    ap.add_argument("--pull-demote", action=argparse.BooleanOptionalAction, default=None,
                    help="a landed pull demotes the source's copy, the pull a move (default: "
                    "the calibrated setting, on)")
    ap.add_argument("--pull-wait", action=argparse.BooleanOptionalAction, default=None,
                    help="a request J counted a pull for waits for it (default: the calibrated "
                    "setting, on)")
    ap.add_argument("--profile", action="store_true", help="cProfile top 20 per policy")
    ap.add_argument("--rows", type=Path, default=None,
                    help="write the result rows (no wall-clock fields) and digests as JSON")
    ap.add_argument("--root", type=Path, default=None,
                    help="import the simulator from this checkout (default: this one)")
    ap.add_argument("--against", type=Path, default=None,
                    help="time this checkout and the one at DIR alternately; print ratios")
    ap.add_argument("--json-lines", action="store_true",
                    help="print one JSON object per policy (used by --against)")
    args = ap.parse_args(argv)
    if args.against is not None:
        return _against(args)

    t0 = time.perf_counter()
    wl = load_workload(args.trace, seed=0)
    if args.max_requests:
        wl = truncate(wl, max_requests=args.max_requests)
    spec = ExperimentSpec(gpus=args.gpus)
    with tempfile.TemporaryDirectory() as tmp:
        profile, kappa_note = _profile(Path(tmp), wl, spec)
    if hasattr(profile, "capacity_scale"):  # as run_simulate: a pooled κ is judged as it is
        spec = replace(spec, kappa_scale=profile.capacity_scale(spec.kappa_scale))
    if args.rate_scale != 1.0:
        wl = scale_rate(wl, args.rate_scale)
    if args.pull_credit_blocks is not None:
        spec = replace(spec, pull_credit_blocks=args.pull_credit_blocks)
    if args.pull_demote is not None and spec.pull is not None:
        spec = replace(spec, pull=replace(spec.pull, demote_source=args.pull_demote))
    if args.pull_wait is not None:
        if not hasattr(spec, "pull_wait"):  # an older checkout (--root / --against)
            raise SystemExit("--pull-wait: this checkout's simulator has no wait")
        spec = replace(spec, pull_wait=args.pull_wait)
    lattice = Lattice(spec.gpus, spec.degrees, gpus_per_node=spec.gpus_per_node)
    # As sim.experiments.sweep does: the initial composition is judged with the controller's
    # profile (κ scaled), when this version of the simulator has one.
    comp_profile = profile
    if hasattr(spec, "kappa_scale"):
        from sim.simulator import controller_profile

        comp_profile = controller_profile(profile, spec.kappa_scale)
    initial = historical_composition(lattice, comp_profile, wl, spec.window_s)
    print(f"workload {wl.name}: {len(wl.requests)} requests, rate scale {args.rate_scale}, "
          f"{spec.gpus} GPUs; {kappa_note}; set-up {time.perf_counter() - t0:.2f} s")

    out_rows: dict[str, Any] = {}
    for pol in args.policies:
        dep = deployment_for(pol, lattice, initial, spec)
        walls: list[float] = []
        cpus: list[float] = []
        cleanups: list[float] = []
        res: SimResult | None = None
        for _ in range(max(1, args.repeat)):
            # Each run starts from a collected heap, so no earlier garbage is charged to it.
            res = None
            gc.collect()
            t1, c1 = time.perf_counter(), time.process_time()
            res = run_deployment(wl, dep, profile, spec)
            walls.append(time.perf_counter() - t1)
            cpus.append(time.process_time() - c1)
            # The garbage the run left (e.g. reference cycles) costs a sweep wall time at its
            # next collection: timed here as a full collection right after the run (the
            # result, still referenced, is not garbage; nothing has allocated in between, so
            # no automatic collection took the garbage first).
            t2 = time.perf_counter()
            gc.collect()
            cleanups.append(time.perf_counter() - t2)
        assert res is not None
        facts = (len(res.records), records_digest(res), res.replications, res.reclamations,
                 len(res.reconfigurations))
        n, digest, n_rep, n_recl, n_reconf = facts
        best = min(walls)
        best_all = min(w + c for w, c in zip(walls, cleanups, strict=True))
        if args.json_lines:
            print(json.dumps({"policy": pol, "requests": n, "walls": walls, "cpus": cpus,
                              "cleanups": cleanups, "digest": digest}), flush=True)
            continue
        print(f"{pol:>10}: {n} requests, best {best:.3f} s = {n / best:,.0f} req/wall-s "
              f"(runs: {', '.join(f'{w:.3f}' for w in walls)}; CPU s: "
              f"{', '.join(f'{c:.3f}' for c in cpus)}); with the collection of its garbage "
              f"{best_all:.3f} s = {n / best_all:,.0f} req/wall-s (collections: "
              f"{', '.join(f'{c:.3f}' for c in cleanups)}); "
              f"digest {digest}; replications {n_rep}, "
              f"reclamations {n_recl}, reconfigurations {n_reconf}")
        if args.rows is not None:
            oracle = oracle_ttfts(wl, profile_truth(), spec.degrees)
            row = summarize_run(res, policy=pol, rate_scale=args.rate_scale, slo=spec.slo,
                                oracle=oracle, wall_s=best)
            for k in _WALL_KEYS:
                row.pop(k, None)
            out_rows[pol] = {"row": row, "digest": records_digest(res)}
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            run_deployment(wl, dep, profile, spec)
            pr.disable()
            for key in ("tottime", "cumulative"):
                buf = io.StringIO()
                pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(20)
                print(f"--- cProfile {pol}, top 20 by {key}")
                print("\n".join(buf.getvalue().splitlines()[4:]))
    if args.rows is not None:
        args.rows.write_text(json.dumps(out_rows, indent=1, sort_keys=True, default=str))
        print(f"rows written to {args.rows}")
    return 0


def _against(args: argparse.Namespace) -> int:
    """``--against DIR``: alternate child runs of both checkouts; best of each, and ratios."""
    import subprocess

    here = Path(__file__).resolve().parents[1]
    sides = {"this": here, "against": args.against.resolve()}
    base = [sys.executable, str(Path(__file__).resolve()), args.trace, "--rate-scale",
            str(args.rate_scale), "--gpus", str(args.gpus), "--policies", *args.policies,
            "--json-lines"]
    if args.max_requests:
        base += ["--max-requests", str(args.max_requests)]
    if args.pull_credit_blocks is not None:
        base += ["--pull-credit-blocks", str(args.pull_credit_blocks)]
    for flag, v in (("pull-demote", args.pull_demote), ("pull-wait", args.pull_wait)):
        if v is not None:
            base += [f"--{flag}" if v else f"--no-{flag}"]
    runs: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in sides}
    for rnd in range(max(1, args.repeat)):
        # Alternate which side goes first, so a load trend does not favour one side.
        order = list(sides) if rnd % 2 == 0 else list(reversed(sides))
        for side in order:
            out = subprocess.run(base + ["--root", str(sides[side])], capture_output=True,
                                 text=True, check=True).stdout
            for line in out.splitlines():
                if not line.startswith("{"):
                    continue
                r = json.loads(line)
                acc = runs[side].setdefault(r["policy"], {"walls": [], "cpus": [],
                                                          "totals": []})
                acc["walls"] += r["walls"]
                acc["cpus"] += r["cpus"]
                # (a checkout whose bench predates the cleanup timing reports none: 0)
                acc["totals"] += [w + c for w, c in zip(
                    r["walls"], r.get("cleanups", [0.0] * len(r["walls"])), strict=True)]
                acc["requests"], acc["digest"] = r["requests"], r["digest"]
    print(f"this = {sides['this']}, against = {sides['against']}; {args.repeat} alternating "
          f"rounds, best of each side")
    for pol in args.policies:
        a, b = runs["this"][pol], runs["against"][pol]
        n = a["requests"]
        wa, wb, ca, cb = min(a["walls"]), min(b["walls"]), min(a["cpus"]), min(b["cpus"])
        same = "identical" if a["digest"] == b["digest"] else "DIFFERENT"
        ta, tb = min(a["totals"]), min(b["totals"])
        print(f"{pol:>10}: this {n / wa:,.0f} req/wall-s ({wa:.3f} s, CPU {ca:.3f} s) | "
              f"against {n / wb:,.0f} req/wall-s ({wb:.3f} s, CPU {cb:.3f} s) | speed-up "
              f"{wb / wa:.2f}x wall, {cb / ca:.2f}x CPU | with the collection of each run's "
              f"garbage: this {ta:.3f} s, against {tb:.3f} s, {tb / ta:.2f}x | "
              f"digests {same}")
    return 0


def _profile(tmp: Path, wl: Any, spec: ExperimentSpec) -> tuple[Any, str]:
    """The profile ``vertumnus simulate --trace … --gpus N`` uses without ``--profile``: Ê fitted
    on the sim backend, κ measured on the (unscaled) trace by a routed pool
    (``sim.runner.sweep_profile``; the caller judges it with the profile's own capacity
    scale, 1.0 for that pooled κ). A checkout from before trace κ (``--root``) gets the
    single-worker profile of ``run_profile`` instead, as ``simulate`` did then. Returns
    (profile, a note naming κ's source)."""
    try:
        from sim.runner import sweep_profile
    except ImportError:
        return run_profile(tmp, degrees=(1, 2, 4), seed=0)[0], "single-worker κ"
    prof, _ = sweep_profile(None, tmp, spec.degrees, 0, wl, profile_truth(), gpus=spec.gpus)
    return prof, "κ on the trace"


def profile_truth():
    from sim.groundtruth import GroundTruth

    return GroundTruth()


if __name__ == "__main__":
    raise SystemExit(main())
