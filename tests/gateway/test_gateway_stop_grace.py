"""A stop's grace (``stop_grace_s``): a request in flight when the gateway stops may still be
answered with its own result within it, over NATS as over HTTP; one still unfinished when it
ends is answered 503 ``service stopping`` (test_gateway_nats_stop.py).

Found by a review of the gateway's stop: HTTP requests in flight got up to 10 s to finish
while a NATS completion was answered 503 at once, its first token perhaps a moment away. The
grace is one rule for both entries (services/gateway/grace.py)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import nats.errors
import pytest
from nats.aio.client import Client

from services.gateway.adapter import GatewayService
from services.gateway.grace import finish_within
from services.gateway.settings import GatewaySettings
from shared.natsserver import EmbeddedNats
from shared.schemas import FirstToken, TtftStages, decode, encode
from shared.service import ERROR_CODE_HEADER
from shared.subjects import Subjects

WAIT_S = 30.0  # hang guard, never a speed check
LONG_GRACE_S = 600.0  # never waited out: the test answers within it, or the run hangs


async def until(pred: Callable[[], bool], what: str) -> None:
    """Poll ``pred`` until true, for at most :data:`WAIT_S` (a hang guard)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not pred():
        assert loop.time() < deadline, f"timed out waiting: {what}"
        await asyncio.sleep(0.02)


def first_token(rid: str) -> FirstToken:
    return FirstToken(request_id=rid, token=7, worker_id="w-cp2-g0", stages=TtftStages(
        intake_wait_s=0, schedule_s=0, queue_wait_s=0, prefill_s=0, kv_transfer_s=0,
        first_decode_s=0, total_s=0), finished_at_s=time.time())


def completion(rid: str) -> bytes:
    return json.dumps({"prompt_tokens": list(range(9)), "request_id": rid}).encode()


async def test_a_nats_completion_answered_within_the_stop_grace_gets_its_result(
        nats_server: EmbeddedNats, nc: Client, uniq: str) -> None:
    # No scheduler: the test answers the request itself, once the stop's grace has begun.
    subjects = Subjects(uniq)
    gw = GatewayService(GatewaySettings(nats_url=nats_server.url, subject_prefix=uniq,
                                        result_timeout_s=600, http_port=None,
                                        stop_grace_s=LONG_GRACE_S))
    run = asyncio.create_task(gw.run(handle_signals=False))
    try:
        await asyncio.wait_for(gw.started.wait(), WAIT_S)
        answer = asyncio.create_task(nc.request(subjects.gateway_completions(),
                                                completion("grace-1"), timeout=WAIT_S))
        await until(lambda: gw.waiting_for("grace-1") == 1, "the request published")
        gw.request_stop()
        await asyncio.wait_for(gw.finishing.wait(), WAIT_S)
        # The grace takes no new completion (the endpoint was drained before it began)...
        with pytest.raises(nats.errors.NoRespondersError):
            await nc.request(subjects.gateway_completions(), completion("grace-2"),
                             timeout=WAIT_S)
        assert not answer.done()  # before the fix: answered 503 already
        # ...and the one in flight gets its first token, which comes now.
        data, headers = encode(first_token("grace-1"))
        await nc.publish(subjects.result("grace-1"), data, headers=headers)
        msg = await answer
        assert ERROR_CODE_HEADER not in (msg.headers or {}), msg.headers
        got = decode(FirstToken, msg.data, msg.headers)
        assert (got.request_id, got.token, got.worker_id) == ("grace-1", 7, "w-cp2-g0")
        # Nothing left in flight: the stop ends without waiting out the (long) grace.
        await asyncio.wait_for(run, WAIT_S)
    finally:
        gw.request_stop()
        await asyncio.wait_for(run, WAIT_S)


async def test_finish_within_cancels_only_what_outlasts_the_grace() -> None:
    """The rule both entries share: a task that ends within the grace is left to end (not
    cancelled); the grace over (0 here: over at once), the rest are cancelled and returned."""
    release = asyncio.Event()

    async def request() -> str:
        await release.wait()
        return "answered"

    quick = asyncio.create_task(request())
    stuck = asyncio.create_task(asyncio.Event().wait())
    waiting = asyncio.create_task(finish_within([quick], LONG_GRACE_S))
    await asyncio.sleep(0)  # the grace has begun
    release.set()
    assert await asyncio.wait_for(waiting, WAIT_S) == set()
    assert quick.result() == "answered"

    assert await finish_within([stuck], 0.0) == {stuck}
    assert stuck.cancelled()
    assert await finish_within([quick, stuck], 0.0) == set()  # done already: nothing to do
