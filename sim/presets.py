"""§9.3 and §9.4 experiments as presets: reconfiguration under phases, and the cache ablation.

``reconfig`` (§9.3): alternating high-rate short-request phases and low-rate long-request
phases (synthetic, Qwen3 ground truth, 40 GPUs, degrees {2, 4} by default, or {2, 4, 8} or §9.3's
{4, 8}); Vertumnus with its controller against two fixed compositions — one with more
small-degree workers, one with more large (:data:`RECONFIG_FIXED`, or the caller's) — run with
the same scheduler and cache manager. Reports mean TTFT per phase, the composition
over time, each split / merge with its drain and switch times (and their min / median / max
per kind; each operation in ``reconfig.json`` names its ``trigger``, the controller rule that
decided it), and how many windows after a phase change the composition first moved.

``ablation`` (§9.4): a fixed composition, the full cache manager against the variant without
replication and reclamation (worker-local LRU caches only), with per-GPU caches small enough for
eviction to matter, at rising rates. The paper's ablation trace (Mooncake Tool-Agent, recurring
system and tool prefixes) is not shipped, so the default workload is a synthetic stand-in for
its shape (:data:`~sim.workloads.synthetic.TOOL_AGENT_SHAPED`) at ×2-×4.5 (the fixed
8CP2/6CP4 pool meets the SLO for 99% of tokens at ×2 and 49% at ×4.5, past saturation).
``run(..., workload=..., rate_scales=...)`` (the CLI's ``--preset ablation --trace PATH
--rate-scale …``) runs it on any workload: the Tool-Agent trace once downloaded (Mooncake
format), the conversation trace (re-reads minutes apart: replication has little to act on, and
the two variants tie), or any synthetic workload file.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Final

import numpy as np

from services.controller.config_file import config_to_mapping
from services.controller.lattice import Composition, Lattice
from services.controller.planner import ControllerConfig
from shared.ids import InvalidInput
from shared.worker import GpuGroup
from sim import calibration
from sim.experiments import (
    Deployment,
    ExperimentSpec,
    oracle_ttfts,
    run_deployment,
    summarize_run,
)
from sim.groundtruth import GroundTruth
from sim.hardware import ground_truth_to_mapping
from sim.metrics import QWEN3_SLO, SloTable, slo_to_dict
from sim.runner import _jsonable, controller_overrides, obtain_profile, write_outputs
from sim.workloads import generate
from sim.workloads.synthetic import (
    TOOL_AGENT_NAME,
    TOOL_AGENT_SHAPED,
    Phase,
    SyntheticConfig,
)
from sim.workloads.workload import Workload, scale_rate, truncate

RECONFIG_PHASES: tuple[Phase, ...] = (
    Phase(300.0, 1.0, 0.05),  # S1 moderate, mixed
    Phase(300.0, 2.2, 0.01),  # S2 high-rate, short-dominated: needs concurrency (split)
    Phase(300.0, 0.45, 0.30),  # S3 low-rate, long-heavy: needs parallelism (merge)
    Phase(300.0, 2.2, 0.01),  # S4 high again
    Phase(300.0, 0.45, 0.30),  # S5 low, long again
)


def descriptions() -> dict[str, str]:
    return {
        "reconfig": "§9.3: phases of high-rate short / low-rate long load; Vertumnus vs two "
        "fixed compositions (40 GPUs, {2,4}; --degrees 2,4,8 or 4,8, --fixed and --rate "
        "choose others)",
        "ablation": "§9.4: fixed composition, cache manager on vs off, small caches, a "
        "Tool-Agent-shaped synthetic workload at rising rates (--trace, --rate-scale, "
        "--cache-blocks-per-gpu choose others)",
    }


ABLATION_OPTIONS: Final = ("workload", "rate_scales", "cache_blocks_per_gpu")
"""What ``ablation`` lets a caller choose (the rest is the experiment's)."""

RECONFIG_OPTIONS: Final = ("degrees", "fixed", "base_rate")
"""What ``reconfig`` lets a caller choose: the lattice's degrees, the two fixed compositions
(:func:`reconfig_fixed`) and the base rate (:func:`reconfig_base_rate`); its phases are its
workload, on 40 GPUs."""

RECONFIG_RATE: Final[dict[tuple[int, ...], float]] = {(2, 4): 24.0, (2, 4, 8): 24.0,
                                                      (4, 8): 14.0}
"""The base rate (req/s at the phases' multiplier 1) per degree set: where the high-rate
phases overload the fixed pool with fewer, larger workers and leave the other one near its
capacity, as §9.3 sets it up ("insufficient concurrency when short requests dominate").
{2, 4}: the calibrated preset (seed 0, S2: 12CP2/4CP4 0.40 s, 4CP2/8CP4 9.7 s). {4, 8},
seeds 0-3 (docs/evaluation.md "The reconfiguration preset on other lattices"): at 12 req/s
neither fixed pool is loaded in S2 (6CP4/2CP8 0.38-0.40 s, as in S1, 4CP4/3CP8 0.49-0.50 s)
and the controller splits only after 4-9 windows; at 16 both collapse (2.7-8.0 s); at 14
6CP4/2CP8 runs at 0.55-0.96 s and 4CP4/3CP8 at 4.0-5.7 s. Other degree sets:
:data:`RECONFIG_RATE_PER_SMALLEST` over the smallest degree, which bounds how many workers a
pool can run at once."""

RECONFIG_RATE_PER_SMALLEST: Final[float] = 48.0
"""The base rate times the smallest degree for a degree set :data:`RECONFIG_RATE` does not
list (24 req/s with a smallest degree of 2)."""


def reconfig_base_rate(degrees: Sequence[int], rate: float | None = None) -> float:
    """The reconfiguration preset's base rate: ``rate`` when given (a finite number > 0),
    else :data:`RECONFIG_RATE`'s for the (sorted) ``degrees``, or
    :data:`RECONFIG_RATE_PER_SMALLEST` over the smallest of them. Raises
    :class:`InvalidInput` for a bad rate."""
    if rate is not None:
        if isinstance(rate, bool) or not isinstance(rate, int | float) \
                or not math.isfinite(rate) or rate <= 0:
            raise InvalidInput(f"rate must be a finite number of requests/s > 0, got {rate!r}")
        return float(rate)
    degs = tuple(sorted(degrees))
    return RECONFIG_RATE.get(degs, RECONFIG_RATE_PER_SMALLEST / min(degs))

RECONFIG_GPUS: Final[int] = 40

RECONFIG_FIXED: Final[dict[tuple[int, ...], tuple[str, str]]] = {
    # 60% / 20% of the GPUs in CP2 workers; the calibrated preset since session 1.
    (2, 4): ("12CP2/4CP4", "4CP2/8CP4"),
    # The same shape over three degrees: 60/20/20% and 20/40/40% of the GPUs by degree.
    (2, 4, 8): ("12CP2/2CP4/1CP8", "4CP2/4CP4/2CP8"),
    # §9.3's own pair (DeepSeek-V4-Flash on 40 GPUs, degrees {4, 8}).
    (4, 8): ("6CP4/2CP8", "4CP4/3CP8"),
}
"""The reconfiguration preset's two fixed compositions per degree set, the one with more
smaller-degree workers first (the adaptive pool starts from it): what ``--fixed`` defaults
to."""


def reconfig_fixed(degrees: Sequence[int],
                   fixed: Sequence[str] | None = None) -> tuple[tuple[int, ...], tuple[str, str]]:
    """(sorted degrees, the two fixed compositions as canonical labels) for the
    reconfiguration preset on :data:`RECONFIG_GPUS` GPUs. ``fixed`` None: the pair of
    :data:`RECONFIG_FIXED` for ``degrees``. Raises :class:`InvalidInput` for degrees the
    lattice refuses, a degree set without a default pair and no ``fixed``, or a ``fixed``
    that is not two distinct compositions of that lattice (each naming the problem)."""
    if isinstance(degrees, str | bytes) or not isinstance(degrees, Sequence) or not degrees:
        raise InvalidInput(f"degrees must be a non-empty sequence of ints, got {degrees!r}")
    lattice = Lattice(RECONFIG_GPUS, tuple(degrees))  # raises for a bad degree
    degs = tuple(lattice.sorted_degrees)
    if fixed is None:
        pair = RECONFIG_FIXED.get(degs)
        if pair is None:
            known = "; ".join(f"{','.join(map(str, d))}: {' and '.join(p)}"
                              for d, p in RECONFIG_FIXED.items())
            raise InvalidInput(f"no default fixed compositions for degrees "
                               f"{','.join(map(str, degs))}; name two (--fixed A,B). "
                               f"Defaults: {known}")
        fixed = pair
    if isinstance(fixed, str | bytes) or not isinstance(fixed, Sequence) or len(fixed) != 2:
        raise InvalidInput(f"fixed compositions (--fixed): want two, got {fixed!r}")
    labels = []
    for text in fixed:
        try:
            labels.append(str(Composition.parse(lattice, text)))
        except InvalidInput as exc:
            raise InvalidInput(f"fixed composition (--fixed) {text!r}: {exc}") from None
    if labels[0] == labels[1]:
        raise InvalidInput(f"the two fixed compositions (--fixed) are the same ({labels[0]})")
    return degs, (labels[0], labels[1])


def run(name: str, *, out: Path, seed: int = 0, progress: bool = False,
        truth: GroundTruth | None = None, per_degree: bool = False,
        slo: SloTable = QWEN3_SLO, controller: ControllerConfig | None = None,
        pending_credit: bool | None = None, **options: Any) -> dict[str, Any]:
    """Run the preset ``name``; ``truth``: the simulated hardware (default: the note's);
    ``per_degree``: the profile fits one coefficient set per degree; ``slo``: the TTFT
    deadlines (attainment, and the κ the profile measures). ``options`` (None = the preset's
    own): for ``ablation`` :data:`ABLATION_OPTIONS`, ``workload`` (default: the
    Tool-Agent-shaped synthetic workload), ``rate_scales``, ``cache_blocks_per_gpu``;
    ``reconfig`` takes :data:`RECONFIG_OPTIONS`: ``degrees`` (default {2, 4}), ``fixed``
    (its two fixed compositions; default: :data:`RECONFIG_FIXED`'s pair for the degrees) and
    ``base_rate`` (default: :func:`reconfig_base_rate`'s for the degrees).
    ``controller`` (``reconfig`` only; None: the calibrated thresholds): the adaptive pool's
    controller setting. ``pending_credit`` (``reconfig`` only; None: the calibrated setting):
    J's credit of a prefix pending after a split or merge (``SimConfig.pending_credit``).
    Raises :class:`InvalidInput` for an option the preset does not take."""
    if controller is not None and name != "reconfig":
        raise InvalidInput(f"preset {name!r} does not take a controller setting")
    if pending_credit is not None and name != "reconfig":
        raise InvalidInput(f"preset {name!r} does not take a pending credit setting")
    given = {k: v for k, v in options.items() if v is not None}
    allowed = {"ablation": ABLATION_OPTIONS, "reconfig": RECONFIG_OPTIONS}.get(name, ())
    extra = sorted(set(given) - set(allowed))
    if extra and name in ("reconfig", "ablation"):
        raise InvalidInput(f"preset {name!r} does not take {', '.join(extra)}")
    if name == "reconfig":
        degs, fixed = reconfig_fixed(given.get("degrees", (2, 4)), given.get("fixed"))
        return run_reconfig(out=out, seed=seed, progress=progress, truth=truth,
                            per_degree=per_degree, slo=slo, controller=controller,
                            pending_credit=pending_credit, degrees=degs, fixed=fixed,
                            base_rate=reconfig_base_rate(degs, given.get("base_rate")))
    if name == "ablation":
        return run_ablation(out=out, seed=seed, progress=progress, truth=truth,
                            per_degree=per_degree, slo=slo, **given)
    raise InvalidInput(f"unknown preset {name!r}; known: conversation, leval, azure-code, "
                       "reconfig, ablation")


def _phase_bounds(phases: Sequence[Phase], duration: float) -> list[tuple[float, float]]:
    out, t, i = [], 0.0, 0
    while t < duration:
        p = phases[i % len(phases)]
        out.append((t, min(duration, t + p.duration_s)))
        t += p.duration_s
        i += 1
    return out


def run_reconfig(*, out: Path, seed: int = 0, progress: bool = False,
                 base_rate: float = 24.0, gpus: int = RECONFIG_GPUS,
                 degrees: tuple[int, ...] = (2, 4),
                 fixed: tuple[str, str] = RECONFIG_FIXED[(2, 4)],
                 truth: GroundTruth | None = None,
                 per_degree: bool = False, slo: SloTable = QWEN3_SLO,
                 controller: ControllerConfig | None = None,
                 pending_credit: bool | None = None) -> dict[str, Any]:
    ctl = controller_overrides(controller)
    if pending_credit is not None:
        ctl["pending_credit"] = pending_credit
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    duration = sum(p.duration_s for p in RECONFIG_PHASES)
    wl = generate(SyntheticConfig(duration_s=duration, rate=base_rate, phases=RECONFIG_PHASES),
                  seed=seed, name="reconfig-phases")
    truth = truth or GroundTruth()
    prof = obtain_profile(None, out, degrees, seed, truth, per_degree=per_degree, slo=slo)
    spec = ExperimentSpec(gpus=gpus, degrees=degrees, seed=seed, slo=slo, **ctl)
    lattice = Lattice(gpus, degrees)
    bounds = _phase_bounds(RECONFIG_PHASES, duration)
    start = Composition.parse(lattice, fixed[0])
    # The fixed compositions run the same J scheduler with the same calibrated weights: the
    # comparison isolates what the controller's reconfigurations buy.
    jparams = calibration.policy_params("vertumnus")
    runs = [("vertumnus", Deployment("vertumnus", "vertumnus", start, adaptive=True,
                                     cache_manager=True, params=jparams))]
    for f in fixed:
        runs.append((f, Deployment(f, "vertumnus", Composition.parse(lattice, f),
                                   adaptive=False, cache_manager=True, params=jparams)))
    oracle = oracle_ttfts(wl, truth, degrees)
    rows, phases_out, timelines, reconfs = [], {}, {}, []
    for label, dep in runs:
        t0 = time.perf_counter()
        res = run_deployment(wl, dep, prof, spec, truth)
        row = summarize_run(res, policy=label, rate_scale=1.0, slo=spec.slo, oracle=oracle,
                            wall_s=time.perf_counter() - t0)
        rows.append(row)
        per = []
        for a, b in bounds:
            sel = [r.ttft_s for r in res.records if a <= r.arrival_s < b and r.ttft_s >= 0]
            per.append(float(np.mean(sel)) if sel else math.nan)
        phases_out[label] = per
        tl = [[t, {str(k): v for k, v in c.items()}] for t, c in res.composition_timeline]
        if res.end_s > tl[-1][0]:  # the composition held until the run's end (as a sweep's)
            tl.append([res.end_s, dict(tl[-1][1])])
        timelines[label] = tl
        if label == "vertumnus":
            reconfs = [
                {"kind": rc.kind, "sources": rc.sources, "targets": rc.targets,
                 "decided_s": rc.decided_s, "drain_s": rc.drain_s, "switch_s": rc.switch_s,
                 "reason": rc.reason, "trigger": rc.trigger}
                for rc in res.reconfigurations if rc.exposed_s >= 0
            ]
    window = spec.window_s
    # Windows from a phase change to the first reconfiguration decided in the new phase (a
    # decision at the change itself closed the previous phase's last window, so it does not
    # count), and its kind.
    reaction, reaction_kind = [], []
    for a, _ in bounds[1:]:
        nxt = [rc for rc in reconfs if rc["decided_s"] > a + 1e-9]
        reaction.append(None if not nxt else math.ceil((nxt[0]["decided_s"] - a) / window - 1e-9))
        reaction_kind.append(None if not nxt else nxt[0]["kind"])
    follow = windows_to_follow(bounds, RECONFIG_PHASES, reconfs, start.counts(), window)
    meta = {
        "workload": wl.name, "gpus": gpus, "degrees": list(degrees), "seed": seed,
        "phases": [[p.duration_s, p.rate_multiplier, p.long_share] for p in RECONFIG_PHASES],
        "base_rate": base_rate, "phase_bounds": bounds, "phase_mean_ttft_s": phases_out,
        "timelines": {"1.0": timelines["vertumnus"]}, "all_timelines": timelines,
        "reconfigurations": reconfs, "windows_to_first_reaction": reaction,
        "first_reaction_kind": reaction_kind, "windows_to_follow": follow,
        "drain_switch_s": _drain_switch_summary(reconfs),
        "controller": config_to_mapping(spec.controller),
        "pending_credit": spec.pending_credit,
        "profile": prof.to_dict(),
        "hardware": ground_truth_to_mapping(truth),
        "slo": slo_to_dict(slo),
    }
    comparison = write_outputs(out, rows, meta)
    _plot_phases(out, bounds, phases_out, timelines)
    (out / "reconfig.json").write_text(json.dumps(_jsonable(meta), indent=1) + "\n")
    return {"rows": rows, "meta": meta, "comparison": comparison}


def windows_to_follow(bounds: Sequence[tuple[float, float]], phases: Sequence[Phase],
                      reconfs: Sequence[Mapping[str, Any]], start: Mapping[int, int],
                      window_s: float) -> list[int | None]:
    """Per phase change (phases 2, 3, ...): how many windows the composition took to follow
    the new phase; 0 when it already had at the change, None when it did not within the
    phase or the phase has no direction.

    The direction follows the phase's long share against the phase before it: a lower share
    (short requests at a high rate want concurrency) asks for more workers, a higher one
    (long requests want parallelism) for fewer, larger ones. With n0 workers in ``start``
    (degree -> workers, the pool the preset starts from: the better fixed one) and n1 at the
    change, a phase asking for more is followed once the pool holds more than min(n0, n1),
    one asking for fewer once it holds fewer than max(n0, n1): it is past the start
    composition in the phase's direction, or has moved that way from where it stood. (On
    a fixed number of GPUs with degrees {2, 4} the workers are 10 + n/2 for n CP2 workers on
    40 GPUs, so counting workers is counting CP2 workers; with three degrees only the
    workers count: a CP8 split into two CP4 workers adds concurrency without a CP2.)
    The composition at time t is ``start`` with every operation of ``reconfs`` (the
    ``run_reconfig`` rows: ``decided_s``, worker ids in ``sources`` / ``targets``) decided by
    t applied, as the reaction metric counts decisions.

    Why beside ``windows_to_first_reaction``: that one counts windows to the first operation
    after the change, of any kind, so a pool that a burst in the previous phase had already
    split (the reconfiguration preset's seeds 63 and 191, split 40-80 s into S1) reads as
    not reacting to the next short phase for the whole of it, where it never needed to move.
    A pool that never moves follows no phase here; one that moves the wrong way does not
    follow until it has come back past where it stood."""
    if window_s <= 0 or not math.isfinite(window_s):
        raise InvalidInput(f"window_s must be a finite number > 0, got {window_s!r}")
    if not start:
        raise InvalidInput("start composition has no workers")
    base = sum(start.values())
    ops = sorted(reconfs, key=lambda rc: float(rc["decided_s"]))
    out: list[int | None] = []
    for i in range(1, min(len(bounds), len(phases))):
        a, b = bounds[i]
        prev_share = phases[i - 1].long_share
        share = phases[i].long_share
        if prev_share is None or share is None or share == prev_share:
            out.append(None)
            continue
        more = share < prev_share
        count = base
        k = 0
        while k < len(ops) and float(ops[k]["decided_s"]) <= a + 1e-9:
            count += _workers_added(ops[k])
            k += 1
        # count is n1 here; the bar is fixed for the whole phase.
        bar = min(base, count) if more else max(base, count)
        if (count > bar) if more else (count < bar):
            out.append(0)
            continue
        got: int | None = None
        for rc in ops[k:]:
            t = float(rc["decided_s"])
            if t >= b:
                break
            count += _workers_added(rc)
            if (count > bar) if more else (count < bar):
                got = math.ceil((t - a) / window_s - 1e-9)
                break
        out.append(got)
    return out


def _workers_added(rc: Mapping[str, Any]) -> int:
    """Workers an operation row adds (its targets) less those it retires (its sources);
    raises InvalidInput on a worker id that is not a lattice worker's."""
    def n(ids: Sequence[str]) -> int:
        for w in ids:
            GpuGroup.from_worker_id(w)  # the check: raises on a malformed id
        return len(ids)
    return n(rc["targets"]) - n(rc["sources"])


def _drain_switch_summary(reconfs: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per kind (split / merge): how many, and min / median / max of drain and switch times."""
    out: dict[str, dict[str, Any]] = {}
    for kind in ("split", "merge"):
        rows = [r for r in reconfs if r["kind"] == kind]
        entry: dict[str, Any] = {"n": len(rows)}
        for key in ("drain_s", "switch_s"):
            xs = [float(r[key]) for r in rows]
            entry[key] = ([float(np.min(xs)), float(np.median(xs)), float(np.max(xs))]
                          if xs else None)
        out[kind] = entry
    return out


def _plot_phases(out: Path, bounds: list[tuple[float, float]], per: dict[str, list[float]],
                 timelines: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for label, tl in timelines.items():
        if label != "vertumnus":
            continue
        # Degrees as numbers: the keys are strings (as meta.json holds them), and "16"
        # sorts before "2" as a string, which put CP16 first in the legend and the colours.
        for d in sorted({k for _, c in tl for k in c}, key=int):
            xs, ys = [], []
            for t, c in tl:
                if ys:
                    xs.append(t)
                    ys.append(ys[-1])
                xs.append(t)
                ys.append(c.get(d, 0))
            ax1.plot(xs, ys, label=f"CP{d} workers")
    ax1.set_ylabel("Workers")
    ax1.legend(fontsize=7)
    ax1.grid(alpha=0.3)
    mids = [(a + b) / 2 for a, b in bounds]
    for label, vals in per.items():
        ax2.plot(mids, vals, marker="o", label=label)
    for a, _ in bounds:
        ax1.axvline(a, color="grey", lw=0.5)
        ax2.axvline(a, color="grey", lw=0.5)
    ax2.set_ylabel("Mean TTFT per phase (s)")
    ax2.set_xlabel("Time (s)")
    ax2.legend(fontsize=7)
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "reconfig.png", dpi=110)
    plt.close(fig)


ABLATION_RATE_SCALES: Final[tuple[float, ...]] = (2.0, 3.0, 3.5, 4.0, 4.5)
"""The default workload's rates: from 99% SLO attainment down to saturation (49% at ×4.5)."""


def ablation_workload(*, seed: int = 0, rate: float | None = None,
                      max_requests: int | None = None) -> Workload:
    """The ablation's default workload, :data:`TOOL_AGENT_SHAPED` for ``seed`` (``rate``:
    its base rate instead of 10 req/s; ``max_requests``: only the first N)."""
    cfg = TOOL_AGENT_SHAPED if rate is None else replace(TOOL_AGENT_SHAPED, rate=rate)
    wl = generate(cfg, seed=seed, name=TOOL_AGENT_NAME)
    return truncate(wl, max_requests=max_requests) if max_requests else wl


def run_ablation(*, out: Path, seed: int = 0, progress: bool = False,
                 rate_scales: Sequence[float] = ABLATION_RATE_SCALES,
                 cache_blocks_per_gpu: int = 200, composition: str = "8CP2/6CP4",
                 workload: Workload | None = None,
                 truth: GroundTruth | None = None,
                 per_degree: bool = False, slo: SloTable = QWEN3_SLO) -> dict[str, Any]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    wl = workload or ablation_workload(seed=seed)
    degrees = (2, 4)
    truth = truth or GroundTruth()
    prof = obtain_profile(None, out, degrees, seed, truth, per_degree=per_degree, slo=slo)
    spec = ExperimentSpec(gpus=40, degrees=degrees, seed=seed, slo=slo,
                          cache_blocks_per_gpu=cache_blocks_per_gpu)
    lattice = Lattice(40, degrees)
    comp = Composition.parse(lattice, composition)
    rows = []
    for scale in rate_scales:
        w = scale_rate(wl, scale) if scale != 1.0 else wl
        oracle = oracle_ttfts(w, truth, degrees)
        for label, cm in (("full", True), ("no_replication", False)):
            # Both variants are Vertumnus's scheduler with its calibrated weights (§9.4: "the
            # same request scheduler"); only the cache manager differs.
            dep = Deployment(label, "vertumnus", comp, adaptive=False, cache_manager=cm,
                             params=calibration.policy_params("vertumnus"))
            t0 = time.perf_counter()
            res = run_deployment(w, dep, prof, spec, truth)
            rows.append(summarize_run(res, policy=label, rate_scale=scale, slo=spec.slo,
                                      oracle=oracle, wall_s=time.perf_counter() - t0))
    meta = {"workload": wl.name, "gpus": 40, "degrees": list(degrees), "seed": seed,
            "composition": composition, "cache_blocks_per_gpu": cache_blocks_per_gpu,
            "profile": prof.to_dict(), "hardware": ground_truth_to_mapping(truth),
            "slo": slo_to_dict(slo)}
    comparison = write_outputs(out, rows, meta)
    return {"rows": rows, "meta": meta, "comparison": comparison}
