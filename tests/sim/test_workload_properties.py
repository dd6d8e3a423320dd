"""Contracts of the workload layer, checked with hypothesis.

The synthetic generator (determinism, arrivals, rate and long share, exact prefix sharing,
chained ids), rate scaling, tick spreading, and the trace readers (round trips of files the
tests write, and fuzzed lines: every malformed line is a :class:`TraceFormatError` naming its
line, never another exception). The example-based tests of the same code are in
``test_workload_readers.py``, ``test_synthetic_workload.py`` and ``test_trace_input_errors.py``.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import Phase as HPhase
from hypothesis import strategies as st

from shared.ids import InvalidInput
from sim.workloads import (
    Request,
    SyntheticConfig,
    TraceFormatError,
    Workload,
    generate,
    read_azure,
    read_leval,
    read_mooncake,
    scale_rate,
)
from sim.workloads.mooncake import spread_within_ticks
from sim.workloads.parsing import MAX_SPAN_S, MAX_TOKENS
from sim.workloads.synthetic import LogNormalLength, Phase

FAST = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@contextmanager
def _tmpdir() -> Iterator[Path]:
    # tmp_path is per test, not per example: each example gets its own directory.
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


def _lcp(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _assert_chained(requests: list[Request] | Workload) -> None:
    """Equal id at block k ⇒ equal ids at every block before k: each id has one position and
    one parent across the whole workload."""
    where: dict[int, tuple[int, int | None]] = {}
    for r in requests:
        parent = None
        for j, h in enumerate(r.block_hashes):
            assert where.setdefault(h, (j, parent)) == (j, parent), (r.request_id, j)
            parent = h


def _fixed(n: int) -> LogNormalLength:
    return LogNormalLength(n, 0.0, n, n)


# --- synthetic generator ---------------------------------------------------------------------
phases = st.lists(
    st.builds(
        Phase,
        st.floats(5.0, 60.0),
        st.sampled_from([0.0, 0.5, 1.0, 2.0]),
        st.one_of(st.none(), st.floats(0.0, 1.0)),
    ),
    max_size=3,
)


@st.composite
def small_configs(draw: st.DrawFn) -> SyntheticConfig:
    """Small workloads (tens to hundreds of requests, prompts of a few blocks)."""
    bsz = draw(st.sampled_from([8, 16, 64]))
    return SyntheticConfig(
        duration_s=draw(st.floats(10.0, 60.0)),
        rate=draw(st.floats(0.5, 4.0)),
        long_share=draw(st.floats(0.0, 1.0)),
        phases=tuple(draw(phases)),
        short_len=LogNormalLength(3 * bsz, 0.8, 1, 12 * bsz),
        long_len=LogNormalLength(20 * bsz, 0.3, 10 * bsz, 40 * bsz),
        output_len=LogNormalLength(bsz, 0.8, 0, 4 * bsz),
        n_system_prompts=draw(st.integers(0, 4)),
        system_prompt_len=LogNormalLength(2 * bsz, 0.6, 1, 6 * bsz),
        system_prompt_share=draw(st.floats(0.0, 1.0)),
        session_share=draw(st.floats(0.0, 1.0)),
        mean_turns=draw(st.floats(2.0, 5.0)),
        turn_len=LogNormalLength(bsz, 0.8, 1, 4 * bsz),
        think_time_s=draw(st.floats(0.5, 10.0)),
        long_doc_pool=draw(st.integers(0, 5)),
        question_len=LogNormalLength(bsz, 0.5, 1, 3 * bsz),
        max_input_len=draw(st.sampled_from([6 * bsz + 3, 64 * bsz])),
        block_size=bsz,
    )


seeds = st.integers(0, 2**32 - 1)


@FAST
@given(small_configs(), seeds)
def test_synthetic_is_a_function_of_config_and_seed(cfg: SyntheticConfig, seed: int) -> None:
    a, b = generate(cfg, seed=seed), generate(cfg, seed=seed)
    assert a.requests == b.requests
    assert dict(a.metadata) == dict(b.metadata)
    other = generate(cfg, seed=seed + 1)
    # Two seeds draw different workloads (continuous arrival times never coincide).
    assume(len(a) + len(other) > 0)
    assert [r.arrival_s for r in a] != [r.arrival_s for r in other]


@FAST
@given(small_configs(), seeds)
def test_synthetic_requests_are_well_formed(cfg: SyntheticConfig, seed: int) -> None:
    wl = generate(cfg, seed=seed)
    arrivals = [r.arrival_s for r in wl]
    assert arrivals == sorted(arrivals)
    assert all(0.0 < t < cfg.duration_s for t in arrivals)
    assert len({r.request_id for r in wl}) == len(wl)
    for r in wl:
        # The project's convention: one id per *full* block (floor), not ceil.
        assert len(r.block_hashes) == r.input_len // cfg.block_size
        assert 1 <= r.input_len <= cfg.max_input_len
        assert cfg.output_len.lo <= r.output_len <= cfg.output_len.hi
    _assert_chained(wl)
    # A phase at multiplier 0 has no conversation starts (follow-ups may spill into it).
    for start, end, phase in cfg.segments():
        if phase.rate_multiplier == 0:
            assert not any(start <= r.arrival_s < end and r.session_id is None for r in wl)


@st.composite
def prefix_configs(draw: st.DrawFn) -> SyntheticConfig:
    """Fixed system prompt and document lengths, so the shared prefix is known exactly; long
    requests are longer than any non-session short one, which tells them apart."""
    bsz = draw(st.sampled_from([8, 16, 32]))
    sp = draw(st.integers(bsz, 5 * bsz))
    doc = draw(st.integers(12 * bsz, 20 * bsz))
    return SyntheticConfig(
        duration_s=draw(st.floats(10.0, 60.0)),
        rate=draw(st.floats(0.5, 3.0)),
        long_share=draw(st.floats(0.0, 0.6)),
        phases=(),
        short_len=LogNormalLength(2 * bsz, 0.8, 1, 6 * bsz),
        long_len=_fixed(doc),
        output_len=LogNormalLength(bsz, 0.8, 0, 3 * bsz),
        n_system_prompts=draw(st.integers(1, 3)),
        system_prompt_len=_fixed(sp),
        system_prompt_share=draw(st.floats(0.3, 1.0)),
        session_share=draw(st.floats(0.0, 0.8)),
        mean_turns=3.0,
        turn_len=LogNormalLength(bsz, 0.8, 1, 3 * bsz),
        think_time_s=2.0,
        long_doc_pool=draw(st.integers(0, 3)),
        question_len=LogNormalLength(bsz, 0.5, 1, 2 * bsz),
        max_input_len=1 << 20,
        block_size=bsz,
    )


def _assert_group_shares_exactly(reqs: list[tuple[str, Request]], depth: int) -> None:
    """Requests of several conversations with one first block share exactly ``depth`` blocks:
    one id at each block before ``depth``, a conversation's own id at block ``depth``."""
    if len({conv for conv, _ in reqs}) < 2:
        return
    for j in range(depth):
        assert len({r.block_hashes[j] for _, r in reqs}) == 1, j
    owner: dict[int, str] = {}
    for conv, r in reqs:
        if len(r.block_hashes) > depth:
            assert owner.setdefault(r.block_hashes[depth], conv) == conv


