"""The scheduler's ``refusals_avoided`` counts placements actually steered away from a worker
to avoid -- one ACTIVE in the view, which the placement would otherwise have had among its
candidates. A hand-back from a worker the view does not hold (gone, or never seen by this
replica) avoids nothing: it went elsewhere because there was nowhere else, and was counted
all the same. Real nats-server, the scheduler in-process, a fake worker."""

from __future__ import annotations

import time

from live_sched_support import FakeWorker, results_for, wait_until

from services.rankd.core import handback_msg_id
from shared.schemas import IntakeRequest, encode
from shared.subjects import Subjects

GONE, W2 = "w-cp2-g0", "w-cp2-g2"


async def test_a_hand_back_from_a_worker_out_of_the_view_is_no_refusal_avoided(
        live, nc, uniq) -> None:  # type: ignore[no-untyped-def]
    w = await FakeWorker(nc, Subjects(uniq), W2, 2, 2).start()
    try:
        sched = await live.scheduler(block_size=16, retry_delay_s=0.05, max_deliver=5)
        await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
        got = await results_for(nc, uniq, "x")
        req = IntakeRequest(request_id="x", input_len=40, block_size=16, arrival_s=time.time())
        data, headers = encode(req)
        headers["Nats-Msg-Id"] = handback_msg_id("x", "x", GONE, 1)
        await nc.jetstream().publish(Subjects(uniq).intake_requests(), data, headers=headers)
        await wait_until(lambda: got, "x's answer")
        assert [(t.worker_id, t.error) for t in got] == [(W2, None)], got
        st = sched.stats
        assert (st.handbacks_steered, st.refusals_avoided, st.retried) == (1, 0, 0), st
    finally:
        await w.stop()
