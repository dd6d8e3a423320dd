"""The trace presets (``simulate --preset conversation | leval | azure-code``) find their
public trace under ``$VERTUMNUS_TRACES`` (default: ``../shared/data/traces`` next to the
repository), read when the preset runs; a trace that is not there is refused (exit 2, one
line) naming that variable and the file it expects under it, before anything runs.

The sweep itself is replaced by a recorder (``run_simulate``): these tests are about where
the trace is looked for, not about the run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from vertumnus.cli import app

TRACE_PRESETS = {"conversation": "mooncake/conversation_trace.jsonl",
                 "leval": "leval/leval_llama3_mooncake.jsonl",
                 "azure-code": "azure2023/AzureLLMInferenceTrace_code.csv"}


class Started(AssertionError):
    """The preset's sweep began."""


@pytest.fixture
def sweeps(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Replace the sweep a trace preset runs with a recorder that raises :class:`Started`."""
    from sim import runner

    calls: list[dict[str, Any]] = []

    def started(**kwargs: Any) -> Any:
        calls.append(kwargs)
        raise Started("the preset's sweep began")

    monkeypatch.setattr(runner, "run_simulate", started)
    return calls


@pytest.mark.parametrize("preset", list(TRACE_PRESETS))
def test_a_missing_preset_trace_names_the_variable_and_the_file(
        preset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        sweeps: list[dict[str, Any]]) -> None:
    monkeypatch.setenv("VERTUMNUS_TRACES", str(tmp_path / "traces"))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["simulate", "--preset", preset, "--out", str(out)])
    assert not sweeps, res.output
    assert res.exit_code == 2, (res.output, res.exception)
    err = " ".join(res.stderr.split())
    assert err.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    rel = TRACE_PRESETS[preset]
    assert f"preset {preset!r} needs the public trace {rel}" in err, err
    assert f"$VERTUMNUS_TRACES is {str(tmp_path / 'traces')!r}" in err, err
    assert f"set VERTUMNUS_TRACES to the directory that holds {rel}" in err, err
    assert not out.exists()  # a refused run leaves nothing behind


def test_unset_the_message_says_where_it_looked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                sweeps: list[dict[str, Any]]) -> None:
    """A checkout not next to ``../shared``: the default directory does not exist."""
    import sim.workloads

    monkeypatch.delenv("VERTUMNUS_TRACES", raising=False)
    monkeypatch.setattr(sim.workloads, "default_traces_dir", lambda: tmp_path / "no-shared")
    res = CliRunner().invoke(app, ["simulate", "--preset", "conversation",
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 2 and not sweeps, res.output
    err = " ".join(res.stderr.split())
    assert f"$VERTUMNUS_TRACES is not set, so {tmp_path / 'no-shared'} was looked in" in err, err
    assert "set VERTUMNUS_TRACES to the directory that holds " \
        "mooncake/conversation_trace.jsonl" in err, err


@pytest.mark.parametrize("preset", list(TRACE_PRESETS))
def test_the_variable_is_read_when_the_preset_runs(
        preset: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        sweeps: list[dict[str, Any]]) -> None:
    """Set after the simulator was imported (as here, and as in any process that imported
    it before), the variable still names the directory the preset reads."""
    import sim.runner  # noqa: F401 - imported before the variable is set

    trace = tmp_path / "traces" / TRACE_PRESETS[preset]
    trace.parent.mkdir(parents=True)
    trace.write_text("")  # found is all that matters here: the sweep is the recorder
    monkeypatch.setenv("VERTUMNUS_TRACES", str(tmp_path / "traces"))
    res = CliRunner().invoke(app, ["simulate", "--preset", preset,
                                   "--out", str(tmp_path / "out")])
    assert isinstance(res.exception, Started), (res.output, res.exception)
    assert sweeps[-1]["trace"] == str(trace)
