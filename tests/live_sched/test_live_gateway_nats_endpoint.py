"""The gateway's NATS completions endpoint serves requests concurrently: one waiting for its
first token does not hold back the next (nats-py runs a subscription's callbacks one after
another, so a handler that awaits the first token would serialise every NATS client). The
errors it answers from those tasks count in ``$SRV.STATS`` as a handler's raised ones do."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import Any

import pytest
from live_sched_support import Services, wait_until
from nats.aio.client import Client
from nats.js.api import DiscardPolicy

from shared.schemas import CompletionRequest, FirstToken, TtftStages, encode
from shared.service import RemoteError, call
from shared.subjects import Subjects

# Requests these tests leave waiting are still in flight at the teardown: a short stop grace
# (default 10 s) so that the gateway does not wait for answers that never come.
_GRACE_S = 0.5


async def test_a_waiting_nats_completion_does_not_block_the_next(
    live: Services, nc: Client, uniq: str
) -> None:
    # No scheduler: nothing answers a request but this test, as a worker would.
    gw = await live.gateway(result_timeout_s=600.0, stop_grace_s=_GRACE_S)
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
    await live.gateway(result_timeout_s=600.0, stop_grace_s=_GRACE_S)
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


async def _completions_stats(nc: Client, gw: Any) -> dict[str, Any]:
    answer = await nc.request(f"$SRV.STATS.{gw.name}.{gw.service.id}", b"", timeout=10)
    stats = json.loads(answer.data)
    return next(e for e in stats["endpoints"] if e["name"] == "completions")  # type: ignore[no-any-return]


async def test_errors_answered_later_count_in_the_endpoint_stats(
    live: Services, nc: Client, uniq: str
) -> None:
    """An error the endpoint answers after its handler returned (the wait runs in a task of
    its own) is counted in ``num_errors`` / ``last_error`` (before: only a malformed body,
    raised in the handler itself, was; a 413, 422, 409 or 504 counted nothing). Among them a
    request id reused with another request: 409, naming the id."""
    gw = await live.gateway(result_timeout_s=600.0, max_prompt_tokens=4,
                                stop_grace_s=_GRACE_S)
    s = Subjects(uniq)
    before = await _completions_stats(nc, gw)
    waiting = asyncio.create_task(call(nc, s.gateway_completions(), CompletionRequest(
        prompt_tokens=[1, 2, 3], request_id="key-1"), FirstToken, timeout_s=600))
    try:
        await wait_until(lambda: gw.waiting_for("key-1") == 1, "the first request waiting")
        refused = [
            (CompletionRequest(prompt_tokens=[1] * 5), 413),
            (CompletionRequest(prompt="text, and no tokenizer"), 422),
            (CompletionRequest(prompt_tokens=[1, 2], request_id="key-1"), 409),
        ]
        for req, code in refused:
            with pytest.raises(RemoteError) as err:
                await call(nc, s.gateway_completions(), req, FirstToken, timeout_s=20)
            assert err.value.code == code, err.value
        assert "'key-1'" in err.value.description
        with pytest.raises(RemoteError) as err:  # raised in the handler: counted before too
            await call(nc, s.gateway_completions(), b"{}", FirstToken, timeout_s=20)
        assert err.value.code == 400
        after = await _completions_stats(nc, gw)
        assert after["num_errors"] - before["num_errors"] == 4, after
        assert after["last_error"].startswith("400:"), after
        # The last error answered from a task is what last_error then shows.
        with pytest.raises(RemoteError):
            await call(nc, s.gateway_completions(), CompletionRequest(prompt_tokens=[1] * 5),
                       FirstToken, timeout_s=20)
        after = await _completions_stats(nc, gw)
        assert after["num_errors"] - before["num_errors"] == 5, after
        assert after["last_error"].startswith("413:") and "max_prompt_tokens" in \
            after["last_error"], after
        assert gw.waiting_for("key-1") == 1 and not waiting.done()  # the first still waits
    finally:
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
