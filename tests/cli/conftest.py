"""Fixtures of the CLI tests: a profile file measured once per session, and one simulate run."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner


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
