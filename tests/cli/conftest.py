"""Fixtures of the CLI tests: a profile file measured once per session, one simulate run, and
``no_runs`` (any sweep or profile started is a test failure)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

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


@pytest.fixture
def tripwire(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """``up``'s run (``vertumnus.live.stack.run_up``) replaced by a recorder that raises
    :class:`cli_support.Started`: a test of ``up``'s checks sees whether it got past them
    without starting anything. Returns the recorded calls."""
    from cli_support import Started

    import vertumnus.live.stack as stack

    calls: list[dict[str, Any]] = []

    async def started(*args: Any, **kwargs: Any) -> Any:
        calls.append({"args": args, **kwargs})
        raise Started("up started its run")

    monkeypatch.setattr(stack, "run_up", started)
    return calls


@pytest.fixture(scope="session")
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def no_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any sweep or profile a test failure: the refusals under test must come before
    one."""
    import sim.profiling
    from sim import runner as sim_runner

    def boom(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a run started despite bad input")

    for name in ("run_simulate", "run_tune", "run_size", "run_preset"):
        monkeypatch.setattr(sim_runner, name, boom)
    monkeypatch.setattr(sim.profiling, "profile_command", boom)
