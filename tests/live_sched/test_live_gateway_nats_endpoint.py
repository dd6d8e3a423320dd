"""The gateway's NATS completions endpoint serves requests concurrently: one waiting for its
first token does not hold back the next (nats-py runs a subscription's callbacks one after
another, so a handler that awaits the first token would serialise every NATS client)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from live_sched_support import Services, wait_until
from nats.aio.client import Client
from nats.js.api import DiscardPolicy

from shared.schemas import CompletionRequest, FirstToken, TtftStages, encode
from shared.service import RemoteError, call
from shared.subjects import Subjects


async def test_a_waiting_nats_completion_does_not_block_the_next(
    live: Services, nc: Client, uniq: str
) -> None:
    # No scheduler: nothing answers a request but this test, as a worker would.
    gw = await live.gateway(result_timeout_s=600.0)
    s = Subjects(uniq)
    stuck = asyncio.create_task(call(nc, s.gateway_completions(), CompletionRequest(
        prompt_tokens=[1, 2, 3], request_id="stuck"), FirstToken, timeout_s=600))
    await wait_until(lambda: "stuck" in gw._waiting, "the first request waiting")
    second = asyncio.create_task(call(nc, s.gateway_completions(), CompletionRequest(
        prompt_tokens=[4, 5], request_id="second"), FirstToken, timeout_s=600))
    try:
        # Before: the second request's handler did not start while the first one waited.
        await wait_until(lambda: "second" in gw._waiting, "the second request waiting")
        result = FirstToken(request_id="second", token=7, worker_id="w", epoch=0,
                            predicted_prefill_s=0.0, stages=TtftStages(), finished_at_s=1.0)
        data, headers = encode(result)
        await nc.publish(s.result("second"), data, headers=headers)
        got = await asyncio.wait_for(second, 20)
        assert got.request_id == "second" and got.token == 7
        assert "stuck" in gw._waiting and not stuck.done()
    finally:
        for t in (stuck, second):
            t.cancel()
        await asyncio.gather(stuck, second, return_exceptions=True)


async def test_an_intake_stream_that_refuses_the_message_is_a_503(
    live: Services, nc: Client, uniq: str
) -> None:
    """A JetStream refusal of the intake publish (here: the stream full, discard new; in a
    deployment: out of storage) is the broker's temporary trouble, 503 naming it, not a 500."""
    await live.gateway(result_timeout_s=600.0)
    s = Subjects(uniq)
    js = nc.jetstream()
    info = await js.stream_info(s.intake_stream())
    await js.update_stream(dataclasses.replace(info.config, max_msgs=1,
                                               discard=DiscardPolicy.NEW))
    first = asyncio.create_task(call(nc, s.gateway_completions(), CompletionRequest(
        prompt_tokens=[1, 2, 3], request_id="first"), FirstToken, timeout_s=600))
    try:
        async with asyncio.timeout(20):
            while (await js.stream_info(s.intake_stream())).state.messages < 1:
                await asyncio.sleep(0.05)
        with pytest.raises(RemoteError) as err:
            await call(nc, s.gateway_completions(), CompletionRequest(
                prompt_tokens=[4, 5], request_id="second"), FirstToken, timeout_s=20)
        assert err.value.code == 503, err.value
        assert "intake" in err.value.description
    finally:
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
