"""A worker leader's bookkeeping, sans IO: admission, FIFO, epoch adoption, reported state.

The rankd adapter (services/rankd/service.py) feeds this core with assignments, clock
readings and epoch records, and turns its outputs into NATS messages. Nothing here touches a
socket, a clock or asyncio; time is a parameter (Unix seconds).

Rules (§5.2, §6.2, §8):

* One request runs at a time; the rest wait in arrival order (FIFO).
* Admission requires lifecycle ACTIVE, the right worker id and degree, an assignment epoch not
  newer than the adopted one (an older epoch is fine while this worker stays ACTIVE: the
  scheduler's view may lag by one record), and room in the queue. A request already queued or
  running is admitted again idempotently (same position), so a redelivered assignment does not
  run twice; so is one finished recently (:meth:`WorkerCore.answered`: position 0, nothing
  queued; for a later attempt of the request -- another arrival -- the service sends its kept
  answer again) -- unless it is the re-sent assignment of a joined attempt whose hand-back's
  outcome is unknown (below). A refused admission changes nothing.
* Adopting an EpochRecord with a newer epoch takes this worker's lifecycle from it (absent →
  UNAVAILABLE). Leaving ACTIVE hands back every queued, not-yet-started request (they are
  redirected, §6.2); the running one finishes under the old geometry.
* A handed-back request is *redirecting*: it left the FIFO (it can never start here, so it is
  never both redirected and executed) but this worker still owns it — it counts in
  ``len``, ``queue_len`` and outstanding work, and a new assignment of its id is refused
  (:class:`NotAccepting`) — until the adapter reports the redirect settled
  (:meth:`WorkerCore.redirect_settled`: intake acknowledged it, it definitely failed and the
  client was told, or the adapter gave up with the outcome logged). So a worker whose state
  shows an empty queue has really handed everything back, and a stop in the middle of
  redirecting loses nothing silently.
* Exactly once across a scheduler crash (§8): an admitted job remembers its *source*, the
  ``Nats-Msg-Id`` of the intake message the scheduler placed (header
  :data:`INTAKE_MSG_HEADER` on the assignment). A scheduler that crashed after our ack re-sends
  the assignment when that message is redelivered. If the job was handed back meanwhile, the
  request already lives on in intake under the redirect's message, so the re-sent assignment
  must neither run here nor be placed again: admission with the same source raises
  :class:`Redirecting` while the redirect is unsettled (retry later; the scheduler keeps its
  record) and :class:`HandedBack` once intake acknowledged the redirect (the scheduler acks the
  old message). A different source (the redirect itself placed back here) is admitted, and so
  is a later attempt under the same source (another arrival stamp: a gateway publishes every
  attempt under the request id, and a store loss lets a client's retry be stored anew): it is
  no re-send of the message handed back, and that hand-back's answer, stamped for the job's
  attempt, is not its answer. So the job's hand-back is remembered by its source and arrival
  stamp, as a joined attempt's is (below); before, by its source alone, such an attempt was
  answered 410 and lost.
* One hand-back, one intake message: the redirect's ``Nats-Msg-Id`` is a function of the
  source and this worker (:func:`handback_msg_id`), so every publish of that hand-back — a
  retry after a lost ack, a re-publish to settle an unknown outcome, or the scheduler's own
  publish on behalf of a worker it knows is gone — is de-duplicated by the intake stream
  (within its duplicate window) and the request is stored there once.
* A redirect whose outcome is unknown (every publish attempt timed out: intake may or may
  not hold it) is remembered with its source (:meth:`WorkerCore.redirect_settled` with
  ``unknown``): a re-sent assignment of that source (and the job's arrival stamp) raises
  :class:`HandBackUnknown`; the
  adapter publishes the hand-back again (same id: stored at most once) and, once intake
  acknowledges it, reports :meth:`WorkerCore.handback_confirmed` and answers as for
  :class:`HandedBack` (else as for :class:`Redirecting`). Forgetting it instead would let the
  re-sent assignment be refused as "not ACTIVE" and placed afresh beside a stored redirect.
* So is a later attempt that joined a handed-back job (the adapter hands each back as an
  intake message of its own, :func:`joined_handback_msg_id`) whose hand-back's outcome is
  unknown (:meth:`WorkerCore.joined_handback_unknown`), by its source *and* arrival stamp --
  attempts of one request usually share their source, and the job's hand-back in intake says
  nothing of the attempt's: a re-sent assignment of that attempt raises
  :class:`HandBackUnknown` naming it (``joined``) until the adapter reports
  :meth:`WorkerCore.joined_handback_confirmed`, then :class:`HandedBack`. Before, it was
  forgotten: its re-sent assignment was refused as "not ACTIVE" (placed afresh beside a
  hand-back intake may hold), admitted with the worker ACTIVE again (a second prefill), or
  answered :class:`HandedBack` on the strength of the job's hand-back (the attempt, perhaps
  not in intake, lost). This comes before "finished here" (:meth:`WorkerCore.admit`,
  :meth:`WorkerCore.check_joined_handback`; the adapter checks it before answering from a
  kept answer): the request may come back and finish here after the attempt was handed back
  (the job's hand-back placed back here), which says nothing of the attempt's hand-back --
  intake may hold it, to run and answer it elsewhere. Before, the re-send was admitted as done
  (and answered from the kept answer): the attempt could be answered twice. It comes before
  a job of the request being redirected too (:class:`Redirecting`), as the adapter checks it:
  the attempt's own hand-back, not the job's, says where the attempt is.
  Likewise once intake acknowledged the attempt's hand-back (at once,
  :meth:`WorkerCore.remember_handed_back` with its ``arrival_s``, or after an unknown outcome,
  :meth:`WorkerCore.joined_handback_confirmed`): its re-sent assignment -- the same source
  and stamp -- is :class:`HandedBack` before "finished here" too (the request finished here
  since, as another attempt: a scheduler whose 410 was lost re-sends it), since intake holds
  the attempt to run it elsewhere. Before, only the source was remembered, checked after
  "finished here": the re-send was admitted as done and answered from the kept answer. A
  genuine later attempt (another stamp) of a request finished here is still admitted as done.
  The latest ``FINISHED_MEMORY`` joined attempts of each kind are remembered.
* The same holds for the job's own hand-back (:meth:`WorkerCore.check_handback`): once
  another attempt of the request (another stamp) finished here, a re-sent assignment of the
  job (its source and stamp) is still :class:`HandedBack` / :class:`HandBackUnknown`, before
  "finished here" -- intake holds (or may hold) the job's hand-back, which answers the job's
  attempt wherever it runs. Before, it was admitted as done and the adapter sent it the later
  attempt's kept answer stamped for the job: two answers for one attempt. The job's own
  attempt finished here (its hand-back placed back here, the same stamp) is done, as before.
* Attempts without a source (an assignment without :data:`INTAKE_MSG_HEADER`) are never
  remembered as handed back, joined or not: the scheduler (services/scheduler/service.py)
  sends the header with every assignment it sends, first or re-sent (the intake message's
  ``Nats-Msg-Id``, else the request id), so only tests and a scheduler older than the header
  send none. Such a scheduler re-sends a crashed dispatch without one, but takes every micro
  error, 410 and 425 included, for a refusal and places the request afresh: remembering its
  attempts would change nothing it does. And a hand-back without a source has an id that
  names the epoch (:func:`handback_msg_id`), so publishing it again under a later epoch to
  settle an unknown outcome could store it twice. A re-send without a source is answered as
  if nothing had been handed back (admitted, as done when finished here, or refused).
* A worker fault (:meth:`WorkerCore.fault`: the backend raised
  :class:`~shared.ids.WorkerFault`, the worker itself can no longer compute) hands back what
  the worker holds instead of failing it: the request whose execution met the fault stops
  running and becomes *redirecting* (not finished: not counted as served, its blocks not
  cached, its id not remembered as finished, so it may come back through intake), then every
  queued request in order. The worker becomes UNAVAILABLE for good: a later epoch record or a
  local lifecycle change never makes a faulted worker ACTIVE again (the process restarts
  instead, as a new incarnation). A fault detected elsewhere (another worker of the same rank
  host) leaves the running request alone: it may still complete, or meet the fault itself.
* Outstanding work = Σ predicted seconds of queued and redirecting requests + the running
  one's predicted remainder (elapsed wall time divided by the time scale, floored at 0),
  saturated at the largest float (a sum of huge predictions must not overflow to inf).
* The worker's own prefix cache (:class:`~services.rankd.blockcache.BlockCache`, LRU) decides
  what is actually reused: when a request starts, its longest cached prefix of full blocks is
  looked up and pinned, and the request executes with that P (≤ L − 1, so R ≥ 1) whatever the
  scheduler assumed; when it finishes, its full blocks are stored. Cache events accumulate in
  the cache and are drained by the adapter (:meth:`WorkerCore.take_cache_events`).
* KV blocks free for admission = capacity − pinned blocks (LRU-evictable blocks count as free).
"""

