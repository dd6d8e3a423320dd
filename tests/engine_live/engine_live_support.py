"""Helpers of the live torch-engine tests: epoch records as a controller writes them, fresh
assignments, and one assignment through a worker's micro endpoint up to its FirstToken."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from nats.aio.client import Client
from nats.errors import NoRespondersError

from services.rankd.host import RankdHost
from services.rankd.settings import RankdSettings
from shared.schemas import (
    Assignment,
    AssignmentAck,
    EpochRecord,
    EpochWorker,
    FirstToken,
    IntakeRequest,
    decode,
    to_json,
)
from shared.service import call
from shared.subjects import Subjects
from shared.worker import GpuGroup, Lifecycle

B = 16  # the block size of the requests built here



def host_settings(url: str, prefix: str, *workers: str,
                  drain_timeout_s: float = 10) -> RankdSettings:
    """The settings of a rank host over GPUs 0-1 (heartbeat 0.2 s) that starts ``workers``."""
    return RankdSettings(nats_url=url, subject_prefix=prefix, heartbeat_s=0.2,
                         drain_timeout_s=drain_timeout_s, host_gpus="0-1",
                         initial_workers=",".join(workers))


async def until_workers(host: RankdHost, wanted: set[str], timeout_s: float) -> None:
    """Until ``host`` runs exactly the workers ``wanted`` (each in ``host.services``)."""
    async with asyncio.timeout(timeout_s):
        while host.worker_ids != wanted or len(host.services) != len(wanted):
            host.changed.clear()
            await host.changed.wait()


def record(epoch: int, *wids: str) -> bytes:
    """The epoch record of composition ``wids``, every worker ACTIVE, as JSON."""
    workers = [
        EpochWorker(worker_id=w, first_gpu=GpuGroup.from_worker_id(w).first_gpu,
                    degree=GpuGroup.from_worker_id(w).degree, lifecycle=Lifecycle.ACTIVE)
        for w in wids
    ]
    return to_json(EpochRecord(epoch=epoch, workers=workers, committed_at_s=time.time()))


def assignment(rid: str, wid: str, tokens: list[int] | None = None, *, epoch: int = 0,
               input_len: int | None = None, hashes: Sequence[int] = ()) -> Assignment:
    """A new request (blocks of :data:`B`) assigned now to ``wid`` (its degree from the id)
    in ``epoch``, the scheduler guessing no cached prefix: of ``tokens``, or without tokens of
    ``input_len`` (what the sim and trace replays send). ``hashes``: its block hashes (for a
    prompt, the chain the gateway computes: rankd's cache then decides the prefix)."""
    now = time.time()
    n = len(tokens) if tokens is not None else int(input_len or 0)
    return Assignment(
        request=IntakeRequest(
            request_id=rid,
            input_len=n,
            tokens=tokens,
            block_hashes=list(hashes),
            block_size=B,
            arrival_s=now,
        ),
        worker_id=wid,
        epoch=epoch,
        degree=GpuGroup.from_worker_id(wid).degree,
        prefix_tokens=0,
        recompute_tokens=n,
        predicted_s=0.01,
        assigned_at_s=now,
    )


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
