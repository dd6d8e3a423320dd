"""The ground truth reproduces the note's table and behaves as its docstrings promise."""

from __future__ import annotations

import random

import pytest

from shared.ids import InvalidInput
from sim.groundtruth import (
    H20,
    H20_3E,
    H200,
    GroundTruth,
    NoisyGroundTruth,
    Surroundings,
    prefill_time,
)

K = 1024
# ground-truth.md, P = 0: S -> times at C = 1, 2, 4, 8 (seconds).
TABLE = {
    1 * K: (0.138, 0.176, 0.163, 0.156),
    2 * K: (0.242, 0.252, 0.223, 0.209),
    8 * K: (1.013, 0.779, 0.623, 0.546),
    32 * K: (6.602, 4.140, 2.850, 2.205),
    64 * K: (20.294, 11.742, 7.378, 5.197),
    128 * K: (69.075, 37.643, 21.784, 13.855),
}
# With a prefix: (R, P) -> (time at C=1, speedups at C = 2, 4, 8).
PREFIX_ROWS = {
    (4 * K, 32 * K): (1.48, 1.34, 1.80, 2.17),
    (1 * K, 120 * K): (1.40, 0.93, 1.07, 1.16),
}


@pytest.mark.parametrize("s", sorted(TABLE))
def test_table_p0_within_one_percent(s: int) -> None:
    for c, expected in zip((1, 2, 4, 8), TABLE[s], strict=True):
        got = prefill_time(s, 0, c)
        assert got == pytest.approx(expected, rel=0.01), (s, c, got)


@pytest.mark.parametrize("rp", sorted(PREFIX_ROWS))
def test_prefix_rows_within_one_percent(rp: tuple[int, int]) -> None:
    r, p = rp
    t1, *speedups = PREFIX_ROWS[rp]
    base = prefill_time(r, p, 1)
    assert base == pytest.approx(t1, rel=0.01)
    for c, sp in zip((2, 4, 8), speedups, strict=True):
        assert base / prefill_time(r, p, c) == pytest.approx(sp, rel=0.01), (r, p, c)


def test_figure2_speedups_at_64k() -> None:
    t1 = prefill_time(64 * K, 0, 1)
    assert t1 / prefill_time(64 * K, 0, 4) == pytest.approx(2.71, abs=0.05)
    assert t1 / prefill_time(64 * K, 0, 8) == pytest.approx(3.91, abs=0.02)


def test_all_ranks_balanced_and_padding_monotone() -> None:
    gt = GroundTruth()
    # R not divisible by 2C is padded: never faster than the next multiple's unpadded length.
    assert gt.prefill_time(1000, 0, 8) >= gt.prefill_time(992, 0, 8)
    # More cached prefix never makes a prefill cheaper.
    for c in (1, 2, 4, 8):
        assert gt.prefill_time(4096, 8192, c) > gt.prefill_time(4096, 0, c)


def test_tp_variant() -> None:
    gt = GroundTruth()
    # TP-1 is CP-1: nothing to split, no collective.
    assert gt.prefill_time(8192, 1024, 1, kind="tp") == pytest.approx(
        gt.prefill_time(8192, 1024, 1)
    )
    # TP-4 speeds up long prefill, but sigma·R and d0 stay serial.
    t1 = gt.prefill_time(32 * K, 0, 1, kind="tp")
    t4 = gt.prefill_time(32 * K, 0, 4, kind="tp")
    assert 1.5 < t1 / t4 < 4.0
    assert t4 > gt.calibration.sigma * 32 * K
    # Short requests: TP has no d_cp, so it beats CP-4 there.
    assert gt.prefill_time(1024, 0, 4, kind="tp") < gt.prefill_time(1024, 0, 4)


def test_bad_input_is_typed() -> None:
    gt = GroundTruth()
    for args in [(0, 0, 1), (10, -1, 1), (10, 0, 0), (1.5, 0, 1)]:
        with pytest.raises(InvalidInput):
            gt.prefill_time(*args)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput, match="kind"):
        gt.prefill_time(10, 0, 1, kind="pp")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        Surroundings(switch_min_s=2.0, switch_max_s=1.0)


