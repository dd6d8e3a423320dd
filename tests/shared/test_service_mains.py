"""A service started with settings it cannot run with exits 2 with one line naming the
problem (no traceback), before it connects anywhere: real processes, as an operator starts
them (``python -m services.<name>``, ``vertumnus rankd``; the NATS URL points nowhere, it is
never reached)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("module", "env", "message"), [
    ("services.controller", {"VTM_DEGREES": "[3]"},
     "vtm-controller: cannot start: every degree must be a power of two >= 1, got 3"),
    ("services.controller", {"VTM_NUM_GPUS": "6", "VTM_DEGREES": "[4]"},
     "num_gpus=6 is not a multiple of the smallest degree 4"),
    ("services.controller", {"VTM_KIND": "tp"}, "kind 'tp' needs adaptive false"),
    ("services.scheduler", {"VTM_POLICY": "nosuch"},
     "vtm-scheduler: cannot start: unknown policy 'nosuch'"),
    ("vertumnus rankd", {"VTM_HEARTBEAT_S": "-1"},
     "VTM_HEARTBEAT_S: Input should be greater than 0 (got '-1')"),
], ids=["degree", "tiling", "tp-adaptive", "policy", "rankd-setting"])
def test_bad_settings_exit_2_with_one_line(module: str, env: dict[str, str],
                                           message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", *module.split()], cwd=REPO, capture_output=True, text=True,
        timeout=60, env={**os.environ, "VTM_NATS_URL": "nats://127.0.0.1:9", **env})
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr
