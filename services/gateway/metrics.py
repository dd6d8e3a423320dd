"""The gateway's metrics: every completion's outcome, TTFT by stage, reuse and SLO attainment.

The gateway is where a request's first token comes back with its stages (the ``FirstToken``
the worker published), so the request-path metrics are recorded here, once per request:

==============================  =========  ===========================================
name                            kind       attributes
==============================  =========  ===========================================
``vtm.gateway.completions``     counter    ``status`` (HTTP status answered), ``entry``
``vtm.request.ttft``            histogram  ``degree`` (s; arrival → first token)
``vtm.request.stage``           histogram  ``stage`` (s; each TTFT stage, design.md)
``vtm.request.input_tokens``    counter    ``degree``, ``status`` (every tokenized prompt)
``vtm.request.reused_tokens``   counter    ``degree`` (prefix-cache hits)
``vtm.request.slo_tokens``      counter    ``degree`` (tokens of requests that met τ(L))
==============================  =========  ===========================================

``vtm.request.input_tokens`` counts the prompt of every request whose length is known, answered
or not: a request refused or failed after its prompt was tokenized (503 unavailable, 504 no
first token in time, 500, a 413 / 422 prompt over a limit) is counted with its HTTP ``status``
and ``degree`` "?" and never in ``slo_tokens``, so it is a miss. So a dashboard reads the
token-weighted SLO attainment (design.md "Metrics": Σ L·[TTFT ≤ τ(L)] / Σ L over *all* the
requests, a failed one a miss, as the simulator counts it) as slo / input tokens (every
``status``), under the gateway's ``VTM_SLO`` deadlines, and the token-level hit rate as reused /
input tokens of answered requests (``status="200"``). A request rejected before its prompt was
tokenized (a malformed body, ``stream=true``, a text prompt without a tokenizer: 400 / 422) has
no known length and is counted in ``vtm.gateway.completions`` only. An HTTP client that closed
its connection before its first token is counted with ``status="499"`` (nginx's "client
closed request"; no answer is sent): a miss too, which a dashboard may leave out by status.
``degree`` is the serving worker's GPU count ("?" when its id is not a lattice worker's, or no
worker served it).
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
            description="Prompt tokens of requests whose prompt was tokenized, by HTTP status "
                        "(answered: 200; refused or failed: the error's)")
        self.reused_tokens = m.create_counter(
            "vtm.request.reused_tokens", unit="{token}",
            description="Prompt tokens served from a prefix cache")
        self.slo_tokens = m.create_counter(
            "vtm.request.slo_tokens", unit="{token}",
            description="Prompt tokens of requests whose TTFT met the SLO deadline τ(L)")

    def answered(self, result: FirstToken, input_len: int, ttft_s: float, entry: str) -> None:
        """One request answered with its first token after ``ttft_s`` (wall seconds, as the
        ``VTM_SLO`` deadlines are read here)."""
        deg = {"degree": degree_label(result.worker_id)}
        self.completions.add(1, {"status": "200", "entry": entry})
        self.ttft.record(ttft_s, deg)
        st = result.stages
        for name in STAGES:
            self.stage.record(getattr(st, f"{name}_s"), {"stage": name})
        self.input_tokens.add(input_len, {**deg, "status": "200"})
        self.reused_tokens.add(min(result.prefix_tokens or 0, input_len), deg)
        if ttft_s <= self.slo.deadline(input_len):
            self.slo_tokens.add(input_len, deg)

    def refused(self, status: int, entry: str, input_len: int | None = None) -> None:
        """One request answered with an error status (bad input, unavailable, timeout, …).

        ``input_len``: the prompt's length in tokens if it was tokenized before the request
        failed; its tokens are then counted in ``vtm.request.input_tokens`` (this ``status``,
        degree "?") and not in ``vtm.request.slo_tokens``: the SLO attainment counts it as a
        miss. None (rejected before its length was known: a malformed body, ``stream=true``, a
        text prompt without a tokenizer): counted in ``vtm.gateway.completions`` only, as no
        token count exists to weigh it by.
        """
        code = str(status)
        self.completions.add(1, {"status": code, "entry": entry})
        if input_len is not None and input_len > 0:
            self.input_tokens.add(input_len, {"degree": degree_label(None), "status": code})


__all__ = ["STAGES", "RequestMetrics", "degree_label"]
