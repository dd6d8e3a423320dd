"""Fixtures of the ``vertumnus up`` / ``replay`` / ``tap`` / docker-compose tests.

These tests run the real command line in child processes against real ``nats-server``
processes on loopback (never mocks). Helpers live in ``live_up_support`` (unique module name
for ``--import-mode=importlib``), made importable here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from shared.natsserver import EmbeddedNats, NatsServerNotFound  # noqa: E402


@pytest.fixture(scope="session")
def nats_server() -> Iterator[EmbeddedNats]:
    try:
        server = EmbeddedNats()
    except NatsServerNotFound as exc:  # pragma: no cover - depends on the machine
        pytest.skip(f"no nats-server binary: {exc}")
    with server:
        yield server
