"""The candidate filter of §5.2: which workers may serve a request at all.

A worker is excluded if it is unavailable, draining or switching (only ACTIVE workers admit new
requests, §6.2), if the input is longer than its ``max_seq_len``, or if the request's own KV
(L tokens) cannot fit in its ``kv_capacity_tokens`` (LRU-evictable blocks count as free). A
prefix-cache miss never excludes a worker: it can always recompute the prefix.

Every policy, baselines included, uses this filter: a baseline cannot send a request to a worker
that physically cannot take it either.

One exclusion is permanent: a request longer than the ``max_seq_len`` of every worker the view
holds (:func:`sequence_too_long`). The others pass (a worker finishes draining or switching,
comes back, or a split or merge changes the KV capacity), so the scheduler holds and retries a
request they exclude, but refuses this one at once (:class:`SequenceTooLong`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

from services.scheduler.decision import Exclusion
from services.scheduler.errors import SequenceTooLong
from services.scheduler.load import WorkerLoad
from services.scheduler.view import ClusterView, RequestInfo, WorkerView
from shared.ids import InvalidInput, UnknownWorker, WorkerId
from shared.worker import Lifecycle

LIFECYCLE_EXCLUSION: Final[Mapping[Lifecycle, Exclusion | None]] = {
    Lifecycle.ACTIVE: None,
    Lifecycle.DRAINING: Exclusion.DRAINING,
    Lifecycle.SWITCHING: Exclusion.SWITCHING,
    Lifecycle.UNAVAILABLE: Exclusion.UNAVAILABLE,
}


def exclusion(worker: WorkerView, length: int) -> Exclusion | None:
    """Why ``worker`` cannot serve a request of ``length`` tokens, or None if it can."""
    reason = LIFECYCLE_EXCLUSION[worker.lifecycle]
    if reason is not None:
        return reason
    if length > worker.max_seq_len:
        return Exclusion.TOO_LONG
    if length > worker.kv_capacity_tokens:
        return Exclusion.NO_MEMORY
    return None


def longest_max_seq_len(view: ClusterView) -> int | None:
    """The largest ``max_seq_len`` over every worker of ``view``, whatever its lifecycle; None
    for a view without workers.

    A draining, switching or unavailable worker counts: it may serve again. A view without
    workers bounds nothing (the scheduler has seen no worker yet, or every state expired): the
    workers still to come may have any limit. KV capacity is deliberately not part of it: it
    differs by degree and a split or merge changes it, so it is never a reason to refuse.
    """
    return max((w.max_seq_len for w in view.workers), default=None)


def sequence_too_long(request: RequestInfo, view: ClusterView,
                      longest: int | None = None) -> SequenceTooLong | None:
    """The refusal of a request no worker of ``view`` can ever serve (its length exceeds every
    worker's ``max_seq_len``), or None when some worker's limit admits it or the view is
    empty. ``longest``: :func:`longest_max_seq_len` of ``view`` when the caller keeps it (a
    placement must not scan 512 workers for it); computed here otherwise. Pure."""
    if longest is None:
        longest = longest_max_seq_len(view)
    if longest is None or request.length <= longest:
        return None
    return SequenceTooLong(request.request_id, request.length, longest,
                           {w.worker_id: Exclusion.TOO_LONG for w in view.workers})


def check_place_inputs(
    request: RequestInfo,
    view: ClusterView,
    held_blocks: Mapping[WorkerId, int],
    loads: Mapping[WorkerId, WorkerLoad],
    now: float,
) -> None:
    """Validate a ``place`` call; raise a typed error before any policy state changes.

    ``held_blocks`` may name workers outside the view (the cache index can lag the view, e.g.
    just after a split); those entries are ignored. A negative or non-integer count is
    :class:`InvalidInput`. A worker of the view without a load tracker is :class:`UnknownWorker`.
    """
    if not isinstance(request, RequestInfo):
        raise InvalidInput(f"request must be a RequestInfo, got {type(request).__name__}")
    if not isinstance(view, ClusterView):
        raise InvalidInput(f"view must be a ClusterView, got {type(view).__name__}")
    if isinstance(now, bool) or not isinstance(now, (int, float)) or not math.isfinite(now):
        raise InvalidInput(f"now must be a finite number of seconds, got {now!r}")
    for w, h in held_blocks.items():
        if isinstance(h, bool) or not isinstance(h, int) or h < 0:
            raise InvalidInput(f"held_blocks[{w!r}] must be an integer >= 0, got {h!r}")
    for w in view.workers:
        if w.worker_id not in loads:
            raise UnknownWorker(f"no load tracker for worker {w.worker_id!r} of the cluster view")


def reusable_prefix(held: int, block_size: int, length: int) -> int:
    """P = min(held·B, L − 1): only full blocks are reused and R ≥ 1 always."""
    p = held * block_size
    return p if p < length else length - 1
