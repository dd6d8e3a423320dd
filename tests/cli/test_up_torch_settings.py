"""``up --backend torch`` checks the rank daemon's ``VTM_TORCH_*`` values -- this environment's
under the stack's own -- as the daemon checks them at its start, before anything starts (exit
2, naming the variable). Before, a bad value was said by the rank daemon once nats, the
services and the engine's profile (~20 s) had started.

The commands run in this process with ``run_up`` replaced by a tripwire (``tests/cli/
conftest.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from cli_support import Started, _refused
from typer.testing import CliRunner

from vertumnus.cli import app

pytest.importorskip("torch")  # the engine extra: the checks are the engine's own

UP = ["up", "--backend", "torch", "--gpus", "2", "--degrees", "1,2", "--duration", "5",
      "--max-requests", "2"]


@pytest.mark.parametrize(("name", "value", "said"), [
    ("VTM_TORCH_DTYPE", "int4", "VTM_TORCH_DTYPE must be one of float32"),
    ("VTM_TORCH_DEGREES", "1,3", "VTM_TORCH_DEGREES must be comma-separated powers of two"),
    ("VTM_TORCH_PAGES_PER_RANK", "0", "VTM_TORCH_PAGES_PER_RANK='0'"),
])
def test_a_bad_torch_value_in_the_environment_starts_nothing(
        monkeypatch: pytest.MonkeyPatch, tripwire: list[dict[str, Any]], name: str,
        value: str, said: str) -> None:
    monkeypatch.setenv(name, value)
    text = _refused(CliRunner().invoke(app, UP), "the rank daemon's torch settings", said)
    assert "Traceback" not in text
    assert tripwire == []


def test_the_stacks_own_values_win_over_the_environment(
        monkeypatch: pytest.MonkeyPatch, tripwire: list[dict[str, Any]]) -> None:
    """The stack sets the engine's page size and device itself (``LiveStack.torch_env``): a bad
    value of those in this environment never reaches the rank daemon, so it is no reason to
    refuse; nor is anything when every value is good."""
    monkeypatch.setenv("VTM_TORCH_BLOCK_SIZE", "0")
    monkeypatch.setenv("VTM_TORCH_DEVICE", "tpu")
    result = CliRunner().invoke(app, UP)
    assert isinstance(result.exception, Started), result.output
    assert len(tripwire) == 1
