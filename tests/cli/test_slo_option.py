"""``--slo``: the TTFT deadlines that SLO attainment counts and that κ_C is profiled to keep, in
``profile``, ``simulate``, ``tune``, the presets, ``up`` and ``replay``'s report."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shared.costmodel import Profile
from shared.ids import InvalidInput
from sim import runner
from sim.metrics import DEEPSEEK_V4_SLO, QWEN3_SLO, parse_slo
from vertumnus.cli import app

# Every prompt meets a deadline of 1,000 s; none meets one of a millisecond.
LAX, STRICT = "inf:1000", "inf:0.001"


def _simulate(out: Path, **kw: object) -> dict:
    args: dict[str, object] = dict(trace="synthetic", policies=["vertumnus", "homo"],
                                   rate_scales=[1.0], gpus=8, degrees=(2, 4), max_requests=150,
                                   out=out)
    args.update(kw)
    return runner.run_simulate(**args)  # type: ignore[arg-type]


def test_simulate_counts_attainment_against_the_given_deadlines(tmp_path: Path,
                                                                profile_file: Path) -> None:
    runs = {name: _simulate(tmp_path / name, profile_path=profile_file, slo=parse_slo(name))
            for name in (LAX, STRICT, "qwen3-30b-a3b")}
    for i, row in enumerate(runs["qwen3-30b-a3b"]["rows"]):
        assert runs[LAX]["rows"][i]["slo_attainment"] == 1.0
        assert runs[STRICT]["rows"][i]["slo_attainment"] == 0.0
        assert 0.0 < row["slo_attainment"] <= 1.0
        # The deadlines are only counted: with the profile given, the runs are the same.
        assert runs[LAX]["rows"][i]["mean_ttft_s"] == row["mean_ttft_s"]
    meta = json.loads((tmp_path / STRICT / "meta.json").read_text())
    assert meta["slo"] == {"name": STRICT, "bounds": [["inf", 0.001]]}
    assert runs["qwen3-30b-a3b"]["meta"]["slo"]["bounds"] == [[8192, 1.0], [32768, 5.0],
                                                               ["inf", 10.0]]


def test_simulate_measures_kappa_against_the_given_deadlines(tmp_path: Path) -> None:
    """Without --profile, κ is measured on the trace: a stricter SLO leaves less capacity."""
    qwen = _simulate(tmp_path / "q", policies=["homo"])
    deepseek = _simulate(tmp_path / "d", policies=["homo"], slo=DEEPSEEK_V4_SLO)
    kq = Profile.load(tmp_path / "q" / "profile" / "profile.json").kappa
    kd = Profile.load(tmp_path / "d" / "profile" / "profile.json").kappa
    assert set(kq) == set(kd) == {2, 4}
    assert all(kd[c] < kq[c] for c in kq), (kd, kq)
    assert deepseek["meta"]["slo"]["name"] == "deepseek-v4-flash"
    assert qwen["meta"]["slo"]["name"] == "qwen3-30b-a3b"
    (cached,) = (tmp_path / "d" / "profile").glob("kappa_*.json")
    assert json.loads(cached.read_text())["slo"]["name"] == "deepseek-v4-flash"


def test_tune_and_presets_take_the_deadlines(tmp_path: Path, profile_file: Path) -> None:
    res = runner.run_tune(trace="synthetic", rate_scales=[1.0], betas=[1.0], lams=[0.0], gpus=8,
                          max_requests=120, out=tmp_path / "t", profile_path=profile_file,
                          slo=parse_slo(STRICT))
    assert [r["slo_attainment"] for r in res["rows"]] == [0.0]
    assert res["meta"]["slo"]["name"] == STRICT
    with pytest.raises(InvalidInput, match="--policies"):  # checked before anything runs
        runner.run_preset("reconfig", out=tmp_path / "p", policies=["homo"],
                          slo=DEEPSEEK_V4_SLO)


def test_profile_measures_kappa_against_the_given_deadlines(runner_cli, tmp_path: Path) -> None:
    kappas = {}
    for name in ("qwen3-30b-a3b", "deepseek-v4-flash"):
        out = tmp_path / name
        res = runner_cli.invoke(app, ["profile", "--degrees", "1,2", "--out", str(out),
                                      "--slo", name])
        assert res.exit_code == 0, res.output
        kappas[name] = Profile.load(out / "profile.json").kappa
        report = json.loads((out / "profile_report.json").read_text())
        assert report["kappa_ramp"]["slo"]["name"] == name
    assert all(kappas["deepseek-v4-flash"][c] < kappas["qwen3-30b-a3b"][c] for c in (1, 2))


@pytest.mark.parametrize("argv", [
    ["simulate", "--slo", "8192:1"],
    ["tune", "--slo", "fast"],
    ["profile", "--slo", "8192:soon,inf:1"],
    ["up", "--slo", "nope"],
    ["replay", "--gateway", "http://127.0.0.1:9", "--slo", "0:1,inf:2"],
])
def test_a_bad_slo_exits_2_naming_it(runner_cli, tmp_path: Path, argv: list[str]) -> None:
    res = runner_cli.invoke(app, [*argv, *(["--out", str(tmp_path / "o")]
                                           if argv[0] in ("simulate", "tune", "profile")
                                           else [])])
    assert res.exit_code == 2, res.output
    assert "--slo:" in res.output
    assert not (tmp_path / "o").exists()


def test_the_torch_profile_has_no_kappa_to_hold_to_a_deadline(runner_cli, tmp_path) -> None:
    res = runner_cli.invoke(app, ["profile", "--backend", "torch", "--slo", "deepseek-v4-flash",
                                  "--out", str(tmp_path)])
    assert res.exit_code == 2 and "--slo" in res.output


def test_the_live_report_counts_attainment_against_its_deadlines() -> None:
    from vertumnus.live.replay import ReplayRecord
    from vertumnus.live.report import LiveReport

    def rec(i: int, length: int, ttft_wall: float) -> ReplayRecord:
        return ReplayRecord(request_id=f"r{i}", arrival_s=float(i), input_len=length,
                            status=200, ttft_s=ttft_wall, client_s=ttft_wall,
                            worker_id="w-cp2-g0", prefill_s=0.01)

    # Modelled TTFTs (time scale 0.1): 0.8 s for a 4K prompt, 1.5 s for a 10K one.
    recs = [rec(0, 4096, 0.08), rec(1, 10_000, 0.15)]
    qwen = LiveReport(recs, 0.1).summary()
    deepseek = LiveReport(recs, 0.1, slo=DEEPSEEK_V4_SLO).summary()
    assert qwen["slo_attainment"] == 1.0  # 1 s and 5 s deadlines
    assert deepseek["slo_attainment"] == pytest.approx(10_000 / 14_096)  # 0.5 s and 2 s
    assert deepseek["slo"] == {"name": "deepseek-v4-flash",
                               "bounds": [[8192, 0.5], [32768, 2.0], ["inf", 5.0]]}
    assert qwen["slo"]["name"] == QWEN3_SLO.name


def test_up_config_takes_only_an_slo_table() -> None:
    from vertumnus.live.stack import UpConfig

    with pytest.raises(ValueError, match="SLO table"):
        UpConfig(slo="qwen3-30b-a3b")  # type: ignore[arg-type]
    assert UpConfig(slo=DEEPSEEK_V4_SLO).slo is DEEPSEEK_V4_SLO
    assert math.isinf(UpConfig().slo.bounds[-1][0])


@pytest.fixture
def runner_cli(runner):  # the session's typer CliRunner (conftest) under a clearer name
    return runner
