"""Helpers of the live tests that take a nats-server away from its clients (``own_nats_server``
of ``conftest.py``) and wait for what that holds up. Freezing and resuming it is ``frozen``'s;
crashing it is :meth:`shared.natsserver.EmbeddedNats.kill` (SIGKILL: the clients see their
connections drop, with any round trip still outstanding).
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client

from services.rankd.host import RankdHost


async def until_a_round_trip_waits(nc: Client, timeout_s: float) -> None:
    """Return once ``nc`` waits for a PONG (a flush, say of a stop or a drain)."""
    async with asyncio.timeout(timeout_s):
        while not nc._pongs:  # nats-py's outstanding PINGs (no public view of them)
            await asyncio.sleep(0.005)


async def until_started(host: RankdHost, timeout_s: float) -> None:
    """Return once ``host`` has its worker services, all of them started, and has itself
    started: it follows the epoch record (its ``rankd-host-epochs`` task runs). Its workers
    start before that; until then its run still makes its round trips of the start (the epoch
    record's watch, set up after the workers), and a test that took the server away in that
    window met a start's request timing out (``nats: timeout`` out of ``run``), not the stop
    it meant to test."""
    async with asyncio.timeout(timeout_s):
        while not (host.services and all(s.started.is_set() for s in host.services.values())
                   and any(t.get_name() == "rankd-host-epochs" for t in asyncio.all_tasks())):
            await asyncio.sleep(0.05)
