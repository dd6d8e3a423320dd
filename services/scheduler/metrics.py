"""A scheduler replica's metrics: where its placements go, what it could not place, and what it
had to try again.

===================================  =======  ===============================================
name                                 kind     attributes
===================================  =======  ===============================================
``vtm.scheduler.placements``         counter  ``policy``, ``degree`` (chosen worker's),
                                              ``preferred_degree`` (§7.1 PreferDegree)
``vtm.scheduler.unplaced``           counter  -: deliveries with no eligible worker after the
                                              hold (retried or failed with 503)
``vtm.scheduler.refused``            counter  -: requests longer than every worker's
                                              max_seq_len, refused at once (422)
``vtm.scheduler.retries``            counter  ``reason`` (:class:`RetryReason`): deliveries
                                              NAK'ed for another try (``retry_delay_s``)
``vtm.scheduler.redeliveries``       counter  -: intake deliveries after a message's first
                                              (a NAK, an expired ``ack_wait``, a give-back)
``vtm.scheduler.handbacks``          counter  ``cause`` (``lost_restarted``, ``lost_silent``,
                                              ``gone``): requests this replica handed back
                                              to intake on a lost or gone worker's behalf
``vtm.scheduler.redirects``          counter  -: new intake messages of a request this
                                              replica had placed (a draining worker's
                                              hand-back, this replica's own hand-back for
                                              a lost worker -- also in ``handbacks`` --
                                              or a client reusing its id)
===================================  =======  ===============================================

``degree`` against ``preferred_degree`` shows how often the pool's composition, not the
request, chose the degree: the controller's signal to split or merge. The counters mirror the
replica's ``retried``, ``lost_handed_back`` / ``gone_handed_back`` and ``redirected`` stats
(``nats micro stats vtm-scheduler``), which a restart resets; a retry's wait is intake wait in
``vtm.request.stage`` and in the trace (``intake_wait`` with ``vtm.retry``) alike.
"""

from __future__ import annotations

from enum import StrEnum

from services.scheduler.decision import Decision
from shared.metrics import meter


class RetryReason(StrEnum):
    """Why a delivery was NAK'ed (``vtm.scheduler.retries{reason}``)."""

    NO_ELIGIBLE_WORKER = "no_eligible_worker"  # none after the hold
    WORKER_REFUSED = "worker_refused"  # a micro error other than 410 / 425, or a bad reply
    WORKER_UNREACHABLE = "worker_unreachable"  # a first send found no responder
    OUTCOME_UNKNOWN = "outcome_unknown"  # timed out (or a re-send found no responder)
    HANDING_BACK = "handing_back"  # 425: the worker is handing it back to intake
    HANDBACK_FAILED = "handback_failed"  # the hand-back for a gone worker failed to publish


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
        self.retries = m.create_counter(
            "vtm.scheduler.retries", unit="{delivery}",
            description="Intake deliveries NAK'ed for another try, by reason")
        self.redeliveries = m.create_counter(
            "vtm.scheduler.redeliveries", unit="{delivery}",
            description="Intake deliveries after a message's first")
        self.handbacks = m.create_counter(
            "vtm.scheduler.handbacks", unit="{request}",
            description="Requests handed back to intake on a lost or gone worker's behalf")
        self.redirects = m.create_counter(
            "vtm.scheduler.redirects", unit="{request}",
            description="New intake messages of a request this replica had placed")

    def placed(self, decision: Decision) -> None:
        self.placements.add(1, {"policy": decision.policy, "degree": str(decision.degree),
                                "preferred_degree": str(decision.preferred_degree)})

    def no_worker(self) -> None:
        self.unplaced.add(1)

    def refused(self) -> None:
        self.refused_too_long.add(1)

    def retried(self, reason: RetryReason) -> None:
        self.retries.add(1, {"reason": str(reason)})

    def redelivered(self) -> None:
        self.redeliveries.add(1)

    def handed_back(self, cause: str) -> None:
        self.handbacks.add(1, {"cause": str(cause)})

    def redirected(self) -> None:
        self.redirects.add(1)


__all__ = ["RetryReason", "SchedulerMetrics"]
