"""shared.files.path_kind: one stat, every failure a clear InvalidInput naming the path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shared.files import path_kind
from shared.ids import InvalidInput


def test_kinds(tmp_path: Path) -> None:
    f = tmp_path / "f.json"
    f.write_text("{}")
    assert path_kind(f) == "file" and path_kind(tmp_path) == "dir"
    assert path_kind(tmp_path / "none") == "missing"
    assert path_kind(f / "under-a-file") == "missing"  # a parent that is a file
    assert path_kind("/dev/null") == "other"


def test_a_path_that_cannot_be_looked_at_is_invalid_input_naming_it(tmp_path: Path) -> None:
    # A loop of links fails every stat whoever runs the test (a permission-denied parent
    # would not fail for root, which CI may be).
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    with pytest.raises(InvalidInput, match=f"cannot access profile {loop} "):
        path_kind(loop, "profile")


def test_the_cli_and_the_loaders_report_it_cleanly(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from shared.costmodel import Profile
    from sim.hardware import load_ground_truth
    from sim.workloads import load_workload
    from vertumnus.cli import app

    loop = tmp_path / "loop.json"
    os.symlink(loop, loop)
    for load in (Profile.load, load_ground_truth, load_workload):
        with pytest.raises(InvalidInput, match="cannot access"):
            load(loop)
    res = CliRunner().invoke(app, ["simulate", "--profile", str(loop), "--gpus", "8",
                                   "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert "cannot access --profile" in " ".join(res.output.split())
