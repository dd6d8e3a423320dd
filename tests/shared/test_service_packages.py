"""Every service package runs as ``python -m services.<name>``, rankd's as the other four:
its ``__main__`` is the service's main (``services.rankd`` had none; only
``python -m services.rankd.main`` ran a rank daemon)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "scheduler", "controller", "cachemgr", "rankd")


@pytest.mark.parametrize("name", SERVICES)
def test_each_service_package_has_a_main(name: str) -> None:
    assert importlib.util.find_spec(f"services.{name}.__main__") is not None


def test_python_m_services_rankd_runs_the_rank_daemon() -> None:
    """Its own main, checks first: a bad setting exits 2 with one line naming it (as
    ``python -m services.rankd.main`` does), before connecting anywhere."""
    proc = subprocess.run(
        [sys.executable, "-m", "services.rankd"], cwd=REPO, capture_output=True, text=True,
        timeout=60, env={**os.environ, "VTM_NATS_URL": "nats://127.0.0.1:9",
                         "VTM_HEARTBEAT_S": "-1"})
    assert proc.returncode == 2, proc.stderr
    assert "VTM_HEARTBEAT_S: Input should be greater than 0 (got '-1')" in proc.stderr
    assert "Traceback" not in proc.stderr
    helped = subprocess.run([sys.executable, "-m", "services.rankd", "--help"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "vertumnus rank daemon" in helped.stdout, helped.stderr
