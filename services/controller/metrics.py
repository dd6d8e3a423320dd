"""The controller's metrics: the pool's composition and each reconfiguration's timings.

==========================================  ==============  ================================
name                                        kind            attributes
==========================================  ==============  ================================
``vtm.pool.workers``                        gauge           ``degree`` (workers of the
                                                            committed composition; reported
                                                            by the leading controller only)
``vtm.pool.reconfigurations``               counter         ``kind`` (split, merge),
                                                            ``outcome`` (exposed, aborted)
``vtm.pool.reconfiguration.drain``          histogram (s)   ``kind``
``vtm.pool.reconfiguration.switch``         histogram (s)   ``kind``
==========================================  ==============  ================================

Times are the controller's wall clock (§8's drain and switch: started → drained → exposed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from opentelemetry.metrics import Observation

from services.controller.lifecycle import Reconfiguration
from shared.metrics import duration_histogram, meter, observe_gauge


class PoolMetrics:
    """The instruments above; ``composition()`` gives workers per degree now, or None while
    this controller does not lead (then the gauge reports nothing)."""

    def __init__(self, composition: Callable[[], Mapping[int, int] | None]) -> None:
        m = meter()
        self._composition = composition
        observe_gauge("vtm.pool.workers", "{worker}",
                      "Workers of each CP degree in the committed composition",
                      self, PoolMetrics._observe)
        self.reconfigurations = m.create_counter(
            "vtm.pool.reconfigurations", unit="{reconfiguration}",
            description="Splits and merges that finished (exposed) or were aborted")
        self.drain = duration_histogram(
            "vtm.pool.reconfiguration.drain", "Seconds from a split/merge's start to its "
            "sources' last in-flight prefill")
        self.switch = duration_histogram(
            "vtm.pool.reconfiguration.switch", "Seconds from drained to the new workers "
            "being schedulable (epoch commit, every rank's ack, exposure)")

    def _observe(self) -> Iterable[Observation]:
        counts = self._composition()
        if not counts:
            return []
        return [Observation(n, {"degree": str(c)}) for c, n in sorted(counts.items())]

    def ended(self, r: Reconfiguration) -> None:
        """A reconfiguration exposed or aborted (its snapshot)."""
        kind = {"kind": r.kind.value}
        self.reconfigurations.add(
            1, {**kind, "outcome": "aborted" if r.aborted_at is not None else "exposed"})
        if r.drain_s is not None:
            self.drain.record(r.drain_s, kind)
        if r.switch_s is not None:
            self.switch.record(r.switch_s, kind)


__all__ = ["PoolMetrics"]
