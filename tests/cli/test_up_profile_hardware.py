"""``up --profile P`` on the sim backend: a profile fitted on other hardware than the modelled
one (``--hardware``, else the default H20) is refused before anything starts, as ``simulate``,
``tune`` and ``size`` refuse it (sim/runner.py ``check_profile_hardware``), unless
``--profile-mismatch-ok``. Before, ``up`` started the stack with it, and the services
predicted every prefill with a model of other hardware than the rank daemons timed.

The commands run in this process with ``run_up`` replaced by a tripwire (conftest.py): a
refusal that regressed fails at once instead of starting a stack."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cli_support import Started, _refused
from typer.testing import CliRunner

from vertumnus.cli import app

SHORT = ["--duration", "10", "--max-requests", "2"]


def _up(*args: str) -> Any:
    return CliRunner().invoke(app, ["up", *SHORT, *args])


@pytest.fixture
def edited_h20(tmp_path: Path) -> Path:
    """The default table with the CP fixed cost doubled: model and GPU names unchanged."""
    path = tmp_path / "h20-slower-cp.toml"
    path.write_text("[calibration]\nd_cp = 0.064\n")
    return path


@pytest.fixture
def h200(tmp_path: Path) -> Path:
    path = tmp_path / "h200.toml"
    path.write_text('gpu = "H200"\n')
    return path


def test_a_profile_of_other_named_hardware_is_refused(
        profile_file: Path, h200: Path, tripwire: list[dict[str, Any]]) -> None:
    _refused(_up("--profile", str(profile_file), "--hardware", str(h200)),
             f"--profile {profile_file} was fitted on other hardware",
             "GPU 'H20' (the run's: 'H200')", "--profile-mismatch-ok")
    assert tripwire == []


def test_a_profile_of_an_edited_table_is_refused(
        profile_file: Path, edited_h20: Path, tripwire: list[dict[str, Any]]) -> None:
    _refused(_up("--profile", str(profile_file), "--hardware", str(edited_h20)),
             f"--profile {profile_file} was fitted on other hardware",
             "the same names (model 'Qwen3-30B-A3B', GPU 'H20') but other figures",
             "--profile-mismatch-ok")
    assert tripwire == []


def test_the_matching_hardware_and_mismatch_ok_start(
        profile_file: Path, h200: Path, tripwire: list[dict[str, Any]]) -> None:
    for extra in ([], ["--hardware", str(h200), "--profile-mismatch-ok"]):
        res = _up("--profile", str(profile_file), *extra)
        assert isinstance(res.exception, Started), res.output
    assert len(tripwire) == 2


def test_mismatch_ok_is_the_sim_backends(tripwire: list[dict[str, Any]]) -> None:
    _refused(_up("--backend", "torch", "--profile-mismatch-ok"), "--profile-mismatch-ok",
             "sim backend")
    assert tripwire == []
