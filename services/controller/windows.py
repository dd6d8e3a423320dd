"""Observation windows and the window demand D(k) (§6.1).

Rules:

* Windows are consecutive, non-overlapping and of fixed length H (default 20 s):
  window k covers [t0 + kH, t0 + (k+1)H).
* D(k) = Σ Ê_{C_wi}(R_i, P_i) over the requests *assigned* in window k — the scheduler's
  predicted service time s_{i,wi} of each placement (Eq. 3), in seconds.
* A request is *long* when its input length is at least ``long_threshold_tokens`` (default
  32K, the paper's longest SLO class); the window reports the long-request fraction.
* An assignment may name the request's *preferred* degree (the caller's rule, e.g. the
  controller core's speedup rule); the window reports D(k) split by it.
* Closing is driven by time passed in as ``now``; a window closes once ``now`` reaches its
  end, whether or not it saw a request (an empty window closes with D = 0 and no fraction).
* ``now`` must not go backwards across calls. An assignment stamped before the open
  window's start (a late report) is counted in the open window — demand is not dropped —
  and tallied in ``late``.

Pure: no clock, no IO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

from shared.ids import InvalidInput

DEFAULT_WINDOW_S: Final[float] = 20.0
DEFAULT_LONG_THRESHOLD_TOKENS: Final[int] = 32_768
# A jump of `now` that would close more windows than this is almost surely a unit error
# (milliseconds for seconds); refusing it keeps a bad input from allocating millions.
MAX_WINDOWS_PER_ADVANCE: Final[int] = 1_000_000


# Steps of one ulp _first_closing may take; rounding moves the threshold by a few at most.
_MAX_THRESHOLD_STEPS: Final[int] = 64


def _first_closing(start_s: float, window_s: float, index: int) -> float:
    """The smallest float ``t`` with ``floor((t - start_s) / window_s) > index``, i.e. the
    earliest ``now`` at which :meth:`DemandWindows._close_until` closes window ``index``;
    -inf when it cannot be pinned down (then every call takes the full path).

    Exact, not approximate: ``(t - start_s) / window_s`` rounds monotonically in ``t``
    (window_s > 0), so the predicate is false below one float and true from it on. The
    computed end ``start_s + (index + 1) * window_s`` is within a few ulps of that float,
    found by stepping with :func:`math.nextafter` (bounded; rounding moves it by ulps).
    """

    def closes(t: float) -> bool:
        return math.floor((t - start_s) / window_s) > index

    try:
        t = start_s + (index + 1) * window_s
        if not math.isfinite(t):
            return -math.inf
        if closes(t):  # step down while the float below still closes
            for _ in range(_MAX_THRESHOLD_STEPS):
                below = math.nextafter(t, -math.inf)
                if not closes(below):
                    return t
                t = below
        else:  # step up to the first float that closes
            for _ in range(_MAX_THRESHOLD_STEPS):
                t = math.nextafter(t, math.inf)
                if closes(t):
                    return t
    except (OverflowError, ValueError):
        pass
    return -math.inf


def _check_time(name: str, t: float) -> float:
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        raise InvalidInput(f"{name} must be a finite number of seconds, got {t!r}")
    return float(t)


@dataclass(frozen=True, slots=True)
class WindowSummary:
    """One closed window: its demand D(k) and request mix."""

    index: int
    start_s: float
    end_s: float
    demand_s: float
    requests: int
    long_requests: int
    late: int = 0
    demand_by_degree: tuple[tuple[int, float], ...] = ()
    demand_by_preferred: tuple[tuple[int, float], ...] = ()

    @property
    def long_fraction(self) -> float | None:
        """Share of requests with input ≥ the long threshold; None for an empty window."""
        return self.long_requests / self.requests if self.requests else None


@dataclass
class DemandWindows:
    """Accumulates D(k) for the open window and closes windows as time advances.

    ``window_s``, ``long_threshold_tokens`` and ``start_s`` are fixed once constructed (the
    open window's bounds are derived from them and kept).
    """

    window_s: float = DEFAULT_WINDOW_S
    long_threshold_tokens: int = DEFAULT_LONG_THRESHOLD_TOKENS
    start_s: float = 0.0
    _index: int = field(default=0, init=False)
    _demand: float = field(default=0.0, init=False)
    _requests: int = field(default=0, init=False)
    _long: int = field(default=0, init=False)
    _late: int = field(default=0, init=False)
    _by_degree: dict[int, float] = field(default_factory=dict, init=False)
    _by_preferred: dict[int, float] = field(default_factory=dict, init=False)
    _last_now: float = field(default=-math.inf, init=False)
    # Derived from (start_s, window_s, _index), refreshed whenever _index moves: the open
    # window's start, and the earliest `now` that closes it (record's fast path).
    _open_start: float = field(default=0.0, init=False, repr=False)
    _close_at: float = field(default=-math.inf, init=False, repr=False)

    def __post_init__(self) -> None:
        self.window_s = _check_time("window_s", self.window_s)
        if self.window_s <= 0:
            raise InvalidInput(f"window_s must be > 0, got {self.window_s}")
        if (
            isinstance(self.long_threshold_tokens, bool)
            or not isinstance(self.long_threshold_tokens, int)
            or self.long_threshold_tokens < 1
        ):
            raise InvalidInput(
                f"long_threshold_tokens must be an integer >= 1, got {self.long_threshold_tokens!r}"
            )
        self.start_s = _check_time("start_s", self.start_s)
        self._refresh_bounds()

    def _refresh_bounds(self) -> None:
        self._open_start = self.open_start_s
        self._close_at = _first_closing(self.start_s, self.window_s, self._index)

    # --- queries -----------------------------------------------------------------------
    @property
    def open_index(self) -> int:
        return self._index

    @property
    def open_start_s(self) -> float:
        return self.start_s + self._index * self.window_s

    @property
    def open_end_s(self) -> float:
        return self.start_s + (self._index + 1) * self.window_s

    @property
    def open_demand_s(self) -> float:
        """D of the window still open (partial)."""
        return self._demand

    @property
    def open_demand_by_preferred_s(self) -> dict[int, float]:
        """D of the window still open (partial) by the requests' preferred degree (those
        recorded with one); a copy."""
        return dict(self._by_preferred)

    # --- events ------------------------------------------------------------------------
    def record(
        self,
        now: float,
        predicted_s: float,
        input_len: int,
        degree: int | None = None,
        preferred: int | None = None,
    ) -> list[WindowSummary]:
        """Count one assignment (predicted service ``predicted_s`` s, ``input_len`` tokens,
        placed at ``degree``, preferring ``preferred``; both optional).

        Windows that ended at or before ``now`` are closed first and returned (usually
        none), so the assignment lands in the window that contains ``now``.
        """
        # Exact-type checks first (speed: once per placement); anything else goes through the
        # full validation, which converts or raises exactly as before.
        if not (
            now.__class__ is float and -math.inf < now < math.inf
            and predicted_s.__class__ is float and 0.0 <= predicted_s < math.inf
            and input_len.__class__ is int and input_len >= 1
            and (degree is None or (degree.__class__ is int and degree >= 1))
            and (preferred is None or (preferred.__class__ is int and preferred >= 1))
        ):
            now = _check_time("now", now)
            predicted_s = _check_time("predicted_s", predicted_s)
            if predicted_s < 0:
                raise InvalidInput(f"predicted_s must be >= 0, got {predicted_s}")
            if isinstance(input_len, bool) or not isinstance(input_len, int) or input_len < 1:
                raise InvalidInput(f"input_len must be an integer >= 1 token, got {input_len!r}")
            for name, v in (("degree", degree), ("preferred", preferred)):
                if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                    raise InvalidInput(f"{name} must be an integer >= 1 or None, got {v!r}")
        if now < self._close_at:
            # No window ends by `now` (the threshold is exact): what _close_until would do.
            closed: list[WindowSummary] = []
            if now > self._last_now:
                self._last_now = now
        else:
            closed = self._close_until(now) if now >= self._last_now else []
        if now < self._open_start:
            self._late += 1
        self._demand += predicted_s
        self._requests += 1
        if input_len >= self.long_threshold_tokens:
            self._long += 1
        if degree is not None:
            self._by_degree[degree] = self._by_degree.get(degree, 0.0) + predicted_s
        if preferred is not None:
            self._by_preferred[preferred] = self._by_preferred.get(preferred, 0.0) + predicted_s
        return closed

    def advance(self, now: float) -> list[WindowSummary]:
        """Close every window whose end is ≤ ``now``; returns them oldest first."""
        now = _check_time("now", now)
        if now < self._last_now:
            raise InvalidInput(f"time went backwards: now={now} < previous {self._last_now}")
        return self._close_until(now)

    def _close_until(self, now: float) -> list[WindowSummary]:
        n = math.floor((now - self.start_s) / self.window_s) - self._index
        if n > MAX_WINDOWS_PER_ADVANCE:
            raise InvalidInput(
                f"now={now} would close {n} windows of {self.window_s} s at once; "
                "is the time in seconds?"
            )
        self._last_now = max(self._last_now, now)
        out: list[WindowSummary] = []
        for _ in range(max(0, n)):
            out.append(
                WindowSummary(
                    index=self._index,
                    start_s=self.open_start_s,
                    end_s=self.open_end_s,
                    demand_s=self._demand,
                    requests=self._requests,
                    long_requests=self._long,
                    late=self._late,
                    demand_by_degree=tuple(sorted(self._by_degree.items())),
                    demand_by_preferred=tuple(sorted(self._by_preferred.items())),
                )
            )
            self._index += 1
            self._demand, self._requests, self._long, self._late = 0.0, 0, 0, 0
            self._by_degree = {}
            self._by_preferred = {}
        if out:
            self._refresh_bounds()
        return out
