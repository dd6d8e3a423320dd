"""``bench/bench_sim_vs_live.py``'s workload: the built-in steady phase, or a synthetic workload
file's phases (``--workload``), scaled to the demand ρ asked for. The live comparison itself is
a benchmark (it prints figures and is not run here)."""

from __future__ import annotations

from pathlib import Path

import pytest
from benchload import load_bench

from sim.workloads import generate
from sim.workloads.synthetic import Phase, SyntheticConfig
from sim.workloads.synthetic_file import config_to_toml


def test_a_workload_file_keeps_its_phases_and_is_scaled_to_the_load() -> None:
    b = load_bench("bench_sim_vs_live")
    cfg = SyntheticConfig(duration_s=120.0, rate=3.0, phases=(
        Phase(60.0, 2.0, 0.0), Phase(60.0, 0.5, 0.3)))
    base = generate(cfg, seed=0)
    wl, rho = b.workload_at(0.4, 999.0, 0, 0.0, cfg)  # duration and long share: the file's
    assert rho == pytest.approx(0.4, rel=1e-6)
    assert [r.input_len for r in wl.requests] == [r.input_len for r in base.requests]
    # Scaling compresses the arrivals evenly: the phases keep their order and shares.
    f = (wl.requests[-1].arrival_s - wl.requests[0].arrival_s) \
        / (base.requests[-1].arrival_s - base.requests[0].arrival_s)
    assert f == pytest.approx(b.demand_rho(base) / 0.4, rel=1e-6)
    steady, _ = b.workload_at(0.4, 120.0, 0, 0.0)
    assert len(steady.requests) != len(wl.requests)  # the file's phases, not the steady one


def test_a_bad_workload_file_is_named(tmp_path: Path) -> None:
    b = load_bench("bench_sim_vs_live")
    bad = tmp_path / "w.toml"
    bad.write_text(config_to_toml(SyntheticConfig()).replace("rate = ", "rate_x = ", 1))
    with pytest.raises(SystemExit, match=r"--workload .*w\.toml: .*rate_x"):
        b.main(["--workload", str(bad)])
    with pytest.raises(SystemExit, match="not found"):
        b.main(["--workload", str(tmp_path / "missing.toml")])


def test_the_live_replay_starts_on_the_simulators_window_grid() -> None:
    """The wait puts the workload's time 0 (its first request is sent ``first`` wall seconds
    after it) on a multiple of the live window since the Unix epoch."""
    b = load_bench("bench_sim_vs_live")
    h = 10.0
    for now in (1_796_478_403.25, 1_796_478_410.0, 1_796_478_419.999):
        for first in (0.0, 0.4, 3.0, 25.0):
            wait = b.window_aligned_delay(now, first, h)
            assert 0.0 <= wait < h
            zero = now + wait - first  # wall time of the workload's time 0
            assert zero / h == pytest.approx(round(zero / h), abs=1e-9)
