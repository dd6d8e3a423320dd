"""The gateway's metrics: every completion's outcome, TTFT by stage, reuse and SLO attainment.

The gateway is where a request's first token comes back with its stages (the ``FirstToken``
the worker published), so the request-path metrics are recorded here, once per request:

==============================  =========  ===========================================
name                            kind       attributes
==============================  =========  ===========================================
``vtm.gateway.completions``     counter    ``status`` (HTTP status answered), ``entry``
``vtm.request.ttft``            histogram  ``degree`` (s; arrival → first token)
``vtm.request.stage``           histogram  ``stage`` (s; each TTFT stage, design.md)
``vtm.request.input_tokens``    counter    ``degree``
``vtm.request.reused_tokens``   counter    ``degree`` (prefix-cache hits)
``vtm.request.slo_tokens``      counter    ``degree`` (tokens of requests that met τ(L))
==============================  =========  ===========================================

So a dashboard reads the token-level hit rate as reused / input tokens and the token-weighted
SLO attainment (design.md "Metrics") as slo / input tokens, under the gateway's
``VTM_SLO`` deadlines. ``degree`` is the serving worker's GPU count ("?" when its id is not a
lattice worker's).
"""

from __future__ import annotations

from typing import Final

from shared.ids import InvalidInput
from shared.metrics import duration_histogram, meter
from shared.schemas import FirstToken
from shared.slo import SloTable
from shared.worker import GpuGroup

STAGES: Final[tuple[str, ...]] = ("intake_wait", "schedule", "queue_wait", "prefill",
                                  "kv_transfer", "first_decode")
"""The stages of ``TtftStages`` recorded (their fields without ``_s``; ``total_s`` is the TTFT
histogram)."""


def degree_label(worker_id: str | None) -> str:
    """The GPU count of a worker id, as an attribute value ("?" if it names no group)."""
    if not worker_id:
        return "?"
    try:
        return str(GpuGroup.from_worker_id(worker_id).degree)
    except InvalidInput:
        return "?"


class RequestMetrics:
    """The instruments above; ``slo`` gives the deadlines ``vtm.request.slo_tokens`` counts."""

    def __init__(self, slo: SloTable) -> None:
        m = meter()
        self.slo = slo
        self.completions = m.create_counter(
            "vtm.gateway.completions", unit="{request}",
            description="Completion requests answered, by HTTP status and entry (http, nats)")
        self.ttft = duration_histogram(
            "vtm.request.ttft", "Time to first token of answered requests")
        self.stage = duration_histogram(
            "vtm.request.stage", "Time spent in each TTFT stage of answered requests")
        self.input_tokens = m.create_counter(
            "vtm.request.input_tokens", unit="{token}",
            description="Prompt tokens of answered requests")
        self.reused_tokens = m.create_counter(
            "vtm.request.reused_tokens", unit="{token}",
            description="Prompt tokens served from a prefix cache")
        self.slo_tokens = m.create_counter(
            "vtm.request.slo_tokens", unit="{token}",
            description="Prompt tokens of requests whose TTFT met the SLO deadline τ(L)")

    def answered(self, result: FirstToken, input_len: int, ttft_s: float, entry: str) -> None:
        """One request answered with its first token after ``ttft_s``."""
        deg = {"degree": degree_label(result.worker_id)}
        self.completions.add(1, {"status": "200", "entry": entry})
        self.ttft.record(ttft_s, deg)
        st = result.stages
        for name in STAGES:
            self.stage.record(getattr(st, f"{name}_s"), {"stage": name})
        self.input_tokens.add(input_len, deg)
        self.reused_tokens.add(min(result.prefix_tokens or 0, input_len), deg)
        if ttft_s <= self.slo.deadline(input_len):
            self.slo_tokens.add(input_len, deg)

    def refused(self, status: int, entry: str) -> None:
        """One request answered with an error status (bad input, unavailable, timeout, …)."""
        self.completions.add(1, {"status": str(status), "entry": entry})


__all__ = ["STAGES", "RequestMetrics", "degree_label"]
