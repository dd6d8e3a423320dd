"""Fixtures of the live acceptance tests (issue "The live system", Acceptance).

These tests start the whole live system as real processes (:class:`vertumnus.live.stack.
LiveStack`: an embedded ``nats-server`` on loopback, gateway, scheduler, controller, cache
manager and a rank-daemon host on the ``sim`` backend timed by the ground truth × a small time
scale) and check it from the outside: HTTP answers, FirstTokens on the wire, epoch records.
The trace test runs the services in-process with an in-memory span exporter (one tracer
provider per process, installed once here as ``_tracing``; ``spans`` of ``tests/conftest.py``
clears it per test). Helpers live in ``live_accept_support``.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from shared.natsserver import EmbeddedNats, NatsServerNotFound, find_nats_server  # noqa: E402
from shared.telemetry import setup_tracing  # noqa: E402

_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="session", autouse=True)
def _needs_nats_server() -> None:
    try:
        find_nats_server()
    except NatsServerNotFound as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"no nats-server binary: {exc}")


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    with EmbeddedNats() as server:
        yield server


@pytest.fixture(scope="session")
def _tracing() -> InMemorySpanExporter:
    setup_tracing("vtm-accept-tests", span_processor=SimpleSpanProcessor(_EXPORTER))
    return _EXPORTER
