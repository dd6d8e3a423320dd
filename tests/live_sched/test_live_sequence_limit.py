"""A prompt longer than every worker's ``max_seq_len`` but within the gateway's own limit is
refused at once (422, naming both numbers), not held and retried into a 503.

Before, the scheduler treated it like a transient "no eligible worker": held for ``hold_s``,
NAK'ed for ``retry_delay_s``, ``max_deliver`` times (12.5 s with the defaults), then a 503
"try again later" that no retry could ever turn into an answer. Here hold and retry delay are
60 s and the gateway's result timeout 10 s, so that behaviour ends in a 504, not a 422.
"""

from __future__ import annotations

import asyncio

import pytest
from live_sched_support import Services, fake_token, http, wait_until
from nats.aio.client import Client

from services.gateway.adapter import (
    Unavailable,
    Unprocessable,
    WorkerFailed,
    result_error,
)
from services.rankd.backend import SimBackend
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.schemas import CompletionRequest, FirstToken
from shared.service import RemoteError, call
from shared.subjects import Subjects

B = 16
WORKER_MAX = 100  # every worker's max_seq_len (the scheduler's setting: its view gives it all)
# Either old path (hold, NAK) outlasts the gateway's wait: only a prompt refusal answers.
SLOW = {"hold_s": 60.0, "retry_delay_s": 60.0}
GATEWAY = {"block_size": B, "result_timeout_s": 10.0}  # its own max_seq_len is far above 100
NEEDLE = "prompt of 200 tokens is longer than every worker's max_seq_len (100 at most)"


async def test_longer_than_every_worker_is_a_prompt_422(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    a = await fake_worker("w-cp2-g0", 2, 0)
    b = await fake_worker("w-cp4-g4", 4, 4)
    sched = await live.scheduler(block_size=B, max_seq_len=WORKER_MAX, **SLOW)
    gw = await live.gateway(**GATEWAY)
    assert gw.gsettings.max_seq_len > 200 + 16  # the gateway's own check lets it through
    await wait_until(lambda: len(sched.core.view) == 2, "both workers in the view")

    reply = await http(gw.http_port, "POST", "/v1/completions",
                       {"prompt": list(range(200)), "max_tokens": 16})
    assert reply.status == 422, reply.body
    err = reply.json()["error"]
    assert err["code"] == 422 and NEEDLE in err["message"], err
    assert err["message"].startswith("not servable"), err
    # The NATS endpoint answers the same refusal as a micro error.
    with pytest.raises(RemoteError) as ei:
        await call(nc, Subjects(uniq).gateway_completions(),
                   CompletionRequest(prompt_tokens=list(range(200))), FirstToken, timeout_s=15)
    assert ei.value.code == 422 and NEEDLE in ei.value.description, ei.value
    # Refused on the first delivery: never held, NAK'ed or sent to a worker.
    assert (sched.stats.refused, sched.stats.retried, sched.stats.failed) == (2, 0, 0)
    assert sched.stats.placed == 0 and a.assignments == b.assignments == []
    # A prompt within the workers' limit is still served.
    ok = await http(gw.http_port, "POST", "/v1/completions",
                    {"prompt": list(range(WORKER_MAX)), "request_id": "fits"})
    assert ok.status == 200, ok.body
    assert ok.json()["choices"][0]["token_ids"] == [fake_token("fits")]


async def test_no_worker_yet_waits_and_is_refused_once_workers_show_the_limit(
    live: Services, fake_worker  # type: ignore[no-untyped-def]
) -> None:
    """With no worker in the view the scheduler cannot know the limit of the workers to come:
    the request is held as before; the first view with workers refuses it at once (before, the
    hold went on to hold_s and then into retries)."""
    sched = await live.scheduler(block_size=B, max_seq_len=WORKER_MAX, **SLOW)
    gw = await live.gateway(**GATEWAY)
    pending = asyncio.create_task(http(gw.http_port, "POST", "/v1/completions",
                                       {"prompt": list(range(200))}))
    await wait_until(lambda: sched._view_changed is not None, "the request held")
    assert sched.stats.placed == sched.stats.retried == 0 and not pending.done()
    w = await fake_worker("w-cp2-g0", 2, 0)
    reply = await pending
    assert reply.status == 422 and NEEDLE in reply.json()["error"]["message"], reply.body
    assert (sched.stats.refused, sched.stats.retried) == (1, 0)
    assert w.assignments == []


async def test_a_retry_after_a_refusal_is_a_new_attempt(
    live: Services, fake_worker  # type: ignore[no-untyped-def]
) -> None:
    """A refusal is judged against the workers of then: once they serve longer prompts (here a
    scheduler restarted with a larger limit), a client retry under the same request id is
    scheduled and answered, not given the kept 422."""
    w = await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=B, max_seq_len=WORKER_MAX, **SLOW)
    gw = await live.gateway(**GATEWAY)
    await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
    body = {"prompt": list(range(200)), "request_id": "grow-1"}
    first = await http(gw.http_port, "POST", "/v1/completions", body)
    assert first.status == 422, first.body
    await live.stop(sched)
    sched = await live.scheduler(block_size=B, max_seq_len=1000, **SLOW)
    await wait_until(lambda: len(sched.core.view) == 1, "the worker in the new view")
    again = await http(gw.http_port, "POST", "/v1/completions", body)
    assert again.status == 200, again.body
    assert again.json()["choices"][0]["token_ids"] == [fake_token("grow-1")]
    assert [a.request.request_id for a in w.assignments] == ["grow-1"]


