"""Worker lifecycle and the epoch (boundary) protocol of a reconfiguration (§6.2, §8).

A sans-IO state machine: the adapter feeds it events (plan started, in-flight request
finished, epoch record committed, rank acknowledged, worker failed or recovered, workers
exposed) and publishes what it returns. Time is always a parameter.

Worker rules (``WORKER_TRANSITIONS``; ``ABSENT`` = not a worker of the current composition):

    ABSENT      --create-->   SWITCHING    a target appears at the new epoch, ranks not acked
    ACTIVE      --drain-->    DRAINING     a plan starts: no new requests, queue redirected
    DRAINING    --drained-->  SWITCHING    no in-flight request left: parked at the boundary
    DRAINING    --abort-->    ACTIVE       the plan is cancelled before its epoch commit
    SWITCHING   --abort-->    ACTIVE       (a parked source, same)
    SWITCHING   --retire-->   ABSENT       the epoch commit replaces the sources
    SWITCHING   --expose-->   ACTIVE       every rank acked and metadata published: schedulable
    ACTIVE | DRAINING | SWITCHING --fail--> UNAVAILABLE   rank failure or lease loss
    UNAVAILABLE --recover-->  SWITCHING    re-admitted under a fresh epoch; acks expose it

Reconfiguration rules (``PHASE_TRANSITIONS``), one split or merge:

    DRAINING  --drained-->  DRAINED    every source parked (no in-flight left)
    DRAINED   --commit-->   COMMITTED  epoch e+1 committed: sources retired, targets created
    COMMITTED --acked-->    READY      every rank of every live target acked (epoch, degree)
    READY     --expose-->   EXPOSED    scheduler and cache manager updated; targets active
    DRAINING | DRAINED --abort--> ABORTED   cancelled or a source failed; sources back active

Epochs are global and strictly increasing (the versioned control record of §8): every
commit and every recovery takes the next one, and each worker remembers the epoch its
geometry was committed at. A rank acknowledges ``(epoch, degree)`` of its worker; an ack
for an older epoch is :class:`StaleEpoch`, for any other epoch :class:`EpochMismatch`, with
the wrong degree :class:`WrongDegree`; a repeated ack is a no-op. A plan touching a worker
that is already reconfiguring raises :class:`ReconfigurationConflict`; disjoint plans may
run concurrently, each committing its own epoch.

NOTE: every public method validates first and mutates after; an error changes nothing.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from services.controller.lattice import Composition, LatticeOp, OpKind
from services.controller.planner import Plan
from shared.ids import InvalidInput, RequestId, UnknownWorker, VertumnusError, WorkerId
from shared.worker import GpuGroup, Lifecycle


# --- errors ------------------------------------------------------------------------------
class IllegalTransition(VertumnusError):
    """The event is not allowed in the current state; nothing changed."""


class ReconfigurationConflict(IllegalTransition):
    """A plan touches a worker that is already part of another reconfiguration."""


class EpochMismatch(InvalidInput):
    """A rank acknowledged an epoch other than the one its worker was committed at."""


class StaleEpoch(EpochMismatch):
    """A rank acknowledged an epoch older than its worker's (a late or replayed ack)."""


class WrongDegree(InvalidInput):
    """A rank acknowledged a CP degree other than its worker's."""


class UnknownReconfiguration(InvalidInput):
    """No reconfiguration has that id."""


# --- tables ------------------------------------------------------------------------------
ABSENT: Final = None
State = Lifecycle | None


class WorkerEvent(StrEnum):
    CREATE = "create"
    DRAIN = "drain"
    DRAINED = "drained"
    ABORT = "abort"
    RETIRE = "retire"
    EXPOSE = "expose"
    FAIL = "fail"
    RECOVER = "recover"


