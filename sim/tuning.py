"""The sweep that chooses J's weights β and λ (§5.3) for a trace and a hardware.

``services/calibration.py`` chose ``BETA`` and ``LAM`` this way on the conversation trace and
the default H20: Vertumnus at every (β, λ) of a grid, over a few rates, the same trace, profile,
cluster and seed. On other hardware the weights can matter where they did not there
(docs/evaluation.md: on H200, λ = 0.25 keeps requests off CP4 workers that cost twice the GPU
time at light load); ``vertumnus tune`` runs the same sweep there.

The best pair has the lowest mean TTFT averaged over the rates; ties go to the lower averaged
P90, then the smaller β, then the smaller λ. Each cell is :func:`sim.experiments.sweep` for
``vertumnus`` alone (its controller on, its initial composition per rate), so a cell here is
the cell ``vertumnus simulate`` would run with ``--beta B --lam L``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from statistics import fmean
from typing import Any

from services.scheduler.placement import check_weights
from shared.costmodel import Profile
from shared.ids import InvalidInput
from sim.experiments import ExperimentSpec, combine_repeats, sweep
from sim.groundtruth import GroundTruth
from sim.workloads.workload import Workload

ROW_KEYS: tuple[str, ...] = ("beta", "lam", "rate_scale", "mean_ttft_s", "p90_ttft_s",
                             "p99_ttft_s", "slo_attainment", "gpu_seconds", "reconfigurations")


def tune_weights(
    workload: Workload,
    rate_scales: Sequence[float],
    betas: Sequence[float],
    lams: Sequence[float],
    profile: Profile,
    spec: ExperimentSpec,
    truth: GroundTruth | None = None,
    *,
    jobs: int = 1,
    on_run: Callable[[str, float], None] | None = None,
    more_seeds: Sequence[tuple[int, Workload]] = (),
) -> dict[str, Any]:
    """Vertumnus at every (β, λ) of ``betas`` × ``lams`` and every rate of ``rate_scales``.

    ``more_seeds``: (seed, that seed's workload) pairs run as well as ``spec.seed`` on
    ``workload``; each row is then the mean over the seeds
    (:func:`sim.experiments.combine_repeats`), with ``seeds``.

    Returns ``{"rows": one per (β, λ, rate), "pairs": one per (β, λ) with the averages over
    the rates, best first, "best": {"beta", "lam"}}``. ``on_run(label, rate)`` is called as
    each cell finishes. Raises :class:`InvalidInput` for an empty grid, a weight J does not
    take (β ≥ 1, λ ≥ 0, finite) or a rate that is not > 0. Deterministic for ``spec.seed``.
    """
    if not betas or not lams or not rate_scales:
        raise InvalidInput("need at least one β, one λ and one rate")
    for b in betas:
        check_weights(b, 0.0)
    for lam in lams:
        check_weights(1.0, lam)
    if any(not s > 0 for s in rate_scales):
        raise InvalidInput(f"rate scales must be > 0, got {list(rate_scales)}")
    betas, lams = sorted({float(b) for b in betas}), sorted({float(v) for v in lams})
    runs = [(spec.seed, workload), *more_seeds]
    seeds = [sd for sd, _ in runs]
    if len(set(seeds)) != len(seeds):
        raise InvalidInput(f"seeds repeat: {seeds}")
    rows: list[dict[str, Any]] = []
    for b in betas:
        for lam in lams:
            label = f"β {b:g} λ {lam:g}"
            per_seed = [sweep(
                wl, ["vertumnus"], rate_scales, profile,
                replace(spec, beta=b, lam=lam, seed=sd), truth, jobs=jobs,
                on_run=None if on_run is None else (lambda _p, s, _l=label: on_run(_l, s)))[0]
                for sd, wl in runs]
            cells = per_seed[0] if len(runs) == 1 else combine_repeats(per_seed, seeds)
            rows.extend({"beta": float(b), "lam": float(lam),
                         **{k: r[k] for k in ROW_KEYS[2:]},
                         **({"seeds": seeds} if len(runs) > 1 else {})} for r in cells)
    pairs = []
    for b in betas:
        for lam in lams:
            mine = [r for r in rows if r["beta"] == b and r["lam"] == lam]
            pairs.append({"beta": float(b), "lam": float(lam),
                          "mean_ttft_s": fmean(r["mean_ttft_s"] for r in mine),
                          "p90_ttft_s": fmean(r["p90_ttft_s"] for r in mine)})
    pairs.sort(key=lambda p: (p["mean_ttft_s"], p["p90_ttft_s"], p["beta"], p["lam"]))
    return {"rows": rows, "pairs": pairs,
            "best": {"beta": pairs[0]["beta"], "lam": pairs[0]["lam"]}}


__all__ = ["ROW_KEYS", "tune_weights"]
