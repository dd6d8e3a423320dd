"""The cost model of §3.2: hand-computed values, fitting, profile files, bad input."""

from __future__ import annotations

import json
import math
from dataclasses import replace

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


def test_mape_is_the_mean_relative_error_against_the_measured_time() -> None:
    # Ê = R / C with every other coefficient zero: Ê(4, ·, 2) = 2.0 and Ê(4, ·, 4) = 1.0.
    prof = Profile(coefficients=Coefficients(d=0.0, a=0.0, b=0.0, c=1.0, alpha=0.0))
    samples = [
        Sample(4, 0, 2, 2.5),  # |2.0 - 2.5| / 2.5 = 0.20
        Sample(4, 7, 2, 1.6),  # |2.0 - 1.6| / 1.6 = 0.25
        Sample(4, 0, 4, 0.8),  # |1.0 - 0.8| / 0.8 = 0.25
    ]
    overall, per = mape(prof, samples)
    # Overall: the mean over samples (0.20 + 0.25 + 0.25) / 3, not the mean of the
    # per-degree means (which would be 0.2375).
    assert overall == pytest.approx(0.7 / 3, rel=1e-12)
    assert per == pytest.approx({2: 0.225, 4: 0.25}, rel=1e-12)
    assert list(per) == [2, 4]
    nan_overall, none = mape(prof, [])
    assert math.isnan(nan_overall) and none == {}


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


def test_a_pooled_kappa_is_judged_as_it_is(tmp_path) -> None:
    single = Profile(coefficients=ROUND, kappa={2: 11.5})
    pooled = replace(single, kappa_pooled=True)
    assert (single.capacity_scale(2.2), pooled.capacity_scale(2.2)) == (2.2, 1.0)
    path = tmp_path / "profile.json"
    pooled.save(path)
    assert json.loads(path.read_text())["kappa_pooled"] is True
    assert Profile.load(path) == pooled
    # A file written before the field existed reads as a single worker's κ.
    data = single.to_dict()
    del data["kappa_pooled"]
    assert Profile.from_dict(data) == single and not single.kappa_pooled


def test_malformed_profile_file_is_a_clear_error(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(InvalidInput, match="not JSON"):
        Profile.load(bad)
    bad.write_text('{"a": ' + "9" * 5000 + "}")  # more digits than Python converts
    with pytest.raises(InvalidInput, match="not JSON"):
        Profile.load(bad)
    bad.write_text(json.dumps({"coefficients": {"d": 1}}))
    with pytest.raises(InvalidInput, match=r"coefficients lacks 'a', 'b', 'c', 'alpha'"):
        Profile.load(bad)
    with pytest.raises(InvalidInput, match="not found"):
        Profile.load(tmp_path / "missing.json")
    with pytest.raises(InvalidInput):
        Profile(kappa={2: -1.0})
    assert math.isfinite(Profile().predict(1, 0, 1))


GOOD = {"coefficients": ROUND.as_dict(), "kappa": {"2": 11.5}}


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ([1, 2], "expected a JSON object, got a list"),
        ("x", "expected a JSON object, got a string ('x')"),
        ({"kappa": {"2": 1.0}}, "'coefficients' is missing"),
        ({"coefficients": [1, 2, 3, 4, 5]}, "coefficients must be an object of d, a, b, c, "
                                            "alpha, got a list"),
        ({"coefficients": {**ROUND.as_dict(), "e": 1.0}}, "coefficients has unknown key(s) 'e'"),
        ({"coefficients": {**ROUND.as_dict(), "a": -1e-4}}, "coefficients.a must be >= 0"),
        ({"coefficients": {**ROUND.as_dict(), "d": float("nan")}},
         "coefficients.d must be finite"),
        ({"coefficients": {**ROUND.as_dict(), "alpha": float("inf")}},
         "coefficients.alpha must be finite"),
        ({"coefficients": {**ROUND.as_dict(), "b": "1e-5"}},
         "coefficients.b must be a number, got a string"),
        ({"coefficients": {**ROUND.as_dict(), "c": True}}, "coefficients.c must be a number"),
        ({"coefficients": dict.fromkeys("dabc", 0.0) | {"alpha": 0.0}},
         "coefficients: d, a, c and alpha are all 0"),
        ({"coefficients": dict.fromkeys("dac", 0.0) | {"b": 1e-5, "alpha": 0.0}},
         "coefficients: d, a, c and alpha are all 0"),
        ({**GOOD, "per_degree": {"4": {**ROUND.as_dict(), "d": -0.1}}},
         "per_degree.4.d must be >= 0"),
        ({**GOOD, "per_degree": {"four": ROUND.as_dict()}},
         "per_degree: key 'four' is not a CP degree"),
        ({**GOOD, "per_degree": {"0": ROUND.as_dict()}}, "per_degree: key '0' is not a CP"),
        ({**GOOD, "per_degree": [ROUND.as_dict()]}, "per_degree must be an object keyed by CP"),
        ({**GOOD, "kappa": {"2": -1.0}}, "kappa.2 must be > 0"),
        ({**GOOD, "kappa": {"2": None}}, "kappa.2 must be a number, got null"),
        ({**GOOD, "kappa": [11.5]}, "kappa must be an object keyed by CP degree, got a list"),
        ({**GOOD, "window_s": 0}, "window_s must be > 0"),
        ({**GOOD, "window_s": float("nan")}, "window_s must be finite"),
        ({**GOOD, "block_size": 0}, "block_size must be an integer >= 1"),
        ({**GOOD, "block_size": 512.5}, "block_size must be an integer >= 1"),
        ({**GOOD, "kappa_pooled": "yes"}, "kappa_pooled must be true or false, got a string"),
        ({**GOOD, "kappa_pooled": 1}, "kappa_pooled must be true or false, got a number"),
        ({**GOOD, "fit": [0.1]}, "'fit' must be an object, got a list"),
        ({**GOOD, "fit": {"mape": "low"}}, "fit.mape must be a number"),
        ({**GOOD, "schema_version": 2}, "unsupported schema_version 2"),
    ],
)
def test_a_bad_profile_file_names_the_file_and_field(tmp_path, data, words: str) -> None:
    f = tmp_path / "p.json"
    f.write_text(json.dumps(data))
    with pytest.raises(InvalidInput) as ei:
        Profile.load(f)
    msg = str(ei.value)
    assert msg.startswith(f"profile {f}: "), msg
    assert words in msg, msg
    # No Python exception text leaks into the message.
    for leak in ("Error(", "object has no attribute", "positional argument", "KeyError"):
        assert leak not in msg, msg