_A, _D, _S, _U = Lifecycle.ACTIVE, Lifecycle.DRAINING, Lifecycle.SWITCHING, Lifecycle.UNAVAILABLE
WORKER_TRANSITIONS: Final[Mapping[tuple[State, WorkerEvent], State]] = {
    (ABSENT, WorkerEvent.CREATE): _S,
    (_A, WorkerEvent.DRAIN): _D,
    (_D, WorkerEvent.DRAINED): _S,
    (_D, WorkerEvent.ABORT): _A,
    (_S, WorkerEvent.ABORT): _A,
    (_S, WorkerEvent.RETIRE): ABSENT,
    (_S, WorkerEvent.EXPOSE): _A,
    (_A, WorkerEvent.FAIL): _U,
    (_D, WorkerEvent.FAIL): _U,
    (_S, WorkerEvent.FAIL): _U,
    (_U, WorkerEvent.RECOVER): _S,
}


class Phase(StrEnum):
    DRAINING = "draining"
    DRAINED = "drained"
    COMMITTED = "committed"
    READY = "ready"
    EXPOSED = "exposed"
    ABORTED = "aborted"


class PhaseEvent(StrEnum):
    DRAINED = "drained"
    COMMIT = "commit"
    ACKED = "acked"
    EXPOSE = "expose"
    ABORT = "abort"


PHASE_TRANSITIONS: Final[Mapping[tuple[Phase, PhaseEvent], Phase]] = {
    (Phase.DRAINING, PhaseEvent.DRAINED): Phase.DRAINED,
    (Phase.DRAINED, PhaseEvent.COMMIT): Phase.COMMITTED,
    (Phase.COMMITTED, PhaseEvent.ACKED): Phase.READY,
    (Phase.READY, PhaseEvent.EXPOSE): Phase.EXPOSED,
    (Phase.DRAINING, PhaseEvent.ABORT): Phase.ABORTED,
    (Phase.DRAINED, PhaseEvent.ABORT): Phase.ABORTED,
}


def worker_transition(state: State, event: WorkerEvent) -> State:
    """The next worker state, or :class:`IllegalTransition`."""
    try:
        return WORKER_TRANSITIONS[(state, event)]
    except KeyError:
        raise IllegalTransition(
            f"worker event {event.value!r} is illegal in state "
            f"{'absent' if state is None else state.value!r}"
        ) from None


def phase_transition(phase: Phase, event: PhaseEvent) -> Phase:
    """The next reconfiguration phase, or :class:`IllegalTransition`."""
    try:
        return PHASE_TRANSITIONS[(phase, event)]
    except KeyError:
        raise IllegalTransition(
            f"reconfiguration event {event.value!r} is illegal in phase {phase.value!r}"
        ) from None


# --- values handed out -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class WorkerState:
    worker_id: WorkerId
    group: GpuGroup
    state: Lifecycle
    epoch: int
    reconfiguration: int | None


