"""Fixtures of the ``vertumnus up`` / ``replay`` / ``tap`` / docker-compose tests.

These tests run the real command line in child processes against real ``nats-server``
processes on loopback (never mocks). Helpers live in ``live_up_support`` (unique module name
for ``--import-mode=importlib``), made importable here. ``nats_server`` (one per session) is
the shared fixture of ``tests/conftest.py``; ``fitted_profile`` (one per session) is the
profile ``up`` fits for itself by default.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from vertumnus.live.stack import UpConfig
from vertumnus.live.startup_profile import profile_in_child

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

DEFAULT_UP = UpConfig()
"""The configuration of ``vertumnus up`` with every option at its default: what its hardware
profile depends on (degrees, seed, hardware, ``--per-degree``, SLO; stack.hardware_profile)
is the command line's default (tests/live_up/test_up_run.py checks that ``up`` fits this
very profile itself)."""


@pytest.fixture(scope="session")
def fitted_profile(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The services' profile ``vertumnus up`` fits for itself on the default hardware, SLO,
    degrees and seed, fitted once per session -- by the very child process ``up`` runs for
    it (vertumnus/live/startup_profile.py), on up's default configuration -- to pass as
    ``--profile`` to runs whose point is not the fit (~8 s of each ``up`` run saved).

    ``up`` fits its profile and then goes on exactly as with ``--profile`` of the file it wrote
    (stack.py: the config's profile is replaced by the fitted path), so such a run takes the
    same path past the fit. A run whose point is the fit itself gives no ``--profile``."""
    path, _ = asyncio.run(profile_in_child("hardware", DEFAULT_UP,
                                           tmp_path_factory.mktemp("up-profile")))
    return path
