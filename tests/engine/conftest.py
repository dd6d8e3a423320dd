"""Engine tests: make the helpers ``engine_dist`` and ``engine_rank_cases`` importable.

pytest runs with ``--import-mode=importlib`` (no package __init__ files), so sibling modules
are not importable by default; spawned ranks inherit this sys.path and unpickle the rank bodies
by these module names. The names are unique to avoid clashing with other suites.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)



@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """``torch.cuda`` answering as a machine with ``cuda[0]`` GPUs (0: no CUDA at all): the
    device checks of the ranks and the decode role, tested without a GPU."""
    import torch

    count = [0]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count[0] > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count[0])
    return count


try:  # the engine extra (torch, safetensors, tokenizers) may be absent: skip, don't error
    import safetensors  # noqa: F401
    import torch  # noqa: F401
except ImportError:
    collect_ignore_glob = ["test_*.py"]