async def test_the_workers_published_limits_route_and_refuse(
    live: Services, fake_worker  # type: ignore[no-untyped-def]
) -> None:
    """The scheduler's own limit is unlimited here: only the workers' states say how long a
    prompt each serves (WorkerState.max_seq_len). A prompt that fits one worker goes to it,
    never to the shorter one; one longer than both is refused at once (422 naming the largest
    published limit), not placed on a worker that would fail it."""
    short = await fake_worker("w-cp2-g0", 2, 0, max_seq_len=WORKER_MAX)
    long = await fake_worker("w-cp4-g4", 4, 4, max_seq_len=3 * WORKER_MAX)
    sched = await live.scheduler(block_size=B, **SLOW)
    gw = await live.gateway(**GATEWAY)
    await wait_until(lambda: len(sched.core.view) == 2, "both workers in the view")
    assert {w.worker_id: w.max_seq_len for w in sched.core.view.workers} == {
        "w-cp2-g0": WORKER_MAX, "w-cp4-g4": 3 * WORKER_MAX}

    for i in range(3):
        ok = await http(gw.http_port, "POST", "/v1/completions",
                        {"prompt": list(range(2 * WORKER_MAX)), "request_id": f"mid-{i}"})
        assert ok.status == 200, ok.body
        assert ok.json()["vtm"]["worker_id"] == "w-cp4-g4"
    assert short.assignments == [] and len(long.assignments) == 3

    reply = await http(gw.http_port, "POST", "/v1/completions",
                       {"prompt": list(range(4 * WORKER_MAX)), "max_tokens": 16})
    assert reply.status == 422, reply.body
    assert ("prompt of 400 tokens is longer than every worker's max_seq_len (300 at most)"
            in reply.json()["error"]["message"]), reply.body
    assert (sched.stats.refused, sched.stats.retried, sched.stats.placed) == (1, 0, 3)
    assert len(long.assignments) == 3
    # Operators see each worker's limit where they see its state.
    workers = (await http(gw.http_port, "GET", "/v1/workers")).json()["workers"]
    assert {w["worker_id"]: w["max_seq_len"] for w in workers} == {
        "w-cp2-g0": WORKER_MAX, "w-cp4-g4": 3 * WORKER_MAX}


async def test_a_rank_daemons_own_limit_refuses_at_once(live: Services) -> None:
    """End to end with a real rank daemon whose backend has a context limit (the sim backend's
    ``max_seq_len``, as the torch backend's model positions): rankd publishes it, and a longer
    prompt is answered 422 by the scheduler at once instead of being placed and failed by the
    worker (a 502), while a prompt at the limit is served."""
    settings = RankdSettings(nats_url=live.url, subject_prefix=live.prefix,
                             worker_id="w-cp2-g0", heartbeat_s=0.2)
    backend = SimBackend(prefill_time=lambda r, p, c, kind="cp": 0.01, max_seq_len=WORKER_MAX)
    rankd = await live._run(RankdService(settings, backend))
    sched = await live.scheduler(block_size=B, **SLOW)
    gw = await live.gateway(**GATEWAY)
    await wait_until(lambda: len(sched.core.view) == 1, "the rank daemon in the view")
    assert sched.core.view.workers[0].max_seq_len == WORKER_MAX

    reply = await http(gw.http_port, "POST", "/v1/completions",
                       {"prompt": list(range(2 * WORKER_MAX))})
    assert reply.status == 422, reply.body
    assert NEEDLE in reply.json()["error"]["message"], reply.body
    ok = await http(gw.http_port, "POST", "/v1/completions", {"prompt": list(range(WORKER_MAX))})
    assert ok.status == 200, ok.body
    assert (sched.stats.refused, sched.stats.placed) == (1, 1)
    await wait_until(lambda: rankd.core.served == 1, "the worker's count of served requests")


def test_result_errors_map_to_statuses() -> None:
    """The gateway's reading of a failed FirstToken (pure)."""
    refused = result_error("r", "not servable: prompt of 9 tokens is longer than ...")
    assert isinstance(refused, Unprocessable) and refused.status == 422
    assert refused.message.startswith("not servable: prompt of 9 tokens")
    gave_up = result_error("r", "not scheduled: no eligible worker for request 'r' (...)")
    assert isinstance(gave_up, Unavailable) and gave_up.status == 503
    failed = result_error("r", "out of memory")
    assert isinstance(failed, WorkerFailed) and failed.status == 502
    assert failed.message == "request r failed: out of memory"


async def test_a_gateway_with_another_block_size_gets_a_prompt_502_naming_both(
    live: Services, fake_worker  # type: ignore[no-untyped-def]
) -> None:
    """The request's block hashes were cut at the gateway's block size: matched against
    caches of another, its P would be wrong. The scheduler fails it at once, naming both
    sizes (a deployment fault, not the client's: 502), and places nothing."""
    w = await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=B, **SLOW)
    gw = await live.gateway(**{**GATEWAY, "block_size": 2 * B})
    await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
    reply = await http(gw.http_port, "POST", "/v1/completions",
                       {"prompt": list(range(64)), "request_id": "bs-1"})
    assert reply.status == 502, reply.body
    msg = reply.json()["error"]["message"]
    assert f"{2 * B}-token blocks" in msg and f"of {B}" in msg and "VTM_BLOCK_SIZE" in msg, msg
    assert (sched.stats.refused, sched.stats.placed, sched.stats.retried) == (1, 0, 0)
    assert w.assignments == []
