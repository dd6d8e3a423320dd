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
from typing import Any, Final

import numpy as np

from shared.ids import InvalidInput


@dataclass(frozen=True, slots=True)
class SloTable:
    """TTFT deadline τ(L) by input length: the first (upper bound, τ) with L < bound wins.

    ``bounds`` must be increasing; a final bound of ``math.inf`` covers every length.
    """

    bounds: tuple[tuple[float, float], ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        if not self.bounds:
            raise InvalidInput("an SLO table needs at least one (bound, deadline) pair")
        prev = -math.inf
        for bound, tau in self.bounds:
            if not bound > prev:
                raise InvalidInput(f"SLO bounds must increase, got {bound} after {prev}")
            if not (tau > 0 and math.isfinite(tau)):
                raise InvalidInput(f"SLO deadline must be finite and > 0 s, got {tau}")
            prev = bound
        if not math.isinf(self.bounds[-1][0]):
            raise InvalidInput("the last SLO bound must be inf so every length has a deadline")

    def deadline(self, input_len: int) -> float:
        """τ(L) in seconds."""
        for bound, tau in self.bounds:
            if input_len < bound:
                return tau
        return self.bounds[-1][1]  # unreachable: last bound is inf

    def __call__(self, input_len: int) -> float:
        return self.deadline(input_len)


QWEN3_SLO: Final[SloTable] = SloTable(
    ((8192, 1.0), (32768, 5.0), (math.inf, 10.0)), "qwen3-30b-a3b"
)
"""Paper Table 2, Qwen3-30B-A3B."""
DEEPSEEK_V4_SLO: Final[SloTable] = SloTable(
    ((8192, 0.5), (32768, 2.0), (math.inf, 5.0)), "deepseek-v4-flash"
)
"""Paper Table 2, DeepSeek-V4-Flash-FP8."""

SLO_TABLES: Final[dict[str, SloTable]] = {t.name: t for t in (QWEN3_SLO, DEEPSEEK_V4_SLO)}
"""The named tables ``--slo`` accepts (paper Table 2)."""


def parse_slo(text: str) -> SloTable:
    """An SLO table from a name of :data:`SLO_TABLES` or ``BOUND:SECONDS,…,inf:SECONDS``
    (a prompt shorter than BOUND tokens must see its first token within SECONDS; the first
    bound it is under wins; the last bound is ``inf``), e.g. ``8192:1,32768:5,inf:10`` (the
    Qwen3 table). Raises :class:`InvalidInput` naming what is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise InvalidInput("an SLO is a table name or BOUND:SECONDS pairs, got nothing")
    name = text.strip()
    if name in SLO_TABLES:
        return SLO_TABLES[name]
    if ":" not in name:
        raise InvalidInput(f"unknown SLO table {name!r}; known: {', '.join(SLO_TABLES)}, or "
                           "BOUND:SECONDS pairs such as 8192:1,32768:5,inf:10")
    pairs: list[tuple[float, float]] = []
    for part in name.split(","):
        bound_s, sep, tau_s = part.strip().partition(":")
        if not sep:
            raise InvalidInput(f"SLO entry {part.strip()!r} is not BOUND:SECONDS")
        try:
            bound = math.inf if bound_s.strip().lower() == "inf" else int(bound_s)
        except ValueError:
            raise InvalidInput(f"SLO bound {bound_s.strip()!r} is not a whole number of tokens "
                               "or 'inf'") from None
        try:
            tau = float(tau_s)
        except ValueError:
            raise InvalidInput(f"SLO deadline {tau_s.strip()!r} is not a number of seconds"
                               ) from None
        if not bound > 0:
            raise InvalidInput(f"SLO bound must be > 0 tokens, got {bound_s.strip()!r}")
        pairs.append((bound, tau))
    return SloTable(tuple(pairs), name)


def slo_to_dict(slo: SloTable) -> dict[str, Any]:
    """The table as JSON can hold it (``inf`` written as the string "inf")."""
    return {"name": slo.name,
            "bounds": [["inf" if math.isinf(b) else int(b), tau] for b, tau in slo.bounds]}


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
