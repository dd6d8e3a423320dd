"""Helpers of the live torch-engine tests: epoch records as a controller writes them, and one
assignment through a worker's micro endpoint up to its FirstToken."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client
from nats.errors import NoRespondersError

from shared.schemas import (
    Assignment,
    AssignmentAck,
    EpochRecord,
    EpochWorker,
    FirstToken,
    decode,
    to_json,
)
from shared.service import call
from shared.subjects import Subjects
from shared.worker import GpuGroup, Lifecycle


def record(epoch: int, *wids: str) -> bytes:
    """The epoch record of composition ``wids``, every worker ACTIVE, as JSON."""
    workers = [
        EpochWorker(worker_id=w, first_gpu=GpuGroup.from_worker_id(w).first_gpu,
                    degree=GpuGroup.from_worker_id(w).degree, lifecycle=Lifecycle.ACTIVE)
        for w in wids
    ]
    return to_json(EpochRecord(epoch=epoch, workers=workers, committed_at_s=time.time()))


async def first_token(nc: Client, s: Subjects, a: Assignment, timeout_s: float) -> FirstToken:
    """Assign ``a`` to its worker and return the FirstToken it publishes. A worker shows up
    in its host just before its micro endpoints subscribe, so an early assignment finds no
    responders: that answer is retried (bounded by ``timeout_s``)."""
    rid = a.request.request_id
    sub = await nc.subscribe(s.result(rid))
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                try:
                    await call(nc, s.worker_assign(a.worker_id), a, AssignmentAck,
                               timeout_s=timeout_s)
                    break
                except NoRespondersError:
                    await asyncio.sleep(0.05)
        return decode(FirstToken, (await sub.next_msg(timeout=timeout_s)).data)
    finally:
        await sub.unsubscribe()
