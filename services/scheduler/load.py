"""Per-worker outstanding work: the queuing-delay proxy q_w of §5.3, and counters for baselines.

    q_w(t) = Σ_{j assigned to w, unfinished at t} predicted remaining service of j

A request's predicted service is its s_{j,w} = Ê_{C_w}(R_{j,w}, P_{j,w}), reserved on the worker
*immediately* at placement (§5.2: "so that concurrent arrivals do not observe the same
pre-assignment load state"). A waiting request counts its whole prediction; the running one counts
its prediction minus the time it has run, never below ``overrun_floor_s`` (default 0: a request
that overran its prediction is treated as about to finish — the model has no better estimate, and
a positive floor would charge every overrunning worker a constant that J cannot tell apart from
real work). The floor is a constructor parameter so a deployment can choose otherwise.
``time_scale`` (default 1): clock seconds per predicted second, for a harness whose clock runs
scaled (``vertumnus up``'s simulated ranks sleep the modelled time × its time scale); the time a
request has run is divided by it before it is taken off the prediction.

Other scheduler replicas (live, several replicas share the intake): each reserves only what it
placed, so a worker also holds *foreign* work this tracker never saw. The worker reports it
(``WorkerState.outstanding_s`` minus this replica's share of it): :meth:`WorkerLoad.set_foreign`
records that figure and its time, and q_w adds it, less the time run since (the worker serves
its FIFO at one predicted second per predicted second; the next report corrects the
estimate), never below 0. A lone scheduler has no foreign work: its q_w is unchanged.

Pure: time is a parameter (``now``), never read from a clock. Every mutator validates first and
raises a typed error with nothing changed.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from services.scheduler.errors import DuplicateRequest, IllegalTransition, UnknownRequest
from shared.ids import InvalidInput, RequestId, WorkerId

_MAX_WORK_S = sys.float_info.max


@dataclass(slots=True)
class Assignment:
    """One unfinished request on a worker. ``started_at`` is None while it waits."""

    request_id: RequestId
    predicted_s: float
    tokens: int = 0
    uncached_tokens: int = 0
    blocks: int = 0
    reserved_at: float = 0.0
    started_at: float | None = None


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """A worker's load at one instant, for tracing, state messages and ``explain()``."""

    worker: WorkerId
    queue_delay_s: float
    waiting: int
    running: int
    inflight_tokens: int
    inflight_uncached_tokens: int
    inflight_blocks: int


def _check_time(name: str, t: float) -> None:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise InvalidInput(f"{name} must be a finite number of seconds, got {t!r}")


