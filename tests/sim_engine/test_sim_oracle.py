"""A request alone on an idle pool is the oracle (noise off); the oracle's cached prefixes."""

from __future__ import annotations

import pytest
from simeng_support import B, run, unique_prefix_workload

from services.controller.lattice import Composition, Lattice
from sim.experiments import oracle_ttfts
from sim.groundtruth import GroundTruth
from sim.workloads import Request, Workload

GT = GroundTruth()


@pytest.mark.parametrize("length", [900, 8_000, 60_000])
def test_single_request_on_idle_pool_is_ground_truth(profile, length) -> None:
    wl = unique_prefix_workload([length], 0.0, start_s=2.5)
    res = run(
        wl,
        profile,
        gpus=8,
        degrees=(2, 4),
        noise_sigma=0.0,
        composition=Composition.parse(Lattice(8, (2, 4)), "2CP2/1CP4"),
    )
    (r,) = res.records
    c = r.degree
    assert r.start_s == 2.5 and r.reused_tokens == 0
    expect = GT.prefill_time(length, 0, c) + GT.external_time(length, c)
    assert r.ttft_s == pytest.approx(expect, rel=1e-12)
    # The oracle may pick a better degree than the scheduler's (profile-based) choice, never worse.
    (o,) = oracle_ttfts(wl, GT, (2, 4))
    assert o <= r.ttft_s + 1e-12
    (o_c,) = oracle_ttfts(wl, GT, (c,))
    assert r.ttft_s == pytest.approx(o_c, rel=1e-12)


@pytest.mark.parametrize("degree", [2, 4])
def test_single_request_equals_oracle_on_single_degree_pool(profile, degree) -> None:
    wl = unique_prefix_workload([33_000], 0.0)
    res = run(wl, profile, gpus=8, degrees=(degree,), noise_sigma=0.0, policy="homo")
    (r,) = res.records
    assert r.degree == degree
    assert r.ttft_s == pytest.approx(float(oracle_ttfts(wl, GT, (degree,))[0]), rel=1e-12)


def _shared_prefix_pair(l0: int, l1: int, shared_blocks: int, gap_s: float) -> Workload:
    a = tuple(range(1, l0 // B + 1))
    b = a[:shared_blocks] + tuple(range(10_000, 10_000 + l1 // B - shared_blocks))
    return Workload("pair", (Request("first", 0.0, l0, 1, a), Request("second", gap_s, l1, 1, b)))


def test_oracle_uses_the_cached_prefix_for_the_second_request() -> None:
    wl = _shared_prefix_pair(20_000, 30_000, 39, 100.0)
    o = oracle_ttfts(wl, GT, (2, 4))
    P = 39 * B
    assert o[0] == pytest.approx(
        min(GT.prefill_time(20_000, 0, c) + GT.external_time(20_000, c) for c in (2, 4)), rel=1e-12
    )
    assert o[1] == pytest.approx(
        min(GT.prefill_time(30_000 - P, P, c) + GT.external_time(30_000, c) for c in (2, 4)),
        rel=1e-12,
    )
    cold = min(GT.prefill_time(30_000, 0, c) + GT.external_time(30_000, c) for c in (2, 4))
    assert o[1] < cold
    # Order matters: the first request never benefits from the second.
    swapped = Workload(
        "swapped",
        (
            Request("x", 0.0, 30_000, 1, wl.requests[1].block_hashes),
            Request("y", 1.0, 20_000, 1, wl.requests[0].block_hashes),
        ),
    )
    o2 = oracle_ttfts(swapped, GT, (2, 4))
    assert o2[0] == pytest.approx(cold, rel=1e-12)


def test_oracle_full_prefix_hit_still_recomputes_one_token() -> None:
    L = 20 * B  # whole blocks: a repeat would otherwise reuse all of it
    ids = tuple(range(1, 21))
    wl = Workload("repeat", (Request("a", 0.0, L, 1, ids), Request("b", 5.0, L, 1, ids)))
    o = oracle_ttfts(wl, GT, (4,))
    assert o[1] == pytest.approx(GT.prefill_time(1, L - 1, 4) + GT.external_time(L, 4), rel=1e-12)


def test_simulator_matches_oracle_for_a_reused_prefix_on_one_worker(profile) -> None:
    """One CP4 worker, the second request long after the first: it reuses the prefix the
    first left in the worker's cache, exactly as the oracle assumes."""
    wl = _shared_prefix_pair(20_000, 30_000, 39, 100.0)
    res = run(wl, profile, gpus=4, degrees=(4,), noise_sigma=0.0)
    r0, r1 = res.records
    assert (r0.reused_tokens, r1.reused_tokens) == (0, 39 * B)
    o = oracle_ttfts(wl, GT, (4,))
    assert [r0.ttft_s, r1.ttft_s] == pytest.approx(list(o), rel=1e-12)


def test_queueing_only_adds_to_the_oracle(profile) -> None:
    """Two long requests at once on one worker: the second waits for the first."""
    wl = unique_prefix_workload([50_000, 50_000], 0.0)
    res = run(wl, profile, gpus=4, degrees=(4,), noise_sigma=0.0)
    o = oracle_ttfts(wl, GT, (4,))
    r0, r1 = sorted(res.records, key=lambda r: r.start_s)
    assert r0.ttft_s == pytest.approx(o[0], rel=1e-12)
    assert r1.start_s == pytest.approx(r0.finish_s, abs=1e-12)
    assert r1.ttft_s == pytest.approx(o[1] + r0.actual_s, rel=1e-12)


def test_the_oracle_bounds_the_tp_pool_when_the_comparison_runs_it(profile) -> None:
    """vLLM's TP-4 workers are faster than every CP degree in the ground truth (no d_cp), so
    an oracle over CP degrees alone would not bound the ``vllm`` row: with ``tp_degrees`` it
    does, and a comparison including ``vllm`` asks for them."""
    from sim.experiments import oracle_tp_degrees

    wl = unique_prefix_workload([2_048, 2_048], 10.0)
    cp = oracle_ttfts(wl, GT, (2, 4))
    both = oracle_ttfts(wl, GT, (2, 4), tp_degrees=(4,))
    tp = GT.prefill_time(2_048, 0, 4, kind="tp") + GT.external_time(2_048, 4)
    assert list(both) == pytest.approx([tp, tp], rel=1e-12)
    assert (both < cp).all()
    res = run(wl, profile, gpus=8, degrees=(2, 4), noise_sigma=0.0, policy="vllm")
    assert all(r.ttft_s >= o - 1e-12 for r, o in zip(res.records, both, strict=True))
    assert any(r.ttft_s < o for r, o in zip(res.records, cp, strict=True))  # CP alone: no bound
    assert oracle_tp_degrees(["vertumnus", "vllm"], (2, 4)) == (4,)
    assert oracle_tp_degrees(["vllm"], (2, 4, 8)) == (4,)
    assert oracle_tp_degrees(["vllm"], (2, 8)) == (8,)
    assert oracle_tp_degrees(["vertumnus", "homo"], (2, 4)) == ()
