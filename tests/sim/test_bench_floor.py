"""bench/bench_sim_floor.py runs on the built-in workload and reports every stage (no timing is
asserted: the figures are for reading, not testing)."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchload import load_bench


def test_floor_reports_every_stage_on_the_synthetic_workload(
        capsys: pytest.CaptureFixture[str]) -> None:
    mod = load_bench("bench_sim_floor")
    assert mod.main(["synthetic", "--repeat", "1", "--workers", "4", "--cache-blocks", "64"]) == 0
    out = capsys.readouterr().out
    for stage in mod.STAGES:
        assert f"  {stage} " in out
    assert "skeleton:" in out and "req/wall-s" in out


def test_skeleton_gives_one_non_negative_time_per_stage() -> None:
    mod = load_bench("bench_sim_floor")
    reqs = [(0.1 * i, (1, 2, 3 + i % 5), 1500) for i in range(200)]
    times = mod.skeleton(reqs, 3, 8)
    assert len(times) == len(mod.STAGES)
    assert all(t >= 0.0 for t in times)


def test_missing_trace_is_a_clear_error(capsys: pytest.CaptureFixture[str],
                                        tmp_path: Path) -> None:
    mod = load_bench("bench_sim_floor")
    assert mod.main([str(tmp_path / "nope.jsonl")]) == 2
    assert "trace not found" in capsys.readouterr().err
