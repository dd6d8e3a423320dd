"""A service notices a NATS server that went silent without closing the connection, and serves
again once the server does.

A crashed host or a dropped NAT / firewall entry leaves a half-open TCP connection: no FIN, no
RST, writes still accepted by the kernel. Only the client's pings tell, so the services ping
every ``ping_interval_s`` and count the connection lost after ``max_outstanding_pings``
unanswered ones (shared/service.py ``reconnect_options``). Before, nats-py's defaults (every
120 s, 2 unanswered) left such a connection unnoticed for up to six minutes, with every publish
of the meantime lost.

Played with a real nats-server frozen by SIGSTOP (tests/frozen.py): its kernel keeps the TCP
connection open and acknowledges what is written, and the process answers nothing. The
assertions are on outcomes (the client saw the connection lost, reconnected, and the service
answers a request), not on timings.
"""

from __future__ import annotations

import asyncio

import nats
from frozen import freeze, resume
from nats.micro.request import Request
from service_support import service_running

from shared.natsserver import EmbeddedNats
from shared.service import Endpoint, MicroService
from shared.settings import ServiceSettings

WAIT_S = 60.0  # a liveness bound for a loaded machine; nats-py's own defaults need 360 s


class Echo(MicroService):
    def __init__(self, settings: ServiceSettings) -> None:
        super().__init__(settings, name="vtm-silenttest", version="0.1.0",
                         group=f"{settings.subject_prefix}.silenttest")

    def endpoints(self) -> list[Endpoint]:
        async def echo(request: Request) -> bytes:
            return request.data

        return [Endpoint("echo", echo)]


async def until(cond: object, what: str) -> None:
    assert callable(cond)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + WAIT_S
    while not cond():
        if loop.time() >= deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def test_a_service_notices_a_silent_server_by_its_pings_and_reconnects(
        own_nats_server: EmbeddedNats, uniq: str) -> None:
    settings = ServiceSettings(nats_url=own_nats_server.url, subject_prefix=uniq,
                               ping_interval_s=0.2, max_outstanding_pings=2,
                               reconnect_wait_s=0.2)
    svc = Echo(settings)
    async with service_running(svc, timeout_s=WAIT_S) as task:
        nc = svc.nc
        reconnects = nc.stats["reconnects"]
        freeze(own_nats_server)
        try:
            # The connection stays open at the TCP level: only the unanswered pings say it
            # is gone (nats-py: "stale connection"), after which the client reconnects.
            await until(lambda: not nc.is_connected, "the silent connection counted as lost")
        finally:
            resume(own_nats_server)
        await until(lambda: nc.is_connected and nc.stats["reconnects"] > reconnects,
                    "the service reconnected")
        client = await nats.connect(own_nats_server.url, connect_timeout=5)
        try:
            reply = await client.request(f"{uniq}.silenttest.echo", b"still here",
                                         timeout=WAIT_S)
        finally:
            await client.close()
        assert reply.data == b"still here"
    assert task.exception() is None


def test_the_ping_settings_reach_the_connection_options() -> None:
    """What every service (and the rank host) passes to nats.connect."""
    from shared.service import reconnect_options

    opts = reconnect_options(ServiceSettings(ping_interval_s=7.5, max_outstanding_pings=4))
    assert (opts["ping_interval"], opts["max_outstanding_pings"]) == (7.5, 4)
    defaults = reconnect_options(ServiceSettings())
    assert defaults["ping_interval"] * (defaults["max_outstanding_pings"] + 1) <= 60
