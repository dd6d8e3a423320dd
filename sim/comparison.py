"""Vertumnus against the strongest baseline at each rate: the simulator issue's acceptance
figures, read off a sweep's rows.

The issue defines them: the *strongest baseline* at a rate is the baseline with the lowest mean
TTFT there; P90 and SLO attainment compare with the baseline best on that metric (which may be
another one). The subject is ``vertumnus``, or, in the cache ablation's rows, ``full`` (the
full cache manager, against the variant without replication and reclamation); a baseline is
any other policy in the rows (for the reconfiguration preset: its fixed compositions). Pure:
rows in, rows out, no IO.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

from shared.ids import InvalidInput

SUBJECTS: Final[tuple[str, ...]] = ("vertumnus", "full")
"""The policies compared with the rest, in order of preference (:func:`subject_of`)."""

COMPARISON_KEYS: Final[tuple[str, ...]] = (
    "subject", "rate_scale",
    "mean_ttft_s", "strongest_baseline", "strongest_mean_ttft_s", "mean_change",
    "p90_ttft_s", "best_p90_baseline", "best_p90_ttft_s", "p90_change",
    "slo_attainment", "best_slo_baseline", "best_slo_attainment", "slo_points",
    "oracle_mean_ttft_s", "mean_over_oracle",
    "failed", "strongest_failed", "best_p90_failed",
)
"""The fields of one comparison row, in the order ``comparison.csv`` writes them.

* ``subject``: the policy compared (:func:`subject_of`); ``mean_ttft_s``, ``p90_ttft_s``,
  ``slo_attainment``, ``oracle_mean_ttft_s``: its figures.
* ``strongest_baseline`` / ``strongest_mean_ttft_s``: the baseline with the lowest mean and
  that mean; ``mean_change``: the subject's mean / that mean − 1 (−0.2: 20% lower).
* ``best_p90_baseline`` / ``best_p90_ttft_s`` / ``p90_change``: the same for P90.
* ``best_slo_baseline`` / ``best_slo_attainment``: the baseline with the highest SLO
  attainment; ``slo_points``: the subject's attainment minus it, in percentage points.
