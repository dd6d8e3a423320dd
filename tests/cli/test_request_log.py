"""``vertumnus simulate --requests``: each run's per-request log (sim/request_log.py) agrees
with the run's results row, is the same with cells in other processes, and is refused where no
log is written."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from shared.ids import InvalidInput
from sim import runner as sim_runner
from sim.metrics import QWEN3_SLO, slo_attainment
from sim.request_log import REQUEST_KEYS, log_name
from vertumnus.cli import app


def _read(path: Path) -> list[dict[str, str]]:
    with path.open() as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def logged(tmp_path_factory, profile_file: Path) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("requests")
    summary = sim_runner.run_simulate(trace="synthetic", policies=["vertumnus", "homo"],
                                  rate_scales=[1.0, 2.0], gpus=8, max_requests=300,
                                  warmup_s=20.0, out=out, profile_path=profile_file,
                                  request_log=True)
    return out, summary


def test_each_cell_writes_a_log_that_adds_up_to_its_row(logged) -> None:
    out, summary = logged
    assert summary["meta"]["request_log"] == "requests"
    names = sorted(p.name for p in (out / "requests").iterdir())
    assert names == sorted(log_name(r["policy"], r["rate_scale"], 0) for r in summary["rows"])
    for row in summary["rows"]:
        log = _read(out / "requests" / log_name(row["policy"], row["rate_scale"], 0))
        assert list(log[0]) == list(REQUEST_KEYS) and len(log) == 300
        measured = [r for r in log if r["warmup"] == "False"]
        assert len(log) - len(measured) == row["warmup_requests"] > 0
        done = [r for r in measured if not r["failed"]]
        ttft = np.array([float(r["ttft_s"]) for r in done])
        assert ttft.mean() == pytest.approx(row["mean_ttft_s"], rel=1e-12)
        assert np.percentile(ttft, 90) == pytest.approx(row["p90_ttft_s"], rel=1e-12)
        for part in ("queue", "prefill", "handoff"):  # the row's split of the mean
            mean = np.mean([float(r[f"{part}_s"]) for r in done])
            assert mean == pytest.approx(row[f"{part}_s_mean"], abs=1e-9)
        for r in done:
            parts = float(r["queue_s"]) + float(r["prefill_s"]) + float(r["handoff_s"])
            assert parts == pytest.approx(float(r["ttft_s"]), abs=1e-9)
            assert min(float(r["queue_s"]), float(r["prefill_s"]), float(r["handoff_s"])) >= 0
            assert (r["met_slo"] == "True") == (float(r["ttft_s"]) <= float(r["deadline_s"]))
        lens = np.array([float(r["input_len"]) for r in measured])
        t = np.array([float(r["ttft_s"]) if r["ttft_s"] else np.inf for r in measured])
        assert slo_attainment(lens, t, QWEN3_SLO) == pytest.approx(row["slo_attainment"])
        reused = sum(int(r["reused_tokens"]) for r in done)
        assert reused / sum(int(r["input_len"]) for r in done) == pytest.approx(row["hit_rate"])


def test_the_logs_are_the_same_with_cells_in_other_processes(logged, tmp_path,
                                                             profile_file) -> None:
    out, _ = logged
    sim_runner.run_simulate(trace="synthetic", policies=["vertumnus", "homo"],
                        rate_scales=[1.0, 2.0], gpus=8, max_requests=300, warmup_s=20.0,
                        out=tmp_path, profile_path=profile_file, request_log=True, jobs=2)
    # The same logs, no more, no fewer: a log only the jobs=2 run wrote would show here.
    names = sorted(p.name for p in (out / "requests").iterdir())
    assert sorted(p.name for p in (tmp_path / "requests").iterdir()) == names
    for name in names:
        again = (tmp_path / "requests" / name).read_text()
        assert again == (out / "requests" / name).read_text(), name


def test_the_summary_carries_the_comparison_it_wrote(logged) -> None:
    out, summary = logged
    written = json.loads((out / "comparison.json").read_text())
    assert [c["rate_scale"] for c in summary["comparison"]] == [1.0, 2.0]
    assert json.loads(json.dumps(summary["comparison"])) == written
    again = sim_runner.redraw(out)
    assert json.loads(json.dumps(again["comparison"])) == written


def test_no_log_unless_asked_and_refused_where_none_is_written(runner: CliRunner,
                                                               tmp_path: Path) -> None:
    res = runner.invoke(app, ["simulate", "--preset", "reconfig", "--requests",
                              "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert "--requests" in res.output and "reconfig" in res.output
    assert not (tmp_path / "o").exists()
    with pytest.raises(InvalidInput, match="per-request log"):
        sim_runner.run_preset("ablation", out=tmp_path / "a", request_log=True)
    with pytest.raises(InvalidInput, match="--requests"):
        sim_runner.run_simulate(trace="synthetic", policies=["homo"], rate_scales=[1.0],
                            out=tmp_path / "b", request_log="yes")  # type: ignore[arg-type]


def test_simulate_cli_writes_the_logs_only_with_the_flag(runner: CliRunner, tmp_path: Path,
                                                         profile_file: Path) -> None:
    args = ["simulate", "--policies", "homo", "--gpus", "8", "--max-requests", "100",
            "--profile", str(profile_file)]
    res = runner.invoke(app, [*args, "--out", str(tmp_path / "no")])
    assert res.exit_code == 0, res.output
    assert not (tmp_path / "no" / "requests").exists()
    assert json.loads((tmp_path / "no" / "meta.json").read_text())["request_log"] is None
    res = runner.invoke(app, [*args, "--requests", "--out", str(tmp_path / "yes")])
    assert res.exit_code == 0, res.output
    assert "per-request logs in" in res.output
    assert len(_read(tmp_path / "yes" / "requests" / "homo_x1_seed0.csv")) == 100


def test_a_reused_out_holds_only_this_runs_request_logs(runner: CliRunner, tmp_path: Path,
                                                        profile_file: Path) -> None:
    """Each run's DIR/requests/ is that run's alone. Before, a later run into the same --out
    left an earlier run's logs there: another policy's (or rate's) beside its own, or every
    one of them after a run without --requests, none of which matched results.json."""
    out = tmp_path / "o"
    args = ["simulate", "--gpus", "8", "--max-requests", "100", "--profile", str(profile_file),
            "--out", str(out)]

    def logs() -> list[str]:
        return sorted(p.name for p in (out / "requests").iterdir())

    def rows_logs() -> list[str]:
        rows = json.loads((out / "results.json").read_text())
        return sorted(log_name(r["policy"], r["rate_scale"], 0) for r in rows)

    res = runner.invoke(app, [*args, "--policies", "homo,static", "--rate-scale", "1,2",
                              "--requests"])
    assert res.exit_code == 0, res.output
    assert logs() == rows_logs() and len(logs()) == 4
    res = runner.invoke(app, [*args, "--policies", "homo", "--requests"])
    assert res.exit_code == 0, res.output
    assert logs() == rows_logs() == ["homo_x1_seed0.csv"]
    res = runner.invoke(app, [*args, "--policies", "homo"])
    assert res.exit_code == 0, res.output
    assert not (out / "requests").exists()
    # Only our logs go: a file of the user's in requests/ stays, and so does the directory.
    (out / "requests").mkdir()
    (out / "requests" / "notes.txt").write_text("mine\n")
    (out / "requests" / "static_x2_seed0.csv").write_text("stale\n")
    res = runner.invoke(app, [*args, "--policies", "homo"])
    assert res.exit_code == 0, res.output
    assert logs() == ["notes.txt"]


def test_a_records_split_adds_up_to_its_ttft() -> None:
    from sim.simulator import RequestRecord

    rec = RequestRecord("r", arrival_s=1.0, input_len=4096, start_s=1.25, finish_s=2.0,
                        ttft_s=1.5)
    assert (rec.queue_s, rec.prefill_s) == (0.25, 0.75)
    assert rec.handoff_s == pytest.approx(0.5)
    assert rec.queue_s + rec.prefill_s + rec.handoff_s == pytest.approx(rec.ttft_s)
