"""MicroService.start's flush after its endpoints are added (the round trip that makes sure
the server has their subscriptions) is bounded by ``connect_timeout_s``, as the start-up's
other plain round trips are (the connection's first PING, the ``$SRV.PING`` after it) -- not
by nats-py's own 10 s, which no setting changed: a server frozen exactly there held the
start-up 10 s whatever the settings said.

A real nats-server of the test's own, frozen (SIGSTOP) by the service as its endpoints are
about to be added, so the flush is the first round trip it never answers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import pytest
from frozen import freeze, resume

from shared.natsserver import EmbeddedNats
from shared.service import Endpoint, MicroService, StartUpLost
from shared.settings import ServiceSettings

CONNECT_TIMEOUT_S = 0.5
WAIT_S = 8.0
"""A liveness bound below nats-py's own flush timeout (10 s): the start-up must have given up
by then -- after about ``CONNECT_TIMEOUT_S``, however slow the machine -- no speed check."""


class FreezingAtEndpoints(MicroService):
    """A service that freezes its server as :meth:`MicroService.start` asks for its
    endpoints: the micro service is up (its own flush answered), the endpoints' subscriptions
    are sent next, and then the start-up's flush waits for a PONG that never comes."""

    def __init__(self, settings: ServiceSettings, server: EmbeddedNats) -> None:
        super().__init__(settings, name="vtm-flushtest", version="0.1.0",
                         group="vtm.flushtest")
        self.server = server

    def endpoints(self) -> Sequence[Endpoint]:
        freeze(self.server)
        return super().endpoints()


@pytest.fixture
def own_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats(jetstream=False) as srv:
        yield srv


async def test_the_start_up_flush_gives_up_after_connect_timeout(own_server: EmbeddedNats,
                                                                 uniq: str) -> None:
    settings = ServiceSettings(nats_url=own_server.url, subject_prefix=uniq,
                               connect_timeout_s=CONNECT_TIMEOUT_S, reconnect_wait_s=0.2)
    svc = FreezingAtEndpoints(settings, own_server)
    try:
        with pytest.raises(StartUpLost):
            await asyncio.wait_for(svc.run(handle_signals=False), timeout=WAIT_S)
    finally:
        resume(own_server)
    assert not svc.started.is_set()
