"""sim.comparison: vertumnus against the strongest baseline at each rate, as the simulator
issue defines it (the lowest mean; P90 and SLO against the baseline best on each)."""

from __future__ import annotations

import math

import pytest

from shared.ids import InvalidInput
from sim.comparison import (
    COMPARISON_KEYS,
    compare_with_baselines,
    strongest_baseline,
    subject_of,
)


def _row(policy: str, rate: float, mean: float | None, p90: float | None,
         slo: float | None, oracle: float | None = 0.5) -> dict:
    return {"policy": policy, "rate_scale": rate, "mean_ttft_s": mean, "p90_ttft_s": p90,
            "slo_attainment": slo, "oracle_mean_ttft_s": oracle}


def test_each_metric_against_the_baseline_best_on_it() -> None:
    rows = [
        _row("vertumnus", 1.0, 0.8, 1.5, 0.93, oracle=0.5),
        _row("homo", 1.0, 1.0, 1.2, 0.90),     # best P90
        _row("static", 1.0, 0.9, 2.0, 0.80),   # lowest mean: the strongest baseline
        _row("vllm", 1.0, 2.0, 3.0, 0.95),     # best SLO
    ]
    (c,) = compare_with_baselines(rows)
    assert list(c) == list(COMPARISON_KEYS)
    assert (c["subject"], c["rate_scale"]) == ("vertumnus", 1.0)
    assert (c["strongest_baseline"], c["strongest_mean_ttft_s"]) == ("static", 0.9)
    assert c["mean_change"] == pytest.approx(0.8 / 0.9 - 1)
    assert (c["best_p90_baseline"], c["best_p90_ttft_s"]) == ("homo", 1.2)
    assert c["p90_change"] == pytest.approx(1.5 / 1.2 - 1)  # worse: positive
    assert (c["best_slo_baseline"], c["best_slo_attainment"]) == ("vllm", 0.95)
    assert c["slo_points"] == pytest.approx(-2.0)
    assert (c["mean_ttft_s"], c["p90_ttft_s"], c["slo_attainment"]) == (0.8, 1.5, 0.93)
    assert c["mean_over_oracle"] == pytest.approx(1.6)


def test_one_row_per_rate_in_order_and_only_where_both_sides_ran() -> None:
    rows = [
        _row("homo", 4.0, 2.0, 3.0, 0.5),
        _row("vertumnus", 4.0, 1.0, 2.0, 0.7),
        _row("vertumnus", 1.0, 0.5, 0.9, 0.95),
        _row("homo", 1.0, 0.6, 1.0, 0.94),
        _row("vertumnus", 2.0, 0.5, 0.9, 0.95),   # no baseline at x2
        _row("homo", 3.0, 0.5, 0.9, 0.95),        # no vertumnus at x3
    ]
    out = compare_with_baselines(rows)
    assert [c["rate_scale"] for c in out] == [4.0, 1.0]
    assert out[0]["mean_change"] == pytest.approx(-0.5)
    assert out[0]["slo_points"] == pytest.approx(20.0)
    assert compare_with_baselines([_row("homo", 1.0, 1, 1, 1)]) == []
    assert compare_with_baselines([]) == []


def test_a_tie_goes_to_the_first_row_and_missing_figures_are_skipped() -> None:
    rows = [
        _row("vertumnus", 1.0, 1.0, 2.0, 0.9),
        _row("a", 1.0, None, None, None),          # no completed request: nulls
        _row("b", 1.0, 1.5, math.nan, 0.8),        # NaN counts as missing
        _row("c", 1.0, 1.5, 2.5, 0.8),
    ]
    (c,) = compare_with_baselines(rows)
    assert c["strongest_baseline"] == "b"          # tie with c: the first
    assert c["best_p90_baseline"] == "c"           # b's NaN skipped
    assert c["best_slo_baseline"] == "b"


def test_figures_that_cannot_be_given_are_none() -> None:
    rows = [
        _row("vertumnus", 1.0, None, 1.0, None, oracle=0.0),
        _row("homo", 1.0, 0.0, None, None),
    ]
    (c,) = compare_with_baselines(rows)
    assert c["mean_change"] is None                # vertumnus has no mean (and the base is 0)
    assert (c["best_p90_baseline"], c["p90_change"]) == (None, None)
    assert (c["best_slo_baseline"], c["slo_points"]) == (None, None)
    assert c["mean_over_oracle"] is None
    rows = [_row("vertumnus", 1.0, 1.0, 1.0, 1.0, oracle=0.0), _row("homo", 1.0, 0.0, 1, 1)]
    (c,) = compare_with_baselines(rows)
    assert (c["mean_change"], c["mean_over_oracle"]) == (None, None)  # zero denominators


