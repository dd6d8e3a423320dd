"""`vertumnus profile` on the simulated backend: measure, fit Ê_C, measure κ_C, write files.

1. **Measure** queue-free prefill times of the (R, P, C) grid of ground-truth.md — R powers of
   two 1K..128K, P ∈ {0, 2K, 8K, 32K, 64K}, C ∈ {1, 2, 4, 8} — on the *noisy* ground truth,
   exactly as one would time a real engine.
2. **Fit** Eq. 2 with one coefficient set (shared.costmodel.fit_profile) and report its error
   against the measurements and against the noise-free ground truth, overall and per degree,
   with a predicted-vs-measured scatter plot (the paper's Figure 4a).
3. **κ_C by a load ramp**: one degree-C worker serves a Poisson stream of requests whose input
   lengths are drawn from a workload, FIFO, with ground-truth service times, at increasing
   offered load. Per window of H seconds we record the demand D (Σ Ê_C of the requests that
   arrived in it, s) and the token-weighted TTFT SLO attainment of those requests, with
   TTFT = queueing + prefill + KV handoff + first decode. κ_C is the largest demand per window
   at which attainment still meets the target (default 90%), interpolated between the last
   passing and the first failing load level. Requests are served uncached (P = 0): κ is a
   capacity in *predicted seconds*, and the controller's demand is measured in the same unit
   whatever the cache saves.

4. **κ on a trace** (:func:`trace_kappa`, what ``vertumnus simulate`` does when no profile file
   is given): the same ramp, but with a routed pool of workers replaying the simulated trace
   itself — its requests in order, each with the prefix reuse its history showed, at its own
   arrival pattern — see :data:`TRACE_KAPPA_RAMP` and :func:`measure_kappa` for why.

The scheduler only ever gets the resulting profile file, never the ground truth.
"""

from __future__ import annotations

import csv
import heapq
import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Final

import numpy as np

from shared.costmodel import Profile, Sample, fit_profile, mape
from shared.files import write_text_atomic
from shared.ids import InvalidInput
from sim.groundtruth import DEFAULT_GROUND_TRUTH, GroundTruth, Kind, NoisyGroundTruth
from sim.hardware import ground_truth_to_mapping
from sim.metrics import QWEN3_SLO, SloTable, slo_to_dict
from sim.workloads import Workload, generate, load_workload, workload_stats
from sim.workloads.workload import history_reuse

PROFILE_R: Final[tuple[int, ...]] = tuple(1 << i for i in range(10, 18))
PROFILE_P: Final[tuple[int, ...]] = (0, 2048, 8192, 32768, 65536)
PROFILE_DEGREES: Final[tuple[int, ...]] = (1, 2, 4, 8)
# The note's fit of the noise-free truth, for comparison in the report.
NOTE_COEFFICIENTS: Final[dict[str, float]] = {
    "d": 0.091,
    "a": 52.8e-6,
    "b": 6.9e-6,
    "c": 24.4e-6,
    "alpha": 6.63e-9,
}

PROFILE_FILE: Final[str] = "profile.json"
REPORT_FILE: Final[str] = "profile_report.json"
PLOT_FILE: Final[str] = "profile_fit.png"
SAMPLES_FILE: Final[str] = "profile_samples.csv"


