"""How many GPUs each policy needs to meet an SLO on a trace (``vertumnus size``).

The §9 sweeps fix the GPU budget and vary the rate. An operator planning capacity asks the
inverse: at my traffic, what is the smallest prefill pool that keeps token-weighted SLO
attainment at or above a target, under each policy? This module answers it with the same
simulator, deployments and profile as :func:`sim.experiments.sweep`: each evaluated pool size
is one cell of a sweep with ``spec.gpus`` set to it (the initial composition, static's profiled
threshold and every baseline's pool are derived from that budget as in a sweep).

Search: over the pool sizes ``gpus_min, gpus_min + step, …, gpus_max`` (``step`` a multiple of
the largest degree, so every policy's pool is whole), a binary search for the smallest size
that meets the target, which assumes attainment does not fall as GPUs are added. Every size it
evaluated is reported, so a non-monotone stretch (noise, a controller decision) shows; the
answer is the smallest *evaluated* size that met the target.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from shared.costmodel import Profile
from shared.ids import InvalidInput
from sim.experiments import ExperimentSpec, run_in_processes, sweep
from sim.groundtruth import GroundTruth
from sim.workloads.workload import Workload

POINT_KEYS: tuple[str, ...] = ("gpus", "slo_attainment", "mean_ttft_s", "p90_ttft_s",
                               "hit_rate", "gpu_seconds", "reconfigurations", "failed",
                               "failed_by_reason")
"""What each evaluated pool size keeps (a results.json row's figures)."""


def smallest_meeting(candidates: Sequence[int], meets: Callable[[int], bool]) -> int | None:
    """The smallest of the increasing ``candidates`` for which ``meets`` holds, by binary
    search (``meets`` called O(log n) times, largest first); None if not even the largest
    meets. Exact when ``meets`` is monotone (false … false true … true)."""
    if not candidates:
        return None
    if any(b <= a for a, b in zip(candidates, candidates[1:], strict=False)):
        raise InvalidInput(f"pool sizes must increase, got {list(candidates)}")
    if not meets(candidates[-1]):
        return None
    lo, hi = 0, len(candidates) - 1  # NOTE: invariant -- candidates[hi] meets
    while lo < hi:
        mid = (lo + hi) // 2
        if meets(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[hi]


def pool_sizes(degrees: Sequence[int], gpus_min: int | None, gpus_max: int,
               step: int | None) -> list[int]:
    """The pool sizes searched: ``gpus_min`` (default ``step``) to ``gpus_max`` by ``step``
    (default: the largest degree). Raises :class:`InvalidInput` for a step that is not a
    positive multiple of the largest degree, or bounds out of order."""
    cmax = max(degrees)
    step = cmax if step is None else step
    if isinstance(step, bool) or not isinstance(step, int) or step < 1 or step % cmax:
        raise InvalidInput(f"--step must be a positive multiple of the largest degree {cmax} "
                           f"(so every pool is whole), got {step!r}")
    lo = step if gpus_min is None else gpus_min
    for name, v in (("gpus-min", lo), ("gpus-max", gpus_max)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1 or v % cmax:
            raise InvalidInput(f"--{name} must be a positive multiple of the largest degree "
                               f"{cmax}, got {v!r}")
    if lo > gpus_max:
        raise InvalidInput(f"--gpus-min {lo} is above --gpus-max {gpus_max}")
    return list(range(lo, gpus_max + 1, step))


def size_policy(policy: str, workload: Workload, rate_scale: float,
                profiles: Mapping[int, Profile], spec: ExperimentSpec, truth: GroundTruth,
                sizes: Sequence[int], target: float) -> dict[str, Any]:
    """One policy's search: ``{"policy", "gpus" (None: not met up to the largest size),
    "points": every evaluated size's :data:`POINT_KEYS`, by size}``. ``profiles``: the
    profile of each pool size (κ depends on the pool: :func:`sim.profiling.ramp_pools`)."""
    points: dict[int, dict[str, Any]] = {}

    def meets(g: int) -> bool:
        rows, _ = sweep(workload, [policy], [rate_scale], profiles[g], replace(spec, gpus=g),
                        truth)
        (row,) = rows
        points[g] = {k: (g if k == "gpus" else row.get(k)) for k in POINT_KEYS}
        att = row["slo_attainment"]
        return isinstance(att, float) and not math.isnan(att) and att >= target

    found = smallest_meeting(sizes, meets)
    return {"policy": policy, "gpus": found,
            "points": [points[g] for g in sorted(points)]}


def size_pools(
    workload: Workload,
    policies: Sequence[str],
    rate_scale: float,
    profiles: Mapping[int, Profile],
    spec: ExperimentSpec,
    truth: GroundTruth | None = None,
    *,
    target: float,
    sizes: Sequence[int],
    jobs: int = 1,
    on_done: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """:func:`size_policy` for every policy (in ``jobs`` processes; the same results), in
    ``policies`` order. ``target``: the token-weighted SLO attainment to meet, in (0, 1].
    Raises :class:`InvalidInput` for a target outside (0, 1], a rate that is not > 0, no
    policies or a size without a profile."""
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 < target <= 1:
        raise InvalidInput(f"--target must be an SLO attainment in (0, 1], got {target!r}")
    if not (isinstance(rate_scale, int | float) and rate_scale > 0 and math.isfinite(rate_scale)):
        raise InvalidInput(f"--rate-scale must be a finite number > 0, got {rate_scale!r}")
    if not policies:
        raise InvalidInput("no policies given")
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise InvalidInput(f"jobs must be an integer >= 1, got {jobs!r}")
    missing = [g for g in sizes if g not in profiles]
    if missing:
        raise InvalidInput(f"no profile for pool sizes {missing}")
    truth = truth or GroundTruth()
    args = (workload, rate_scale, dict(profiles), spec, truth, list(sizes), float(target))
    out: dict[str, dict[str, Any]] = {}
    if jobs == 1 or len(policies) == 1:
        for pol in policies:
            out[pol] = size_policy(pol, *args)
            if on_done is not None:
                on_done(pol)
    else:
        # Each search is independent and deterministic; in worker processes that a Ctrl-C or
        # SIGTERM stops at once (sim.experiments.run_in_processes).
        def done(i: int) -> None:
            if on_done is not None:
                on_done(policies[i])

        found = run_in_processes(size_policy, [(pol, *args) for pol in policies], jobs,
                                 on_done=done)
        out.update(zip(policies, found, strict=True))
    return [out[p] for p in policies]


__all__ = ["POINT_KEYS", "pool_sizes", "size_policy", "size_pools", "smallest_meeting"]
