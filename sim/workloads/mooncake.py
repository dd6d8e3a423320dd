"""Reader of Mooncake-format JSONL traces (kvcache-ai/Mooncake ``FAST25-release/traces``).

One request per line: ``{"timestamp": ms since trace start, "input_length": tokens,
"output_length": tokens, "hash_ids": [one id per 512-token block, prefix-chained]}``, and
an optional ``session_id`` (a string or an integer); extra keys are ignored.
``len(hash_ids) == ceil(input_length / block_size)``; the trailing partial block's id is
dropped (only full blocks are cached, design.md). Ids are unsigned 64-bit ints,
and prefix-chained across the file: an id always follows the same predecessor (or is always
a first block), and a request never repeats one (:class:`~sim.workloads.parsing.PrefixChains`).

The conversation trace's timestamps are quantised to ~3 s ticks (~10 requests per tick).
Replaying them as bursts would overstate queueing, so requests of one tick are spread
uniformly over the tick with a seeded generator, keeping their file order.
"""

from __future__ import annotations

from numbers import Real
from pathlib import Path
from typing import Any, Final

import numpy as np

from shared.ids import DEFAULT_BLOCK_SIZE, InvalidInput
from sim.workloads.errors import TraceFormatError
from sim.workloads.parsing import (
    MAX_SPAN_S,
    MAX_TOKENS,
    PrefixChains,
    check_arrivals_vary,
    hash_ids_field,
    int_field,
    iter_jsonl,
    shown_value,
)
from sim.workloads.workload import Request, Workload, truncate

_MAX_TIMESTAMP_MS = int(MAX_SPAN_S * 1000)
_MS_PER_DAY = 86_400_000


def _days(ms: int) -> str:
    """``ms`` milliseconds in days, for a message (an int of any size: no float overflow)."""
    days = ms // _MS_PER_DAY
    return f"{ms / _MS_PER_DAY:,.1f}" if days < 10**15 else f"about 10^{len(str(days)) - 1}"


def _timestamp(row: dict[str, Any], path: Path, line_no: int) -> int:
    """A row's ``timestamp``: ms since the trace's start, at most MAX_SPAN_S (366 days) of
    them; else :class:`TraceFormatError` naming the line.

    The bound is said in days, with the value seen and what it is in days: a bound of
    31,622,400,000 ms means nothing to a reader, "19,675.9 days" says that the file holds
    Unix times. So it is checked here, before :func:`int_field` (whose message would name
    the bound as an integer; its ``maximum`` is the same bound, never reached).
    """
    v = row.get("timestamp")
    if type(v) is int and v > _MAX_TIMESTAMP_MS:  # (bool is no int here: int_field says so)
        shown = f"{v} ms" if v.bit_length() <= 128 else f"of {v.bit_length()} bits"
        raise TraceFormatError(
            path, line_no, f"timestamp {shown} is {_days(v)} days after the trace's start, "
            f"more than the {MAX_SPAN_S / 86400:.0f} days a trace may span: Mooncake "
            "timestamps count milliseconds from the trace's start (not Unix time)")
    return int_field(row, "timestamp", path, line_no, 0, maximum=_MAX_TIMESTAMP_MS)


TICK_SAMPLE: Final[int] = 1024
"""Records whose timestamps a read cut short by ``max_requests`` still scans to detect the
tick (:func:`read_mooncake`): some 300 ticks of the conversation trace."""


def detect_tick_ms(timestamps: np.ndarray) -> float:
    """Quantisation tick (ms) of arrival timestamps, or 0 when they are not quantised.

    Quantised means many requests share a timestamp (fewer than half as many distinct values
    as requests). The tick is then the median of the gaps between consecutive distinct values
    that lie within [g, 1.5·g), g being the smallest gap of at least an eighth of the median
    gap. The median absorbs the ±1 ms jitter of the Mooncake trace (gaps of 2,999 and
    3,001 ms); g keeps a sparse trace's tick, whose occupied ticks are mostly two or more
    ticks apart and whose median gap is then a multiple of it (stamps 0, 2, 3, 5, 7 s: 1 s,
    not 2 s); the eighth ignores the millisecond gaps of a jittered stamp within one tick.
    """
    distinct = np.unique(timestamps)
    if len(distinct) < 2 or len(distinct) * 2 > len(timestamps):
        return 0.0
    gaps = np.diff(distinct)
    g = gaps[gaps >= np.median(gaps) / 8].min()
    return float(np.median(gaps[(gaps >= g) & (gaps < 1.5 * g)]))


