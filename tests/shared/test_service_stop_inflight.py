"""A graceful stop finishes the requests a service has received, and takes no new ones.

nats.micro's own ``Service.stop`` unsubscribes its endpoints, which cancels the handler
running and drops the requests queued behind it: their callers waited out their whole
timeout. Now the endpoints are drained first (``shared.service.stop_micro_service``): no new
request reaches them, and those received are handled to their end, within the service's
``drain_timeout_s``; what is still being handled past that bound, and what is queued behind
it, is answered 503 "service stopping". Against a real nats-server; bounds (``WAIT_S``) are
liveness bounds, never speed checks.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import nats
import pytest
from nats.aio.client import Client
from nats.micro.request import ERROR_CODE_HEADER, ERROR_HEADER, Request

import shared.natsclient as natsclient
from shared.natsserver import EmbeddedNats
from shared.service import STOPPING_CODE, STOPPING_DESCRIPTION, Endpoint, MicroService
from shared.settings import ServiceSettings

WAIT_S = 15.0
SHORT_BOUND_S = 0.5  # drain_timeout_s of a stop that must give up on a handler that never ends


class Slow(MicroService):
    """``work``: a body ``slow`` is held until :attr:`release` is set; any other is answered
    at once. ``started`` is set once a slow one is being handled."""

    def __init__(self, settings: ServiceSettings) -> None:
        super().__init__(settings, name="vtm-slow", version="0.1.0",
                         group=f"{settings.subject_prefix}.svc")
        self.started_slow = asyncio.Event()
        self.release = asyncio.Event()
        self.cancelled = 0

    def endpoints(self) -> Sequence[Endpoint]:
        async def work(request: Request) -> bytes:
            if request.data == b"slow":
                self.started_slow.set()
                try:
                    await self.release.wait()
                except asyncio.CancelledError:
                    self.cancelled += 1
                    raise
                return b"done"
            return b"fast:" + request.data

        return [Endpoint("work", work)]


async def running(svc: Slow) -> asyncio.Task[None]:
    task = asyncio.create_task(svc.run(handle_signals=False))
    await asyncio.wait_for(svc.started.wait(), WAIT_S)
    return task


async def send(nc: Client, subject: str, body: bytes) -> nats.aio.subscription.Subscription:
    """Publish a request on an inbox of its own, flushed: the server has routed it."""
    inbox = await nc.subscribe(nc.new_inbox())
    await nc.publish(subject, body, reply=inbox.subject)
    await nc.flush()
    return inbox


@pytest.fixture
async def client(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    nc = await natsclient.connect(nats_server.url, connect_timeout=5)
    try:
        yield nc
    finally:
        await nc.close()


async def test_a_graceful_stop_finishes_the_request_in_flight_and_takes_no_new_one(
        nats_server: EmbeddedNats, client: Client, uniq: str) -> None:
    svc = Slow(ServiceSettings(nats_url=nats_server.url, subject_prefix=uniq,
                               drain_timeout_s=WAIT_S))
    task = await running(svc)
    subject = f"{uniq}.svc.work"
    try:
        inflight = await send(client, subject, b"slow")
        await asyncio.wait_for(svc.started_slow.wait(), WAIT_S)
        svc.request_stop()
        # New requests find no responder once the endpoint's interest is gone (one that
        # comes before that is queued behind the slow one, and handled after it).
        async with asyncio.timeout(WAIT_S):
            while True:
                try:
                    await client.request(subject, b"probe", timeout=0.2)
                except nats.errors.NoRespondersError:
                    break
                except nats.errors.TimeoutError:
                    continue
        assert not task.done()  # the stop waits for the handler
        svc.release.set()
        answer = await inflight.next_msg(timeout=WAIT_S)  # was cancelled: no answer came
        assert (answer.data, answer.headers) == (b"done", None)
        await asyncio.wait_for(task, WAIT_S)
        assert svc.cancelled == 0
    finally:
        svc.request_stop()
        svc.release.set()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), WAIT_S)


async def test_requests_a_stop_gives_up_on_are_answered_503(
        nats_server: EmbeddedNats, client: Client, uniq: str) -> None:
    svc = Slow(ServiceSettings(nats_url=nats_server.url, subject_prefix=uniq,
                               drain_timeout_s=SHORT_BOUND_S))
    task = await running(svc)
    subject = f"{uniq}.svc.work"
    try:
        inflight = await send(client, subject, b"slow")  # never released
        await asyncio.wait_for(svc.started_slow.wait(), WAIT_S)
        queued = await send(client, subject, b"queued")  # behind it, on the same endpoint
        # Received before the stop begins (nats.micro keeps its endpoints private).
        endpoint_sub = svc.service._endpoints[0]._subscription
        async with asyncio.timeout(WAIT_S):
            while endpoint_sub.pending_msgs < 1:
                await asyncio.sleep(0.01)
        svc.request_stop()
        for sub in (inflight, queued):
            answer = await sub.next_msg(timeout=WAIT_S)  # none came: the caller timed out
            assert answer.headers is not None
            assert answer.headers[ERROR_CODE_HEADER] == STOPPING_CODE
            assert answer.headers[ERROR_HEADER] == STOPPING_DESCRIPTION
        await asyncio.wait_for(task, WAIT_S)
        assert svc.cancelled == 1
    finally:
        svc.request_stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), WAIT_S)
