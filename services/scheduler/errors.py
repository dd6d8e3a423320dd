"""Typed errors of the request-level scheduler core.

Every error is a subclass of the shared :class:`~shared.ids.VertumnusError` family, so an adapter
can map the whole family to one micro-service error code. NOTE: a core call that raises one of
these has changed nothing (validate first, then mutate).
"""

from __future__ import annotations

from collections.abc import Mapping

from shared.ids import InvalidInput, RequestId, VertumnusError, WorkerId


class NoEligibleWorker(VertumnusError):
    """No worker may serve the request; ``reasons`` names why each one was excluded (§5.2)."""

    def __init__(self, request_id: RequestId, reasons: Mapping[WorkerId, str]) -> None:
        self.request_id = request_id
        self.reasons: dict[WorkerId, str] = dict(reasons)
        if self.reasons:
            detail = "; ".join(f"{w}: {r}" for w, r in sorted(self.reasons.items()))
        else:
            detail = "the cluster view has no workers"
        super().__init__(f"no eligible worker for request {request_id!r} ({detail})")


class SequenceTooLong(NoEligibleWorker):
    """The request is longer than the ``max_seq_len`` of *every* worker the view holds, whatever
    their lifecycle: unlike a worker that is draining, switching, unavailable or short of KV,
    this does not pass, so the request must be refused rather than held and retried.

    A subclass of :class:`NoEligibleWorker` so that a caller that only knows "nothing may serve
    it" (the simulator) keeps working; ``reasons`` names every worker with the TOO_LONG text.
    ``max_seq_len`` is the largest limit among those workers.
    """

    def __init__(self, request_id: RequestId, length: int, max_seq_len: int,
                 reasons: Mapping[WorkerId, str]) -> None:
        self.request_id = request_id
        self.reasons = dict(reasons)
        self.length = length
        self.max_seq_len = max_seq_len
        # Not NoEligibleWorker's per-worker list: the one number a client can act on.
        VertumnusError.__init__(
            self, f"prompt of {length} tokens is longer than every worker's max_seq_len "
            f"({max_seq_len} at most)")


class UnknownPolicy(InvalidInput):
    """A policy name that is not in the registry; the message lists the known ones."""


class DuplicateRequest(InvalidInput):
    """A request id reserved twice on a worker (or placed twice by the scheduler)."""


class UnknownRequest(InvalidInput):
    """A request id the load tracker (or scheduler) has no record of."""


class IllegalTransition(InvalidInput):
    """A request operation that its current state forbids (start twice, withdraw a running one)."""
