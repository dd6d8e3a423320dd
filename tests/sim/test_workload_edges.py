"""Workload inputs at their edges (a review of the readers, session 58): a length median that
overflows the sampler, phase multipliers past the request cap, sparse quantised ticks, a
read cut short inside a tick, a timed trace that carries L-Eval's keys, an empty trace or an
L-Eval file given to ``up``, and the messages of a few malformed fields. Each case was a
traceback, a hang, a silent wrong result or a vague message before."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shared.ids import InvalidInput
from sim.runner import load_trace
from sim.workloads import (
    Phase,
    SyntheticConfig,
    TraceFormatError,
    detect_format,
    generate_from_file,
    load_workload,
    read_mooncake,
    scale_rate,
    truncate,
)
from sim.workloads.mooncake import detect_tick_ms
from sim.workloads.synthetic import MAX_REQUESTS, LogNormalLength
from vertumnus.live.stack import load_requests


def _row(ts: int, ids: list[int], **extra: object) -> str:
    return json.dumps({"timestamp": ts, "input_length": 512 * len(ids) + 10,
                       "output_length": 1, "hash_ids": ids + [10**6 + ids[0]], **extra})


def _write(path: Path, rows: list[str]) -> Path:
    path.write_text("\n".join(rows) + "\n")
    return path


# --- the synthetic generator's bounds ---------------------------------------------------------
def test_a_median_past_the_token_bound_is_refused_not_an_overflow(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="median"):
        LogNormalLength(1e300, 10.0, 1, 100)
    toml = tmp_path / "huge.toml"
    toml.write_text("short_len = { median = 1e300, sigma = 10.0 }\n")
    with pytest.raises(InvalidInput, match=r"huge\.toml.*short_len.*median"):
        generate_from_file(toml)


def test_phase_multipliers_count_toward_the_request_cap() -> None:
    # rate × duration is 10 requests, but the one phase runs at 10^7 times that.
    with pytest.raises(InvalidInput, match="requests"):
        SyntheticConfig(rate=1.0, duration_s=10.0, phases=(Phase(10.0, 1e7),))


def test_the_cap_counts_the_expected_requests_over_the_cycled_phases() -> None:
    phases = (Phase(100.0, 2.0), Phase(50.0, 0.5))
    cfg = SyntheticConfig(rate=4.0, duration_s=400.0, phases=phases)
    # Two full cycles (2·(200 + 25) s·multiplier) and 100 s of the first phase (200).
    assert cfg.expected_requests() == pytest.approx(4.0 * (2 * 225.0 + 200.0))
    # Low multipliers let a base rate × duration above the cap through when the requests
    # expected are under it; the same duration at multiplier 1 is refused.
    low = (Phase(600.0, 0.5),)
    rate = MAX_REQUESTS / 600.0 * 1.5
    assert SyntheticConfig(rate=rate, duration_s=600.0, phases=low).expected_requests() \
        <= MAX_REQUESTS
    with pytest.raises(InvalidInput, match="requests"):
        SyntheticConfig(rate=rate, duration_s=600.0, phases=(Phase(600.0, 1.0),))


# --- ticks --------------------------------------------------------------------------------
def test_a_sparse_quantised_trace_keeps_its_smallest_tick() -> None:
    # Stamps on a 1 s grid, three requests each, most occupied ticks 2 s apart.
    stamps = np.repeat(np.array([0, 2000, 3000, 5000, 7000], dtype=np.int64), 3)
    assert detect_tick_ms(stamps) == 1000.0


def test_a_jittered_tick_is_still_its_median_gap() -> None:
    # The conversation trace's shape: 3 s ticks whose stamps jitter by a millisecond, and a
    # stamp 1 ms off inside a tick.
    base = [0, 3000, 5999, 9000, 12001, 12002, 15000, 18000, 24000]
    stamps = np.repeat(np.array(base, dtype=np.int64), 4)
    assert detect_tick_ms(stamps) == 3000.0


def test_sparse_ticks_spread_within_their_own_second(tmp_path: Path) -> None:
    stamps = [0, 2000, 3000, 5000, 7000]
    rows = [_row(t, [1000 * i + k]) for i, t in enumerate(stamps) for k in range(3)]
    wl = read_mooncake(_write(tmp_path / "sparse.jsonl", rows), seed=1)
    assert wl.metadata["tick_s"] == 1.0
    for i, r in enumerate(wl.requests):
        stamp = stamps[i // 3] / 1000.0
        assert stamp <= r.arrival_s < stamp + 1.0


@pytest.mark.parametrize("n", [1, 5, 13, 20, 29])
def test_a_read_cut_short_spreads_as_the_full_read_does(tmp_path: Path, n: int) -> None:
    # Ten requests per 3 s tick: a cut inside a tick must not spread its part again over the
    # whole tick (the same arrivals as reading everything and truncating).
    rows = [_row(3000 * (i // 10), [i + 1]) for i in range(40)]
    path = _write(tmp_path / "ticks.jsonl", rows)
    for tick_s in (None, 3.0):
        cut = read_mooncake(path, seed=7, max_requests=n, tick_s=tick_s)
        full = truncate(read_mooncake(path, seed=7, tick_s=tick_s), max_requests=n)
        assert [r.arrival_s for r in cut] == [r.arrival_s for r in full]


# --- a timed trace with L-Eval's keys -----------------------------------------------------
def test_a_timed_trace_with_a_doc_key_keeps_its_timestamps(tmp_path: Path) -> None:
    rows = [_row(t, [2 * i + 1], doc_id=i) for i, t in enumerate([0, 60000, 120000, 180000])]
    path = _write(tmp_path / "timed.jsonl", rows)
    assert detect_format(path) == "mooncake"
    wl = load_trace(str(path), "auto", seed=0, rate=None, max_requests=None)
    assert [r.arrival_s for r in wl] == [0.0, 60.0, 120.0, 180.0]
    assert [r.arrival_s for r in load_workload(path)] == [0.0, 60.0, 120.0, 180.0]


def test_leval_in_mooncake_form_is_still_leval(tmp_path: Path) -> None:
    # The derived L-Eval file: Mooncake rows, every timestamp 0, with doc_sha1.
    rows = [_row(0, [1, 2 + i], doc_sha1="a") for i in range(5)]
    path = _write(tmp_path / "leval.jsonl", rows)
    assert detect_format(path) == "leval"


# --- what `up` and `replay` load -----------------------------------------------------------
def test_up_refuses_a_trace_without_requests(tmp_path: Path) -> None:
    csv = tmp_path / "empty.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    with pytest.raises(InvalidInput, match="no requests"):
        load_requests(str(csv), duration_s=240.0, rate=None, seed=0, max_requests=None,
                      default_rate=2.0)


def test_up_gives_leval_its_default_rate(tmp_path: Path) -> None:
    rows = [json.dumps({"doc_sha1": f"d{i % 3}", "doc_llama3_tokens": 900,
                        "llama3_tokens": 1000, "ref_output_llama3_tokens": 3})
            for i in range(200)]
    path = _write(tmp_path / "lengths.jsonl", rows)
    wl, reqs = load_requests(str(path), duration_s=0.0, rate=None, seed=0, max_requests=None,
                             default_rate=2.0)
    assert wl.metadata["format"].startswith("leval")
    span = reqs[-1].arrival_s - reqs[0].arrival_s
    # Poisson arrivals at 2 req/s: 199 gaps of mean 0.5 s (a loose bound: ±5 σ).
    assert 199 * 0.5 * (1 - 5 / 199**0.5) < span < 199 * 0.5 * (1 + 5 / 199**0.5)


# --- fields and messages ----------------------------------------------------------------------
def test_a_huge_integer_field_is_shown_short(tmp_path: Path) -> None:
    row = json.loads(_row(0, [1]))
    row["input_length"] = int("9" * 4000)
    path = _write(tmp_path / "big.jsonl", [json.dumps(row), _row(1000, [2])])
    with pytest.raises(TraceFormatError, match="input_length") as err:
        read_mooncake(path, tick_s=0)
    assert len(str(err.value)) < 400


def test_a_session_id_must_be_a_string_or_an_integer(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.jsonl", [_row(0, [1], session_id={"a": 1}),
                                         _row(1000, [2])])
    with pytest.raises(TraceFormatError, match=r"s\.jsonl:1.*session_id"):
        read_mooncake(path, tick_s=0)
    ok = _write(tmp_path / "ok.jsonl", [_row(0, [1], session_id=7),
                                        _row(1000, [2], session_id="x")])
    assert [r.session_id for r in read_mooncake(ok, tick_s=0)] == ["7", "x"]


def test_scale_rate_takes_numpy_numbers_and_refuses_a_bool(tmp_path: Path) -> None:
    wl = read_mooncake(_write(tmp_path / "t.jsonl", [_row(0, [1]), _row(4000, [2])]),
                       tick_s=0)
    assert scale_rate(wl, np.int64(2)).requests[1].arrival_s == 2.0
    assert scale_rate(wl, np.float32(4.0)).requests[1].arrival_s == 1.0
    with pytest.raises(InvalidInput, match="rate scale"):
        scale_rate(wl, True)


def test_a_csv_under_another_name_gets_a_hint(tmp_path: Path) -> None:
    path = tmp_path / "azure.txt"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:17:03.1,10,1\n2023-11-16 18:17:04.1,10,1\n")
    with pytest.raises(InvalidInput, match="--format azure"):
        load_trace(str(path), "auto", seed=0, rate=None, max_requests=None)
    with pytest.raises(InvalidInput, match=r"\.csv"):
        load_workload(path)