from __future__ import annotations

import hashlib
import math
import sys
from collections import OrderedDict, deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from services.cachemgr.events import CacheEvent, Snapshot
from services.rankd.blockcache import BlockCache
from shared.ids import BlockHash, InvalidInput, UnknownWorker, VertumnusError, WorkerId
from shared.schemas import (
    MAX_SCHEDULER_REPLICAS,
    Assignment,
    CacheCommandResult,
    DemoteCommand,
    EpochRecord,
    ReclaimCommand,
    ReconcileCommand,
    ReplicateCommand,
    WorkerState,
)
from shared.worker import GpuGroup, Lifecycle, WorkerKind

FINISHED_MEMORY = 65_536
"""Finished (and handed-back) request ids remembered for idempotent admission (≫ ack_wait ×
rate)."""

INTAKE_MSG_HEADER: Final[str] = "Vtm-Intake-Msg-Id"
"""Assignment header: the ``Nats-Msg-Id`` of the intake message the scheduler placed."""
REDIRECTING_CODE: Final[str] = "425"
"""Micro error code of :class:`Redirecting` ("too early": retry; keep the assignment record)."""
HANDED_BACK_CODE: Final[str] = "410"
"""Micro error code of :class:`HandedBack` ("gone": intake holds the request under the
redirect's message; ack the re-sent one, place nothing)."""
HANDBACK_AT_HEADER: Final[str] = "Vtm-Handed-Back-At"
"""Header of a hand-back's intake message: when it was handed back (Unix seconds, ``repr`` of
a float), where its ``handed_back`` span ends and the scheduler starts the hand-back delivery's
``intake_wait`` (services/scheduler/service.py, whose replicas put it on the hand-backs they
publish for a lost worker too). Every publish of one hand-back carries the same stamp."""
HANDBACK_CAUSE_HEADER: Final[str] = "Vtm-Handback-Cause"
"""Header of a hand-back's intake message: why it was handed back (:class:`HandBackCause` for
a worker's own; the scheduler's causes for one it publishes on a lost worker's behalf)."""
HANDED_BACK_SPAN: Final[str] = "handed_back"
"""The span of the time a request spent on a worker before it was handed back to intake: from
its acceptance there to the hand-back's stamp (:data:`HANDBACK_AT_HEADER`)."""


class HandBackCause(StrEnum):
    """Why a worker handed a request back itself (header :data:`HANDBACK_CAUSE_HEADER`, span
    attribute ``vtm.cause``)."""

    DRAINING = "draining"  # an adopted epoch record drains it (a reconfiguration)
    UNAVAILABLE = "unavailable"  # an adopted record left it out, or made it UNAVAILABLE
    STOPPING = "stopping"  # the service stops (SIGTERM / SIGINT)
    WORKER_FAULT = "worker_fault"  # it can no longer compute (WorkerFault)

PULL_HOLD_MAX_COPY_S: Final[float] = 2.0
"""The longest copy estimate (``Assignment.pull_copy_s``, cost-model seconds) that
:meth:`WorkerCore.pull_hold` honours in full: ~13× the calibrated longest copy J counts on
(services/calibration.py ``PULL_CREDIT_BLOCKS``, 256 blocks at ``PullCredit``'s 2 ms + 0.6 ms a
block: 0.156 s), so a link estimated an order of magnitude slower is still waited for; a larger
estimate (the schema takes any finite one) holds the FIFO no longer than this one."""

_MAX_SECONDS: Final[float] = sys.float_info.max
"""Outstanding work saturates here: each predicted_s is finite, but their sum may overflow to
inf, which no WorkerState (the worker's liveness heartbeat) may carry."""

# Longest hand-back id built by chaining (a request redirected many times); beyond it the
# source part is replaced by a digest. JetStream compares ids as strings of any length; the
# bound only keeps headers and logs small.
_MAX_HANDBACK_ID: Final[int] = 200


def handback_msg_id(request_id: str, source: str | None, worker_id: str, epoch: int) -> str:
    """``Nats-Msg-Id`` of the intake message that hands ``request_id`` back from ``worker_id``.

    With the ``source`` (the ``Nats-Msg-Id`` of the intake message whose assignment the worker
    admitted): ``{source}>{worker_id}`` — one id per hop (a worker admits one source of a
    request at most once, see :class:`HandedBack`), computable by the scheduler too, so a
    worker's hand-back and a scheduler's publish on a gone worker's behalf are the same intake
    message. Without one (an assignment from an older scheduler, or a test):
    ``{request_id}-r{epoch}-{worker_id}``. Pure."""
    if source is None:
        return f"{request_id}-r{epoch}-{worker_id}"
    mid = f"{source}>{worker_id}"
    if len(mid) <= _MAX_HANDBACK_ID:
        return mid
    digest = hashlib.sha256(source.encode()).hexdigest()[:32]
    return f"{request_id[:64]}-h{digest}>{worker_id}"


