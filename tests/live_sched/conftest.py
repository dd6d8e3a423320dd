"""Fixtures for the live gateway + scheduler tests: a real ``nats-server`` (JetStream, random
loopback ports, one per session), in-process services on it (``live``), fake rank workers
(``fake_worker``). Each test uses its own subject prefix (``uniq``), so tests never see each
other's streams, buckets or subjects. One OpenTelemetry provider per process (see tests/live).
Helpers live in ``live_sched_support`` (made importable here).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.client import Client
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from live_sched_support import FakeWorker, Services  # noqa: E402

from shared.natsserver import EmbeddedNats, NatsServerNotFound  # noqa: E402
from shared.subjects import Subjects  # noqa: E402
from shared.telemetry import setup_tracing  # noqa: E402

_EXPORTER = InMemorySpanExporter()


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
    """A fresh subject prefix / id token for one test."""
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture(scope="session")
def _tracing() -> InMemorySpanExporter:
    setup_tracing("vtm-tests", span_processor=SimpleSpanProcessor(_EXPORTER))
    return _EXPORTER


@pytest.fixture
def spans(_tracing: InMemorySpanExporter) -> Iterator[InMemorySpanExporter]:
    _tracing.clear()
    yield _tracing
    _tracing.clear()


@pytest.fixture
async def live(nats_server: EmbeddedNats, uniq: str) -> AsyncIterator[Services]:
    services = Services(nats_server.url, uniq, AsyncExitStack())
    try:
        yield services
    finally:
        await services.close()


@pytest.fixture
async def fake_worker(nc: Client, uniq: str) -> AsyncIterator[Callable[..., Awaitable[FakeWorker]]]:
    made: list[FakeWorker] = []

    async def make(worker_id: str, degree: int, first_gpu: int, **kw: Any) -> FakeWorker:
        w = await FakeWorker(nc, Subjects(uniq), worker_id, degree, first_gpu, **kw).start()
        made.append(w)
        return w

    yield make
    for w in made:
        await w.stop()
