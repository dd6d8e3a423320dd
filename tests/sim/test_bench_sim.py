"""bench/bench_sim.py times the run ``vertumnus simulate`` makes for one (policy, rate) cell: the
same profile (κ measured on the trace), the same spec and so the same result row. No timing is
asserted: the figures are for reading, not testing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from benchload import load_bench

from sim import runner
from sim.workloads import generate
from sim.workloads.synthetic import SyntheticConfig

COMPARED = ("requests", "completed", "mean_ttft_s", "p90_ttft_s", "slo_attainment", "hit_rate",
            "gpu_seconds", "reconfigurations", "replications")


def _mooncake_file(path: Path) -> Path:
    """A short built-in workload written as a Mooncake JSONL trace (ms timestamps; a trailing
    partial block gets an id of its own, as Mooncake's hash_ids have one per started block)."""
    wl = generate(SyntheticConfig(duration_s=120.0), seed=3)
    fresh = 1 << 40
    with path.open("w") as f:
        for r in wl.requests:
            hids = list(r.block_hashes)
            while len(hids) < -(-r.input_len // 512):
                fresh += 1
                hids.append(fresh)
            f.write(json.dumps({"timestamp": round(r.arrival_s * 1000),
                                "input_length": r.input_len, "output_length": r.output_len,
                                "hash_ids": hids}) + "\n")
    return path


@pytest.mark.slow
@pytest.mark.parametrize(("flags", "wait"), [((), None), (("--no-pull-wait",), False)])
def test_the_bench_runs_what_simulate_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           flags: tuple[str, ...], wait: bool | None) -> None:
    trace = _mooncake_file(tmp_path / "t.jsonl")
    mod = load_bench("bench_sim")
    rows = tmp_path / "rows.json"
    assert mod.main([str(trace), "--rate-scale", "1.5", "--gpus", "16", "--policies",
                     "vertumnus", "--rows", str(rows), *flags]) == 0
    out = capsys.readouterr().out
    assert "κ on the trace" in out and "req/wall-s" in out
    bench_row = json.loads(rows.read_text())["vertumnus"]["row"]
    runner.run_simulate(trace=str(trace), policies=["vertumnus"], rate_scales=[1.5], gpus=16,
                        degrees=(2, 4), seed=0, out=tmp_path / "sim", pull_wait=wait)
    sim_row = json.loads((tmp_path / "sim" / "results.json").read_text())[0]
    assert sim_row["requests"] > 100
    for key in COMPARED:
        assert bench_row[key] == sim_row[key], key
