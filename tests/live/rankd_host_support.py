"""Helpers of the rank host's live tests: an epoch record naming active workers, and a sim
backend that says whether it was closed."""

from __future__ import annotations

import time

from services.rankd.backend import SimBackend
from shared.schemas import EpochRecord, EpochWorker, to_json
from shared.worker import GpuGroup, Lifecycle


def record(epoch: int, *wids: str) -> bytes:
    """The JSON of an epoch record ``epoch`` whose workers ``wids`` are all ACTIVE (their GPUs
    from their ids), committed now."""
    workers = []
    for wid in wids:
        g = GpuGroup.from_worker_id(wid)
        workers.append(EpochWorker(worker_id=wid, first_gpu=g.first_gpu, degree=g.degree,
                                   lifecycle=Lifecycle.ACTIVE))
    return to_json(EpochRecord(epoch=epoch, workers=workers, committed_at_s=time.time()))


class Closing(SimBackend):
    """A SimBackend that says whether it was closed."""

    def __init__(self, wid: str) -> None:
        super().__init__(time_scale=1.0)
        self.wid, self.closed = wid, False

    async def close(self) -> None:
        self.closed = True
        await super().close()
