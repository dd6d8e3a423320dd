"""A scheduler replica's metrics: where its placements go, and what it could not place.

===================================  =======  ===============================================
name                                 kind     attributes
===================================  =======  ===============================================
``vtm.scheduler.placements``         counter  ``policy``, ``degree`` (chosen worker's),
                                              ``preferred_degree`` (§7.1 PreferDegree)
``vtm.scheduler.unplaced``           counter  -: deliveries with no eligible worker after the
                                              hold (retried or failed with 503)
``vtm.scheduler.refused``            counter  -: requests longer than every worker's
                                              max_seq_len, refused at once (422)
===================================  =======  ===============================================

``degree`` against ``preferred_degree`` shows how often the pool's composition, not the
request, chose the degree: the controller's signal to split or merge.
"""

from __future__ import annotations

from services.scheduler.decision import Decision
from shared.metrics import meter


class SchedulerMetrics:
    def __init__(self) -> None:
        m = meter()
        self.placements = m.create_counter(
            "vtm.scheduler.placements", unit="{request}",
            description="Requests placed, by policy, chosen degree and preferred degree")
        self.unplaced = m.create_counter(
            "vtm.scheduler.unplaced", unit="{delivery}",
            description="Intake deliveries that found no eligible worker")
        self.refused_too_long = m.create_counter(
            "vtm.scheduler.refused", unit="{request}",
            description="Requests refused at once: longer than every worker's max_seq_len")

    def placed(self, decision: Decision) -> None:
        self.placements.add(1, {"policy": decision.policy, "degree": str(decision.degree),
                                "preferred_degree": str(decision.preferred_degree)})

    def no_worker(self) -> None:
        self.unplaced.add(1)

    def refused(self) -> None:
        self.refused_too_long.add(1)


__all__ = ["SchedulerMetrics"]