* ``mean_over_oracle``: the subject's mean over the zero-queue oracle's (1.0: at the limit).
* ``failed`` / ``strongest_failed`` / ``best_p90_failed``: the requests that never completed
  (the rows' ``failed``; with ``--repeats`` the mean over the seeds) of the subject, of
  the strongest baseline and of the best-P90 one.
  Mean and percentiles are over completed requests only (a failed request has no TTFT; SLO
  attainment counts it as a miss), so a policy that fails requests -- long ones its caches
  cannot hold -- can show a lower mean than one that serves them: these say when a
  comparison of means is one of different request sets.

A figure that cannot be given is None: a metric no baseline has (null in results.json: a run
with no completed request), or a ratio over a zero or missing denominator.
"""


def _number(row: Mapping[str, Any], key: str) -> float | None:
    """``row[key]`` as a finite float, None where it is absent, null or not finite."""
    v = row.get(key)
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if math.isfinite(v) else None


def subject_of(rows: Iterable[Mapping[str, Any]]) -> str | None:
    """The first of :data:`SUBJECTS` some row has as its policy; None if none has."""
    policies = {r.get("policy") for r in rows if isinstance(r, Mapping)}
    return next((s for s in SUBJECTS if s in policies), None)


def strongest_baseline(rows: Iterable[Mapping[str, Any]], rate_scale: float,
                       metric: str = "mean_ttft_s", higher_is_better: bool = False,
                       subject: str = SUBJECTS[0]) -> Mapping[str, Any] | None:
    """The baseline row (not ``subject``) best on ``metric`` at ``rate_scale``: the first such
    row in the rows' order on a tie; rows whose ``metric`` is missing, null or not finite are
    passed over; None when no baseline row has it."""
    best: Mapping[str, Any] | None = None
    best_v = 0.0
    for r in rows:
        if r["rate_scale"] != rate_scale or r["policy"] == subject:
            continue
        v = _number(r, metric)
        if v is None:
            continue
        if best is None or (v > best_v if higher_is_better else v < best_v):
            best, best_v = r, v
    return best


def _count(row: Mapping[str, Any]) -> float | None:
    """``row["failed"]``: an int >= 0, or a finite float >= 0 (the mean over the seeds of a
    ``--repeats`` row, :func:`sim.experiments.combine_repeats`); None where absent or not
    one (older rows)."""
    v = row.get("failed")
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return v if 0 <= v < math.inf else None


def _count_of(group: list[Mapping[str, Any]], policy: str | None) -> float | None:
    """:func:`_count` of ``policy``'s row in ``group`` (None: no such policy)."""
    row = next((r for r in group if r["policy"] == policy), None) if policy else None
    return None if row is None else _count(row)


def _change(v: float | None, b: float | None) -> float | None:
    """v / b − 1, None where either is missing or b is not > 0."""
    if v is None or b is None or b <= 0:
        return None
    return v / b - 1.0


def _best(rows: list[Mapping[str, Any]], rate: float, metric: str, higher: bool, subject: str
          ) -> tuple[str | None, float | None]:
    """(policy, value) of :func:`strongest_baseline` on ``metric``; (None, None) if none."""
    r = strongest_baseline(rows, rate, metric, higher, subject)
    return (None, None) if r is None else (str(r["policy"]), _number(r, metric))


def compare_with_baselines(rows: Iterable[Mapping[str, Any]], subject: str | None = None
                           ) -> list[dict[str, Any]]:
    """One comparison row (:data:`COMPARISON_KEYS`) per rate scale that has a ``subject`` row
    (default: :func:`subject_of` the rows) and at least one baseline row, in the order of the
    rate scales' first appearance; [] where there is no subject.

    ``rows`` are a sweep's result rows (``results.json``: ``policy``, ``rate_scale`` and the
    metrics). Raises :class:`InvalidInput` for a row without ``policy`` or ``rate_scale``, or
    with two subject rows at one rate scale (not one sweep's rows)."""
    rows = list(rows)
    by_rate: dict[float, list[Mapping[str, Any]]] = {}
    for i, r in enumerate(rows):
        if not isinstance(r, Mapping) or "policy" not in r or "rate_scale" not in r:
            raise InvalidInput(f"row {i} has no policy or rate_scale")
        by_rate.setdefault(r["rate_scale"], []).append(r)
    subject = subject_of(rows) if subject is None else subject
    out: list[dict[str, Any]] = []
    if subject is None:
        return out
    for rate, group in by_rate.items():
        mine = [r for r in group if r["policy"] == subject]
        others = [r for r in group if r["policy"] != subject]
        if len(mine) > 1:
            raise InvalidInput(f"{len(mine)} {subject} rows at rate scale {rate}")
        if not mine or not others:
            continue
        v = mine[0]
        mean, p90, slo = (_number(v, k) for k in ("mean_ttft_s", "p90_ttft_s",
                                                   "slo_attainment"))
        oracle = _number(v, "oracle_mean_ttft_s")
        s_pol, s_mean = _best(group, rate, "mean_ttft_s", False, subject)
        p_pol, p_val = _best(group, rate, "p90_ttft_s", False, subject)
        a_pol, a_val = _best(group, rate, "slo_attainment", True, subject)
        out.append({
            "subject": subject, "rate_scale": rate,
            "mean_ttft_s": mean, "strongest_baseline": s_pol,
            "strongest_mean_ttft_s": s_mean, "mean_change": _change(mean, s_mean),
            "p90_ttft_s": p90, "best_p90_baseline": p_pol, "best_p90_ttft_s": p_val,
            "p90_change": _change(p90, p_val),
            "slo_attainment": slo, "best_slo_baseline": a_pol, "best_slo_attainment": a_val,
            "slo_points": None if slo is None or a_val is None else (slo - a_val) * 100.0,
            "oracle_mean_ttft_s": oracle,
            "mean_over_oracle": None if mean is None or oracle is None or oracle <= 0
            else mean / oracle,
            "failed": _count(v),
            "strongest_failed": _count_of(group, s_pol),
            "best_p90_failed": _count_of(group, p_pol),
        })
    return out


def compare_sizes(policies: Iterable[Mapping[str, Any]], subject: str = SUBJECTS[0]
                  ) -> dict[str, Any] | None:
    """Vertumnus's pool size against the smallest baseline's, from ``vertumnus size``'s
    per-policy answers (``size.json``'s ``policies``: ``policy`` and ``gpus``, None where the
    target was not met at the largest size tried).

    Returns None when ``subject`` is not among them; else ``subject``, ``gpus`` (its answer),
    ``best_baseline`` / ``best_gpus`` (the baseline needing the fewest GPUs, the first on a
    tie; None where no baseline met the target), and ``saved_gpus`` / ``saved_share`` (what the
    subject needs less, absolute and as a fraction of the baseline's pool; None unless both
    met the target)."""
    mine: Mapping[str, Any] | None = None
    best: Mapping[str, Any] | None = None
    for r in policies:
        if r["policy"] == subject:
            mine = r
            continue
        g = r["gpus"]
        if g is not None and (best is None or g < best["gpus"]):
            best = r
    if mine is None:
        return None
    g, b = mine["gpus"], None if best is None else best["gpus"]
    both = g is not None and b is not None
    return {"subject": subject, "gpus": g,
            "best_baseline": None if best is None else best["policy"], "best_gpus": b,
            "saved_gpus": b - g if both else None,
            "saved_share": (b - g) / b if both else None}