def is_handback_msg_id(msg_id: str) -> bool:
    """True when ``msg_id`` names a hand-back (:func:`handback_msg_id` with a source): request
    ids never contain ``>``, so only a hand-back's ``{source}>{worker}`` does. The epoch form
    (no source) is not recognised; only assignments without an intake message id make it. Pure."""
    return ">" in msg_id


JOINED_MARK: Final[str] = "@a"
"""What a joined attempt's hand-back id adds to the job's (:func:`joined_handback_msg_id`),
before the attempt's arrival stamp. Request ids and gateway message ids never contain ``@``."""


def joined_handback_msg_id(request_id: str, source: str | None, worker_id: str, epoch: int,
                           arrival_s: float) -> str:
    """``Nats-Msg-Id`` of the intake message that hands back a later attempt of
    ``request_id`` (arrival ``arrival_s``, brought by intake message ``source``) which joined
    the request's job on ``worker_id``: the :func:`handback_msg_id` of its source, then
    :data:`JOINED_MARK` and the stamp. The attempts of one request usually share their
    source -- a gateway publishes every attempt under the request id, and a later one is
    stored anew only where the first one's message no longer de-duplicates it (a store
    loss) -- so under the job's own hand-back id it would be de-duplicated against that
    hand-back and dropped. Still a hand-back id (:func:`is_handback_msg_id`). Pure."""
    return f"{handback_msg_id(request_id, source, worker_id, epoch)}{JOINED_MARK}{arrival_s!r}"


def attempt_mark(msg_id: str) -> str | None:
    """The attempt an intake message id names, as far as ids tell: the stamp of the last
    :data:`JOINED_MARK` in it (a joined attempt's hand-back, or a later hop of one), None for
    the request's job itself (the gateway's message and its hand-backs). A digest-shortened
    id (:func:`handback_msg_id`) has lost its marks: None, as before joined attempts were
    handed back. Pure."""
    head, mark, tail = msg_id.rpartition(JOINED_MARK)
    if not mark:
        return None
    return tail.split(">", 1)[0]