@dataclass(frozen=True, slots=True)
class ControlRecord:
    """The versioned control record to publish (compare-and-set) at ``epoch``.

    ``workers``: every worker of the composition as (group, the epoch its geometry was
    committed at). A rank finds its group and acknowledges that epoch and degree.
    """

    epoch: int
    workers: tuple[tuple[GpuGroup, int], ...]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form: ``{"epoch", "workers": [{"first_gpu", "degree", "epoch"}]}``."""
        return {
            "epoch": self.epoch,
            "workers": [
                {"first_gpu": g.first_gpu, "degree": g.degree, "epoch": e} for g, e in self.workers
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> ControlRecord:
        """Inverse of :meth:`to_dict`; raises :class:`InvalidInput` on a malformed record."""
        try:
            epoch = data["epoch"]
            rows = data["workers"]
            if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
                raise ValueError(f"epoch {epoch!r}")
            workers = []
            for row in rows:  # type: ignore[attr-defined]
                g = GpuGroup(int(row["first_gpu"]), int(row["degree"]))
                e = row["epoch"]
                if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e <= epoch:
                    raise ValueError(f"worker epoch {e!r}")
                workers.append((g, e))
        except InvalidInput:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"malformed control record: {exc!r}") from exc
        return cls(epoch, tuple(sorted(workers)))


@dataclass(frozen=True, slots=True)
class Reconfiguration:
    """A snapshot of one split or merge and its timings (seconds; None until reached).

    ``drain_s`` = drained_at − started_at; ``switch_s`` = exposed_at − drained_at.
    """

    id: int
    kind: OpKind
    sources: tuple[GpuGroup, ...]
    targets: tuple[GpuGroup, ...]
    phase: Phase
    epoch: int | None
    started_at: float
    drained_at: float | None
    switch_started_at: float | None
    exposed_at: float | None
    aborted_at: float | None
    in_flight: Mapping[WorkerId, int]
    awaiting_acks: tuple[int, ...]
    failed_targets: tuple[WorkerId, ...]
    redirected: int

    @property
    def drain_s(self) -> float | None:
        return None if self.drained_at is None else self.drained_at - self.started_at

    @property
    def switch_s(self) -> float | None:
        if self.exposed_at is None or self.drained_at is None:
            return None
        return self.exposed_at - self.drained_at

    def to_dict(self) -> dict[str, object]:
        """JSON-ready form for reports (each reconfiguration's drain and switch times)."""
        return {
            "id": self.id,
            "kind": self.kind.value,
            "sources": [[g.first_gpu, g.degree] for g in self.sources],
            "targets": [[g.first_gpu, g.degree] for g in self.targets],
            "phase": self.phase.value,
            "epoch": self.epoch,
            "started_at": self.started_at,
            "drained_at": self.drained_at,
            "switch_started_at": self.switch_started_at,
            "exposed_at": self.exposed_at,
            "aborted_at": self.aborted_at,
            "drain_s": self.drain_s,
            "switch_s": self.switch_s,
            "redirected": self.redirected,
            "failed_targets": list(self.failed_targets),
        }


@dataclass(frozen=True, slots=True)
class StartResult:
    """``redirected``: the sources' queued requests, in queue order, for the adapter to
    re-place on other workers. ``drained``: true when no source had anything in flight."""

    reconfiguration: int
    redirected: tuple[tuple[WorkerId, RequestId], ...]
    drained: bool


@dataclass(frozen=True, slots=True)
class DrainProgress:
    drained_workers: tuple[WorkerId, ...] = ()
    drained_reconfiguration: int | None = None


@dataclass(frozen=True, slots=True)
class AckResult:
    duplicate: bool
    worker: WorkerId
    worker_complete: bool
    activated: tuple[WorkerId, ...] = ()  # recovered workers that became schedulable
    ready: int | None = None  # a reconfiguration whose targets are all acknowledged


@dataclass(frozen=True, slots=True)
class FailResult:
    worker: WorkerId
    aborted: int | None = None  # reconfiguration aborted because a source failed
    reactivated: tuple[WorkerId, ...] = ()  # its other sources, back to active
    ready: int | None = None  # a committed reconfiguration now complete without this target


# --- internal mutable records ------------------------------------------------------------
@dataclass
class _Worker:
    group: GpuGroup
    state: Lifecycle
    epoch: int
    reconf: int | None = None
    acked: set[int] = field(default_factory=set)


@dataclass
class _Reconf:
    id: int
    kind: OpKind
    sources: tuple[GpuGroup, ...]
    targets: tuple[GpuGroup, ...]
    phase: Phase
    started_at: float
    in_flight: dict[WorkerId, set[RequestId]]
    redirected: int
    epoch: int | None = None
    drained_at: float | None = None
    switch_started_at: float | None = None
    exposed_at: float | None = None
    aborted_at: float | None = None
    failed_targets: list[WorkerId] = field(default_factory=list)
    last_t: float = 0.0

    def snapshot(self, awaiting: tuple[int, ...]) -> Reconfiguration:
        return Reconfiguration(
            id=self.id,
            kind=self.kind,
            sources=self.sources,
            targets=self.targets,
            phase=self.phase,
            epoch=self.epoch,
            started_at=self.started_at,
            drained_at=self.drained_at,
            switch_started_at=self.switch_started_at,
            exposed_at=self.exposed_at,
            aborted_at=self.aborted_at,
            in_flight={w: len(r) for w, r in self.in_flight.items()},
            awaiting_acks=awaiting,
            failed_targets=tuple(self.failed_targets),
            redirected=self.redirected,
        )


def _check_now(now: float, not_before: float | None = None) -> float:
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise InvalidInput(f"now must be a finite number of seconds, got {now!r}")
    if not_before is not None and now < not_before:
        raise InvalidInput(f"time went backwards: now={now} < {not_before}")
    return float(now)


class EpochProtocol:
    """Lifecycle of every worker of the pool and the reconfigurations in flight.

    ``acknowledged=True`` starts every worker active at ``epoch`` (a pool already serving);
    ``False`` starts them switching, to be exposed as their ranks acknowledge ``epoch``
    (a cold start: each worker becomes active once all its ranks acked).
    """

    def __init__(
        self, composition: Composition, *, epoch: int = 0, acknowledged: bool = True
    ) -> None:
        if not isinstance(composition, Composition):
            raise InvalidInput(f"expected a Composition, got {composition!r}")
        if isinstance(epoch, bool) or not isinstance(epoch, int) or epoch < 0:
            raise InvalidInput(f"epoch must be an integer >= 0, got {epoch!r}")
        self._lattice = composition.lattice
        self._epoch = epoch
        state = Lifecycle.ACTIVE if acknowledged else Lifecycle.SWITCHING
        self._workers: dict[WorkerId, _Worker] = {
            g.worker_id: _Worker(g, state, epoch) for g in composition.groups
        }
        self._by_gpu: dict[int, WorkerId] = {
            gpu: g.worker_id for g in composition.groups for gpu in g.gpus
        }
        self._reconfs: dict[int, _Reconf] = {}
        self._next_id = 1
        # The current composition, built on first use after each change of ``_workers``.
        self._composition: Composition | None = composition

    # --- queries -------------------------------------------------------------------------
    @property
    def epoch(self) -> int:
        """The latest committed epoch."""
        return self._epoch

    @property
    def composition(self) -> Composition:
        """The groups of the current epoch (retired sources excluded, targets included).

        The same object until the workers change (a commit): compositions are frozen, and one
        kept object keeps what is derived from it (adjacent compositions, capacity) for the
        planner's next window."""
        comp = self._composition
        if comp is None:
            comp = Composition(self._lattice, tuple(w.group for w in self._workers.values()))
            self._composition = comp
        return comp

    def state(self, worker: WorkerId) -> Lifecycle:
        return self._worker(worker).state

    def worker(self, worker: WorkerId) -> WorkerState:
        w = self._worker(worker)
        return WorkerState(worker, w.group, w.state, w.epoch, w.reconf)

    def workers(self) -> tuple[WorkerState, ...]:
        return tuple(self.worker(wid) for wid in sorted(self._workers, key=self._gpu_order))

    def schedulable(self) -> tuple[WorkerId, ...]:
        """Workers the scheduler may place requests on: active ones, in GPU order."""
        return tuple(
            wid
            for wid in sorted(self._workers, key=self._gpu_order)
            if self._workers[wid].state is Lifecycle.ACTIVE
        )

    def unavailable(self) -> tuple[WorkerId, ...]:
        """Workers that are not active (the planner must not pick them)."""
        return tuple(wid for wid, w in self._workers.items() if w.state is not Lifecycle.ACTIVE)

    def worker_of_gpu(self, gpu: int) -> WorkerId:
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu not in self._by_gpu:
            raise InvalidInput(f"no GPU {gpu!r} in a pool of {self._lattice.num_gpus}")
        return self._by_gpu[gpu]

    def reconfiguration(self, rid: int) -> Reconfiguration:
        r = self._reconf(rid)
        return r.snapshot(self._awaiting(r))

    def in_progress(self) -> tuple[int, ...]:
        """Ids of reconfigurations not yet exposed or aborted."""
        return tuple(
            r.id for r in self._reconfs.values() if r.phase not in (Phase.EXPOSED, Phase.ABORTED)
        )

    def history(self) -> tuple[Reconfiguration, ...]:
        return tuple(r.snapshot(self._awaiting(r)) for r in self._reconfs.values())

    def control_record(self) -> ControlRecord:
        return ControlRecord(
            self._epoch,
            tuple(
                (w.group, w.epoch)
                for w in sorted(self._workers.values(), key=lambda w: w.group.first_gpu)
            ),
        )

    # --- events --------------------------------------------------------------------------
    def start(
        self,
        plan: Plan | LatticeOp,
        now: float,
        *,
        queued: Mapping[WorkerId, Sequence[RequestId]] | None = None,
        in_flight: Mapping[WorkerId, Collection[RequestId]] | None = None,
    ) -> StartResult:
        """Begin ``plan``: its sources stop admitting requests and start draining.

        ``queued`` / ``in_flight``: each worker's queued and executing request ids (entries
        for workers outside the plan are ignored). Queued requests of the sources are
        returned for redirection; in-flight ones are awaited through :meth:`finished`.
        """
        now = _check_now(now)
        if not isinstance(plan, (Plan, LatticeOp)):
            raise InvalidInput(f"expected a Plan or LatticeOp, got {plan!r}")
        op = plan.op if isinstance(plan, Plan) else plan
        self.composition.apply(op)  # raises if op is not adjacent to the current composition
        for g in op.sources:
            w = self._workers[g.worker_id]
            if w.reconf is not None:
                raise ReconfigurationConflict(
                    f"{g.worker_id} is already part of reconfiguration {w.reconf}"
                )
            worker_transition(w.state, WorkerEvent.DRAIN)
        queued = {} if queued is None else queued
        in_flight = {} if in_flight is None else in_flight
        if not isinstance(queued, Mapping) or not isinstance(in_flight, Mapping):
            raise InvalidInput("queued and in_flight must be mappings worker -> request ids")
        redirected: list[tuple[WorkerId, RequestId]] = []
        flights: dict[WorkerId, set[RequestId]] = {}
        for wid in op.source_ids:
            q = queued.get(wid, ())
            f = in_flight.get(wid, ())
            if isinstance(q, (str, bytes)) or isinstance(f, (str, bytes)):
                raise InvalidInput(f"queued/in_flight of {wid} must be collections of ids")
            redirected.extend((wid, r) for r in q)
            flights[wid] = set(f)
        # -- mutate ---------------------------------------------------------------------
        rid = self._next_id
        self._next_id += 1
        r = _Reconf(
            rid,
            op.kind,
            op.sources,
            op.targets,
            Phase.DRAINING,
            now,
            flights,
            len(redirected),
            last_t=now,
        )
        self._reconfs[rid] = r
        for wid in op.source_ids:
            w = self._workers[wid]
            w.state = worker_transition(w.state, WorkerEvent.DRAIN)
            w.reconf = rid
            if not flights[wid]:
                w.state = worker_transition(w.state, WorkerEvent.DRAINED)
        drained = all(not s for s in flights.values())
        if drained:
            r.phase = phase_transition(r.phase, PhaseEvent.DRAINED)
            r.drained_at = now
        return StartResult(rid, tuple(redirected), drained)

    def in_flight_found(
        self, worker: WorkerId, requests: Collection[RequestId], now: float
    ) -> None:
        """More requests executing on the draining source ``worker``, awaited like those given
        to :meth:`start` (through :meth:`finished`). :meth:`start` takes what the source
        reported *before* it stopped admitting; a request that started in between is found
        only once the source has stopped (the adapter asks again). Ids already awaited are
        ignored. :class:`IllegalTransition` unless ``worker`` is draining (nothing is found
        on a source that is parked, aborted or failed)."""
        w = self._worker(worker)
        now = _check_now(now)
        if isinstance(requests, (str, bytes)) or not isinstance(requests, Collection):
            raise InvalidInput(f"requests of {worker} must be a collection of ids")
        if w.state is not Lifecycle.DRAINING or w.reconf is None:
            raise IllegalTransition(f"{worker} is not a draining source")
        r = self._reconfs[w.reconf]
        _check_now(now, r.last_t)
        # -- mutate ---------------------------------------------------------------------
        r.in_flight[worker] |= set(requests)
        r.last_t = now

    def finished(self, worker: WorkerId, request: RequestId, now: float) -> DrainProgress:
        """A request left ``worker`` (completed or failed). Only draining sources care;
        for any other worker, or an untracked / repeated request, this is a no-op."""
        w = self._worker(worker)
        now = _check_now(now)
        if w.state is not Lifecycle.DRAINING or w.reconf is None:
            return DrainProgress()
        r = self._reconfs[w.reconf]
        _check_now(now, r.last_t)
        pending = r.in_flight[worker]
        if request not in pending:
            return DrainProgress()
        pending.discard(request)
        r.last_t = now
        if pending:
            return DrainProgress()
        w.state = worker_transition(w.state, WorkerEvent.DRAINED)
        if any(r.in_flight.values()):
            return DrainProgress((worker,))
        r.phase = phase_transition(r.phase, PhaseEvent.DRAINED)
        r.drained_at = now
        return DrainProgress((worker,), r.id)

    def switch_started(self, rid: int, now: float) -> ControlRecord:
        """Commit the drained reconfiguration ``rid`` under the next epoch.

        The sources are retired and the targets appear switching, each awaiting an ack
        from every one of its ranks. Returns the control record to publish.
        """
        r = self._reconf(rid)
        now = _check_now(now, r.last_t)
        phase_transition(r.phase, PhaseEvent.COMMIT)
        # -- mutate ---------------------------------------------------------------------
        self._epoch += 1
        r.epoch = self._epoch
        r.phase = Phase.COMMITTED
        r.switch_started_at = now
        r.last_t = now
        self._composition = None  # the groups change below
        for g in r.sources:
            w = self._workers.pop(g.worker_id)
            worker_transition(w.state, WorkerEvent.RETIRE)
        for g in r.targets:
            self._workers[g.worker_id] = _Worker(
                g, worker_transition(ABSENT, WorkerEvent.CREATE), self._epoch, r.id
            )
            for gpu in g.gpus:
                self._by_gpu[gpu] = g.worker_id
        return self.control_record()

    def ack(self, rank_gpu: int, epoch: int, degree: int) -> AckResult:
        """Rank ``rank_gpu`` adopted ``epoch`` with CP degree ``degree``."""
        wid = self.worker_of_gpu(rank_gpu)
        for name, v in (("epoch", epoch), ("degree", degree)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise InvalidInput(f"ack {name} must be an integer >= 0, got {v!r}")
        w = self._workers[wid]
        if epoch < w.epoch:
            raise StaleEpoch(f"rank {rank_gpu} acked epoch {epoch}; {wid} is at epoch {w.epoch}")
        if epoch != w.epoch:
            raise EpochMismatch(f"rank {rank_gpu} acked epoch {epoch}; {wid} is at epoch {w.epoch}")
        if degree != w.group.degree:
            raise WrongDegree(
                f"rank {rank_gpu} acked degree {degree}; {wid} has degree {w.group.degree}"
            )
        if w.state is Lifecycle.UNAVAILABLE:
            raise IllegalTransition(f"{wid} is unavailable; recover it before its ranks ack")
        awaiting = w.state is Lifecycle.SWITCHING and not self._is_parked_source(w)
        if not awaiting or rank_gpu in w.acked:
            return AckResult(True, wid, not awaiting or self._complete(w))
        # -- mutate ---------------------------------------------------------------------
        w.acked.add(rank_gpu)
        if not self._complete(w):
            return AckResult(False, wid, False)
        if w.reconf is None:  # a recovering worker: exposed as soon as its ranks agree
            w.state = worker_transition(w.state, WorkerEvent.EXPOSE)
            w.acked.clear()
            return AckResult(False, wid, True, activated=(wid,))
        r = self._reconfs[w.reconf]
        ready = self._maybe_ready(r)
        return AckResult(False, wid, True, ready=r.id if ready else None)

    def exposed(self, rid: int, now: float) -> Reconfiguration:
        """The scheduler and cache manager know the targets: make them schedulable."""
        r = self._reconf(rid)
        now = _check_now(now, r.last_t)
        phase_transition(r.phase, PhaseEvent.EXPOSE)
        # -- mutate ---------------------------------------------------------------------
        r.phase = Phase.EXPOSED
        r.exposed_at = now
        r.last_t = now
        for g in r.targets:
            w = self._workers.get(g.worker_id)
            # A failed target (even one recovering under a later epoch) is not ours to expose.
            if w is None or w.reconf != r.id:
                continue
            w.state = worker_transition(w.state, WorkerEvent.EXPOSE)
            w.reconf = None
            w.acked.clear()
        return r.snapshot(())

    def abort(self, rid: int, now: float) -> Reconfiguration:
        """Cancel ``rid`` before its epoch commit; its sources return to active."""
        r = self._reconf(rid)
        now = _check_now(now, r.last_t)
        phase_transition(r.phase, PhaseEvent.ABORT)
        self._abort(r, now, failed=None)
        return r.snapshot(())

    def fail(self, worker: WorkerId, now: float) -> FailResult:
        """``worker`` lost a rank or its lease. Aborts an uncommitted reconfiguration it
        is a source of; a committed one continues without it."""
        w = self._worker(worker)
        now = _check_now(now)
        worker_transition(w.state, WorkerEvent.FAIL)
        r = self._reconfs.get(w.reconf) if w.reconf is not None else None
        if r is not None:
            _check_now(now, r.last_t)
        # -- mutate ---------------------------------------------------------------------
        if r is not None and r.phase in (Phase.DRAINING, Phase.DRAINED):
            back = self._abort(r, now, failed=worker)
            w.state = worker_transition(w.state, WorkerEvent.FAIL)
            w.reconf = None
            return FailResult(worker, r.id, back)
        w.state = worker_transition(w.state, WorkerEvent.FAIL)
        w.acked.clear()
        if r is None:
            return FailResult(worker)
        w.reconf = None
        r.failed_targets.append(worker)
        r.last_t = now
        ready = r.phase is Phase.COMMITTED and self._maybe_ready(r)
        return FailResult(worker, ready=r.id if ready else None)

    def recover(self, worker: WorkerId, now: float) -> ControlRecord:
        """Re-admit an unavailable worker under the next epoch; it becomes active once
        every one of its ranks acknowledged that epoch. Returns the record to publish."""
        w = self._worker(worker)
        _check_now(now)
        worker_transition(w.state, WorkerEvent.RECOVER)
        self._epoch += 1
        w.state = worker_transition(w.state, WorkerEvent.RECOVER)
        w.epoch = self._epoch
        w.acked.clear()
        return self.control_record()

    # --- helpers -------------------------------------------------------------------------
    def _worker(self, worker: WorkerId) -> _Worker:
        try:
            return self._workers[worker]
        except (KeyError, TypeError):
            raise UnknownWorker(f"{worker!r} is not a worker of the current epoch") from None

    def _reconf(self, rid: int) -> _Reconf:
        try:
            return self._reconfs[rid]
        except (KeyError, TypeError):
            raise UnknownReconfiguration(f"no reconfiguration {rid!r}") from None

    def _gpu_order(self, wid: WorkerId) -> int:
        return self._workers[wid].group.first_gpu

    def _is_parked_source(self, w: _Worker) -> bool:
        r = self._reconfs.get(w.reconf) if w.reconf is not None else None
        return r is not None and r.phase in (Phase.DRAINING, Phase.DRAINED)

    def _complete(self, w: _Worker) -> bool:
        return len(w.acked) == w.group.degree

    def _awaiting(self, r: _Reconf) -> tuple[int, ...]:
        if r.phase is not Phase.COMMITTED:
            return ()
        out = []
        for g in r.targets:
            w = self._workers.get(g.worker_id)
            if w is not None and w.state is Lifecycle.SWITCHING and w.reconf == r.id:
                out.extend(gpu for gpu in g.gpus if gpu not in w.acked)
        return tuple(out)

    def _maybe_ready(self, r: _Reconf) -> bool:
        if self._awaiting(r):
            return False
        r.phase = phase_transition(r.phase, PhaseEvent.ACKED)
        return True

    def _abort(self, r: _Reconf, now: float, failed: WorkerId | None) -> tuple[WorkerId, ...]:
        r.phase = phase_transition(r.phase, PhaseEvent.ABORT)
        r.aborted_at = now
        r.last_t = now
        back = []
        for wid in (g.worker_id for g in r.sources):
            if wid == failed:
                continue
            w = self._workers[wid]
            w.state = worker_transition(w.state, WorkerEvent.ABORT)
            w.reconf = None
            back.append(wid)
        r.in_flight = {w: set() for w in r.in_flight}
        return tuple(back)
