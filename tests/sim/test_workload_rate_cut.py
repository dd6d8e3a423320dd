"""``--rate R`` on a timed trace (Mooncake, Azure): what rate the requests replayed arrive at.

1. The rate's definition: R req/s means a mean inter-arrival gap of 1/R, so n requests span
   (n − 1)/R from the first arrival to the last, as Poisson arrivals of rate R do on average
   (L-Eval's, the synthetic generator's). It was n/span = R, a mean gap of n/((n − 1)·R):
   twice too long with two requests.
2. ``up`` / ``replay`` (``vertumnus.live.stack.load_requests``) cut the trace first, to
   ``--max-requests`` and to as many requests as ``--duration`` seconds hold at R, then
   rescale the part replayed. It rescaled the whole trace to R and then kept its first
   requests, which ran at the rate of the trace's first part instead.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shared.ids import InvalidInput
from sim.workloads import load_workload
from vertumnus.live.stack import load_requests


def _mooncake(path: Path, stamps_ms: list[int]) -> Path:
    """A Mooncake trace with these (distinct, so not spread over a tick) timestamps."""
    rows = [{"timestamp": t, "input_length": 500, "output_length": 4, "hash_ids": [i]}
            for i, t in enumerate(stamps_ms)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _gaps(arrivals: list[float]) -> list[float]:
    return [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]


# --- 1. the definition ----------------------------------------------------------------------
def test_rate_on_a_tiny_timed_trace_is_one_over_the_mean_gap(tmp_path: Path) -> None:
    f = _mooncake(tmp_path / "t.jsonl", [0, 1000, 3000])
    wl = load_workload(f, rate=2.0)
    arr = [r.arrival_s for r in wl]
    # Two gaps of mean 0.5 s (the trace's 1 : 2 proportions kept); n/span would give 1.5 s.
    assert arr == pytest.approx([0.0, 1 / 3, 1.0])
    two = load_workload(_mooncake(tmp_path / "two.jsonl", [0, 1000]), rate=4.0)
    assert [r.arrival_s for r in two] == pytest.approx([0.0, 0.25])


def test_rate_on_an_azure_trace_is_one_over_the_mean_gap(tmp_path: Path) -> None:
    f = tmp_path / "a.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 18:17:03.0,10,1\n2023-11-16 18:17:05.0,10,1\n"
                 "2023-11-16 18:17:06.0,10,1\n")
    wl = load_workload(f, rate=1.0)
    arr = [r.arrival_s for r in wl]
    assert arr[-1] - arr[0] == pytest.approx(2.0)  # two gaps of mean 1 s


def test_scale_to_rate_contract() -> None:
    from sim.workloads import Request, Workload, scale_to_rate

    wl = Workload("w", tuple(Request(f"r{i}", 5.0 + 3.0 * i * i, 10, 1) for i in range(5)))
    out = scale_to_rate(wl, 0.5)
    arr = [r.arrival_s for r in out]
    assert arr[0] == 5.0  # the first arrival is kept
    assert sum(_gaps(arr)) / 4 == pytest.approx(2.0)  # mean gap 1/rate
    # Proportions kept: each gap scaled by one factor.
    assert [g / _gaps([r.arrival_s for r in wl])[i] for i, g in enumerate(_gaps(arr))] \
        == pytest.approx([2.0 / 12.0] * 4)
    assert out.metadata["rate_scale"] == pytest.approx(12.0 / 2.0)
    # Nothing to rescale: one request, or all at one instant.
    one = Workload("w", (Request("a", 1.0, 10, 1),))
    assert scale_to_rate(one, 3.0) is one
    tie = Workload("w", (Request("a", 1.0, 10, 1), Request("b", 1.0, 10, 1)))
    assert scale_to_rate(tie, 3.0) is tie
    for bad in (0.0, -1.0, math.inf, math.nan, True):
        with pytest.raises(InvalidInput, match="rate"):
            scale_to_rate(wl, bad)  # type: ignore[arg-type]


# --- 2. up / replay: cut, then rescale ------------------------------------------------------
# 10 requests 0.1 s apart (10 req/s), then 10 more 2 s apart (0.5 req/s): the rate halves
# its way through (a burst, then a lull); the whole trace's mean rate is under 1 req/s.
BURST_THEN_LULL = [100 * i for i in range(10)] + [900 + 2000 * k for k in range(1, 11)]
LULL_THEN_BURST = [2000 * i for i in range(10)] + [18000 + 100 * k for k in range(1, 11)]


def _load(path: Path, **kw: object) -> list[float]:
    args: dict[str, object] = {"duration_s": 0.0, "rate": None, "seed": 0,
                               "max_requests": None, "default_rate": 2.0, **kw}
    _, reqs = load_requests(str(path), **args)  # type: ignore[arg-type]
    return [r.arrival_s for r in reqs]


@pytest.mark.parametrize("stamps", [BURST_THEN_LULL, LULL_THEN_BURST], ids=["burst", "lull"])
def test_max_requests_are_replayed_at_the_rate_asked(tmp_path: Path, stamps: list[int]) -> None:
    f = _mooncake(tmp_path / "t.jsonl", stamps)
    arr = _load(f, rate=2.0, max_requests=10, duration_s=1000.0)
    assert len(arr) == 10
    assert arr[0] == 0.0
    assert arr[-1] == pytest.approx(9 / 2.0)  # 9 gaps of mean 0.5 s, whichever half it is


@pytest.mark.parametrize("stamps", [BURST_THEN_LULL, LULL_THEN_BURST], ids=["burst", "lull"])
def test_duration_at_a_rate_holds_duration_times_rate_requests(tmp_path: Path,
                                                               stamps: list[int]) -> None:
    """``--duration D --rate R``: the first ⌈D·R⌉ requests (as many as D seconds hold at a
    mean gap of 1/R), rescaled to R: they arrive within [0, D)."""
    f = _mooncake(tmp_path / "t.jsonl", stamps)
    arr = _load(f, rate=2.0, duration_s=3.0)
    assert len(arr) == 6
    assert arr[0] == 0.0 and arr[-1] == pytest.approx(5 / 2.0) and arr[-1] < 3.0
    # Not an integer D·R: ⌈2.5·2⌉ = 5 requests, 4 gaps of 0.5 s.
    arr = _load(f, rate=2.0, duration_s=2.5)
    assert len(arr) == 5 and arr[-1] == pytest.approx(2.0)
    # D·R = 0.3·10 is 3.0000000000000004 in floats: still 3 requests, the last before D.
    arr = _load(f, rate=10.0, duration_s=0.3)
    assert len(arr) == 3 and arr[-1] < 0.3
    # Both: the fewer of --max-requests and what the duration holds.
    assert len(_load(f, rate=2.0, duration_s=3.0, max_requests=4)) == 4
    assert len(_load(f, rate=2.0, duration_s=3.0, max_requests=9)) == 6
    # A trace shorter than the duration at R: all of it, at R.
    arr = _load(f, rate=0.5, duration_s=1000.0)
    assert len(arr) == 20 and arr[-1] == pytest.approx(19 / 0.5)


def test_without_a_rate_duration_cuts_the_traces_own_time(tmp_path: Path) -> None:
    f = _mooncake(tmp_path / "t.jsonl", BURST_THEN_LULL)
    arr = _load(f, duration_s=5.0)  # the burst (0-0.9 s), then 2.9 and 4.9 s
    assert arr == pytest.approx([0.1 * i for i in range(10)] + [2.9, 4.9])
    assert len(_load(f, duration_s=5.0, max_requests=3)) == 3
    assert len(_load(f)) == 20


def test_a_synthetic_or_leval_rate_is_unchanged(tmp_path: Path) -> None:
    # Their rate is the generator's (Poisson) rate, not a rescale: the cut stays after it.
    rows = [json.dumps({"doc_sha1": f"d{i % 3}", "doc_llama3_tokens": 900,
                        "llama3_tokens": 1000, "ref_output_llama3_tokens": 3})
            for i in range(50)]
    lv = tmp_path / "lengths.jsonl"
    lv.write_text("\n".join(rows) + "\n")
    arr = _load(lv, rate=4.0, max_requests=10)
    assert len(arr) == 10
    every = _load(lv, rate=4.0)
    assert arr == every[:10]
