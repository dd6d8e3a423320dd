"""The simulator CLI as a new user met it (review 2): failures in the main table, a profile of
other hardware, the composition plot, size's sentences and its target near the oracle, an
empty or reused --out, help at 80 columns and tune's ties."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sim import runner as sim_runner
from sim.metrics import parse_slo
from vertumnus.cli import app

SMALL = ["simulate", "--trace", "synthetic", "--gpus", "8", "--max-requests", "60"]
"""A run of seconds: the synthetic workload's first 60 requests on 8 GPUs."""


def _ok(result) -> str:
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    return " ".join(result.output.split())


def _refused(result, *words: str) -> str:
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    for w in words:
        assert w in text, (w, text)
    return text


# --- 1: failed requests in the main table ------------------------------------------------------
def test_failed_requests_show_in_the_table_with_one_policy(runner: CliRunner,
                                                           tmp_path: Path) -> None:
    """Two KV blocks per GPU cannot hold most requests: with vertumnus alone (no comparison
    table) the main table still says how many failed, and what its figures cover."""
    out = tmp_path / "o"
    text = _ok(runner.invoke(app, [*SMALL, "--policies", "vertumnus", "--cache-blocks-per-gpu",
                                   "2", "--out", str(out)]))
    (row,) = json.loads((out / "results.json").read_text())
    assert row["failed"] > 0
    assert f"failed requests: vertumnus ×1 {row['failed']} of {row['requests']}" in text
    assert "the TTFT columns are over the completed requests" in text
    assert "the oracle over all measured requests (failed ones included)" in text


def test_table_without_failures_has_no_failure_line() -> None:
    row = {"policy": "homo", "rate_scale": 1.0, "request_rate": 2.0, "requests": 10,
           "failed": 0, "mean_ttft_s": 0.5, "p50_ttft_s": 0.5, "p90_ttft_s": 0.6,
           "p99_ttft_s": 0.7, "slo_attainment": 1.0, "hit_rate": 0.1, "reconfigurations": 0,
           "oracle_mean_ttft_s": 0.4}
    buf = io.StringIO()
    sim_runner.print_table({"rows": [row], "meta": {}, "comparison": []}, buf)
    assert "failed" in buf.getvalue()  # the column
    assert "failed requests" not in buf.getvalue()


# --- 2: a profile of other hardware --------------------------------------------------------------
@pytest.fixture
def h200_profile(tmp_path: Path, profile_file: Path) -> Path:
    """The session's profile as if fitted on H200 (what `profile --hardware h200.toml` records)."""
    data = json.loads(profile_file.read_text())
    assert data["hardware"] == "H20"
    data["hardware"] = "H200"
    path = tmp_path / "h200_profile.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("cmd", [
    [*SMALL, "--policies", "vertumnus"],
    ["tune", "--max-requests", "60", "--gpus", "8", "--beta", "1", "--lam", "0"],
    ["size", "--max-requests", "60", "--policies", "vertumnus", "--gpus-max", "8"],
])
def test_a_profile_of_other_hardware_is_refused(runner: CliRunner, tmp_path: Path,
                                                h200_profile: Path, no_runs: None,
                                                cmd: list[str]) -> None:
    out = tmp_path / "o"
    _refused(runner.invoke(app, [*cmd, "--profile", str(h200_profile), "--out", str(out)]),
             "error:", str(h200_profile), "GPU 'H200' (the run's: 'H20')",
             "--profile-mismatch-ok")
    assert not out.exists()  # refused before anything was written


def test_profile_mismatch_ok_runs_with_it(runner: CliRunner, tmp_path: Path,
                                          h200_profile: Path) -> None:
    out = tmp_path / "o"
    _ok(runner.invoke(app, [*SMALL, "--policies", "vertumnus", "--profile", str(h200_profile),
                            "--profile-mismatch-ok", "--out", str(out)]))
    assert json.loads((out / "meta.json").read_text())["profile"]["hardware"] == "H200"