def _check_count(name: str, v: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise InvalidInput(f"{name} must be an integer >= 0, got {v!r}")


def _check_work(seconds: float, now: float) -> None:
    """Other replicas' work: finite seconds >= 0, at a finite time."""
    _check_time("seconds", seconds)
    if seconds < 0:
        raise InvalidInput(f"foreign work must be >= 0 seconds, got {seconds!r}")
    _check_time("now", now)


class WorkerLoad:
    """The unfinished requests assigned to one worker, with O(1) aggregates.

    NOTE: ``_queued_s`` (Σ predictions of waiting requests) is kept incrementally so that
    :meth:`queue_delay` costs O(running) — one request on a CP worker — not O(queue). It is reset
    to exactly 0 whenever the queue empties so floating-point drift never accumulates.
    """

    __slots__ = (
        "worker",
        "overrun_floor_s",
        "_per_clock_s",
        "_reqs",
        "_running",
        "_queued_s",
        "_tokens",
        "_uncached",
        "_blocks",
        "_foreign_s",
        "_foreign_at",
    )

    def __init__(self, worker: WorkerId, *, overrun_floor_s: float = 0.0,
                 time_scale: float = 1.0) -> None:
        if not isinstance(worker, str) or not worker:
            raise InvalidInput(f"worker must be a non-empty string, got {worker!r}")
        _check_time("overrun_floor_s", overrun_floor_s)
        if overrun_floor_s < 0:
            raise InvalidInput(f"overrun_floor_s must be >= 0, got {overrun_floor_s!r}")
        _check_time("time_scale", time_scale)
        if not time_scale > 0:
            raise InvalidInput(f"time_scale must be > 0, got {time_scale!r}")
        self.worker = worker
        self.overrun_floor_s = float(overrun_floor_s)
        # Clock seconds -> predicted seconds: ``now`` may run time-scaled (vertumnus up: wall
        # = modelled × scale) while predictions are the profile's seconds. 1/1.0 is exactly
        # 1.0, so an unscaled run computes exactly what it did without the factor.
        self._per_clock_s = 1.0 / float(time_scale)
        self._reqs: dict[RequestId, Assignment] = {}  # insertion order = reservation order
        self._running: dict[RequestId, Assignment] = {}
        self._queued_s = 0.0
        self._tokens = 0
        self._uncached = 0
        self._blocks = 0
        self._foreign_s = 0.0  # other replicas' work at _foreign_at (see the module docstring)
        self._foreign_at = 0.0

    # --- queries -------------------------------------------------------------------------
    def queue_delay(self, now: float) -> float:
        """q_w(now): predicted remaining service of every unfinished request on this worker."""
        q = self._queued_s
        if self._running:
            floor = self.overrun_floor_s
            for a in self._running.values():
                rem = a.predicted_s - (now - a.started_at) * self._per_clock_s  # type: ignore

                q += rem if rem > floor else floor
        if self._foreign_s:
            f = self._foreign_left(now)
            if f > 0.0:
                q += f
        return q

    def _foreign_left(self, now: float) -> float:
        """Other replicas' reported work less what the worker has run since (may be < 0)."""
        return self._foreign_s - (now - self._foreign_at) * self._per_clock_s

    def busy(self, now: float) -> bool:
        """Whether the worker holds unfinished work at ``now``: a request this tracker reserved
        and has not seen finish, or other replicas' reported work not yet run off."""
        if self._reqs:
            return True
        return bool(self._foreign_s) and self._foreign_left(now) > 0.0

    @property
    def foreign_s(self) -> float:
        """Other replicas' work on this worker as last reported (:meth:`set_foreign`)."""
        return self._foreign_s

    @property
    def waiting(self) -> int:
        """Requests reserved here and not started (vLLM's ``waiting``)."""
        return len(self._reqs) - len(self._running)

    @property
    def running(self) -> int:
        """Requests executing now (vLLM's ``running``)."""
        return len(self._running)

    @property
    def unfinished(self) -> int:
        """Waiting + running: SGLang's in-flight request count."""
        return len(self._reqs)

    @property
    def inflight_tokens(self) -> int:
        """Σ input length L of unfinished requests."""
        return self._tokens

    @property
    def inflight_uncached_tokens(self) -> int:
        """Σ uncached suffix R of unfinished requests (llm-d token load, Dynamo prefill tokens)."""
        return self._uncached

    @property
    def inflight_blocks(self) -> int:
        """Σ KV blocks of unfinished requests (Dynamo's active blocks on a prefill worker)."""
        return self._blocks

    @property
    def queued_work_s(self) -> float:
        """Σ predictions of waiting requests (the part of q that does not depend on time)."""
        return self._queued_s

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def assignment(self, request_id: RequestId) -> Assignment:
        try:
            return self._reqs[request_id]
        except KeyError:
            raise UnknownRequest(
                f"request {request_id!r} is not assigned to worker {self.worker}"
            ) from None

    def queued(self) -> tuple[RequestId, ...]:
        """Waiting request ids in reservation order (those a drain redirects, §6.2)."""
        return tuple(r for r in self._reqs if r not in self._running)

    def snapshot(self, now: float) -> LoadSnapshot:
        return LoadSnapshot(
            worker=self.worker,
            queue_delay_s=self.queue_delay(now),
            waiting=self.waiting,
            running=self.running,
            inflight_tokens=self._tokens,
            inflight_uncached_tokens=self._uncached,
            inflight_blocks=self._blocks,
        )

    # --- mutators ------------------------------------------------------------------------
    def set_foreign(self, seconds: float, now: float) -> None:
        """Other scheduler replicas have ``seconds`` of predicted work on this worker as of
        ``now`` (the worker's report); it replaces the previous figure."""
        _check_work(seconds, now)
        self._foreign_s = float(seconds)
        self._foreign_at = float(now)

    def add_foreign(self, seconds: float, now: float) -> None:
        """Another replica just placed ``seconds`` of predicted work here (its placement went
        by before the worker's next report, which then replaces the sum): the foreign work
        still left at ``now`` plus ``seconds``."""
        _check_work(seconds, now)
        left = self._foreign_left(now)
        # Saturated, never inf: two absurd (finite) placements must not make q_w inf, which
        # no JSON status can carry; the worker's next report replaces the sum anyway.
        self._foreign_s = min((left if left > 0.0 else 0.0) + float(seconds), _MAX_WORK_S)
        self._foreign_at = float(now)

    def reserve(
        self,
        request_id: RequestId,
        predicted_s: float,
        *,
        tokens: int = 0,
        uncached_tokens: int = 0,
        blocks: int = 0,
        now: float = 0.0,
    ) -> Assignment:
        """Add a placed request's predicted service to this worker's queue (it waits)."""
        # Fast exact-type checks first (speed: once per placement); anything they do not pass
        # goes through the full validation below, which raises or accepts exactly as before.
        if not (
            predicted_s.__class__ is float and 0.0 <= predicted_s < math.inf
            and now.__class__ is float and -math.inf < now < math.inf
            and tokens.__class__ is int and tokens >= 0
            and uncached_tokens.__class__ is int and uncached_tokens >= 0
            and blocks.__class__ is int and blocks >= 0
            and request_id.__class__ is str and request_id
        ):
            self._check_reserve(request_id, predicted_s, tokens, uncached_tokens, blocks, now)
        if request_id in self._reqs:
            raise DuplicateRequest(
                f"request {request_id!r} is already reserved on worker {self.worker}"
            )
        a = Assignment(request_id, float(predicted_s), tokens, uncached_tokens, blocks, float(now))
        self._reqs[request_id] = a
        self._queued_s += a.predicted_s
        self._tokens += tokens
        self._uncached += uncached_tokens
        self._blocks += blocks
        return a

    @staticmethod
    def _check_reserve(request_id: RequestId, predicted_s: float, tokens: int,
                       uncached_tokens: int, blocks: int, now: float) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidInput(f"request_id must be a non-empty string, got {request_id!r}")
        _check_time("predicted_s", predicted_s)
        if predicted_s < 0:
            raise InvalidInput(f"predicted_s must be >= 0, got {predicted_s!r}")
        _check_count("tokens", tokens)
        _check_count("uncached_tokens", uncached_tokens)
        _check_count("blocks", blocks)
        _check_time("now", now)

    def start(self, request_id: RequestId, now: float) -> None:
        """The worker began executing the request at ``now``: it stops waiting, starts running."""
        _check_time("now", now)
        a = self.assignment(request_id)
        if a.started_at is not None:
            raise IllegalTransition(
                f"request {request_id!r} already started on worker {self.worker} at {a.started_at}"
            )
        a.started_at = float(now)
        self._running[request_id] = a
        self._dequeue_work(a)

    def finish(self, request_id: RequestId) -> Assignment:
        """The request left the worker (completed or aborted): release everything it held."""
        a = self.assignment(request_id)
        del self._reqs[request_id]
        if a.started_at is not None:
            del self._running[request_id]
        else:
            self._dequeue_work(a)
        self._release_counts(a)
        return a

    def withdraw(self, request_id: RequestId) -> Assignment:
        """Take a *waiting* request off this worker so it can be redirected (drain, §6.2).

        A running request cannot be withdrawn (in-flight prefill finishes under the old
        geometry): :class:`IllegalTransition`.
        """
        a = self.assignment(request_id)
        if a.started_at is not None:
            raise IllegalTransition(
                f"request {request_id!r} is running on worker {self.worker}; "
                "only queued requests can be redirected"
            )
        del self._reqs[request_id]
        self._dequeue_work(a)
        self._release_counts(a)
        return a

    def withdraw_queued(self) -> tuple[Assignment, ...]:
        """Withdraw every waiting request, in reservation order (a draining worker's queue)."""
        return tuple(self.withdraw(r) for r in self.queued())

    # --- internals -----------------------------------------------------------------------
    def _dequeue_work(self, a: Assignment) -> None:
        if len(self._reqs) == len(self._running):
            self._queued_s = 0.0  # queue empty: drop accumulated rounding exactly
        else:
            self._queued_s = max(0.0, self._queued_s - a.predicted_s)

    def _release_counts(self, a: Assignment) -> None:
        self._tokens -= a.tokens
        self._uncached -= a.uncached_tokens
        self._blocks -= a.blocks

    def __repr__(self) -> str:
        return (
            f"WorkerLoad({self.worker}, waiting={self.waiting}, running={self.running}, "
            f"queued_work_s={self._queued_s:.4f})"
        )
