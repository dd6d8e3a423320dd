"""shared/costmodel.py: κ_C is bounded as the coefficients are (``COEFFICIENT_BOUNDS``).

κ was checked positive and finite only, so a profile with κ = 1e308 loaded and overflowed to
infinity later: × the controller's ``kappa_scale``, × the window ratio of
``Profile.for_window``, and in the controller's sums of κ over workers. A κ above
``MAX_KAPPA_S`` is now refused where it is read, naming the field, and every κ within the
bound keeps those finite."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from shared.ids import InvalidInput

ROUND = {"d": 0.09, "a": 5e-5, "b": 7e-6, "c": 2e-5, "alpha": 6e-9}
GOOD: dict[str, Any] = {"schema_version": 1, "coefficients": ROUND,
                        "kappa": {"2": 11.5, "4": 14.0}}


def _write(tmp_path: Path, data: object) -> Path:
    f = tmp_path / "p.json"
    f.write_text(json.dumps(data))
    return f


@pytest.mark.parametrize("huge", [1e308, 1e300, 1e16])
def test_a_profile_file_with_a_huge_kappa_is_refused_naming_it(tmp_path: Path,
                                                               huge: float) -> None:
    from shared.costmodel import Profile

    f = _write(tmp_path, {**GOOD, "kappa": {"2": 11.5, "4": huge}})
    with pytest.raises(InvalidInput) as ei:
        Profile.load(f)
    msg = str(ei.value)
    assert msg.startswith(f"profile {f}: kappa.4 "), msg
    assert "at most" in msg, msg


def test_kappa_up_to_the_bound_loads_and_stays_finite_downstream(tmp_path: Path) -> None:
    from services.calibration import KAPPA_SCALE
    from services.controller.composition import capacity_of_counts
    from shared.costmodel import MAX_KAPPA_S, Profile

    prof = Profile.load(_write(tmp_path, {**GOOD, "kappa": {"2": MAX_KAPPA_S, "4": 14.0}}))
    assert prof.kappa_for(2) == MAX_KAPPA_S
    # What the controller does with it: × kappa_scale, per window of its own length (a
    # time scale of 0.05 makes a 20 s window 400 modelled seconds), summed over workers.
    judged = prof.kappa_for(2) * KAPPA_SCALE * (400.0 / prof.window_s)
    assert math.isfinite(judged)
    assert math.isfinite(sum([judged] * 1_000_000))
    assert math.isfinite(capacity_of_counts((2, 4), (10**6, 10**6), prof))


def test_a_profile_built_with_a_huge_kappa_is_refused() -> None:
    from shared.costmodel import Profile

    with pytest.raises(InvalidInput, match=r"kappa\[4\].*at most"):
        Profile(kappa={2: 11.5, 4: 1e308})
    # with_kappa (the controller's overrides) builds a profile too.
    with pytest.raises(InvalidInput, match=r"kappa\[2\].*at most"):
        Profile().with_kappa({2: 1e300})


def test_the_cli_refuses_such_a_profile_before_any_run(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from sim import runner as sim_runner
    from vertumnus.cli import app

    def boom(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("a run started despite bad input")

    monkeypatch.setattr(sim_runner, "run_simulate", boom)
    f = _write(tmp_path, {**GOOD, "kappa": {"2": 1e308, "4": 14.0}})
    res = CliRunner().invoke(app, ["simulate", "--gpus", "8", "--degrees", "2,4",
                                   "--policies", "vertumnus", "--max-requests", "30",
                                   "--profile", str(f), "--out", str(tmp_path / "o")])
    text = " ".join(res.output.split())
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    assert f"--profile: profile {f}: kappa.2 must be" in text, text
    assert "at most" in text, text


def test_a_kappa_that_scales_past_the_bound_is_refused_naming_what_was_given() -> None:
    """for_window scales κ by the ratio of the windows; a κ within the bound whose scaled
    value is not was refused naming only the scaled κ, a number the profile does not hold.
    The error names the profile's κ, its window, the window asked and the factor."""
    from shared.costmodel import MAX_KAPPA_S, Profile

    prof = Profile(kappa={2: 11.5, 4: MAX_KAPPA_S / 2}, window_s=20.0)
    with pytest.raises(InvalidInput) as ei:
        prof.for_window(400.0)  # x 20: a 20 s window at a time scale of 0.05
    msg = str(ei.value)
    assert f"kappa[4] = {MAX_KAPPA_S / 2!r}" in msg, msg
    assert "20 s" in msg and "400 s" in msg and "x 20" in msg, msg
    assert "at most" in msg, msg
    # Within the bound once scaled: as before.
    assert prof.for_window(20.0) is prof
    assert prof.for_window(30.0).kappa_for(4) == MAX_KAPPA_S / 2 * 1.5
