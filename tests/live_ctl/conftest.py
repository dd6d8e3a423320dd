"""Fixtures for the controller / cache-manager services against a real ``nats-server``.

One JetStream-enabled server per session on random loopback ports; every test uses its own
subject prefix (``uniq``) so buckets, streams and subjects never collide between tests.
``nats_server``, ``nc`` and ``uniq`` are the shared fixtures of ``tests/conftest.py``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack

import pytest

from shared.service import MicroService

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # helpers in live_ctl_support (import-mode=importlib)
    sys.path.insert(0, _HERE)


@pytest.fixture
async def services() -> AsyncIterator[Callable[[MicroService], Awaitable[MicroService]]]:
    """Start services (each on its own connection); all are stopped at the end of the test."""
    async with AsyncExitStack() as stack:

        async def start(svc: MicroService) -> MicroService:
            await svc.start(stack)
            return svc

        yield start
