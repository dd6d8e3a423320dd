"""rankd's pull hold on a real server (sim backend) when the held request leaves the queue: a
request held at the head of the FIFO for its route-time pull (``WorkerCore.pull_hold``) is
handed back by a drain; the worker, ACTIVE again, is assigned a request that counted on no
pull. That one must start at once -- the hold was the handed-back request's, not the FIFO's.

Before, the executor went on waiting out the handed-back request's hold (its bound, up to
``time_scale·pull_hold_slack·PULL_HOLD_MAX_COPY_S + pull_hold_grace_s``), woken only by a cache
command's end: the next request queued behind a hold nobody needed. The bound here is made
long (slack 1000: 2,000 s) so that the test's correctness wait, not a timing, tells the two
apart."""

from __future__ import annotations

import time

from nats.aio.client import Client
from rankd_support import plain_assignment, until
from service_support import service_running

from services.rankd.backend import SimBackend
from services.rankd.core import INTAKE_MSG_HEADER
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
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
from shared.worker import Lifecycle

WID = "w-cp2-g2"
WAIT_S = 20.0  # hang guard only; nothing asserts on speed


def held(rid: str) -> Assignment:
    """Two full blocks priced with P = 512 counting on a copy (1 s, capped at 2 s) that never
    comes: held at the head of the FIFO for slack × 1 s."""
    now = time.time()
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=1024, block_hashes=[1, 2],
                              arrival_s=now - 0.01),
        worker_id=WID, epoch=0, degree=2, prefix_tokens=512, recompute_tokens=512,
        predicted_s=0.01, assigned_at_s=now, pull_copy_s=1.0,
    )


async def put_record(nc: Client, s: Subjects, epoch: int, lifecycle: Lifecycle) -> None:
    epochs = await nc.jetstream().key_value(s.epoch_bucket())
    await epochs.put(s.epoch_key(), to_json(EpochRecord(
        epoch=epoch, committed_at_s=time.time(),
        workers=[EpochWorker(worker_id=WID, first_gpu=2, degree=2, lifecycle=lifecycle)])))


async def test_a_request_after_a_held_one_was_handed_back_does_not_wait_out_its_hold(
    nats_server: EmbeddedNats, nc: Client, uniq: str
) -> None:
    s = Subjects(uniq)
    svc = RankdService(RankdSettings(nats_url=nats_server.url, subject_prefix=uniq,
                                     worker_id=WID, heartbeat_s=0.2, pull_hold_slack=1000.0,
                                     pull_hold_grace_s=0.0, redirect_timeout_s=1.0),
                       SimBackend(prefill_time=lambda r, p, d, **_: 0.01, time_scale=1.0))
    async with service_running(svc, timeout_s=WAIT_S):
        sub = await nc.subscribe(s.result("free"))
        await call(nc, s.worker_assign(WID), held("held"), AssignmentAck, timeout_s=WAIT_S,
                   headers={INTAKE_MSG_HEADER: "held"})
        await until(lambda: svc._holding is not None, "the request held for its pull")
        await put_record(nc, s, 1, Lifecycle.DRAINING)  # hands it back
        await until(lambda: not svc.core.queued and svc.core.epoch == 1, "held one handed back")
        await put_record(nc, s, 2, Lifecycle.ACTIVE)
        await until(lambda: svc.core.lifecycle is Lifecycle.ACTIVE, "ACTIVE again")
        free = plain_assignment("free", WID).model_copy(update={"epoch": 2})
        await call(nc, s.worker_assign(WID), free, AssignmentAck, timeout_s=WAIT_S,
                   headers={INTAKE_MSG_HEADER: "free"})
        ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
    assert ft.error is None and ft.request_id == "free"
