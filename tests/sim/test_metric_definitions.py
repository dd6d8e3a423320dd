"""Metric definitions: Table 2 deadlines, token-weighted attainment, hit rate, GPU-seconds."""

from __future__ import annotations

import math
import re

import pytest

from shared.ids import InvalidInput
from sim.metrics import (
    DEEPSEEK_V4_SLO,
    QWEN3_SLO,
    RequestRecord,
    SloTable,
    slo_attainment,
    summarize,
)


def test_table2_deadlines() -> None:
    assert [QWEN3_SLO(x) for x in (1, 8191, 8192, 32767, 32768, 10**6)] == [
        1.0,
        1.0,
        5.0,
        5.0,
        10.0,
        10.0,
    ]
    assert [DEEPSEEK_V4_SLO(x) for x in (100, 9000, 40000)] == [0.5, 2.0, 5.0]


def test_slo_table_validation() -> None:
    with pytest.raises(InvalidInput):
        SloTable(())
    with pytest.raises(InvalidInput):
        SloTable(((100, 1.0), (50, 2.0), (math.inf, 3.0)))
    with pytest.raises(InvalidInput):
        SloTable(((100, 1.0),))  # lengths >= 100 would have no deadline
    with pytest.raises(InvalidInput):
        SloTable(((math.inf, 0.0),))


def test_token_weighted_attainment() -> None:
    # A long request missing its deadline weighs more than many short ones meeting theirs.
    lens = [1000, 1000, 40_000]
    assert slo_attainment(lens, [0.5, 0.9, 11.0]) == pytest.approx(2000 / 42_000)
    assert slo_attainment(lens, [2.0, 0.9, 9.0]) == pytest.approx(41_000 / 42_000)
    assert math.isnan(slo_attainment([], []))
    with pytest.raises(InvalidInput):
        slo_attainment([1], [1.0, 2.0])


def test_summarize() -> None:
    recs = [
        RequestRecord(
            "a",
            0.0,
            1000,
            0.5,
            reused_tokens=512,
            worker="w-cp2-g0",
            degree=2,
            predicted_prefill_s=0.2,
            actual_prefill_s=0.25,
        ),
        RequestRecord(
            "b",
            1.0,
            3000,
            2.0,
            reused_tokens=0,
            worker="w-cp4-g4",
            degree=4,
            predicted_prefill_s=0.5,
            actual_prefill_s=0.4,
        ),
    ]
    s = summarize(recs)
    assert s["requests"] == 2
    assert s["ttft_mean"] == pytest.approx(1.25)
    assert s["ttft_p50"] == pytest.approx(1.25)
    assert s["slo_attainment"] == pytest.approx(0.25)
    assert s["hit_rate"] == pytest.approx(512 / 4000)
    assert s["gpu_seconds"] == pytest.approx(0.25 * 2 + 0.4 * 4)
    assert s["prediction_mape"] == pytest.approx((0.05 / 0.25 + 0.1 / 0.4) / 2)
    assert s["per_degree"][4]["requests"] == 1 and s["per_degree"][2]["hit_rate"] == pytest.approx(
        0.512
    )
    assert summarize([]) == {"requests": 0, "slo": "qwen3-30b-a3b"}


def test_record_validation() -> None:
    with pytest.raises(InvalidInput):
        RequestRecord("a", 0.0, 100, 1.0, reused_tokens=101)
    with pytest.raises(InvalidInput):
        RequestRecord("a", 0.0, 100, -1.0)


# --- --slo: a named table or BOUND:SECONDS pairs -----------------------------------------------
def test_parse_slo_names_and_pairs() -> None:
    from sim.metrics import SLO_TABLES, parse_slo, slo_to_dict

    assert parse_slo("qwen3-30b-a3b") is QWEN3_SLO
    assert parse_slo(" deepseek-v4-flash ") is DEEPSEEK_V4_SLO
    assert set(SLO_TABLES) == {"qwen3-30b-a3b", "deepseek-v4-flash"}
    mine = parse_slo("4096:0.5, 16384:2,INF:6")
    assert mine.bounds == ((4096, 0.5), (16384, 2.0), (math.inf, 6.0))
    assert [mine(x) for x in (4095, 4096, 16384, 10**6)] == [0.5, 2.0, 6.0, 6.0]
    assert parse_slo("8192:1,32768:5,inf:10").bounds == QWEN3_SLO.bounds
    assert parse_slo("inf:3").deadline(1) == 3.0
    assert slo_to_dict(mine) == {"name": "4096:0.5, 16384:2,INF:6",
                                 "bounds": [[4096, 0.5], [16384, 2.0], ["inf", 6.0]]}


@pytest.mark.parametrize(("text", "words"), [
    ("", "nothing"),
    ("qwen3", "unknown SLO table 'qwen3'; known: qwen3-30b-a3b"),
    ("8192:1", "last SLO bound must be inf"),
    ("8192,inf:1", "'8192' is not BOUND:SECONDS"),
    ("8k:1,inf:2", "bound '8k' is not a whole number"),
    ("1.5:1,inf:2", "bound '1.5' is not a whole number"),
    ("8192:soon,inf:2", "deadline 'soon' is not a number"),
    ("0:1,inf:2", "bound must be > 0"),
    ("8192:1,4096:2,inf:3", "must increase"),
    ("8192:-1,inf:2", "deadline must be finite and > 0"),
    ("inf:nan", "deadline must be finite and > 0"),
    ("inf:inf", "deadline must be finite and > 0"),
])
def test_parse_slo_names_what_is_wrong(text: str, words: str) -> None:
    from sim.metrics import parse_slo

    with pytest.raises(InvalidInput, match=re.escape(words)):
        parse_slo(text)