@settings(max_examples=30, deadline=None)
@given(prefix_configs(), seeds)
def test_synthetic_shares_exactly_the_shared_tokens_blocks(cfg: SyntheticConfig,
                                                           seed: int) -> None:
    wl = generate(cfg, seed=seed)
    bsz = cfg.block_size
    sp_blocks = cfg.system_prompt_len.lo // bsz
    doc_blocks = cfg.long_len.lo // bsz
    short_max = cfg.system_prompt_len.hi + cfg.short_len.hi
    _assert_chained(wl)
    shorts: dict[int, list[tuple[str, Request]]] = {}
    longs: dict[int, list[tuple[str, Request]]] = {}
    for r in wl:
        if not r.block_hashes:  # shorter than a block: nothing to share
            continue
        conv = r.session_id or r.request_id  # a request without a session is its own
        is_long = r.session_id is None and r.input_len > short_max
        (longs if is_long else shorts).setdefault(r.block_hashes[0], []).append((conv, r))
    assert not set(shorts) & set(longs)  # a document never shares a block with a chat
    for group in shorts.values():
        _assert_group_shares_exactly(group, sp_blocks)
    for group in longs.values():
        if cfg.long_doc_pool == 0:  # every long request has its own document
            assert len(group) == 1
        _assert_group_shares_exactly(group, doc_blocks)
    # A session's turn extends the previous turn's prompt: all its blocks, then its own.
    turns: dict[str, list[Request]] = {}
    for r in wl:
        if r.session_id is not None:
            turns.setdefault(r.session_id, []).append(r)
    for ts in turns.values():
        for a, b in zip(ts, ts[1:], strict=False):
            assert b.input_len > a.input_len
            assert _lcp(a.block_hashes, b.block_hashes) == len(a.block_hashes)


def _turns_moments(cfg: SyntheticConfig, long_share: float) -> tuple[float, float]:
    """E[N], E[N²] of the requests of one conversation start (N = 1 + Geometric for a
    session), before follow-ups past the end are dropped."""
    p = 1.0 / (cfg.mean_turns - 1)
    en_s = 1.0 + 1.0 / p
    en2_s = 1.0 + 2.0 / p + (2.0 - p) / p**2
    multi = (1 - long_share) * cfg.session_share
    return (1 - multi) + multi * en_s, (1 - multi) + multi * en2_s


