"""``vertumnus up``'s first line says what the run will do: with ``--serve`` nothing is
replayed, so it names no request count or replay length (it used to announce the default
workload's, e.g. "388 requests over 240 modelled s", for a stack that only serves)."""

from __future__ import annotations

from pathlib import Path

from vertumnus.live.stack import UpConfig, up_banner


def test_a_replay_announces_its_requests_and_length() -> None:
    line = up_banner(UpConfig(duration_s=60.0, time_scale=0.1), 60, Path("logs"))
    assert line.startswith("vertumnus up: 8 GPUs, degrees [2, 4], policy vertumnus, backend sim")
    assert "60 requests over 60 modelled s at time scale 0.1 (≈6 s wall); logs logs" in line


def test_serve_announces_no_replay() -> None:
    line = up_banner(UpConfig(serve=True), 388, Path("logs"))
    assert "no replay (--serve)" in line and "time scale 0.1" in line
    assert "requests" not in line and "modelled s" not in line and "wall" not in line
