"""The GPU check script (services/rankd/engine/cuda_check.py) is ready for a machine with a
GPU: it imports and runs here; without CUDA it fails (exit 2) with a clear message instead of
reading as a pass, and ``--cpu-dry-run`` exercises its zigzag, model, page-pool and
decode-role checks on CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services.rankd.engine import cuda_check

REPO = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.rankd.engine.cuda_check", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_without_cuda_it_fails_with_a_clear_message() -> None:
    proc = run()
    assert proc.returncode == cuda_check.NO_DEVICE == 2, proc.stdout + proc.stderr
    assert "FAILED: no CUDA device available" in proc.stderr
    assert "--cpu-dry-run" in proc.stderr and "[ok]" not in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cpu_dry_run_runs_the_checks() -> None:
    proc = run("--cpu-dry-run", "--lengths", "32")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[ok] sdpa_mask zigzag chunks" in proc.stdout
    assert "[ok] C=1 model prefill" in proc.stdout and "R=    32" in proc.stdout
    assert "[ok] page pool on cpu" in proc.stdout
    assert "[ok] decode role on cpu" in proc.stdout
