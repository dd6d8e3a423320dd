"""Observation windows: D(k), long-request fraction, closing driven by `now`."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.windows import DemandWindows
from shared.ids import InvalidInput


def test_demand_and_long_fraction_of_one_window() -> None:
    w = DemandWindows()  # H = 20 s, long ≥ 32768 tokens
    assert w.record(1.0, 2.0, 40_000, degree=4) == []
    assert w.record(5.0, 1.5, 1_000, degree=2) == []
    assert w.record(19.5, 0.25, 32_768) == []  # exactly the threshold counts as long
    assert w.advance(19.99) == []
    (win,) = w.advance(20.0)
    assert (win.index, win.start_s, win.end_s) == (0, 0.0, 20.0)
    assert win.demand_s == pytest.approx(3.75)
    assert (win.requests, win.long_requests) == (3, 2)
    assert win.long_fraction == pytest.approx(2 / 3)
    assert win.demand_by_degree == ((2, 1.5), (4, 2.0))


def test_empty_windows_close_with_zero_demand() -> None:
    w = DemandWindows(window_s=20.0)
    w.record(3.0, 1.0, 100)
    closed = w.advance(65.0)  # windows [0,20), [20,40), [40,60)
    assert [c.index for c in closed] == [0, 1, 2]
    assert [c.demand_s for c in closed] == [1.0, 0.0, 0.0]
    assert closed[1].long_fraction is None and closed[1].requests == 0
    assert w.open_index == 3 and w.open_start_s == 60.0


def test_record_past_the_window_end_closes_it_first() -> None:
    w = DemandWindows(window_s=10.0, long_threshold_tokens=1000)
    w.record(1.0, 4.0, 999)
    closed = w.record(12.0, 3.0, 1000)
    assert [(c.index, c.demand_s, c.long_requests) for c in closed] == [(0, 4.0, 0)]
    assert w.open_demand_s == 3.0
    (second,) = w.advance(20.0)
    assert (second.demand_s, second.long_fraction) == (3.0, 1.0)


def test_late_report_counts_in_the_open_window() -> None:
    w = DemandWindows(window_s=10.0)
    w.advance(25.0)
    assert w.record(15.0, 2.0, 10) == []  # stamped in a closed window
    (win,) = w.advance(30.0)
    assert (win.index, win.demand_s, win.late) == (2, 2.0, 1)


def test_start_offset() -> None:
    w = DemandWindows(window_s=20.0, start_s=100.0)
    assert w.advance(119.0) == []
    (win,) = w.advance(120.0)
    assert (win.start_s, win.end_s) == (100.0, 120.0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window_s": 0.0},
        {"window_s": math.inf},
        {"long_threshold_tokens": 0},
        {"start_s": math.nan},
    ],
)
def test_bad_configuration(kwargs: dict) -> None:
    with pytest.raises(InvalidInput):
        DemandWindows(**kwargs)


@pytest.mark.parametrize(
    "args",
    [
        (math.nan, 1.0, 10),
        (1.0, -0.1, 10),
        (1.0, math.inf, 10),
        (1.0, 1.0, 0),
        (1.0, 1.0, 2.5),
        (1.0, 1.0, True),
        (1e12, 1.0, 10),
        (-math.inf, 1.0, 10),
        (1.0, math.nan, 10),
        (1.0, 1.0, 10, True),
        (1.0, 1.0, 10, 2.0),
        (1.0, 1.0, 10, 0),
        (1.0, 1.0, 10, None, 0),
        (1.0, 1.0, 10, None, False),
    ],
)
def test_bad_records_change_nothing(args: tuple) -> None:
    w = DemandWindows()
    w.record(1.0, 1.0, 10)
    with pytest.raises(InvalidInput):
        w.record(*args)
    assert w.open_demand_s == 1.0 and w.open_index == 0


def test_time_going_backwards_is_rejected() -> None:
    w = DemandWindows()
    w.advance(50.0)
    with pytest.raises(InvalidInput, match="backwards"):
        w.advance(49.0)
    assert w.open_index == 2


def test_integer_times_and_degrees_are_accepted() -> None:
    w = DemandWindows()
    w.record(1, 2, 10, 2, 4)
    w.record(2.0, 0.5, 40_000, 4, 4)
    (win,) = w.advance(20)
    assert win.demand_s == 2.5 and win.requests == 2 and win.long_requests == 1
    assert win.demand_by_degree == ((2, 2.0), (4, 0.5))
    assert win.demand_by_preferred == ((4, 2.5),)


# --- record's fast path: the exact first `now` that closes the open window -----------------
def _closes(start: float, window: float, index: int, t: float) -> bool:
    return math.floor((t - start) / window) > index  # the rule _close_until applies


@pytest.mark.parametrize(
    ("start", "window"),
    [(0.0, 20.0), (0.3, 0.1), (140.0, 20.0), (-7.25, 3.3), (1e9, 1e-3), (0.0, 1e-300)],
)
def test_first_closing_is_the_exact_threshold(start: float, window: float) -> None:
    from services.controller.windows import _first_closing

    for index in (0, 1, 2, 3, 7, 29, 1000, 123_457):
        t = _first_closing(start, window, index)
        assert math.isfinite(t)
        assert _closes(start, window, index, t)
        assert not _closes(start, window, index, math.nextafter(t, -math.inf))


class _FullPath(DemandWindows):
    """Reference: every record takes the full close check (as before the fast path)."""

    def _refresh_bounds(self) -> None:
        super()._refresh_bounds()
        self._close_at = -math.inf


@settings(max_examples=80, deadline=None)
@given(
    start=st.sampled_from([0.0, 0.3, 140.0, -5.5]),
    window=st.sampled_from([20.0, 0.1, 3.3, 1.0]),
    steps=st.lists(
        st.tuples(
            st.one_of(
                st.floats(-0.5, 3.0, allow_nan=False),  # forward, or a little back (late)
                st.sampled_from([0.0, 0.1, 0.2, 0.3]),  # repeats and awkward decimal steps
            ),
            st.integers(0, 2),  # ulps nudged around the step
        ),
        max_size=60,
    ),
)
def test_fast_path_records_exactly_like_the_full_check(
    start: float, window: float, steps: list[tuple[float, int]]
) -> None:
    fast = DemandWindows(window_s=window, long_threshold_tokens=100, start_s=start)
    ref = _FullPath(window_s=window, long_threshold_tokens=100, start_s=start)
    now = start
    for i, (dt, ulps) in enumerate(steps):
        now = now + dt * window
        for _ in range(ulps):
            now = math.nextafter(now, math.inf if i % 2 else -math.inf)
        assert fast.record(now, 0.5, 50 + i, degree=2, preferred=4) == ref.record(
            now, 0.5, 50 + i, degree=2, preferred=4
        )
        assert (fast._index, fast._late, fast._last_now) == (ref._index, ref._late, ref._last_now)
        assert fast._open_start == fast.open_start_s
    if now >= fast._last_now:
        assert fast.advance(now + window) == ref.advance(now + window)


def test_a_record_at_each_boundary_float_lands_in_the_right_window() -> None:
    w = DemandWindows(window_s=0.1, start_s=0.3)
    for k in range(1, 40):
        edge = 0.3 + k * 0.1  # not exactly representable: the threshold is a few ulps off
        for t in (math.nextafter(edge, -math.inf), edge, math.nextafter(edge, math.inf)):
            w.record(t, 1.0, 10)
            assert w.open_index == max(0, math.floor((t - 0.3) / 0.1))
