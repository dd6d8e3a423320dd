"""Fixtures of the live torch-engine tests: a real ``nats-server`` (random loopback ports, one
per session) and unique subject prefixes; gloo worlds are spawned by the tests themselves.

pytest runs with ``--import-mode=importlib``, so fixtures of tests/live are not shared: the
NATS fixtures are repeated here (same pattern as tests/live/conftest.py).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator

import nats
import pytest
from nats.aio.client import Client

try:  # the engine extra (torch, safetensors) may be absent: skip, don't error
    import safetensors  # noqa: F401
    import torch  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_*.py"]

from shared.natsserver import EmbeddedNats, NatsServerNotFound


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
    """A fresh lowercase token for subjects, prefixes and ids of one test."""
    return "t" + uuid.uuid4().hex[:10]
