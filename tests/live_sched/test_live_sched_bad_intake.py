"""Intake messages that decode but carry extreme values are handled on their first delivery
(not crashed on and left for ``ack_wait``'s redelivery)."""

from __future__ import annotations

import json
import time

import pytest
from live_sched_support import WAIT_S, Services, wait_until
from malformed_support import BAD_BLOCK, hpub, send_raw
from nats.aio.client import Client
from structlog.testing import capture_logs

from shared.natsserver import EmbeddedNats
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


@pytest.mark.parametrize("body", [
    pytest.param({"request_id": "bad", "input_len": 40, "block_size": 16}, id="request-body"),
    pytest.param(b"\x00not json", id="garbage-body"),
])
async def test_an_intake_message_with_a_malformed_header_block_is_terminated(
    live: Services, fake_worker, nc: Client, nats_server: EmbeddedNats,  # type: ignore[no-untyped-def]
    uniq: str, body: dict[str, object] | bytes,
) -> None:
    """A stored intake message whose header block could not be read (delivered marked
    ``Vtm-Malformed-Headers``) is terminated on its first delivery -- not placed, whatever its
    body, since what its headers said (``Nats-Msg-Id``, ``Content-Type``, the trace context)
    is lost -- with a warning naming its subject and stream sequence, counted in
    ``malformed``; the scheduler serves on. Before: a body that decoded as a request was
    placed and dispatched."""
    w = await fake_worker("w-a", 2, 0)
    s = Subjects(uniq)
    terminated = await nc.subscribe(
        f"$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{s.intake_stream()}.{s.intake_consumer()}")
    with capture_logs() as logs:
        sched = await live.scheduler(block_size=16, ack_wait_s=600.0)
        await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
        data = body if isinstance(body, bytes) else json.dumps(
            {**body, "arrival_s": time.time()}).encode()
        await send_raw(nats_server, hpub(s.intake_requests().encode(), BAD_BLOCK, data))
        advisory = json.loads((await terminated.next_msg(timeout=WAIT_S)).data)
        # And the scheduler keeps serving an ordinary request after it.
        ok = {"request_id": "next", "input_len": 40, "block_size": 16, "arrival_s": time.time()}
        await nc.jetstream().publish(s.intake_requests(), json.dumps(ok).encode(), headers={
            "Content-Type": "application/json", "Nats-Msg-Id": "next"})
        await wait_until(lambda: sched.stats.dispatched == 1, "the next request dispatched")
    assert [a.request.request_id for a in w.assignments] == ["next"]
    assert sched.stats.malformed == 1
    warned = [e for e in logs if e["log_level"] == "warning" and "header" in e["event"]]
    assert len(warned) == 1, logs
    assert warned[0]["subject"] == s.intake_requests()
    assert warned[0]["stream_seq"] == advisory["stream_seq"]
    info = await nc.jetstream().consumer_info(s.intake_stream(), s.intake_consumer())
    assert (info.num_ack_pending, info.num_pending) == (0, 0)