# No shrinking: a statistical failure is its drawn case (shrinking one takes minutes).
@settings(max_examples=4, deadline=None,
          phases=[HPhase.explicit, HPhase.reuse, HPhase.generate])
@given(
    st.floats(4.0, 8.0),
    st.floats(0.0, 0.6),
    st.floats(0.3, 0.8),  # sessions: a wrong turns-per-start would show
    st.lists(st.tuples(st.floats(50.0, 200.0), st.sampled_from([0.5, 1.0, 2.0]),
                       st.one_of(st.none(), st.floats(0.0, 0.6))), max_size=3),
    seeds,
)
def test_synthetic_meets_rate_and_long_share(rate: float, long_share: float,
                                             session_share: float,
                                             phase_spec: list[tuple[float, float, float | None]],
                                             seed: int) -> None:
    bsz = 64
    cfg = SyntheticConfig(
        duration_s=1200.0, rate=rate, long_share=long_share,
        phases=tuple(Phase(*p) for p in phase_spec),
        short_len=LogNormalLength(2 * bsz, 0.8, 1, 8 * bsz), long_len=_fixed(30 * bsz),
        system_prompt_len=LogNormalLength(2 * bsz, 0.5, bsz, 4 * bsz),
        output_len=LogNormalLength(bsz, 0.8, 1, 2 * bsz),
        turn_len=LogNormalLength(bsz, 0.8, 1, 2 * bsz), question_len=_fixed(bsz),
        session_share=session_share, mean_turns=3.0, think_time_s=1.0, block_size=bsz,
    )
    wl = generate(cfg, seed=seed)
    # Per segment: conversation starts (a Poisson count), their requests, the long ones.
    expected = var = starts = longs = 0.0
    for a, b, phase in cfg.segments():
        share = cfg.long_share_of(phase)
        en, en2 = _turns_moments(cfg, share)
        k = cfg.rate * phase.rate_multiplier / en * (b - a)
        starts, longs = starts + k, longs + k * share
        expected, var = expected + k * en, var + k * en2
    # Requests: the phases' rate × duration, within 5 σ of the compound Poisson count (less
    # a margin for follow-ups dropped past the end: those of the last ~10 think times).
    tail = 10 * cfg.think_time_s * cfg.rate * 2.0
    sd = math.sqrt(var)
    assert expected - 5 * sd - tail <= len(wl) <= expected + 5 * sd + 1
    # Long share of conversation starts (a long request, a single turn, a session's first).
    long_n = sum(r.session_id is None and r.input_len > 12 * bsz for r in wl)
    n_starts = sum(r.session_id is None for r in wl) + len({r.session_id for r in wl} - {None})
    share = longs / starts
    assert abs(long_n - share * n_starts) <= 5 * math.sqrt(n_starts * share * (1 - share)) + 1


# --- rate scaling ----------------------------------------------------------------------------
@FAST
@given(
    st.lists(st.floats(0, 1e5, allow_nan=False), min_size=1, max_size=30),
    st.floats(1e-3, 1e3),
    st.floats(1e-2, 1e2),
)
def test_scale_rate_divides_every_gap(arrivals: list[float], s: float, s2: float) -> None:
    reqs = [Request(f"r{i}", t, 1 + i, i, (), None if i % 2 else f"s{i}")
            for i, t in enumerate(sorted(arrivals))]
    wl = Workload("w", tuple(reqs), metadata={"format": "x"})
    out = scale_rate(wl, s)
    assert out[0].arrival_s == wl[0].arrival_s
    for (a, b), (x, y) in zip(zip(wl, wl.requests[1:], strict=False),
                              zip(out, out.requests[1:], strict=False), strict=True):
        assert y.arrival_s >= x.arrival_s
        tol = 1e-15 * (x.arrival_s + y.arrival_s)  # the rounding of t0 + (t - t0) / s
        assert y.arrival_s - x.arrival_s == pytest.approx((b.arrival_s - a.arrival_s) / s,
                                                          rel=1e-9, abs=tol)
    # Only arrivals change: ids, lengths, blocks, sessions and metadata stay.
    assert [replace(r, arrival_s=0.0) for r in out] == [replace(r, arrival_s=0.0) for r in wl]
    assert out.metadata["format"] == "x" and out.metadata["rate_scale"] == s
    # Scaling composes: s then s2 is s·s2 (same gaps, the factor recorded once).
    both = scale_rate(out, s2)
    assert both.metadata["rate_scale"] == pytest.approx(s * s2)
    assert [r.arrival_s for r in both] == pytest.approx(
        [r.arrival_s for r in scale_rate(wl, s * s2)], rel=1e-9, abs=1e-9)


