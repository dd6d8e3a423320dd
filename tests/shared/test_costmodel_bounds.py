"""shared/costmodel.py: a profile file's numbers are bounded where they are read. An integer
too large for a float is an InvalidInput naming the file and the field (not an OverflowError),
and coefficients are bounded so that every request within the project's token limits
(R, P <= MAX_TOKENS, C >= 1) is predicted a finite, non-negative time."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from shared.costmodel import (
    COEFFICIENT_BOUNDS,
    DEFAULT_PROFILE,
    MAX_PREDICTED_S,
    Coefficients,
    Profile,
)
from shared.ids import InvalidInput
from shared.schemas import MAX_TOKENS

ROUND = {"d": 0.09, "a": 5e-5, "b": 7e-6, "c": 2e-5, "alpha": 6e-9}
GOOD = {"schema_version": 1, "coefficients": ROUND, "kappa": {"2": 11.5},
        "per_degree": {"4": ROUND}, "fit": {"mape": 0.05, "mape_per_degree": {"2": 0.04}}}
REPO = Path(__file__).resolve().parents[2]
BIG = 10**400  # an integer JSON allows and no float holds


def _load(tmp_path: Path, data: object) -> Profile:
    f = tmp_path / "p.json"
    f.write_text(json.dumps(data))
    return Profile.load(f)


def _refused(tmp_path: Path, data: object, field: str) -> str:
    with pytest.raises(InvalidInput) as ei:
        _load(tmp_path, data)
    msg = str(ei.value)
    assert msg.startswith(f"profile {tmp_path / 'p.json'}: "), msg
    assert f"{field} " in msg, msg
    return msg


@pytest.mark.parametrize(("data", "field"), [
    ({**GOOD, "window_s": BIG}, "window_s"),
    ({**GOOD, "kappa": {"2": BIG}}, "kappa.2"),
    ({**GOOD, "coefficients": {**ROUND, "d": BIG}}, "coefficients.d"),
    ({**GOOD, "per_degree": {"4": {**ROUND, "alpha": BIG}}}, "per_degree.4.alpha"),
    ({**GOOD, "fit": {"mape": BIG}}, "fit.mape"),
    ({**GOOD, "fit": {"mape_per_degree": {"2": -BIG}}}, "fit.mape_per_degree.2"),
], ids=["window_s", "kappa", "coefficient", "per-degree", "mape", "mape-per-degree"])
def test_an_integer_too_large_for_a_float_names_the_file_and_field(tmp_path: Path, data: dict,
                                                                   field: str) -> None:
    _refused(tmp_path, data, field)


@pytest.mark.parametrize("name", ["d", "a", "b", "c", "alpha"])
def test_a_coefficient_beyond_its_bound_is_refused_naming_it(tmp_path: Path, name: str) -> None:
    bound = COEFFICIENT_BOUNDS[name]
    ok = _load(tmp_path, {**GOOD, "coefficients": {**ROUND, name: bound}})
    assert math.isfinite(ok.predict(MAX_TOKENS, MAX_TOKENS, 1))
    msg = _refused(tmp_path, {**GOOD, "coefficients": {**ROUND, name: bound * 1.01}},
                   f"coefficients.{name}")
    assert "at most" in msg, msg
    _refused(tmp_path, {**GOOD, "per_degree": {"4": {**ROUND, name: 1e300}}},
             f"per_degree.4.{name}")


def test_alpha_1e300_is_refused(tmp_path: Path) -> None:
    _refused(tmp_path, {**GOOD, "coefficients": {**ROUND, "alpha": 1e300}}, "coefficients.alpha")


def test_the_largest_coefficients_predict_finite_times_everywhere(tmp_path: Path) -> None:
    # Every coefficient at its bound: the worst request there is (C = 1, R = P = MAX_TOKENS)
    # is finite, as are sums and differences of such predictions.
    prof = _load(tmp_path, {**GOOD, "coefficients": dict(COEFFICIENT_BOUNDS),
                            "per_degree": {}})
    worst = prof.predict(MAX_TOKENS, MAX_TOKENS, 1)
    assert math.isfinite(worst) and worst > 0
    assert worst <= MAX_PREDICTED_S * (1 + 1e-9)
    assert prof.predict_fast(MAX_TOKENS, MAX_TOKENS, 1) == pytest.approx(worst)
    for r, p, c in [(1, 0, 1), (MAX_TOKENS, 0, 1), (1, MAX_TOKENS, 4), (MAX_TOKENS // 2, 7, 2)]:
        t = prof.predict(r, p, c)
        assert math.isfinite(t) and t >= 0
        assert math.isfinite(worst - t) and math.isfinite(worst + t)
    assert math.isfinite(sum([worst] * 1000))


def test_a_coefficient_set_beyond_the_bound_is_refused_when_built() -> None:
    with pytest.raises(InvalidInput, match="coefficients.alpha"):
        Profile(coefficients=Coefficients(d=0.1, a=0.0, b=0.0, c=0.0, alpha=1e300))
    with pytest.raises(InvalidInput, match=r"per_degree.2.d"):
        Profile(per_degree={2: Coefficients(d=math.inf, a=0.0, b=0.0, c=0.0, alpha=1e-9)})


def test_the_default_and_fitted_profiles_load(tmp_path: Path) -> None:
    f = tmp_path / "default.json"
    DEFAULT_PROFILE.save(f)
    assert Profile.load(f) == DEFAULT_PROFILE
    assert _load(tmp_path, GOOD).predict(MAX_TOKENS, MAX_TOKENS, 1) > 0


def test_a_profile_the_project_fits_loads(tmp_path: Path) -> None:
    # `vertumnus profile` as an operator runs it (the sim backend, one set per degree too).
    proc = subprocess.run([sys.executable, "-m", "vertumnus", "profile", "--backend", "sim",
                           "--per-degree", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    prof = Profile.load(tmp_path / "profile.json")
    assert prof.per_degree
    for c in (1, 2, 4, 8):
        t = prof.predict(MAX_TOKENS, MAX_TOKENS, c)
        assert math.isfinite(t) and 0 < t <= MAX_PREDICTED_S
