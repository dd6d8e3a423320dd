"""The CLI commands that read ``VTM_*`` settings refuse a ``VTM_*`` variable that no vertumnus
process reads (a misspelt name, which they would silently ignore) exactly as the services and
``up`` do (shared/envcheck.py): exit 2, an ``error:`` line naming the variable and the known
name closest to it, no traceback, before any work. A variable another process reads is no
error (one environment serves several processes). The offline commands, which read no
``VTM_*`` variable, do not look (vertumnus/cliargs.py, :func:`vtm_environment`).

The commands run in this process (typer's runner) with their work replaced by a tripwire:
a command that got past its checks raises :class:`Started`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cli_support import _refused
from typer.testing import CliRunner

from vertumnus.cli import app

NOWHERE = "nats://127.0.0.1:9"
WINDOW_TYPO = ("VTM_WINDOWS_S", "5",
               "VTM_WINDOWS_S: no vertumnus service reads it (did you mean VTM_WINDOW_S?)")
TORCH_TYPO = ("VTM_TORCH_MODEL_PATHH", "/ckpt",
              "VTM_TORCH_MODEL_PATHH: no vertumnus service reads it "
              "(did you mean VTM_TORCH_MODEL_PATH?)")

CHECKING = {
    "replay": ["replay", "--gateway", "http://127.0.0.1:9", "--max-requests", "1",
               "--duration", "5"],
    "replay --nats": ["replay", "--gateway", "http://127.0.0.1:9", "--nats", NOWHERE,
                      "--max-requests", "1", "--duration", "5"],
    "tap": ["tap", "vtm.>", "--nats", NOWHERE, "--count", "1", "--timeout", "1"],
    "status": ["status", "--nats", NOWHERE, "--timeout", "1"],
    "profile --backend torch": ["profile", "--backend", "torch", "--degrees", "1,2"],
}
"""A run of each command that reads ``VTM_*`` variables (``up`` and the service commands
check theirs in their own ways: tests/shared/test_envcheck.py)."""

SERVICE_COMMANDS = frozenset({"gateway", "scheduler", "controller", "cachemgr", "rankd"})
"""They run a service's main, which checks its environment itself (shared.servicemain)."""
OFFLINE = frozenset({"demo", "simulate", "tune", "size", "hardware", "synthetic",
                     "controller-config", "report"})
"""Commands that read no ``VTM_*`` variable, and so do not refuse one."""


class Started(AssertionError):
    """A command got past its checks: it would have connected, replayed or measured."""


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """No ``VTM_*`` variable of the test run's own environment in the way."""
    for k in list(os.environ):
        if k.upper().startswith("VTM_"):
            monkeypatch.delenv(k)
    yield monkeypatch


@pytest.fixture(autouse=True)
def tripwire(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import vertumnus.cmd_live as cmd_live
    import vertumnus.live.status as status
    import vertumnus.live.tap as tap

    async def started(*args: Any, **kwargs: Any) -> Any:
        raise Started("the command started its work")

    def started_sync(*args: Any, **kwargs: Any) -> Any:
        raise Started("the command started its work")

    monkeypatch.setattr(cmd_live, "_replay_main", started)
    monkeypatch.setattr(tap, "tap", started)
    monkeypatch.setattr(status, "status", started)
    monkeypatch.chdir(tmp_path)  # profile's default --out (runs/profile) is made here
    try:
        from services.rankd.engine import profiling
    except ImportError:  # no torch extra: profile --backend torch refuses before this
        return
    monkeypatch.setattr(profiling, "torch_profile_command", started_sync)


def _run(args: list[str], env: dict[str, str]) -> Any:
    return CliRunner().invoke(app, args, env=env)


@pytest.mark.parametrize("typo", [WINDOW_TYPO, TORCH_TYPO], ids=["window", "torch"])
@pytest.mark.parametrize("command", sorted(CHECKING))
def test_a_command_reading_vtm_settings_refuses_a_misspelt_variable(
        command: str, typo: tuple[str, str, str]) -> None:
    var, value, line = typo
    res = _run(CHECKING[command], {var: value})
    text = _refused(res, line)
    assert not isinstance(res.exception, Started)
    assert text.count("no vertumnus service reads") == 1, text


def test_every_misspelt_variable_is_named() -> None:
    res = _run(CHECKING["status"], {WINDOW_TYPO[0]: "5", TORCH_TYPO[0]: "/x"})
    _refused(res, WINDOW_TYPO[2], TORCH_TYPO[2])


@pytest.mark.parametrize("command", sorted(CHECKING))
def test_variables_another_process_reads_are_accepted(command: str) -> None:
    """Another service's variables and the torch backend's exact names pass: the command
    gets to its work."""
    env = {"VTM_DEGREES": "[2, 4]", "VTM_WINDOW_S": "20", "VTM_TRUTH": "exact",
           "VTM_TORCH_THREADS": "1", "VTM_TORCH_VARLEN": "0", "VTM_GATEWAY_CA": "",
           "VTM_POLICY_PARAMS__HALF_LIFE_S": "3"}
    res = _run(CHECKING[command], env)
    assert isinstance(res.exception, Started), res.output
    assert "no vertumnus service reads" not in res.output


def test_profile_reads_an_exact_torch_name_as_rankd_does() -> None:
    """``VTM_TORCH_MODEL_PATH`` passes the check and is the checkpoint profile measures
    (refused here for not being a directory: the name was read)."""
    pytest.importorskip("torch")
    res = _run(CHECKING["profile --backend torch"], {"VTM_TORCH_MODEL_PATH": "/nonexistent/x"})
    text = _refused(res, "VTM_TORCH_MODEL_PATH", "/nonexistent/x")
    assert "no vertumnus service reads" not in text


def test_profile_on_the_sim_backend_reads_no_vtm_variable_and_does_not_look(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import sim.profiling

    def started(*args: Any, **kwargs: Any) -> Any:
        raise Started("the command started its work")

    monkeypatch.setattr(sim.profiling, "profile_command", started)
    res = _run(["profile", "--backend", "sim", "--degrees", "1,2"], {TORCH_TYPO[0]: "/x"})
    assert isinstance(res.exception, Started), res.output


def test_an_offline_command_does_not_look() -> None:
    res = _run(["demo"], {WINDOW_TYPO[0]: "5"})
    assert res.exit_code == 0, res.output
    assert "no vertumnus service reads" not in res.output


def test_up_refuses_a_misspelt_torch_variable() -> None:
    res = _run(["up", "--duration", "5"], {TORCH_TYPO[0]: "/x"})
    _refused(res, TORCH_TYPO[2])


def test_every_command_is_classified() -> None:
    """A new command must decide: it reads VTM_* variables (and checks them) or not."""
    import typer.main

    group = typer.main.get_command(app)
    names = set(group.commands)  # type: ignore[attr-defined]
    checking = {c.split()[0] for c in CHECKING} | {"up"}
    assert names == checking | SERVICE_COMMANDS | OFFLINE, names ^ (
        checking | SERVICE_COMMANDS | OFFLINE)
