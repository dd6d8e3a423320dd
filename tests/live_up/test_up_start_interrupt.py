"""An interrupt during ``vertumnus up``'s start-up (its hardware profiling, or while the
services start) is an interruption like one during the replay: exit 130 after a line naming
the phase, the report and ``--json``, no child left. It used to exit 130 silently without the
JSON during the profiling, and to blame a missing controller ("no epoch record observed (no
controller running?)") during the health wait, before the controller is started at all.
Real ``vertumnus up`` processes, stopped within seconds of starting."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

import pytest
from live_up_support import REPO, alive, cli, kill_leftovers, wait_until


def _services_started(logs: Path) -> bool:
    try:
        return "gateway" in json.loads((logs / "pids.json").read_text())
    except (OSError, ValueError):
        return False


@pytest.mark.parametrize("when", ["profiling", "services"])
def test_an_interrupted_start_up_says_where_and_writes_its_json(
        tmp_path: Path, when: str, request: pytest.FixtureRequest) -> None:
    logs, err, out = tmp_path / "logs", tmp_path / "stderr.txt", tmp_path / "r.json"
    # Interrupted while the services start, up is given the profile it would fit first
    # (conftest.py): the same path past the fit, without waiting for it.
    profile = () if when == "profiling" else (
        "--profile", str(request.getfixturevalue("fitted_profile")))
    with open(err, "w") as fh:
        proc = subprocess.Popen(
            cli("up", "--duration", "60", "--time-scale", "0.05", *profile, "--log-dir",
                str(logs), "--no-progress", "--stop-timeout", "10", "--json", str(out)),
            cwd=REPO, stdout=subprocess.PIPE, stderr=fh, text=True)
    pids: dict[str, int] = {}
    try:
        if when == "profiling":
            wait_until(lambda: "profiling the modelled hardware" in err.read_text()
                       or proc.poll() is not None, "the profiling to start")
        else:
            wait_until(lambda: _services_started(logs) or proc.poll() is not None,
                       "the services to start")
            pids = {n: p for n, p in json.loads((logs / "pids.json").read_text()).items()
                    if n != "orchestrator"}
        assert proc.poll() is None, err.read_text()
        proc.send_signal(signal.SIGINT)
        stdout, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_leftovers(logs)
    text = " ".join(stdout.split())
    assert proc.returncode == 130, err.read_text() + stdout
    assert "interrupted during start-up: " in text and "no request was sent" in text, text
    assert "no controller running" not in text, text
    data = json.loads(out.read_text())
    assert data["interrupted"] is True and data["requests"] == 0
    assert data["interrupted_during"].startswith("start-up: "), data["interrupted_during"]
    if when == "profiling":
        assert "healthy:" not in err.read_text()
    else:
        assert "composition: no epoch record yet (interrupted during start-up" in text, text
        left = [n for n, p in pids.items() if alive(p)]
        assert not left, f"still running after the interrupt: {left}"
