"""The CLI review's remainder: bad input exits 2 with one ``error:`` line naming the flag or
the file (and line), no traceback, nothing written and no run started. Absurd hardware
values, a non-finite rate in results.json, ``profile --pool-gpus`` of a pool ``simulate``
refuses, and a synthetic workload file whose block size the run does not count in."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from cli_support import SIM, _refused
from typer.testing import CliRunner

import sim.profiling
from sim import runner as sim_runner
from vertumnus.cli import app


# --- 1. hardware values beyond any real model or GPU ---------------------------------------------
@pytest.mark.parametrize(("content", "key"), [
    ("[model]\nlayers = 1000000000\n", "model.layers"),
    ("[model]\nexperts = 1000000000\n", "model.experts"),
    ('[gpu]\npreset = "H20"\npeak_flops = 1e300\n', "gpu.peak_flops"),
    ("[surroundings]\nswitch_max_s = 1e12\n", "surroundings.switch_max_s"),
])
@pytest.mark.parametrize("command", [["hardware"], [*SIM, "--hardware"], ["profile", "--hardware"],
                                     ["tune", "--hardware"], ["size", "--hardware"]])
def test_absurd_hardware_is_refused_naming_the_file_and_key(
        runner: CliRunner, tmp_path: Path, no_runs: None, content: str, key: str,
        command: list[str]) -> None:
    hw = tmp_path / "hw.toml"
    hw.write_text(content)
    out = tmp_path / "o"
    args = [*command, str(hw)] + ([] if command == ["hardware"] else ["--out", str(out)])
    _refused(runner.invoke(app, args), f"{hw}: {key}: must be at most",
             "far beyond any real model or GPU")
    assert not out.exists()


def test_hardware_no_run_could_use_is_refused(runner: CliRunner, tmp_path: Path) -> None:
    hw = tmp_path / "hw.toml"
    hw.write_text("[model]\nlayers = 4096\nkv_heads = 32\nhead_dim = 8192\n")
    _refused(runner.invoke(app, ["hardware", str(hw)]), f"{hw}: not a usable ground truth",
             "holds no KV block")


# --- 2. report: a non-finite rate ----------------------------------------------------------------
def _row(policy: str = "vertumnus", **figures: Any) -> dict[str, Any]:
    return {"policy": policy, "rate_scale": 1.0, "request_rate": 2.0, "mean_ttft_s": 0.5,
            "p50_ttft_s": 0.4, "p90_ttft_s": 0.9, "p99_ttft_s": 1.2, "slo_attainment": 0.95,
            "hit_rate": 0.2, "reconfigurations": 0, "oracle_mean_ttft_s": 0.3, **figures}


@pytest.mark.parametrize(("field", "value"), [
    ("rate_scale", float("nan")), ("rate_scale", float("inf")),
    ("request_rate", float("nan")), ("request_rate", float("-inf")),
])
def test_report_refuses_a_non_finite_rate_naming_the_file_and_field(
        runner: CliRunner, tmp_path: Path, field: str, value: float) -> None:
    """json.loads takes NaN; the redraw wrote it back as null (a different row key)."""
    results = tmp_path / "results.json"
    text = json.dumps([_row(), _row("homo", **{field: value})])  # NaN / Infinity literals
    results.write_text(text)
    _refused(runner.invoke(app, ["report", str(tmp_path)]),
             f"{results}: row 1 (homo): {field} is {value!r}, not a finite number")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["results.json"]  # nothing written
    assert results.read_text() == text


def test_report_refuses_a_size_summary_with_a_non_finite_rate(runner: CliRunner,
                                                             tmp_path: Path) -> None:
    size = tmp_path / "size.json"
    size.write_text(json.dumps({"meta": {"target": 0.9, "workload": "x",
                                         "rate_scale": float("nan"), "sizes": [8]},
                                "policies": []}))
    _refused(runner.invoke(app, ["report", str(tmp_path)]),
             f"{size}: meta.rate_scale is nan, not a finite number")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["size.json"]


def test_report_still_draws_finite_rates(runner: CliRunner, tmp_path: Path) -> None:
    (tmp_path / "results.json").write_text(json.dumps([_row(), _row(rate_scale=2)]))
    res = runner.invoke(app, ["report", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert (tmp_path / "results.csv").exists()


# --- 3. profile --pool-gpus: the pools simulate takes --------------------------------------------
@pytest.mark.parametrize(("pool", "degrees", "problem"), [
    ("6", "2,4", "node 0 has 6 GPUs, not a multiple of degree 4"),  # all-CP4 baselines
    ("3", "2,4", "not a multiple of the smallest degree 2"),
    ("20", "2,8", "node 2 has 4 GPUs, not a multiple of degree 8"),  # the largest degree
    ("7", "1,2,4,8", "node 0 has 7 GPUs, not a multiple of degree 4"),
])
def test_profile_pool_gpus_refuses_the_pools_simulate_refuses(
        runner: CliRunner, tmp_path: Path, no_runs: None, pool: str, degrees: str,
        problem: str) -> None:
    out = tmp_path / "o"
    _refused(runner.invoke(app, ["profile", "--pool-gpus", pool, "--degrees", degrees,
                                 "--out", str(out)]),
             f"--pool-gpus {pool}", f"simulate --gpus {pool} --degrees {degrees}", problem)
    assert not out.exists()
    # simulate's own refusal of that pool, by the same check and in the same words.
    _refused(runner.invoke(app, ["simulate", "--gpus", pool, "--degrees", degrees,
                                 "--out", str(out)]),
             f"--gpus {pool} with --degrees {degrees}", problem)
    assert not out.exists()


def test_profile_pool_gpus_checks_the_kappa_degrees(runner: CliRunner, tmp_path: Path,
                                                    no_runs: None) -> None:
    """'--degrees 1,D --kappa-degrees D --pool-gpus N' is simulate's --gpus N --degrees D."""
    out = tmp_path / "o"
    _refused(runner.invoke(app, ["profile", "--degrees", "1,2,4", "--kappa-degrees", "4",
                                 "--pool-gpus", "6", "--out", str(out)]),
             "--pool-gpus 6", "--degrees 4", "not a multiple of the smallest degree 4")
    _refused(runner.invoke(app, ["profile", "--pool-gpus", "1000000000", "--out", str(out)]),
             "--pool-gpus must be an integer in [1, 16384], got 1000000000")
    assert not out.exists()


