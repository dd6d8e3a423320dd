"""Typed errors of the request-level scheduler core.

Every error is a subclass of the shared :class:`~shared.ids.VertumnusError` family, so an adapter
can map the whole family to one micro-service error code. NOTE: a core call that raises one of
these has changed nothing (validate first, then mutate).
"""

from __future__ import annotations

from collections.abc import Mapping

from services.scheduler.decision import Exclusion
from shared.ids import InvalidInput, RequestId, VertumnusError, WorkerId


def _in_scheduler_order(found: set[Exclusion]) -> tuple[Exclusion, ...]:
    """``found`` in :class:`Exclusion`'s declaration order (the order a failure's reason key
    names them in, e.g. ``too_long+no_memory``)."""
    return tuple(e for e in Exclusion if e in found)


class NoEligibleWorker(VertumnusError):
    """No worker may serve the request; ``reasons`` names why each one was excluded (§5.2).

    ``reasons`` maps each worker of the view to its :class:`Exclusion` (the exclusion's text,
    ``str(Exclusion.X)``, is accepted as the same thing; any other text is a ValueError). The
    exception keeps them as data, so that a caller never has to read its message:

    * ``reasons``: worker → the exclusion's text (plain ``str``, as the message prints it);
    * ``exclusions``: the distinct exclusions, in :class:`Exclusion`'s order;
    * ``no_workers``: the view had no workers at all (``exclusions`` is then empty).

    The message is for people and may be reworded; these attributes are the contract.
    """

    def __init__(self, request_id: RequestId,
                 reasons: Mapping[WorkerId, Exclusion | str]) -> None:
        self.request_id = request_id
        # Exclusion(text) is the member itself for a member, its member for its text.
        excluded = {w: Exclusion(r) for w, r in reasons.items()}
        self.reasons: dict[WorkerId, str] = {w: str(e) for w, e in excluded.items()}
        self.exclusions: tuple[Exclusion, ...] = _in_scheduler_order(set(excluded.values()))
        self.no_workers: bool = not excluded
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
    it" (the simulator) keeps working; ``reasons`` names every worker with the TOO_LONG text,
    ``exclusions`` is ``(Exclusion.TOO_LONG,)`` (whatever ``reasons`` holds: the request is too
    long for every worker) and ``no_workers`` is False. ``max_seq_len`` is the largest limit
    among those workers.
    """

    def __init__(self, request_id: RequestId, length: int, max_seq_len: int,
                 reasons: Mapping[WorkerId, Exclusion | str]) -> None:
        self.request_id = request_id
        self.reasons = {w: str(Exclusion(r)) for w, r in reasons.items()}
        self.exclusions = (Exclusion.TOO_LONG,)
        self.no_workers = False
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
