"""Fixtures of the live tests (services and clients against a real ``nats-server``).

``nats_server`` (one per session), ``nc`` and ``uniq`` are the shared fixtures of
``tests/conftest.py``. A test that freezes or kills its server must not do so to the session's:
it takes ``own_nats_server``, a server of its own (crash it with ``EmbeddedNats.kill``). Helpers
to freeze and resume it, and to wait for what that holds up, live in ``live_support`` (unique
module name for ``--import-mode=importlib``), made importable here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.natsserver import EmbeddedNats

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture
def own_nats_server() -> Iterator[EmbeddedNats]:
    """A nats-server of the test's own (it is frozen or killed)."""
    with EmbeddedNats() as srv:
        yield srv
