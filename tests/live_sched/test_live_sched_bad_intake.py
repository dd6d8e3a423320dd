"""Intake messages that decode but carry extreme values are handled on their first delivery
(not crashed on and left for ``ack_wait``'s redelivery)."""

from __future__ import annotations

import json
import time

from live_sched_support import Services, wait_until
from nats.aio.client import Client

from shared.subjects import Subjects


async def test_an_arrival_far_in_the_future_is_placed_on_its_first_delivery(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    """``arrival_s`` 1e300 is a valid WallTime; before, recording the intake-wait span took
    int(1e300 * 1e9) and the handler died (OverflowError), the message waiting for its
    redelivery after ack_wait_s."""
    w = await fake_worker("w-a", 2, 0)
    sched = await live.scheduler(block_size=16, ack_wait_s=600.0)
    await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
    s = Subjects(uniq)
    body = {"request_id": "far", "input_len": 40, "block_size": 16, "arrival_s": 1e300}
    await nc.jetstream().publish(s.intake_requests(), json.dumps(body).encode(), headers={
        "Content-Type": "application/json", "Nats-Msg-Id": "far"})
    await wait_until(lambda: bool(w.assignments), "the request dispatched")
    assert w.assignments[0].request.request_id == "far"
    # The worker has it before the scheduler has its ack: the count follows the ack.
    await wait_until(lambda: sched.stats.dispatched == 1, "the dispatch recorded (ack received)")
    assert sched.stats.malformed == 0
    # And the scheduler keeps serving an ordinary request after it.
    ok = {"request_id": "next", "input_len": 40, "block_size": 16, "arrival_s": time.time()}
    await nc.jetstream().publish(s.intake_requests(), json.dumps(ok).encode(), headers={
        "Content-Type": "application/json", "Nats-Msg-Id": "next"})
    await wait_until(lambda: len(w.assignments) == 2, "the next request dispatched")
