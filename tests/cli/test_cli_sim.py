"""``vertumnus simulate`` / ``report`` / ``profile`` / ``demo`` through the typer app."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from report_support import ROW_KEYS
from typer.testing import CliRunner

from shared.costmodel import Profile
from sim.experiments import ALL_POLICIES
from vertumnus.cli import app

ROOT = Path(__file__).resolve().parents[2]
PNGS = ("ttft_mean.png", "ttft_p90.png", "slo.png", "composition.png")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

SIM_ARGS = [
    "simulate",
    "--trace",
    "synthetic",
    "--policies",
    "vertumnus,homo",
    "--rate-scale",
    "1,2",
    "--gpus",
    "8",
    "--degrees",
    "2,4",
    "--seed",
    "0",
    "--max-requests",
    "200",
]


def _ok(result) -> str:
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    return result.output


@pytest.fixture(scope="module")
def sim_dir(tmp_path_factory, runner: CliRunner, profile_file: Path) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("simulate") / "run"
    res = runner.invoke(app, [*SIM_ARGS, "--out", str(out), "--profile", str(profile_file)])
    return out, _ok(res)


# --- simulate -----------------------------------------------------------------------------------
def test_simulate_writes_results_json(sim_dir) -> None:
    out, _ = sim_dir
    rows = json.loads((out / "results.json").read_text())
    assert isinstance(rows, list) and len(rows) == 4
    assert sorted((r["policy"], r["rate_scale"]) for r in rows) == sorted(
        (p, s) for p in ("vertumnus", "homo") for s in (1.0, 2.0)
    )
    for r in rows:
        assert ROW_KEYS <= set(r)
        assert r["requests"] == r["completed"] == 200
        assert r["oracle_mean_ttft_s"] <= r["mean_ttft_s"]
        assert 0 <= r["slo_attainment"] <= 1 and 0 <= r["hit_rate"] <= 1
        assert r["gpu_seconds"] > 0
    homo = [r for r in rows if r["policy"] == "homo"]
    assert all(r["composition_start"] == {"4": 2} for r in homo)


def test_simulate_writes_csv_meta_and_plots(sim_dir, profile_file) -> None:
    out, _ = sim_dir
    with (out / "results.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 4
    assert ROW_KEYS <= set(rows[0])
    js = json.loads((out / "results.json").read_text())
    assert [float(r["mean_ttft_s"]) for r in rows] == pytest.approx([r["mean_ttft_s"] for r in js])
    for name in PNGS:
        assert (out / name).read_bytes()[:8] == PNG_MAGIC, name
    meta = json.loads((out / "meta.json").read_text())
    assert (meta["gpus"], meta["degrees"], meta["seed"]) == (8, [2, 4], 0)
    # The given profile was used as is (no profiling run in the output directory).
    assert meta["profile"] == Profile.load(profile_file).to_dict()
    assert not (out / "profile").exists()


def test_simulate_prints_the_table(sim_dir) -> None:
    out, text = sim_dir
    assert "vertumnus" in text and "homo" in text
    assert f"{out}/results.json" in text.replace("\n", "")


def test_simulate_is_deterministic(sim_dir, runner, profile_file, tmp_path) -> None:
    out, _ = sim_dir
    res = runner.invoke(app, [*SIM_ARGS, "--out", str(tmp_path), "--profile", str(profile_file)])
    _ok(res)
    strip = ("wall_s", "sim_requests_per_wall_s")
    a = [
        {k: v for k, v in r.items() if k not in strip}
        for r in json.loads((out / "results.json").read_text())
    ]
    b = [
        {k: v for k, v in r.items() if k not in strip}
        for r in json.loads((tmp_path / "results.json").read_text())
    ]
    assert a == b


def test_report_redraws(sim_dir, runner, tmp_path) -> None:
    out, _ = sim_dir
    d = tmp_path / "copy"
    d.mkdir()
    for name in ("results.json", "meta.json"):
        shutil.copy(out / name, d / name)
    text = _ok(runner.invoke(app, ["report", str(d)]))
    for name in PNGS:
        assert (d / name).read_bytes()[:8] == PNG_MAGIC, name
    assert (d / "results.csv").read_text() == (out / "results.csv").read_text()
    assert (d / "comparison.csv").read_text() == (out / "comparison.csv").read_text()
    assert "vertumnus" in text and "homo" in text
    assert "vertumnus against the strongest baseline" in text


def test_simulate_writes_the_comparison_with_the_strongest_baseline(sim_dir) -> None:
    out, text = sim_dir
    rows = json.loads((out / "results.json").read_text())
    comp = json.loads((out / "comparison.json").read_text())
    assert [c["rate_scale"] for c in comp] == [1.0, 2.0]
    for c in comp:
        v, h = ({r["policy"]: r for r in rows if r["rate_scale"] == c["rate_scale"]}[p]
                for p in ("vertumnus", "homo"))
        assert c["strongest_baseline"] == c["best_p90_baseline"] == "homo"
        assert c["mean_change"] == pytest.approx(v["mean_ttft_s"] / h["mean_ttft_s"] - 1)
        assert c["slo_points"] == pytest.approx(
            100 * (v["slo_attainment"] - h["slo_attainment"]))
    with (out / "comparison.csv").open() as fh:
        flat = list(csv.DictReader(fh))
    assert [float(r["p90_change"]) for r in flat] == pytest.approx(
        [c["p90_change"] for c in comp])
    assert "vertumnus against the strongest baseline" in text


def test_report_without_results_fails(runner, tmp_path) -> None:
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2
    assert "results.json" in res.output
    (tmp_path / "results.json").write_text("{broken")
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 2 and "not valid JSON" in res.output


# --- simulate: bad input ------------------------------------------------------------------------
GOOD_LINE = json.dumps(
    {"timestamp": 0, "input_length": 1000, "output_length": 10, "hash_ids": [1, 2]}
)


@pytest.mark.parametrize(
    "line3,problem",
    [
        ('{"timestamp": 5, "input_length": 10', "not valid JSON"),
        (json.dumps({"timestamp": 5, "output_length": 1, "hash_ids": [1]}), "input_length"),
        (
            json.dumps({"timestamp": 5, "input_length": 1000, "output_length": 1, "hash_ids": [1]}),
            "hash_ids",
        ),
    ],
)
@pytest.mark.parametrize("fmt", ["auto", "mooncake"])
def test_bad_trace_line_exits_2_naming_file_and_line(
    runner, tmp_path, profile_file, line3, problem, fmt
) -> None:
    trace = tmp_path / "bad_trace.jsonl"
    trace.write_text("\n".join([GOOD_LINE, GOOD_LINE, line3, GOOD_LINE]) + "\n")
    res = runner.invoke(
        app,
        [
            "simulate",
            "--trace",
            str(trace),
            "--format",
            fmt,
            "--policies",
            "homo",
            "--gpus",
            "8",
            "--out",
            str(tmp_path / "out"),
            "--profile",
            str(profile_file),
        ],
    )
    assert res.exit_code == 2, res.output
    assert f"{trace}:3" in res.output
    assert problem in res.output
    assert "Traceback" not in res.output


def test_missing_trace_file_exits_2(runner, tmp_path) -> None:
    res = runner.invoke(
        app, ["simulate", "--trace", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "out")]
    )
    assert res.exit_code == 2 and "nope.jsonl" in res.output


def test_unknown_policy_exits_2_with_known_names(runner, tmp_path) -> None:
    res = runner.invoke(
        app,
        [
            "simulate",
            "--policies",
            "vertumnus,bogus",
            "--out",
            str(tmp_path / "out"),
            "--max-requests",
            "10",
        ],
    )
    assert res.exit_code == 2
    assert "bogus" in res.output
    for p in ALL_POLICIES:
        assert p in res.output
    assert not (tmp_path / "out" / "results.json").exists()


def test_options_are_checked_before_the_profile_is_measured(runner, tmp_path) -> None:
    """--cache-blocks-per-gpu was checked only once a profile had been measured on the trace;
    a pipe given as --trace was reported missing."""
    out = tmp_path / "o"
    res = runner.invoke(app, ["simulate", "--policies", "static", "--max-requests", "20",
                              "--gpus", "8", "--cache-blocks-per-gpu", "-5", "--out", str(out)])
    assert res.exit_code == 2 and "--cache-blocks-per-gpu must be" in res.output, res.output
    assert not (out / "profile").exists()
    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    res = runner.invoke(app, ["simulate", "--trace", str(fifo), "--out", str(out)])
    assert res.exit_code == 2 and "not a regular file" in res.output, res.output


@pytest.mark.parametrize(
    "args",
    [
        ["--rate-scale", "0"],
        ["--rate-scale", "x"],
        ["--degrees", "two"],
        ["--degrees", "0"],
        ["--jobs", "0"],
    ],
)
def test_bad_numbers_exit_2(runner, tmp_path, args) -> None:
    res = runner.invoke(app, ["simulate", *args, "--out", str(tmp_path / "out")])
    assert res.exit_code == 2
    assert "error:" in res.output


@pytest.mark.parametrize(
    "args,words",
    [
        (["--gpus", "6", "--degrees", "2,4"], "multiple of degree 4"),
        (["--degrees", "3"], "power of two"),
        (["--gpus", "0"], "--gpus"),
        (["--cache-blocks-per-gpu", "-1"], "--cache-blocks-per-gpu"),
    ],
)
def test_bad_cluster_exits_2(runner, tmp_path, profile_file, args, words) -> None:
    res = runner.invoke(
        app,
        [
            "simulate",
            "--policies",
            "homo",
            "--max-requests",
            "20",
            "--profile",
            str(profile_file),
            "--out",
            str(tmp_path / "o"),
            *args,
        ],
    )
    assert res.exit_code == 2, res.output
    assert "error:" in res.output and words in res.output
    assert not (tmp_path / "o" / "results.json").exists()


def test_policies_do_not_apply_to_a_fixed_deployment_preset(runner, tmp_path) -> None:
    res = runner.invoke(app, ["simulate", "--preset", "reconfig", "--policies", "homo",
                              "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert "error:" in res.output and "reconfig" in res.output and "--policies" in res.output
    assert not (tmp_path / "o" / "results.json").exists()


def test_list_presets(runner) -> None:
    text = _ok(runner.invoke(app, ["simulate", "--list-presets"]))
    for name in ("conversation", "leval", "azure-code", "reconfig", "ablation"):
        assert re.search(rf"^{re.escape(name)}\s", text, re.M), name


# --- profile ------------------------------------------------------------------------------------
def test_profile_writes_a_loadable_profile(runner, tmp_path) -> None:
    out = tmp_path / "prof"
    text = _ok(
        runner.invoke(app, ["profile", "--backend", "sim", "--out", str(out), "--degrees", "1,2,4"])
    )
    prof = Profile.load(out / "profile.json")
    assert set(prof.kappa) == {1, 2, 4}
    assert all(k > 0 for k in prof.kappa.values())
    # The fit is close to the note's (ground-truth.md): d ≈ 91 ms, α ≈ 6.6 ns per pair.
    assert 0.05 < prof.coefficients.d < 0.15
    assert 4e-9 < prof.coefficients.alpha < 9e-9
    assert prof.fit_mape is not None and prof.fit_mape < 0.15
    assert str(out / "profile.json") in text.replace("\n", "")
    assert "kappa" in text


def test_profile_takes_kappa_repeats(runner, tmp_path) -> None:
    """``--kappa-repeats N``: κ_C is the median of N ramps per degree, every draw in the
    report."""
    out = tmp_path / "prof"
    _ok(runner.invoke(app, ["profile", "--out", str(out), "--degrees", "2,4",
                            "--kappa-repeats", "3"]))
    report = json.loads((out / "profile_report.json").read_text())
    prof = Profile.load(out / "profile.json")
    assert report["kappa_repeats"] == 3
    for c in (2, 4):
        draws = report["kappa_ramp"]["results"][str(c)]["draws"]
        assert len(draws) == 3 and prof.kappa[c] == sorted(draws)[1]


PROFILE_MAPE_BUG = (
    "vertumnus/cmd_sim.py profile(): prints report keys 'mape_vs_measured' / 'mape_vs_truth', "
    "but sim/profiling.py writes 'fit_vs_measured' / 'fit_vs_truth' to profile_report.json, "
    "so the command never shows the fit error it promises ('report MAPE', design.md)"
)


def test_profile_reports_the_fit_error(runner, tmp_path) -> None:
    out = tmp_path / "prof"
    text = _ok(
        runner.invoke(app, ["profile", "--backend", "sim", "--out", str(out), "--degrees", "1,2"])
    )
    report = json.loads((out / "profile_report.json").read_text())
    mape = report["fit_vs_measured"]["mape"]
    assert 0 < mape < 0.2
    assert "mape" in text.lower()


def test_profile_rejects_unknown_backend(runner, tmp_path) -> None:
    res = runner.invoke(app, ["profile", "--backend", "quantum", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "quantum" in res.output
    assert not (tmp_path / "profile.json").exists()


def test_profile_measures_a_pooled_kappa_on_a_trace(runner, tmp_path) -> None:
    """``--pool-gpus``: κ of a routed pool replaying the workload in order with its prefix
    reuse (what a sweep of that workload measures), marked pooled; the fit is the same."""
    from sim.profiling import trace_kappa
    from sim.workloads import generate

    single, pooled = tmp_path / "single", tmp_path / "pooled"
    _ok(runner.invoke(app, ["profile", "--degrees", "1,2", "--out", str(single)]))
    text = _ok(runner.invoke(app, ["profile", "--degrees", "1,2", "--out", str(pooled),
                                   "--pool-gpus", "8"]))
    p_single = Profile.load(single / "profile.json")
    p_pooled = Profile.load(pooled / "profile.json")
    assert not p_single.kappa_pooled and p_pooled.kappa_pooled
    assert p_pooled.coefficients == p_single.coefficients
    report = json.loads((pooled / "profile_report.json").read_text())
    assert report["kappa_pooled"] is True
    assert report["kappa_ramp"]["pool_workers"] == 8
    assert report["kappa_ramp"]["pool_workers_per_degree"] == {"1": 8, "2": 4}  # 8 GPUs / C
    assert "pool_workers_per_degree" not in json.loads(
        (single / "profile_report.json").read_text())["kappa_ramp"]
    # The κ the sweep's method gives the same fit on the same (default, synthetic) workload.
    expected, _ = trace_kappa(p_single, generate(seed=0), degrees=(1, 2), seed=0, pool_gpus=8)
    assert p_pooled.kappa == expected.kappa
    # A load-aware pool routes around long prompts: each worker sustains more than alone.
    assert all(p_pooled.kappa[c] > p_single.kappa[c] for c in (1, 2))
    assert "kappa_pooled: true" in text


def test_profile_with_kappa_degrees_writes_the_profile_simulate_measures(runner,
                                                                         tmp_path) -> None:
    """``simulate --degrees 2,4`` fits Ê on {1, 2, 4} and measures the pooled κ on 2 and 4
    only; ``profile --degrees 1,2,4 --kappa-degrees 2,4 --pool-gpus N`` does the same, so its
    file is the sweep's, κ included (without --kappa-degrees a CP1 ramp draws from the shared
    streams first and every later κ differs)."""
    sim_out, prof_out, all_out = tmp_path / "sim", tmp_path / "prof", tmp_path / "all"
    _ok(runner.invoke(app, ["simulate", "--trace", "synthetic", "--policies", "round_robin",
                            "--rate-scale", "1", "--gpus", "8", "--degrees", "2,4",
                            "--out", str(sim_out)]))
    _ok(runner.invoke(app, ["profile", "--degrees", "1,2,4", "--kappa-degrees", "2,4",
                            "--pool-gpus", "8", "--out", str(prof_out)]))
    _ok(runner.invoke(app, ["profile", "--degrees", "1,2,4", "--pool-gpus", "8",
                            "--out", str(all_out)]))
    swept = json.loads((sim_out / "profile" / "profile.json").read_text())
    profiled = json.loads((prof_out / "profile.json").read_text())
    assert set(swept["kappa"]) == {"2", "4"}
    assert profiled == swept
    every = json.loads((all_out / "profile.json").read_text())
    assert set(every["kappa"]) == {"1", "2", "4"}
    assert every["coefficients"] == swept["coefficients"]
    assert every["kappa"]["2"] != swept["kappa"]["2"]
    report = json.loads((prof_out / "profile_report.json").read_text())
    assert report["degrees"] == [1, 2, 4] and report["kappa_degrees"] == [2, 4]


def test_profile_takes_an_leval_trace_with_its_rate(runner, tmp_path) -> None:
    """L-Eval has no arrival times: ``--rate`` sets them, as for ``simulate``; the pooled ramp
    replays its documents' questions with their reuse."""
    f = tmp_path / "lv.jsonl"
    f.write_text("".join(json.dumps({
        "task": "t", "doc_sha1": f"d{i // 4}", "instr_idx": i % 4, "doc_llama3_tokens": 6000,
        "instr_llama3_tokens": 40, "llama3_tokens": 6040, "ref_output_llama3_tokens": 5,
    }) + "\n" for i in range(40)))
    out = tmp_path / "prof"
    _ok(runner.invoke(app, ["profile", "--degrees", "2,4", "--out", str(out), "--workload",
                            str(f), "--rate", "2", "--pool-gpus", "16"]))
    report = json.loads((out / "profile_report.json").read_text())
    assert report["kappa_workload"]["requests"] == 40
    assert report["kappa_ramp"]["pool_workers_per_degree"] == {"2": 8, "4": 4}
    assert all(k > 0 for k in Profile.load(out / "profile.json").kappa.values())


