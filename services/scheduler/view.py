"""What a placement policy sees: the request, and the cluster's workers (§5.2).

The view is the slowly-changing part of the scheduler's state (kind, degree, lifecycle, epoch and
limits of every worker, the block size). It is immutable: the adapter builds a new one when a
worker-state or epoch message arrives. The fast-changing part, each worker's outstanding work, is
in :mod:`services.scheduler.load` (one mutable :class:`WorkerLoad` per worker), because a
reservation happens on every placement and rebuilding a frozen view per request would cost more
than the placement itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from shared.ids import (
    DEFAULT_BLOCK_SIZE,
    BlockHash,
    InvalidInput,
    RequestId,
    UnknownWorker,
    WorkerId,
)
from shared.worker import Lifecycle, WorkerKind

UNLIMITED: Final[int] = 2**62
"""A limit that never binds (sequence length or KV capacity of a worker without a limit)."""


_INT_ONLY: Final[set[type]] = {int}


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """One prefill request as the scheduler sees it.

    ``length`` is the input length L in tokens (≥ 1); ``block_hashes`` are the chained hashes of
    its cache blocks in order (in traces the ``hash_ids``; the last one may cover a partial
    block, which is never reused); ``arrival`` is the arrival time in seconds.
    """

    request_id: RequestId
    length: int
    block_hashes: tuple[BlockHash, ...] = ()
    arrival: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidInput(f"request_id must be a non-empty string, got {self.request_id!r}")
        if isinstance(self.length, bool) or not isinstance(self.length, int) or self.length < 1:
            raise InvalidInput(
                f"request {self.request_id!r}: length must be an integer >= 1, got {self.length!r}"
            )
        if not isinstance(self.block_hashes, tuple):
            # Accept any sequence from callers, store a tuple so the request stays hashable.
            if isinstance(self.block_hashes, Sequence) and not isinstance(self.block_hashes, str):
                object.__setattr__(self, "block_hashes", tuple(self.block_hashes))
            else:
                raise InvalidInput(
                    f"request {self.request_id!r}: block_hashes must be a sequence of ints"
                )
        hs = self.block_hashes
        # Exact ints (a bool is none): a list or string as a hash would fail only deep in the
        # core, after the placement was reserved (one C-level pass; speed).
        if hs and set(map(type, hs)) != _INT_ONLY:
            bad = next(h for h in hs if type(h) is not int)
            raise InvalidInput(f"request {self.request_id!r}: block_hashes must be a sequence "
                               f"of ints, got {bad!r}")
        if not (isinstance(self.arrival, (int, float)) and math.isfinite(self.arrival)):
            raise InvalidInput(
                f"request {self.request_id!r}: arrival must be finite, got {self.arrival!r}"
            )


@dataclass(frozen=True, slots=True)
class WorkerView:
    """One prefill worker as the scheduler sees it.

    ``kv_capacity_tokens`` is the total KV the worker can hold: LRU-evictable blocks count as
    free, so the worker is ineligible for memory only if the request's own KV (L tokens) cannot
    fit at all (design.md, "KV capacity"). ``max_seq_len`` is the longest input it serves.
    ``epoch`` is the configuration epoch the worker was last acknowledged under (§6.2); the
    scheduler does not compare epochs (the controller only marks a worker ACTIVE once every rank
    acknowledged), it carries them for tracing.
    """

    worker_id: WorkerId
    degree: int
    kind: WorkerKind = WorkerKind.CP
    lifecycle: Lifecycle = Lifecycle.ACTIVE
    epoch: int = 0
    max_seq_len: int = UNLIMITED
    kv_capacity_tokens: int = UNLIMITED

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise InvalidInput(f"worker_id must be a non-empty string, got {self.worker_id!r}")
        if isinstance(self.degree, bool) or not isinstance(self.degree, int) or self.degree < 1:
            raise InvalidInput(f"worker {self.worker_id}: degree must be >= 1, got {self.degree!r}")
        if not isinstance(self.kind, WorkerKind):
            try:
                object.__setattr__(self, "kind", WorkerKind(self.kind))
            except ValueError as exc:
                raise InvalidInput(f"worker {self.worker_id}: unknown kind {self.kind!r}") from exc
        if not isinstance(self.lifecycle, Lifecycle):
            try:
                object.__setattr__(self, "lifecycle", Lifecycle(self.lifecycle))
            except ValueError as exc:
                raise InvalidInput(
                    f"worker {self.worker_id}: unknown lifecycle {self.lifecycle!r}"
                ) from exc
        for name in ("epoch", "max_seq_len", "kv_capacity_tokens"):
            v = getattr(self, name)
            lo = 0 if name != "max_seq_len" else 1
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise InvalidInput(
                    f"worker {self.worker_id}: {name} must be an int >= {lo}, got {v!r}"
                )


@dataclass(frozen=True)
class ClusterView:
    """The workers a policy chooses among, in a fixed order, and the cache block size B.

    Worker order is the view's iteration order; policies that need an order for tie-breaks or
    rotation (vLLM, SGLang, round robin) use it. Worker ids are unique.
    """

    workers: tuple[WorkerView, ...]
    block_size: int = DEFAULT_BLOCK_SIZE
    _index: Mapping[WorkerId, WorkerView] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.workers, tuple):
            if not isinstance(self.workers, Iterable):
                raise InvalidInput("ClusterView.workers must be a sequence of WorkerView")
            object.__setattr__(self, "workers", tuple(self.workers))
        if (
            isinstance(self.block_size, bool)
            or not isinstance(self.block_size, int)
            or self.block_size < 1
        ):
            raise InvalidInput(f"block_size must be an integer >= 1, got {self.block_size!r}")
        index: dict[WorkerId, WorkerView] = {}
        for w in self.workers:
            if not isinstance(w, WorkerView):
                raise InvalidInput(f"ClusterView.workers holds a non-WorkerView: {w!r}")
            if w.worker_id in index:
                raise InvalidInput(f"duplicate worker id in cluster view: {w.worker_id}")
            index[w.worker_id] = w
        object.__setattr__(self, "_index", index)

    def __len__(self) -> int:
        return len(self.workers)

    def __contains__(self, worker: object) -> bool:
        return worker in self._index

    def worker(self, worker_id: WorkerId) -> WorkerView:
        """The worker's view; :class:`UnknownWorker` if it is not in this view."""
        try:
            return self._index[worker_id]
        except KeyError:
            raise UnknownWorker(f"worker {worker_id!r} is not in the cluster view") from None

    @property
    def worker_ids(self) -> tuple[WorkerId, ...]:
        return tuple(self._index)

    @property
    def degrees(self) -> tuple[int, ...]:
        """The distinct degrees present, ascending."""
        return tuple(sorted({w.degree for w in self.workers}))
