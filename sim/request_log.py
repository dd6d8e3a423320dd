"""Each simulated request's TTFT and where it went: the per-request log of a sweep cell.

``vertumnus simulate --requests`` writes one CSV a (policy, rate, seed) cell into
``DIR/requests/`` (:func:`log_name`), one row a request of the trace in arrival order
(:data:`REQUEST_KEYS`), so that a user can take a run apart as the tracing UI takes a live
request apart: how long it queued, how long its prefill ran, how long the KV hand-off and first
decode step took, how much of its prompt it reused, and whether it met its deadline.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from shared.slo import SloTable
from sim.metrics import failure_reason
from sim.simulator import RequestRecord

REQUEST_KEYS: Final[tuple[str, ...]] = (
    "request_id", "arrival_s", "input_len", "worker", "degree", "reused_tokens",
    "queue_s", "prefill_s", "handoff_s", "ttft_s", "deadline_s", "met_slo",
    "predicted_s", "redirected", "warmup", "failed", "failed_reason",
)
"""The columns, seconds of simulated time.

* ``queue_s``: arrival to the start of its prefill (the worker's queue, a wait for a pulled
  prefix, a redirection after a drain); ``prefill_s``: the prefill itself (the ground truth's
  time); ``handoff_s``: the rest of the TTFT, the KV hand-off to decode and the first decode
  step. ``queue_s + prefill_s + handoff_s == ttft_s``.
* ``deadline_s``: the SLO's deadline for its length; ``met_slo``: ``ttft_s <= deadline_s``.
* ``predicted_s``: the scheduler's Ê for its prefill (what J priced); ``redirected``: how
  often a drain sent it elsewhere; ``warmup``: it arrived within the warm-up the figures leave
  out; ``failed``: why it never completed ('' when it did; its times are then empty), the
  scheduler's message; ``failed_reason``: the same as the results' ``failed_by_reason`` key
  (``no_memory``, ``too_long``, ...; '' when it completed). A log written before this column
  has the message alone: :func:`logged_failure_reason` reads either.
"""


def log_name(policy: str, rate_scale: float, seed: int) -> str:
    """The file of one cell: ``<policy>_x<rate>_seed<seed>.csv`` (``/`` in a pool name as
    ``-``)."""
    return f"{policy.replace('/', '-')}_x{rate_scale:g}_seed{seed}.csv"


def request_rows(records: Iterable[RequestRecord], slo: SloTable,
                 warmup_s: float = 0.0) -> list[dict[str, Any]]:
    """One :data:`REQUEST_KEYS` row per record, in the records' order. ``warmup_s``: records
    arriving within that long of the first arrival are marked ``warmup`` (as
    :func:`sim.experiments.summarize_run` leaves them out)."""
    recs = list(records)
    start = min((r.arrival_s for r in recs), default=0.0) + warmup_s
    rows: list[dict[str, Any]] = []
    for r in recs:
        done = r.ttft_s >= 0
        deadline = slo.deadline(r.input_len)
        rows.append({
            "request_id": r.request_id, "arrival_s": r.arrival_s, "input_len": r.input_len,
            "worker": r.worker, "degree": r.degree or None, "reused_tokens": r.reused_tokens,
            "queue_s": r.queue_s if done else None,
            "prefill_s": r.prefill_s if done else None,
            "handoff_s": r.handoff_s if done else None,
            "ttft_s": r.ttft_s if done else None,
            "deadline_s": deadline, "met_slo": done and r.ttft_s <= deadline,
            "predicted_s": r.predicted_s, "redirected": r.redirected,
            "warmup": warmup_s > 0 and r.arrival_s < start, "failed": r.failed,
            "failed_reason": r.failed_reason,
        })
    return rows


def write_request_log(path: Path, rows: Iterable[Mapping[str, Any]]) -> None:
    """``rows`` (:func:`request_rows`) as CSV at ``path`` (None as an empty cell)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(REQUEST_KEYS))
        w.writeheader()
        for row in rows:
            w.writerow(row)


def logged_failure_reason(row: Mapping[str, str]) -> str:
    """Why the request of ``row`` (a per-request log's row as :class:`csv.DictReader` reads it)
    failed, as the results' ``failed_by_reason`` key: its ``failed_reason`` cell, or, in a log
    written before that column (or a row without the key), :func:`sim.metrics.failure_reason`
    of its ``failed`` text ('' for a request that completed)."""
    key = row.get("failed_reason") or ""
    if key:
        return key
    failed = row.get("failed") or ""
    return failure_reason(failed) if failed else ""
