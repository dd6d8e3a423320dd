"""Leftovers of the simulator CLI's review (review 2): the reconfiguration preset's composition
timelines run to the run's end; a rate asked of a one-request trace is refused by the ablation
preset as by simulate; `size` refuses homo_cp2 without a degree 2 before measuring anything;
every command's --help reads at 80 columns; an empty path is refused by every path option;
`vertumnus synthetic` says what rate its workload delivers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer.main
from cli_support import _refused, one_request_trace
from typer.testing import CliRunner

from shared.ids import InvalidInput
from sim import presets
from sim import runner as sim_runner
from vertumnus.cli import app


def _ok(result: Any) -> str:
    assert result.exit_code == 0, f"exit {result.exit_code}\n{result.output}\n{result.exception!r}"
    return " ".join(result.output.split())


# --- 1: the reconfiguration preset's timelines run to the run's end -----------------------------
def test_reconfig_timelines_run_to_the_end(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """As a sweep's: every pool's timeline ends with the run's end, holding its last
    composition (the fixed pools' held only their start, and the plots stopped at the last
    change or were held to the last phase's end by a workaround)."""
    import matplotlib.pyplot as plt

    figs: list = []
    monkeypatch.setattr(plt, "close", figs.append)  # keep the figures to look at them
    fixed = ("4CP2/2CP4", "2CP2/3CP4")
    s = presets.run_reconfig(out=tmp_path, seed=0, base_rate=0.6, gpus=16, fixed=fixed)
    meta = json.loads((tmp_path / "reconfig.json").read_text())
    tls = meta["all_timelines"]
    assert set(tls) == {"vertumnus", *fixed}
    rows = {r["policy"]: r for r in s["rows"]}
    last_arrival = meta["phase_bounds"][-1][0]  # the last phase has arrivals (base rate 0.6)
    for label, tl in tls.items():
        times = [t for t, _ in tl]
        assert times == sorted(times) and len(set(times)) == len(times), label
        end, comp = tl[-1]
        assert end > last_arrival, label
        assert comp == tl[-2][1] == rows[label]["composition_end"], label
    for f in fixed:  # the start, then the end: never a change
        assert len(tls[f]) == 2
    assert meta["timelines"]["1.0"] == tls["vertumnus"]
    # Both plots draw vertumnus's lines to the end, no further.
    end = tls["vertumnus"][-1][0]
    drawn = [[ln for ax in fig.axes for ln in ax.get_lines()
              if ln.get_label().startswith(("CP", "×"))] for fig in figs]
    drawn = [lines for lines in drawn if lines]
    assert len(drawn) == 2  # composition.png (×1) and reconfig.png (CP2, CP4 workers)
    for lines in drawn:
        assert all(max(ln.get_xdata()) == pytest.approx(end) for ln in lines)


def test_the_composition_plot_draws_a_timeline_as_recorded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No end is made up any more: the recorded points are the line's."""
    import matplotlib.pyplot as plt

    figs: list = []
    monkeypatch.setattr(plt, "close", figs.append)
    sim_runner._plot_composition(tmp_path, {"1.0": [[0.0, {"2": 4}], [50.0, {"2": 2}],
                                                    [120.0, {"2": 2}]]})
    (ln,) = figs[0].axes[0].get_lines()
    assert (min(ln.get_xdata()), max(ln.get_xdata())) == (0.0, 120.0)
    assert (ln.get_ydata()[0], ln.get_ydata()[-1]) == (4, 2)


# --- 2: the preset path checks a rate as simulate does -------------------------------------------
@pytest.mark.parametrize(("given", "words"), [
    ({"rate": 5.0}, "--rate 5 would change nothing"),
    ({"rate_scales": [2.0, 3.0]}, "--rate-scale 2,3 would change nothing"),
])
def test_the_ablation_refuses_a_rate_of_a_one_request_trace(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: dict[str, Any],
        words: str) -> None:
    def ran(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("the preset ran despite the rate")

    monkeypatch.setattr(presets, "run", ran)
    out = tmp_path / "o"
    with pytest.raises(InvalidInput, match="the trace has one request: it has no arrival rate"
                       ) as err:
        sim_runner.run_preset("ablation", out=out, trace=str(one_request_trace(tmp_path)), **given)
    assert words in str(err.value)
    assert not out.exists()


def test_the_ablation_cli_refuses_a_rate_of_a_one_request_trace(
        runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def ran(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("the preset ran despite the rate")

    monkeypatch.setattr(presets, "run", ran)
    out = tmp_path / "o"
    _refused(runner.invoke(app, ["simulate", "--preset", "ablation", "--trace",
                                 str(one_request_trace(tmp_path)), "--rate", "5",
                                 "--out", str(out)]),
             "no arrival rate", "--rate 5 would change nothing")
    assert not out.exists()


# --- 3: size refuses homo_cp2 without a degree 2 up front ----------------------------------------
def test_size_refuses_homo_cp2_before_anything_runs(runner: CliRunner, tmp_path: Path,
                                                    no_runs: None) -> None:
    """Refused by the command's checks (no_runs: run_size itself is a test failure), with the
    sweep's own message (sim.experiments.check_pools)."""
    out = tmp_path / "o"
    _refused(runner.invoke(app, ["size", "--degrees", "4,8", "--policies", "vertumnus,homo_cp2",
                                 "--max-requests", "20", "--gpus-max", "16", "--out", str(out)]),
             "--policies homo_cp2 with --degrees 4,8", "all-CP4 -- homo's pool again")
    assert not out.exists()


def test_check_size_checks_the_pools() -> None:
    args: dict[str, Any] = dict(rate_scale=1.0, target=0.9, jobs=1, seed=0, warmup_s=0.0,
                                gpus_min=None, gpus_max=16, step=None)
    assert sim_runner.check_size(policies=["vertumnus", "homo_cp2"], degrees=(2, 4),
                                 **args) == [4, 8, 12, 16]
    with pytest.raises(InvalidInput, match="homo_cp2 is the all-CP2 pool"):
        sim_runner.check_size(policies=["vertumnus", "homo_cp2"], degrees=(4, 8), **args)
    # A pool the GPU count cannot form names the size, not a --gpus size does not have.
    with pytest.raises(InvalidInput, match=r"the pool of 16 GPUs \(the smallest size tried\): "
                                           r"--gpus 16 with --degrees 2,16"):
        sim_runner.check_size(policies=["vertumnus"], degrees=(2, 16), **{**args, "gpus_max": 32})


# --- 4: every --help at 80 columns ---------------------------------------------------------------
COMMANDS = sorted(typer.main.get_command(app).commands)  # type: ignore[attr-defined]


def test_the_commands_are_found() -> None:
    assert {"simulate", "up", "replay", "gateway", "rankd", "status", "report"} <= set(COMMANDS)


@pytest.mark.parametrize("cmd", ["", *COMMANDS])
def test_every_help_reads_at_80_columns(cmd: str) -> None:
    """No line past 80 columns (the service commands' argparse help and its VTM_* list were
    100 wide, rankd's description one line of 293), and in a rich help no cell cut short
    (rich marks one with an ellipsis: `up` cut LOG_DIR/hardware-profil…; the help texts use
    no ellipsis of their own, so that any is a cut)."""
    env = {**os.environ, "COLUMNS": "80", "TERMINAL_WIDTH": "80"}
    got = subprocess.run([sys.executable, "-m", "vertumnus", *([cmd] if cmd else []),
                          "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, got.stderr
    text = got.stdout
    assert text.strip()
    wide = [line for line in text.splitlines() if len(line) > 80]
    assert not wide, wide
    if "╭" in text:  # rich's boxes: typer's own help
        assert "…" not in text, text


# --- 5: an empty path ----------------------------------------------------------------------------
EMPTY_PATHS: list[list[str]] = [
    ["profile", "--workload"], ["profile", "--hardware"], ["profile", "--model-path"],
    ["simulate", "--trace"], ["simulate", "--profile"], ["simulate", "--hardware"],
    ["simulate", "--controller"], ["tune", "--trace"], ["size", "--profile"],
    ["hardware"], ["synthetic"], ["controller-config"], ["report"],
    ["up", "--workload"], ["up", "--model-path"], ["up", "--profile"], ["up", "--hardware"],
    ["up", "--controller"], ["up", "--log-dir"], ["up", "--json"], ["up", "--nats-config"],
    ["replay", "--gateway", "http://127.0.0.1:9", "--trace"],
    ["replay", "--gateway", "http://127.0.0.1:9", "--json"],
]


@pytest.mark.parametrize("cmd", EMPTY_PATHS,
                         ids=[" ".join(dict.fromkeys([c[0], c[-1]])) for c in EMPTY_PATHS])
@pytest.mark.parametrize("empty", ["", " "])
def test_an_empty_path_is_refused(runner: CliRunner, tmp_path: Path, no_runs: None,
                                  monkeypatch: pytest.MonkeyPatch, cmd: list[str],
                                  empty: str) -> None:
    """Refused naming the option and the text typed, before anything runs or is written (an
    empty --log-dir ran the stack in the current directory; an empty --json or --profile
    failed naming '.', a FILE or DIRECTORY argument read '.')."""
    import vertumnus.live.stack as stack

    async def started(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("up started its run")

    monkeypatch.setattr(stack, "run_up", started)
    monkeypatch.chdir(tmp_path)
    label = cmd[-1] if cmd[-1].startswith("--") else (
        "DIRECTORY" if cmd[0] == "report" else "FILE")
    _refused(runner.invoke(app, [*cmd, empty]), f"error: {label} {empty!r}", "an empty path")
    assert list(tmp_path.iterdir()) == []


def test_dot_still_names_the_current_directory(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from vertumnus.cliargs import path_option, text_path_option

    monkeypatch.chdir(tmp_path)
    assert path_option("--log-dir", "directory")(".") == Path(".")
    assert path_option("--json")(Path("x.json")) == Path("x.json")  # a default
    assert text_path_option("--trace")("synthetic") == "synthetic"


# --- 6: synthetic's delivered rate ---------------------------------------------------------------
def _summary(tmp_path: Path, text: str) -> str:
    path = tmp_path / "w.toml"
    path.write_text(text)
    res = CliRunner().invoke(app, ["synthetic", str(path)])
    _ok(res)
    return " ".join(res.stderr.split())


def test_synthetic_says_the_rate_its_workload_delivers(tmp_path: Path) -> None:
    """rate 2 over 60 s said "at 2-2 req/s" for 65 requests over 58 s: the configured rate is
    the steady state's, which sessions' follow-up turns reach only after a while."""
    from sim.workloads.synthetic import generate
    from sim.workloads.synthetic_file import load_synthetic_config

    text = _summary(tmp_path, "rate = 2\nduration_s = 60\n")
    wl = generate(load_synthetic_config(tmp_path / "w.toml"), seed=0)
    got = len(wl) / wl.duration_s
    assert got < 0.9 * 2
    assert "60 s in 1 segment(s) at 2 req/s" in text and "configured mean 2 req/s" in text
    assert (f"generated (seed 0): {len(wl)} requests over {wl.duration_s:.4g} s, delivered "
            f"mean {got:.3g} req/s") in text
    assert f"delivered {(2 - got) / 2:.0%} below the configured mean" in text
    assert "think_time_s (20 s)" in text


def test_synthetic_says_nothing_more_when_the_rates_agree(tmp_path: Path) -> None:
    # No sessions: every request is a conversation's start, a Poisson process at the rate.
    text = _summary(tmp_path, "rate = 2\nduration_s = 600\nsession_share = 0\nphases = []\n")
    assert "delivered mean" in text
    assert "below the configured mean" not in text and "above" not in text
