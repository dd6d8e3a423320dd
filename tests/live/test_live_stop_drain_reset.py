"""A connection's last drain ends cleanly when its socket dies under it.

``vertumnus up`` killed: the kernel sends SIGTERM to the services and to nats-server at once;
a service's connection may be draining (``shared.service.drain_or_close``) when the server
closes it. nats-py then starts reconnecting and cancels its read and write loops;
``while_connected`` gives the drain up (reconnecting), nats-py's drain catches that cancel
and flushes once more -- with its loops gone, that flush writes what was queued meanwhile to
the dead socket itself and raises ``ConnectionResetError``, which ended the stop with a
traceback and exit status 1 (a rank host in 1 of 89 stops with requests in flight).

Reproduced with a real nats-server: frozen (SIGSTOP) so that the drain waits for its PONG,
then killed (SIGKILL); a publish while the client reconnects is what the final flush has to
write. (Should the drain be given up before the test sees the client reconnecting, there is
nothing queued and the old code passes too: the race is lost rarely.)
"""

from __future__ import annotations

import asyncio

import nats
from frozen import freeze
from live_support import until_a_round_trip_waits

from shared.natsserver import EmbeddedNats
from shared.service import drain_or_close

WAIT_S = 30.0  # a liveness bound, not a speed check


async def test_a_drain_whose_socket_dies_under_it_closes_the_connection(
        own_nats_server: EmbeddedNats) -> None:
    nc = await nats.connect(own_nats_server.url, connect_timeout=5, reconnect_time_wait=0.5,
                            max_reconnect_attempts=-1)
    try:
        await nc.subscribe("probe.x")
        freeze(own_nats_server)
        stop = asyncio.create_task(drain_or_close(nc, WAIT_S))
        await until_a_round_trip_waits(nc, WAIT_S)  # the drain waits for its PONG
        own_nats_server.kill()  # SIGKILL: delivered to a stopped process too
        async with asyncio.timeout(WAIT_S):
            while not (nc.is_reconnecting or stop.done()):
                await asyncio.sleep(0)
        if not stop.done():
            await nc.publish("probe.y", b"queued while reconnecting")
        await asyncio.wait_for(stop, WAIT_S)  # old code: ConnectionResetError
        assert nc.is_closed
    finally:
        if not nc.is_closed:
            await nc.close()
