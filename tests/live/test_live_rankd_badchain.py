"""rankd on a real server: an assignment whose block chain contradicts the worker's cache."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client
from service_support import service_running

from services.rankd.backend import SimBackend
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import Assignment, AssignmentAck, FirstToken, IntakeRequest, decode
from shared.service import call
from shared.subjects import Subjects

WID = "w-cp2-g2"
WAIT_S = 20.0  # bound for correctness waits only


def assignment(rid: str, hashes: list[int], length: int) -> Assignment:
    now = time.time()
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=length, block_hashes=hashes,
                              arrival_s=now - 0.01),
        worker_id=WID, epoch=0, degree=2, prefix_tokens=0, recompute_tokens=length,
        predicted_s=0.0, assigned_at_s=now,
    )


@pytest.fixture
async def rankd(nats_server: EmbeddedNats, uniq: str) -> AsyncIterator[RankdService]:
    settings = RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, worker_id=WID,
                             heartbeat_s=0.2)
    svc = RankdService(settings, SimBackend(time_scale=1.0))
    async with service_running(svc, timeout_s=WAIT_S):
        yield svc


async def serve(nc: Client, s: Subjects, a: Assignment) -> FirstToken:
    sub = await nc.subscribe(s.result(a.request.request_id))
    await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S)
    msg = await sub.next_msg(timeout=WAIT_S)
    await sub.unsubscribe()
    return decode(FirstToken, msg.data, msg.headers)


@pytest.mark.parametrize("bad", [[9], [7, 7]], ids=["reparented", "repeated"])
async def test_a_chain_contradicting_the_cache_is_a_miss_and_the_worker_serves_on(
    rankd: RankdService, nc: Client, uniq: str, bad: list[int]
) -> None:
    s = Subjects(uniq)
    first = await serve(nc, s, assignment("a", [7, 9], 1024))  # caches 7 -> 9
    assert first.error is None
    # 9 is cached under 7, this request puts it at the root (or repeats 7): a bad chain
    odd = await serve(nc, s, assignment("b", bad, 512 * len(bad)))
    assert odd.error is None and odd.prefix_tokens == 0  # served as a miss
    after = await serve(nc, s, assignment("c", [7, 9], 1024))
    assert after.error is None and after.prefix_tokens == 1023  # the cache is intact
    assert rankd.core.running is None and len(rankd.core) == 0
