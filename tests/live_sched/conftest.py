"""Fixtures for the live gateway + scheduler tests: a real ``nats-server`` (JetStream, random
loopback ports, one per session), in-process services on it (``live``), fake rank workers
(``fake_worker``). Each test uses its own subject prefix (``uniq``), so tests never see each
other's streams, buckets or subjects. ``nats_server``, ``nc``, ``uniq`` and ``spans`` (one
OpenTelemetry provider per process) are the shared fixtures of ``tests/conftest.py``.
Helpers live in ``live_sched_support`` (made importable here).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from live_sched_support import FakeWorker, Services  # noqa: E402

from shared.natsserver import EmbeddedNats  # noqa: E402
from shared.subjects import Subjects  # noqa: E402


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
