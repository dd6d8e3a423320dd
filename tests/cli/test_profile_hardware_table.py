"""``--profile`` with ``--hardware FILE`` that edits the default H20 table's figures but keeps
its names: refused, as a profile naming other hardware is (session 64), because the profile
records the fingerprint of the table it was fitted on. Before, the names matched and the run
used a prefill-time model fitted on other figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_support import _refused
from typer.testing import CliRunner

from sim.groundtruth import GroundTruth
from sim.profiling import hardware_fingerprint
from vertumnus.cli import app

SMALL = ["simulate", "--trace", "synthetic", "--gpus", "8", "--max-requests", "60"]


@pytest.fixture
def edited_h20(tmp_path: Path) -> Path:
    """The default table with the CP fixed cost doubled: model and GPU names unchanged."""
    path = tmp_path / "h20-slower-cp.toml"
    path.write_text("[calibration]\nd_cp = 0.064\n")
    return path


def test_the_session_profile_records_the_default_table(profile_file: Path) -> None:
    data = json.loads(profile_file.read_text())
    assert data["hardware_fingerprint"] == hardware_fingerprint(GroundTruth())


@pytest.mark.parametrize("cmd", [
    [*SMALL, "--policies", "vertumnus"],
    ["tune", "--max-requests", "60", "--gpus", "8", "--beta", "1", "--lam", "0"],
    ["size", "--max-requests", "60", "--policies", "vertumnus", "--gpus-max", "8"],
])
def test_a_profile_of_an_edited_table_is_refused(runner: CliRunner, tmp_path: Path,
                                                 profile_file: Path, edited_h20: Path,
                                                 no_runs: None, cmd: list[str]) -> None:
    out = tmp_path / "o"
    _refused(runner.invoke(app, [*cmd, "--hardware", str(edited_h20), "--profile",
                                 str(profile_file), "--out", str(out)]),
             f"--profile {profile_file} was fitted on other hardware",
             "the same names (model 'Qwen3-30B-A3B', GPU 'H20') but other figures",
             "--profile-mismatch-ok")
    assert not out.exists()  # refused before anything was written


def test_the_same_table_spelled_otherwise_passes_and_mismatch_ok_runs(
        runner: CliRunner, tmp_path: Path, profile_file: Path, edited_h20: Path) -> None:
    same = tmp_path / "h20.json"
    same.write_text(json.dumps({"calibration": {"d_cp": 0.032}, "gpu": "H20",
                                "memory_gpu": "H20-3e"}))
    for hw, extra in ((same, []), (edited_h20, ["--profile-mismatch-ok"])):
        out = tmp_path / hw.stem
        res = runner.invoke(app, [*SMALL, "--policies", "vertumnus", "--hardware", str(hw),
                                  "--profile", str(profile_file), *extra, "--out", str(out)])
        assert res.exit_code == 0, res.output
        assert (out / "results.json").is_file()