def spread_within_ticks(
    timestamps_ms: np.ndarray, tick_ms: float, rng: np.random.Generator
) -> np.ndarray:
    """Arrival times (s): each group of equal timestamps spread uniformly over [t, t + tick).

    Within a group the offsets are sorted and handed out in file order, so the order of
    requests is preserved (a later request of a tick may extend an earlier one's prefix).
    Across groups, too: where two stamps are closer than a tick (the conversation trace's
    ticks jitter by a millisecond: gaps of 2,999 ms), a later stamp's request drawn before
    an earlier stamp's request is moved up to that request's time (a tie, which keeps file
    order); every arrival stays within its own [t, t + tick).
    """
    ts = timestamps_ms.astype(np.float64)
    if tick_ms <= 0:
        return ts / 1000.0
    out = ts.copy()
    order = np.argsort(ts, kind="stable")
    sorted_ts = ts[order]
    bounds = np.flatnonzero(np.diff(sorted_ts)) + 1
    for group in np.split(order, bounds):
        offsets = np.sort(rng.uniform(0.0, tick_ms, size=len(group)))
        out[group] = ts[group] + offsets
    # Time order across overlapping ticks: a later stamp's request is raised to the latest
    # arrival before it (still >= its own stamp, and < its stamp + tick, as that arrival is).
    out[order] = np.maximum.accumulate(out[order])
    return out / 1000.0


