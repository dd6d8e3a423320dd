"""Metric definitions used everywhere (design.md "Metrics"), on per-request records.

TTFT = time the first output token reaches the client − arrival (s); it includes queueing,
scheduling, cache operations on the path, prefill, KV handoff and the first decode step.
Token-weighted SLO attainment = Σ L_i·[TTFT_i ≤ τ(L_i)] / Σ L_i with τ from the paper's
Table 2 (Qwen3-30B-A3B: L < 8,192 → 1 s; < 32,768 → 5 s; else 10 s), configurable.
Token-level prefix hit rate = reused input tokens / input tokens. GPU-seconds = Σ prefill
time × GPUs of the worker that ran it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from shared.ids import InvalidInput
from shared.slo import (  # noqa: F401 -- the SLO tables, re-exported where metrics are defined
    DEEPSEEK_V4_SLO,
    QWEN3_SLO,
    SLO_TABLES,
    SloTable,
    parse_slo,
    slo_to_dict,
)


def slo_attainment(
    input_lens: Sequence[int] | np.ndarray,
    ttfts: Sequence[float] | np.ndarray,
    slo: SloTable = QWEN3_SLO,
) -> float:
    """Token-weighted SLO attainment in [0, 1]; NaN for no requests."""
    lens = np.asarray(input_lens, dtype=float)
    t = np.asarray(ttfts, dtype=float)
    if lens.shape != t.shape:
        raise InvalidInput(f"{lens.shape[0]} input lengths but {t.shape[0]} TTFTs")
    if lens.size == 0:
        return math.nan
    taus = np.array([slo.deadline(int(x)) for x in lens])
    return float(lens[t <= taus].sum() / lens.sum())


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What the simulator (or the live stack) records for one finished request.

    Times in seconds since the workload's start; ``ttft_s`` = first token − arrival.
    ``degree`` is the worker's GPU count (CP or TP degree).
    """

    request_id: str
    arrival_s: float
    input_len: int
    ttft_s: float
    reused_tokens: int = 0
    worker: str = ""
    degree: int = 1
    predicted_prefill_s: float = math.nan
    actual_prefill_s: float = math.nan
    queue_s: float = 0.0

    def __post_init__(self) -> None:
        if self.input_len < 1:
            raise InvalidInput(f"{self.request_id}: input_len must be >= 1")
        if not 0 <= self.reused_tokens <= self.input_len:
            raise InvalidInput(
                f"{self.request_id}: reused_tokens {self.reused_tokens} "
                f"outside [0, {self.input_len}]"
            )
        if not self.ttft_s >= 0:
            raise InvalidInput(f"{self.request_id}: ttft_s must be >= 0, got {self.ttft_s}")
        if self.degree < 1:
            raise InvalidInput(f"{self.request_id}: degree must be >= 1")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if x.size else math.nan


def summarize(records: Iterable[RequestRecord], slo: SloTable = QWEN3_SLO) -> dict[str, Any]:
    """Aggregate metrics of finished requests.

    Keys: requests, ttft_mean/p50/p90/p99 (s), slo_attainment (token-weighted), hit_rate
    (token level), gpu_seconds (Σ actual prefill × degree), prediction_mape (mean
    |pred − actual| / actual over records with both), and per_degree {C: requests,
    hit_rate, ttft_mean, gpu_seconds}.
    """
    recs = list(records)
    out: dict[str, Any] = {"requests": len(recs), "slo": slo.name}
    if not recs:
        return out
    ttft = np.array([r.ttft_s for r in recs])
    lens = np.array([r.input_len for r in recs], dtype=float)
    reused = np.array([r.reused_tokens for r in recs], dtype=float)
    actual = np.array([r.actual_prefill_s for r in recs])
    pred = np.array([r.predicted_prefill_s for r in recs])
    deg = np.array([r.degree for r in recs])
    ok = np.isfinite(actual) & np.isfinite(pred) & (actual > 0)
    gpu_s = np.where(np.isfinite(actual), actual, 0.0) * deg
    out.update(
        {
            "ttft_mean": float(ttft.mean()),
            "ttft_p50": _pct(ttft, 50),
            "ttft_p90": _pct(ttft, 90),
            "ttft_p99": _pct(ttft, 99),
            "slo_attainment": slo_attainment(lens, ttft, slo),
            "hit_rate": float(reused.sum() / lens.sum()),
            "gpu_seconds": float(gpu_s.sum()),
            "prediction_mape": float(np.mean(np.abs(pred[ok] - actual[ok]) / actual[ok]))
            if ok.any()
            else math.nan,
        }
    )
    per: dict[int, dict[str, float]] = {}
    for c in sorted(set(deg.tolist())):
        m = deg == c
        per[int(c)] = {
            "requests": int(m.sum()),
            "hit_rate": float(reused[m].sum() / lens[m].sum()),
            "ttft_mean": float(ttft[m].mean()),
            "gpu_seconds": float(gpu_s[m].sum()),
        }
    out["per_degree"] = per
    return out