# --- 4: the composition plot ----------------------------------------------------------------------
def test_composition_runs_to_the_end_and_the_oracle_is_drawn_with_one_rate(
        runner: CliRunner, tmp_path: Path, profile_file: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A run without a reconfiguration records its composition to the run's end (not the
    start alone, which drew an empty frame), and with one rate the oracle has a marker."""
    import matplotlib.pyplot as plt

    figs: list = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figures to look at them
    out = tmp_path / "o"
    _ok(runner.invoke(app, [*SMALL, "--policies", "vertumnus", "--profile", str(profile_file),
                            "--out", str(out)]))
    meta = json.loads((out / "meta.json").read_text())
    (tl,) = meta["timelines"].values()
    assert tl[-1][0] > tl[0][0] and tl[-1][1] == tl[0][1]
    lines = {ln.get_label(): ln for f in figs for ax in f.axes for ln in ax.get_lines()}
    oracle = lines["oracle (zero queue)"]
    assert len(oracle.get_xdata()) == 1 and oracle.get_marker() not in (None, "", "None")
    comp = lines["×1"]
    assert max(comp.get_xdata()) == pytest.approx(tl[-1][0])


def test_composition_colours_differ_past_ten_rates(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import matplotlib.pyplot as plt

    figs: list = []
    monkeypatch.setattr(plt, "close", figs.append)
    timelines = {str(float(s)): [[0.0, {"2": 4, "4": 2}], [10.0 + s, {"2": 4, "4": 2}]]
                 for s in range(1, 14)}
    sim_runner._plot_composition(tmp_path, timelines)
    (fig,) = figs
    for ax in fig.axes:
        colours = [tuple(ln.get_color()) for ln in ax.get_lines()]
        assert len(colours) == 13 and len(set(colours)) == 13


# --- 8, 9: size ----------------------------------------------------------------------------------
def test_size_says_nothing_of_baselines_it_did_not_run() -> None:
    summary = {"policies": [{"policy": "vertumnus", "gpus": 12, "points": []}],
               "meta": {"workload": "w", "rate_scale": 1.0, "target": 0.5, "sizes": [4, 16]}}
    buf = io.StringIO()
    sim_runner.print_size_table(summary, buf)
    text = " ".join(buf.getvalue().split())
    assert "no baseline meets" not in text
    assert "vertumnus needs 12 GPUs (no baseline was run" in text


def test_size_searches_a_target_just_above_the_oracle(tmp_path: Path,
                                                      profile_file: Path) -> None:
    """The noise-free oracle's attainment is no hard ceiling: a target a few tenths above it
    is searched, with a warning; one well above it is still refused."""
    from sim.groundtruth import GroundTruth
    from sim.runner import load_trace, oracle_attainment

    slo = parse_slo("2048:0.4,inf:1.5")
    wl = load_trace("synthetic", "auto", seed=0, rate=None, max_requests=100)
    ceiling = oracle_attainment(wl, GroundTruth(), (2, 4), slo)
    assert ceiling < 0.99
    warned: list[str] = []
    target = ceiling + sim_runner.ORACLE_NOISE_MARGIN / 2
    summary = sim_runner.run_size(trace="synthetic", policies=["homo"], rate_scale=1.0,
                                  target=target, gpus_max=8, max_requests=100,
                                  out=tmp_path / "a", profile_path=profile_file, slo=slo,
                                  on_warning=warned.append)
    assert len(warned) == 1 and "searched anyway" in warned[0]
    assert summary["meta"]["above_oracle"] == warned[0]
    buf = io.StringIO()
    sim_runner.print_size_table(summary, buf)
    assert "searched anyway" in " ".join(buf.getvalue().split())
    with pytest.raises(sim_runner.InvalidInput, match="zero-queue oracle"):
        sim_runner.run_size(trace="synthetic", policies=["homo"], rate_scale=1.0,
                            target=ceiling + 2 * sim_runner.ORACLE_NOISE_MARGIN, gpus_max=8,
                            max_requests=100, out=tmp_path / "b", profile_path=profile_file,
                            slo=slo)


# --- 10: --out, stale files, help, tune ----------------------------------------------------------
@pytest.mark.parametrize("cmd", [SMALL, ["tune"], ["size"], ["profile"]])
def test_an_empty_out_is_refused(runner: CliRunner, tmp_path: Path, no_runs: None,
                                 monkeypatch: pytest.MonkeyPatch, cmd: list[str]) -> None:
    monkeypatch.chdir(tmp_path)
    _refused(runner.invoke(app, [*cmd, "--out", ""]), "error: --out ''", "empty path")
    assert list(tmp_path.iterdir()) == []


def test_a_reused_out_loses_an_earlier_reconfig_runs_files(runner: CliRunner, tmp_path: Path,
                                                           profile_file: Path) -> None:
    out = tmp_path / "o"
    out.mkdir()
    for name in ("reconfig.json", "reconfig.png"):
        (out / name).write_text("an earlier run's")
    _ok(runner.invoke(app, [*SMALL, "--policies", "vertumnus", "--profile", str(profile_file),
                            "--out", str(out)]))
    assert not (out / "reconfig.json").exists() and not (out / "reconfig.png").exists()


def test_report_redraws_the_reconfig_plot(tmp_path: Path) -> None:
    row = {"policy": "vertumnus", "rate_scale": 1.0, "request_rate": 2.0, "mean_ttft_s": 0.5,
           "p50_ttft_s": 0.5, "p90_ttft_s": 0.6, "p99_ttft_s": 0.7, "slo_attainment": 1.0,
           "hit_rate": 0.1, "reconfigurations": 1, "oracle_mean_ttft_s": 0.4}
    tl = [[0.0, {"2": 4}], [150.0, {"2": 2, "4": 1}]]
    meta = {"workload": "reconfig", "gpus": 8, "degrees": [2, 4],
            "phase_bounds": [[0, 100], [100, 200]],
            "phase_mean_ttft_s": {"vertumnus": [0.5, 0.6], "4CP2": [0.5, 0.7]},
            "timelines": {"1.0": tl}, "all_timelines": {"vertumnus": tl, "4CP2": [tl[0]]}}
    (tmp_path / "results.json").write_text(json.dumps([row, {**row, "policy": "4CP2"}]))
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    sim_runner.redraw(tmp_path)
    assert (tmp_path / "reconfig.png").stat().st_size > 0


_CUT = re.compile(r"…\s*│")
"""rich's mark of a cell cut short: an ellipsis at the cell's end."""


@pytest.mark.parametrize("cmd", ["profile", "simulate", "tune", "size"])
def test_help_at_80_columns_cuts_nothing(cmd: str) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "COLUMNS": "80", "TERMINAL_WIDTH": "80"}
    got = subprocess.run([sys.executable, "-m", "vertumnus", cmd, "--help"], env=env,
                         capture_output=True, text=True, check=True).stdout
    assert max(len(line) for line in got.splitlines()) <= 80
    assert not _CUT.search(got), got
    if cmd == "simulate":
        assert "--cache-blocks-per-gpu " in got
    if cmd == "profile":  # its --rate help names only options it has
        assert "--max-requests" not in got and "--rate-scale" not in got


def test_tune_says_when_every_setting_ties(runner: CliRunner, tmp_path: Path,
                                           profile_file: Path) -> None:
    """A pool of one worker (4 GPUs, degree 4) places every request the same whatever J's
    weights: no pair is best, and tune says so instead of announcing the tie-break's pick as
    a finding."""
    out = tmp_path / "t"
    text = _ok(runner.invoke(app, [
        "tune", "--max-requests", "20", "--gpus", "4", "--degrees", "4", "--beta", "1,2",
        "--lam", "0,1",
        "--rate-scale", "1", "--profile", str(profile_file), "--out", str(out)]))
    pairs = json.loads((out / "tune.json").read_text())["pairs"]
    assert len({(p["mean_ttft_s"], p["p90_ttft_s"]) for p in pairs}) == 1
    assert "all 4 settings tie" in text and "picked β 1, λ 0 by the tie-break" in text
    assert "best:" not in text