# --- tick spreading --------------------------------------------------------------------------
@st.composite
def ticked_stamps(draw: st.DrawFn) -> tuple[np.ndarray, float]:
    """Non-decreasing ms timestamps quantised to a tick, each tick's stamp jittered by a few
    ms as in the Mooncake conversation trace (gaps of tick ± 1..3 ms)."""
    tick = draw(st.integers(1, 20) | st.integers(1, 10_000))  # short ticks overlap more
    counts = draw(st.lists(st.integers(1, 12), min_size=1, max_size=15))
    jitter = draw(st.lists(st.integers(-3, 3), min_size=len(counts), max_size=len(counts)))
    start = draw(st.integers(0, 10**9))
    stamps: list[int] = []
    for k, (n, j) in enumerate(zip(counts, jitter, strict=True)):
        stamps += [start + k * tick + (max(j, -tick + 1) if k else 0)] * n
    return np.array(sorted(stamps), dtype=np.int64), float(tick)


@FAST
@given(ticked_stamps(), seeds)
def test_tick_spreading_stays_in_its_tick_keeps_order_and_is_seeded(
        data: tuple[np.ndarray, float], seed: int) -> None:
    stamps, tick = data
    out = spread_within_ticks(stamps, tick, np.random.default_rng(seed))
    assert len(out) == len(stamps)
    for t, a in zip(stamps.tolist(), out.tolist(), strict=True):
        assert t / 1000 <= a < (t + tick) / 1000
    assert np.all(np.diff(out) >= 0)  # file (= time) order kept, across ticks too
    again = spread_within_ticks(stamps, tick, np.random.default_rng(seed))
    assert np.array_equal(out, again)
    assert not np.array_equal(out, spread_within_ticks(stamps, tick,
                                                       np.random.default_rng(seed + 1)))
    assert np.array_equal(spread_within_ticks(stamps, 0.0, np.random.default_rng(seed)),
                          stamps / 1000.0)


def test_tick_spreading_keeps_order_where_ticks_overlap() -> None:
    """Regression: a tick stamped 1 ms early (the conversation trace has 263 such gaps of
    2,999 ms) overlaps the previous tick's last millisecond; a request of the earlier tick
    drawn there must not overtake one of the later tick."""
    stamps = np.array([0, 0, 2999, 2999], dtype=np.int64)

    class Draws:  # the earlier tick's requests drawn late, the later tick's early
        def uniform(self, lo: float, hi: float, size: int) -> np.ndarray:
            self.calls = getattr(self, "calls", 0) + 1
            return np.array([2999.5, 2999.9] if self.calls == 1 else [0.1, 0.2])[:size]

    out = spread_within_ticks(stamps, 3000.0, Draws())  # type: ignore[arg-type]
    assert np.all(np.diff(out) >= 0)
    # The earlier tick's draws stand; the later tick's requests wait for them (ties).
    assert out.tolist() == pytest.approx([2.9995, 2.9999, 2.9999, 2.9999])
    assert all(t / 1000 <= a < (t + 3000) / 1000
               for t, a in zip(stamps.tolist(), out.tolist(), strict=True))


@FAST
@given(ticked_stamps(), seeds, st.booleans())
def test_mooncake_spread_ticks_keep_file_order(data: tuple[np.ndarray, float], seed: int,
                                              detect: bool) -> None:
    stamps, tick = data
    assume(len(np.unique(stamps)) > 1)
    rows = [{"timestamp": int(t), "input_length": 5, "output_length": 1, "hash_ids": [i]}
            for i, t in enumerate(stamps)]
    with _tmpdir() as d:
        wl = read_mooncake(_write_jsonl(d / "t.jsonl", rows), seed=seed,
                           tick_s=None if detect else tick / 1000)
    used = wl.metadata["tick_s"] * 1000
    assert [r.request_id for r in wl] == [f"t-{i}" for i in range(len(rows))]
    for t, r in zip(stamps.tolist(), wl, strict=True):
        assert t / 1000 <= r.arrival_s and (used == 0 or r.arrival_s < (t + used) / 1000)


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.none(), st.floats(), st.integers(-10, 10**400)))
def test_mooncake_any_tick_is_used_or_refused_as_invalid_input(tick: float | None) -> None:
    rows = [{"timestamp": t, "input_length": 5, "output_length": 1, "hash_ids": [t]}
            for t in (0, 0, 0, 3000, 3000, 6000)]
    with _tmpdir() as d:
        path = _write_jsonl(d / "t.jsonl", rows)
        try:
            wl = read_mooncake(path, tick_s=tick)  # type: ignore[arg-type]
        except InvalidInput as exc:
            assert "tick_s" in str(exc)
            return
    assert len(wl) == len(rows)
    assert all(math.isfinite(r.arrival_s) for r in wl)


