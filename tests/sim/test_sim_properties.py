"""Invariants of the ground truth and the workload helpers, checked with hypothesis."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sim.groundtruth import GroundTruth
from sim.workloads import Request, Workload, scale_rate, truncate
from sim.workloads.blocks import chain

GT = GroundTruth()
lengths = st.integers(min_value=1, max_value=200_000)
prefixes = st.integers(min_value=0, max_value=200_000)
degrees = st.sampled_from([1, 2, 4, 8])


@settings(max_examples=200, deadline=None)
@given(lengths, prefixes, degrees, st.sampled_from(["cp", "tp"]))
def test_prefill_time_positive_and_monotone(r: int, p: int, c: int, kind: str) -> None:
    t = GT.prefill_time(r, p, c, kind=kind)  # type: ignore[arg-type]
    assert t > GT.calibration.d0
    # More new tokens or more cached prefix never makes the prefill faster.
    assert GT.prefill_time(r + 2 * c, p, c, kind=kind) >= t  # type: ignore[arg-type]
    assert GT.prefill_time(r, p + 512, c, kind=kind) >= t  # type: ignore[arg-type]


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=8),
    st.lists(st.integers(0, 3), min_size=1, max_size=8),
)
def test_chained_ids_equal_iff_equal_prefix(a: list[int], b: list[int]) -> None:
    ha, hb = chain(a), chain(b)
    for j in range(min(len(a), len(b))):
        assert (ha[j] == hb[j]) == (a[: j + 1] == b[: j + 1])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=30),
    st.floats(0.1, 10.0),
)
def test_scale_rate_keeps_order_and_count(arrivals: list[float], factor: float) -> None:
    reqs = [Request(f"r{i}", t, 10, 1) for i, t in enumerate(sorted(arrivals))]
    wl = Workload("w", tuple(reqs))
    scaled = scale_rate(wl, factor)
    assert [r.request_id for r in scaled] == [r.request_id for r in wl]
    assert scaled.duration_s == pytest.approx(wl.duration_s / factor, rel=1e-9, abs=1e-9)
    assert len(truncate(scaled, max_requests=5)) == min(5, len(wl))
