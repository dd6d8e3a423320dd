"""Fixtures of the tests in tests/shared."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.natsserver import EmbeddedNats

SMALL_MAX_PAYLOAD = 1024
"""The max_payload of :func:`small_server`: what a test fills or overflows with a few bytes."""


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """A nats-server (no JetStream) whose max_payload is :data:`SMALL_MAX_PAYLOAD` bytes."""
    conf: Path = tmp_path_factory.mktemp("conf") / "small.conf"
    conf.write_text(f"max_payload: {SMALL_MAX_PAYLOAD}\n")
    srv = EmbeddedNats(jetstream=False, extra_args=("-c", str(conf))).start()
    try:
        yield srv
    finally:
        srv.stop()