@pytest.mark.parametrize(("args", "words"), [
    (["--pool-gpus", "-1"], "--pool-gpus must be an integer >= 0"),
    (["--rate", "-2"], "--rate must be a finite number"),
    (["--backend", "torch", "--pool-gpus", "8"], "the torch backend measures"),
    (["--backend", "torch", "--kappa-degrees", "2"], "the torch backend measures"),
    (["--degrees", "1,2", "--kappa-degrees", "4"], "--kappa-degrees 4 must be among --degrees"),
    (["--kappa-degrees", "2,x"], "--kappa-degrees must be comma-separated integers"),
    (["--workload", "synthetic", "--format", "azure"], "azure"),
])
def test_profile_refuses_bad_kappa_options(runner, tmp_path, args, words) -> None:
    res = runner.invoke(app, ["profile", *args, "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert words in " ".join(res.output.split()), res.output
    assert not (tmp_path / "o" / "profile.json").exists()


# --- --hardware ---------------------------------------------------------------------------------
def test_simulate_on_a_hardware_file(sim_dir, runner, profile_file, tmp_path) -> None:
    """The sweep runs on the file's hardware and records it; the same trace on a faster GPU
    has a lower zero-queue limit at every (policy, rate). (The H20 profile on H200 is a
    mismatch the run refuses unless told: the oracle here needs no profile.)"""
    out, _ = sim_dir
    hw = tmp_path / "h200.toml"
    hw.write_text('gpu = "H200"\n')
    fast = tmp_path / "fast"
    _ok(runner.invoke(app, [*SIM_ARGS, "--out", str(fast), "--profile", str(profile_file),
                            "--hardware", str(hw), "--profile-mismatch-ok"]))
    meta = json.loads((fast / "meta.json").read_text())
    assert meta["hardware"]["gpu"]["name"] == "H200"
    assert meta["hardware"]["memory_gpu"]["name"] == "H200"
    assert json.loads((out / "meta.json").read_text())["hardware"]["gpu"]["name"] == "H20"
    base = {(r["policy"], r["rate_scale"]): r for r in
            json.loads((out / "results.json").read_text())}
    rows = json.loads((fast / "results.json").read_text())
    assert len(rows) == len(base)
    for r in rows:
        assert r["oracle_mean_ttft_s"] < base[(r["policy"], r["rate_scale"])][
            "oracle_mean_ttft_s"]


def test_profile_on_a_hardware_file(runner, tmp_path) -> None:
    hw = tmp_path / "h200.json"
    hw.write_text(json.dumps({"gpu": "H200"}))
    out = tmp_path / "prof"
    _ok(runner.invoke(app, ["profile", "--backend", "sim", "--out", str(out), "--degrees",
                            "1,2", "--hardware", str(hw)]))
    report = json.loads((out / "profile_report.json").read_text())
    assert report["gpu"] == "H200" and report["hardware"]["gpu"]["name"] == "H200"
    # Fitted on that GPU: its fixed cost is well under the H20 fit's (d ≈ 91 ms there).
    assert Profile.load(out / "profile.json").coefficients.d < 0.05
    assert not Profile.load(out / "profile.json").per_degree
    per = tmp_path / "per"
    _ok(runner.invoke(app, ["profile", "--backend", "sim", "--out", str(per), "--degrees",
                            "1,2", "--hardware", str(hw), "--per-degree"]))
    assert set(Profile.load(per / "profile.json").per_degree) == {1, 2}


@pytest.mark.parametrize(("command", "words"), [
    (["simulate", "--trace", "synthetic"], "gpu: unknown GPU preset 'B300'"),
    (["simulate", "--preset", "ablation"], "gpu: unknown GPU preset 'B300'"),
    (["profile", "--backend", "sim"], "gpu: unknown GPU preset 'B300'"),
    (["profile", "--backend", "torch"], "the torch backend measures the machine it runs on"),
    (["profile", "--backend", "torch", "--per-degree"], "the torch backend measures"),
])
def test_a_bad_hardware_file_exits_2_naming_the_key(runner, tmp_path, command, words) -> None:
    hw = tmp_path / "hw.toml"
    hw.write_text('gpu = "B300"\n' if "--per-degree" not in command else 'gpu = "H200"\n')
    res = runner.invoke(app, [*command, "--hardware", str(hw), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert words in " ".join(res.output.split()), res.output
    assert not (tmp_path / "o" / "results.json").exists()


# --- demo ---------------------------------------------------------------------------------------
ROW = re.compile(
    r"^(\*| ) (w-cp\d+-g\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+"
    r"([-\d.]+)\s+([-\d.]+)\s*$"
)


@pytest.mark.parametrize("beta,lam", [(1.5, 0.5), (2.0, 0.0)])
def test_demo_prints_j_terms_scan_and_plan(runner, beta, lam) -> None:
    text = _ok(runner.invoke(app, ["demo", "--beta", str(beta), "--lam", str(lam)]))
    assert f"β={beta}" in text and f"λ={lam}" in text
    rows = [m for m in (ROW.match(line) for line in text.splitlines()) if m]
    assert len(rows) >= 15  # 5 requests × 3 workers
    chosen = 0
    tables: list[list[re.Match[str]]] = []
    for m in rows:
        if m.group(2) == "w-cp4-g0" or not tables:
            tables.append([])
        tables[-1].append(m)
    for tab in tables:
        js = [float(m.group(9)) for m in tab]
        for m in tab:
            q, s, extra, j = (float(m.group(k)) for k in (6, 7, 8, 9))
            assert j == pytest.approx(q + beta * s + lam * extra, abs=3e-4), m.group(0)
            assert int(m.group(4)) + int(m.group(5)) > 0
        star = [m for m in tab if m.group(1) == "*"]
        assert len(star) == 1 and float(star[0].group(9)) == min(js)
        chosen += 1
    assert chosen == 5
    # The document's second follow-up goes to a CP2 worker while the CP4 holder is busy: the
    # cache manager pulls the 32-block document to it.
    assert "route-time pull: 32 blocks of the prefix from w-cp4-g0 to w-cp2-" in text
    assert "Prefix-cache scan" in text and "action:" in text
    assert "Controller" in text and "plan:" in text and "'kind': 'split'" in text


# --- the console script -------------------------------------------------------------------------
def test_console_script_help() -> None:
    exe = Path(sys.executable).with_name("vertumnus")
    assert exe.exists(), f"console script missing next to {sys.executable}"
    out = subprocess.run(
        [str(exe), "--help"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    for cmd in ("simulate", "report", "profile", "demo"):
        assert cmd in out.stdout


def test_per_degree_applies_to_the_profile_measured_here(runner, tmp_path, profile_file) -> None:
    res = runner.invoke(app, [*SIM_ARGS, "--out", str(tmp_path / "o"), "--profile",
                              str(profile_file), "--per-degree"])
    assert res.exit_code == 2 and "--profile gives one" in res.output, res.output


def test_hardware_prints_a_template_and_checks_a_file(runner, tmp_path) -> None:
    from sim.groundtruth import GroundTruth
    from sim.hardware import ground_truth_from_mapping

    res = CliRunner().invoke(app, ["hardware"])
    _ok(res)
    template = json.loads(res.stdout)  # stdout is a hardware file; the summary is on stderr
    assert ground_truth_from_mapping(template) == GroundTruth()
    assert "Qwen3-30B-A3B on H20" in res.stderr
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({**template, "gpu": "H200", "memory_gpu": "H200"}))
    res = CliRunner().invoke(app, ["hardware", str(mine)])
    assert json.loads(_ok(res) and res.stdout)["gpu"]["name"] == "H200"
    mine.write_text(json.dumps({"gpu": {"name": "X"}}))
    res = runner.invoke(app, ["hardware", str(mine)])
    assert res.exit_code == 2 and "gpu: missing field(s)" in " ".join(res.output.split())


def test_synthetic_prints_a_workload_file_that_simulate_runs(runner, tmp_path,
                                                            profile_file) -> None:
    import tomllib

    from sim.workloads.synthetic import SyntheticConfig
    from sim.workloads.synthetic_file import config_from_mapping

    res = CliRunner().invoke(app, ["synthetic"])
    _ok(res)
    # stdout is a workload file; the summary is on stderr
    assert config_from_mapping(tomllib.loads(res.stdout)) == SyntheticConfig()
    assert "600 s in 4 segment(s) at 3.2-16 req/s" in res.stderr
    mine = tmp_path / "agent.toml"
    mine.write_text(res.stdout.replace("rate = 8.0", "rate = 3.0").replace(
        "n_system_prompts = 6", "n_system_prompts = 2"))
    res = CliRunner().invoke(app, ["synthetic", "--json", str(mine)])
    as_json = json.loads(_ok(res) and res.stdout)
    assert (as_json["rate"], as_json["n_system_prompts"]) == (3.0, 2)
    # simulate runs it (TOML by its suffix, JSON with --format synthetic), and meta.json
    # records the parameters as a workload file again.
    js = tmp_path / "agent.json"
    js.write_text(json.dumps(as_json))
    outs = []
    for trace, fmt in ((mine, "auto"), (js, "synthetic")):
        out = tmp_path / f"o-{fmt}"
        _ok(runner.invoke(app, ["simulate", "--trace", str(trace), "--format", fmt,
                                "--policies", "homo", "--rate-scale", "1", "--gpus", "8",
                                "--max-requests", "100", "--profile", str(profile_file),
                                "--out", str(out)]))
        meta = json.loads((out / "meta.json").read_text())
        assert meta["workload"] == "agent"
        assert config_from_mapping(meta["synthetic"]) == config_from_mapping(as_json)
        outs.append(json.loads((out / "results.json").read_text())[0]["mean_ttft_s"])
    assert outs[0] == outs[1]
    # Bad files: named, exit 2, no traceback.
    mine.write_text("rate = -1\n")
    for args in (["synthetic", str(mine)],
                 ["simulate", "--trace", str(mine), "--out", str(tmp_path / "bad")]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert f"{mine}: rate must be > 0 req/s" in " ".join(res.output.split())
    res = runner.invoke(app, ["simulate", "--trace", str(js), "--out", str(tmp_path / "bad")])
    assert res.exit_code == 2
    assert "a synthetic workload file in JSON needs --format synthetic" in " ".join(
        res.output.split())


def test_controller_config_prints_a_file_that_simulate_and_tune_run(runner, tmp_path,
                                                                     profile_file) -> None:
    import tomllib

    from services.calibration import CONTROLLER
    from services.controller.config_file import config_from_mapping

    res = CliRunner().invoke(app, ["controller-config"])
    _ok(res)
    # stdout is a controller file (the calibrated setting); the summary is on stderr
    assert config_from_mapping(tomllib.loads(res.stdout)) == CONTROLLER
    assert "the calibrated setting" in res.stderr
    mine = tmp_path / "ctl.toml"
    mine.write_text(res.stdout.replace("persistence = 2", "persistence = 1"))
    res = CliRunner().invoke(app, ["controller-config", "--json", str(mine)])
    assert json.loads(_ok(res) and res.stdout)["persistence"] == 1
    assert "differs from the calibrated setting in persistence" in res.stderr
    # The same overloaded run with and without the file: persistence 1 acts on the first
    # window that signals, the calibrated 2 not within these 200 requests. meta.json records
    # the setting each ran with.
    args = [*SIM_ARGS[:4], "vertumnus", "--rate-scale", "2", "--gpus", "8", "--max-requests",
            "200", "--profile", str(profile_file)]
    reconf, persistence = [], []
    for extra in ([], ["--controller", str(mine)]):
        out = tmp_path / f"o{len(extra)}"
        text = _ok(runner.invoke(app, [*args, *extra, "--out", str(out)]))
        assert ("differs from the calibrated setting in persistence)" in text) == bool(extra)
        reconf.append(json.loads((out / "results.json").read_text())[0]["reconfigurations"])
        persistence.append(json.loads((out / "meta.json").read_text())["controller"][
            "persistence"])
    assert persistence == [2, 1]
    assert reconf[0] == 0 < reconf[1]
    out = tmp_path / "tune"
    _ok(runner.invoke(app, ["tune", "--max-requests", "100", "--gpus", "8", "--beta", "2",
                            "--lam", "0.25", "--rate-scale", "1", "--profile", str(profile_file),
                            "--controller", str(mine), "--out", str(out)]))
    assert json.loads((out / "tune.json").read_text())["meta"]["controller"]["persistence"] == 1
    out = tmp_path / "size"
    _ok(runner.invoke(app, ["size", "--policies", "vertumnus", "--max-requests", "100",
                            "--gpus-max", "8", "--profile", str(profile_file),
                            "--controller", str(mine), "--out", str(out)]))
    assert json.loads((out / "size.json").read_text())["meta"]["controller"]["persistence"] == 1


def test_a_bad_controller_file_exits_2_naming_it(runner, tmp_path) -> None:
    mine = tmp_path / "ctl.toml"
    mine.write_text("upper = 0.8\n")
    for args in (["controller-config", str(mine)],
                 ["simulate", "--controller", str(mine), "--out", str(tmp_path / "o")],
                 ["size", "--controller", str(mine), "--out", str(tmp_path / "o")]):
        res = runner.invoke(app, args)
        assert res.exit_code == 2 and "Traceback" not in res.output, res.output
        assert (f"{mine}: ControllerConfig.preference_headroom must be None or in (0, "
                f"upper=0.8], got 0.9 (preference_headroom is not in the file and keeps 0.9; "
                f"set it there too)") in " ".join(res.output.split())
    res = runner.invoke(app, ["simulate", "--controller", str(tmp_path / "none.toml"),
                              "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--controller" in res.output
    mine.write_text("persistence = 1\n")
    res = runner.invoke(app, ["simulate", "--preset", "ablation", "--controller", str(mine),
                              "--out", str(tmp_path / "o")])
    assert res.exit_code == 2
    assert "preset 'ablation' holds its composition fixed: a controller setting does not " \
           "apply to it" in " ".join(res.output.split())


# --- tune ---------------------------------------------------------------------------------------
def test_tune_runs_every_pair_and_names_the_best(runner, tmp_path, profile_file) -> None:
    out = tmp_path / "tune"
    text = _ok(runner.invoke(app, [
        "tune", "--max-requests", "200", "--gpus", "8", "--beta", "1,2", "--lam", "0,1",
        "--rate-scale", "1,2", "--profile", str(profile_file), "--out", str(out)]))
    got = json.loads((out / "tune.json").read_text())
    assert sorted((r["beta"], r["lam"], r["rate_scale"]) for r in got["rows"]) == sorted(
        (b, lam, s) for b in (1.0, 2.0) for lam in (0.0, 1.0) for s in (1.0, 2.0))
    pairs = got["pairs"]
    assert len(pairs) == 4
    for p in pairs:  # each pair's figure is the average of its rows
        mine = [r["mean_ttft_s"] for r in got["rows"]
                if (r["beta"], r["lam"]) == (p["beta"], p["lam"])]
        assert p["mean_ttft_s"] == pytest.approx(sum(mine) / len(mine))
    assert [p["mean_ttft_s"] for p in pairs] == sorted(p["mean_ttft_s"] for p in pairs)
    assert got["best"] == {"beta": pairs[0]["beta"], "lam": pairs[0]["lam"]}
    assert f"best: β {pairs[0]['beta']:g}, λ {pairs[0]['lam']:g}" in text
    with (out / "tune.csv").open() as fh:
        assert len(list(csv.DictReader(fh))) == 8
    # A cell is the one simulate runs with those weights.
    sim_out = tmp_path / "sim"
    _ok(runner.invoke(app, [*SIM_ARGS, "--gpus", "8", "--policies", "vertumnus", "--beta", "2",
                            "--lam", "1", "--profile", str(profile_file), "--out",
                            str(sim_out)]))
    sim_rows = json.loads((sim_out / "results.json").read_text())
    for r in sim_rows:
        cell = next(c for c in got["rows"] if (c["beta"], c["lam"], c["rate_scale"])
                    == (2.0, 1.0, r["rate_scale"]))
        assert cell["mean_ttft_s"] == r["mean_ttft_s"]


def test_tune_chooses_among_controller_files(runner, tmp_path, profile_file) -> None:
    """Several --controller files are a third axis of tune's grid: every (β, λ) runs with each
    ('calibrated' names the calibrated setting), a cell is the simulate run with that file."""
    mine = tmp_path / "eager.toml"
    mine.write_text("persistence = 1\n")
    out = tmp_path / "tune"
    common = ["--max-requests", "200", "--gpus", "8", "--profile", str(profile_file)]
    text = _ok(runner.invoke(app, [
        "tune", *common, "--beta", "3", "--lam", "0,0.25", "--rate-scale", "1,2",
        "--controller", f"calibrated,{mine}", "--out", str(out)]))
    got = json.loads((out / "tune.json").read_text())
    labels = ("calibrated", str(mine))
    assert sorted((r["lam"], r["controller"], r["rate_scale"]) for r in got["rows"]) == sorted(
        (lam, c, sc) for lam in (0.0, 0.25) for c in labels for sc in (1.0, 2.0))
    assert len(got["pairs"]) == 4 and set(got["meta"]["controllers"]) == set(labels)
    assert got["meta"]["controllers"][str(mine)]["persistence"] == 1
    best = got["pairs"][0]
    assert got["best"] == {k: best[k] for k in ("beta", "lam", "controller")}
    assert f"best: β 3, λ {best['lam']:g}" in " ".join(text.split())
    with (out / "tune.csv").open() as fh:
        reader = csv.DictReader(fh)
        assert reader.fieldnames[:3] == ["beta", "lam", "controller"]
        assert len(list(reader)) == 8
    # The eager file's cells are the simulate runs with that file (and differ from the
    # calibrated ones: it reconfigures where the calibrated controller does not).
    sim_out = tmp_path / "sim"
    _ok(runner.invoke(app, [*SIM_ARGS[:4], "vertumnus", "--rate-scale", "1,2", *common,
                            "--beta", "3", "--lam", "0.25", "--controller", str(mine),
                            "--out", str(sim_out)]))
    for r in json.loads((sim_out / "results.json").read_text()):
        cell = next(c for c in got["rows"] if (c["lam"], c["controller"], c["rate_scale"])
                    == (0.25, str(mine), r["rate_scale"]))
        assert (cell["mean_ttft_s"], cell["reconfigurations"]) == (
            r["mean_ttft_s"], r["reconfigurations"])
    assert any(c["reconfigurations"] != d["reconfigurations"] for c in got["rows"]
               for d in got["rows"] if c["controller"] != d["controller"]
               and (c["lam"], c["rate_scale"]) == (d["lam"], d["rate_scale"]))
    res = runner.invoke(app, ["tune", *common, "--controller", f"{mine},{mine}",
                              "--out", str(tmp_path / "bad")])
    assert res.exit_code == 2 and "controller" in res.output


def test_tune_and_simulate_take_the_busy_share_power(runner, tmp_path, profile_file) -> None:
    """``--beta-busy-power 0`` (the paper's constant β) reaches every J run of both commands:
    a tune cell is the simulate cell with the same setting; meta.json / tune.json record it."""
    common = ["--max-requests", "200", "--gpus", "8", "--profile", str(profile_file)]
    tuned = {}
    for k in ("0", "-1"):
        out = tmp_path / f"tune{k}"
        _ok(runner.invoke(app, ["tune", *common, "--beta", "3", "--lam", "0.25", "--rate-scale",
                                "2", "--beta-busy-power", k, "--out", str(out)]))
        got = json.loads((out / "tune.json").read_text())
        assert got["meta"]["beta_busy_power"] == (0.0 if k == "0" else 2.0)
        tuned[k] = got["rows"][0]["mean_ttft_s"]
    sim_out = tmp_path / "sim"
    _ok(runner.invoke(app, ["simulate", "--trace", "synthetic", *common, "--policies",
                            "vertumnus", "--rate-scale", "2", "--beta", "3", "--lam", "0.25",
                            "--beta-busy-power", "0", "--out", str(sim_out)]))
    assert json.loads((sim_out / "results.json").read_text())[0]["mean_ttft_s"] == tuned["0"]
    # The calibrated default (busy share on) is another placement rule: another run.
    assert tuned["-1"] != tuned["0"]
    res = runner.invoke(app, ["tune", *common, "--beta-busy-power", "-2", "--out",
                              str(tmp_path / "bad")])
    assert res.exit_code == 2 and "--beta-busy-power must be" in " ".join(res.output.split())


@pytest.mark.parametrize(("args", "words"), [
    (["--beta", "0.5"], "beta must be a finite number >= 1.0"),
    (["--lam", "-1"], "lam must be a finite number >= 0"),
    (["--beta", ""], "beta"),
])
def test_tune_rejects_weights_j_does_not_take(runner, tmp_path, args, words) -> None:
    res = runner.invoke(app, ["tune", "--max-requests", "50", "--out", str(tmp_path), *args])
    assert res.exit_code == 2 and words in " ".join(res.output.split()), res.output
    assert not (tmp_path / "tune.json").exists()


def test_simulate_takes_the_pull_setting(runner, tmp_path, profile_file) -> None:
    """``--pull-min-blocks`` reaches vertumnus's cache manager (0: off; meta.json records the
    setting used, the calibrated one by default); a negative value, or the option with a
    preset, which fixes vertumnus's settings, is refused before anything runs."""
    common = ["simulate", "--trace", "synthetic", "--max-requests", "300", "--gpus", "8",
              "--profile", str(profile_file), "--policies", "vertumnus,homo", "--rate-scale", "2"]
    metas, rows = {}, {}
    for k in ("0", "-1", "1"):
        out = tmp_path / f"pull{k}"
        _ok(runner.invoke(app, [*common, "--pull-min-blocks", k, "--out", str(out)]))
        metas[k] = json.loads((out / "meta.json").read_text())["pull_min_blocks"]
        rows[k] = {r["policy"]: r for r in json.loads((out / "results.json").read_text())}
    assert metas == {"0": 0, "-1": 2, "1": 1}
    assert rows["0"]["vertumnus"]["pulls"] == 0
    assert rows["1"]["vertumnus"]["pulls"] > 0
    assert rows["1"]["homo"]["pulls"] == 0  # a baseline has no cache manager
    # The copies' waits for their workers' links are reported with them (none here without pulls).
    assert (rows["0"]["vertumnus"]["copy_waits"], rows["0"]["vertumnus"]["copy_wait_s"]) == (0, 0)
    assert rows["1"]["vertumnus"]["copy_wait_s"] >= 0
    assert "copy_waits" in (tmp_path / "pull1" / "results.csv").read_text().splitlines()[0]
    _refused(runner, tmp_path, ((["--pull-min-blocks", "-2", *common[1:]],
                                 "--pull-min-blocks must be an integer >= 0"),
                                (["--preset", "conversation", "--pull-min-blocks", "4"],
                                 "leave out --pull-min-blocks")))


def _refused(runner, tmp_path, cases) -> None:
    """Each (simulate arguments, words) exits with code 2 naming the problem, writing nothing."""
    for bad, words in cases:
        out = tmp_path / "bad"
        res = runner.invoke(app, ["simulate", *bad, "--out", str(out)])
        assert res.exit_code == 2 and words in " ".join(res.output.split()), res.output
        assert not (out / "results.json").exists()


def test_simulate_takes_the_pull_credit_setting(runner, tmp_path, profile_file) -> None:
    """``--pull-credit-blocks`` reaches J (0: no credit; meta.json records the setting used,
    the calibrated 256 by default, and 0 when the pull is off); a negative value, one below the
    pull's min_blocks, or the option with a preset is refused before anything runs."""
    common = ["simulate", "--trace", "synthetic", "--max-requests", "300", "--gpus", "8",
              "--profile", str(profile_file), "--policies", "vertumnus", "--rate-scale", "2"]
    metas, rows = {}, {}
    for name, extra in (("off", ["--pull-credit-blocks", "0"]), ("default", []),
                        ("on", ["--pull-credit-blocks", "256"]),
                        ("nopull", ["--pull-min-blocks", "0", "--pull-credit-blocks", "64"])):
        out = tmp_path / name
        _ok(runner.invoke(app, [*common, *extra, "--out", str(out)]))
        metas[name] = json.loads((out / "meta.json").read_text())["pull_credit_blocks"]
        rows[name] = json.loads((out / "results.json").read_text())[0]
    assert metas == {"off": 0, "default": 256, "on": 256, "nopull": 0}
    assert rows["on"]["mean_ttft_s"] == rows["default"]["mean_ttft_s"]
    assert rows["off"]["mean_ttft_s"] != rows["on"]["mean_ttft_s"]  # J placed otherwise
    _refused(runner, tmp_path, (
        (["--pull-credit-blocks", "-2", *common[1:]],
         "--pull-credit-blocks must be an integer >= 0"),
        (["--pull-credit-blocks", "1", *common[1:]],
         "--pull-credit-blocks (1) must be 0 or at least --pull-min-blocks (2)"),
        (["--preset", "conversation", "--pull-credit-blocks", "4"],
         "leave out --pull-credit-blocks")))


def test_simulate_takes_the_pull_wait_setting(runner, tmp_path, profile_file) -> None:
    """``--pull-wait/--no-pull-wait`` reaches J's credit (meta.json records it: the calibrated
    on by default, off when the pull is); the wait changes where J places; with a preset it
    is refused."""
    common = ["simulate", "--trace", "synthetic", "--max-requests", "300", "--gpus", "8",
              "--profile", str(profile_file), "--policies", "vertumnus", "--rate-scale", "2"]
    metas, rows = {}, {}
    for name, extra in (("default", []), ("on", ["--pull-wait"]), ("off", ["--no-pull-wait"]),
                        ("nopull", ["--pull-min-blocks", "0", "--pull-wait"])):
        out = tmp_path / name
        _ok(runner.invoke(app, [*common, *extra, "--out", str(out)]))
        metas[name] = json.loads((out / "meta.json").read_text())["pull_wait"]
        rows[name] = json.loads((out / "results.json").read_text())[0]
    assert metas == {"default": True, "on": True, "off": False, "nopull": False}
    assert rows["on"]["mean_ttft_s"] == rows["default"]["mean_ttft_s"]
    assert rows["off"]["mean_ttft_s"] != rows["on"]["mean_ttft_s"]
    _refused(runner, tmp_path, (
        (["--preset", "conversation", "--no-pull-wait"], "leave out --pull-wait"),))


@pytest.fixture
def sim_configs(monkeypatch) -> list:
    """(:class:`SimConfig`, the simulator) of every simulator built in this process (the runs
    go through ``--jobs 1``, so every run is in this process and seen here)."""
    import sim.simulator as simulator_module

    seen: list = []
    real_init = simulator_module.Simulator.__init__

    def recording_init(self, config, *args, **kwargs) -> None:
        real_init(self, config, *args, **kwargs)
        seen.append((config, self))

    monkeypatch.setattr(simulator_module.Simulator, "__init__", recording_init)
    return seen


def test_simulate_takes_the_pending_credit_setting(runner, tmp_path, profile_file,
                                                   sim_configs) -> None:
    """``--pending-credit/--no-pending-credit`` reaches the simulator (meta.json records it:
    on by default, as calibrated); the reconfiguration and trace presets take it, the
    ablation (a fixed composition) refuses it."""
    common = ["simulate", "--trace", "synthetic", "--max-requests", "300", "--gpus", "8",
              "--profile", str(profile_file), "--policies", "vertumnus", "--rate-scale", "2",
              "--jobs", "1"]
    metas, got = {}, {}
    for name, extra in (("default", []), ("on", ["--pending-credit"]),
                        ("off", ["--no-pending-credit"]),
                        ("nopull", ["--pull-min-blocks", "0", "--pending-credit"])):
        out = tmp_path / name
        sim_configs.clear()
        _ok(runner.invoke(app, [*common, *extra, "--out", str(out)]))
        metas[name] = json.loads((out / "meta.json").read_text())["pending_credit"]
        assert sim_configs, name  # the runs were in this process
        got[name] = {(c.pending_credit, c.pull is not None, sim._pending_credit)
                     for c, sim in sim_configs}
    assert metas == {"default": True, "on": True, "off": False, "nopull": False}
    # What the simulator was given, not what meta.json says it was: (the setting, a pull,
    # the credit in effect). Without a pull there is no credit, so the setting does nothing.
    assert got == {"default": {(True, True, True)}, "on": {(True, True, True)},
                   "off": {(False, True, False)}, "nopull": {(True, False, False)}}
    _refused(runner, tmp_path, (
        (["--preset", "ablation", "--pending-credit"], "does not apply"),))


def test_simulate_takes_the_pull_demote_setting(runner, tmp_path, profile_file,
                                                sim_configs) -> None:
    """``--pull-demote/--no-pull-demote`` reaches the pull (meta.json records it: the
    calibrated on by default, and off when the pull is); with a preset it is refused."""
    common = ["simulate", "--trace", "synthetic", "--max-requests", "300", "--gpus", "8",
              "--profile", str(profile_file), "--policies", "vertumnus", "--rate-scale", "2",
              "--jobs", "1"]
    metas, got = {}, {}
    for name, extra in (("default", []), ("on", ["--pull-demote"]),
                        ("off", ["--no-pull-demote"]),
                        ("nopull", ["--pull-min-blocks", "0", "--pull-demote"])):
        out = tmp_path / name
        sim_configs.clear()
        _ok(runner.invoke(app, [*common, *extra, "--out", str(out)]))
        meta = json.loads((out / "meta.json").read_text())
        metas[name] = (meta["pull_demote"], meta["pull_min_blocks"])
        assert sim_configs, name  # the runs were in this process
        got[name] = {None if c.pull is None else (c.pull.demote_source, c.pull.min_blocks)
                     for c, _ in sim_configs}
    assert metas == {"default": (True, 2), "on": (True, 2), "off": (False, 2),
                     "nopull": (False, 0)}
    # What the simulator's pull was given, not what meta.json says it was.
    assert got == {"default": {(True, 2)}, "on": {(True, 2)}, "off": {(False, 2)},
                   "nopull": {None}}
    _refused(runner, tmp_path, (
        (["--preset", "conversation", "--no-pull-demote"], "leave out --pull-demote"),))
