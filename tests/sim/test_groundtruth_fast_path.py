"""The CP fast path of GroundTruth.prefill_time is bit-identical to layer_terms' arithmetic."""

from __future__ import annotations

import random

import pytest

from shared.ids import InvalidInput
from sim.groundtruth import H200, GroundTruth


def _via_layer_terms(gt: GroundTruth, r: int, p: int, c: int) -> float:
    terms = gt.layer_terms(r, p, c, kind="cp")
    cal = gt.calibration
    fixed = cal.d0
    if c > 1:
        fixed += cal.d_cp
    return fixed + cal.sigma * r + gt.model.layers * (terms["layer"] + terms["comm"])


@pytest.mark.parametrize("gt", [GroundTruth(), GroundTruth(gpu=H200)])
def test_fast_path_is_bit_identical(gt: GroundTruth) -> None:
    rng = random.Random(7)
    for _ in range(5000):
        c = rng.choice([1, 2, 3, 4, 8, 16])
        r = rng.choice([1, 2, 3, rng.randint(1, 300), rng.randint(1, 300_000)])
        p = rng.choice([0, rng.randint(0, 200_000), rng.randint(0, 10) * 512])
        assert gt.prefill_time(r, p, c).hex() == _via_layer_terms(gt, r, p, c).hex()


def test_slow_path_still_validates() -> None:
    gt = GroundTruth()
    for bad in ((0, 0, 1), (1, -1, 1), (1, 0, 0), (True, 0, 1), (1.0, 0, 1)):
        with pytest.raises(InvalidInput):
            gt.prefill_time(*bad)
    with pytest.raises(InvalidInput):
        gt.prefill_time(1, 0, 1, kind="xx")  # type: ignore[arg-type]