def test_rows_that_are_not_one_sweeps_are_refused() -> None:
    with pytest.raises(InvalidInput, match="row 1 has no policy"):
        compare_with_baselines([_row("vertumnus", 1.0, 1, 1, 1), {"rate_scale": 1.0}])
    with pytest.raises(InvalidInput, match="2 vertumnus rows at rate scale 1.0"):
        compare_with_baselines([_row("vertumnus", 1.0, 1, 1, 1), _row("vertumnus", 1.0, 2, 2, 1),
                                _row("homo", 1.0, 1, 1, 1)])


def test_strongest_baseline() -> None:
    rows = [
        {"policy": "vertumnus", "rate_scale": 1.0, "mean_ttft_s": 0.1},
        {"policy": "homo", "rate_scale": 1.0, "mean_ttft_s": 0.5},
        {"policy": "sglang", "rate_scale": 1.0, "mean_ttft_s": 0.3},
        {"policy": "vllm", "rate_scale": 2.0, "mean_ttft_s": 0.2},
    ]
    assert strongest_baseline(rows, 1.0)["policy"] == "sglang"
    assert strongest_baseline(rows, 2.0)["policy"] == "vllm"
    assert strongest_baseline(rows, 3.0) is None
    rows2 = [dict(r, slo_attainment=1 - r["mean_ttft_s"]) for r in rows]
    assert (
        strongest_baseline(rows2, 1.0, "slo_attainment", higher_is_better=True)["policy"]
        == "sglang"
    )


def test_the_ablation_compares_the_full_manager_with_the_variant_without() -> None:
    rows = [_row("full", 4.5, 2.9, 5.9, 0.65), _row("no_replication", 4.5, 4.2, 6.8, 0.49)]
    assert subject_of(rows) == "full"
    (c,) = compare_with_baselines(rows)
    assert (c["subject"], c["strongest_baseline"]) == ("full", "no_replication")
    assert c["mean_change"] == pytest.approx(2.9 / 4.2 - 1)
    assert c["slo_points"] == pytest.approx(16.0)
    # vertumnus is the subject wherever it ran; another subject can be named.
    rows.append(_row("vertumnus", 4.5, 3.0, 6.0, 0.6))
    assert subject_of(rows) == "vertumnus"
    assert compare_with_baselines(rows)[0]["strongest_baseline"] == "full"
    (c,) = compare_with_baselines(rows, subject="no_replication")
    assert (c["subject"], c["strongest_baseline"]) == ("no_replication", "full")
    assert subject_of([_row("homo", 1.0, 1, 1, 1)]) is None


def test_compare_sizes() -> None:
    from sim.comparison import compare_sizes

    c = compare_sizes([{"policy": "homo", "gpus": 32}, {"policy": "vertumnus", "gpus": 28},
                       {"policy": "static", "gpus": 32}, {"policy": "homo_cp2", "gpus": None}])
    assert c == {"subject": "vertumnus", "gpus": 28, "best_baseline": "homo", "best_gpus": 32,
                 "saved_gpus": 4, "saved_share": pytest.approx(0.125)}
    c = compare_sizes([{"policy": "vertumnus", "gpus": None}, {"policy": "homo", "gpus": 8}])
    assert (c["best_baseline"], c["saved_gpus"], c["saved_share"]) == ("homo", None, None)
    c = compare_sizes([{"policy": "vertumnus", "gpus": 8}, {"policy": "homo", "gpus": None}])
    assert (c["best_baseline"], c["best_gpus"], c["saved_gpus"]) == (None, None, None)
    assert compare_sizes([{"policy": "homo", "gpus": 8}]) is None


def test_failed_requests_are_shown_beside_the_means() -> None:
    """Mean and P90 are over completed requests: a baseline that fails requests can look
    stronger than one that serves them. The comparison row carries the failed counts of
    the subject and of the baselines it names (None for rows without them)."""
    rows = [
        {**_row("vertumnus", 2.0, 0.5, 0.9, 0.9), "failed": 1},
        {**_row("homo_cp2", 2.0, 0.35, 0.53, 0.49), "failed": 25},  # fails the long ones
        {**_row("homo", 2.0, 0.45, 0.8, 0.68), "failed": 6},
    ]
    (c,) = compare_with_baselines(rows)
    assert (c["strongest_baseline"], c["best_p90_baseline"]) == ("homo_cp2", "homo_cp2")
    assert (c["failed"], c["strongest_failed"], c["best_p90_failed"]) == (1, 25, 25)
    (old,) = compare_with_baselines([_row("vertumnus", 1.0, 0.5, 0.9, 0.9),
                                     _row("homo", 1.0, 0.6, 1.0, 0.9)])
    assert (old["failed"], old["strongest_failed"], old["best_p90_failed"]) == (None,) * 3
