"""A graceful stop ends cleanly when the NATS server vanishes under it.

``vertumnus up`` killed: the kernel sends SIGTERM to the services and to nats-server at once.
A stop that had sent a round trip (the PING of a subscription drain, a KV put) just before the
server went away waited for nats-py's whole timeout -- nats-py forgets, rather than fails, a
round trip whose connection drops -- and then raised: the micro service's stop 10 s and a
``FlushTimeoutError`` out of ``run`` (exit status 1 with a traceback), a rank worker's final
state publication 5 s more and a ``TimeoutError`` that skipped its backend's close.

Reproduced deterministically with a real nats-server: it is frozen (SIGSTOP) so that the stop's
first round trip waits for its answer, then killed (SIGKILL): the client sees the connection
drop with that round trip outstanding. The assertions are on outcomes (no exception, no error
logged, the backend closed, the connection closed), not on timings.
"""

from __future__ import annotations

import asyncio

import nats
from frozen import freeze, resume
from live_support import until_a_round_trip_waits, until_started
from nats.micro.request import Request
from structlog.testing import capture_logs

from services.rankd.backend import SimBackend
from services.rankd.host import RankdHost
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.service import Endpoint, MicroService, while_connected
from shared.settings import ServiceSettings

WAIT_S = 60.0  # a liveness bound (the old stop took 10-15 s and then raised), not a speed check


class Echo(MicroService):
    def __init__(self, settings: ServiceSettings) -> None:
        super().__init__(settings, name="vtm-stoptest", version="0.1.0", group="vtm.stoptest")

    def endpoints(self) -> list[Endpoint]:
        async def echo(request: Request) -> bytes:
            return request.data

        return [Endpoint("echo", echo)]


async def test_a_service_whose_server_vanishes_during_its_stop_ends_cleanly(
        own_nats_server: EmbeddedNats, uniq: str) -> None:
    # drain_timeout_s above nats-py's 10 s flush timeout: the old stop met that timeout first.
    settings = ServiceSettings(nats_url=own_nats_server.url, subject_prefix=uniq,
                               drain_timeout_s=30)
    svc = Echo(settings)
    task = asyncio.create_task(svc.run(handle_signals=False))
    try:
        await asyncio.wait_for(svc.started.wait(), WAIT_S)
        nc = svc.nc
        svc.request_stop()
        freeze(own_nats_server)
        await until_a_round_trip_waits(nc, WAIT_S)
        with capture_logs() as logs:
            own_nats_server.kill()
            await asyncio.wait_for(asyncio.shield(task), WAIT_S)  # raised FlushTimeoutError
    finally:
        svc.request_stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), WAIT_S)
    assert task.exception() is None
    assert nc.is_closed
    assert any(e["event"].startswith("micro service stopped without a drain") for e in logs)


class Recorded(SimBackend):
    """The sim backend, recording that it was closed."""

    closed: list[str] = []

    def __init__(self, wid: str) -> None:
        super().__init__(time_scale=1.0)
        self.wid = wid

    async def close(self) -> None:
        Recorded.closed.append(self.wid)
        await super().close()


async def test_a_rank_worker_whose_server_vanishes_during_its_stop_closes_its_backend(
        own_nats_server: EmbeddedNats, uniq: str) -> None:
    Recorded.closed = []
    settings = RankdSettings(nats_url=own_nats_server.url, subject_prefix=uniq,
                             drain_timeout_s=30)
    host = RankdHost(settings, range(0, 2), lambda wid, kind: Recorded(wid),
                     initial=["w-cp2-g0"])
    task = asyncio.create_task(host.run(handle_signals=False))
    try:
        await until_started(host, WAIT_S)
        nc = host._nc
        assert nc is not None
        with capture_logs() as logs:
            host.request_stop()
            freeze(own_nats_server)
            await until_a_round_trip_waits(nc, WAIT_S)
            own_nats_server.kill()
            await asyncio.wait_for(asyncio.shield(task), WAIT_S)
    finally:
        host.request_stop()
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), WAIT_S)
    assert task.exception() is None
    # The worker's stop neither failed (logged by the host as "worker service failed") nor
    # skipped its backend's close; its final state could not be published, which is told.
    assert not [e for e in logs if e["log_level"] in ("error", "critical")], logs
    assert Recorded.closed == ["w-cp2-g0"]
    assert nc.is_closed


async def test_a_flush_cut_short_by_its_bound_leaves_the_connection_working(
        own_nats_server: EmbeddedNats) -> None:
    """while_connected gives up a flush whose PONG is late (the server frozen, not gone) and
    cancels it; when the PONG then comes, nats-py sets the result of the oldest waiter without
    looking whether it was cancelled: before shield_pongs, the InvalidStateError ended the
    client's read loop and the connection stayed "connected" while delivering nothing."""
    nc = await nats.connect(own_nats_server.url, connect_timeout=5, allow_reconnect=False)
    try:
        sub = await nc.subscribe("probe.x")
        freeze(own_nats_server)
        try:
            done, _ = await while_connected(nc, nc.flush(timeout=30), timeout_s=0.3)
            assert not done  # given up: the server never answered in time
        finally:
            resume(own_nats_server)  # the late PONG reaches the client now
        await nc.flush(timeout=WAIT_S)
        await nc.publish("probe.x", b"after")
        msg = await sub.next_msg(timeout=WAIT_S)  # old code: nothing is read any more
        assert msg.data == b"after" and nc.is_connected
    finally:
        await nc.close()
