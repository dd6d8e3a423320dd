"""Pools that a GPU count or a degree set cannot form, and names that would not say the pool.

* ``--gpus 2 --degrees 2,4 --policies vertumnus,static`` ran a 1CP2 pool with κ measured on a
  CP4 worker it could never have; ``--gpus 4 --degrees 2,4,8`` compared 2CP2 runs with an oracle
  placing requests on a CP8 worker. A degree larger than the pool is refused now (exit 2, naming
  --gpus, --degrees and the degree), and ``profile --pool-gpus`` no longer measures κ on one.
* With the default policies the refusal of 2 GPUs said only "node 0 has 2 GPUs, not a multiple
  of degree 4"; it names the policies whose all-CP4 pool that is now.
* ``homo_cp2`` is the all-CP2 pool (README); with ``--degrees 4,8`` it ran homo's all-CP4 pool
  under that name, with ``--degrees 1`` all-CP1: refused where the smallest degree is not 2.
* A one-request trace has no arrival rate: ``--rate`` and ``--rate-scale`` changed nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cli_support import _refused, one_request_trace
from typer.testing import CliRunner

import sim.profiling
from shared.ids import InvalidInput
from sim import runner as sim_runner
from sim.experiments import check_pools, check_rate
from sim.profiling import TRACE_KAPPA_RAMP, ramp_pools
from sim.workloads.workload import Request, Workload
from vertumnus.cli import app


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """Stand-in for simulate's run that records its arguments (an accepted command)."""
    seen: dict[str, dict[str, Any]] = {}

    def run(*args: Any, **kwargs: Any) -> dict[str, Any]:
        seen["run_simulate"] = {"args": args, **kwargs}
        return {"rows": [], "meta": {}}

    monkeypatch.setattr(sim_runner, "run_simulate", run)
    return seen


# --- degrees no pool of --gpus can form -----------------------------------------------------------
@pytest.mark.parametrize(("gpus", "degrees", "policies", "degree"), [
    ("2", "2,4", "vertumnus,static", "degree 4"),
    ("4", "2,4,8", "vertumnus,homo", "degree 8"),
    ("4", "2,4,8", "homo_cp2", "degree 8"),  # the oracle would place requests on a CP8
])
def test_a_degree_larger_than_the_pool_is_refused(
        runner: CliRunner, tmp_path: Path, no_runs: None, gpus: str, degrees: str,
        policies: str, degree: str) -> None:
    text = _refused(runner.invoke(app, ["simulate", "--gpus", gpus, "--degrees", degrees,
                                        "--policies", policies, "--out", str(tmp_path / "o")]),
                    f"--gpus {gpus} with --degrees {degrees}", f"cannot form a worker of {degree}")
    assert "drop it from --degrees" in text
    assert not (tmp_path / "o").exists()


def test_the_refusal_of_the_uniform_pools_names_their_policies(
        runner: CliRunner, tmp_path: Path, no_runs: None) -> None:
    _refused(runner.invoke(app, ["simulate", "--gpus", "2", "--degrees", "2,4",
                                 "--out", str(tmp_path / "o")]),
             "--gpus 2 with --degrees 2,4",
             "homo, sglang, vllm, dynamo, llmd run every worker at degree 4 (vllm as TP workers)",
             "node 0 has 2 GPUs, not a multiple of degree 4", "leave them out of --policies")
    with pytest.raises(InvalidInput, match="sglang run every worker at degree 4, a pool"):
        check_pools(6, (2, 4), policies=("vertumnus", "sglang"))


def test_kappa_is_not_measured_on_a_worker_the_pool_cannot_form(
        runner: CliRunner, tmp_path: Path, no_runs: None) -> None:
    """``ramp_pools`` took at least one worker of every degree, whatever the pool held."""
    with pytest.raises(InvalidInput, match="a pool of 4 GPUs has no worker of degree 8"):
        ramp_pools(TRACE_KAPPA_RAMP, (2, 4, 8), 4)
    assert ramp_pools(TRACE_KAPPA_RAMP, (2, 4), 4) == {
        2: min(TRACE_KAPPA_RAMP.pool_workers, 2), 4: 1}
    _refused(runner.invoke(app, ["profile", "--degrees", "2,4,8", "--pool-gpus", "4",
                                 "--out", str(tmp_path / "o")]),
             "--pool-gpus 4", "cannot form a worker of degree 8")
    assert not (tmp_path / "o").exists()


