"""Fixtures for the controller / cache-manager services against a real ``nats-server``.

One JetStream-enabled server per session on random loopback ports; every test uses its own
subject prefix (``uniq``) so buckets, streams and subjects never collide between tests.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack

import nats
import pytest
from nats.aio.client import Client

from shared.natsserver import EmbeddedNats, NatsServerNotFound
from shared.service import MicroService

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # helpers in live_ctl_support (import-mode=importlib)
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    try:
        server = EmbeddedNats()
    except NatsServerNotFound as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"no nats-server binary: {exc}")
    with server:
        yield server


@pytest.fixture
async def nc(nats_server: EmbeddedNats) -> AsyncIterator[Client]:
    client = await nats.connect(nats_server.url, connect_timeout=5)
    try:
        yield client
    finally:
        await client.drain()


@pytest.fixture
def uniq() -> str:
    """A fresh lowercase token for subject prefixes and ids of one test."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
async def services() -> AsyncIterator[Callable[[MicroService], Awaitable[MicroService]]]:
    """Start services (each on its own connection); all are stopped at the end of the test."""
    async with AsyncExitStack() as stack:

        async def start(svc: MicroService) -> MicroService:
            await svc.start(stack)
            return svc

        yield start
