"""``idempotency_bucket_remade`` counts the makings of the idempotency bucket that created it,
not those that found it there already: a claim may take a brief failure ("no responders",
"stream not found" from a JetStream catching up) for a missing bucket, and the making that
follows then finds the bucket in place.

Found by a review of the counters (docs/evaluation.md listed it as left): the counter was
raised as a making began, whatever the making then found."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from service_support import service_running

from services.gateway.adapter import GatewayError, GatewayService
from services.gateway.idempotency_kv import STREAM_NOT_FOUND, idempotency_kv
from services.gateway.settings import GatewaySettings
from shared.natsserver import EmbeddedNats
from shared.schemas import CompletionRequest
from shared.subjects import Subjects

WAIT_S = 30.0  # hang guard, never a speed check


@pytest.fixture
async def gateway(nats_server: EmbeddedNats, uniq: str) -> AsyncIterator[GatewayService]:
    """A gateway without a scheduler: a request it lets through times out (504)."""
    gw = GatewayService(GatewaySettings(nats_url=nats_server.url, subject_prefix=uniq,
                                        result_timeout_s=0.3))
    async with service_running(gw):
        yield gw


async def until(pred: Callable[[], bool], what: str) -> None:
    """Poll ``pred`` until true, for at most :data:`WAIT_S` (a hang guard)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not pred():
        assert loop.time() < deadline, f"timed out waiting: {what}"
        await asyncio.sleep(0.02)


async def run_to_timeout(gw: GatewayService, rid: str) -> None:
    """A request with id ``rid`` (so it is claimed in the bucket), let through: no first
    token comes (504)."""
    with pytest.raises(GatewayError) as err:
        await gw.complete(CompletionRequest(prompt_tokens=list(range(9)), request_id=rid))
    assert err.value.status == 504, err.value


async def test_a_making_that_finds_the_bucket_there_is_not_counted(
        gateway: GatewayService, nc: Client, uniq: str) -> None:
    s = Subjects(uniq)
    js = nc.jetstream()
    bucket = s.idempotency_bucket()
    # The claim's write is held by the test (the real bucket gone meanwhile), which makes
    # the bucket again -- as another replica would -- and then answers the write "stream
    # not found": the gateway's making that follows finds the bucket there.
    await js.delete_key_value(bucket)
    held: asyncio.Queue[Msg] = asyncio.Queue()

    async def hold(msg: Msg) -> None:
        await held.put(msg)

    sub = await nc.subscribe(f"$KV.{bucket}.>", cb=hold)
    await nc.flush()
    request = asyncio.create_task(run_to_timeout(gateway, "found-1"))
    write = await asyncio.wait_for(held.get(), WAIT_S)
    await idempotency_kv(js, s, ttl_s=gateway._claim_ttl_s)
    await write.respond(json.dumps({"error": {"code": 404, "err_code": STREAM_NOT_FOUND,
                                              "description": "played"}}).encode())
    await sub.unsubscribe()
    await request
    assert gateway.counters["idempotency_store_failed"] == 1
    assert gateway.counters["idempotency_bucket_remade"] == 0
    # The claim the bucket did not decide is written there once it answers: done before the
    # next part, whose deletion it would otherwise meet (and make the bucket itself).
    await until(lambda: gateway.counters["idempotency_shared_late"] == 1, "claim shared")
    assert gateway.counters["idempotency_bucket_remade"] == 0

    # Really missing (deleted): the making creates it, and that is counted.
    await js.delete_key_value(bucket)
    await run_to_timeout(gateway, "missing-1")
    assert gateway.counters["idempotency_store_failed"] == 2
    assert gateway.counters["idempotency_bucket_remade"] == 1
    await js.key_value(bucket)  # made again
