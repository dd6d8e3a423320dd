"""Fixtures of the simulator tests: one measured profile per session, small workloads.

The profile is *measured* on the simulated backend (``sim.profiling.run_profile``), exactly as
``vertumnus profile`` would; it is never the ground truth itself. Helpers live in
``simeng_support`` (made importable here: pytest runs with ``--import-mode=importlib``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from simeng_support import CALM_THEN_HEAVY  # noqa: E402

from shared.costmodel import Profile  # noqa: E402
from sim.workloads import (  # noqa: E402
    SyntheticConfig,
    Workload,
    default_traces_dir,
    generate,
    read_mooncake,  # noqa: E402
)


@pytest.fixture(scope="session")
def profile(tmp_path_factory: pytest.TempPathFactory) -> Profile:
    from sim.profiling import run_profile

    prof, _ = run_profile(
        tmp_path_factory.mktemp("profile"), degrees=(1, 2, 4), seed=0, measure_kappas=True
    )
    return prof


@pytest.fixture(scope="session")
def steady_workload() -> Workload:
    """~130 requests over 60 s, one steady phase (shared system prompts, sessions, documents)."""
    return generate(SyntheticConfig(duration_s=60.0, rate=4.0, phases=()), seed=0)


@pytest.fixture(scope="session")
def phased_workload() -> Workload:
    """~960 requests: 100 s calm, then 100 s heavy."""
    return generate(CALM_THEN_HEAVY, seed=0)


@pytest.fixture(scope="session")
def conversation_workload() -> Workload:
    """The first 300 requests of the Mooncake conversation trace (real prefix sharing)."""
    path = default_traces_dir() / "mooncake" / "conversation_trace.jsonl"
    if not path.is_file():
        pytest.skip(f"trace not available: {path}")
    return read_mooncake(path, max_requests=300, seed=0)
