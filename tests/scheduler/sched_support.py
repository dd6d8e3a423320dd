"""Helpers of the scheduler tests: a Profile with round coefficients, hand-derivable terms."""

from __future__ import annotations

from services.scheduler import ClusterView, RequestInfo, WorkerLoad, WorkerView
from shared.costmodel import Coefficients, Profile
from shared.ids import BlockHash, RequestId, WorkerId

# Ê_C(R, P) = 0.1 + 0.001·R + 0.0001·P + (0.002·R + 1e-6·W(R, P)) / C
ROUND = Profile(coefficients=Coefficients(d=0.1, a=0.001, b=0.0001, c=0.002, alpha=1e-6))
B = 100  # block size of the worked examples


def req(rid: str, length: int, nblocks: int | None = None, first: int = 0) -> RequestInfo:
    n = nblocks if nblocks is not None else -(-length // B)
    return RequestInfo(RequestId(rid), length, tuple(BlockHash(first + k) for k in range(n)))


def view(*workers: WorkerView, block_size: int = B) -> ClusterView:
    return ClusterView(tuple(workers), block_size=block_size)


def loads_for(v: ClusterView) -> dict[WorkerId, WorkerLoad]:
    return {w.worker_id: WorkerLoad(w.worker_id) for w in v.workers}
