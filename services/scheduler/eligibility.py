"""The candidate filter of §5.2: which workers may serve a request at all.

A worker is excluded if it is unavailable, draining or switching (only ACTIVE workers admit new
requests, §6.2), if the input is longer than its ``max_seq_len``, or if the request's own KV
(L tokens) cannot fit in its ``kv_capacity_tokens`` (LRU-evictable blocks count as free). A
prefix-cache miss never excludes a worker: it can always recompute the prefix.

Every policy, baselines included, uses this filter: a baseline cannot send a request to a worker
that physically cannot take it either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Final

from services.scheduler.decision import Exclusion
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
