"""sim.tuning.tune_weights' controller axis: its arguments are checked before anything runs."""

from __future__ import annotations

import pytest

from services.calibration import CONTROLLER
from shared.costmodel import DEFAULT_PROFILE
from shared.ids import InvalidInput
from sim.experiments import ExperimentSpec
from sim.tuning import tune_weights
from sim.workloads import generate
from sim.workloads.synthetic import SyntheticConfig


@pytest.mark.parametrize(("controllers", "words"), [
    ([("a", CONTROLLER), ("a", CONTROLLER)], "controller settings repeat: ['a', 'a']"),
    ([("a", {"upper": 0.9})], "controller 'a' must be a ControllerConfig"),
])
def test_a_bad_controller_axis_is_refused(controllers, words) -> None:
    wl = generate(SyntheticConfig(duration_s=10.0), seed=0)
    with pytest.raises(InvalidInput) as exc:
        tune_weights(wl, [1.0], [2.0], [0.25], DEFAULT_PROFILE, ExperimentSpec(gpus=8),
                     controllers=controllers)
    assert words in str(exc.value)