def test_mooncake_a_tick_longer_than_a_trace_may_span_is_refused(tmp_path: Path) -> None:
    """Regression: a tick of 1e306 s overflowed to an infinite ms tick, and numpy's
    OverflowError escaped; one of 1e300 s put arrivals 1e300 s out."""
    path = _write_jsonl(tmp_path / "t.jsonl", [
        {"timestamp": t, "input_length": 5, "output_length": 1, "hash_ids": [1]}
        for t in (0, 3000)])
    for tick in (1e306, 1e300, MAX_SPAN_S * 1.01):
        with pytest.raises(InvalidInput, match="tick_s"):
            read_mooncake(path, tick_s=tick)
    assert read_mooncake(path, tick_s=MAX_SPAN_S).metadata["tick_s"] == MAX_SPAN_S


# --- readers: round trips --------------------------------------------------------------------
def _mooncake_rows(wl: Workload) -> list[dict[str, Any]]:
    """A workload as Mooncake rows: ms timestamps, ceil(L/B) hash ids (a request-own id for
    the trailing partial block: above the 63 bits of the chained ids, as ids must be
    unsigned 64-bit ints)."""
    rows = []
    for i, r in enumerate(wl):
        ids = list(r.block_hashes)
        if r.input_len % wl.block_size:
            ids.append((1 << 63) + i)
        row = {"timestamp": round(r.arrival_s * 1000), "input_length": r.input_len,
               "output_length": r.output_len, "hash_ids": ids}
        if r.session_id is not None:
            row["session_id"] = r.session_id
        rows.append(row)
    return rows


def _write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@FAST
@given(small_configs(), seeds)
def test_mooncake_round_trip_of_a_generated_workload(cfg: SyntheticConfig, seed: int) -> None:
    wl = generate(cfg, seed=seed)
    rows = _mooncake_rows(wl)
    assume(len({r["timestamp"] for r in rows}) > 1)
    with _tmpdir() as d:
        back = read_mooncake(_write_jsonl(d / "gen.jsonl", rows), tick_s=0,
                             block_size=cfg.block_size)
    assert len(back) == len(wl)
    for i, (a, b) in enumerate(zip(wl, back, strict=True)):
        assert b.request_id == f"gen-{i}"
        assert b.arrival_s == pytest.approx(a.arrival_s, abs=5e-4 + 1e-9)
        assert (b.input_len, b.output_len, b.block_hashes, b.session_id) == \
            (a.input_len, a.output_len, a.block_hashes, a.session_id)
    assert back.block_size == cfg.block_size


@FAST
@given(small_configs(), seeds, st.data())
def test_mooncake_a_broken_chain_names_the_id_and_the_line_that_fixed_it(
        cfg: SyntheticConfig, seed: int, data: st.DataObject) -> None:
    """A generated workload's ids are chained, so its rows read; one more row that puts an
    id after a predecessor it never had (a fresh one, or none: a first block), or repeats an
    id within itself, is refused naming that row's line, the id and, for a conflict, the
    line where the id first appeared (which fixed its predecessor)."""
    wl = generate(cfg, seed=seed)
    rows = _mooncake_rows(wl)
    assume(len({r["timestamp"] for r in rows}) > 1)
    first_line: dict[int, int] = {}
    parent: dict[int, int | None] = {}
    for n, row in enumerate(rows, start=1):
        prev = None
        for h in row["hash_ids"]:
            first_line.setdefault(h, n)
            parent.setdefault(h, prev)
            prev = h
    assume(first_line)
    h = data.draw(st.sampled_from(sorted(first_line)), label="id")
    fresh = (1 << 64) - 1  # above the chained (63-bit) and the partial-block ids
    repeat = data.draw(st.booleans(), label="repeat")
    ids = [h, fresh, h] if repeat else [h] if parent[h] is not None else [fresh, h]
    bad = {"timestamp": rows[-1]["timestamp"] + 1, "input_length": len(ids) * cfg.block_size,
           "output_length": 1, "hash_ids": ids}
    line = len(rows) + 1
    with _tmpdir() as d:
        path = _write_jsonl(d / "gen.jsonl", [*rows, bad])
        with pytest.raises(TraceFormatError) as ei:
            read_mooncake(path, tick_s=0, block_size=cfg.block_size)
    assert ei.value.line == line and str(ei.value).startswith(f"{path}:{line}: ")
    if repeat and parent[h] is None:  # [h, fresh, h]: h's second place is the conflict
        assert f"repeat id {h} (blocks 0 and 2)" in ei.value.problem
    elif repeat:  # h's first place already breaks its chain
        assert f"hash id {h} is a first block here" in ei.value.problem
    else:
        assert f"hash id {h} " in ei.value.problem
    if "repeat" not in ei.value.problem:
        assert f"on line {first_line[h]}:" in ei.value.problem