def test_profile_pool_gpus_takes_a_pool_simulate_takes(
        runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def fake(out: Path, **kw: Any) -> Path:
        seen.update(kw)
        return Path(out) / "profile.json"

    monkeypatch.setattr(sim.profiling, "profile_command", fake)
    res = runner.invoke(app, ["profile", "--degrees", "1,2,4", "--kappa-degrees", "2",
                              "--pool-gpus", "6", "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert seen["pool_gpus"] == 6  # 3×CP2: simulate --gpus 6 --degrees 2 takes it


# --- 5. a synthetic workload file's block size, when the file is read ----------------------------
@pytest.fixture
def blocks16(tmp_path: Path) -> Path:
    f = tmp_path / "w.toml"
    f.write_text("block_size = 16\nduration_s = 60\n")
    return f


@pytest.mark.parametrize("command", [SIM, ["tune"], ["size"], ["simulate", "--preset",
                                                                  "ablation"]])
def test_a_synthetic_file_of_another_block_size_is_refused_before_the_run(
        runner: CliRunner, tmp_path: Path, no_runs: None, blocks16: Path,
        command: list[str]) -> None:
    """It was refused only when the first run started, after the profile was measured and
    written into --out ("workload block size 16 != profile block size 512")."""
    out = tmp_path / "o"
    _refused(runner.invoke(app, [*command, "--trace", str(blocks16), "--out", str(out)]),
             f"{blocks16}: block_size is 16", "512 tokens", "set block_size = 512")
    as_json = tmp_path / "w.json"
    as_json.write_text(json.dumps({"block_size": 16}))
    _refused(runner.invoke(app, [*command, "--trace", str(as_json), "--format", "synthetic",
                                 "--out", str(out)]), f"{as_json}: block_size is 16")
    assert not out.exists()


def test_a_profile_of_that_block_size_takes_the_file(
        runner: CliRunner, tmp_path: Path, profile_file: Path, blocks16: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The block size to match is the profile's: a --profile counting in 16-token blocks
    takes the file, and refuses one of the default 512."""
    data = json.loads(profile_file.read_text())
    p16 = tmp_path / "p16.json"
    p16.write_text(json.dumps({**data, "block_size": 16}))
    seen: dict[str, Any] = {}
    monkeypatch.setattr(sim_runner, "run_simulate",
                        lambda **kw: seen.update(kw) or {"rows": [], "meta": {}})
    monkeypatch.setattr(sim_runner, "print_table", lambda *a, **k: None)
    res = runner.invoke(app, [*SIM, "--trace", str(blocks16), "--profile", str(p16),
                              "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert seen["trace"] == str(blocks16)
    default = tmp_path / "d.toml"
    default.write_text("duration_s = 60\n")
    _refused(runner.invoke(app, [*SIM, "--trace", str(default), "--profile", str(p16),
                                 "--out", str(tmp_path / "o2")]),
             f"{default}: block_size is 512", f"--profile {p16}'s cache blocks are 16 tokens",
             "set block_size = 16")
    # Every trace reader and the built-in workload count in 512-token blocks.
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 5, '
                     '"hash_ids": [1, 2]}\n')
    for given in ([], ["--trace", str(trace)]):
        _refused(runner.invoke(app, [*SIM, *given, "--profile", str(p16),
                                     "--out", str(tmp_path / "o2")]),
                 f"--profile {p16}: its cache blocks are 16 tokens", "the trace's are 512")
    assert not (tmp_path / "o2").exists()


def test_up_refuses_a_synthetic_file_of_another_block_size(
        runner: CliRunner, tmp_path: Path, blocks16: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The live stack hashes prompts in its own blocks (512 but for synthetic-short): a file
    of 16-token blocks was replayed in 512-token ones, silently."""
    import vertumnus.live.stack as stack

    started: list[Any] = []

    async def run_up(*a: Any, **k: Any) -> Any:
        started.append(k)
        raise AssertionError("the stack started")

    monkeypatch.setattr(stack, "run_up", run_up)
    log_dir = tmp_path / "logs"
    _refused(runner.invoke(app, ["up", "--workload", str(blocks16), "--log-dir", str(log_dir)]),
             "--workload", f"{blocks16}: block_size is 16", "the stack's cache blocks are 512")
    assert started == [] and not log_dir.exists()