# --- homo_cp2 only where it is the all-CP2 pool ---------------------------------------------------
@pytest.mark.parametrize(("degrees", "policies", "words"), [
    ("4,8", ["--policies", "vertumnus,homo,homo_cp2,vllm"], "all-CP4 -- homo's pool again"),
    ("4,8", ["--policies", "homo_cp2"], "the default list holds it"),
    ("1", ["--policies", "vertumnus,homo_cp2"], "so it would run all-CP1 -- homo's pool again"),
    ("1,2,4", ["--policies", "homo_cp2"], "so it would run all-CP1;"),
])
def test_homo_cp2_is_refused_where_it_would_not_be_all_cp2(
        runner: CliRunner, tmp_path: Path, no_runs: None, degrees: str, policies: list[str],
        words: str) -> None:
    _refused(runner.invoke(app, ["simulate", "--degrees", degrees, *policies,
                                 "--out", str(tmp_path / "o")]),
             f"--policies homo_cp2 with --degrees {degrees}", "homo_cp2 is the all-CP2 pool",
             words, "leave homo_cp2 out of --policies")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("degrees", "policies"), [
    ("4,8", "vertumnus,homo,vllm"),    # §9's DeepSeek lattice without homo_cp2
    ("2,4", None),                     # the default configuration, homo_cp2 included
    ("2,4,8", "homo,homo_cp2"),        # the smallest is 2: all-CP2
])
def test_the_pools_that_are_what_they_say_are_taken(
        runner: CliRunner, tmp_path: Path, calls: dict[str, dict[str, Any]], degrees: str,
        policies: str | None) -> None:
    args = ["simulate", "--degrees", degrees, "--out", str(tmp_path / "o")]
    res = runner.invoke(app, args + (["--policies", policies] if policies else []))
    assert res.exit_code == 0, res.output
    assert calls["run_simulate"]["degrees"] == tuple(int(d) for d in degrees.split(","))


@pytest.mark.parametrize("command", ["simulate", "size"])
@pytest.mark.parametrize("degrees", ["4,8", "1"])
def test_the_default_policies_leave_homo_cp2_out_where_it_cannot_run(
        runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str,
        degrees: str) -> None:
    """Without --policies, a lattice whose smallest degree is not 2 runs the default list
    without homo_cp2 (a note says so) instead of refusing the user's own default; the
    default configuration keeps it."""
    seen: dict[str, Any] = {}

    def run(*args: Any, **kwargs: Any) -> dict[str, Any]:
        seen.update(kwargs)
        raise SystemExit(0)  # accepted: what it was asked to run is all this test needs

    monkeypatch.setattr(sim_runner, f"run_{command}", run)
    res = runner.invoke(app, [command, "--degrees", degrees, "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "homo_cp2" not in seen["policies"] and "homo" in seen["policies"]
    assert "note: homo_cp2 (the all-CP2 pool) left out of the default --policies" in res.output
    seen.clear()
    res = runner.invoke(app, [command, "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert "homo_cp2" in seen["policies"] and "note:" not in res.output


def test_profile_pool_gpus_is_a_check_of_the_gpu_count_alone(
        runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A κ for 16 GPUs of degrees 4 and 8 is for the runs of that pool (homo's, vertumnus's):
    homo_cp2's name, a run's matter, does not refuse it."""
    seen: dict[str, Any] = {}

    def fake(out: Path, **kw: Any) -> Path:
        seen.update(kw)
        return Path(out) / "profile.json"

    monkeypatch.setattr(sim.profiling, "profile_command", fake)
    res = runner.invoke(app, ["profile", "--degrees", "4,8", "--pool-gpus", "16",
                              "--out", str(tmp_path / "o")])
    assert res.exit_code == 0, res.output
    assert seen["pool_gpus"] == 16


# --- a one-request trace has no rate --------------------------------------------------------------
@pytest.mark.parametrize(("given", "words"), [
    (["--rate-scale", "1,2"], "--rate-scale 1,2 would change nothing; leave it out"),
    (["--rate", "5"], "--rate 5 would change nothing"),
    (["--rate", "5", "--rate-scale", "2"], "--rate 5 and --rate-scale 2 would change nothing; "
                                           "leave them out"),
])
def test_a_rate_asked_of_a_one_request_trace_is_refused(
        runner: CliRunner, tmp_path: Path, given: list[str], words: str) -> None:
    """Refused once the trace is read, before the profile (it used to run every rate, each
    the same run: req/s 1.00 at ×1 and ×2)."""
    out = tmp_path / "o"
    _refused(runner.invoke(app, ["simulate", "--trace", str(one_request_trace(tmp_path)),
                                 "--policies", "vertumnus", "--gpus", "8", *given,
                                 "--out", str(out)]),
             "the trace has one request: it has no arrival rate to set or scale", words)
    assert not out.exists()


def test_check_rate() -> None:
    one = Workload("one", (Request("r0", 0.0, 1024, 1, (1, 2)),), block_size=512)
    two = Workload("two", (Request("r0", 0.0, 1024, 1, (1, 2)),
                           Request("r1", 1.0, 1024, 1, (1, 3))), block_size=512)
    check_rate(one)  # nothing asked
    check_rate(one, [1.0, 1])
    check_rate(two, [0.5, 2.0], rate=3.0)
    with pytest.raises(InvalidInput, match="--rate-scale 1,2 would change nothing"):
        check_rate(one, [1.0, 2.0])
    with pytest.raises(InvalidInput, match="--rate 0.5 would change nothing"):
        check_rate(one, rate=0.5)