def test_a_profile_file_that_is_not_json_text(tmp_path) -> None:
    f = tmp_path / "p.json"
    f.write_bytes(b'{"coefficients": \xff}')
    with pytest.raises(InvalidInput, match=r"p\.json: not JSON \(not valid UTF-8 text\)"):
        Profile.load(f)
    with pytest.raises(InvalidInput, match="is a directory, not a profile file"):
        Profile.load(tmp_path)
    # A byte-order mark is tolerated; b alone may be 0 and so may all but one coefficient.
    f.write_bytes(b"\xef\xbb\xbf" + json.dumps(
        {"coefficients": {"d": 0, "a": 0, "b": 0, "c": 0, "alpha": 1e-9}}).encode())
    assert Profile.load(f).predict(1, 0, 1) > 0


def test_missing_kappa_is_reported_and_checkable(tmp_path) -> None:
    prof = Profile(coefficients=ROUND, kappa={2: 11.5})
    f = tmp_path / "profile.json"
    prof.save(f)
    loaded = Profile.load(f)  # the services' use: the documented fallback stays
    assert loaded.kappa_for(4) == pytest.approx(0.7 * loaded.window_s)
    assert loaded.missing_kappa([8, 2, 4, 4]) == (4, 8)
    assert loaded.missing_kappa([2]) == ()
    loaded.check_degrees([2])
    with pytest.raises(InvalidInput) as ei:
        loaded.check_degrees([2, 4, 8], source=f"profile {f}")
    msg = str(ei.value)
    assert msg.startswith(f"profile {f} has no kappa for CP degree(s) 4, 8 (it has kappa for: 2)")
    with pytest.raises(InvalidInput, match=r"has no kappa for CP degree\(s\) 4 "):
        Profile.load(f, degrees=[2, 4])
    assert Profile.load(f, degrees=[2]) == prof
    none = Profile(coefficients=ROUND)
    with pytest.raises(InvalidInput, match=r"profile has no kappa for CP degree\(s\) 2, 4 "
                                           r"\(it has kappa for: none\)"):
        none.check_degrees((2, 4))
