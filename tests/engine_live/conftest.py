"""Fixtures of the live torch-engine tests: a real ``nats-server`` (random loopback ports, one
per session) and unique subject prefixes, both from ``tests/conftest.py``; gloo worlds are
spawned by the tests themselves.
"""

from __future__ import annotations

try:  # the engine extra (torch, safetensors) may be absent: skip, don't error
    import safetensors  # noqa: F401
    import torch  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_*.py"]