def read_mooncake(
    path: str | Path,
    *,
    name: str | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    seed: int = 0,
    tick_s: float | None = None,
    max_requests: int | None = None,
    start_s: float | None = None,
    end_s: float | None = None,
) -> Workload:
    """Read a Mooncake JSONL trace into a :class:`Workload`.

    ``tick_s``: None detects the timestamp quantisation (3 s for the conversation trace) and
    spreads each tick's requests uniformly within it (seeded by ``seed``); 0 keeps the raw
    timestamps; a tick longer than :data:`~sim.workloads.parsing.MAX_SPAN_S` (or not a
    number) is :class:`InvalidInput`. ``max_requests`` / ``start_s`` / ``end_s`` truncate
    (see :func:`truncate`; ``max_requests`` alone stops reading early, past the requests it
    keeps only reading the timestamps of up to :data:`TICK_SAMPLE` records to detect the
    tick). Request ids are
    ``{name}-{index}`` with the 0-based record index.

    Raises :class:`~sim.workloads.errors.TraceFormatError` naming file:line for a bad line
    (bad JSON or UTF-8, a missing or ill-typed field, a count above
    :data:`~sim.workloads.parsing.MAX_TOKENS`, a timestamp before the previous row's or past
    :data:`~sim.workloads.parsing.MAX_SPAN_S`, a hash id outside [0, 2**64 - 1], repeated
    within its request or after another predecessor than on an earlier line, which the
    message names) and naming the file when two or more
    records all share one timestamp (:func:`~sim.workloads.parsing.check_arrivals_vary`; an
    L-Eval file read as Mooncake) unless ``tick_s`` > 0 asks for that tick to be spread.
    """
    path = Path(path)
    if block_size < 1:
        raise InvalidInput(f"block_size must be >= 1, got {block_size}")
    if tick_s is not None and (isinstance(tick_s, bool) or not isinstance(tick_s, Real)
                               or not 0 <= tick_s <= MAX_SPAN_S):
        # (a comparison, not math.isfinite, which overflows on a huge int; NaN fails it too)
        raise InvalidInput(f"tick_s must be a number of seconds in [0, {MAX_SPAN_S:g}] (at "
                           f"most the span a trace may have), got {tick_s!r}")
    name = name or path.stem
    stamps: list[int] = []
    rows: list[tuple[int, int, tuple[int, ...], str | None]] = []
    read_all = start_s is None and end_s is None
    seen = 0  # records read, including those only scanned past max_requests
    varied = False  # some timestamp differs from the first one
    chains = PrefixChains(path)
    scanned: list[int] = []  # timestamps read past max_requests, for the tick's detection
    closed = False  # a timestamp read past max_requests differs from the last one kept
    for line_no, row in iter_jsonl(path):
        if read_all and max_requests is not None and len(rows) >= max_requests:
            if not stamps or (closed and (tick_s is not None or seen >= TICK_SAMPLE)):
                break
            # Stopping early must neither hide a file whose timestamps are all equal nor
            # reject one whose first requests merely share a tick: read on (timestamps only)
            # until one differs from the last kept, which for a timed trace is at most one
            # tick further; the last kept tick's other requests are then known, and its
            # requests are spread as a full read spreads them. With the tick to detect, read
            # on to TICK_SAMPLE records: the requests kept may all lie in one tick, where
            # alone they show no quantisation (and would all arrive at its start).
            seen += 1
            ts = _timestamp(row, path, line_no)
            scanned.append(ts)
            varied = varied or ts != stamps[0]
            closed = closed or ts != stamps[-1]
            continue
        ts = _timestamp(row, path, line_no)
        if stamps and ts < stamps[-1]:
            raise TraceFormatError(path, line_no, f"timestamp {ts} goes backwards (after "
                                   f"{stamps[-1]}; rows must be in time order)")
        inp = int_field(row, "input_length", path, line_no, 1, MAX_TOKENS)
        out = int_field(row, "output_length", path, line_no, 0, MAX_TOKENS)
        hids = hash_ids_field(row, inp, block_size, path, line_no, chains)
        session = row.get("session_id")
        if session is not None and (
                isinstance(session, bool) or not isinstance(session, (str, int))
                or (isinstance(session, int) and session.bit_length() > 128)):
            # A table or list would become its repr, a bool "True": ids no one wrote (and
            # str() of an integer of over 4,300 digits raises).
            raise TraceFormatError(path, line_no, f"field 'session_id' must be a string or an "
                                   f"integer of at most 128 bits, got {shown_value(session)}")
        seen += 1
        varied = varied or (bool(stamps) and ts != stamps[0])
        stamps.append(ts)
        rows.append((inp, out, hids, None if session is None else str(session)))
    if stamps and not tick_s:
        check_arrivals_vary(path, "mooncake", requests=seen, varied=varied,
                            shown=f"timestamp {stamps[0]} ms")
    ts_arr = np.array(stamps, dtype=np.int64)
    tick_ms = (detect_tick_ms(np.array(stamps + scanned, dtype=np.int64)) if tick_s is None
               else tick_s * 1000.0)
    # The rest of the last kept tick (read past max_requests) is spread with it, so that a
    # read cut short gives the arrivals a full read would; spreading draws tick by tick in
    # time order, so the ticks after it do not matter.
    tail = 0
    while tail < len(scanned) and scanned[tail] == stamps[-1]:
        tail += 1
    if tail:
        ts_arr = np.concatenate([ts_arr, np.array(scanned[:tail], dtype=np.int64)])
    arrivals = spread_within_ticks(ts_arr, tick_ms, np.random.default_rng(seed))[:len(rows)]
    reqs = [
        Request(f"{name}-{i}", float(arrivals[i]), inp, out, hids, session)
        for i, (inp, out, hids, session) in enumerate(rows)
    ]
    wl = Workload.from_requests(
        name,
        reqs,
        block_size=block_size,
        metadata={
            "source": str(path),
            "format": "mooncake",
            "tick_s": tick_ms / 1000.0,
            "seed": seed,
        },
    )
    if max_requests is not None or start_s is not None or end_s is not None:
        wl = truncate(wl, max_requests=max_requests, start_s=start_s, end_s=end_s)
    return wl
