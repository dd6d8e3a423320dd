"""MicroService.start's flushes -- nats.micro's own, as the micro service is added (its
PING/INFO/STATS subscriptions), and the start-up's after the endpoints are added -- are bounded
by ``connect_timeout_s``, as the start-up's other plain round trips are (the connection's first
PING, the ``$SRV.PING`` after it); not by nats-py's own 10 s, which no setting changed: a server
frozen at either flush held the start-up 10 s whatever the settings said. A flush unanswered
ends the start-up as a lost server, naming the server and the bound; a micro service whose
start was given up leaves no subscription behind, also on a connection that lives on.

Structural: the service's connection records the timeout each of its flushes is given (the
connection's ``flush`` wrapped as the setup begins, before either flush: nats.micro calls the
same connection's); the tests assert it is the setting. A real nats-server of the test's own,
frozen (SIGSTOP) where a flush is the first round trip it never answers, shows that the bound
is what ends the start-up. WAIT_S is a hang guard only, no speed check."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack

import nats.errors
import pytest
from frozen import freeze, resume
from nats.aio.client import DEFAULT_FLUSH_TIMEOUT

from shared.natsclient import Client, connect
from shared.natsserver import EmbeddedNats
from shared.service import Endpoint, MicroService, StartUpLost
from shared.settings import ServiceSettings

CONNECT_TIMEOUT_S = 0.5
WAIT_S = 60.0
"""A hang guard: far above both the bound (CONNECT_TIMEOUT_S) and nats-py's own 10 s."""
NAME = "vtm-flushtest"


class Freezing(MicroService):
    """A service that records in :attr:`timeouts` the timeout each flush of its connection is
    given (nats-py's default where none is), and freezes its server ``at`` a step of its
    start: ``"setup"`` (just before the micro service is added: nats.micro's flush, after its
    PING/INFO/STATS subscriptions, is the first round trip unanswered) or ``"endpoints"`` (the
    micro service is up, its flush answered; the endpoints' subscriptions are sent next, and
    the start-up's own flush waits for a PONG that never comes)."""

    def __init__(self, settings: ServiceSettings, server: EmbeddedNats, at: str) -> None:
        super().__init__(settings, name=NAME, version="0.1.0", group="vtm.flushtest")
        self.server = server
        self.at = at
        self.timeouts: list[float] = []

    async def setup(self, stack: AsyncExitStack) -> None:
        flush = self.nc.flush

        async def recorded(timeout: float = DEFAULT_FLUSH_TIMEOUT) -> None:
            self.timeouts.append(timeout)
            await flush(timeout=timeout)  # type: ignore[arg-type]  # int in the stubs

        self.nc.flush = recorded  # type: ignore[method-assign]
        if self.at == "setup":
            freeze(self.server)

    def endpoints(self) -> Sequence[Endpoint]:
        if self.at == "endpoints":
            freeze(self.server)
        return super().endpoints()


@pytest.fixture
def own_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats(jetstream=False) as srv:
        yield srv


@pytest.fixture
async def other(own_server: EmbeddedNats) -> AsyncIterator[Client]:
    """A second connection to ``own_server``: someone asking for the service."""
    client = await connect(own_server.url, connect_timeout=5)
    try:
        yield client
    finally:
        await client.close()


def settings_for(server: EmbeddedNats, prefix: str) -> ServiceSettings:
    return ServiceSettings(nats_url=server.url, subject_prefix=prefix,
                           connect_timeout_s=CONNECT_TIMEOUT_S, reconnect_wait_s=0.2,
                           drain_timeout_s=CONNECT_TIMEOUT_S)


async def lost_start_up(svc: Freezing) -> str:
    """Run ``svc`` to its :class:`StartUpLost`, its server resumed after; the error's text."""
    try:
        with pytest.raises(StartUpLost) as lost:
            await asyncio.wait_for(svc.run(handle_signals=False), timeout=WAIT_S)
    finally:
        resume(svc.server)
    assert not svc.started.is_set()
    return str(lost.value)


def names_server_and_bound(text: str, server: EmbeddedNats) -> bool:
    return server.url in text and f"connect_timeout_s = {CONNECT_TIMEOUT_S:g} s" in text


async def test_the_micro_services_start_flush_is_given_connect_timeout(
        own_server: EmbeddedNats, uniq: str) -> None:
    """Frozen before the micro service is added: nats.micro's own flush (its only round trip)
    is given ``connect_timeout_s`` (before: nothing, nats-py's 10 s), and its timeout ends the
    start-up as a lost server naming the server and the bound."""
    svc = Freezing(settings_for(own_server, uniq), own_server, at="setup")
    text = await lost_start_up(svc)
    assert svc.timeouts == [CONNECT_TIMEOUT_S]
    assert names_server_and_bound(text, own_server), text
    assert svc.nc.is_closed


async def test_the_start_up_flush_after_the_endpoints_is_given_connect_timeout(
        own_server: EmbeddedNats, uniq: str) -> None:
    """Frozen as the endpoints are added: nats.micro's flush (answered) and the start-up's own
    after the endpoints (never answered) were each given ``connect_timeout_s``."""
    svc = Freezing(settings_for(own_server, uniq), own_server, at="endpoints")
    text = await lost_start_up(svc)
    assert svc.timeouts == [CONNECT_TIMEOUT_S, CONNECT_TIMEOUT_S]
    assert names_server_and_bound(text, own_server), text
    assert svc.nc.is_closed


async def test_a_micro_start_given_up_on_a_given_connection_leaves_no_service(
        own_server: EmbeddedNats, other: Client, uniq: str) -> None:
    """On a connection handed to ``run`` (its owner's: it lives on after the failed start, as
    a rank host's does), a micro start given up at its flush raises the flush's timeout as it
    is, and takes back the PING/INFO/STATS subscriptions it had made: once the server is back,
    nothing answers for the service (before: the half-registered service answered its
    ``$SRV.PING`` although it never started)."""
    given = await connect(own_server.url, connect_timeout=5)
    try:
        svc = Freezing(settings_for(own_server, uniq), own_server, at="setup")
        try:
            with pytest.raises(nats.errors.FlushTimeoutError) as timed_out:
                await asyncio.wait_for(svc.run(given, handle_signals=False), timeout=WAIT_S)
        finally:
            resume(own_server)
        assert svc.timeouts == [CONNECT_TIMEOUT_S]
        assert names_server_and_bound(str(timed_out.value), own_server), timed_out.value
        assert given.is_connected
        await given.flush(timeout=int(WAIT_S))  # the server has read all it was sent
        with pytest.raises(nats.errors.NoRespondersError):
            await other.request(f"$SRV.PING.{NAME}", b"", timeout=WAIT_S)
    finally:
        await given.close()
