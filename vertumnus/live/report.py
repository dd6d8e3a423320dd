"""The live run's report: TTFT table, SLO attainment, hit rate, overhead, composition changes,
injected faults.

Metrics come from :mod:`sim.metrics` (the same definitions as the simulator): TTFT in
*modelled* seconds (wall ÷ time scale) so the paper's Table 2 deadlines apply, token-weighted
SLO attainment, token-level hit rate. Overhead percentiles are wall milliseconds.

Which requests each figure covers: the SLO attainment covers every request with a record,
answered or not; a failed one (an HTTP error, or no response: refused or dropped connection,
the client's timeout) is a miss weighted by its input length, which the replay knows from the
workload request it sent (design.md "Metrics"; the simulator counts a failed request the same
way). TTFT, hit rate, overhead, cost-model error and the per-degree figures cover the completed
requests only. A run cut short (``interrupted``) has no record of the requests still in flight
or not yet sent; they are counted nowhere (``up`` reports ``requests_planned``).

What was not measured reads as not measured ("–", null in JSON), never as 0: the hit rates
without the results tap and the reconfigurations without the epoch records (``replay``
without ``--nats``), the request figures of ``up --serve`` (external traffic), the cost-model
error on TP workers (the vllm baseline; the CP-fitted profile does not describe them).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from shared.ids import InvalidInput
from shared.worker import GpuGroup
from sim.metrics import (
    QWEN3_SLO,
    RequestRecord,
    SloTable,
    slo_attainment,
    slo_to_dict,
    summarize,
)
from vertumnus.live.faults import describe as describe_faults
from vertumnus.live.replay import ReplayRecord

REQUIRED_KEYS = (
    "requests", "completed", "failed", "mean_ttft_s", "p50_ttft_s", "p90_ttft_s", "p99_ttft_s",
    "slo_attainment", "hit_rate", "overhead_p50_ms", "overhead_p99_ms", "reconfigurations",
)


RECOVERY_COUNTERS: tuple[tuple[str, str], ...] = (
    ("predecessor_naked", "held messages given back by a restarted replica"),
    ("peer_naked", "held messages of a gone replica given back by a survivor"),
    ("adopted", "dispatched requests adopted from a gone replica"),
    ("adopted_lost", "of a gone replica, handed back (worker gone or restarted)"),
    ("lost_handed_back", "handed back for a lost worker"),
    ("gone_handed_back", "handed back for a gone worker on redelivery"),
    ("redelivered_acked", "redeliveries found answered"),
    ("fail_found_answered", "last deliveries found answered (no error sent)"),
    ("resent", "recorded assignments sent again"),
    ("republished_held", "re-sent after a store loss, found held by a worker"),
    ("republished_answered", "re-sent after a store loss, answered meanwhile"),
    ("republished_placed", "re-sent after a store loss, lost with it: placed"),
    ("republished_listings", "listings of the workers' queues those took"),
)
"""The scheduler's recovery counters (``SchedulerStats``) ``up`` sums over its replicas."""


CACHE_MANAGER_COUNTERS: tuple[str, ...] = ("pulls", "rehomed", "commands_sent",
                                           "commands_ok", "commands_failed", "demotes_ok",
                                           "demotes_failed", "reconciled_notices")
"""The cache manager's counters (``CacheMgrService.counters``) ``up`` reports."""

SCHEDULER_CACHE_COUNTERS: tuple[str, ...] = ("reconciled_applied", "pending_credited")
"""The scheduler's counters of J's credit of a pending prefix (``SchedulerStats``) ``up``
sums over its replicas."""


