"""``vertumnus size``: the fewest GPUs with which each policy meets an SLO on a trace."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.ids import InvalidInput
from sim import runner
from sim.sizing import pool_sizes, smallest_meeting
from vertumnus.cli import app


# --- the search (pure) -------------------------------------------------------------------------
@given(n=st.integers(1, 40), k=st.integers(0, 41))
def test_smallest_meeting_finds_the_first_size_of_a_monotone_predicate(n: int, k: int) -> None:
    sizes = [4 * (i + 1) for i in range(n)]
    asked: list[int] = []

    def meets(g: int) -> bool:
        asked.append(g)
        return sizes.index(g) >= k

    got = smallest_meeting(sizes, meets)
    assert got == (sizes[k] if k < n else None)
    assert len(asked) <= 1 + math.ceil(math.log2(n)) + 1  # a binary search, largest first
    assert asked[0] == sizes[-1]


def test_smallest_meeting_edges() -> None:
    assert smallest_meeting([], lambda g: True) is None
    assert smallest_meeting([8], lambda g: True) == 8
    with pytest.raises(InvalidInput, match="increase"):
        smallest_meeting([8, 8], lambda g: True)


def test_pool_sizes() -> None:
    assert pool_sizes((2, 4), None, 16, None) == [4, 8, 12, 16]
    assert pool_sizes((2, 4), 8, 40, 8) == [8, 16, 24, 32, 40]
    assert pool_sizes((2, 4, 8), None, 16, None) == [8, 16]
    for args, words in [((None, 16, 6), "multiple of the largest degree 4"),
                        ((None, 16, 0), "--step"),
                        ((6, 16, None), "--gpus-min must be a positive multiple"),
                        ((None, 18, None), "--gpus-max must be a positive multiple"),
                        ((20, 16, None), "above --gpus-max")]:
        with pytest.raises(InvalidInput, match=words):
            pool_sizes((2, 4), *args)  # type: ignore[arg-type]


# --- on a trace --------------------------------------------------------------------------------
def test_size_finds_the_fewest_gpus_that_meet_the_target(tmp_path: Path,
                                                         profile_file: Path) -> None:
    summary = runner.run_size(trace="synthetic", policies=["vertumnus", "homo"], rate_scale=1.0,
                              target=0.8, gpus_max=32, max_requests=400, out=tmp_path,
                              profile_path=profile_file)
    meta = summary["meta"]
    assert meta["sizes"] == [4, 8, 12, 16, 20, 24, 28, 32] and meta["target"] == 0.8
    assert 0.8 <= meta["oracle_slo_attainment"] <= 1.0
    for r in summary["policies"]:
        pts = {p["gpus"]: p for p in r["points"]}
        assert r["gpus"] is not None, r
        assert pts[r["gpus"]]["slo_attainment"] >= 0.8
        # The size below the answer was evaluated and missed (or the answer is the smallest).
        below = r["gpus"] - 4
        assert below < 4 or pts[below]["slo_attainment"] < 0.8, r
        # The answer is a real run: the same sweep cell at that size gives the same figures.
        alone = runner.run_simulate(trace="synthetic", policies=[r["policy"]],
                                    rate_scales=[1.0], gpus=r["gpus"], max_requests=400,
                                    profile_path=profile_file, out=tmp_path / r["policy"])
        assert alone["rows"][0]["slo_attainment"] == pts[r["gpus"]]["slo_attainment"]
        assert alone["rows"][0]["mean_ttft_s"] == pts[r["gpus"]]["mean_ttft_s"]
    # Policies searched in two processes: the same answers and points.
    twice = runner.run_size(trace="synthetic", policies=["vertumnus", "homo"], rate_scale=1.0,
                            target=0.8, gpus_max=32, max_requests=400, out=tmp_path / "j2",
                            profile_path=profile_file, jobs=2)
    assert twice["policies"] == summary["policies"]
    saved = json.loads((tmp_path / "size.json").read_text())
    assert [r["gpus"] for r in saved["policies"]] == [r["gpus"] for r in summary["policies"]]
    with (tmp_path / "size.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert {r["policy"] for r in rows} == {"vertumnus", "homo"}
    assert all((r["meets"] == "True") == (float(r["slo_attainment"]) >= 0.8) for r in rows)
    assert (tmp_path / "size.png").stat().st_size > 0


def test_size_reports_a_target_no_pool_meets(tmp_path: Path, profile_file: Path) -> None:
    # Over the largest size tried: None, with that size's figures kept.
    summary = runner.run_size(trace="synthetic", policies=["homo"], rate_scale=1.0,
                              target=0.8, gpus_max=4, max_requests=400, out=tmp_path,
                              profile_path=profile_file)
    (r,) = summary["policies"]
    assert r["gpus"] is None and [p["gpus"] for p in r["points"]] == [4]
    assert r["points"][0]["slo_attainment"] < 0.8


def test_size_refuses_a_target_above_the_oracle_before_running(tmp_path: Path) -> None:
    """A deadline no prompt can meet even alone on an idle worker: no pool size helps."""
    from sim.metrics import parse_slo

    with pytest.raises(InvalidInput, match="zero-queue oracle"):
        runner.run_size(trace="synthetic", policies=["homo"], rate_scale=1.0, target=0.5,
                        max_requests=100, out=tmp_path / "o", slo=parse_slo("inf:0.01"))
    assert not (tmp_path / "o" / "profile").exists()  # nothing was profiled


@pytest.mark.parametrize(("args", "words"), [
    (["--target", "1.5"], "--target"),
    (["--target", "0"], "--target"),
    (["--rate-scale", "0"], "--rate-scale"),
    (["--step", "6"], "--step"),
    (["--gpus-max", "30"], "--gpus-max"),
    (["--policies", "vertumnus,nope"], "unknown policies"),
    (["--slo", "fast"], "--slo"),
])
def test_size_cli_bad_input_exits_2(runner_cli, tmp_path: Path, args: list[str],
                                    words: str) -> None:
    res = runner_cli.invoke(app, ["size", "--max-requests", "50", "--out", str(tmp_path / "o"),
                                  *args])
    assert res.exit_code == 2, res.output
    assert words in res.output
    assert not (tmp_path / "o").exists()


def test_size_cli_prints_the_table(runner_cli, tmp_path: Path, profile_file: Path) -> None:
    res = runner_cli.invoke(app, ["size", "--policies", "homo", "--max-requests", "300",
                                  "--gpus-max", "16", "--target", "0.5", "--profile",
                                  str(profile_file), "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    got = json.loads((tmp_path / "size.json").read_text())["policies"][0]["gpus"]
    assert "fewest GPUs for 50% SLO attainment" in res.output and f" {got} " in res.output
    # `report` redraws a size directory: the same table, the CSV and plot made again.
    for name in ("size.csv", "size.png"):
        (tmp_path / name).unlink()
    again = runner_cli.invoke(app, ["report", str(tmp_path)])
    assert again.exit_code == 0, again.output
    assert "fewest GPUs for 50% SLO attainment" in again.output and f" {got} " in again.output
    assert (tmp_path / "size.csv").stat().st_size > 0 and (tmp_path / "size.png").exists()
    (tmp_path / "size.json").write_text('{"policies": 3}')
    bad = runner_cli.invoke(app, ["report", str(tmp_path)])
    assert bad.exit_code == 2 and "not a size summary" in bad.output


@pytest.fixture
def runner_cli(runner):  # the session's typer CliRunner (conftest) under a clearer name
    return runner


def test_size_measures_kappa_for_each_pool_it_tries(tmp_path: Path) -> None:
    """Without --profile, κ is measured on the trace for each pool size's own worker counts
    (an 8-GPU pool has 4 CP2 and 2 CP4 workers; from 32 GPUs on, the ramp's 8 each).

    Sizes 8, 32 and 56: a pool below the ramp's size, the first size at it for every degree
    (sim.profiling.ramp_pools caps each degree's workers at the ramp's 8, and 32 // 4 = 8)
    and one above it, which shares that κ: two ramps. (Every size from 4 to 36 by 4 ran
    eight ramps, ~18 s, for the same checks.)"""
    summary = runner.run_size(trace="synthetic", policies=["homo"], rate_scale=1.0,
                              target=0.5, gpus_min=8, gpus_max=56, step=24, max_requests=300,
                              out=tmp_path)
    by = summary["meta"]["kappa"]["by_size"]
    assert set(by) == {"8", "32", "56"}
    assert by["8"]["pool_workers"] == {"2": 4, "4": 2}
    assert by["32"]["pool_workers"] == by["56"]["pool_workers"] == {"2": 8, "4": 8}
    assert by["32"]["kappa"] == by["56"]["kappa"]  # one measurement for the same pools
    assert by["8"]["kappa"] != by["32"]["kappa"]  # measured on its own, smaller pools
    assert len(list((tmp_path / "profile").glob("kappa_*.json"))) == 2  # 8, ≥ 32


def test_size_table_says_what_vertumnus_saves_against_the_best_baseline() -> None:
    import io

    def summary(answers: dict[str, int | None]) -> dict:
        pols = [{"policy": p, "gpus": g, "points": []} for p, g in answers.items()]
        return {"policies": pols, "meta": {"workload": "w", "rate_scale": 2.0, "target": 0.9,
                                           "sizes": [4, 8, 80]}}

    def said(answers: dict[str, int | None]) -> str:
        buf = io.StringIO()
        runner.print_size_table(summary(answers), buf)
        return " ".join(buf.getvalue().split())

    assert ("vertumnus needs 28 GPUs, 4 fewer than the best baseline, homo (32; 12.5% of its "
            "pool saved)") in said({"vertumnus": 28, "homo_cp2": None, "homo": 32, "vllm": 52})
    assert "vertumnus needs 36 GPUs, 4 more than the best baseline, static (32)" in said(
        {"static": 32, "vertumnus": 36})
    assert "vertumnus does not meet the target with 80 GPUs; homo does with 32" in said(
        {"vertumnus": None, "homo": 32})
    assert "vertumnus needs 8 GPUs; no baseline meets the target with 80" in said(
        {"vertumnus": 8, "homo": None})
    assert "best baseline" not in said({"homo": 32})  # no vertumnus: no sentence


def test_size_table_and_csv_say_which_sizes_lost_requests_and_why(tmp_path: Path) -> None:
    """A size that lost requests is named under the table with the count and its reasons
    (each point's ``failed_by_reason``, as results rows have it), the reasons explained;
    size.csv has the reasons as one cell. A point of a size.json written before the field
    (no ``failed_by_reason``) is still named, with its count alone. Before, neither the table
    nor its line said anything of failed requests."""
    import io

    def point(g: int, att: float, failed: int, why: dict[str, int] | None) -> dict:
        pt = {"gpus": g, "slo_attainment": att, "mean_ttft_s": 1.0, "p90_ttft_s": 2.0,
              "hit_rate": 0.5, "gpu_seconds": 10.0, "reconfigurations": 0, "failed": failed}
        if why is not None:
            pt["failed_by_reason"] = why
        return pt

    summary = {"meta": {"workload": "w", "rate_scale": 1.0, "target": 0.9,
                        "sizes": [8, 16, 32]},
               "policies": [
                   {"policy": "vertumnus", "gpus": 16,
                    "points": [point(8, 0.4, 103, {"no_memory": 103}),
                               point(16, 0.95, 0, {})]},
                   {"policy": "homo", "gpus": None,
                    "points": [point(32, 0.7, 4, None)]}]}
    buf = io.StringIO()
    runner.print_size_table(summary, buf)
    said = " ".join(buf.getvalue().split())
    assert "failed requests: vertumnus with 8 GPUs 103 (no_memory 103); homo with 32 GPUs 4." \
        in said, said
    assert "no_memory: " in said and "16 GPUs 0" not in said
    runner.write_size_outputs(tmp_path, summary)
    with (tmp_path / "size.csv").open() as fh:
        rows = {(r["policy"], r["gpus"]): r for r in csv.DictReader(fh)}
    assert rows[("vertumnus", "8")]["failed_by_reason"] == "no_memory=103"
    assert rows[("vertumnus", "16")]["failed_by_reason"] == ""
    assert rows[("homo", "32")]["failed_by_reason"] == ""  # an older point: none known
    buf = io.StringIO()
    runner.print_size_table({**summary, "policies": [
        {"policy": "vertumnus", "gpus": 16, "points": [point(16, 0.95, 0, {})]}]}, buf)
    assert "failed requests" not in buf.getvalue()