def hardware_fingerprint(truth: GroundTruth) -> str:
    """A digest of every figure of the simulated hardware ``truth`` (16 hex digits of the
    SHA-256 of :func:`~sim.hardware.ground_truth_to_mapping` as canonical JSON: sorted keys,
    no spaces, every number as a float by its shortest repr), recorded in the profiles fitted
    on it (:attr:`shared.costmodel.Profile.hardware_fingerprint`).

    Equal tables give equal digests, whatever file, key order or number spelling they were
    written in (``96e9`` and ``96000000000`` are one figure, as :class:`GroundTruth`'s equality
    has it); a table that changes any figure (a GPU's FLOP rate, the model's layers, a
    calibration) gives another one while its ``model.name`` and ``gpu.name`` may stay the
    default's."""
    import hashlib

    def canon(v: Any) -> Any:
        if isinstance(v, dict):
            return {str(k): canon(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [canon(x) for x in v]
        if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool):
            return float(v)
        return v

    text = json.dumps(canon(ground_truth_to_mapping(truth)), sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _check_degrees(degrees: Sequence[int]) -> tuple[int, ...]:
    degs = tuple(sorted(set(int(d) for d in degrees)))
    if not degs or any(d < 1 for d in degs):
        raise InvalidInput(f"degrees must be a non-empty set of integers >= 1, got {degrees!r}")
    return degs


def profile_grid(
    degrees: Sequence[int] = PROFILE_DEGREES,
    r_values: Sequence[int] = PROFILE_R,
    p_values: Sequence[int] = PROFILE_P,
) -> list[tuple[int, int, int]]:
    """The (R, P, C) points to measure, in a fixed order."""
    return [(r, p, c) for c in _check_degrees(degrees) for r in r_values for p in p_values]


def measure_samples(
    truth: NoisyGroundTruth,
    grid: Sequence[tuple[int, int, int]],
    *,
    repeats: int = 1,
    kind: Kind = "cp",
) -> list[Sample]:
    """Time every grid point ``repeats`` times on the noisy ground truth."""
    if repeats < 1:
        raise InvalidInput(f"repeats must be >= 1, got {repeats}")
    return [
        Sample(r, p, c, truth.prefill_time(r, p, c, kind=kind))
        for _ in range(repeats)
        for r, p, c in grid
    ]


def score_against_truth(
    profile: Profile, grid: Sequence[tuple[int, int, int]], truth: GroundTruth, *, kind: Kind = "cp"
) -> dict[str, Any]:
    """MAPE of the profile against the noise-free ground truth, overall, per degree, worst."""
    exact = [Sample(r, p, c, truth.prefill_time(r, p, c, kind=kind)) for r, p, c in grid]
    overall, per = mape(profile, exact)
    worst = max(
        exact, key=lambda s: abs(profile.predict(s.r, s.p, s.degree) - s.seconds) / s.seconds
    )
    worst_err = abs(profile.predict(worst.r, worst.p, worst.degree) - worst.seconds) / worst.seconds
    return {
        "mape": overall,
        "mape_per_degree": {str(c): m for c, m in per.items()},
        "worst": {"r": worst.r, "p": worst.p, "degree": worst.degree, "error": worst_err},
    }


def plot_fit(
    profile: Profile, samples: Sequence[Sample], path: str | Path, *, title: str = ""
) -> Path:
    """Log-log scatter of predicted vs measured prefill time, one colour per degree."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.0, 4.5), dpi=120)
    lo, hi = math.inf, 0.0
    for c in sorted({s.degree for s in samples}):
        meas = np.array([s.seconds for s in samples if s.degree == c])
        pred = np.array([profile.predict(s.r, s.p, s.degree) for s in samples if s.degree == c])
        ax.scatter(meas, pred, s=12, alpha=0.75, label=f"C={c}")
        lo, hi = min(lo, meas.min(), pred.min()), max(hi, meas.max(), pred.max())
    line = np.array([lo * 0.8, hi * 1.25])
    ax.plot(line, line, "k-", lw=0.8, label="y = x")
    ax.plot(line, line * 1.15, "k:", lw=0.6, label="±15%")
    ax.plot(line, line / 1.15, "k:", lw=0.6)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("Measured prefill time (s)")
    ax.set_ylabel("Predicted prefill time (s)")
    ax.set_title(title or f"Ê_C fit, MAPE {100 * (profile.fit_mape or math.nan):.1f}%", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out)
    plt.close(fig)
    return out


# --- κ by load ramp ------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class KappaRamp:
    """Load-ramp settings. Offered load ρ = arrival rate × mean predicted service time."""

    window_s: float = 20.0
    windows_per_level: int = 30
    """Minimum windows simulated per load level."""
    min_requests_per_level: int = 1500
    """Levels are lengthened (in whole windows) until this many requests arrive on average,
    so attainment at light load is not decided by a handful of requests."""
    warmup_windows: int = 2
    """Leading windows of each level left out (the queue starts empty)."""
    target: float = 0.9
    load_start: float = 0.05
    load_step: float = 0.05
    load_max: float = 1.5
    slo: SloTable = QWEN3_SLO
    pool_workers: int = 1
    """Degree-C workers served together in the ramp. 1 is §6.1's single worker. With n > 1 each
    request goes to the worker whose queue (ground-truth backlog) drains first — an idealised
    load-aware router, what the J scheduler approximates — and κ_C is the largest window
    demand *per worker* at target. See :func:`measure_kappa` for why this matters."""

    def __post_init__(self) -> None:
        if self.pool_workers < 1:
            raise InvalidInput(f"pool_workers must be >= 1, got {self.pool_workers}")
        if not (self.window_s > 0 and self.windows_per_level > self.warmup_windows >= 0):
            raise InvalidInput("need window_s > 0 and windows_per_level > warmup_windows >= 0")
        if self.min_requests_per_level < 1:
            raise InvalidInput("min_requests_per_level must be >= 1")
        if not 0 < self.target <= 1:
            raise InvalidInput(f"SLO attainment target must be in (0, 1], got {self.target}")
        if not 0 < self.load_start <= self.load_max or self.load_step <= 0:
            raise InvalidInput("need 0 < load_start <= load_max and load_step > 0")


@dataclass(frozen=True, slots=True)
class KappaResult:
    """κ_C (s of predicted service per window) and the ramp it came from.

    ``status``: "ok" (target crossed; κ interpolated between the last passing and the first
    failing level), "ceiling" (target met up to load_max; κ is a lower bound), "never_met"
    (missed even at the lightest load; κ = that level's demand × attainment / target, a
    pessimistic stand-in), "infeasible" (no length of the workload meets its deadline on an
    idle degree-C worker; κ = 1e-6). ``excluded_token_share``: input tokens of lengths left
    out because an idle degree-C worker misses their deadline anyway (they are the larger
    degrees' work).
    """

    degree: int
    kappa: float
    status: str
    excluded_token_share: float
    levels: tuple[dict[str, float], ...]

    def as_dict(self) -> dict[str, Any]:
        return {
            "degree": self.degree,
            "kappa": self.kappa,
            "status": self.status,
            "excluded_token_share": self.excluded_token_share,
            "levels": list(self.levels),
        }


def _ramp_level(
    profile: Profile,
    truth: NoisyGroundTruth,
    degree: int,
    lengths: np.ndarray,
    load: float,
    mean_pred: float,
    ramp: KappaRamp,
    rng: np.random.Generator,
    kind: Kind,
    gaps: np.ndarray | None = None,
    feasible: np.ndarray | None = None,
    reused: np.ndarray | None = None,
) -> dict[str, float]:
    """One load level: ``ramp.pool_workers`` FIFO workers of degree C, each arrival sent to
    the one that frees first; windows indexed by each request's completion; demand reported
    per worker. ``load`` is per worker (arrival rate × mean predicted service / workers).

    Without ``gaps``: Poisson arrivals, lengths drawn independently from ``lengths``. With
    ``gaps`` (mean-1 inter-arrival gaps of a trace, in order) the trace is replayed from a
    random offset, cyclically, scaled to the level's rate: request k has length
    ``lengths[k]`` and arrives ``gaps[k]`` after the one before. ``reused[k]`` (default 0) of
    its tokens are cached: it is served and counted in demand as Ê_C(L − P, P), its deadline
    is its whole length's. A request that is not ``feasible`` at this degree keeps its arrival
    slot but is not served here."""
    n_pool = ramp.pool_workers
    rate = load * n_pool / mean_pred
    n_windows = max(
        ramp.windows_per_level, math.ceil(ramp.min_requests_per_level / (rate * ramp.window_s))
    )
    horizon = ramp.window_s * n_windows
    demand = np.zeros(n_windows + 1)
    tok_all = np.zeros(n_windows + 1)
    tok_ok = np.zeros(n_windows + 1)
    busy = 0.0
    free = [0.0] * n_pool  # a heap of the workers' free times (all equal at the start)
    served = 0
    n_len = len(lengths)
    idx = int(rng.integers(len(gaps))) if gaps is not None else 0
    t = rng.exponential(1.0 / rate) if gaps is None else 0.0
    while t < horizon:
        if gaps is not None:
            j = idx % n_len
            t_next = t + float(gaps[idx % len(gaps)]) / rate
            idx += 1
            if feasible is not None and not feasible[j]:
                t = t_next
                continue
        else:
            j = int(rng.integers(n_len))
        length = int(lengths[j])
        p = 0 if reused is None else int(reused[j])
        service = truth.prefill_time(length - p, p, degree, kind=kind)
        free_at = max(t, free[0]) + service
        heapq.heapreplace(free, free_at)
        busy += service
        ttft = free_at - t + truth.external_time(length, degree)
        # Requests finishing after the horizon count in the overflow window (never scored).
        w = min(int(free_at // ramp.window_s), n_windows)
        demand[w] += profile.predict_fast(length - p, p, degree)
        tok_all[w] += length
        if ttft <= ramp.slo.deadline(length):
            tok_ok[w] += length
        served += 1
        t = t_next if gaps is not None else t + rng.exponential(1.0 / rate)
    kept = slice(ramp.warmup_windows, n_windows)
    scored = tok_all[kept].sum()
    return {
        "load": load,
        "rate_req_per_s": rate,
        "windows": n_windows - ramp.warmup_windows,
        "requests": served,
        "demand_mean_s": float(demand[kept].mean()) / n_pool,
        "demand_p90_s": float(np.percentile(demand[kept], 90)) / n_pool,
        "attainment": float(tok_ok[kept].sum() / scored) if scored else 1.0,
        "utilisation": busy / (horizon * n_pool),
    }


def measure_kappa(
    profile: Profile,
    truth: NoisyGroundTruth,
    degree: int,
    lengths: Sequence[int] | np.ndarray,
    *,
    rng: np.random.Generator,
    ramp: KappaRamp = KappaRamp(),
    kind: Kind = "cp",
    arrival_gaps: Sequence[float] | np.ndarray | None = None,
    reused: Sequence[int] | np.ndarray | None = None,
) -> KappaResult:
    """κ_C of one degree-C worker (per worker of a ``ramp.pool_workers`` pool) for a length
    distribution (see the module docstring).

    ``arrival_gaps`` (optional, a trace's inter-arrival gaps in order) makes the ramp replay the
    trace itself, scaled in rate, instead of Poisson arrivals with independent lengths: the
    requests in their order (``lengths`` in arrival order) at the trace's own gaps, so κ
    reflects the traffic's burstiness and which requests come together, not only its length
    mix. ``reused`` (optional, parallel to ``lengths``): tokens of each request already cached
    (e.g. :func:`sim.workloads.workload.history_reuse`); each is served and counted as
    Ê_C(L − P, P), with the deadline of its whole length. Default: all uncached.

    Why both, on a trace: consecutive requests are correlated through shared prefixes (L-Eval's
    questions on one document come together; a conversation's turns follow each other), and
    runs of long first reads and runs of short cached follow-ups load a small pool very
    unevenly. Drawn independently and served uncached, the same lengths spread that work
    evenly: on L-Eval ×2 (81% of tokens reused) an 8-GPU pool's κ_4 came out 13.0 s per window,
    where the simulated all-CP4 pool already misses the target at a demand of 9.5 s; replayed
    in order with its reuse, 10.3 s. (Serving the lengths uncached in order would count each
    cached burst as a burst of full prefills; the reuse is what makes the order usable.)
    """
    lens = np.asarray(lengths, dtype=np.int64)
    if lens.size == 0 or (lens < 1).any():
        raise InvalidInput("kappa ramp needs a non-empty set of input lengths >= 1")
    reu = np.zeros_like(lens)
    if reused is not None:
        reu = np.asarray(reused)
        if reu.shape != lens.shape or not np.issubdtype(reu.dtype, np.integer) \
                or (reu < 0).any() or (reu >= lens).any():
            raise InvalidInput("reused must give, for each length L, an integer 0 <= P < L")
        reu = reu.astype(np.int64)
    gaps: np.ndarray | None = None
    if arrival_gaps is not None:
        gaps = np.asarray(arrival_gaps, dtype=float)
        if gaps.ndim != 1 or gaps.size == 0 or (gaps < 0).any() or not np.isfinite(gaps).all() \
                or gaps.sum() <= 0:
            raise InvalidInput("arrival_gaps must be finite gaps >= 0, not all 0")
        gaps = gaps / gaps.mean()
    # Lengths an idle degree-C worker cannot serve within their deadline say nothing about
    # its capacity; the scheduler sends them to larger degrees.
    feasible = np.array(
        [
            truth.noise_free(int(x - r), int(r), degree, kind=kind)
            + truth.external_time(int(x), degree) <= ramp.slo.deadline(int(x))
            for x, r in zip(lens, reu, strict=True)
        ]
    )
    excluded = float(lens[~feasible].sum() / lens.sum())
    if not feasible.any():
        return KappaResult(degree, 1e-6, "infeasible", excluded, ())
    mean_pred = float(np.mean([profile.predict_fast(int(x - r), int(r), degree)
                               for x, r in zip(lens[feasible], reu[feasible], strict=True)]))
    if gaps is None:
        lens, reu = lens[feasible], reu[feasible]
    else:
        # Replay keeps every arrival slot; the level's rate counts all of them, so the mean
        # predicted service per arrival counts the excluded ones as 0.
        mean_pred *= float(feasible.mean())
    levels: list[dict[str, float]] = []
    load = ramp.load_start
    while load <= ramp.load_max + 1e-9:
        lvl = _ramp_level(profile, truth, degree, lens, load, mean_pred, ramp, rng, kind,
                          gaps, None if gaps is None else feasible, reu)
        levels.append(lvl)
        if lvl["attainment"] < ramp.target:
            break
        load = round(load + ramp.load_step, 10)
    last = levels[-1]
    if last["attainment"] >= ramp.target:
        return KappaResult(degree, last["demand_mean_s"], "ceiling", excluded, tuple(levels))
    if len(levels) == 1:
        kappa = last["demand_mean_s"] * last["attainment"] / ramp.target
        return KappaResult(degree, max(kappa, 1e-6), "never_met", excluded, tuple(levels))
    ok, bad = levels[-2], levels[-1]
    frac = (ok["attainment"] - ramp.target) / (ok["attainment"] - bad["attainment"])
    kappa = ok["demand_mean_s"] + frac * (bad["demand_mean_s"] - ok["demand_mean_s"])
    return KappaResult(degree, kappa, "ok", excluded, tuple(levels))


# --- κ on the simulated trace's own traffic ------------------------------------------------
TRACE_KAPPA_RAMP: Final[KappaRamp] = KappaRamp(
    pool_workers=8, windows_per_level=90, min_requests_per_level=3000
)
"""The ramp of :func:`trace_kappa`: a routed pool of 8 degree-C workers, 90-window levels.

Why a pool and not §6.1's single worker. A single FIFO worker has no one to route around a
burst or a long request, so its κ is far below what the same worker sustains behind a
load-aware router, and *by how much* depends on the traffic (figures measured when the ramp
still drew lengths independently and served them uncached): on the conversation mix single
κ_2/κ_4 were 5.4/7.2 s per 20 s window and a pool of 8 sustains 15.4/18.6 (×2.9/×2.6); on the
Azure code mix (all short, Poisson arrivals) 8.2/11.1 vs 16.4/18.1 (×2.0/×1.6). One
calibrated factor (sim/calibration.py KAPPA_SCALE 2.2, fitted on the conversation trace) over-
rates the short mix and skews κ_4/κ_2 (1.35 single, 1.1 pooled) toward CP4. A pooled ramp
measures the pooled capacity directly, so the controller judges with κ as measured (scale
1.0). 8 workers: fewer than the 10-20 of a homogeneous 40-GPU pool, because a mixed
composition has fewer of each degree and per-worker capacity grows with the pool (4 workers:
conversation 13.1/16.1). 90-window levels: bursts of a trace are rare events; 30-window levels
left a 3-seed spread of ±17% on the Azure trace, 90 ±6%."""


def _trace_arrays(workload: Workload) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Input lengths, inter-arrival gaps (s) and history reuse (tokens) of ``workload`` in
    arrival order."""
    if not workload.requests:
        raise InvalidInput(f"workload {workload.name!r} has no requests to measure kappa on")
    lengths = np.array([r.input_len for r in workload.requests], dtype=np.int64)
    arrivals = np.array([r.arrival_s for r in workload.requests], dtype=float)
    gaps = np.diff(arrivals)
    if gaps.size == 0 or gaps.sum() <= 0:
        gaps = np.ones(1)  # a single instant: no arrival pattern to replay, Poisson-like
    return lengths, gaps, np.array(history_reuse(workload), dtype=np.int64)


KAPPA_REPEATS: Final[int] = 9
"""Single-worker κ ramps per degree whose median is κ_C (``run_profile``'s default).

Why: one ramp's κ is a threshold on a noisy curve, 7-21% off on a fixed workload (nine draws
on the reconfiguration preset's profile: sd 0.39 / 0.60 / 0.55 s for κ_1 / κ_2 / κ_4 on
seed 0), and the ramps of all degrees used to share one noise and one arrival stream, so κ_C
depended on which degrees were measured before it. The reconfiguration preset's reactions
rested on that draw: with another single draw (streams per degree) seed 4 reacted to a phase
change only in the sixth window. With the median of nine ramps on streams of their own, every
seed 0-14 reacts within three windows (seeds 6 and 13 no longer reconfigure in S1) and every
phase stays within 4.2% of the better fixed pool (docs/evaluation.md "κ as the median of nine
ramps", 2026-12-02, session 33). Nine: an odd count (a plain median) that takes a profile from
1.6 s to 3.9 s (`vertumnus profile`, four degrees). 1 reproduces the single shared-stream draw
of the figures measured before."""


def _ramp_streams(seed: int, degree: int, repeat: int, noise_sigma: float,
                  truth: GroundTruth) -> tuple[NoisyGroundTruth, np.random.Generator]:
    """The noisy ground truth and the arrival generator of one κ ramp (``run_profile`` with
    ``kappa_repeats`` > 1): streams of their own per (seed, degree, repeat)."""
    noise = np.random.SeedSequence(seed, spawn_key=(1, degree, repeat))
    arrivals = np.random.SeedSequence(seed, spawn_key=(2, degree, repeat))
    return (NoisyGroundTruth(int(noise.generate_state(1)[0]), noise_sigma, truth),
            np.random.default_rng(arrivals))


def trace_kappa(
    profile: Profile,
    workload: Workload,
    *,
    degrees: Sequence[int],
    seed: int = 0,
    truth: GroundTruth = DEFAULT_GROUND_TRUTH,
    noise_sigma: float = 0.04,
    ramp: KappaRamp = TRACE_KAPPA_RAMP,
    replay_arrivals: bool = True,
    kind: Kind = "cp",
    pool_gpus: int | None = None,
) -> tuple[Profile, dict[str, Any]]:
    """κ_C per degree measured on ``workload``'s own traffic; returns (profile with that κ and
    ``window_s`` = the ramp's H, report).

    ``pool_gpus``: the GPUs of the pool κ is for. A routed pool sustains more per worker the
    more workers share the traffic, so degree C is measured on a pool of
    min(``ramp.pool_workers``, pool_gpus // C) workers (:func:`ramp_pools`): κ measured on 8
    workers over-rates the 2 CP4 workers of an 8-GPU pool. None: ``ramp.pool_workers``.

    §6.1: the operator profiles κ on a representative history of their traffic. Here that
    history is the trace being simulated, each request with the prefix reuse its history
    showed (:func:`sim.workloads.workload.history_reuse`): with ``replay_arrivals`` the trace
    itself — its requests in order at its inter-arrival pattern — replayed at increasing rate;
    without, Poisson arrivals of its (length, reuse) mix (see :func:`measure_kappa`; the Azure
    code trace's arrivals have a coefficient of variation of 13 — bursts of dozens of requests
    within a second — and its pooled κ is ~2 s against ~16 s under Poisson arrivals of the same
    mix). Only lengths, block identities and arrival times of the trace are used, never its
    service times, and
    the ramp is the offline profiling step: it runs the noisy ground truth as ``vertumnus
    profile --backend sim`` does; the scheduler still only gets the fitted profile.
    Deterministic for a seed (the ramp's noise and arrivals come from ``seed``'s streams, as in
    :func:`run_profile`).
    """
    degs = _check_degrees(degrees)
    lengths, gaps, reused = _trace_arrays(workload)
    _, noise_seq, arr_seq = np.random.SeedSequence(seed).spawn(3)
    k_truth = NoisyGroundTruth(int(noise_seq.generate_state(1)[0]), noise_sigma, truth)
    rng = np.random.default_rng(arr_seq)
    kappas: dict[int, float] = {}
    results: dict[str, Any] = {}
    pools = ramp_pools(ramp, degs, pool_gpus)
    for c in degs:
        res = measure_kappa(profile, k_truth, c, lengths, rng=rng,
                            ramp=replace(ramp, pool_workers=pools[c]), kind=kind,
                            arrival_gaps=gaps if replay_arrivals else None, reused=reused)
        kappas[c] = res.kappa
        results[str(c)] = res.as_dict()
    # A routed pool's capacity: the controller judges with it as it is (Profile.kappa_pooled).
    out = replace(profile.with_kappa(kappas), window_s=ramp.window_s, kappa_pooled=True)
    report = {
        "workload": workload.name,
        "requests": int(lengths.size),
        "replay_arrivals": replay_arrivals,
        "reused_token_share": float(reused.sum() / lengths.sum()),
        "seed": seed,
        "noise_sigma": noise_sigma,
        "kappa": {str(c): k for c, k in kappas.items()},
        "ramp": {k: v for k, v in asdict(ramp).items() if k != "slo"},
        "pool_workers": {str(c): n for c, n in pools.items()},
        "slo": slo_to_dict(ramp.slo),
        "results": results,
    }
    return out, report


def ramp_pools(ramp: KappaRamp, degrees: Sequence[int], pool_gpus: int | None
               ) -> dict[int, int]:
    """Workers of the routed pool κ_C is measured on, per degree: ``ramp.pool_workers``, at
    most the degree-C workers ``pool_gpus`` holds. Raises :class:`InvalidInput` for a degree
    larger than ``pool_gpus``: such a pool never has a worker of it, and a κ measured on one
    (it used to be measured on one anyway) describes no worker of the pool
    (``sim.experiments.check_pools`` refuses that pool before anything runs)."""
    if pool_gpus is not None and (isinstance(pool_gpus, bool) or not isinstance(pool_gpus, int)
                                  or pool_gpus < 1):
        raise InvalidInput(f"pool_gpus must be an integer >= 1, got {pool_gpus!r}")
    if pool_gpus is not None and (big := sorted(c for c in degrees if c > pool_gpus)):
        raise InvalidInput(f"a pool of {pool_gpus} GPUs has no worker of degree "
                           f"{', '.join(map(str, big))} to measure κ on")
    return {c: ramp.pool_workers if pool_gpus is None
            else min(ramp.pool_workers, pool_gpus // c) for c in degrees}


def trace_kappa_key(profile: Profile, workload: Workload, *, degrees: Sequence[int], seed: int,
                    ramp: KappaRamp = TRACE_KAPPA_RAMP, replay_arrivals: bool = True,
                    noise_sigma: float = 0.04, pool_gpus: int | None = None,
                    truth: GroundTruth = DEFAULT_GROUND_TRUTH) -> str:
    """A digest of everything :func:`trace_kappa`'s result depends on (the cache file name),
    ``truth`` (the hardware the ramp runs) included."""
    import hashlib

    pools = ramp_pools(ramp, _check_degrees(degrees), pool_gpus)
    # Pools the ramp's own size: the key of a cache written before pools could be smaller.
    extra: list[Any] = [] if all(n == ramp.pool_workers for n in pools.values()) else \
        [{"pools": {str(c): n for c, n in sorted(pools.items())}}]
    if truth != DEFAULT_GROUND_TRUTH:
        # Its every field: the surroundings (first decode, hand-off) change TTFT, so κ, and
        # not Ê. The default adds nothing: the key of a cache written before is kept.
        extra.append({"truth": asdict(truth)})

    lengths, gaps, reused = _trace_arrays(workload)
    h = hashlib.sha256()
    # Not the hardware's fingerprint: `truth` is in the key already (below), and a key
    # without it is the one a cache written before profiles recorded it has.
    fitted = {k: v for k, v in profile.to_dict().items()
              if k not in ("kappa", "hardware_fingerprint")}
    h.update(json.dumps([fitted, sorted(_check_degrees(degrees)), seed, noise_sigma,
                         replay_arrivals, {k: v for k, v in asdict(ramp).items() if k != "slo"},
                         [list(b) for b in ramp.slo.bounds], *extra],
                        sort_keys=True, default=str).encode())
    h.update(lengths.tobytes())
    h.update(np.round(gaps, 9).tobytes())
    # The ramp's method: the trace replayed in order with its history reuse (a cache file of
    # the earlier method, independent uncached draws, has a key without this).
    h.update(b"in-order, history reuse")
    h.update(reused.tobytes())
    return h.hexdigest()[:16]


def cached_trace_kappa(
    profile: Profile, workload: Workload, cache_dir: str | Path, *, degrees: Sequence[int],
    seed: int = 0, ramp: KappaRamp = TRACE_KAPPA_RAMP, replay_arrivals: bool = True,
    pool_gpus: int | None = None, truth: GroundTruth = DEFAULT_GROUND_TRUTH,
) -> tuple[Profile, dict[str, Any]]:
    """:func:`trace_kappa` on ``truth``'s hardware (the sweep's: Ê is fitted on it too),
    cached as ``cache_dir/kappa_<key>.json`` (the report, κ included); a later sweep of the
    same trace, profile, hardware and settings reads κ back instead of re-measuring.
    """
    key = trace_kappa_key(profile, workload, degrees=degrees, seed=seed, ramp=ramp,
                          replay_arrivals=replay_arrivals, pool_gpus=pool_gpus, truth=truth)
    path = Path(cache_dir) / f"kappa_{key}.json"
    damaged: str | None = None
    if path.is_file():
        try:
            report = json.loads(path.read_text())
            kappas = {int(c): float(k) for c, k in report["kappa"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            # Ours (named by the inputs' key), not the user's: measured again and replaced.
            damaged = f"{path.name} could not be read ({exc}); measured again"
        else:
            report["cached"] = True
            return replace(profile.with_kappa(kappas), window_s=ramp.window_s,
                           kappa_pooled=True), report
    prof, report = trace_kappa(profile, workload, degrees=degrees, seed=seed, ramp=ramp,
                               replay_arrivals=replay_arrivals, pool_gpus=pool_gpus,
                               truth=truth)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {**report, "key": key}
    write_text_atomic(path, json.dumps(report, indent=1, default=_json_default) + "\n")
    return prof, {**report, "cached": False, **({"damaged_cache": damaged} if damaged else {})}


# --- the whole command ---------------------------------------------------------------------
def run_profile(
    out_dir: str | Path,
    *,
    degrees: Sequence[int] = PROFILE_DEGREES,
    seed: int = 0,
    truth: GroundTruth = DEFAULT_GROUND_TRUTH,
    noise_sigma: float = 0.04,
    repeats: int = 1,
    kappa_workload: Workload | None = None,
    ramp: KappaRamp = KappaRamp(),
    kind: Kind = "cp",
    measure_kappas: bool = True,
    per_degree: bool = False,
    kappa_pool_gpus: int | None = None,
    kappa_repeats: int = KAPPA_REPEATS,
    kappa_degrees: Sequence[int] | None = None,
) -> tuple[Profile, dict[str, Any]]:
    """Profile the simulated backend; write profile.json, the scatter plot (+ CSV) and a report.

    ``per_degree``: fit one coefficient set per degree as well (Ê_C of each C on its own
    samples; :func:`shared.costmodel.fit_profile`), used for every degree profiled. The one
    global set (the default, as ground-truth.md fits it) cannot follow hardware whose CP
    fixed costs dominate short prompts, e.g. H200 (docs/evaluation.md).

    Returns the profile (coefficients, fit MAPE against the measurements, κ per degree with
    ``window_s`` = the ramp's H) and the report dict also written to ``profile_report.json``.
    ``kappa_workload`` supplies the κ ramp's length distribution (default: the embedded
    synthetic workload for ``seed``). Deterministic for a seed.

    ``kappa_pool_gpus``: measure κ as ``vertumnus simulate`` does on a trace
    (:func:`trace_kappa`) instead of on §6.1's single worker: a routed pool sized for a pool of
    that many GPUs (at most ``TRACE_KAPPA_RAMP.pool_workers`` workers per degree) replays
    ``kappa_workload`` in order at its own gaps, each request with its history's prefix reuse.
    That κ is a pooled capacity: the profile is marked ``kappa_pooled`` and the controller
    judges with it as it is (no calibrated pool factor); the ramp's SLO is ``ramp.slo``.

    ``kappa_repeats``: §6.1's single-worker κ_C is a threshold on a noisy curve
    (:data:`KAPPA_REPEATS`). With N > 1 (the default: nine) each degree runs N ramps on
    streams of its own (children (1, C, r) and (2, C, r) of the seed's SeedSequence, so κ_C
    no longer depends on the other degrees measured) and κ_C is their median; the report
    keeps every draw (``draws``). 1 is one ramp per degree from streams shared in degree
    order, as every figure before 2026-12-02 (session 33) was measured. Not used with
    ``kappa_pool_gpus`` (the trace's own arrivals make that κ steady).

    ``kappa_degrees``: the degrees κ is measured for (each one of ``degrees``; None: all of
    them); Ê is still fitted on every degree of ``degrees``. This is how ``vertumnus
    simulate --degrees D`` profiles (Ê on {1} ∪ D, κ on D alone), and with
    ``kappa_pool_gpus`` the shared streams of :func:`trace_kappa` are drawn in the same
    order, so the κ is the sweep's exactly (a ramp on a degree outside D would draw from
    them first and change every later degree's κ).
    """
    if isinstance(kappa_repeats, bool) or not isinstance(kappa_repeats, int) \
            or kappa_repeats < 1:
        raise InvalidInput(f"kappa_repeats must be an integer >= 1, got {kappa_repeats!r}")
    degs = _check_degrees(degrees)
    kdegs = degs if kappa_degrees is None else _check_degrees(kappa_degrees)
    if not set(kdegs) <= set(degs):
        raise InvalidInput(f"κ degrees {sorted(set(kdegs) - set(degs))} are not among the "
                           f"profiled degrees {sorted(degs)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meas_seq, kappa_noise_seq, kappa_arr_seq = np.random.SeedSequence(seed).spawn(3)
    meter = NoisyGroundTruth(int(meas_seq.generate_state(1)[0]), noise_sigma, truth)
    grid = profile_grid(degs)
    samples = measure_samples(meter, grid, repeats=repeats, kind=kind)
    base = Profile(
        model=truth.model.name, hardware=truth.gpu.name if kind == "cp" else f"{truth.gpu.name} TP",
        hardware_fingerprint=hardware_fingerprint(truth),
    )
    profile = fit_profile(samples, base=base, per_degree=per_degree)
    truth_score = score_against_truth(profile, grid, truth, kind=kind)

    kappa_report: dict[str, Any] = {}
    wl_info: dict[str, Any] | None = None
    pools: dict[str, int] | None = None
    if measure_kappas:
        wl = kappa_workload if kappa_workload is not None else generate(seed=seed)
        wl_info = {k: v for k, v in workload_stats(wl).items() if not isinstance(v, dict)}
        if kappa_pool_gpus is not None:
            # A sweep's method (the pooled, in-order replay, its streams from the same seed's
            # spawn); the sweep's κ exactly when Ê and the κ degrees are the sweep's too.
            ramp = replace(TRACE_KAPPA_RAMP, slo=ramp.slo)
            profile, t_report = trace_kappa(profile, wl, degrees=kdegs, seed=seed, truth=truth,
                                            noise_sigma=noise_sigma, ramp=ramp, kind=kind,
                                            pool_gpus=kappa_pool_gpus)
            kappa_report = t_report["results"]
            pools = t_report["pool_workers"]
        else:
            lengths = np.array([r.input_len for r in wl.requests], dtype=np.int64)
            kappas: dict[int, float] = {}
            if kappa_repeats == 1:
                k_truth = NoisyGroundTruth(int(kappa_noise_seq.generate_state(1)[0]),
                                           noise_sigma, truth)
                k_rng = np.random.default_rng(kappa_arr_seq)
                for c in kdegs:
                    res = measure_kappa(profile, k_truth, c, lengths, rng=k_rng, ramp=ramp,
                                        kind=kind)
                    kappas[c] = res.kappa
                    kappa_report[str(c)] = res.as_dict()
            else:
                for c in kdegs:
                    draws = []
                    for r in range(kappa_repeats):
                        k_truth, k_rng = _ramp_streams(seed, c, r, noise_sigma, truth)
                        draws.append(measure_kappa(profile, k_truth, c, lengths, rng=k_rng,
                                                   ramp=ramp, kind=kind))
                    kappas[c] = float(np.median([d.kappa for d in draws]))
                    # The report's levels are the draw nearest the median (its own ramp).
                    near = min(draws, key=lambda d: abs(d.kappa - kappas[c]))
                    kappa_report[str(c)] = {**near.as_dict(), "kappa": kappas[c],
                                            "draws": [d.kappa for d in draws]}
            profile = replace(profile.with_kappa(kappas), window_s=ramp.window_s)

    profile_path = out / PROFILE_FILE
    profile.save(profile_path)
    plot_fit(
        profile,
        samples,
        out / PLOT_FILE,
        title=f"{truth.model.name} on {truth.gpu.name} ({kind.upper()}): MAPE "
        f"{100 * (profile.fit_mape or math.nan):.1f}% vs measured, "
        f"{100 * truth_score['mape']:.1f}% vs truth",
    )
    with (out / SAMPLES_FILE).open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["r", "p", "degree", "measured_s", "predicted_s", "truth_s"])
        for s in samples:
            w.writerow(
                [
                    s.r,
                    s.p,
                    s.degree,
                    f"{s.seconds:.6g}",
                    f"{profile.predict(s.r, s.p, s.degree):.6g}",
                    f"{truth.prefill_time(s.r, s.p, s.degree, kind=kind):.6g}",
                ]
            )
    report: dict[str, Any] = {
        "backend": "sim",
        "kind": kind,
        "seed": seed,
        "noise_sigma": noise_sigma,
        "repeats": repeats,
        "kappa_repeats": kappa_repeats,
        "degrees": list(degs),
        "kappa_degrees": list(kdegs) if measure_kappas else [],
        "model": truth.model.name,
        "gpu": truth.gpu.name,
        "hardware": ground_truth_to_mapping(truth),
        "grid": {
            "r": list(PROFILE_R),
            "p": list(PROFILE_P),
            "points": len(grid),
            "samples": len(samples),
        },
        "coefficients": profile.coefficients.as_dict(),
        "note_coefficients": NOTE_COEFFICIENTS,
        "fit_vs_measured": {
            "mape": profile.fit_mape,
            "mape_per_degree": {str(c): m for c, m in profile.fit_mape_per_degree.items()},
        },
        "fit_vs_truth": truth_score,
        "kappa": {str(c): k for c, k in profile.kappa.items()},
        "kappa_pooled": profile.kappa_pooled,
        "kappa_ramp": {
            **{k: v for k, v in asdict(ramp).items() if k != "slo"},
            "slo": slo_to_dict(ramp.slo),
            # Workers per degree of the routed pool (a pooled κ only): min(8, GPUs / C).
            **({"pool_gpus": kappa_pool_gpus, "pool_workers_per_degree": pools}
               if pools is not None else {}),
            "results": kappa_report,
        },
        "kappa_workload": wl_info,
        "files": {
            "profile": PROFILE_FILE,
            "plot": PLOT_FILE,
            "samples": SAMPLES_FILE,
            "report": REPORT_FILE,
        },
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    return profile, report


def _json_default(x: Any) -> Any:
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def profile_command(
    out_dir: str | Path,
    backend: str = "sim",
    degrees: Sequence[int] = PROFILE_DEGREES,
    seed: int = 0,
    kappa_workload: Workload | str | Path | None = None,
    truth: GroundTruth | None = None,
    per_degree: bool = False,
    slo: SloTable = QWEN3_SLO,
    pool_gpus: int | None = None,
    kappa_repeats: int = KAPPA_REPEATS,
    kappa_degrees: Sequence[int] | None = None,
) -> Path:
    """CLI entry of ``vertumnus profile``: returns the path of the written profile.json.

    ``kappa_workload`` may be a Workload, a trace path or "synthetic" (loaded with
    :func:`sim.workloads.load_workload`; L-Eval needs a rate, so pass a Workload for it).
    ``truth``: the simulated hardware measured (``--hardware``, :mod:`sim.hardware`; None:
    the default). ``slo``: the TTFT deadlines κ must keep (the ramp's SLO). ``pool_gpus``: κ
    of a routed pool of that many GPUs replaying the workload (``run_profile``'s
    ``kappa_pool_gpus``; the profile is marked pooled). ``kappa_repeats``: ``run_profile``'s
    (the median of that many single-worker ramps per degree). ``kappa_degrees``:
    ``run_profile``'s (κ for these degrees only). Only the ``sim`` backend is implemented
    here.
    """
    if backend != "sim":
        raise InvalidInput(f"profiling backend {backend!r} is not supported here (only 'sim')")
    wl = kappa_workload
    if isinstance(wl, (str, Path)):
        wl = load_workload(wl, seed=seed)
    run_profile(out_dir, degrees=degrees, seed=seed, kappa_workload=wl,
                truth=truth or DEFAULT_GROUND_TRUTH, per_degree=per_degree,
                ramp=KappaRamp(slo=slo), kappa_pool_gpus=pool_gpus,
                kappa_repeats=kappa_repeats, kappa_degrees=kappa_degrees)
    return Path(out_dir) / PROFILE_FILE
