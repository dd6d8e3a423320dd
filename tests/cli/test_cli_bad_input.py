"""Bad input to ``simulate`` / ``tune`` / ``size`` / ``profile`` / ``report`` / ``demo``: exit 2
with one ``error:`` line naming the option (or file) and the problem, no traceback, and no run
started. Every refusal here comes from a check made before any simulation, so these are fast.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import typer
from cli_support import SIM, _refused
from typer.testing import CliRunner

from shared.ids import InvalidInput
from sim import runner as sim_runner
from vertumnus.cli import app
from vertumnus.cliargs import comma_list, input_file, output_dir, output_file


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """Stand-ins for simulate's runs that record their arguments and return an empty
    summary, to see what accepted options reach the run without running it."""
    seen: dict[str, dict[str, Any]] = {}

    def fake(name: str) -> Any:
        def run(*args: Any, **kwargs: Any) -> dict[str, Any]:
            seen[name] = {"args": args, **kwargs}
            return {"rows": [], "meta": {}}
        return run

    for name in ("run_simulate", "run_preset"):
        monkeypatch.setattr(sim_runner, name, fake(name))
    return seen


# --- 1. seeds ------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [SIM, ["tune"], ["size"], ["profile"]])
def test_a_negative_seed_is_refused(runner: CliRunner, tmp_path: Path, no_runs: None,
                                    command: list[str]) -> None:
    res = runner.invoke(app, [*command, "--seed", "-1", "--out", str(tmp_path / "o")])
    _refused(res, "--seed must be an integer >= 0, got -1")
    assert not (tmp_path / "o").exists()


# --- 2. --out ------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [SIM, ["tune"], ["size"], ["profile"]])
def test_an_out_that_is_a_file_or_cannot_be_made_is_refused(
        runner: CliRunner, tmp_path: Path, no_runs: None, command: list[str]) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    res = runner.invoke(app, [*command, "--out", str(afile)])
    _refused(res, f"--out {afile}: exists and is not a directory")
    under = afile / "sub"  # a parent that is a file: mkdir fails
    res = runner.invoke(app, [*command, "--out", str(under)])
    _refused(res, f"--out {under}: cannot be created")


def test_a_run_refused_by_its_trace_leaves_no_out_directory(runner: CliRunner,
                                                            tmp_path: Path) -> None:
    """The trace is read once the run starts, after --out was checked (and made): a trace
    refused then took the directory along. Before, an empty --out was left behind."""
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    out = tmp_path / "new" / "out"
    res = runner.invoke(app, ["simulate", "--trace", str(empty), "--format", "azure",
                              "--policies", "vertumnus", "--out", str(out)])
    _refused(res)
    assert not out.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    res = runner.invoke(app, ["simulate", "--trace", str(empty), "--format", "azure",
                              "--policies", "vertumnus", "--out", str(kept)])
    _refused(res)
    assert kept.is_dir()  # the user's own directory stays


def test_an_output_file_taken_by_a_directory_is_one_error_line(runner: CliRunner,
                                                                tmp_path: Path) -> None:
    """The run is done, but results.json cannot be written (a directory of that name): exit
    1 with one line naming the file. Before, a traceback (IsADirectoryError)."""
    out = tmp_path / "o"
    (out / "results.json").mkdir(parents=True)
    res = runner.invoke(app, [*SIM, "--out", str(out)])
    assert res.exit_code == 1, res.output
    assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output
    text = " ".join(res.output.split())
    assert f"error: --out {out}: cannot write {out / 'results.json'}: Is a directory" in text


def test_output_helpers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    made = output_dir(tmp_path / "a" / "b")
    assert made.is_dir()
    f = tmp_path / "f.json"
    f.write_text("{}")
    with pytest.raises(typer.Exit) as exc:
        output_dir(f, "log-dir")
    assert exc.value.exit_code == 2
    assert f"error: --log-dir {f}: exists and is not a directory" in capsys.readouterr().err
    # A file to write: its directory is made; a directory or a file-as-parent is refused.
    assert output_file(tmp_path / "new" / "x.json", "json") == tmp_path / "new" / "x.json"
    assert (tmp_path / "new").is_dir() and not (tmp_path / "new" / "x.json").exists()
    for bad, words in ((tmp_path, "is a directory, not a file"),
                       (f / "x.json", f"its directory {f} exists and is not a directory")):
        with pytest.raises(typer.Exit):
            output_file(bad, "json")
        assert words in capsys.readouterr().err
    # A file to read.
    assert input_file(f, "profile") == f
    for bad, words in ((tmp_path / "nope", "no such file"),
                       (tmp_path, "is a directory, not a file")):
        with pytest.raises(typer.Exit):
            input_file(bad, "profile")
        assert f"--profile {bad}: {words}" in capsys.readouterr().err


# --- 3. demo -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "words"), [
    (["--beta", "0.5"], "--beta must be a finite number >= 1.0, got 0.5"),
    (["--beta", "-1"], "--beta must be a finite number >= 1.0"),
    (["--beta", "nan"], "--beta must be a finite number >= 1.0, got nan"),
    (["--beta", "inf"], "--beta must be a finite number >= 1.0, got inf"),
    (["--lam", "-1"], "--lam must be a finite number >= 0.0, got -1"),
])
def test_demo_refuses_weights_j_does_not_take_before_printing(
        runner: CliRunner, args: list[str], words: str) -> None:
    text = _refused(runner.invoke(app, ["demo", *args]), words)
    assert "Pool:" not in text  # refused before the demo's first line


# --- 4. --profile --------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [SIM, ["tune"], ["size"]])
def test_a_profile_that_is_no_profile_file_is_refused(
        runner: CliRunner, tmp_path: Path, no_runs: None, command: list[str]) -> None:
    out = ["--out", str(tmp_path / "o")]
    _refused(runner.invoke(app, [*command, "--profile", str(tmp_path), *out]),
             f"--profile {tmp_path}: is a directory, not a file")
    _refused(runner.invoke(app, [*command, "--profile", str(tmp_path / "nope.json"), *out]),
             "--profile", "nope.json", "no such file")
    junk = tmp_path / "junk.json"
    junk.write_bytes(b"\xff\xfe not json")
    _refused(runner.invoke(app, [*command, "--profile", str(junk), *out]), "--profile",
             str(junk))


@pytest.mark.parametrize("command", [SIM, ["tune", "--gpus", "8"], ["size"]])
def test_a_profile_without_kappa_for_a_degree_in_use_is_refused(
        runner: CliRunner, tmp_path: Path, no_runs: None, profile_file: Path,
        command: list[str]) -> None:
    """The controller judges a degree's capacity by its κ; a profile lacking it (one fitted on
    the torch backend, or cut by hand) would have it judged by a placeholder."""
    data = json.loads(profile_file.read_text())
    data["kappa"] = {k: v for k, v in data["kappa"].items() if k != "4"}
    cut = tmp_path / "no-kappa-4.json"
    cut.write_text(json.dumps(data))
    _refused(runner.invoke(app, [*command, "--degrees", "2,4", "--profile", str(cut),
                                 "--out", str(tmp_path / "o")]), "--profile", "kappa", "4")


# --- 5. report -----------------------------------------------------------------------------------
def _row(policy: str = "vertumnus", **figures: Any) -> dict[str, Any]:
    return {"policy": policy, "rate_scale": 1.0, "request_rate": 2.0, "mean_ttft_s": 0.5,
            "p50_ttft_s": 0.4, "p90_ttft_s": 0.9, "p99_ttft_s": 1.2, "slo_attainment": 0.95,
            "hit_rate": 0.2, "reconfigurations": 0, "oracle_mean_ttft_s": 0.3, **figures}


def test_report_refuses_what_no_run_wrote(runner: CliRunner, tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    _refused(runner.invoke(app, ["report", str(afile)]), str(afile), "is not a directory")
    _refused(runner.invoke(app, ["report", str(tmp_path / "nope")]), "no such directory")
    cases: list[tuple[str, Any, tuple[str, ...]]] = [
        ("dir", None, ("results.json is a directory, not a JSON file",)),
        ("latin1", b"\xff\xfe[]", ("results.json is not UTF-8 text",)),
        ("fields", [{"policy": "x"}], ("results.json: row 0 (x) lacks", "request_rate")),
        ("empty", [], ("results.json has no result rows",)),
        ("type", [_row(mean_ttft_s="fast")], ("results.json: row 0", "mean_ttft_s")),
        ("two", [_row(), _row(), _row("homo")],
         ("results.json: 2 vertumnus rows at rate scale 1.0",)),
    ]
    for name, content, words in cases:
        d = tmp_path / name
        d.mkdir()
        results = d / "results.json"
        if content is None:
            results.mkdir()
        elif isinstance(content, bytes):
            results.write_bytes(content)
        else:
            results.write_text(json.dumps(content))
        text = _refused(runner.invoke(app, ["report", str(d)]), *words)
        assert "Warning" not in text
        assert not (d / "results.csv").exists()


def test_report_refuses_a_size_summary_its_table_cannot_show(runner: CliRunner,
                                                            tmp_path: Path) -> None:
    """The size table is printed after the CSV and plot are written: a summary that lacks
    what the table shows used to end in a traceback after writing them."""
    meta = {"target": 0.9, "workload": "x", "rate_scale": 1}
    cases = {
        "nosizes": ({"meta": meta, "policies": [
            {"policy": "static", "gpus": 8, "points": [
                {"gpus": 8, "slo_attainment": 0.95, "mean_ttft_s": 0.5}]}]},
            "KeyError('sizes')"),
        "nomean": ({"meta": {**meta, "sizes": [8]}, "policies": [
            {"policy": "static", "gpus": 8, "points": [{"gpus": 8, "slo_attainment": 0.95}]}]},
            "KeyError('mean_ttft_s')"),
    }
    for name, (summary, word) in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "size.json").write_text(json.dumps(summary))
        _refused(runner.invoke(app, ["report", str(d)]), "size.json is not a size summary",
                 word)
        assert sorted(x.name for x in d.iterdir()) == ["size.json"]  # nothing written


@pytest.mark.parametrize("policies", [[], ""], ids=["empty-list", "empty-string"])
def test_report_refuses_a_size_summary_of_no_policy(runner: CliRunner, tmp_path: Path,
                                                    policies: Any) -> None:
    """A size run sizes at least one policy: a size.json whose policy list is empty is no
    run's summary. Before, report drew it (a size.csv of its header alone, an empty plot)
    and exited 0."""
    meta = {"target": 0.9, "workload": "x", "rate_scale": 1, "sizes": [8]}
    size = tmp_path / "size.json"
    size.write_text(json.dumps({"meta": meta, "policies": policies}))
    text = _refused(runner.invoke(app, ["report", str(tmp_path)]),
                    f"error: {size}: 'policies' is empty", "at least one policy")
    assert text.count("error:") == 1
    assert sorted(x.name for x in tmp_path.iterdir()) == ["size.json"]  # nothing written


def test_report_names_meta_json_when_it_is_the_broken_one(runner: CliRunner,
                                                          tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text(json.dumps([_row()]))
    for meta in ("{broken", json.dumps([1, 2]), json.dumps({"warmup_s": "soon"})):
        (tmp_path / "meta.json").write_text(meta)
        text = _refused(runner.invoke(app, ["report", str(tmp_path)]), "meta.json")
        assert "results.json" not in text


def _mark_outputs(d: Path, inputs: tuple[str, ...]) -> dict[str, bytes]:
    """Overwrite every file `report` writes in ``d`` with a mark of its own; the marks."""
    marks = {}
    for f in d.iterdir():
        if f.is_file() and f.name not in inputs:
            marks[f.name] = f"mark of {f.name}".encode()
            f.write_bytes(marks[f.name])
    return marks


def test_a_refused_report_changes_none_of_the_run_s_files(runner: CliRunner,
                                                          tmp_path: Path) -> None:
    """`report` redraws from the run's own files: one it refuses half-way leaves every file
    as it was. Before, a bad point of size.json (one the table does not show) cut size.csv
    to its header, and a bad meta.json left results.json, the CSVs and the plots rewritten."""
    size = tmp_path / "size"
    size.mkdir()
    meta = {"target": 0.9, "workload": "x", "rate_scale": 1, "sizes": [8, 16]}
    point = {"gpus": 8, "slo_attainment": 0.95, "mean_ttft_s": 0.5}
    good = {"meta": meta, "policies": [{"policy": "static", "gpus": 8, "points": [
        point, {**point, "gpus": 16}]}]}
    (size / "size.json").write_text(json.dumps(good))
    assert runner.invoke(app, ["report", str(size)]).exit_code == 0
    marks = _mark_outputs(size, ("size.json",))
    assert "size.csv" in marks
    bad = {**good, "policies": [{"policy": "static", "gpus": 8, "points": [
        point, {**point, "gpus": 16, "slo_attainment": "x"}]}]}
    (size / "size.json").write_text(json.dumps(bad))
    _refused(runner.invoke(app, ["report", str(size)]), "size.json is not a size summary")
    assert {f.name: f.read_bytes() for f in size.iterdir() if f.name != "size.json"} == marks

    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text(json.dumps([_row()]))
    assert runner.invoke(app, ["report", str(run)]).exit_code == 0
    marks = _mark_outputs(run, ("results.json", "meta.json"))
    assert "results.csv" in marks and "ttft_mean.png" in marks
    (run / "meta.json").write_text(json.dumps({"timelines": {"1": [[0, {"x": 1}]]}}))
    _refused(runner.invoke(app, ["report", str(run)]), "meta.json")
    assert {f.name: f.read_bytes() for f in run.iterdir()
            if f.name not in ("results.json", "meta.json")} == marks  # no scratch left either


def test_report_names_results_json_for_a_bad_runs_list_and_takes_huge_counts(
        runner: CliRunner, tmp_path: Path) -> None:
    """A row whose ``runs`` (--repeats) is no list of figures is results.json's fault (it was
    blamed on meta.json); a count too large for a float is shown as the integer it is (it was
    an OverflowError traceback)."""
    (tmp_path / "results.json").write_text(json.dumps([{**_row(), "runs": 5}]))
    text = _refused(runner.invoke(app, ["report", str(tmp_path)]), "results.json", "runs")
    assert "meta.json" not in text
    (tmp_path / "results.json").write_text(json.dumps([_row(rate_scale=-2.0)]))
    _refused(runner.invoke(app, ["report", str(tmp_path)]), "results.json",
             "rate_scale is -2.0, not a rate multiplier > 0")
    (tmp_path / "results.json").write_text(
        json.dumps([_row()]).replace('"reconfigurations": 0', '"reconfigurations": 1' + "0" * 400))
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 0 and "Traceback" not in res.output, res.output


def test_report_draws_rows_with_a_figure_a_run_could_not_give(runner: CliRunner,
                                                               tmp_path: Path) -> None:
    # A non-finite figure is written as null (runner._jsonable): the table shows '-'.
    (tmp_path / "results.json").write_text(json.dumps(
        [_row(), _row("homo", mean_ttft_s=None, oracle_mean_ttft_s=None)]))
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "homo" in res.output and (tmp_path / "ttft_mean.png").exists()
    # ... and the comparison has no strongest baseline there: null, '-' in the table.
    (comp,) = json.loads((tmp_path / "comparison.json").read_text())
    assert comp["strongest_baseline"] is None and comp["mean_change"] is None
    assert comp["best_p90_baseline"] == "homo"


def _phases_meta(**over: Any) -> dict[str, Any]:
    """What run_reconfig writes into meta.json about its phases (two phases, two pools)."""
    return {"phase_bounds": [[0.0, 300.0], [300.0, 600.0]],
            "phase_mean_ttft_s": {"vertumnus": [0.40, 0.45], "12CP2/4CP4": [0.40, 0.50]},
            "windows_to_first_reaction": [2], "windows_to_follow": [0], **over}


def test_report_of_a_reconfig_run_shows_its_phases(runner: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text(json.dumps([_row()]))
    (tmp_path / "meta.json").write_text(json.dumps(_phases_meta()))
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "by phase" in res.output and "-10.0%" in res.output
    # A phase without a completed request is null in the JSON: '-' in its cells.
    (tmp_path / "meta.json").write_text(json.dumps(_phases_meta(
        phase_mean_ttft_s={"vertumnus": [0.40, None], "12CP2/4CP4": [None, 0.50]})))
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    line = next(ln for ln in res.output.splitlines() if "better fixed" in ln)
    assert "%" not in line


def test_report_names_meta_json_when_its_phases_are_broken(runner: CliRunner,
                                                           tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text(json.dumps([_row()]))
    for meta in (_phases_meta(phase_bounds=[[0.0, 300.0], [300.0, 600.0], [600.0, 900.0]]),
                 _phases_meta(phase_mean_ttft_s={"vertumnus": ["slow", 0.4]}),
                 _phases_meta(phase_mean_ttft_s=[0.4, 0.5]),
                 _phases_meta(phase_bounds=None)):
        (tmp_path / "meta.json").write_text(json.dumps(meta))
        _refused(runner.invoke(app, ["report", str(tmp_path)]), "meta.json", "phase")
        assert not (tmp_path / "results.csv").exists()


# --- 6. --preset ---------------------------------------------------------------------------------
def test_a_preset_refuses_the_options_it_fixes(runner: CliRunner, tmp_path: Path,
                                               no_runs: None) -> None:
    res = runner.invoke(app, ["simulate", "--preset", "leval", "--gpus", "7", "--degrees", "3",
                              "--trace", "/nonexistent", "--max-requests", "5", "--out",
                              str(tmp_path / "o")])
    text = _refused(res, "--preset 'leval' fixes", "--trace, --gpus, --degrees, --max-requests")
    assert "--out" not in text.split("leave out")[1]
    for opt, val in (("--rate-scale", "2"), ("--profile", "p.json"), ("--beta", "2"),
                     ("--lam", "0.5"), ("--format", "auto"), ("--rate", "1"),
                     ("--cache-blocks-per-gpu", "10")):
        _refused(runner.invoke(app, ["simulate", "--preset", "conversation", opt, val]),
                 f"leave out {opt} ")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name", ["", "nope"])
def test_an_unknown_or_empty_preset_is_refused(runner: CliRunner, tmp_path: Path,
                                               no_runs: None, name: str) -> None:
    res = runner.invoke(app, ["simulate", "--preset", name, "--out", str(tmp_path / "o")])
    _refused(res, f"unknown preset {name!r}", "conversation")


def test_a_preset_keeps_the_options_it_honours(runner: CliRunner, tmp_path: Path,
                                               calls: dict[str, dict[str, Any]]) -> None:
    out = tmp_path / "o"
    res = runner.invoke(app, ["simulate", "--preset", "conversation", "--out", str(out),
                              "--seed", "3", "--jobs", "2", "--repeats", "2", "--warmup", "5",
                              "--policies", "vertumnus,homo"])
    assert res.exit_code == 0, res.output
    got = calls["run_preset"]
    assert got["args"] == ("conversation",)
    assert (got["out"], got["seed"], got["jobs"], got["repeats"], got["warmup_s"]) == (
        out, 3, 2, 2, 5.0)
    assert got["policies"] == ["vertumnus", "homo"]
    assert out.is_dir()
    # Without --policies the preset runs its own list.
    assert runner.invoke(app, ["simulate", "--preset", "leval", "--out", str(out)]
                         ).exit_code == 0
    assert calls["run_preset"]["policies"] is None


def test_the_ablation_preset_leaves_its_workload_rates_and_cache_open(
        runner: CliRunner, tmp_path: Path, calls: dict[str, dict[str, Any]]) -> None:
    # The paper's ablation trace (Tool-Agent) is not shipped: a user who has it names it.
    trace = tmp_path / "toolagent_trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, '
                     '"hash_ids": [1, 2]}\n')
    res = runner.invoke(app, ["simulate", "--preset", "ablation", "--trace", str(trace),
                              "--rate-scale", "1,2", "--max-requests", "50",
                              "--cache-blocks-per-gpu", "100", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    got = calls["run_preset"]
    assert got["args"] == ("ablation",)
    assert (got["trace"], got["fmt"], got["rate_scales"], got["max_requests"],
            got["cache_blocks_per_gpu"]) == (str(trace), "auto", [1.0, 2.0], 50, 100)
    assert "rate" not in got
    # Left out, they are the preset's own.
    assert runner.invoke(app, ["simulate", "--preset", "ablation", "--out", str(tmp_path / "o")]
                         ).exit_code == 0
    assert not {"trace", "rate_scales", "cache_blocks_per_gpu"} & set(calls["run_preset"])


@pytest.mark.parametrize(("args", "words"), [
    (["--gpus", "8"], "--preset 'ablation' fixes its cluster and profile; leave out --gpus"),
    (["--degrees", "2,4,8", "--profile", "p.json"], "leave out --degrees, --profile"),
    (["--cache-blocks-per-gpu", "0"], "--cache-blocks-per-gpu must be >= 1"),
    (["--rate-scale", "0"], "--rate-scale"),
    (["--trace", "synthetic", "--format", "azure"], "--format azure reads a trace file"),
    (["--max-requests", "-1"], "--max-requests must be an integer >= 0"),
])
def test_the_ablation_preset_checks_what_it_leaves_open(runner: CliRunner, tmp_path: Path,
                                                        no_runs: None, args: list[str],
                                                        words: str) -> None:
    res = runner.invoke(app, ["simulate", "--preset", "ablation", *args,
                              "--out", str(tmp_path / "o")])
    _refused(res, words)
    assert not (tmp_path / "o").exists()


def test_the_reconfig_preset_leaves_its_degrees_and_fixed_pools_open(
        runner: CliRunner, tmp_path: Path, calls: dict[str, dict[str, Any]]) -> None:
    # §9.3's own setting: degrees {4, 8}, 6CP4/2CP8 against 4CP4/3CP8.
    res = runner.invoke(app, ["simulate", "--preset", "reconfig", "--degrees", "8,4",
                              "--fixed", "2CP8/6CP4, 4CP4/3CP8", "--rate", "10",
                              "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    got = calls["run_preset"]
    assert got["args"] == ("reconfig",)
    assert (got["degrees"], got["fixed"], got["rate"]) == (
        (8, 4), ("2CP8/6CP4", "4CP4/3CP8"), 10.0)
    # Left out, they are the preset's own ({2, 4}, its pair and rate, chosen by the preset).
    assert runner.invoke(app, ["simulate", "--preset", "reconfig", "--out", str(tmp_path / "o")]
                         ).exit_code == 0
    assert not {"degrees", "fixed", "rate"} & set(calls["run_preset"])


@pytest.mark.parametrize(("args", "words"), [
    (["--degrees", "2,8"], "no default fixed compositions for degrees 2,8; name two (--fixed"),
    (["--degrees", "2,3"], "--degrees: every degree must be a power of two"),
    (["--fixed", "12CP2/4CP4"], "fixed compositions (--fixed): want two"),
    (["--fixed", "12CP2/4CP4,4CP2/8CP4,20CP2"], "fixed compositions (--fixed): want two"),
    (["--fixed", "12CP2/4CP4,4CP4/12CP2"], "the two fixed compositions (--fixed) are the same"),
    (["--fixed", "12CP2/4CP4,1CP8/16CP2"], "fixed composition (--fixed) '1CP8/16CP2': degree 8"),
    (["--fixed", "12CP2/4CP4,12CP2"], "no composition of 40 GPUs has 12CP2"),
    (["--degrees", "4,8", "--fixed", "12CP2/4CP4,4CP4/3CP8"], "degree 2 not in [4, 8]"),
    (["--fixed", "12CP2/4CP4,,4CP2/8CP4"], "--fixed has an empty entry"),
    (["--gpus", "16"], "--preset 'reconfig' fixes its workload, GPUs and profile; "
                       "leave out --gpus"),
    (["--rate-scale", "2"], "leave out --rate-scale"),
    (["--rate", "-1"], "--rate"),
])
def test_the_reconfig_preset_checks_its_degrees_and_fixed_pools(
        runner: CliRunner, tmp_path: Path, no_runs: None, args: list[str], words: str) -> None:
    _refused(runner.invoke(app, ["simulate", "--preset", "reconfig", *args,
                                 "--out", str(tmp_path / "o")]), words)
    assert not (tmp_path / "o").exists()


def test_fixed_pools_belong_to_the_reconfig_preset(runner: CliRunner, tmp_path: Path,
                                                   no_runs: None) -> None:
    _refused(runner.invoke(app, [*SIM, "--fixed", "12CP2/4CP4,4CP2/8CP4",
                                 "--out", str(tmp_path / "o")]),
             "--fixed names the fixed compositions of --preset reconfig")
    _refused(runner.invoke(app, ["simulate", "--preset", "ablation", "--fixed",
                                 "12CP2/4CP4,4CP2/8CP4", "--out", str(tmp_path / "o")]),
             "--preset 'ablation' fixes its cluster and profile; leave out --fixed")
    assert not (tmp_path / "o").exists()


def test_run_preset_checks_the_reconfig_choices_before_running(tmp_path: Path) -> None:
    for kw, words in (({"degrees": (2, 8)}, "no default fixed compositions"),
                      ({"fixed": ("12CP2/4CP4",)}, "want two"),
                      ({"degrees": (4, 8), "fixed": ("12CP2/4CP4", "4CP4/3CP8")},
                       "degree 2 not in"),
                      ({"degrees": (2, 3)}, "power of two"),
                      ({"rate": float("inf")}, "rate must be a finite number"),
                      ({"rate_scales": [2.0]}, "preset 'reconfig' fixes rate_scale")):
        with pytest.raises(InvalidInput, match=re.escape(words)):
            sim_runner.run_preset("reconfig", out=tmp_path / "o", **kw)
    with pytest.raises(InvalidInput, match="preset 'leval' fixes degrees"):
        sim_runner.run_preset("leval", out=tmp_path / "o", degrees=(2, 4))
    assert not (tmp_path / "o").exists()


def test_run_preset_refuses_a_choice_the_preset_fixes(tmp_path: Path) -> None:
    for name, kw in (("conversation", {"trace": "synthetic"}), ("reconfig", {"trace": "x"}),
                     ("leval", {"rate_scales": [1.0]}),
                     ("reconfig", {"cache_blocks_per_gpu": 10})):
        with pytest.raises(InvalidInput, match=f"preset '{name}' fixes"):
            sim_runner.run_preset(name, out=tmp_path / "o", **kw)
    for kw in ({"rate_scales": []}, {"rate_scales": [float("nan")]},
               {"cache_blocks_per_gpu": 0}, {"rate_scales": [1e-9]}):
        with pytest.raises(InvalidInput):
            sim_runner.run_preset("ablation", out=tmp_path / "o", trace="synthetic", **kw)
    assert not (tmp_path / "o").exists()


# --- 7. lists ------------------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "words"), [
    (["--policies", "vertumnus,vertumnus"], "--policies repeats vertumnus"),
    (["--policies", "vertumnus,"], "--policies has an empty entry in 'vertumnus,'"),
    (["--policies", ",vertumnus"], "--policies has an empty entry"),
    (["--rate-scale", "1,,2"], "--rate-scale has an empty entry in '1,,2'"),
    (["--rate-scale", "1,1.0"], "--rate-scale repeats 1.0"),
    (["--rate-scale", "inf"], "--rate-scale needs finite numbers > 0"),
    (["--degrees", "2,2"], "--degrees repeats 2"),
    (["--degrees", "2,,4"], "--degrees has an empty entry"),
])
def test_simulate_lists_refuse_repeats_and_empty_entries(
        runner: CliRunner, tmp_path: Path, no_runs: None, args: list[str], words: str) -> None:
    _refused(runner.invoke(app, [*SIM, *args, "--out", str(tmp_path / "o")]), words)


@pytest.mark.parametrize(("args", "words"), [
    (["--beta", "1.5,1.5"], "--beta repeats 1.5"),
    (["--lam", "0,0.0"], "--lam repeats 0.0"),
    (["--beta", "1,"], "--beta has an empty entry"),
    (["--rate-scale", "2,2"], "--rate-scale repeats 2.0"),
])
def test_tune_lists_refuse_repeats_and_empty_entries(
        runner: CliRunner, tmp_path: Path, no_runs: None, args: list[str], words: str) -> None:
    _refused(runner.invoke(app, ["tune", *args, "--out", str(tmp_path / "o")]), words)


def test_size_policies_refuse_repeats(runner: CliRunner, tmp_path: Path, no_runs: None) -> None:
    _refused(runner.invoke(app, ["size", "--policies", "homo,homo", "--out",
                                 str(tmp_path / "o")]), "--policies repeats homo")


def test_comma_list_keeps_order_and_strips_blanks() -> None:
    assert comma_list(" 2, 4 ", "degrees", int, "integers", unique=True) == (2, 4)
    # Repeats are allowed unless asked for (e.g. one time per service killed).
    assert comma_list("1,1", "kill-at", float, "seconds") == (1.0, 1.0)


def test_runner_refuses_repeated_policies(tmp_path: Path) -> None:
    from shared.ids import InvalidInput

    with pytest.raises(InvalidInput, match="policies repeat: homo"):
        sim_runner.check_policies(["homo", "vertumnus", "homo"])


# --- 8. profile --degrees ------------------------------------------------------------------------
@pytest.mark.parametrize(("degrees", "words"), [
    ("3", "--degrees: every degree must be a power of two"),
    ("16", "--degrees: degree 16 exceeds the node size 8"),
    ("2,2", "--degrees repeats 2"),
    ("1,2,4,6", "power of two"),
])
def test_profile_checks_degrees_as_simulate_does(runner: CliRunner, tmp_path: Path,
                                                 degrees: str, words: str) -> None:
    out = tmp_path / "o"
    _refused(runner.invoke(app, ["profile", "--degrees", degrees, "--out", str(out)]), words)
    assert not out.exists()
    # simulate refuses the same degrees with the same words, before any run.
    _refused(runner.invoke(app, [*SIM, "--degrees", degrees, "--out", str(out)]), words)


@pytest.mark.parametrize(("args", "words"), [
    (["--kappa-repeats", "0"], "--kappa-repeats must be an integer >= 1, got 0"),
    (["--kappa-repeats", "3", "--pool-gpus", "8"], "--kappa-repeats is for the single-worker"),
    (["--kappa-repeats", "3", "--backend", "torch"], "are the sim backend's"),
])
def test_profile_refuses_kappa_repeats_it_cannot_use(runner: CliRunner, tmp_path: Path,
                                                     args: list[str], words: str) -> None:
    out = tmp_path / "o"
    _refused(runner.invoke(app, ["profile", *args, "--out", str(out)]), words)
    assert not out.exists()


def test_profile_of_one_degree_says_c_is_not_identifiable(runner: CliRunner,
                                                          tmp_path: Path) -> None:
    res = runner.invoke(app, ["profile", "--degrees", "4", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert '"c": 0.0' in res.output
    assert "warning: one degree profiled (--degrees 4): c is not identifiable" in res.stderr
    two = runner.invoke(app, ["profile", "--degrees", "2,4", "--out", str(tmp_path / "two")])
    assert two.exit_code == 0 and "warning" not in two.output


# --- 9. simulate --beta / --lam ------------------------------------------------------------------
@pytest.mark.parametrize(("args", "words"), [
    (["--lam", "-5"], "--lam must be -1 (the calibrated default) or a finite number >= 0.0, "
                      "got -5"),
    (["--lam", "nan"], "--lam must be -1 (the calibrated default)"),
    (["--beta", "0.5"], "--beta must be 0 (the calibrated default) or a finite number >= 1.0, "
                        "got 0.5"),
    (["--beta", "-1"], "--beta must be 0 (the calibrated default)"),
])
def test_simulate_refuses_weights_other_than_the_documented_default(
        runner: CliRunner, tmp_path: Path, no_runs: None, args: list[str], words: str) -> None:
    _refused(runner.invoke(app, [*SIM, *args, "--out", str(tmp_path / "o")]), words)


def test_simulate_reads_the_documented_defaults_as_calibrated(
        runner: CliRunner, tmp_path: Path, calls: dict[str, dict[str, Any]]) -> None:
    out = ["--out", str(tmp_path / "o")]
    assert runner.invoke(app, [*SIM, "--beta", "0", "--lam", "-1", *out]).exit_code == 0
    assert (calls["run_simulate"]["beta"], calls["run_simulate"]["lam"]) == (None, None)
    assert runner.invoke(app, [*SIM, "--beta", "2", "--lam", "0", *out]).exit_code == 0
    assert (calls["run_simulate"]["beta"], calls["run_simulate"]["lam"]) == (2.0, 0.0)


# --- 10. tune's weights --------------------------------------------------------------------------
@pytest.mark.parametrize(("args", "words"), [
    (["--beta", "0.5"], "--beta must be a finite number >= 1.0, got 0.5"),
    (["--beta", "1,inf"], "--beta must be a finite number >= 1.0, got inf"),
    (["--lam", "0,-0.25"], "--lam must be a finite number >= 0.0, got -0.25"),
])
def test_tune_checks_j_bounds_before_running(runner: CliRunner, tmp_path: Path, no_runs: None,
                                             args: list[str], words: str) -> None:
    out = tmp_path / "o"
    _refused(runner.invoke(app, ["tune", *args, "--out", str(out)]), words)
    assert not out.exists()


def test_run_tune_checks_weights_before_profiling(tmp_path: Path) -> None:
    from shared.ids import InvalidInput

    with pytest.raises(InvalidInput, match="beta must be a finite number >= 1.0"):
        sim_runner.run_tune(trace="synthetic", rate_scales=[1.0], betas=[0.5], lams=[0.0],
                            out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


# --- 11. --trace / --format ----------------------------------------------------------------------
@pytest.mark.parametrize("command", [SIM, ["tune"], ["size"]])
def test_contradictory_trace_and_format_are_refused(
        runner: CliRunner, tmp_path: Path, no_runs: None, command: list[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1,
                                 "hash_ids": [1]}) + "\n")
    out = ["--out", str(tmp_path / "o")]
    _refused(runner.invoke(app, [*command, "--format", "synthetic", "--trace", str(trace), *out]),
             "--format synthetic", f"--trace {trace}")
    _refused(runner.invoke(app, [*command, "--format", "bogus", "--trace", "synthetic", *out]),
             "unknown --format 'bogus'")
    _refused(runner.invoke(app, [*command, "--format", "mooncake", *out]),
             "--format mooncake", "--trace is 'synthetic'")
    assert not (tmp_path / "o").exists()


def test_load_trace_refuses_contradictions(tmp_path: Path) -> None:
    from shared.ids import InvalidInput

    with pytest.raises(InvalidInput, match="--format synthetic"):
        sim_runner.load_trace(str(tmp_path / "t.jsonl"), "synthetic", seed=0, rate=None,
                              max_requests=None)
    with pytest.raises(InvalidInput, match="--trace is 'synthetic'"):
        sim_runner.load_trace("synthetic", "azure", seed=0, rate=None, max_requests=None)


# --- 12. --gpus that no pool fits ---------------------------------------------------------------
@pytest.mark.parametrize(("command", "gpus", "degrees", "problem"), [
    (["simulate"], "3", "2,4", "not a multiple of the smallest degree 2"),
    (["tune"], "3", "2,4", "not a multiple of the smallest degree 2"),
    (["simulate"], "6", "2,4", "node 0 has 6 GPUs, not a multiple of degree 4"),  # all-CP4
    (["simulate", "--policies", "vertumnus,sglang"], "6", "2,4", "not a multiple of degree 4"),
    (["simulate"], "20", "2,8", "node 2 has 4 GPUs, not a multiple of degree 8"),  # the largest
])
def test_gpus_that_a_compared_pool_cannot_use_are_refused(
        runner: CliRunner, tmp_path: Path, no_runs: None, command: list[str], gpus: str,
        degrees: str, problem: str) -> None:
    """Refused before the profile and the first run (it used to fail once the sweep had
    started, after the profile was measured)."""
    _refused(runner.invoke(app, [*command, "--gpus", gpus, "--degrees", degrees,
                                 "--out", str(tmp_path / "o")]),
             f"--gpus {gpus} with --degrees {degrees}", problem)
    assert not (tmp_path / "o").exists()


def test_gpus_that_only_an_unchosen_policy_cannot_use_are_taken(
        runner: CliRunner, tmp_path: Path, calls: dict[str, dict[str, Any]]) -> None:
    """6 GPUs hold 3×CP2 or 1×CP2 + 1×CP4 (as `up --gpus 6` runs) but no all-CP4 pool: only
    the policies that run one are refused."""
    res = runner.invoke(app, ["simulate", "--gpus", "6", "--policies",
                              "vertumnus,static,homo_cp2", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert calls["run_simulate"]["gpus"] == 6


def test_check_pools_takes_the_pools_of_the_policies_given() -> None:
    from shared.ids import InvalidInput
    from sim.experiments import check_pools

    check_pools(12, (2, 4, 8))  # homo is all-CP4 there: 8 + 4 GPUs both fit it
    check_pools(40, (2, 4))
    check_pools(16, (2, 4), gpus_per_node=4)
    check_pools(6, (2, 4), policies=("vertumnus", "static", "homo_cp2"))
    with pytest.raises(InvalidInput, match="node 0 has 6 GPUs, not a multiple of degree 4"):
        check_pools(6, (2, 4), policies=("vertumnus", "llmd"))
    with pytest.raises(InvalidInput, match="node 0 has 2 GPUs, not a multiple of degree 4"):
        check_pools(2, (2, 4))
    with pytest.raises(InvalidInput, match="exceeds the node size 4"):
        check_pools(16, (2, 8), gpus_per_node=4, policies=("vertumnus",))


def test_a_run_of_a_policy_whose_pool_fits_builds_only_that_pool() -> None:
    """deployment_for builds only the pool of the policy asked for: vertumnus on 6 GPUs does
    not need the all-CP4 pool that 6 GPUs cannot hold."""
    from services.controller.lattice import Composition, Lattice
    from shared.ids import InvalidInput
    from sim.experiments import ExperimentSpec, deployment_for

    lattice = Lattice(6, (2, 4))
    initial = Composition.from_counts(lattice, {2: 1, 4: 1})
    spec = ExperimentSpec(gpus=6)
    assert deployment_for("vertumnus", lattice, initial, spec).composition == initial
    assert deployment_for("homo_cp2", lattice, initial, spec).composition.describe() == "3CP2"
    with pytest.raises(InvalidInput, match="not a multiple of degree 4"):
        deployment_for("dynamo", lattice, initial, spec)
    with pytest.raises(InvalidInput, match="unknown policy 'nope'"):
        deployment_for("nope", lattice, initial, spec)


# --- a valid tiny run still runs -----------------------------------------------------------------
def test_a_tiny_valid_simulate_runs(runner: CliRunner, tmp_path: Path, profile_file: Path
                                    ) -> None:
    out = tmp_path / "new" / "run"  # --out's parents are made
    res = runner.invoke(app, [*SIM, "--rate-scale", "1, 2", "--profile", str(profile_file),
                              "--out", str(out)])
    assert res.exit_code == 0, res.output
    rows = json.loads((out / "results.json").read_text())
    assert [(r["policy"], r["rate_scale"]) for r in rows] == [("vertumnus", 1.0),
                                                              ("vertumnus", 2.0)]


def test_report_of_an_ablation_compares_the_full_manager_uncut(runner: CliRunner,
                                                                tmp_path: Path) -> None:
    """The ablation's rows have no vertumnus: the full manager is compared with the variant
    without it, and the long policy names are printed whole, not cut to fit 140 columns."""
    (tmp_path / "results.json").write_text(json.dumps(
        [_row("full", mean_ttft_s=2.947, p90_ttft_s=5.905),
         _row("no_replication", mean_ttft_s=4.206, p90_ttft_s=6.793)]))
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert "full against the strongest baseline" in res.output
    table = res.output[res.output.index("full against"):]
    assert table.count("no_replication") == 3 and "-29.9%" in table and "-13.1%" in table
    (comp,) = json.loads((tmp_path / "comparison.json").read_text())
    assert (comp["subject"], comp["strongest_baseline"]) == ("full", "no_replication")


def test_a_run_without_a_composition_leaves_no_earlier_composition_plot(
        runner: CliRunner, tmp_path: Path) -> None:
    """A run of fixed pools into an --out an adaptive run used before: that run's
    composition.png would pass for this one's. It is removed."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "composition.png").write_bytes(b"an earlier run's plot")
    res = runner.invoke(app, ["simulate", "--gpus", "8", "--policies", "static",
                              "--max-requests", "30", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert not (out / "composition.png").exists() and (out / "ttft_mean.png").exists()
