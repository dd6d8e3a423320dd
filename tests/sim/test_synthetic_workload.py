"""The embedded synthetic workload: deterministic, chained ids, sessions, system prompts, phases."""

from __future__ import annotations

import numpy as np
import pytest

from shared.ids import InvalidInput
from sim.workloads import SyntheticConfig, generate, workload_stats
from sim.workloads.synthetic import Phase, phase_table, steady


@pytest.fixture(scope="module")
def default_wl():
    return generate(seed=0)


def test_deterministic_for_a_seed(default_wl) -> None:
    again = generate(seed=0)
    assert [(r.arrival_s, r.input_len, r.block_hashes) for r in again] == [
        (r.arrival_s, r.input_len, r.block_hashes) for r in default_wl
    ]
    other = generate(seed=1)
    assert [r.arrival_s for r in other][:10] != [r.arrival_s for r in default_wl][:10]


def test_chained_ids_equal_prefix_iff_equal_id(default_wl) -> None:
    # Every id always has the same parent (prefix-chained) and the same position.
    parent: dict[int, int | None] = {}
    position: dict[int, int] = {}
    for r in default_wl:
        prev = None
        for j, h in enumerate(r.block_hashes):
            assert parent.setdefault(h, prev) == prev
            assert position.setdefault(h, j) == j
            prev = h


def test_sessions_extend_previous_turn(default_wl) -> None:
    by_session: dict[str, list] = {}
    for r in default_wl:
        if r.session_id is not None:
            by_session.setdefault(r.session_id, []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert len(multi) > 50
    for turns in multi:
        for a, b in zip(turns, turns[1:], strict=False):
            assert b.input_len > a.input_len
            assert b.block_hashes[: len(a.block_hashes)] == a.block_hashes


def test_system_prompts_shared_with_skew(default_wl) -> None:
    firsts = [r.block_hashes[0] for r in default_wl if r.block_hashes and r.input_len < 32768]
    values, counts = np.unique(firsts, return_counts=True)
    top = np.sort(counts)[::-1]
    assert top[0] > 2 * top[min(4, len(top) - 1)]  # Zipf: the most popular prompt dominates
    assert top[:6].sum() > 0.6 * len(firsts)


def test_default_has_distinct_phases_and_reuse(default_wl) -> None:
    st = workload_stats(default_wl)
    assert 0.02 < st["long_share"] < 0.15
    assert st["long_token_share"] > 0.2
    assert 0.3 < st["oracle_reuse"] < 0.85
    assert st["sessions"] > 100
    # Request rate per phase follows the multipliers (burst phase far above the calm one).
    rates = []
    for seg in phase_table():
        n = sum(1 for r in default_wl if seg["start_s"] + 30 <= r.arrival_s < seg["end_s"])
        rates.append(n / (seg["end_s"] - seg["start_s"] - 30))
    assert rates[2] > 2.5 * rates[3]
    # The long-heavy phase has the highest share of long requests.
    longs = []
    for seg in phase_table():
        reqs = [r for r in default_wl if seg["start_s"] <= r.arrival_s < seg["end_s"]]
        longs.append(sum(r.input_len > 32768 for r in reqs) / len(reqs))
    assert max(longs) == longs[1]


def test_config_validation_and_steady() -> None:
    with pytest.raises(InvalidInput):
        SyntheticConfig(rate=0)
    with pytest.raises(InvalidInput):
        Phase(10.0, -1.0)
    with pytest.raises(InvalidInput):
        SyntheticConfig(mean_turns=1.5)
    wl = generate(steady(120.0, 5.0, 0.0, session_share=0.0), seed=3)
    assert all(r.input_len <= 32768 for r in wl)
    assert all(r.session_id is None for r in wl)
    assert 400 < len(wl) < 800
    assert all(r.arrival_s < 120.0 for r in wl)


def test_phases_cycle_to_fill_duration() -> None:
    cfg = SyntheticConfig(duration_s=700.0, phases=(Phase(100.0, 1.0, 0.0), Phase(200.0, 2.0, 0.5)))
    table = phase_table(cfg)
    assert [(s["start_s"], s["end_s"]) for s in table] == [
        (0.0, 100.0),
        (100.0, 300.0),
        (300.0, 400.0),
        (400.0, 600.0),
        (600.0, 700.0),
    ]
    assert cfg.phase_at(350.0).rate_multiplier == 1.0
