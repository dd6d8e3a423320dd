"""``vertumnus report DIR`` on a directory that holds both a ``simulate`` run's results.json
and a ``size`` run's size.json (``size --out D`` after ``simulate --out D``, or the other
way round) is refused, exit 2 naming both files, nothing written. It redrew the
results.json silently: after ``size`` had written into D, ``report D`` printed the earlier
simulate run's table as D's."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from vertumnus.cli import app


def _results_row(policy: str) -> dict[str, object]:
    return {"policy": policy, "rate_scale": 1.0, "request_rate": 5.0, "mean_ttft_s": 0.5,
            "p50_ttft_s": 0.4, "p90_ttft_s": 0.9, "p99_ttft_s": 1.2, "slo_attainment": 0.9,
            "hit_rate": 0.3, "reconfigurations": 0, "oracle_mean_ttft_s": 0.3}


def _size_summary() -> dict[str, object]:
    point = {"gpus": 8, "slo_attainment": 0.95, "mean_ttft_s": 0.4, "p90_ttft_s": 0.7,
             "hit_rate": 0.3, "gpu_seconds": 60.0, "reconfigurations": 0, "failed": 0}
    return {"meta": {"workload": "w", "rate_scale": 1.0, "target": 0.9, "sizes": [8],
                     "degrees": [2, 4]},
            "policies": [{"policy": "vertumnus", "gpus": 8, "points": [point]}]}


def test_a_directory_of_both_a_simulate_and_a_size_run_is_refused(tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text(json.dumps([_results_row("vertumnus")]))
    (tmp_path / "size.json").write_text(json.dumps(_size_summary()))
    res = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2, res.output
    text = " ".join(res.output.split())
    assert "results.json" in text and "size.json" in text, text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "size.json"]


def test_either_alone_is_redrawn(tmp_path: Path) -> None:
    sim, size = tmp_path / "sim", tmp_path / "size"
    sim.mkdir()
    size.mkdir()
    (sim / "results.json").write_text(json.dumps([_results_row("vertumnus")]))
    (size / "size.json").write_text(json.dumps(_size_summary()))
    for d, made in ((sim, "results.csv"), (size, "size.csv")):
        res = CliRunner().invoke(app, ["report", str(d)])
        assert res.exit_code == 0, res.output
        assert (d / made).is_file()
