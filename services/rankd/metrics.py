"""A rank daemon's metrics: its prefills against the cost model, its queue and its KV cache.

======================================  =============  ==========================================
name                                    kind           attributes
======================================  =============  ==========================================
``vtm.worker.prefill``                  histogram (s)  ``worker``, ``degree``: measured prefill
``vtm.worker.prediction_ratio``         histogram      ``degree``: measured ÷ the scheduler's
                                                       Ê_C(R, P) (1 = the fitted cost model is
                                                       right; drift shows as a shifted ratio)
``vtm.worker.queue``                    gauge          ``worker``: requests queued or running
``vtm.worker.kv_blocks``                gauge          ``worker``: KV blocks its cache holds
``vtm.worker.kv_capacity``              gauge          ``worker``: KV blocks it may hold
======================================  =============  ==========================================

Prefill times are the backend's measured wall seconds divided by the worker's time scale (the
modelled seconds Ê_C predicts; equal at scale 1).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from opentelemetry.metrics import Observation

from services.rankd.core import WorkerCore
from shared.metrics import duration_histogram, meter, observe_gauge

RATIO_BUCKETS: Final[tuple[float, ...]] = (0.5, 0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25,
                                           1.5, 2.0, 3.0, 5.0)
"""Bucket bounds of measured ÷ predicted: fine around 1."""


class WorkerMetrics:
    """The instruments above for one worker (``core``: its :class:`WorkerCore`)."""

    def __init__(self, core: WorkerCore) -> None:
        self.core = core
        self.prefill = duration_histogram(
            "vtm.worker.prefill", "Measured prefill time of each request (modelled seconds)")
        self.ratio = meter().create_histogram(
            "vtm.worker.prediction_ratio", unit="1",
            description="Measured prefill time over the scheduler's prediction",
            explicit_bucket_boundaries_advisory=list(RATIO_BUCKETS))
        for name, unit, desc, fn in (
            ("vtm.worker.queue", "{request}", "Requests queued or running at the worker",
             WorkerMetrics._queue),
            ("vtm.worker.kv_blocks", "{block}", "KV blocks the worker's cache holds",
             WorkerMetrics._kv_blocks),
            ("vtm.worker.kv_capacity", "{block}", "KV blocks the worker's cache may hold",
             WorkerMetrics._kv_capacity),
        ):
            observe_gauge(name, unit, desc, self, fn)

    def _attrs(self) -> dict[str, str]:
        return {"worker": self.core.worker_id}

    def _queue(self) -> Iterable[Observation]:
        c = self.core
        return [Observation(len(c.queued) + (c.running is not None), self._attrs())]

    def _kv_blocks(self) -> Iterable[Observation]:
        cache = self.core.cache
        return [] if cache is None else [Observation(len(cache), self._attrs())]

    def _kv_capacity(self) -> Iterable[Observation]:
        return [Observation(self.core.kv_total_blocks, self._attrs())]

    def prefilled(self, degree: int, measured_s: float, predicted_s: float) -> None:
        """One prefill done: ``measured_s`` (modelled seconds) against ``predicted_s``."""
        self.prefill.record(measured_s, {"worker": self.core.worker_id, "degree": str(degree)})
        if predicted_s > 0:
            self.ratio.record(measured_s / predicted_s, {"degree": str(degree)})


__all__ = ["RATIO_BUCKETS", "WorkerMetrics"]
