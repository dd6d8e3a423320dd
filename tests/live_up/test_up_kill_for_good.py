"""``vertumnus up --kill-at S`` without ``--restart-after``: the killed service stays down for
the rest of the run, which is therefore no clean run. The report lists it
(``services_killed``, a "down at the end" line) and ``up`` exits 1 after the report, as for a
service that exited for good; it used to report ``services_down: []`` and exit 0 with most
requests failed. A real ``up`` on 40 requests."""

from __future__ import annotations

import json
from pathlib import Path

from live_up_support import kill_leftovers, run_cli


def test_a_kill_never_restarted_is_reported_and_exits_1(tmp_path: Path,
                                                       fitted_profile: Path) -> None:
    out, logs = tmp_path / "r.json", tmp_path / "logs"
    try:
        proc = run_cli(["up", "--max-requests", "40", "--duration", "60", "--time-scale",
                        "0.05", "--profile", str(fitted_profile),  # the fit it would make
                        "--kill-service", "controller", "--kill-at", "0.5",
                        "--log-dir", str(logs), "--json", str(out), "--no-progress",
                        "--stop-timeout", "10"])
    finally:
        kill_leftovers(logs)
    data = json.loads(out.read_text())
    assert [f["action"] for f in data["faults"] if f["service"] == "controller"] == ["kill"]
    assert data["services_killed"] == ["controller"] and data["services_down"] == []
    assert proc.returncode == 1, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split()) + " ".join(proc.stderr.split())
    assert "down at the end: controller (killed by --kill-at" in text, text
    assert "controller killed by --kill-at and never started again" in text, text