def test_noise_seeded_mean_one() -> None:
    a, b = NoisyGroundTruth(7), NoisyGroundTruth(7)
    xs = [a.prefill_time(8192, 0, 4) for _ in range(2000)]
    assert xs == [b.prefill_time(8192, 0, 4) for _ in range(2000)]
    base = prefill_time(8192, 0, 4)
    ratios = [x / base for x in xs]
    mean = sum(ratios) / len(ratios)
    sd = (sum((r - mean) ** 2 for r in ratios) / len(ratios)) ** 0.5
    assert mean == pytest.approx(1.0, abs=0.005)
    assert sd == pytest.approx(0.04, rel=0.1)
    assert NoisyGroundTruth(8).prefill_time(8192, 0, 4) != xs[0]
    assert NoisyGroundTruth(1, sigma=0).prefill_time(8192, 0, 4) == base
    with pytest.raises(InvalidInput):
        NoisyGroundTruth(1, sigma=-0.1)


def test_switch_times_independent_of_noise_stream() -> None:
    a, b = NoisyGroundTruth(3), NoisyGroundTruth(3)
    a.prefill_time(1024, 0, 1)
    s = [a.switch_time() for _ in range(100)]
    assert s == [b.switch_time() for _ in range(100)]
    assert all(0.5 <= x <= 1.0 for x in s)
    assert 0.5 <= GroundTruth().switch_time(random.Random(1)) <= 1.0


def test_kv_handoff_and_external_time() -> None:
    gt = GroundTruth()
    # 40K tokens · 96 KiB = 4.03 GB over 40 GB/s → 0.1007 s at C=1, a quarter at C=4.
    assert gt.kv_handoff_time(40_000, 1) == pytest.approx(40_000 * 96 * K / 40e9)
    assert gt.kv_handoff_time(40_000, 4) == pytest.approx(gt.kv_handoff_time(40_000, 1) / 4)
    assert gt.external_time(0, 2) == pytest.approx(0.030)


def test_kv_capacity() -> None:
    gt = GroundTruth()
    per_gpu = gt.kv_capacity_tokens_per_gpu()
    assert per_gpu == pytest.approx(712_000, rel=0.005)
    assert gt.kv_capacity_blocks(1) == pytest.approx(1390, abs=1)
    assert gt.kv_capacity_blocks(4) == 4 * gt.kv_capacity_blocks(1)
    assert GroundTruth(memory_gpu=H20).kv_capacity_tokens_per_gpu() == pytest.approx(
        254_000, rel=0.02
    )
    small = GroundTruth(surroundings=Surroundings(kv_capacity_blocks_per_gpu=64))
    assert small.kv_capacity_blocks(2) == 128
    with pytest.raises(InvalidInput):
        Surroundings(kv_capacity_blocks_per_gpu=0)


def test_replication_time() -> None:
    gt = GroundTruth()
    one_block = 512 * 96 * K
    assert gt.replication_time(100, same_node=False) == pytest.approx(100 * one_block / 40e9)
    assert gt.replication_time(100, same_node=True) < gt.replication_time(100, same_node=False)
    assert gt.replication_time(100, same_node=False, links=4) == pytest.approx(
        gt.replication_time(100, same_node=False) / 4
    )
    assert gt.replication_time(0, same_node=True) == 0.0
    with pytest.raises(InvalidInput):
        gt.replication_time(-1, same_node=True)


def test_gpu_presets() -> None:
    assert H20.peak_flops == H20_3E.peak_flops and H20_3E.hbm_bytes == 141e9
    fast = GroundTruth(gpu=H200)
    assert fast.prefill_time(64 * K, 0, 1) < prefill_time(64 * K, 0, 1)


def test_noisy_constructor_call_styles() -> None:
    gt = GroundTruth(gpu=H200)
    a = NoisyGroundTruth(gt, seed=4, sigma=0.05)
    b = NoisyGroundTruth(4, 0.05, gt)
    assert a.truth is gt and b.truth is gt and a.seed == b.seed == 4
    assert a.prefill_time(4096, 0, 2) == b.prefill_time(4096, 0, 2)
    assert NoisyGroundTruth().seed == 0 and NoisyGroundTruth(seed=3).seed == 3
    with pytest.raises(InvalidInput):
        NoisyGroundTruth(3, seed=4)
    with pytest.raises(InvalidInput):
        NoisyGroundTruth(-1)
