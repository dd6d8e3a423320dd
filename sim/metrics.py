"""Metric definitions used everywhere (design.md "Metrics"), on per-request records.

TTFT = time the first output token reaches the client − arrival (s); it includes queueing,
scheduling, cache operations on the path, prefill, KV handoff and the first decode step.
Token-weighted SLO attainment = Σ L_i·[TTFT_i ≤ τ(L_i)] / Σ L_i with τ from the paper's
Table 2 (Qwen3-30B-A3B: L < 8,192 → 1 s; < 32,768 → 5 s; else 10 s), configurable.
Token-level prefix hit rate = reused input tokens / input tokens. GPU-seconds = Σ prefill
time × GPUs of the worker that ran it. A failed request (the simulator's, one no worker could
take) is counted by why it failed: :func:`refusal_reason` (from the scheduler's exception, when
it fails), :func:`failure_reason` (from its text, in a per-request log written before the
simulator recorded the reason), :func:`failures_by_reason`.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Final, Protocol

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

if TYPE_CHECKING:  # the scheduler package imports scipy (seconds): see _exclusions
    from services.scheduler.errors import NoEligibleWorker


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


# --- why requests failed ---------------------------------------------------------------------
NO_WORKERS: Final[str] = "no_workers"
"""A request failed because the pool had no worker at all."""
UNFINISHED: Final[str] = "unfinished"
"""A request that never completed and recorded no failure (none does in the simulator: a
placed request always completes; here so that the counts always add up to ``failed``)."""
OTHER: Final[str] = "other"
"""A failure text of no form :func:`failure_reason` knows (the per-request log has it whole)."""

_TOO_LONG_ALL = re.compile(r"prompt of \d+ tokens is longer than every worker's max_seq_len")


@functools.cache
def _exclusions() -> tuple[tuple[str, str], ...]:
    """(reason key, the scheduler's text) of every exclusion, in the scheduler's order.

    Imported here, not at the top: the scheduler package imports the cost model and scipy
    (seconds), which a reader of these metrics alone does not need."""
    from services.scheduler.decision import Exclusion

    return tuple((e.name.lower(), e.value) for e in Exclusion)


def failure_reasons() -> dict[str, str]:
    """Every key :func:`failure_reason` may combine, with what it means (the scheduler's own
    text for an exclusion): the legend of the results' ``failed_by_reason``."""
    return {
        **dict(_exclusions()),
        NO_WORKERS: "the pool had no workers",
        UNFINISHED: "never completed, no failure recorded",
        OTHER: "a failure of another kind (see the per-request log, --requests)",
    }


def refusal_reason(exc: NoEligibleWorker) -> str:
    """Why the scheduler refused a request, as the short key :func:`failure_reason` names,
    from the exception's data (never its message, which may be reworded):
    ``exc.exclusions`` lower-cased and joined by ``+`` in the scheduler's order
    (``too_long+no_memory``; :class:`~services.scheduler.errors.SequenceTooLong` is
    ``too_long``), :data:`NO_WORKERS` when ``exc.no_workers``, :data:`OTHER` when it names no
    exclusion (not an exception the scheduler raises)."""
    if exc.no_workers:
        return NO_WORKERS
    return "+".join(e.name.lower() for e in exc.exclusions) or OTHER


def failure_reason(failed: str) -> str:
    """Why a request failed, as a short key, from the text the simulator records for it
    (``RequestRecord.failed``: the message of the scheduler's
    :class:`~services.scheduler.errors.NoEligibleWorker`).

    The simulator records the key itself (``RequestRecord.failed_reason``, the per-request
    log's ``failed_reason`` column: :func:`refusal_reason`); this reads the text of a log
    written before it did, and depends on the message's wording of that time.

    A request fails when the scheduler excludes every worker; the key names the exclusions
    that did it (:class:`~services.scheduler.decision.Exclusion`, lower case), several joined
    by ``+`` in the scheduler's order when the workers were excluded for different ones:
    ``no_memory`` (its KV fits in no worker's KV capacity), ``too_long`` (longer than every
    worker's ``max_seq_len``, also :class:`~services.scheduler.errors.SequenceTooLong`'s
    message), ``too_long+no_memory``, ``draining``, ... :data:`NO_WORKERS` for a pool without
    workers, :data:`UNFINISHED` for an empty text (no failure recorded), :data:`OTHER` for
    any other text."""
    if not failed:
        return UNFINISHED
    if _TOO_LONG_ALL.match(failed):
        return "too_long"
    if failed.startswith("no eligible worker"):
        if failed.endswith("(the cluster view has no workers)"):
            return NO_WORKERS
        # Each worker's part is "<worker>: <reason>", parts joined by "; ", all in "( )".
        found = [
            key
            for key, text in _exclusions()
            if re.search(f": {re.escape(text)}(?:; |\\)$)", failed)
        ]
        if found:
            return "+".join(found)
    return OTHER


class FailedRecord(Protocol):
    """What :func:`failures_by_reason` reads of a request record (the simulator's; also its
    ``failed_reason`` where the record has one)."""

    @property
    def failed(self) -> str: ...

    @property
    def ttft_s(self) -> float: ...


def failures_by_reason(records: Iterable[FailedRecord]) -> dict[str, int]:
    """How many of ``records`` failed, by reason (the keys sorted; only reasons with a
    failure): the record's own ``failed_reason`` (the simulator's, from the scheduler's
    exception: :func:`refusal_reason`), else :func:`failure_reason` of its text (a record
    without the key). A record failed when it has no TTFT (``ttft_s`` < 0, as the results'
    ``failed`` counts them), so the counts add up to that."""
    out: dict[str, int] = {}
    for r in records:
        if r.ttft_s < 0:
            # Optional (not in FailedRecord): a record of another source has the text alone.
            key = getattr(r, "failed_reason", "") or failure_reason(r.failed)
            out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def format_failed_by_reason(counts: Mapping[str, float]) -> str:
    """``counts`` (a results row's ``failed_by_reason``) as one CSV cell: ``key=n`` joined
    by ``;`` in key order (``no_memory=139;too_long=2``), a mean over seeds to two decimals;
    empty for none."""

    def num(v: float) -> str:
        return str(int(v)) if float(v).is_integer() else f"{v:.2f}"

    return ";".join(f"{k}={num(v)}" for k, v in sorted(counts.items()))
