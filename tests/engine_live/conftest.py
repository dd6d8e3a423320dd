"""Fixtures of the live torch-engine tests: a real ``nats-server`` (random loopback ports, one
per session) and unique subject prefixes, both from ``tests/conftest.py``; gloo worlds are
spawned by the tests themselves. Helpers shared by the tests: ``engine_live_support``.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # helpers in engine_live_support (import-mode=importlib)
    sys.path.insert(0, _HERE)

try:  # the engine extra (torch, safetensors) may be absent: skip, don't error
    import safetensors  # noqa: F401
    import torch  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_*.py"]
