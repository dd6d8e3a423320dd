"""Profiling the simulated backend: the fit lands near the note's, κ ramps behave, files appear."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from shared.costmodel import DEFAULT_PROFILE, Profile, fit_profile
from shared.ids import InvalidInput
from sim.groundtruth import DEFAULT_GROUND_TRUTH, NoisyGroundTruth
from sim.metrics import SloTable
from sim.profiling import (
    KAPPA_REPEATS,
    NOTE_COEFFICIENTS,
    KappaRamp,
    measure_kappa,
    measure_samples,
    profile_command,
    profile_grid,
    run_profile,
    score_against_truth,
)
from sim.workloads import generate
from sim.workloads.synthetic import steady

# Relative tolerances around the note's coefficients; c is the least identifiable (it trades
# off against a between degrees), seeds 0-7 land within 12% of it.
TOL = {"d": 0.10, "a": 0.06, "b": 0.08, "c": 0.20, "alpha": 0.03}


def test_grid_is_the_notes() -> None:
    grid = profile_grid()
    assert len(grid) == 8 * 5 * 4
    assert {r for r, _, _ in grid} == {1 << i for i in range(10, 18)}
    assert {p for _, p, _ in grid} == {0, 2048, 8192, 32768, 65536}
    with pytest.raises(InvalidInput):
        profile_grid(degrees=())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_noisy_fit_close_to_truth_and_note(seed: int) -> None:
    grid = profile_grid()
    samples = measure_samples(NoisyGroundTruth(seed), grid)
    prof = fit_profile(samples)
    score = score_against_truth(prof, grid, DEFAULT_GROUND_TRUTH)
    assert score["mape"] <= 0.06
    assert all(m <= 0.10 for m in score["mape_per_degree"].values())
    got = prof.coefficients.as_dict()
    for k, ref in NOTE_COEFFICIENTS.items():
        assert got[k] == pytest.approx(ref, rel=TOL[k]), k


def test_noise_free_fit_reproduces_note() -> None:
    grid = profile_grid()
    samples = measure_samples(NoisyGroundTruth(0, sigma=0.0), grid)
    prof = fit_profile(samples)
    assert prof.fit_mape == pytest.approx(0.047, abs=0.002)
    got = prof.coefficients.as_dict()
    assert got["d"] == pytest.approx(0.091, rel=0.01)
    assert got["alpha"] == pytest.approx(6.63e-9, rel=0.01)
    assert got["b"] == pytest.approx(6.9e-6, rel=0.01)
    assert got["c"] == pytest.approx(24.4e-6, rel=0.01)
    assert got["a"] == pytest.approx(52.8e-6, rel=0.02)


def test_kappa_ramp_crosses_target() -> None:
    lengths = np.array([1024, 2048, 4096] * 10)
    res = measure_kappa(
        DEFAULT_PROFILE, NoisyGroundTruth(1), 2, lengths, rng=np.random.default_rng(0)
    )
    assert res.status == "ok"
    assert res.excluded_token_share == 0.0
    # κ is demand per window below one worker's full time (seconds of predicted service).
    assert 0 < res.kappa < 20.0
    assert res.levels[-1]["attainment"] < 0.9 <= res.levels[-2]["attainment"]
    loads = [lvl["load"] for lvl in res.levels]
    assert loads == sorted(loads)


def test_kappa_excludes_lengths_an_idle_worker_cannot_serve() -> None:
    # 64K at C=1 takes ~20 s > 10 s deadline: excluded, the ramp runs on the rest.
    lengths = np.array([1024] * 9 + [65536])
    res = measure_kappa(
        DEFAULT_PROFILE, NoisyGroundTruth(1), 1, lengths, rng=np.random.default_rng(0)
    )
    assert res.excluded_token_share == pytest.approx(65536 / (65536 + 9 * 1024))
    assert res.kappa > 0
    none = measure_kappa(
        DEFAULT_PROFILE, NoisyGroundTruth(1), 1, np.array([65536]), rng=np.random.default_rng(0)
    )
    assert none.status == "infeasible" and none.kappa > 0


def test_kappa_ceiling_with_generous_slo() -> None:
    ramp = KappaRamp(load_max=0.3, slo=SloTable(((math.inf, 1e6),)), min_requests_per_level=200)
    res = measure_kappa(
        DEFAULT_PROFILE,
        NoisyGroundTruth(1),
        4,
        np.array([4096]),
        rng=np.random.default_rng(0),
        ramp=ramp,
    )
    assert res.status == "ceiling"
    assert res.levels[-1]["load"] == pytest.approx(0.3)


def test_ramp_settings_validated() -> None:
    with pytest.raises(InvalidInput):
        KappaRamp(target=1.5)
    with pytest.raises(InvalidInput):
        KappaRamp(windows_per_level=2, warmup_windows=2)


def test_run_profile_writes_files_and_is_deterministic(tmp_path: Path) -> None:
    wl = generate(steady(300.0, 4.0, 0.05), seed=0)
    ramp = KappaRamp(min_requests_per_level=400, load_step=0.1)
    prof, report = run_profile(
        tmp_path / "a", degrees=(1, 2, 4), seed=5, kappa_workload=wl, ramp=ramp
    )
    files = {p.name for p in (tmp_path / "a").iterdir()}
    assert files == {
        "profile.json",
        "profile_report.json",
        "profile_fit.png",
        "profile_samples.csv",
    }
    assert (tmp_path / "a" / "profile_fit.png").read_bytes()[:4] == b"\x89PNG"
    loaded = Profile.load(tmp_path / "a" / "profile.json")
    assert loaded == prof
    assert set(loaded.kappa) == {1, 2, 4} and all(k > 0 for k in loaded.kappa.values())
    assert loaded.window_s == 20.0 and loaded.hardware == "H20"
    rep = json.loads((tmp_path / "a" / "profile_report.json").read_text())
    assert rep["fit_vs_truth"]["mape"] <= 0.06
    assert set(rep["fit_vs_truth"]["mape_per_degree"]) == {"1", "2", "4"}
    assert rep["kappa_ramp"]["results"]["1"]["status"] in {"ok", "ceiling", "never_met"}
    assert rep == json.loads(json.dumps(report))
    prof2, _ = run_profile(tmp_path / "b", degrees=(1, 2, 4), seed=5, kappa_workload=wl, ramp=ramp)
    assert prof2 == prof


def test_kappa_repeats_take_the_median_of_independent_ramps(tmp_path: Path) -> None:
    """``kappa_repeats`` N > 1: N single-worker ramps per degree, each on streams of its own,
    and κ_C their median (the report keeps every draw); deterministic for a seed; nine by
    default. 1 keeps one ramp per degree from streams shared in degree order; the fit is the
    same either way; bad values are refused."""
    wl = generate(steady(300.0, 4.0, 0.05), seed=0)
    ramp = KappaRamp(min_requests_per_level=400, load_step=0.1)
    common = dict(seed=5, kappa_workload=wl, ramp=ramp)
    prof, _ = run_profile(tmp_path / "a", degrees=(2, 4), kappa_repeats=3, **common)
    rep = json.loads((tmp_path / "a" / "profile_report.json").read_text())
    assert rep["kappa_repeats"] == 3
    for c in (2, 4):
        draws = rep["kappa_ramp"]["results"][str(c)]["draws"]
        assert len(draws) == 3 and prof.kappa[c] == sorted(draws)[1]
        assert rep["kappa_ramp"]["results"][str(c)]["kappa"] == prof.kappa[c]
    assert len(set(rep["kappa_ramp"]["results"]["2"]["draws"])) > 1  # independent ramps
    again, _ = run_profile(tmp_path / "b", degrees=(2, 4), kappa_repeats=3, **common)
    assert again == prof  # deterministic for a seed
    one, _ = run_profile(tmp_path / "c", degrees=(2, 4), kappa_repeats=1, **common)
    assert "draws" not in json.loads((tmp_path / "c" / "profile_report.json").read_text())[
        "kappa_ramp"]["results"]["2"]
    assert one.coefficients == prof.coefficients  # only κ's measurement differs
    run_profile(tmp_path / "e", degrees=(2,), **common)  # the default: KAPPA_REPEATS ramps
    rep = json.loads((tmp_path / "e" / "profile_report.json").read_text())
    assert rep["kappa_repeats"] == KAPPA_REPEATS == 9
    assert len(rep["kappa_ramp"]["results"]["2"]["draws"]) == 9
    for bad in (0, -1, 2.0, True):
        with pytest.raises(InvalidInput, match="kappa_repeats"):
            run_profile(tmp_path / "d", degrees=(2,), kappa_repeats=bad, **common)  # type: ignore[arg-type]


def test_profile_command(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="backend"):
        profile_command(tmp_path, backend="torch")
    path = profile_command(tmp_path / "p", degrees=(2, 4), seed=0)
    prof = Profile.load(path)
    assert set(prof.kappa) == {2, 4}
    assert prof.fit_mape is not None and prof.fit_mape < 0.08