mooncake_rows = st.lists(
    st.fixed_dictionaries(
        {"gap": st.integers(0, 5000), "input_length": st.integers(1, 5000),
         "output_length": st.integers(0, MAX_TOKENS), "session": st.none() | st.integers(0, 3)},
    ),
    min_size=2, max_size=20,
)


@FAST
@given(mooncake_rows, st.sampled_from([1, 7, 512]), st.integers(0, 10**6))
def test_mooncake_rows_read_back_exactly(rows: list[dict[str, Any]], bsz: int,
                                         first: int) -> None:
    ts = first
    lines = []
    for i, r in enumerate(rows):
        ts += r["gap"] if i else 0
        n = -(-r["input_length"] // bsz)
        row = {"timestamp": ts, "input_length": r["input_length"],
               "output_length": r["output_length"],
               "hash_ids": [i * 10_000 + j for j in range(n)], "extra": [1, "x"]}
        if r["session"] is not None:
            row["session_id"] = r["session"]
        lines.append(row)
    assume(len({row["timestamp"] for row in lines}) > 1)
    with _tmpdir() as d:
        wl = read_mooncake(_write_jsonl(d / "m.jsonl", lines), tick_s=0, block_size=bsz)
        # The id count must be ceil(L/B): one more or one fewer names the line.
        k = len(lines) - 1
        for delta in (1, -1):
            bad = [*lines[:k], {**lines[k], "hash_ids": list(range(
                -(-lines[k]["input_length"] // bsz) + delta))}]
            with pytest.raises(TraceFormatError) as ei:
                read_mooncake(_write_jsonl(d / "bad.jsonl", bad), tick_s=0, block_size=bsz)
            assert ei.value.line == len(lines) and "hash_ids" in ei.value.problem
    assert [(r.arrival_s, r.input_len, r.output_len, r.block_hashes, r.session_id)
            for r in wl] == [
        (row["timestamp"] / 1000, row["input_length"], row["output_length"],
         tuple(row["hash_ids"][: row["input_length"] // bsz]),
         None if "session_id" not in row else str(row["session_id"])) for row in lines]


@FAST
@given(
    st.lists(st.tuples(st.integers(0, 10**7), st.integers(1, 100_000),
                       st.integers(0, 10_000)), min_size=2, max_size=20),
    st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2030, 1, 1)),
    st.sampled_from([1, 16, 512]),
)
def test_azure_rows_read_back(rows: list[tuple[int, int, int]], t0: datetime,
                              bsz: int) -> None:
    """Times with 7 fractional digits (100 ns units), as the Azure files write them."""
    stamps, at = [], 0
    for i, (gap, _, _) in enumerate(rows):
        at += gap if i else 0
        stamps.append(at)
    # Times are read to the microsecond (the 7th digit is below datetime's resolution): rows
    # that differ only there arrive together, and a file whose rows all do is refused
    # (check_arrivals_vary), so at least two must differ by a microsecond.
    assume(len({u // 10 for u in stamps}) > 1)

    def fmt(units: int) -> str:
        dt = t0 + timedelta(microseconds=units // 10)
        return dt.strftime("%Y-%m-%d %H:%M:%S") + f".{dt.microsecond:06d}{units % 10}"

    body = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"{fmt(u)},{inp},{out}\n" for u, (_, inp, out) in zip(stamps, rows, strict=True))
    with _tmpdir() as d:
        p = d / "az.csv"
        p.write_text(body)
        wl = read_azure(p, block_size=bsz)
    assert [r.request_id for r in wl] == [f"az-{i}" for i in range(len(rows))]
    assert [(r.input_len, r.output_len) for r in wl] == [(i, o) for _, i, o in rows]
    assert [r.arrival_s for r in wl] == pytest.approx([(u - stamps[0]) / 1e7 for u in stamps],
                                                      abs=2e-6)
    # No prefix information: floor(L/B) ids per request, none shared between requests.
    assert all(len(r.block_hashes) == r.input_len // bsz for r in wl)
    ids = [h for r in wl for h in r.block_hashes]
    assert len(ids) == len(set(ids))


@settings(max_examples=150, deadline=None)
@given(st.one_of(
    st.text(max_size=8),
    st.integers(-5, 2 * MAX_TOKENS).map(str),
    st.from_regex(r"[ +\-0-9_\u0660-\u0669\uff10-\uff19]{1,6}", fullmatch=True),
))
def test_azure_counts_are_plain_ascii_decimal_integers(cell: str) -> None:
    """A count cell reads exactly when it is ASCII digits (a minus sign aside, which the
    range check refuses) in range: ``int()`` would also take ``1_000``, ``+5``, ``" 12 "``
    and other scripts' digits. Otherwise the error names the line and the column."""
    assume(not any(c in cell for c in ',"\r\n\0'))  # what CSV itself would split or quote
    body = f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:17:03.1,5,1\n" \
        f"2023-11-16 18:17:04.1,{cell},1\n"
    plain = re.fullmatch(r"[0-9]+", cell) is not None
    with _tmpdir() as d:
        p = d / "az.csv"
        p.write_text(body, encoding="utf-8")
        if plain and 1 <= int(cell) <= MAX_TOKENS:
            assert read_azure(p)[1].input_len == int(cell)
            return
        with pytest.raises(TraceFormatError) as ei:
            read_azure(p)
    assert ei.value.line == 3 and "column ContextTokens" in ei.value.problem
    assert ("plain decimal" in ei.value.problem) == (not re.fullmatch(r"-?[0-9]+", cell))


@FAST
@given(
    st.lists(st.tuples(st.sampled_from("abc"), st.integers(1, 3000), st.integers(0, 500)),
             min_size=1, max_size=20),
    st.dictionaries(st.sampled_from("abc"), st.integers(0, 3000), min_size=3),
    st.sampled_from([16, 100, 512]),
    seeds,
    st.sampled_from(["file", "shuffle"]),
)
def test_leval_documents_are_exactly_the_shared_prefix(
        rows: list[tuple[str, int, int]], doc_len: dict[str, int], bsz: int, seed: int,
        order: str) -> None:
    lines = [{"doc_sha1": sha, "instr_idx": k, "doc_llama3_tokens": doc_len[sha],
              "llama3_tokens": doc_len[sha] + instr, "ref_output_llama3_tokens": out}
             for k, (sha, instr, out) in enumerate(rows)]
    with _tmpdir() as d:
        wl = read_leval(_write_jsonl(d / "lv.jsonl", lines), rate=2.0, seed=seed,
                        order=order, block_size=bsz)  # type: ignore[arg-type]
    assert sorted(r.request_id for r in wl) == sorted(f"lv-{i}" for i in range(len(rows)))
    arrivals = [r.arrival_s for r in wl]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0
    by_line = {int(r.request_id.rsplit("-", 1)[1]): r for r in wl}
    _assert_chained(wl)
    for i, a in by_line.items():
        assert (a.input_len, a.output_len) == (lines[i]["llama3_tokens"],
                                               lines[i]["ref_output_llama3_tokens"])
        assert len(a.block_hashes) == a.input_len // bsz
        for j, b in by_line.items():
            if i != j:
                same = lines[i]["doc_sha1"] == lines[j]["doc_sha1"]
                want = doc_len[lines[i]["doc_sha1"]] // bsz if same else 0
                assert _lcp(a.block_hashes, b.block_hashes) == want


# --- readers: fuzzed lines -------------------------------------------------------------------
odd_numbers = st.one_of(
    st.integers(-(2**70), 2**70),
    st.sampled_from([0, -1, MAX_TOKENS, MAX_TOKENS + 1, 2**63, 2**64, 10**300]),
    st.floats(allow_nan=True, allow_infinity=True),
)
json_values = st.recursive(
    st.none() | st.booleans() | odd_numbers | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=3),
    max_leaves=8,
)


def _rows_with(fields: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with some of ``fields`` (any JSON values, plausible ones often) and extras."""
    plausible = st.one_of(st.integers(0, 4000), st.lists(st.integers(0, 20), max_size=10),
                          st.lists(st.sampled_from([1, 2, 3, 2**64 - 1, 2**64, -1]), max_size=4),
                          st.text(max_size=6), json_values)
    return st.builds(
        lambda d, extra: {**extra, **d},
        st.dictionaries(st.sampled_from(fields), plausible),
        st.dictionaries(st.text(max_size=6), json_values, max_size=2),
    )


def _mutated(base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """``base`` (a valid row) with some fields replaced by odd values and some removed, so
    every field's check is reached (a random object mostly fails on its first field)."""
    return st.builds(
        lambda new, gone: {k: v for k, v in {**base, **new}.items() if k not in gone},
        st.dictionaries(st.sampled_from(sorted(base)), json_values | odd_numbers, max_size=2),
        st.sets(st.sampled_from(sorted(base)), max_size=1),
    )


def _json_line(obj: Any) -> str:
    return json.dumps(obj)  # NaN and Infinity are written bare, as Python's json reads them


def fuzz_lines(fields: list[str], *valid: dict[str, Any]) -> st.SearchStrategy[str | bytes]:
    return st.one_of(
        *(_mutated(v).map(_json_line) for v in valid),
        _rows_with(fields).map(_json_line),
        json_values.map(_json_line),
        st.text(max_size=40).map(lambda s: s.replace("\n", " ")),
        st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ")),
        st.sampled_from(["1" * 5000, "[" * 5000, '{"timestamp": ' + "9" * 5000 + "}",
                         '{"a": 1e999}', "NaN", "\ufeff{}"]),
    )


def _check_fuzzed(read: Callable[[Path], Workload], good: str, line: str | bytes,
                  suffix: str) -> None:
    """``good`` (some lines) then the fuzzed ``line``: the file reads, or the error is a
    TraceFormatError naming the fuzzed line (the file, for a NUL byte: binary data)."""
    data = good.encode() + (line.encode() if isinstance(line, str) else line) + b"\n"
    n = good.count("\n") + 1
    with _tmpdir() as d:
        p = d / f"fuzz{suffix}"
        p.write_bytes(data)
        try:
            wl = read(p)
        except TraceFormatError as exc:
            nul = (b"\0" in line) if isinstance(line, bytes) else ("\0" in line)
            assert exc.line == n or (exc.line is None and nul), str(exc)
            where = f"{p}:{n}" if exc.line is not None else str(p)
            assert str(exc).startswith(f"{where}: ")
            return
    assert isinstance(wl, Workload)
    assert 0 < len(wl) <= n


MOONCAKE_GOOD = (
    '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
    '{"timestamp": 1000, "input_length": 10, "output_length": 0, "hash_ids": [3]}\n'
)
MOONCAKE_FIELDS = ["timestamp", "input_length", "output_length", "hash_ids", "session_id"]


@settings(max_examples=150, deadline=None)
@given(fuzz_lines(MOONCAKE_FIELDS, {"timestamp": 2000, "input_length": 600, "output_length": 1,
                                    "hash_ids": [1, 2], "session_id": "s"}),
       st.sampled_from([None, 0.0, 2.0]))
def test_mooncake_fuzzed_line_is_a_trace_format_error_naming_it(line: str | bytes,
                                                                tick: float | None) -> None:
    _check_fuzzed(lambda p: read_mooncake(p, tick_s=tick), MOONCAKE_GOOD, line, ".jsonl")


LEVAL_GOOD = (
    '{"doc_sha1": "a", "instr_idx": 0, "doc_llama3_tokens": 900, "llama3_tokens": 1000}\n'
    '{"doc_sha1": "a", "instr_idx": 1, "doc_llama3_tokens": 900, "llama3_tokens": 950}\n'
)
LEVAL_MC_GOOD = (
    '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}\n'
)
LEVAL_FIELDS = ["doc_sha1", "instr_idx", "doc_llama3_tokens", "llama3_tokens",
                "ref_output_llama3_tokens", "hash_ids", "input_length", "output_length"]


@settings(max_examples=150, deadline=None)
@given(fuzz_lines(LEVAL_FIELDS,
                  {"doc_sha1": "a", "instr_idx": 2, "doc_llama3_tokens": 900,
                   "llama3_tokens": 990, "ref_output_llama3_tokens": 7},
                  {"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}),
       st.sampled_from([LEVAL_GOOD, LEVAL_MC_GOOD]))
def test_leval_fuzzed_line_is_a_trace_format_error_naming_it(line: str | bytes,
                                                             good: str) -> None:
    _check_fuzzed(lambda p: read_leval(p, rate=1.0), good, line, ".jsonl")


AZURE_GOOD = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:17:03.9799600,1100,10\n"
    "2023-11-16 18:17:04.0319600,30,0\n"
)
cells = st.one_of(
    # No "\n" inside a cell: the fuzzed text is one line of the file (a newline would put
    # what follows it on the next line, and the error there).
    st.text(max_size=12).map(lambda s: s.replace("\n", " ")),
    odd_numbers.map(str),
    st.sampled_from(["2023-11-16 18:17:05", "2023-11-16 18:17:05.", "2023-11-16 18:17:05.1²",
                     "2023-11-16 18:17:05." + "9" * 5000, "2023-11-16 18:17:02.5",
                     "9999-12-31 23:59:59.9999999", "0001-01-01 00:00:00", "1_000", " 7 ",
                     "１２", "١٢", "+5", "7 ", '"5"', '"unterminated', "2024-02-30 00:00:00"]),
)


@settings(max_examples=150, deadline=None)
@given(st.one_of(
    st.tuples(cells, st.integers(1, 5000), st.integers(0, 50)).map(
        lambda c: ",".join(map(str, c))),
    st.tuples(st.just("2023-11-16 18:17:05.1"), cells, cells).map(",".join),
    st.lists(cells, min_size=1, max_size=4).map(",".join),
    st.tuples(cells, cells, cells).map(",".join),
    st.text(max_size=40).map(lambda s: s.replace("\n", " ")),
    st.binary(max_size=40).map(lambda b: b.replace(b"\n", b" ")),
))
def test_azure_fuzzed_line_is_a_trace_format_error_naming_it(line: str | bytes) -> None:
    _check_fuzzed(read_azure, AZURE_GOOD, line, ".csv")
