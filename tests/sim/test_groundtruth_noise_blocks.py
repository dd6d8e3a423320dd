"""NoisyGroundTruth draws its noise in blocks (speed); the factors are those of one draw each.

The contract (sim.groundtruth.NoisyGroundTruth): the i-th prefill of a seed's noise stream is
noise-free time × exp(σ·Z_i − σ²/2), Z_i the i-th standard normal of the generator spawned
first from ``SeedSequence(seed)``. The expectation below draws Z_i one call at a time.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sim.groundtruth import GroundTruth, NoisyGroundTruth


@pytest.mark.parametrize("seed,sigma", [(0, 0.04), (3, 0.25)])
def test_blocked_noise_equals_one_draw_per_prefill(seed: int, sigma: float) -> None:
    truth = GroundTruth()
    noisy = NoisyGroundTruth(truth, seed=seed, sigma=sigma)
    stream = np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[0])
    n = 2600  # crosses at least two block boundaries
    for i in range(n):
        r, p, c = 1 + (i * 7919) % 40_000, (i % 5) * 512, (1, 2, 4, 8)[i % 4]
        z = float(stream.standard_normal())
        want = truth.prefill_time(r, p, c) * math.exp(sigma * z - 0.5 * sigma**2)
        assert noisy.prefill_time(r, p, c).hex() == want.hex()


def test_switch_stream_is_independent_of_prefill_count() -> None:
    a, b = NoisyGroundTruth(5), NoisyGroundTruth(5)
    for _ in range(10):
        a.prefill_time(1000, 0, 2)
    assert a.switch_time() == b.switch_time()


def test_zero_sigma_is_noise_free() -> None:
    noisy = NoisyGroundTruth(1, sigma=0.0)
    assert noisy.prefill_time(5000, 1024, 4) == GroundTruth().prefill_time(5000, 1024, 4)