def rank_shares(recompute_tokens: int, degree: int) -> tuple[int, ...]:
    """New tokens each rank of a degree-``degree`` CP worker prefills, by rank index.

    The zigzag partition (services/rankd/engine/zigzag.py, paper §2.1): R is padded to a
    multiple of 2C and cut into 2C chunks of L = R_pad / 2C; rank k owns chunks k and
    2C − 1 − k, so each rank gets an early (cheap) and a late (expensive) chunk. Padding sits
    at the end, so the last ranks' late chunks may hold fewer real tokens. Sums to R."""
    if recompute_tokens < 1 or degree < 1:
        raise InvalidInput(f"need R >= 1 and degree >= 1, got R={recompute_tokens}, "
                           f"degree={degree}")
    two_c = 2 * degree
    ell = -(-recompute_tokens // two_c)

    def real(chunk: int) -> int:
        return max(0, min(ell, recompute_tokens - chunk * ell))

    return tuple(real(k) + real(two_c - 1 - k) for k in range(degree))


class NotAccepting(VertumnusError):
    """The worker is not ACTIVE (draining, switching, unavailable)."""


class EpochAhead(VertumnusError):
    """The assignment names an epoch this worker has not adopted yet."""


class QueueFull(VertumnusError):
    """The FIFO is at its bound."""


class Redirecting(NotAccepting):
    """The request is being handed back to intake by this worker (redirect not settled)."""


class HandedBack(NotAccepting):
    """This assignment's intake message was admitted here and then handed back: intake
    acknowledged the redirect, which now carries the request (see module rules)."""


class HandBackUnknown(Redirecting):
    """This assignment's intake message was admitted here and handed back, but whether intake
    stored the hand-back is unknown; ``job`` is what to publish again to settle it (see
    module rules). ``joined``: ``job`` is a later attempt that joined the request's job here
    (its own request and source; its hand-back's id is :func:`joined_handback_msg_id`, and
    :meth:`WorkerCore.joined_handback_confirmed` settles it), else the job itself
    (:func:`handback_msg_id`, :meth:`WorkerCore.handback_confirmed`). Answered as
    :class:`Redirecting` by an adapter that does not."""

    def __init__(self, message: str, job: Job, *, joined: bool = False) -> None:
        super().__init__(message)
        self.job = job
        self.joined = joined


@dataclass(slots=True)
class Job:
    """One admitted request and what the adapter needs to finish it."""

    assignment: Assignment
    accepted_at_s: float
    # W3C carrier the request's stage spans hang from (the adapter passes the root's).
    trace_carrier: dict[str, str] = field(default_factory=dict)
    started_at_s: float | None = None
    executed: Assignment | None = None  # the assignment with P, R as found at start
    pinned: tuple[BlockHash, ...] = ()
    source: str | None = None  # Nats-Msg-Id of the intake message placed (INTAKE_MSG_HEADER)
    # When its hand-back began (HANDBACK_AT_HEADER) and why (HANDBACK_CAUSE_HEADER): every
    # publish of it carries these.
    handed_back_at_s: float | None = None
    handback_cause: str | None = None

    @property
    def request_id(self) -> str:
        return self.assignment.request.request_id


@dataclass(frozen=True, slots=True)
class Adoption:
    """Result of :meth:`WorkerCore.adopt`: what changed and what to redirect."""

    adopted: bool  # False: the record was not newer; nothing changed
    epoch: int
    lifecycle: Lifecycle
    member: bool  # this worker is in the record's composition
    redirected: tuple[Job, ...] = ()


class WorkerCore:
    """State of one worker as seen by its leader rank."""

    def __init__(
        self,
        worker_id: str,
        *,
        kind: WorkerKind = WorkerKind.CP,
        epoch: int = 0,
        lifecycle: Lifecycle = Lifecycle.ACTIVE,
        kv_total_blocks: int = 0,
        max_queue: int = 4096,
        time_scale: float = 1.0,
        incarnation: str = "",
        pull_hold_slack: float = 2.0,
        pull_hold_grace_s: float = 0.05,
        pull_hold_max_copy_s: float | None = None,
    ) -> None:
        """``incarnation``: this start of the worker (the adapter draws it), published in
        every state so readers can tell a restarted worker from the one before it.
        ``pull_hold_slack``, ``pull_hold_grace_s``, ``pull_hold_max_copy_s`` (None:
        :data:`PULL_HOLD_MAX_COPY_S`): the bound of :meth:`pull_hold` on waiting for a pull
        that may never be sent."""
        self.group = GpuGroup.from_worker_id(worker_id)  # raises InvalidInput
        if epoch < 0 or kv_total_blocks < 0 or max_queue < 1 or not time_scale > 0:
            raise InvalidInput("epoch, kv_total_blocks >= 0; max_queue >= 1; time_scale > 0")
        if pull_hold_max_copy_s is None:
            pull_hold_max_copy_s = PULL_HOLD_MAX_COPY_S
        if (not 1.0 <= pull_hold_slack < math.inf or not 0.0 <= pull_hold_grace_s < math.inf
                or not 0.0 <= pull_hold_max_copy_s < math.inf):
            raise InvalidInput("pull_hold_slack must be finite and >= 1, pull_hold_grace_s "
                               "and pull_hold_max_copy_s finite and >= 0")
        self.pull_hold_slack = pull_hold_slack
        self.pull_hold_grace_s = pull_hold_grace_s
        self.pull_hold_max_copy_s = pull_hold_max_copy_s
        self.worker_id = WorkerId(worker_id)
        self.kind = kind
        self.epoch = epoch
        self.lifecycle = lifecycle
        self.kv_total_blocks = kv_total_blocks
        self.max_queue = max_queue
        self.time_scale = time_scale
        self.incarnation = incarnation
        self._queue: deque[Job] = deque()
        # Handed back to intake, publish not yet settled (see module rules); insertion order.
        self._redirecting: dict[str, Job] = {}
        self._running: Job | None = None
        self._known: dict[str, Job] = {}
        # Recently finished request ids -> the arrival stamp of the attempt run: a scheduler
        # that crashed between our ack and its own record re-sends the assignment; admission
        # must stay idempotent after the run too.
        self._finished: OrderedDict[str, float] = OrderedDict()
        # Request id → (source, arrival stamp) of the admissions whose redirect intake
        # acknowledged (bounded like _finished): a re-sent assignment of one of them is
        # answered HandedBack. By the stamp too: the attempts of a request usually share their
        # source, and a later attempt (another stamp) under it is no re-send. Several: a later
        # attempt that joined the job (the adapter's) is handed back as its own
        # (remember_handed_back). A None stamp (remember_handed_back without one) matches
        # every attempt from the source.
        self._handed_back: OrderedDict[str, tuple[tuple[str, float | None], ...]] = \
            OrderedDict()
        # (request id, source, arrival stamp) → the handed-back job whose redirect's outcome
        # is unknown (bounded). By all three, as _joined_unknown: two hand-backs of
        # one request may both be open (a later attempt under the job's source, the job's
        # hand-back placed back here under its own), each settled by its own re-send. By the
        # request id alone, the second replaced the first, whose re-send was then admitted
        # beside a hand-back intake may hold.
        self._handback_unknown: OrderedDict[tuple[str, str, float], Job] = OrderedDict()
        # (request id, source, arrival stamp) → a later attempt that joined a handed-back job,
        # as the adapter described it, whose own hand-back's outcome is unknown (bounded).
        # Keyed by the stamp too: the attempts of a request usually share their source.
        self._joined_unknown: OrderedDict[tuple[str, str, float], Job] = OrderedDict()
        # (request id, source, arrival stamp) of each later attempt that joined a handed-back
        # job and whose own hand-back intake acknowledged (bounded): its re-sent assignment is
        # HandedBack even after the request finished here since (check_joined_handback).
        self._joined_handed_back: OrderedDict[tuple[str, str, float], None] = OrderedDict()
        self._seq = 0
        # The first record is adopted even if its epoch equals the configured start epoch.
        self._adopted_once = False
        self.served = 0
        self.input_tokens = 0
        self.hit_tokens = 0
        self.cache: BlockCache | None = (
            BlockCache(self.worker_id, kv_total_blocks) if kv_total_blocks > 0 else None
        )
        self._pinned_blocks = 0
        self._faulted = False

    # -- queries ----------------------------------------------------------------------------

    @property
    def degree(self) -> int:
        return self.group.degree

    @property
    def faulted(self) -> bool:
        """True once :meth:`fault` was called: the worker can no longer compute (module rules)."""
        return self._faulted

    @property
    def running(self) -> Job | None:
        return self._running

    @property
    def queued(self) -> tuple[Job, ...]:
        """Requests waiting in the FIFO (not started), in order."""
        return tuple(self._queue)

    def job(self, request_id: str) -> Job | None:
        """The job of ``request_id`` queued or running here; None when there is none."""
        return self._known.get(request_id)

    def answered(self, request_id: str) -> bool:
        """Whether this worker finished ``request_id`` (ran it to its first token, or failed
        it) recently enough to remember (``FINISHED_MEMORY``): :meth:`admit` will not run it
        again."""
        return request_id in self._finished

    def finished_arrival(self, request_id: str) -> float | None:
        """The arrival stamp of the attempt of ``request_id`` this worker finished (as
        :meth:`answered` remembers it); None when it remembers none."""
        return self._finished.get(request_id)

    @property
    def redirecting(self) -> tuple[Job, ...]:
        """Requests handed back to intake whose redirect is not settled yet, oldest first."""
        return tuple(self._redirecting.values())

    def __len__(self) -> int:
        """Requests waiting, being redirected or running."""
        return len(self._queue) + len(self._redirecting) + (self._running is not None)

    def outstanding_s(self, now: float) -> float:
        total = sum(j.assignment.predicted_s for j in self._queue)
        total += sum(j.assignment.predicted_s for j in self._redirecting.values())
        if self._running is not None and self._running.started_at_s is not None:
            elapsed = max(0.0, now - self._running.started_at_s) / self.time_scale
            total += max(0.0, self._running.assignment.predicted_s - elapsed)
        return min(total, _MAX_SECONDS)

    def outstanding_by(self, now: float) -> dict[str, float]:
        """:meth:`outstanding_s` split by the scheduler replica that placed each request
        (``Assignment.scheduler_id``; requests without one are in no entry). At most
        MAX_SCHEDULER_REPLICAS entries, the largest: a replica left out counts all of this
        worker's work as other replicas' (an over-estimate, never an under-estimate)."""
        by: dict[str, float] = {}

        def add(a: Assignment, seconds: float) -> None:
            if a.scheduler_id is not None:
                by[a.scheduler_id] = by.get(a.scheduler_id, 0.0) + seconds

        for j in self._queue:
            add(j.assignment, j.assignment.predicted_s)
        for j in self._redirecting.values():
            add(j.assignment, j.assignment.predicted_s)
        if self._running is not None and self._running.started_at_s is not None:
            elapsed = max(0.0, now - self._running.started_at_s) / self.time_scale
            add(self._running.assignment,
                max(0.0, self._running.assignment.predicted_s - elapsed))
        if len(by) > MAX_SCHEDULER_REPLICAS:
            by = dict(sorted(by.items(), key=lambda kv: -kv[1])[:MAX_SCHEDULER_REPLICAS])
        return {k: min(v, _MAX_SECONDS) for k, v in by.items()}

    def state(self, now: float, *, kv_free_blocks: int | None = None,
              max_seq_len: int | None = None, handing_back: int = 0) -> WorkerState:
        """The WorkerState to publish now (``seq`` increases on every call). ``max_seq_len``:
        the engine's prompt limit, published as is (None: not known); the core does not
        enforce it (the backend refuses a longer prompt). ``handing_back``: requests the
        adapter still hands back that are not the core's jobs (later attempts that joined a
        handed-back job), counted in ``queue_len`` like the core's own redirecting jobs: the
        worker is not empty until they are in intake. Raises InvalidInput if negative."""
        if handing_back.__class__ is not int or handing_back < 0:
            raise InvalidInput(f"handing_back must be an integer >= 0, got {handing_back!r}")
        self._seq += 1
        free = (
            self.kv_total_blocks - self._pinned_blocks if kv_free_blocks is None else kv_free_blocks
        )
        return WorkerState(
            worker_id=self.worker_id,
            kind=self.kind,
            degree=self.degree,
            gpus=list(self.group.gpus),
            epoch=self.epoch,
            lifecycle=self.lifecycle,
            queue_len=len(self) + handing_back,
            outstanding_s=self.outstanding_s(now),
            outstanding_by=self.outstanding_by(now),
            kv_free_blocks=max(0, min(free, self.kv_total_blocks)),
            kv_total_blocks=self.kv_total_blocks,
            kv_cached_blocks=len(self.cache) if self.cache is not None else 0,
            hit_tokens=self.hit_tokens,
            input_tokens=self.input_tokens,
            served=self.served,
            seq=self._seq,
            incarnation=self.incarnation,
            max_seq_len=max_seq_len,
            heartbeat_s=now,
        )

    # -- transitions ------------------------------------------------------------------------

    def admit(
        self, a: Assignment, now: float, trace_carrier: Mapping[str, str] | None = None,
        *, source: str | None = None, again: bool = False,
    ) -> int:
        """Queue ``a``; return the number of requests ahead of it (running included).

        ``source``: the intake message the scheduler placed (see module rules); None (an
        older scheduler, a test) is never matched as handed back. A request this worker
        finished is admitted as done (0, not run twice) unless ``again``: a later attempt
        under its id that the adapter cannot answer from what it kept (other content, or an
        answer no longer kept), which then runs like a new request. A joined attempt whose
        hand-back's outcome is unknown, or whose hand-back intake acknowledged, comes first
        (:meth:`check_joined_handback`), even when the request finished here since or its job
        is being redirected (module rules)."""
        rid = a.request.request_id
        # A joined attempt's own hand-back first: a later attempt that joined the job shares
        # its source as a rule, and its hand-back's success (remember_handed_back) says
        # nothing of the job's own, which must then be published again, not taken as in
        # intake -- nor the job's success of the attempt's (told apart by the arrival stamp).
        # Before a redirect of the job (the adapter's order: the attempt's answer does not
        # wait for the job's) and before "finished here": another attempt finishing here says
        # nothing of this one's hand-back, unknown or in intake (HandedBack). So for the job's
        # own hand-back when another attempt finished here (check_handback).
        self.check_handback(a, source=source)
        redirecting = self._redirecting.get(rid)
        if redirecting is not None:
            # Handed back to intake and maybe already stored there: queueing it here too could
            # run it twice. The scheduler retries later; by then the redirect has settled.
            # (Never also finished here: admitting it forgot it as finished.)
            raise Redirecting(f"{rid} is being redirected by {self.worker_id}")
        if rid in self._finished and not again:
            return 0  # already served (its result went out); do not run it twice
        self._check_job_handback(a, source=source)
        known = self._known.get(rid)
        if known is not None:
            if known is self._running:
                return 0
            return list(self._queue).index(known) + (self._running is not None)
        if a.worker_id != self.worker_id:
            raise UnknownWorker(f"assignment for {a.worker_id} reached {self.worker_id}")
        if a.degree != self.degree:
            raise InvalidInput(f"assignment degree {a.degree} != worker degree {self.degree}")
        if self.lifecycle is not Lifecycle.ACTIVE:
            raise NotAccepting(f"{self.worker_id} is {self.lifecycle.value}")
        if a.epoch > self.epoch:
            raise EpochAhead(f"{self.worker_id} is at epoch {self.epoch}, assignment {a.epoch}")
        if len(self) >= self.max_queue:
            raise QueueFull(f"{self.worker_id} queue is full ({self.max_queue})")
        position = len(self._queue) + (self._running is not None)  # redirecting: not ahead
        job = Job(a, accepted_at_s=now, trace_carrier=dict(trace_carrier or {}), source=source)
        self._queue.append(job)
        self._known[rid] = job
        self._finished.pop(rid, None)  # run again (``again``): it is no longer finished here
        return position

    def check_handback(self, a: Assignment, *, source: str | None) -> None:
        """What the adapter asks before it answers a re-sent assignment from the answer it
        kept, and :meth:`admit` first: :meth:`check_joined_handback`, then -- when this
        worker finished the request as another attempt (another arrival stamp than ``a``'s)
        -- the job's own hand-back of ``source`` and ``a``'s stamp (:class:`HandBackUnknown`
        or :class:`HandedBack`, as :meth:`admit` answers it when nothing finished here
        since). Intake holds (or may hold) that hand-back, which answers the job's attempt
        wherever it runs. Before, "finished here" came first: the re-send was admitted as
        done and the adapter sent it the later attempt's kept answer, stamped for the job's
        attempt -- two answers for one attempt. The request finished here as ``a``'s own
        attempt (the job's hand-back placed back here) is left to :meth:`admit`: answered
        here, done. Changes nothing."""
        self.check_joined_handback(a, source=source)
        done = self._finished.get(a.request.request_id)
        if done is not None and done != a.request.arrival_s:
            self._check_job_handback(a, source=source)

    def _check_job_handback(self, a: Assignment, *, source: str | None) -> None:
        """Raise :class:`HandBackUnknown` / :class:`HandedBack` if ``a`` is the re-sent
        assignment of a job handed back here (its ``source`` and arrival stamp) whose
        hand-back's outcome is unknown / intake acknowledged; else nothing (None ``source``:
        never, module rules)."""
        if source is None:
            return
        # Only the re-sent assignment of the job handed back (its source and arrival stamp):
        # a later attempt under the same source (a gateway publishes every attempt under the
        # request id; a store loss let it be stored anew) is another client's wait, which the
        # job's hand-back does not answer (its answer carries the job's stamp). Before, the
        # source alone matched: such an attempt was answered 410 (acked, placed nowhere:
        # lost) or took the job's unknown hand-back for its own.
        rid, arrival = a.request.request_id, a.request.arrival_s
        unknown = self._handback_unknown.get((rid, source, arrival))
        if unknown is not None:
            raise HandBackUnknown(f"{rid} (intake message {source}) was handed back by "
                                  f"{self.worker_id}; whether intake holds it is unknown",
                                  unknown)
        if self._was_handed_back(rid, source, arrival):
            raise HandedBack(f"{rid} (intake message {source}) was handed back to intake by "
                             f"{self.worker_id}")

    def check_joined_handback(self, a: Assignment, *, source: str | None) -> None:
        """Raise :class:`HandBackUnknown` (``joined``, carrying the attempt) if ``a`` is the
        re-sent assignment of a later attempt that joined a job here and whose hand-back's
        outcome is unknown (:meth:`joined_handback_unknown`: the same request id, ``source``
        and arrival stamp), :class:`HandedBack` if intake acknowledged that hand-back
        (:meth:`remember_handed_back` with the attempt's ``arrival_s``, or
        :meth:`joined_handback_confirmed`); else nothing (None ``source``: never, module
        rules). :meth:`admit` checks it before any other answer, a job of the request being
        redirected and "finished here" included, and so must the adapter before it answers a
        re-send from what it kept (see module rules). Changes nothing."""
        if source is None or not (self._joined_unknown or self._joined_handed_back):
            return
        rid = a.request.request_id
        key = (rid, source, a.request.arrival_s)
        attempt = self._joined_unknown.get(key)
        if attempt is not None:
            raise HandBackUnknown(
                f"{rid} (intake message {source}, arrival {a.request.arrival_s!r}) joined "
                f"a job {self.worker_id} handed back; whether intake holds it is unknown",
                attempt, joined=True)
        if key in self._joined_handed_back:
            raise HandedBack(f"{rid} (intake message {source}, arrival "
                             f"{a.request.arrival_s!r}) joined a job {self.worker_id} handed "
                             "back, and was handed back to intake with it")

    def pull_hold(self, now: float, incoming: Collection[BlockHash] = ()) -> float:
        """Wall seconds the head of the FIFO should still wait before :meth:`start_next`: its
        assignment counted on a route-time pull (``Assignment.pull_copy_s`` > 0, J's pull
        credit with its wait) that has not landed -- the cache does not yet give the prefix
        P it was priced with. It waits until it does:

        * until ``accepted_at_s + time_scale·pull_hold_slack·min(pull_copy_s,
          pull_hold_max_copy_s) + pull_hold_grace_s`` in any case (the copy's command may
          still be on its way), and never longer than that bound from ``now``;
        * after that only while a copy of its first missing block is arriving (``incoming``:
          the blocks of the copy commands this worker is executing -- replicate commands
          and reconcile commands with a source, whose blocks are the root-to-node path, so
          one that brings any of the prefix brings its first missing block; ``math.inf``:
          until the cache changes). The simulator's request waits for its copies in the
          same way, reconcile copies included (sim/simulator.py ``SimConfig.pull_wait``,
          ``pending_credit``).

        The bound counts from the job's admission on this worker's own clock (``now`` of
        :meth:`admit`), not from the scheduler's ``assigned_at_s``: another host's clock, ahead
        by 30 s, held the FIFO 30 s (and one behind cut the wait short). The copy's estimate
        is honoured up to ``pull_hold_max_copy_s`` (cost-model seconds,
        :data:`PULL_HOLD_MAX_COPY_S` by default: ~13× the calibrated longest copy, 256 blocks
        in 0.156 s): the schema lets any finite ``pull_copy_s`` through, and an estimate of
        1e12 s held the FIFO for ever while the worker stayed ACTIVE. So the head of the
        FIFO waits for a pull that is not arriving at most ``time_scale·pull_hold_slack·
        pull_hold_max_copy_s + pull_hold_grace_s`` (4.05 s with the defaults at time scale 1).

        A copy that never comes is not waited for past the bound: the request then recomputes
        what is missing, as without the wait. 0: start it now (or nothing to start)."""
        if self._running is not None or not self._queue or self.cache is None:
            return 0.0
        job = self._queue[0]
        a = job.assignment
        if not a.pull_copy_s:
            return 0.0
        full = self._full_blocks(a)
        hit = self.cache.peek(full)
        if min(hit * a.request.block_size, a.request.input_len - 1) >= a.prefix_tokens:
            return 0.0
        bound = (self.time_scale * self.pull_hold_slack
                 * min(a.pull_copy_s, self.pull_hold_max_copy_s) + self.pull_hold_grace_s)
        # min: a clock stepped back since the admission does not lengthen the wait.
        left = min(bound, job.accepted_at_s + bound - now)
        if left > 0.0:
            return left
        if hit < len(full) and full[hit] in incoming:
            return math.inf
        return 0.0

    def start_next(self, now: float) -> Job | None:
        """Move the head of the FIFO to running, if nothing runs; else None."""
        if self._running is not None or not self._queue:
            return None
        job = self._queue.popleft()
        job.started_at_s = now
        job.executed = self._reuse(job)
        self._running = job
        return job

    @staticmethod
    def _full_blocks(a: Assignment) -> tuple[BlockHash, ...]:
        req = a.request
        n = min(len(req.block_hashes), req.input_len // req.block_size)
        return tuple(BlockHash(h) for h in req.block_hashes[:n])

    def _reuse(self, job: Job) -> Assignment:
        """Look up and pin the cached prefix; return the assignment as it will execute."""
        a = job.assignment
        full = self._full_blocks(a)
        hit = 0
        if self.cache is not None and full:
            try:
                hit = self.cache.lookup(full)
            except InvalidInput:
                # NOTE: a chain that contradicts the cache (a hash collision, a repeated or
                # bad client hash) reuses nothing; raising here would leave the job popped
                # from the FIFO but never running and end the adapter's executor.
                hit = 0
        if hit:
            job.pinned = full[:hit]
            assert self.cache is not None
            self.cache.pin(job.pinned)
            self._pinned_blocks += hit
        length = a.request.input_len
        p = min(hit * a.request.block_size, length - 1)
        if p == a.prefix_tokens:
            return a
        return a.model_copy(update={"prefix_tokens": p, "recompute_tokens": length - p})

    def finish(self, request_id: str, *, ok: bool = True) -> Job:
        """The running request completed (``ok``) or failed; count it and free the slot."""
        job = self._running
        if job is None or job.request_id != request_id:
            raise InvalidInput(f"{request_id} is not the running request")
        self._running = None
        del self._known[request_id]
        self._finished[request_id] = job.assignment.request.arrival_s
        if len(self._finished) > FINISHED_MEMORY:
            self._finished.popitem(last=False)
        self._unpin(job)
        if ok:
            executed = job.executed or job.assignment
            self.served += 1
            self.input_tokens += executed.request.input_len
            self.hit_tokens += executed.prefix_tokens
            full = self._full_blocks(executed)
            if self.cache is not None and full:
                try:
                    self.cache.insert(full)
                except InvalidInput:
                    # NOTE: a chain that contradicts the cache (a hash collision or a bad
                    # client hash) is not cached; the request itself already succeeded.
                    pass
        return job

    def _unpin(self, job: Job) -> None:
        if job.pinned:
            assert self.cache is not None
            self.cache.unpin(job.pinned)
            self._pinned_blocks -= len(job.pinned)
            job.pinned = ()

    def fault(self, running: str | None = None) -> tuple[Job, ...]:
        """The worker can no longer compute (see module rules): lifecycle UNAVAILABLE for good;
        hand back ``running`` (the request whose execution met the fault) first, then every
        queued request in order. Each returned job is *redirecting* until
        :meth:`redirect_settled`, exactly as after :meth:`take_queued`.

        ``running`` None (the fault was detected elsewhere): the running request, if any, stays
        running and ends by :meth:`finish` or by a later ``fault`` naming it. Raises
        InvalidInput, changing nothing, if ``running`` is given and is not the running
        request. Calling it again hands back what was admitted meanwhile (nothing: a faulted
        worker admits nothing) and the running request when named."""
        job = self._running
        if running is not None and (job is None or job.request_id != running):
            raise InvalidInput(f"{running} is not the running request")
        self._faulted = True
        self.lifecycle = Lifecycle.UNAVAILABLE
        handed: list[Job] = []
        if running is not None and job is not None:
            # Not a finish: the request produced nothing, so it is neither served nor
            # remembered as finished (its redirect may bring it back here, or anywhere).
            self._running = None
            self._unpin(job)
            self._redirecting[job.request_id] = job
            handed.append(job)
        handed.extend(self.take_queued())
        return tuple(handed)

    # -- prefix cache -------------------------------------------------------------------------

    def take_cache_events(self) -> list[CacheEvent]:
        """Drain the cache's events (stored / removed / cleared), oldest first."""
        return self.cache.take_events() if self.cache is not None else []

    def cache_snapshot(self) -> Snapshot:
        """The whole cache index as of the last event (drain events first)."""
        if self.cache is None:
            return Snapshot(self.worker_id, 0, ())
        return self.cache.snapshot()

    def check_command(
        self, cmd: ReplicateCommand | ReclaimCommand | ReconcileCommand | DemoteCommand
    ) -> None:
        """What :meth:`apply_command` refuses, checked alone: a real engine that moves KV
        before the command is applied (rankd's ``prepare_cache_command``) asks first, so a
        refused command changes nothing there either. Raises :class:`UnknownWorker` for
        another worker's command, :class:`EpochAhead` for one from a newer epoch,
        :class:`InvalidInput` without a cache."""
        if cmd.worker_id != self.worker_id:
            raise UnknownWorker(f"command for {cmd.worker_id} reached {self.worker_id}")
        if cmd.epoch > self.epoch:
            raise EpochAhead(f"{self.worker_id} is at epoch {self.epoch}, command {cmd.epoch}")
        if self.cache is None:
            raise InvalidInput(f"{self.worker_id} has no KV cache (kv_total_blocks = 0)")

    def apply_command(
        self, cmd: ReplicateCommand | ReclaimCommand | ReconcileCommand | DemoteCommand
    ) -> CacheCommandResult:
        """Execute a cache-manager command on this worker's cache (sim: no data moves).

        Replicate / reconcile store the root-to-node path ``cmd.blocks`` (only the missing
        part is new; what does not fit stays a miss); reclaim removes the blocks that are
        unpinned and have no retained child; demote moves the cached ones among ``cmd.blocks``
        to the evict-first end of the LRU (nothing removed, no event; ``blocks_done`` = the
        blocks demoted; uncached ones and ones with a cached child left behind skipped,
        ``BlockCache.demote``). Visibility changes only through the events.
        Raises :class:`UnknownWorker` for another worker's command, :class:`EpochAhead` for
        one from a newer epoch, :class:`InvalidInput` without a cache (every op alike):
        :meth:`check_command`.
        """
        self.check_command(cmd)
        assert self.cache is not None
        blocks = tuple(BlockHash(h) for h in cmd.blocks)
        if isinstance(cmd, ReclaimCommand):
            done = len(self.cache.remove(blocks))
        elif isinstance(cmd, DemoteCommand):
            done = self.cache.demote(blocks)  # the uncached ones are skipped, not an error
        elif isinstance(cmd, ReconcileCommand) and cmd.source_worker is None:
            done = 0  # no valid copy left: the pending part becomes an ordinary miss
        else:
            done = self.cache.insert(blocks)  # raises InvalidInput on a contradicting chain
        return CacheCommandResult(
            command_id=cmd.command_id, worker_id=self.worker_id, ok=True, blocks_done=done
        )

    def take_queued(self) -> tuple[Job, ...]:
        """Hand back every queued (not running) request, in order: each leaves the FIFO and
        becomes *redirecting* until :meth:`redirect_settled` (see module rules)."""
        jobs = tuple(self._queue)
        self._queue.clear()
        for j in jobs:
            self._redirecting[j.request_id] = j
        return jobs

    def redirect_settled(self, request_id: str, *, in_intake: bool = False,
                         unknown: bool = False) -> Job:
        """The redirect of ``request_id`` is over: intake acknowledged it (``in_intake``), or
        its outcome is ``unknown`` (a publish timed out: intake may hold it), or it definitely
        failed (neither; the client is told). Forget the request. Raises InvalidInput if it is
        not redirecting, or if both flags are given.

        The id is not remembered as finished: it may legitimately come back to this worker
        through intake (under the redirect's message) once the worker is ACTIVE again. With
        ``in_intake`` its source and arrival stamp are remembered, so a re-sent assignment of
        the *old* message (not a later attempt under its source: another stamp) is answered
        :class:`HandedBack`; with ``unknown`` the job is remembered, so one raises
        :class:`HandBackUnknown` (see module rules). After a definite failure nothing is
        remembered: a re-sent assignment is refused as for any worker not ACTIVE, or
        admitted."""
        if in_intake and unknown:
            raise InvalidInput("a redirect is either in intake or of unknown outcome")
        job = self._redirecting.pop(request_id, None)
        if job is None:
            raise InvalidInput(f"{request_id} is not being redirected by {self.worker_id}")
        del self._known[request_id]
        if job.source is not None:
            if in_intake:
                self._remember_handed_back(request_id, job.source,
                                           job.assignment.request.arrival_s)
            elif unknown:
                key = (request_id, job.source, job.assignment.request.arrival_s)
                self._handback_unknown[key] = job
                self._handback_unknown.move_to_end(key)
                if len(self._handback_unknown) > FINISHED_MEMORY:
                    self._handback_unknown.popitem(last=False)
        return job

    def handback_confirmed(self, request_id: str, *, source: str | None = None,
                           arrival_s: float | None = None) -> None:
        """Intake acknowledged a hand-back whose outcome was unknown (published again under
        its id): from now on a re-sent assignment of its source (and the job's arrival stamp)
        is :class:`HandedBack`. ``source``, ``arrival_s``: the job's (:class:`HandBackUnknown`
        ``job``), when ``request_id`` may have more than one open (None: any; the latest).
        Raises InvalidInput if no such hand-back is remembered."""
        key = next((k for k in reversed(self._handback_unknown) if k[0] == request_id
                    and source in (None, k[1]) and arrival_s in (None, k[2])), None)
        job = self._handback_unknown.pop(key) if key is not None else None
        if job is None or job.source is None:
            raise InvalidInput(f"no hand-back of unknown outcome for {request_id}")
        self._remember_handed_back(request_id, job.source, job.assignment.request.arrival_s)

    def joined_handback_unknown(self, attempt: Job) -> None:
        """The adapter's hand-back of a later attempt that joined a job here ended with its
        outcome unknown (intake may or may not hold it). ``attempt`` describes that attempt:
        its request (the job's assignment with the attempt's ``request``: its arrival stamp)
        and its ``source`` (the intake message whose assignment brought it). From now on a
        re-sent assignment of that source and arrival stamp raises :class:`HandBackUnknown`
        (``joined``, carrying ``attempt``) until :meth:`joined_handback_confirmed` (see module
        rules). Without a source nothing is remembered: no re-sent assignment could be
        matched to it, and only tests and pre-header schedulers send none (module rules). The
        latest ``FINISHED_MEMORY`` are remembered."""
        if attempt.source is None:
            return
        key = (attempt.request_id, attempt.source, attempt.assignment.request.arrival_s)
        self._joined_unknown[key] = attempt
        self._joined_unknown.move_to_end(key)
        if len(self._joined_unknown) > FINISHED_MEMORY:
            self._joined_unknown.popitem(last=False)

    def joined_handback_confirmed(self, attempt: Job) -> None:
        """Intake acknowledged the hand-back of ``attempt`` (a joined attempt whose outcome
        was unknown, :meth:`joined_handback_unknown`; published again under its id): from now
        on a re-sent assignment of its source is :class:`HandedBack`, that of its source and
        arrival stamp even after the request finished here (as
        :meth:`remember_handed_back` with ``arrival_s``). Raises InvalidInput if no such
        hand-back is remembered."""
        arrival = attempt.assignment.request.arrival_s
        key = (attempt.request_id, attempt.source or "", arrival)
        known = self._joined_unknown.pop(key, None)
        if known is None or known.source is None:
            raise InvalidInput(f"no joined hand-back of unknown outcome for "
                               f"{attempt.request_id} (arrival {arrival!r})")
        self.remember_handed_back(known.request_id, known.source, arrival_s=arrival)

    def remember_handed_back(self, request_id: str, source: str, *,
                             arrival_s: float | None = None) -> None:
        """Intake acknowledged a hand-back of ``request_id``'s admission from ``source`` that
        the adapter made itself (a later attempt that joined the job here, handed back as
        its own intake message): from now on a re-sent assignment of that source (and
        ``arrival_s``; every attempt from the source without it) is :class:`HandedBack`, as
        for a job's (:meth:`redirect_settled`). Before, it was admitted and ran here while its
        hand-back ran elsewhere too. The job's own re-send (its own stamp) is not answered by
        it: before, when the two shared their source, a job whose own hand-back had failed
        was answered 410 on the strength of the attempt's.

        ``arrival_s``: the attempt's arrival stamp (the adapter always gives it). The attempt
        is then remembered by it too (the latest ``FINISHED_MEMORY``): its re-sent
        assignment -- the same source and stamp -- is :class:`HandedBack` before "finished
        here" (:meth:`check_joined_handback`, module rules), while another attempt of the
        request that finished here (another stamp) is still admitted as done. Without it, the
        request finishing here since (the job's hand-back placed back here) answered the
        re-send as done, and the adapter sent it the kept answer: the attempt answered here
        and again wherever intake runs its hand-back."""
        self._remember_handed_back(request_id, source, arrival_s)
        if arrival_s is not None:
            key = (request_id, source, arrival_s)
            self._joined_handed_back[key] = None
            self._joined_handed_back.move_to_end(key)
            if len(self._joined_handed_back) > FINISHED_MEMORY:
                self._joined_handed_back.popitem(last=False)

    def _remember_handed_back(self, request_id: str, source: str,
                              arrival_s: float | None) -> None:
        known = self._handed_back.get(request_id, ())
        if (source, arrival_s) not in known:
            # Few per id (one per attempt a store loss made): no bound needed beyond the ids'.
            self._handed_back[request_id] = (*known, (source, arrival_s))
        self._handed_back.move_to_end(request_id)
        if len(self._handed_back) > FINISHED_MEMORY:
            self._handed_back.popitem(last=False)

    def _was_handed_back(self, request_id: str, source: str, arrival_s: float) -> bool:
        """Whether intake acknowledged the hand-back of ``request_id``'s admission from
        ``source`` with arrival stamp ``arrival_s`` (or of every attempt from ``source``: one
        remembered without a stamp)."""
        known = self._handed_back.get(request_id, ())
        return (source, arrival_s) in known or (source, None) in known

    def set_lifecycle(self, lifecycle: Lifecycle) -> tuple[Job, ...]:
        """Change lifecycle locally (e.g. shutdown); leaving ACTIVE returns queued jobs. A
        faulted worker stays UNAVAILABLE whatever is asked (module rules)."""
        self.lifecycle = Lifecycle.UNAVAILABLE if self._faulted else lifecycle
        return self.take_queued() if self.lifecycle is not Lifecycle.ACTIVE else ()

    def adopt(self, record: EpochRecord) -> Adoption:
        """Adopt a newer epoch record (see module rules); an older or equal one is ignored.
        A faulted worker adopts the epoch but stays UNAVAILABLE (the Adoption says so)."""
        mine = next((w for w in record.workers if w.worker_id == self.worker_id), None)
        if record.epoch <= self.epoch and self._adopted_once:
            return Adoption(False, self.epoch, self.lifecycle, mine is not None)
        self._adopted_once = True
        self.epoch = max(self.epoch, record.epoch)
        lifecycle = mine.lifecycle if mine is not None else Lifecycle.UNAVAILABLE
        redirected = self.set_lifecycle(lifecycle)
        return Adoption(True, self.epoch, self.lifecycle, mine is not None, redirected)
