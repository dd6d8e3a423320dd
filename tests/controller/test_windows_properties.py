"""Properties of the observation windows (§6.1), over random streams of assignments and ticks.

test_windows.py checks hand-made cases and the fast path; here the stream is drawn and the
rules of the module doc are checked against a plain model: windows are consecutive, of fixed
length H and non-overlapping; every assignment is counted exactly once (in the window that
contains its time, or in the open window when it arrives late); demand, request counts and
the by-degree breakdowns are conserved; how often ``advance`` is called does not matter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from services.controller.windows import DemandWindows, WindowSummary
from shared.ids import InvalidInput

THRESHOLD = 1_000  # long-request threshold (tokens) used throughout


@dataclass(frozen=True)
class Rec:
    dt: float  # seconds since the previous event (negative: a late report)
    predicted_s: float
    input_len: int
    degree: int | None
    preferred: int | None


@dataclass(frozen=True)
class Adv:
    dt: float  # seconds since the previous event (>= 0)


records = st.builds(
    Rec,
    dt=st.one_of(st.floats(-15.0, 25.0), st.sampled_from([0.0, 20.0, -20.0])),
    predicted_s=st.one_of(st.floats(0.0, 50.0), st.just(0.0)),
    input_len=st.integers(1, 3 * THRESHOLD),
    degree=st.sampled_from([None, 2, 4, 8]),
    preferred=st.sampled_from([None, 2, 4]),
)
advances = st.builds(Adv, dt=st.floats(0.0, 70.0))


def _containing(start: float, window: float, t: float) -> int:
    """The window containing ``t`` under the module's rule (window k closes when
    floor((now − start) / H) > k)."""
    return math.floor((t - start) / window)


@settings(max_examples=150, deadline=None)
@given(
    start=st.sampled_from([0.0, 3.5, -40.0, 1e6]),
    window=st.sampled_from([20.0, 1.0, 0.3, 7.5]),
    events=st.lists(st.one_of(records, advances), max_size=80),
)
def test_every_assignment_is_counted_once_in_the_window_that_contains_it(
    start: float, window: float, events: list[Rec | Adv]
) -> None:
    """Consecutive fixed-length windows; each assignment lands in the window containing its
    time (a late one in the open window, tallied as late); closed windows never end after
    ``now``; Σ demand, requests, long requests and both breakdowns are conserved."""
    w = DemandWindows(window_s=window, long_threshold_tokens=THRESHOLD, start_s=start)
    closed: list[WindowSummary] = []
    expected: dict[int, list[Rec]] = {}  # window index -> its assignments (the model)
    late: dict[int, int] = {}
    now = start
    last = -math.inf  # the latest ``now`` seen
    for ev in events:
        now = now + ev.dt
        if isinstance(ev, Adv):
            if now < last:
                continue
            out = w.advance(now)
        else:
            out = w.record(now, ev.predicted_s, ev.input_len, ev.degree, ev.preferred)
        # Closed windows end by ``now``: their index is below the one containing it.
        for win in out:
            assert win.index < _containing(start, window, max(now, last))
        closed.extend(out)
        last = max(last, now)
        if isinstance(ev, Rec):
            k = _containing(start, window, now)
            if k >= w.open_index:
                assert k == w.open_index  # closed up to the window containing ``now``
            else:
                late[w.open_index] = late.get(w.open_index, 0) + 1
            expected.setdefault(w.open_index, []).append(ev)
    closed.extend(w.advance(max(last, w.open_end_s) + window))

    assert [c.index for c in closed] == list(range(len(closed)))
    for c in closed:
        assert c.start_s == start + c.index * window and c.end_s == start + (c.index + 1) * window
    for a, b in zip(closed, closed[1:], strict=False):
        assert a.end_s == b.start_s  # no gap, no overlap
    assert set(expected) <= {c.index for c in closed}
    for c in closed:
        recs = expected.get(c.index, [])
        assert c.requests == len(recs)
        assert c.long_requests == sum(r.input_len >= THRESHOLD for r in recs)
        assert c.late == late.get(c.index, 0)
        assert math.isclose(c.demand_s, math.fsum(r.predicted_s for r in recs), abs_tol=1e-9)
        for field, attr in (("demand_by_degree", "degree"), ("demand_by_preferred", "preferred")):
            want: dict[int, float] = {}
            for r in recs:
                key = getattr(r, attr)
                if key is not None:
                    want[key] = want.get(key, 0.0) + r.predicted_s
            got = dict(getattr(c, field))
            assert list(getattr(c, field)) == sorted(getattr(c, field))
            assert got.keys() == want.keys()
            for key in want:
                assert math.isclose(got[key], want[key], abs_tol=1e-9)
        if c.requests:
            assert c.long_fraction == c.long_requests / c.requests
        else:
            assert c.long_fraction is None and c.demand_s == 0.0


@settings(max_examples=150, deadline=None)
@given(
    window=st.sampled_from([20.0, 0.3, 7.5]),
    gaps=st.lists(st.floats(0.0, 30.0), max_size=40),
    ticks=st.lists(st.tuples(st.integers(0, 39), st.floats(0.0, 1.0)), max_size=30),
)
def test_advance_calls_in_between_change_no_window(
    window: float, gaps: list[float], ticks: list[tuple[int, float]]
) -> None:
    """Whether the timer ticks often, rarely or never between assignments, the closed windows
    are the same (in time order, a tick never ahead of the next assignment)."""
    times: list[float] = []
    t = 0.0
    for g in gaps:
        t += g
        times.append(t)
    calm = DemandWindows(window_s=window)
    busy = DemandWindows(window_s=window)
    got_calm: list[WindowSummary] = []
    got_busy: list[WindowSummary] = []
    extra = {i: frac for i, frac in ticks}
    prev = 0.0
    for i, t in enumerate(times):
        if i in extra:  # a tick somewhere between the previous assignment and this one
            got_busy.extend(busy.advance(prev + extra[i] * (t - prev)))
        got_calm.extend(calm.record(t, 1.0 + i, 100 + i, degree=2))
        got_busy.extend(busy.record(t, 1.0 + i, 100 + i, degree=2))
        prev = t
    end = prev + 3 * window
    got_calm.extend(calm.advance(end))
    got_busy.extend(busy.advance(end))
    assert got_busy == got_calm


# Bounded magnitudes (a jump of ``now`` to 1e4 closes 2 000 windows of 5 s) plus the extremes.
junk = st.one_of(
    st.floats(-1e3, 1e4),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e300, -0.0, 10**13]),
    st.integers(-5, 10**4),
    st.booleans(),
    st.none(),
    st.text(max_size=2),
)


@settings(max_examples=120, deadline=None)
@given(
    calls=st.lists(
        st.tuples(st.booleans(), junk, junk, junk, st.one_of(st.none(), junk)), max_size=20
    )
)
def test_arbitrary_input_raises_only_invalid_input_and_changes_nothing(
    calls: list[tuple[bool, object, object, object, object]],
) -> None:
    """``record`` and ``advance`` with arbitrary values either succeed or raise InvalidInput
    (never another error) and, when they raise, leave the windows exactly as they were."""
    w = DemandWindows(window_s=5.0, long_threshold_tokens=THRESHOLD)
    for is_record, now, pred, length, degree in calls:
        before = (w.open_index, w.open_demand_s, w._requests, w._long, w._late, w._last_now,
                  dict(w._by_degree))
        try:
            if is_record:
                w.record(now, pred, length, degree)  # type: ignore[arg-type]
            else:
                w.advance(now)  # type: ignore[arg-type]
        except InvalidInput:
            after = (w.open_index, w.open_demand_s, w._requests, w._long, w._late, w._last_now,
                     dict(w._by_degree))
            assert after == before
