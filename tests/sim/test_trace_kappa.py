"""κ measured on a trace's own traffic: the pooled ramp, arrival replay, the cache, the sweep."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from shared.costmodel import DEFAULT_PROFILE, Profile
from shared.ids import InvalidInput
from sim import calibration, runner
from sim.groundtruth import NoisyGroundTruth
from sim.profiling import (
    KappaRamp,
    cached_trace_kappa,
    measure_kappa,
    trace_kappa,
    trace_kappa_key,
)
from sim.workloads import generate
from sim.workloads.synthetic import steady
from sim.workloads.workload import Request, Workload, history_reuse, truncate

# Cheap ramps: these tests compare κ's, they do not need its precision.
SMALL = KappaRamp(min_requests_per_level=400, load_step=0.1)


def _bursty(n_bursts: int, burst: int, gap_s: float, length: int = 2048,
            name: str = "bursty") -> Workload:
    """``n_bursts`` bursts of ``burst`` simultaneous requests, ``gap_s`` apart."""
    reqs = [
        Request(f"r{b}-{i}", b * gap_s, length, 1, tuple(range(length // 512)))
        for b in range(n_bursts)
        for i in range(burst)
    ]
    return Workload(name, tuple(reqs))


def test_pool_size_is_validated() -> None:
    with pytest.raises(InvalidInput, match="pool_workers"):
        KappaRamp(pool_workers=0)


def test_a_routed_pool_sustains_more_per_worker_than_one_fifo_worker() -> None:
    # Mostly short requests with a few long ones: one FIFO worker queues the short ones behind
    # each long one; a pool routes around it, so its per-worker capacity is higher.
    lengths = np.array([1024] * 18 + [32768] * 2)
    single = measure_kappa(DEFAULT_PROFILE, NoisyGroundTruth(1), 2, lengths,
                           rng=np.random.default_rng(0), ramp=SMALL)
    pooled = measure_kappa(
        DEFAULT_PROFILE, NoisyGroundTruth(1), 2, lengths, rng=np.random.default_rng(0),
        ramp=KappaRamp(min_requests_per_level=400, load_step=0.1, pool_workers=4),
    )
    assert single.status == pooled.status == "ok"
    assert pooled.kappa > 1.3 * single.kappa
    # Per-worker demand can never exceed a worker's whole window of (predicted) service by
    # much: the fit is within a few percent of the truth.
    assert pooled.kappa < 1.2 * SMALL.window_s
    assert all(lvl["utilisation"] <= 1.0 for lvl in pooled.levels)


def test_replayed_bursts_lower_kappa_against_poisson_arrivals() -> None:
    lengths = np.full(50, 2048)
    gaps = np.array([0.0] * 49 + [1.0])  # bursts of 50 at once, then a pause
    kw = dict(rng=np.random.default_rng(0), ramp=SMALL)
    poisson = measure_kappa(DEFAULT_PROFILE, NoisyGroundTruth(1), 2, lengths, **kw)
    kw = dict(rng=np.random.default_rng(0), ramp=SMALL)
    bursty = measure_kappa(DEFAULT_PROFILE, NoisyGroundTruth(1), 2, lengths,
                           arrival_gaps=gaps, **kw)
    assert bursty.kappa < 0.5 * poisson.kappa


def test_replay_with_even_gaps_is_a_steady_stream() -> None:
    # Evenly spaced arrivals queue less than Poisson ones: κ at least as high.
    lengths = np.full(50, 2048)
    even = measure_kappa(DEFAULT_PROFILE, NoisyGroundTruth(1), 2, lengths,
                         rng=np.random.default_rng(0), ramp=SMALL, arrival_gaps=np.ones(50))
    poisson = measure_kappa(DEFAULT_PROFILE, NoisyGroundTruth(1), 2, lengths,
                            rng=np.random.default_rng(0), ramp=SMALL)
    assert even.kappa >= poisson.kappa


@pytest.mark.parametrize("gaps", [[-1.0, 1.0], [0.0, 0.0], [float("nan"), 1.0], []])
def test_bad_arrival_gaps_are_rejected(gaps: list[float]) -> None:
    with pytest.raises(InvalidInput, match="arrival_gaps"):
        measure_kappa(DEFAULT_PROFILE, NoisyGroundTruth(1), 2, [1024, 2048],
                      rng=np.random.default_rng(0), ramp=SMALL, arrival_gaps=gaps)


def test_history_reuse_is_the_longest_prefix_an_earlier_request_had() -> None:
    reqs = [
        Request("a", 0.0, 1024, 1, (1, 2)),
        Request("b", 1.0, 1536, 1, (1, 2, 3)),  # two blocks of a
        Request("c", 2.0, 1000, 1, (9,)),  # new
        Request("d", 3.0, 1100, 1, (1, 8)),  # a's first block only
        Request("e", 4.0, 1024, 1, (1, 2)),  # all of a again: one token is still computed
        Request("f", 5.0, 300, 1, ()),  # shorter than a block: nothing to reuse
        Request("g", 6.0, 1024, 1, (9, 5)),  # c's block, then a new one
    ]
    assert history_reuse(Workload("w", tuple(reqs))) == [0, 1024, 0, 512, 1023, 0, 512]
    assert history_reuse(Workload("empty", ())) == []


def test_cached_requests_leave_slack_for_queueing() -> None:
    # 6K-token prompts (1 s deadline) on CP2: uncached their prefill eats most of the deadline;
    # with 5.5K of them cached the same pool queues much more before missing it.
    lengths = np.full(60, 6144)
    cold = measure_kappa(DEFAULT_PROFILE, NoisyGroundTruth(1), 2, lengths,
                         rng=np.random.default_rng(0), ramp=SMALL)
    warm = measure_kappa(DEFAULT_PROFILE, NoisyGroundTruth(1), 2, lengths,
                         rng=np.random.default_rng(0), ramp=SMALL, reused=np.full(60, 5632))
    assert cold.status == warm.status == "ok"
    assert warm.kappa > 1.5 * cold.kappa
    # Load is predicted service with the reuse: the same load is many more cached requests.
    assert warm.levels[0]["rate_req_per_s"] > 3 * cold.levels[0]["rate_req_per_s"]


@pytest.mark.parametrize("reused", [[0], [0, -1], [0, 2048], [0.5, 0], [[0, 0]]])
def test_bad_reuse_is_rejected(reused: list[object]) -> None:
    with pytest.raises(InvalidInput, match="reused"):
        measure_kappa(DEFAULT_PROFILE, NoisyGroundTruth(1), 2, [1024, 2048],
                      rng=np.random.default_rng(0), ramp=SMALL, reused=np.array(reused))


def test_a_replayed_trace_keeps_its_order() -> None:
    # The same lengths at the same even gaps: long prompts in runs of 6 load a pool of 2 far
    # more unevenly than the same prompts spread out one in 10. Drawn independently (the old
    # ramp) both orders were one mix and gave one κ.
    runs = np.array(([32768] * 6 + [1024] * 54) * 2)
    spread = np.array(([32768] + [1024] * 9) * 12)
    assert sorted(runs) == sorted(spread)
    ramp = KappaRamp(min_requests_per_level=400, load_step=0.1, pool_workers=2)
    kw = dict(ramp=ramp, arrival_gaps=np.ones(runs.size))
    k_runs = measure_kappa(DEFAULT_PROFILE, NoisyGroundTruth(1), 4, runs,
                           rng=np.random.default_rng(0), **kw)
    k_spread = measure_kappa(DEFAULT_PROFILE, NoisyGroundTruth(1), 4, spread,
                             rng=np.random.default_rng(0), **kw)
    assert k_runs.kappa < 0.8 * k_spread.kappa


def test_trace_kappa_is_deterministic_and_follows_the_trace() -> None:
    ramp = KappaRamp(min_requests_per_level=400, load_step=0.1, pool_workers=2)
    calm = _bursty(40, 1, 1.0, name="calm")
    burst = _bursty(4, 10, 10.0)  # same lengths and request count, same mean rate
    a, rep = trace_kappa(DEFAULT_PROFILE, calm, degrees=(2, 4), seed=3, ramp=ramp)
    b, _ = trace_kappa(DEFAULT_PROFILE, calm, degrees=(2, 4), seed=3, ramp=ramp)
    c, _ = trace_kappa(DEFAULT_PROFILE, burst, degrees=(2, 4), seed=3, ramp=ramp)
    assert a == b and set(a.kappa) == {2, 4} and a.window_s == ramp.window_s
    assert a.coefficients == DEFAULT_PROFILE.coefficients  # only κ changes
    assert a.kappa_pooled and not DEFAULT_PROFILE.kappa_pooled  # a pool's capacity
    assert rep["workload"] == "calm" and rep["requests"] == 40
    assert rep["replay_arrivals"] is True and set(rep["results"]) == {"2", "4"}
    # _bursty repeats one prompt: every request after the first reuses all but one token.
    assert rep["reused_token_share"] == pytest.approx((39 * 2047) / (40 * 2048))
    assert all(c.kappa[d] < a.kappa[d] for d in (2, 4))
    with pytest.raises(InvalidInput, match="no requests"):
        trace_kappa(DEFAULT_PROFILE, Workload("empty", ()), degrees=(2,), ramp=ramp)


def test_cached_trace_kappa_reuses_its_file(tmp_path: Path) -> None:
    ramp = KappaRamp(min_requests_per_level=400, load_step=0.1, pool_workers=2)
    wl = _bursty(30, 2, 1.0)
    first, rep1 = cached_trace_kappa(DEFAULT_PROFILE, wl, tmp_path, degrees=(2,), ramp=ramp)
    files = list(tmp_path.glob("kappa_*.json"))
    assert len(files) == 1 and rep1["cached"] is False
    assert files[0].name == f"kappa_{rep1['key']}.json"
    again, rep2 = cached_trace_kappa(DEFAULT_PROFILE, wl, tmp_path, degrees=(2,), ramp=ramp)
    assert rep2["cached"] is True and again == first
    # Anything κ depends on changes the key: the trace, the degrees, the seed, the ramp.
    key = trace_kappa_key(DEFAULT_PROFILE, wl, degrees=(2,), seed=0, ramp=ramp)
    assert key == rep1["key"]
    assert key != trace_kappa_key(DEFAULT_PROFILE, _bursty(30, 2, 2.0), degrees=(2,), seed=0,
                                  ramp=ramp)
    assert key != trace_kappa_key(DEFAULT_PROFILE, wl, degrees=(2, 4), seed=0, ramp=ramp)
    assert key != trace_kappa_key(DEFAULT_PROFILE, wl, degrees=(2,), seed=1, ramp=ramp)
    assert key != trace_kappa_key(DEFAULT_PROFILE, wl, degrees=(2,), seed=0, ramp=SMALL)
    # Same lengths and arrivals, other block identities: other reuse, another key.
    fresh = Workload("bursty", tuple(replace(r, block_hashes=(1000 + i, 2000 + i, 3000 + i,
                                                              4000 + i))
                                     for i, r in enumerate(wl.requests)))
    assert key != trace_kappa_key(DEFAULT_PROFILE, fresh, degrees=(2,), seed=0, ramp=ramp)
    # A damaged file (what a write cut short used to leave: the file is written atomically
    # now) is the cache's own: measured again and replaced. Before, every later run into the
    # same --out failed on it, naming a file the user never gave.
    files[0].write_text("{not json")
    third, rep3 = cached_trace_kappa(DEFAULT_PROFILE, wl, tmp_path, degrees=(2,), ramp=ramp)
    assert third == first and rep3["cached"] is False and "measured again" in rep3["damaged_cache"]
    assert json.loads(files[0].read_text())["key"] == key
    assert [p.name for p in tmp_path.iterdir()] == [files[0].name]  # no temporary file left


def test_simulate_without_a_profile_measures_kappa_on_the_trace(tmp_path: Path) -> None:
    wl = truncate(generate(steady(120.0, 3.0, 0.05), seed=0), max_requests=200)
    kw = dict(trace="synthetic", policies=["vertumnus"], rate_scales=[1.0], gpus=8,
              degrees=(2, 4), workload=wl)
    first = runner.run_simulate(out=tmp_path / "a", **kw)
    meta = first["meta"]["kappa"]
    assert meta["source"] == "trace" and meta["kappa_scale"] == 1.0 and meta["cached"] is False
    assert meta["replay_arrivals"] is True
    prof_dir = tmp_path / "a" / "profile"
    cache = json.loads((prof_dir / f"kappa_{meta['cache_key']}.json").read_text())
    saved = json.loads((prof_dir / "profile.json").read_text())
    assert saved["kappa"] == cache["kappa"] == first["meta"]["profile"]["kappa"]
    assert set(saved["kappa"]) == {"2", "4"}
    # A second sweep into the same directory reads κ back and runs identically.
    second = runner.run_simulate(out=tmp_path / "a", **kw)
    assert second["meta"]["kappa"]["cached"] is True
    assert [r["mean_ttft_s"] for r in second["rows"]] == [r["mean_ttft_s"] for r in first["rows"]]
    # An explicit kappa_scale still wins.
    third = runner.run_simulate(out=tmp_path / "a", spec_overrides={"kappa_scale": 2.0}, **kw)
    assert third["meta"]["kappa"]["kappa_scale"] == 2.0
    # The profile the sweep wrote says its κ is pooled: given back with --profile it is judged
    # as it is (scale 1, not the single-worker pool factor), so the sweep runs the same.
    assert saved["kappa_pooled"] is True
    again = runner.run_simulate(out=tmp_path / "b", profile_path=prof_dir / "profile.json", **kw)
    assert again["meta"]["kappa"]["kappa_scale"] == 1.0
    assert [r["mean_ttft_s"] for r in again["rows"]] == [r["mean_ttft_s"] for r in first["rows"]]
    # A single worker's κ (vertumnus profile) gets the calibrated pool factor.
    single = tmp_path / "single.json"
    replace(Profile.load(prof_dir / "profile.json"), kappa_pooled=False).save(single)
    fourth = runner.run_simulate(out=tmp_path / "c", profile_path=single, **kw)
    assert fourth["meta"]["kappa"]["kappa_scale"] == calibration.KAPPA_SCALE


def test_a_small_pool_measures_kappa_on_as_many_workers_as_it_holds() -> None:
    """κ of degree C comes from a routed pool of min(ramp's workers, GPUs / C): a pool of 8
    GPUs has 2 CP4 workers, and 2 workers sustain less per worker than 4 (fewer lanes to route
    around a long request), so an 8-GPU pool must not be judged with a 4-worker κ."""
    from sim.profiling import ramp_pools

    ramp = KappaRamp(min_requests_per_level=400, load_step=0.1, pool_workers=4)
    assert ramp_pools(ramp, (2, 4), None) == {2: 4, 4: 4}
    assert ramp_pools(ramp, (2, 4), 40) == {2: 4, 4: 4}
    assert ramp_pools(ramp, (2, 4), 8) == {2: 4, 4: 2}
    assert ramp_pools(ramp, (2, 4), 4) == {2: 2, 4: 1}
    # A pool of 2 GPUs has no CP4 worker: κ_4 is not measured on one it never has.
    with pytest.raises(InvalidInput, match="a pool of 2 GPUs has no worker of degree 4"):
        ramp_pools(ramp, (2, 4), 2)
    assert ramp_pools(ramp, (2,), 2) == {2: 1}
    with pytest.raises(InvalidInput, match="pool_gpus"):
        ramp_pools(ramp, (2,), 0)
    # Short prompts with a long one every tenth: a long prefill blocks its worker's FIFO,
    # and the fewer the workers the more short ones wait behind it.
    wl = Workload("mix", tuple(
        Request(f"r{i}", i * 0.5, n, 1, tuple(range(n // 512)))
        for i, n in enumerate(32768 if i % 10 == 0 else 2048 for i in range(200))))
    wide, rep_wide = trace_kappa(DEFAULT_PROFILE, wl, degrees=(4,), ramp=ramp, pool_gpus=16)
    narrow, rep = trace_kappa(DEFAULT_PROFILE, wl, degrees=(4,), ramp=ramp, pool_gpus=8)
    assert rep_wide["pool_workers"] == {"4": 4} and rep["pool_workers"] == {"4": 2}
    assert narrow.kappa[4] < wide.kappa[4]
    # A pool the ramp's own size keeps the key it always had; a smaller one changes it.
    key = trace_kappa_key(DEFAULT_PROFILE, wl, degrees=(4,), seed=0, ramp=ramp)
    assert trace_kappa_key(DEFAULT_PROFILE, wl, degrees=(4,), seed=0, ramp=ramp,
                           pool_gpus=16) == key
    assert trace_kappa_key(DEFAULT_PROFILE, wl, degrees=(4,), seed=0, ramp=ramp,
                           pool_gpus=8) != key


def test_run_profile_refuses_kappa_degrees_it_does_not_fit(tmp_path: Path) -> None:
    """κ is measured with the Ê fitted on ``degrees``: a κ degree outside them is refused
    before anything is written."""
    from sim.profiling import run_profile

    with pytest.raises(InvalidInput, match=r"κ degrees \[8\] are not among"):
        run_profile(tmp_path / "p", degrees=(1, 2), kappa_degrees=(2, 8), kappa_pool_gpus=8)
    assert not (tmp_path / "p").exists()


def test_kappa_is_measured_on_the_sweeps_hardware(tmp_path: Path) -> None:
    """κ on the trace is measured on the ground truth the sweep runs (its hardware), as Ê is
    fitted on it; before, the cached ramp always ran the default H20 truth, so a sweep of
    another GPU judged capacity by the wrong machine's κ. The hardware is in the cache key
    (the default's key is unchanged: caches written before stay valid)."""
    from sim.groundtruth import H200, GroundTruth, Surroundings

    ramp = KappaRamp(min_requests_per_level=400, load_step=0.1, pool_workers=2)
    wl = _bursty(30, 2, 1.0)
    h200 = GroundTruth(gpu=H200)
    got, _ = cached_trace_kappa(DEFAULT_PROFILE, wl, tmp_path, degrees=(2,), ramp=ramp,
                                truth=h200)
    want, _ = trace_kappa(DEFAULT_PROFILE, wl, degrees=(2,), ramp=ramp, truth=h200)
    assert got.kappa == want.kappa
    default, _ = trace_kappa(DEFAULT_PROFILE, wl, degrees=(2,), ramp=ramp)
    assert want.kappa != default.kappa  # the test can tell the two machines apart
    key = trace_kappa_key(DEFAULT_PROFILE, wl, degrees=(2,), seed=0, ramp=ramp)
    assert key == trace_kappa_key(DEFAULT_PROFILE, wl, degrees=(2,), seed=0, ramp=ramp,
                                  truth=GroundTruth())
    slow_decode = GroundTruth(surroundings=Surroundings(first_decode_s=0.3))
    assert len({key, trace_kappa_key(DEFAULT_PROFILE, wl, degrees=(2,), seed=0, ramp=ramp,
                                     truth=h200),
                trace_kappa_key(DEFAULT_PROFILE, wl, degrees=(2,), seed=0, ramp=ramp,
                                truth=slow_decode)}) == 3
