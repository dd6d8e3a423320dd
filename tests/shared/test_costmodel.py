"""The cost model of §3.2: hand-computed values, fitting, profile files, bad input."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from shared.costmodel import (
    Coefficients,
    Profile,
    Sample,
    attention_work,
    fit_profile,
    mape,
)
from shared.ids import InvalidInput

ROUND = Coefficients(d=0.1, a=1e-4, b=1e-5, c=2e-4, alpha=1e-8)


def test_attention_work_matches_eq1() -> None:
    # W(R, P) = R·P + R(R+1)/2
    assert attention_work(4, 0) == 10
    assert attention_work(4, 10) == 40 + 10
    assert attention_work(1, 1000) == 1000 + 1


def test_predict_matches_eq2_by_hand() -> None:
    prof = Profile(coefficients=ROUND)
    r, p, c = 1000, 3000, 4
    w = 1000 * 3000 + 1000 * 1001 / 2  # 3,500,500
    expected = 0.1 + 1e-4 * 1000 + 1e-5 * 3000 + (2e-4 * 1000 + 1e-8 * w) / 4
    assert prof.predict(r, p, c) == pytest.approx(expected, rel=1e-12)
    assert prof.predict_fast(r, p, c) == pytest.approx(expected, rel=1e-12)


def test_per_degree_coefficients_take_precedence() -> None:
    other = Coefficients(d=1.0, a=0, b=0, c=0, alpha=0)
    prof = Profile(coefficients=ROUND, per_degree={8: other})
    assert prof.predict(100, 0, 8) == 1.0
    assert prof.predict(100, 0, 4) == pytest.approx(ROUND.predict(100, 0, 4))


@pytest.mark.parametrize(("r", "p", "c"), [(0, 0, 1), (-5, 0, 2), (10, -1, 2), (10, 0, 0)])
def test_predict_rejects_bad_input(r: int, p: int, c: int) -> None:
    with pytest.raises(InvalidInput):
        Profile().predict(r, p, c)


def test_fit_recovers_exact_coefficients() -> None:
    samples = [
        Sample(r, p, c, ROUND.predict(r, p, c))
        for r in (512, 2048, 8192, 32768)
        for p in (0, 4096, 16384)
        for c in (1, 2, 4, 8)
    ]
    prof = fit_profile(samples)
    for name in ("d", "a", "b", "c", "alpha"):
        assert getattr(prof.coefficients, name) == pytest.approx(
            getattr(ROUND, name), rel=1e-6, abs=1e-12
        )
    assert prof.fit_mape is not None and prof.fit_mape < 1e-9
    assert set(prof.fit_mape_per_degree) == {1, 2, 4, 8}


def test_fit_with_noise_reports_mape_and_per_degree() -> None:
    rng = np.random.default_rng(0)
    samples = [
        Sample(r, p, c, ROUND.predict(r, p, c) * float(rng.lognormal(0, 0.04)))
        for r in (1024, 4096, 16384, 65536)
        for p in (0, 8192)
        for c in (1, 2, 4)
    ]
    prof = fit_profile(samples, per_degree=True)
    assert 0 < prof.fit_mape < 0.08
    assert set(prof.per_degree) == {1, 2, 4}
    overall, per = mape(prof, samples)
    assert overall == pytest.approx(prof.fit_mape)
    assert per.keys() == {1, 2, 4}


def test_fit_rejects_bad_samples() -> None:
    with pytest.raises(InvalidInput):
        fit_profile([(1, 0, 1, 0.1)] * 3)  # too few
    with pytest.raises(InvalidInput):
        fit_profile([(1, 0, 1, -0.1)] * 6)
    with pytest.raises(InvalidInput):
        fit_profile([(1, 0)] * 6)  # type: ignore[list-item]


def test_profile_round_trips_through_json(tmp_path) -> None:
    prof = Profile(
        coefficients=ROUND,
        per_degree={2: ROUND},
        kappa={2: 11.5, 4: 9.0},
        fit_mape=0.05,
        fit_mape_per_degree={2: 0.04},
    )
    path = tmp_path / "profile.json"
    prof.save(path)
    again = Profile.load(path)
    assert again == prof
    assert again.kappa_for(2) == 11.5
    assert again.kappa_for(8) == pytest.approx(0.7 * again.window_s)


def test_malformed_profile_file_is_a_clear_error(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidInput, match="not JSON"):
        Profile.load(bad)
    bad.write_text(json.dumps({"coefficients": {"d": 1}}))
    with pytest.raises(InvalidInput, match="malformed"):
        Profile.load(bad)
    with pytest.raises(InvalidInput, match="not found"):
        Profile.load(tmp_path / "missing.json")
    with pytest.raises(InvalidInput):
        Profile(kappa={2: -1.0})
    assert math.isfinite(Profile().predict(1, 0, 1))
