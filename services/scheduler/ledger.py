"""Requests a scheduler replica dispatched and has not seen answered: what a lost worker takes
with it (pure bookkeeping, no IO).

A worker whose process dies takes its queue with it: the requests it had admitted produce no
first token, and the replica that dispatched them would keep their reservations (its q_w for
that worker) forever. The replica therefore remembers each request it dispatched -- the intake
message it came from, the worker and the worker's *incarnation* that admitted it
(``AssignmentAck.incarnation``) -- until its first token (or an error result) arrives, and asks
:meth:`DispatchLedger.lost` which of them a worker can no longer answer:

* **restarted**: the incarnation that admitted the request was *retired* -- the adapter saw
  the worker's state change from it to another one (a rank daemon restarted under the same
  worker id): its queue started empty, so the request is gone for certain (unless the new
  incarnation lists it: the adapter asks). Only a retired incarnation counts, not merely one
  that differs from the state in view: an AssignmentAck of the new process can arrive before
  its first state does, and its requests are not lost;
* **silent**: the worker's heartbeat is older than the lease (or its state is gone from a
  loaded view): the adapter asks the worker's ``queue`` endpoint, and only if nobody answers
  is the request given up on -- a worker whose heartbeats stopped reaching the bucket but that
  still answers is alive and will finish it.

The adapter hands a lost request back to intake under the id the worker itself would have
used (``handback_msg_id``), so a hand-back the worker did make before it died and this one are
one intake message. Bounded: at most ``limit`` requests are remembered (the oldest is forgotten
first; a forgotten request is only not recovered, nothing else changes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Final

from shared.schemas import IntakeRequest, WorkerState

LEDGER_LIMIT: Final[int] = 65536
"""Requests remembered at most (a replica's in-flight requests, with a wide margin)."""


class Loss(StrEnum):
    RESTARTED = "restarted"  # another incarnation now runs under the worker id
    SILENT = "silent"  # heartbeat older than the lease, or no state: confirm before giving up


@dataclass(frozen=True, slots=True)
class Sent:
    """One dispatched request: enough to hand it back to intake as its worker would have."""

    request_id: str
    worker_id: str
    incarnation: str  # of the worker that admitted it ("" = not known: never RESTARTED)
    msg_id: str  # Nats-Msg-Id of the intake message whose assignment the worker admitted
    stream_seq: int  # that message's intake stream sequence
    request: IntakeRequest
    carrier: Mapping[str, str]  # trace context of the original message
    assigned_at_s: float | None = None  # when it was assigned to the worker (None: not known)


@dataclass(frozen=True, slots=True)
class LostWorker:
    """A worker that holds dispatched requests it may no longer be able to answer."""

    worker_id: str
    loss: Loss
    incarnation: str  # the worker's current incarnation ("" when it has no state)
    requests: tuple[Sent, ...]


class DispatchLedger:
    """The requests a replica dispatched and has not seen a result for, by worker."""

    def __init__(self, limit: int = LEDGER_LIMIT) -> None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit!r}")
        self.limit = limit
        self._sent: OrderedDict[str, Sent] = OrderedDict()
        self._by_worker: dict[str, set[str]] = {}
        # Worker id -> incarnations seen replaced by another (restarts); few per worker.
        self._retired: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return len(self._sent)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._sent

    def __iter__(self) -> Iterator[Sent]:
        return iter(tuple(self._sent.values()))

    def get(self, request_id: str) -> Sent | None:
        return self._sent.get(request_id)

    def add(self, sent: Sent) -> None:
        """Remember a dispatch; it replaces any earlier one of the same request."""
        self.pop(sent.request_id)
        self._sent[sent.request_id] = sent
        self._by_worker.setdefault(sent.worker_id, set()).add(sent.request_id)
        while len(self._sent) > self.limit:
            self.pop(next(iter(self._sent)))

    def pop(self, request_id: str) -> Sent | None:
        """Forget a request (its result arrived, or it was handed back); None if unknown."""
        sent = self._sent.pop(request_id, None)
        if sent is not None:
            rids = self._by_worker[sent.worker_id]
            rids.discard(request_id)
            if not rids:
                del self._by_worker[sent.worker_id]
        return sent

    def supersede(self, request_id: str, stream_seq: int) -> Sent | None:
        """A message of ``request_id`` other than the one dispatched is being handled (a
        redirect, a hand-back, a client reusing the id): the old dispatch is no longer this
        replica's to recover. Returns what was forgotten."""
        sent = self._sent.get(request_id)
        if sent is None or sent.stream_seq == stream_seq:
            return None
        return self.pop(request_id)

    def retire(self, worker_id: str, incarnation: str) -> None:
        """The worker's state changed from ``incarnation`` to another: that process is gone."""
        if incarnation:
            self._retired.setdefault(worker_id, set()).add(incarnation)

    def adopted(self, request_id: str, incarnation: str) -> None:
        """``incarnation`` of the worker holds the request: its AssignmentAck said so (a
        dispatch enters the ledger before the ack, with none), or it lists the request (a
        re-send reached it)."""
        sent = self._sent.get(request_id)
        if sent is not None and sent.incarnation != incarnation:
            self._sent[request_id] = replace(sent, incarnation=incarnation)

    def lost(self, states: Mapping[str, WorkerState], *, now: float, lease_s: float,
             loaded: bool) -> list[LostWorker]:
        """Workers holding requests of this ledger that they may not answer (module doc).

        ``states``: the worker-state view (latest state per worker id); ``loaded``: whether
        the view has its initial values (before that, a missing state proves nothing).
        RESTARTED lists only the requests admitted by a retired incarnation (:meth:`retire`);
        SILENT lists all of the worker's requests. Sorted by worker id (deterministic)."""
        out: list[LostWorker] = []
        for wid in sorted(self._by_worker):
            sents = tuple(self._sent[r] for r in sorted(self._by_worker[wid]))
            state = states.get(wid)
            if state is None:
                if loaded:
                    out.append(LostWorker(wid, Loss.SILENT, "", sents))
                continue
            if now - state.heartbeat_s > lease_s:
                out.append(LostWorker(wid, Loss.SILENT, state.incarnation, sents))
                continue
            retired = self._retired.get(wid)
            if not retired:
                continue
            old = tuple(s for s in sents if s.incarnation in retired)
            if old:
                out.append(LostWorker(wid, Loss.RESTARTED, state.incarnation, old))
        return out
