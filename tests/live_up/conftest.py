"""Fixtures of the ``vertumnus up`` / ``replay`` / ``tap`` / docker-compose tests.

These tests run the real command line in child processes against real ``nats-server``
processes on loopback (never mocks). Helpers live in ``live_up_support`` (unique module name
for ``--import-mode=importlib``), made importable here. ``nats_server`` (one per session) is
the shared fixture of ``tests/conftest.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
