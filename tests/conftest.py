"""Fixtures shared by every test folder (pytest runs with ``--import-mode=importlib``; a
``conftest.py`` at the top of the test tree is still seen by all subfolders).

Tests against a real ``nats-server`` (JetStream on, random loopback ports): one server per test
session (starting one takes a fraction of a second, but dozens add up); each test gets its own
connection (``nc``) and must use unique subjects / bucket names (``uniq``) so tests never see
each other's traffic. One OpenTelemetry provider per process: the in-memory exporter is
installed once here (``_tracing``) and cleared per test that asks for it (``spans``); likewise
one meter provider with an in-memory reader (``metric_reader``; ``metricsread.points`` reads it).

A folder that needs something else overrides the fixture of the same name in its own conftest.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from hypothesis import settings
from nats.aio.client import Client
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared.metrics import setup_metrics
from shared.natsclient import connect
from shared.natsserver import EmbeddedNats, NatsServerNotFound
from shared.telemetry import setup_tracing

_EXPORTER = InMemorySpanExporter()
_METRICS = InMemoryMetricReader()
# Installed at import: a reader can only be given to the provider when it is made, and the
# first setup_metrics of the process (any in-process service) makes it.
setup_metrics("vtm-tests", reader=_METRICS)

# Property tests draw the same examples on every run (derandomize: the seed comes from each
# test's source), so that a red CI is a defect of the change and not a rare draw; the example
# database is then unused. HYPOTHESIS_PROFILE=explore draws fresh examples (and keeps the
# failures found in .hypothesis/): run it by hand over several seeds to search further.
# No deadline in either: hypothesis's per-example deadline (200 ms) is a timed assertion,
# which a loaded CI machine fails at random.
settings.register_profile("repeatable", derandomize=True, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

# Helpers shared by several folders (natssecurity_support) live at the top of the tree.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
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
    """A test's own connection: the project's client, whose ``flush()`` ends after the
    server read what came before it (``shared.natsclient``: nats-py's may end before a
    subscription just made is in place, and a service's request then finds no responders)."""
    client = await connect(nats_server.url, connect_timeout=5)
    try:
        yield client
    finally:
        await client.drain()


@pytest.fixture
def uniq() -> str:
    """A fresh lowercase token for subjects, prefixes and ids of one test."""
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


@pytest.fixture(scope="session")
def metric_reader() -> InMemoryMetricReader:
    """The process's one meter provider, read in memory (cumulative: compare before/after)."""
    return _METRICS