def scheduler_recovery(answers: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Sum :data:`RECOVERY_COUNTERS` over ``$SRV.STATS`` answers of the scheduler's replicas
    (the counters are every endpoint's ``data``; a replica is counted once). Pure."""
    return summed_counters(answers, [k for k, _ in RECOVERY_COUNTERS])


def summed_counters(answers: Sequence[Mapping[str, Any]], keys: Sequence[str]) -> dict[str, int]:
    """Sum the counters ``keys`` over a micro service's ``$SRV.STATS`` answers (the counters
    are every endpoint's ``data``; a replica is counted once; a missing, malformed or
    negative value counts 0). Pure."""
    out = dict.fromkeys(keys, 0)
    for a in answers:
        data = next((e.get("data") for e in a.get("endpoints") or ()
                     if isinstance(e, Mapping) and isinstance(e.get("data"), Mapping)), None)
        if data is None:
            continue
        for k in out:
            v = data.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                out[k] += v
    return out


@dataclass(frozen=True, slots=True)
class CompositionChange:
    """One epoch record as observed (``at_s`` = seconds since the replay started, wall)."""

    epoch: int
    at_s: float
    workers: tuple[str, ...]
    reason: str = ""

    def degrees(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for w in self.workers:
            try:
                d = GpuGroup.from_worker_id(w).degree
            except InvalidInput:
                continue
            out[d] = out.get(d, 0) + 1
        return dict(sorted(out.items()))

    def label(self) -> str:
        """``'2×CP2 + 1×CP4'`` (TP workers, the vllm baseline's, as ``TP4``)."""
        out: dict[tuple[int, str], int] = {}
        for w in self.workers:
            if _lattice(w):
                key = (GpuGroup.from_worker_id(w).degree, _kind(w))
                out[key] = out.get(key, 0) + 1
        return " + ".join(f"{n}×{k}{d}" for (d, k), n in sorted(out.items())) or "(none)"


def _kind(worker_id: str) -> str:
    """'TP' for a tensor-parallel worker's id (``w-tp4-g0``), else 'CP'."""
    return "TP" if worker_id.startswith("w-tp") else "CP"


def describe_change(old: CompositionChange, new: CompositionChange) -> str:
    """'split w-cp4-g0 → w-cp2-g0, w-cp2-g2' (or merge / change) between two records."""
    gone = sorted(set(old.workers) - set(new.workers))
    came = sorted(set(new.workers) - set(old.workers))
    if not gone and not came:
        return "lifecycle change"
    dg = [GpuGroup.from_worker_id(w).degree for w in gone if _lattice(w)]
    dc = [GpuGroup.from_worker_id(w).degree for w in came if _lattice(w)]
    kind = "change"
    if dg and dc and len(came) > len(gone) and max(dc) < min(dg):
        kind = "split"
    elif dg and dc and len(came) < len(gone) and min(dc) > max(dg):
        kind = "merge"
    return f"{kind} {', '.join(gone)} → {', '.join(came)}"


def _lattice(wid: str) -> bool:
    try:
        GpuGroup.from_worker_id(wid)
    except InvalidInput:
        return False
    return True


def reconfigurations(changes: Sequence[CompositionChange], *, warmup: bool = False) -> int:
    """Epoch records whose worker set differs from the previous one, during the replay
    (``at_s`` ≥ 0) or, with ``warmup``, before it."""
    return sum(1 for a, b in zip(changes, changes[1:], strict=False)
               if set(a.workers) != set(b.workers) and (b.at_s < 0) == warmup)


def _degree(worker_id: str | None) -> int:
    if worker_id and _lattice(worker_id):
        return GpuGroup.from_worker_id(worker_id).degree
    return 1


def _pct(x: np.ndarray, q: float) -> float:
    return float(np.percentile(x, q)) if x.size else math.nan


@dataclass
class LiveReport:
    records: Sequence[ReplayRecord]
    time_scale: float
    changes: Sequence[CompositionChange] = field(default_factory=list)
    slo: SloTable = QWEN3_SLO
    prefix_tokens: Mapping[str, int] = field(default_factory=dict)
    """Reused tokens by request id from the results tap, where the HTTP answer lacks them."""
    meta: dict[str, Any] = field(default_factory=dict)
    faults: Sequence[Mapping[str, Any]] = field(default_factory=list)
    """Faults injected during the run (:meth:`vertumnus.live.faults.FaultEvent.as_dict`)."""
    followed_epochs: bool = True
    """Whether the epoch records were followed (``changes`` is what they showed); False for a
    ``replay`` without ``--nats``, which has no way to see the composition: its
    ``reconfigurations`` are then None (not measured), not 0."""
    followed_results: bool = True
    """Whether the results were tapped on the bus (``prefix_tokens`` is what they showed). The
    gateway's HTTP answer carries no reused-token count, so without the tap (a ``replay``
    without ``--nats``) the hit rates are NaN (not measured), not 0."""
    serving: bool = False
    """``up --serve``: the stack replayed nothing itself and served external traffic (other
    processes' replays), whose requests it has no record of: the request figures are None /
    NaN (not measured), while the composition changes, cache commands and ``results_seen``
    count that external traffic."""

    def metric_records(self) -> list[RequestRecord]:
        """The completed requests as :class:`RequestRecord` (modelled seconds); failed ones
        have no TTFT and are left out (:meth:`slo_attainment` counts them)."""
        out = []
        for r in self.records:
            if not r.ok:
                continue
            reused = r.prefix_tokens or self.prefix_tokens.get(r.request_id, 0)
            # The scheduler's profile is a CP fit: on a TP worker (the vllm baseline's pool)
            # predicted and actual times describe different executions, so their gap is no
            # error of the model; left out of the MAPE, as `simulate` leaves it (None there).
            tp = bool(r.worker_id) and _kind(r.worker_id or "") == "TP"
            out.append(RequestRecord(
                request_id=r.request_id, arrival_s=r.arrival_s, input_len=r.input_len,
                ttft_s=max(0.0, r.ttft_s) / self.time_scale,
                reused_tokens=min(max(0, reused), r.input_len),
                worker=r.worker_id or "", degree=_degree(r.worker_id),
                predicted_prefill_s=(r.predicted_prefill_s
                                     if r.predicted_prefill_s is not None and not tp
                                     else math.nan),
                actual_prefill_s=r.prefill_s / self.time_scale,
                queue_s=r.queue_wait_s / self.time_scale,
            ))
        return out

    def slo_attainment(self) -> float:
        """Token-weighted SLO attainment over every recorded request (design.md "Metrics"):
        Σ L·[TTFT ≤ τ(L)] / Σ L with TTFT in modelled seconds, a failed or unanswered request
        a miss weighted by its input length. NaN for no request with an input length."""
        counted = [r for r in self.records if r.input_len >= 1]
        lens = [r.input_len for r in counted]
        ttfts = [max(0.0, r.ttft_s) / self.time_scale if r.ok else math.inf for r in counted]
        return slo_attainment(lens, ttfts, self.slo)

    def summary(self) -> dict[str, Any]:
        """The report as JSON-ready figures (:data:`REQUIRED_KEYS` and more). ``requests`` =
        ``completed`` + ``failed`` (``unanswered`` of those got no HTTP response at all);
        ``slo_attainment`` covers them all, ``failed_input_tokens`` being misses, and
        ``slo_attainment_completed`` the completed ones only; the TTFT figures are over the
        completed requests (see the module docstring)."""
        recs = self.metric_records()
        s = summarize(recs, self.slo)
        ok = [r for r in self.records if r.ok]
        over = np.array([r.overhead_s for r in ok]) * 1e3
        failed = [r for r in self.records if not r.ok]
        per_degree = {str(k): dict(v) for k, v in (s.get("per_degree") or {}).items()}
        if not self.followed_results:
            for v in per_degree.values():
                v["hit_rate"] = math.nan  # the reused tokens were not seen: not measured
        out: dict[str, Any] = {
            "requests": len(self.records),
            "completed": len(ok),
            "failed": len(failed),
            "unanswered": sum(1 for r in failed if r.status == 0),
            "input_tokens": sum(max(0, r.input_len) for r in self.records),
            "failed_input_tokens": sum(max(0, r.input_len) for r in failed),
            "mean_ttft_s": s.get("ttft_mean", math.nan),
            "p50_ttft_s": s.get("ttft_p50", math.nan),
            "p90_ttft_s": s.get("ttft_p90", math.nan),
            "p99_ttft_s": s.get("ttft_p99", math.nan),
            "slo_attainment": self.slo_attainment(),
            "slo_attainment_completed": s.get("slo_attainment", math.nan),
            "hit_rate": s.get("hit_rate", math.nan) if self.followed_results else math.nan,
            "overhead_p50_ms": _pct(over, 50),
            "overhead_p99_ms": _pct(over, 99),
            "overhead_mean_ms": float(over.mean()) if over.size else math.nan,
            "reconfigurations": (reconfigurations(self.changes) if self.followed_epochs
                                 else None),
            "reconfigurations_warmup": (reconfigurations(self.changes, warmup=True)
                                        if self.followed_epochs else None),
            "time_scale": self.time_scale,
            "worker_time_scales": self.worker_time_scales(),
            "ttft_unit": "modelled seconds (wall / time_scale)",
            "slo": slo_to_dict(self.slo),
            "prediction_mape": s.get("prediction_mape", math.nan),
            "gpu_seconds": s.get("gpu_seconds", math.nan),
            "per_degree": per_degree,
            "wall_mean_ttft_s": float(np.mean([r.ttft_s for r in ok])) if ok else math.nan,
            "wall_mean_client_s": float(np.mean([r.client_s for r in ok])) if ok else math.nan,
            "errors": _error_counts(failed),
            "retried": sum(1 for r in self.records if r.retries),
            "composition": [
                {"epoch": c.epoch, "at_s": c.at_s, "workers": list(c.workers),
                 "label": c.label(), "reason": c.reason} for c in self.changes
            ],
            "faults": [dict(f) for f in self.faults],
            # Completed requests of TP workers, which the cost-model error leaves out.
            "prediction_mape_tp_requests": sum(1 for r in ok if r.worker_id
                                               and _kind(r.worker_id) == "TP"),
        }
        if self.serving:
            # Not "0 requests": the stack's own record of external requests is none at all.
            out.update(dict.fromkeys(("requests", "completed", "failed", "unanswered",
                                      "input_tokens", "failed_input_tokens", "retried")),
                       served_external=True)
        out.update(self.meta)
        return out

    def worker_time_scales(self) -> list[float]:
        """The time scales the answering workers reported (sorted, distinct). One equal to
        :attr:`time_scale` is the consistent case; any other means the modelled-second
        figures are off by their ratio (a replay's ``--time-scale`` not the workers')."""
        return sorted({r.worker_time_scale for r in self.records
                       if r.ok and r.worker_time_scale is not None})

    def render(self, console: Console) -> None:
        s = self.summary()
        other = [x for x in s["worker_time_scales"]
                 if not math.isclose(x, self.time_scale, rel_tol=1e-9)]
        if other:
            console.print(f"[bold yellow]warning:[/] the workers ran at time scale "
                          f"{', '.join(f'{x:g}' for x in other)}, this report divides by "
                          f"{self.time_scale:g}: its modelled seconds are off by that ratio "
                          "(give replay the workers' --time-scale)")
        t = Table(title=f"TTFT, modelled seconds (wall ÷ time scale {self.time_scale:g})"
                  + ("; up --serve: the stack served external traffic" if self.serving else ""))
        t.add_column("metric")
        t.add_column("value", justify="right")
        if self.serving:
            requests_row = ("requests", "not measured: the stack served external traffic "
                            f"({s.get('results_seen', 0)} results seen on the bus); each "
                            "replay's own report has its requests and TTFTs")
        else:
            requests_row = ("requests / completed / failed (no response)",
                            f"{s['requests']} / {s['completed']} / {s['failed']} "
                            f"({s['unanswered']})")
        mape = _f(s["prediction_mape"], pct=True)
        if s["prediction_mape_tp_requests"] and not math.isfinite(s["prediction_mape"]):
            mape += " (TP workers: the CP profile does not describe them)"
        rows = [
            requests_row,
            ("TTFT mean (completed)", _f(s["mean_ttft_s"])),
            ("TTFT P50 (completed)", _f(s["p50_ttft_s"])),
            ("TTFT P90 (completed)", _f(s["p90_ttft_s"])),
            ("TTFT P99 (completed)", _f(s["p99_ttft_s"])),
            (f"SLO attainment (token-weighted, {self.slo.name}; all requests, failed = miss)",
             _f(s["slo_attainment"], pct=True)
             + (f" (completed only {_f(s['slo_attainment_completed'], pct=True)})"
                if s["failed"] else "")),
            ("prefix hit rate (tokens)", _f(s["hit_rate"], pct=True)
             + ("" if self.followed_results else " (not measured: give --nats URL)")),
            ("overhead P50 / P99 (wall ms)",
             f"{_f(s['overhead_p50_ms'], 1)} / {_f(s['overhead_p99_ms'], 1)}"),
            ("cost-model error (MAPE)", mape),
            ("reconfigurations" + (" (of the external traffic)" if self.serving else ""),
             "– (not followed)" if s["reconfigurations"] is None
             else str(s["reconfigurations"])),
        ]
        if "cache_commands" in s:
            cm = s.get("cache_manager") or {}
            pulls, lost = cm.get("pulls", 0), cm.get("demotes_failed", 0)
            rows.append(("cache commands", (", ".join(
                f"{n} {op}" for op, n in s["cache_commands"].items()) or "none")
                + (f" ({pulls} route-time pulls among the replicates)" if pulls else "")
                # A failed demote only leaves a pull's source copy recent: said, not an error.
                + (f" ({lost} demotes failed)" if lost else "")))
        notices = (s.get("cache_manager") or {}).get("reconciled_notices", 0)
        if notices:
            # J's credit of a pending prefix (a split's or merge's reconcile, §6.2).
            sc = s.get("scheduler_cache") or {}
            rows.append(("pending prefixes", (
                f"{notices} reconcile notice{'s' if notices != 1 else ''} published, "
                f"{sc.get('reconciled_applied', 0)} marked by the schedulers, "
                f"{sc.get('pending_credited', 0)} placements counted on one")))
        for k, v in rows:
            t.add_row(k, v)
        console.print(t)
        if s["per_degree"]:
            d = Table(title="per degree")
            for col in ("degree", "requests", "mean TTFT", "hit rate"):
                d.add_column(col, justify="right")
            kinds = {_degree(r.worker_id): _kind(r.worker_id) for r in self.records
                     if r.ok and r.worker_id}
            for deg, v in s["per_degree"].items():
                d.add_row(f"{kinds.get(deg, 'CP')}{deg}", str(v["requests"]), _f(v["ttft_mean"]),
                          _f(v["hit_rate"], pct=True))
            console.print(d)
        if self.changes:
            during = "while serving" if self.serving else "during the replay"
            c = Table(title=f"composition changes ({s['reconfigurations']} {during}"
                            f", {s['reconfigurations_warmup']} in warm-up)")
            for col in ("epoch", "at (wall s)", "composition", "change"):
                c.add_column(col)
            prev: CompositionChange | None = None
            for ch in self.changes:
                # Drain / expose records change lifecycles only: one row per worker-set change.
                if prev is not None and set(prev.workers) == set(ch.workers):
                    continue
                when = f"{ch.at_s:.1f}" if ch.at_s >= 0 else "warm-up"
                c.add_row(str(ch.epoch), when, ch.label(),
                          describe_change(prev, ch) if prev else "initial")
                prev = ch
            console.print(c)
        elif s.get("interrupted_during"):
            # The controller writes the first record once the stack is healthy: none yet.
            # (Before the observer existed none was followed either: not a replay's --nats.)
            console.print(f"composition: no epoch record yet (interrupted during "
                          f"{s['interrupted_during']})")
        elif not self.followed_epochs:
            console.print("composition: not followed (give --nats URL to follow the epoch "
                          "records)")
        else:
            console.print("composition: no epoch record observed (no controller running?)")
        if s["faults"]:
            console.print("faults and restarts (wall s after the replay start): "
                          + describe_faults(s["faults"]))
        if s.get("services_killed"):
            # A fault the run asked for, but the rest of it ran without that service: not a
            # clean run (up exits 1).
            console.print(f"[red]down at the end: {', '.join(s['services_killed'])} (killed by "
                          "--kill-at and never started again: no --restart-after, or the "
                          "replay ended before it)")
        recovery = s.get("scheduler_recovery") or {}
        if any(recovery.values()):
            console.print("scheduler recovery (replicas running at the end; a killed process' "
                          "counts went with it): " + ", ".join(
                              f"{recovery[k]} {what}" for k, what in RECOVERY_COUNTERS
                              if recovery.get(k)))
        if s["retried"]:
            console.print(f"sent again by the client (connection refused or dropped: a gateway "
                          f"restarting): {s['retried']} requests")
        if s["errors"]:
            console.print("errors: " + "; ".join(f"{n}× {e}" for e, n in s["errors"].items()))


def _error_counts(failed: Sequence[ReplayRecord]) -> dict[str, int]:
    """Failures by message, the request's own id replaced by ``<id>``: the services name the
    request in their errors ("no eligible worker for request 'x' ..."), which would otherwise
    list one line per request."""
    out: dict[str, int] = {}
    for r in failed:
        msg = r.error or f"HTTP {r.status}"
        if r.request_id:
            msg = msg.replace(r.request_id, "<id>")
        key = msg[:120]
        out[key] = out.get(key, 0) + 1
    return out


def _f(v: Any, digits: int = 3, *, pct: bool = False) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "–"
    return f"{100 * v:.1f}%" if pct else f"{v:.{digits}f}"


__all__ = ["REQUIRED_KEYS", "CompositionChange", "LiveReport", "describe_change",
           "reconfigurations"]
