"""Fixtures of the CLI tests: a profile file measured once per session, and one simulate run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:  # helpers in cli_support (import-mode=importlib)
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="session")
def profile_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A profile measured on the sim backend (as ``vertumnus profile`` does), saved to JSON."""
    from sim.profiling import run_profile

    d = tmp_path_factory.mktemp("cli-profile")
    prof, _ = run_profile(d / "measured", degrees=(1, 2, 4), seed=0, measure_kappas=True)
    path = d / "profile.json"
    prof.save(path)
    return path


@pytest.fixture(scope="session")
def runner() -> CliRunner:
    return CliRunner()
