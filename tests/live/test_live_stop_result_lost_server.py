"""A rank worker stopped while its NATS server is gone does not wait for its results' store.

``vertumnus up`` killed with requests in flight: the kernel sends SIGTERM to the services and
to nats-server at once. A rank worker's stop waits for the FirstTokens it is still sending
(``publish_result``: stored by the results stream, sent again after a reconnect for up to
its ``within_s``), bounded by ``drain_timeout_s`` -- with the server gone it waited out that
whole bound (10 s by default; seen in 7 of 41 such stops), though no result could be stored.
Here the bound is far longer than the test's own wait, so the old stop fails the test; the
fixed one gives the wait up as soon as the connection is lost, and says how many results it
left.

A real nats-server is killed (SIGKILL); the result is sent after that, as the handoff of a
request that finished while the server went away.
"""

from __future__ import annotations

import asyncio

from live_support import until_started
from structlog.testing import capture_logs

from services.rankd.backend import SimBackend
from services.rankd.host import RankdHost
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats

WAIT_S = 20.0  # a liveness bound (the old stop took min(drain_timeout_s, ~within_s))
DRAIN_TIMEOUT_S = 120.0  # far past WAIT_S: a stop that waits it out fails the test


async def test_a_rank_worker_whose_server_is_gone_does_not_wait_for_its_results(
        own_nats_server: EmbeddedNats, uniq: str) -> None:
    settings = RankdSettings(nats_url=own_nats_server.url, subject_prefix=uniq,
                             drain_timeout_s=DRAIN_TIMEOUT_S)
    host = RankdHost(settings, range(0, 2), lambda wid, kind: SimBackend(time_scale=1.0),
                     initial=["w-cp2-g0"])
    task = asyncio.create_task(host.run(handle_signals=False))
    try:
        await until_started(host, WAIT_S)
        svc = host.services["w-cp2-g0"]
        own_nats_server.kill()
        async with asyncio.timeout(WAIT_S):
            while svc.nc.is_connected:
                await asyncio.sleep(0.02)
        # A request's FirstToken, sent as the worker sends every one (its own task, which the
        # stop waits for): it waits for a reconnect that never comes.
        svc._send_result(svc.subjects.result("stop-1"), b"{}", {})
        assert svc._handoffs
        with capture_logs() as logs:
            host.request_stop()
            await asyncio.wait_for(asyncio.shield(task), WAIT_S)
    finally:
        host.request_stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), WAIT_S)
    assert task.exception() is None
    assert any(e["event"].startswith("results not stored at stop") and e["results"] == 1
               for e in logs), logs
