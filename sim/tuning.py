"""The sweep that chooses J's weights β and λ (§5.3) for a trace and a hardware.

``services/calibration.py`` chose ``BETA`` and ``LAM`` this way on the conversation trace and
the default H20: Vertumnus at every (β, λ) of a grid, over a few rates, the same trace, profile,
cluster and seed. On other hardware the weights can matter where they did not there
(docs/evaluation.md: on H200, λ = 0.25 keeps requests off CP4 workers that cost twice the GPU
time at light load); ``vertumnus tune`` runs the same sweep there.

The best pair has the lowest mean TTFT averaged over the rates; ties go to the lower averaged
P90, then the smaller β, then the smaller λ. With ``controllers`` (several controller files,
``vertumnus tune --controller A.toml,B.toml``) the grid has a third axis: every (β, λ) runs
with each controller setting, a "pair" is then a (β, λ, controller) cell and a tie goes last
to the setting listed first. Each cell is :func:`sim.experiments.sweep` for
``vertumnus`` alone (its controller on, its initial composition per rate), so a cell here is
the cell ``vertumnus simulate`` would run with ``--beta B --lam L``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from statistics import fmean
from typing import Any

from services.controller.planner import ControllerConfig
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
    controllers: Sequence[tuple[str, ControllerConfig]] = (),
) -> dict[str, Any]:
    """Vertumnus at every (β, λ) of ``betas`` × ``lams`` and every rate of ``rate_scales``.

    ``more_seeds``: (seed, that seed's workload) pairs run as well as ``spec.seed`` on
    ``workload``; each row is then the mean over the seeds
    (:func:`sim.experiments.combine_repeats`), with ``seeds``.

    ``controllers``: (label, setting) pairs to run every (β, λ) with, in the order given
    (labels distinct); empty: ``spec.controller`` alone, and no row carries a controller.

    Returns ``{"rows": one per (β, λ, rate), "pairs": one per (β, λ) with the averages over
    the rates, best first, "best": {"beta", "lam"}}``; with ``controllers``, each row, pair
    and the best also name their ``"controller"``. ``on_run(label, rate)`` is called as
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
    labels = [lab for lab, _ in controllers]
    if len(set(labels)) != len(labels):
        raise InvalidInput(f"controller settings repeat: {labels}")
    for lab, cfg in controllers:
        if not isinstance(cfg, ControllerConfig):
            raise InvalidInput(f"controller {lab!r} must be a ControllerConfig, got {cfg!r}")
    # (label or None, the spec that runs it): the controller's window is the spec's too.
    axis: list[tuple[str | None, ExperimentSpec]] = (
        [(lab, replace(spec, controller=cfg, window_s=cfg.window_s))
         for lab, cfg in controllers] or [(None, spec)])
    rows: list[dict[str, Any]] = []
    for b in betas:
        for lam in lams:
            for lab, cspec in axis:
                label = f"β {b:g} λ {lam:g}" + ("" if lab is None else f" {lab}")
                per_seed = [sweep(
                    wl, ["vertumnus"], rate_scales, profile,
                    replace(cspec, beta=b, lam=lam, seed=sd), truth, jobs=jobs,
                    on_run=None if on_run is None else (
                        lambda _p, s, _l=label: on_run(_l, s)))[0]
                    for sd, wl in runs]
                cells = per_seed[0] if len(runs) == 1 else combine_repeats(per_seed, seeds)
                rows.extend({"beta": float(b), "lam": float(lam),
                             **({} if lab is None else {"controller": lab}),
                             **{k: r[k] for k in ROW_KEYS[2:]},
                             **({"seeds": seeds} if len(runs) > 1 else {})} for r in cells)
    pairs = []
    for b in betas:
        for lam in lams:
            for k, (lab, _) in enumerate(axis):
                mine = [r for r in rows if r["beta"] == b and r["lam"] == lam
                        and r.get("controller") == lab]
                pairs.append({"beta": float(b), "lam": float(lam),
                              **({} if lab is None else {"controller": lab}),
                              "mean_ttft_s": fmean(r["mean_ttft_s"] for r in mine),
                              "p90_ttft_s": fmean(r["p90_ttft_s"] for r in mine), "_k": k})
    pairs.sort(key=lambda p: (p["mean_ttft_s"], p["p90_ttft_s"], p["beta"], p["lam"], p["_k"]))
    for p in pairs:
        del p["_k"]
    best = {k: pairs[0][k] for k in ("beta", "lam", "controller") if k in pairs[0]}
    return {"rows": rows, "pairs": pairs, "best": best}


__all__ = ["ROW_KEYS", "tune_weights"]
