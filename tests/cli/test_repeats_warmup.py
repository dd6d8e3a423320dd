"""``simulate --repeats N`` (the mean over seeds, §9.1's three runs) and ``--warmup S`` (requests
run but not counted): the pure combination, the row filter, the sweep, the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from shared.ids import InvalidInput
from sim import runner
from sim.experiments import REPEAT_METRICS, ExperimentSpec, combine_repeats, summarize_run
from sim.metrics import QWEN3_SLO
from sim.simulator import RequestRecord, SimConfig
from vertumnus.cli import app


def _row(policy: str, scale: float, **figures: object) -> dict[str, object]:
    return {"policy": policy, "rate_scale": scale, "variant": policy, **figures}


# --- combine_repeats (pure) --------------------------------------------------------------------
def test_combine_repeats_takes_the_mean_of_each_figure_and_keeps_every_run() -> None:
    a = [_row("vertumnus", 1.0, mean_ttft_s=1.0, requests=100, completed=100, failed=0,
              drain_s_mean=None, composition_start={"2": 4},
              per_degree={"2": {"requests": 60, "mean_ttft_s": 0.5},
                          "4": {"requests": 40, "mean_ttft_s": 2.0}}),
         _row("homo", 1.0, mean_ttft_s=3.0, requests=100, completed=100, failed=0,
              drain_s_mean=None, composition_start={"4": 2}, per_degree={})]
    b = [_row("homo", 1.0, mean_ttft_s=5.0, requests=100, completed=99, failed=1,
              drain_s_mean=None, composition_start={"4": 2}, per_degree={}),
         _row("vertumnus", 1.0, mean_ttft_s=2.0, requests=100, completed=98, failed=2,
              drain_s_mean=4.0, composition_start={"2": 2, "4": 1},
              per_degree={"2": {"requests": 100, "mean_ttft_s": 1.5}})]
    rows = combine_repeats([a, b], [7, 8])
    assert [r["policy"] for r in rows] == ["vertumnus", "homo"]  # the first seed's order
    v, h = rows
    assert v["mean_ttft_s"] == 1.5 and h["mean_ttft_s"] == 4.0
    assert v["requests"] == 100 and isinstance(v["requests"], int)  # equal counts stay ints
    assert v["completed"] == 99.0 and v["failed"] == 1.0
    assert v["drain_s_mean"] == 4.0  # a seed without the figure is skipped
    assert h["drain_s_mean"] is None
    assert v["composition_start"] == {"2": 4}  # a composition is the first seed's
    # per degree, key by key; a degree one seed never used counts only where it was used
    assert v["per_degree"] == {"2": {"requests": 80.0, "mean_ttft_s": 1.0},
                               "4": {"requests": 40, "mean_ttft_s": 2.0}}
    assert v["seeds"] == [7, 8]
    assert [r["seed"] for r in v["runs"]] == [7, 8]
    assert [r["mean_ttft_s"] for r in v["runs"]] == [1.0, 2.0]
    assert [r["completed"] for r in v["runs"]] == [100, 98]
    assert set(REPEAT_METRICS) <= set(v["runs"][0])


def test_combine_repeats_of_one_seed_is_that_sweep() -> None:
    a = [_row("homo", 2.0, mean_ttft_s=0.7, slo_attainment=0.9, reconfigurations=0)]
    (row,) = combine_repeats([a], [3])
    assert {k: row[k] for k in a[0]} == a[0]
    assert row["seeds"] == [3] and row["runs"][0]["mean_ttft_s"] == 0.7


def test_combine_repeats_rejects_sweeps_that_differ() -> None:
    a = [_row("homo", 1.0, mean_ttft_s=1.0)]
    with pytest.raises(InvalidInput, match="same"):
        combine_repeats([a, [_row("homo", 2.0, mean_ttft_s=1.0)]], [0, 1])
    with pytest.raises(InvalidInput, match="seeds"):
        combine_repeats([a, a], [0])
    with pytest.raises(InvalidInput, match="repeats"):
        combine_repeats([a + a], [0])


# --- the warm-up filter ------------------------------------------------------------------------
def _rec(i: int, arrival: float, ttft: float, length: int = 1000,
         reused: int = 0) -> RequestRecord:
    # Of its TTFT, a tenth queued, 80% prefill, a tenth hand-off.
    return RequestRecord(request_id=f"r{i}", arrival_s=arrival, input_len=length, ttft_s=ttft,
                         reused_tokens=reused, degree=2, predicted_s=0.1, actual_s=0.1,
                         start_s=arrival + 0.1 * ttft, finish_s=arrival + 0.9 * ttft)


def _result(recs: list[RequestRecord]) -> object:
    return SimpleNamespace(records=recs, reconfigurations=[], gpu_seconds=12.0, replications=0,
                           reclamations=0, pulls=0, copy_waits=0, copy_wait_s=0.0,
                           workload_name="w", config=SimConfig(),
                           composition_timeline=[(0.0, {2: 4})])


def test_summarize_run_leaves_the_warm_up_out_of_every_per_request_figure() -> None:
    # Cold caches make the first requests slow: 10 s TTFTs, then 0.5 s ones.
    recs = [_rec(i, 10.0 + i, 10.0) for i in range(5)] + \
        [_rec(i, 10.0 + i, 0.5, reused=500) for i in range(5, 15)]
    kw = dict(policy="p", rate_scale=1.0, slo=QWEN3_SLO, wall_s=1.0)
    full = summarize_run(_result(recs), oracle=np.full(15, 0.4), **kw)
    warm = summarize_run(_result(recs), oracle=np.full(10, 0.4), warmup_s=5.0, **kw)
    assert full["requests"] == 15 and full["warmup_requests"] == 0
    assert warm["requests"] == warm["completed"] == 10 and warm["warmup_requests"] == 5
    assert warm["mean_ttft_s"] == 0.5 and warm["p99_ttft_s"] == 0.5
    assert (warm["queue_s_mean"], warm["prefill_s_mean"], warm["handoff_s_mean"]) == \
        pytest.approx((0.05, 0.4, 0.05))
    assert full["queue_s_mean"] == pytest.approx(0.1 * full["mean_ttft_s"])
    assert full["mean_ttft_s"] == pytest.approx((5 * 10.0 + 10 * 0.5) / 15)
    assert warm["slo_attainment"] == 1.0 and full["slo_attainment"] == pytest.approx(10 / 15)
    assert warm["hit_rate"] == 0.5
    assert warm["request_rate"] == pytest.approx(10 / 9)  # 10 arrivals over 15 s … 24 s
    assert warm["gpu_seconds"] == full["gpu_seconds"] == 12.0  # the whole run's


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, True, "5"])
def test_a_warm_up_that_is_no_duration_is_rejected(bad: object) -> None:
    with pytest.raises(InvalidInput, match="warm-up"):
        ExperimentSpec(warmup_s=bad)  # type: ignore[arg-type]


# --- the sweep ---------------------------------------------------------------------------------
def _simulate(tmp_path: Path, profile_file: Path, name: str, **kw: object) -> dict:
    args: dict[str, object] = dict(trace="synthetic", policies=["vertumnus", "homo"],
                                   rate_scales=[1.0, 2.0], gpus=8, degrees=(2, 4),
                                   max_requests=150, profile_path=profile_file,
                                   out=tmp_path / name)
    args.update(kw)
    return runner.run_simulate(**args)  # type: ignore[arg-type]


def test_repeats_report_the_mean_of_the_seeds_own_runs(tmp_path: Path,
                                                       profile_file: Path) -> None:
    rep = _simulate(tmp_path, profile_file, "rep", seed=4, repeats=2)
    one = {sd: _simulate(tmp_path, profile_file, f"s{sd}", seed=sd) for sd in (4, 5)}
    assert rep["meta"]["seeds"] == [4, 5]
    assert [(r["policy"], r["rate_scale"]) for r in rep["rows"]] == \
        [(r["policy"], r["rate_scale"]) for r in one[4]["rows"]]
    for i, row in enumerate(rep["rows"]):
        # Each seed's run is exactly the sweep run alone with that seed...
        for run in row["runs"]:
            alone = one[run["seed"]]["rows"][i]
            assert {m: run[m] for m in REPEAT_METRICS} == {m: alone[m] for m in REPEAT_METRICS}
        # ...and the row is their mean.
        for m in ("mean_ttft_s", "p90_ttft_s", "slo_attainment", "hit_rate", "gpu_seconds"):
            assert row[m] == pytest.approx(np.mean([one[sd]["rows"][i][m] for sd in (4, 5)]))
    # The seeds draw different arrivals and noise: the runs differ.
    assert any(len({run["mean_ttft_s"] for run in row["runs"]}) == 2 for row in rep["rows"])
    saved = json.loads((tmp_path / "rep" / "results.json").read_text())
    assert saved[0]["runs"] == rep["rows"][0]["runs"]
    assert json.loads((tmp_path / "rep" / "meta.json").read_text())["seeds"] == [4, 5]


def test_warmup_counts_only_the_requests_after_it(tmp_path: Path, profile_file: Path) -> None:
    base = _simulate(tmp_path, profile_file, "all", rate_scales=[1.0])
    warm = _simulate(tmp_path, profile_file, "warm", rate_scales=[1.0], warmup_s=20.0)
    wl = runner.load_trace("synthetic", "auto", seed=0, rate=None, max_requests=150)
    t0 = wl.requests[0].arrival_s
    after = sum(r.arrival_s >= t0 + 20.0 for r in wl.requests)
    assert 0 < after < 150
    for b, w in zip(base["rows"], warm["rows"], strict=True):
        assert w["requests"] == after and w["warmup_requests"] == 150 - after
        assert b["requests"] == 150 and b["warmup_requests"] == 0
        assert w["gpu_seconds"] == b["gpu_seconds"]  # the same run, measured differently
        assert w["oracle_mean_ttft_s"] != b["oracle_mean_ttft_s"]
    assert warm["meta"]["warmup_s"] == 20.0


def test_a_warmup_past_the_last_arrival_is_rejected(tmp_path: Path, profile_file: Path) -> None:
    with pytest.raises(InvalidInput, match=r"no request at rate ×2"):
        _simulate(tmp_path, profile_file, "w", warmup_s=20.0)  # spans ≈ 34 s at ×1, 17 at ×2
    with pytest.raises(InvalidInput, match="repeats"):
        _simulate(tmp_path, profile_file, "r", repeats=0)


# --- the command line --------------------------------------------------------------------------
def test_cli_repeats_and_warmup(runner_cli, tmp_path: Path, profile_file: Path) -> None:
    out = tmp_path / "cli"
    res = runner_cli.invoke(app, [
        "simulate", "--trace", "synthetic", "--policies", "homo", "--rate-scale", "1",
        "--gpus", "8", "--max-requests", "120", "--profile", str(profile_file),
        "--repeats", "2", "--warmup", "10", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "mean of seeds 0, 1" in res.output and "10 s warm-up" in res.output
    (row,) = json.loads((out / "results.json").read_text())
    assert row["seeds"] == [0, 1] and len(row["runs"]) == 2 and row["warmup_requests"] > 0
    assert "warmup_requests" in (out / "results.csv").read_text().splitlines()[0]
    assert (out / "ttft_mean.png").stat().st_size > 0
    bad = runner_cli.invoke(app, ["simulate", "--preset", "reconfig", "--repeats", "3",
                                  "--out", str(tmp_path / "p")])
    assert bad.exit_code == 2 and "--repeats" in bad.output
    neg = runner_cli.invoke(app, ["simulate", "--warmup", "-1", "--out", str(tmp_path / "n")])
    assert neg.exit_code == 2 and "warm-up (--warmup" in " ".join(neg.output.split())


@pytest.fixture
def runner_cli(runner):  # the session's typer CliRunner (conftest) under a clearer name
    return runner


def test_tune_repeats_judge_each_pair_by_the_mean_of_the_seeds(tmp_path: Path,
                                                               profile_file: Path) -> None:
    def tune(name: str, **kw: object) -> dict:
        return runner.run_tune(trace="synthetic", rate_scales=[1.0, 2.0], betas=[1.0, 2.0],
                               lams=[0.0], gpus=8, max_requests=150, out=tmp_path / name,
                               profile_path=profile_file, **kw)  # type: ignore[arg-type]

    both = tune("both", seed=2, repeats=2)
    alone = {sd: tune(f"s{sd}", seed=sd) for sd in (2, 3)}
    assert both["meta"]["seeds"] == [2, 3]
    for i, row in enumerate(both["rows"]):
        assert row["seeds"] == [2, 3]
        assert row["mean_ttft_s"] == pytest.approx(
            np.mean([alone[sd]["rows"][i]["mean_ttft_s"] for sd in (2, 3)]))
    best = both["pairs"][0]
    assert best["mean_ttft_s"] == pytest.approx(np.mean(
        [r["mean_ttft_s"] for r in both["rows"]
         if (r["beta"], r["lam"]) == (best["beta"], best["lam"])]))
    assert json.loads((tmp_path / "both" / "tune.json").read_text())["meta"]["seeds"] == [2, 3]
