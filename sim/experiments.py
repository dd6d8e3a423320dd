"""Policy comparisons on one workload: deployments, sweeps over rate, results and the oracle.

Every policy runs on the same simulated cluster: same GPU budget, same ground truth (with the
same noise seed), same per-GPU KV-cache capacity, same trace. What differs is what each policy's
source deploys (peer-routing.md, paper §9.1):

==============  =============================================  ==============================
policy          pool                                           extras
==============  =============================================  ==============================
vertumnus       §6.1 initial composition over the degree set   controller + cache manager on
static          the same initial composition, held fixed        length threshold profiled
homo            all degree-4 workers (paper's Homo)             —
homo_cp2        all smallest-degree workers (only where that    —
                is 2: ``check_pools``)
vllm            all TP-4 workers                                —
sglang          all CP-4 (bounded and unbounded trees; the      —
                stronger is reported as ``sglang``)
dynamo, llmd,   all CP-4                                        —
round_robin
==============  =============================================  ==============================
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import pickle
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field, replace
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any, Final, TypeVar

import numpy as np

from services.cachemgr.pull import PullConfig
from services.cachemgr.reconcile import RehomeConfig
from services.cachemgr.scan import ScanConfig
from services.controller.composition import (
    HistoricalWorkload,
    demand_percentile,
    initial_composition,
    samples_from_lengths,
)
from services.controller.lattice import Composition, Lattice
from services.controller.planner import ControllerConfig
from shared.costmodel import Profile
from shared.ids import InvalidInput
from shared.worker import WorkerKind
from sim import calibration
from sim.groundtruth import GroundTruth, Kind
from sim.metrics import QWEN3_SLO, SloTable, failures_by_reason, slo_attainment
from sim.request_log import log_name, request_rows, write_request_log
from sim.simulator import SimConfig, SimResult, Simulator, controller_profile
from sim.workloads.workload import Workload, history_reuse, scale_rate

ALL_POLICIES: tuple[str, ...] = (
    "vertumnus", "static", "homo", "homo_cp2", "sglang", "vllm", "dynamo", "llmd", "round_robin",
)
HOMO_DEGREE = 4


@dataclass(frozen=True)
class Deployment:
    """How one policy is deployed for a comparison."""

    policy: str
    registry_name: str
    composition: Composition
    kind: WorkerKind = WorkerKind.CP
    adaptive: bool = False
    cache_manager: bool = False
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ExperimentSpec:
    """A sweep: the cluster, the knobs shared by all policies, and what to vary."""

    gpus: int = 40
    degrees: tuple[int, ...] = (2, 4)
    gpus_per_node: int = 8
    seed: int = 0
    cache_blocks_per_gpu: int | None = None
    window_s: float = 20.0
    scan_interval_s: float = 20.0
    beta: float | None = None
    lam: float | None = None
    beta_queue_scale: float | None = None
    """τ of J's queue-following β for the J policies (vertumnus, homo, homo_cp2;
    services/scheduler/placement.py). None: the calibrated default (off)."""
    beta_busy_power: float | None = None
    """k of J's busy-share β for the J policies (services/scheduler/placement.py; 0: β fixed,
    the paper's form). None: the calibrated default (``calibration.BETA_BUSY_POWER``)."""
    slo: SloTable = QWEN3_SLO
    static_thresholds: tuple[int, ...] = (4096, 8192, 16384, 32768)
    vertumnus_overrides: Mapping[str, Any] = field(default_factory=dict)
    controller: ControllerConfig = calibration.CONTROLLER
    scan: ScanConfig = calibration.SCAN
    rehome: RehomeConfig | None = calibration.REHOME
    pull: PullConfig | None = calibration.PULL
    """vertumnus's route-time pull (services/cachemgr/pull.py); None: off."""
    pull_credit_blocks: int = calibration.PULL_CREDIT_BLOCKS
    """J counts on that pull for copies of up to this many blocks (0: off;
    services/scheduler/placement.py ``PullCredit``)."""
    pull_displace_block_s: float = calibration.PULL_DISPLACE_BLOCK_S
    """The credit's price per copied block (``PullCredit.displace_block_s``)."""
    pull_wait: bool = calibration.PULL_WAIT
    """The credit also where the request waits for the copy (``PullCredit.wait``)."""
    pending_credit: bool = calibration.PENDING_CREDIT
    """The credit also counts a prefix pending at a worker after a split or merge
    (``SimConfig.pending_credit``)."""
    kappa_scale: float = calibration.KAPPA_SCALE
    """The controller judges capacity with κ_C × this. KAPPA_SCALE corrects a single-worker κ
    (``vertumnus profile``); sim/runner.py sets 1.0 when κ was measured on the trace with a
    routed pool (sim/profiling.py ``TRACE_KAPPA_RAMP``), which is already a pooled capacity —
    measured now, or read from a profile file that says so (``Profile.capacity_scale``)."""
    warmup_s: float = 0.0
    """Simulated seconds from the first arrival (at each rate) whose requests are run but left
    out of the TTFT, SLO, hit-rate and oracle figures (§9.1: "we warm up each system until its
    request processing and prefix-cache state stabilize"). 0: every request counts."""

    def __post_init__(self) -> None:
        check_warmup_s(self.warmup_s)


def check_warmup_s(w: object) -> None:
    """A warm-up is a finite number of seconds >= 0 (else :class:`InvalidInput`)."""
    if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) or w < 0:
        raise InvalidInput(f"the warm-up (--warmup, warmup_s) must be a finite number of "
                           f"seconds >= 0, got {w!r}")


def check_rate(workload: Workload, rate_scales: Sequence[float] = (1.0,), *,
               rate: float | None = None) -> None:
    """A rate asked of ``workload`` must be one it can take (else :class:`InvalidInput`):
    a trace whose arrivals span no time (a single request; two or more at one instant are
    refused by the readers) has no arrival rate, so ``--rate`` (``rate``) would set none and
    a ``--rate-scale`` other than 1 would scale none -- every such run would be the same run
    under another label. Nothing is asked by default (``rate_scales`` (1,), ``rate`` None)."""
    if workload.duration_s > 0:
        return
    asked = ([f"--rate {rate:g}"] if rate is not None else []) + \
        ([f"--rate-scale {','.join(f'{s:g}' for s in rate_scales)}"]
         if any(s != 1 for s in rate_scales) else [])
    if asked:
        n = len(workload)
        what = "one request" if n == 1 else f"{n} requests, all at one instant"
        raise InvalidInput(
            f"the trace has {what}: it has no arrival rate to set or scale, so "
            f"{' and '.join(asked)} would change nothing; leave "
            f"{'it' if len(asked) == 1 else 'them'} out (a rate needs two or more requests "
            f"at different times)")


# --- compositions -----------------------------------------------------------------------------
def historical_composition(
    lattice: Lattice, profile: Profile, workload: Workload, window_s: float
) -> Composition:
    """§6.1's initial composition from the workload as history (lengths and window demand).

    The demand of a window is estimated at each request's preferred degree (the mixture
    rule's), with the prefix reuse the history showed (every earlier prefix counted as cached:
    history as an ideal cache saw it); the median window is the expected demand that the check
    (with the controller's 1.2 headroom) must accommodate — bursts are the controller's job.
    """
    degs = lattice.sorted_degrees
    profile = profile.for_window(window_s)  # κ per window of window_s (Profile.for_window)
    lens = [r.input_len for r in workload.requests]
    if not lens:
        return Composition.uniform(lattice, degs[-1])
    cmin = degs[0]
    n_windows = max(1, math.ceil((workload.duration_s or window_s) / window_s))
    demand = [0.0] * n_windows
    t0 = workload.requests[0].arrival_s  # windows count from the trace's own start
    for r, p in zip(workload.requests, history_reuse(workload), strict=True):
        k = min(n_windows - 1, int((r.arrival_s - t0) // window_s))
        # Each request's demand at the degree it would prefer (§6.1's mixture rule), so the
        # capacity check compares like with like: κ_C is in degree-C service seconds.
        c = cmin
        while 2 * c in degs and profile.predict_fast(r.input_len - p, p, c) >= \
                calibration.SPEEDUP_THRESHOLD * profile.predict_fast(r.input_len - p, p, 2 * c):
            c *= 2
        demand[k] += profile.predict_fast(r.input_len - p, p, c)
    # Per-worker capacity is per window; provision the busy windows (not the average).
    hist = HistoricalWorkload(
        demand_s=demand_percentile(demand, 0.5),
        samples=samples_from_lengths(lens[:: max(1, len(lens) // 2000)], profile, degs),
    )
    return initial_composition(lattice, profile, hist,
                               speedup_threshold=calibration.SPEEDUP_THRESHOLD).composition


_HOMO_POOL_POLICIES: Final[frozenset[str]] = frozenset(
    {"homo", "vllm", "sglang", "sglang_unbounded", "dynamo", "llmd", "round_robin"})
"""The policies that run the peers' homogeneous pool (:func:`deployment_for`)."""


def _homo_degree(degrees: Sequence[int]) -> int:
    """The degree of the peers' homogeneous pool: :data:`HOMO_DEGREE`, else the largest."""
    return HOMO_DEGREE if HOMO_DEGREE in degrees else max(degrees)


def _fixed_pool_degree(policy: str, degrees: Sequence[int]) -> int | None:
    """The degree of the uniform pool :func:`deployment_for` gives ``policy``; None for the
    policies that start from the initial composition (vertumnus, static)."""
    if policy == "homo_cp2":
        return min(degrees)
    if policy in _HOMO_POOL_POLICIES:
        return _homo_degree(degrees)
    return None


HOMO_CP2_DEGREE: Final = 2
"""The degree ``homo_cp2`` is named after (README: "all CP2"; peer-routing.md's all-CP2 pool
of the {2, 4} experiments): it runs every worker at the smallest degree, and so only where
that is 2 (:func:`check_pools`)."""


def check_pools(gpus: int, degrees: Sequence[int], *,
                policies: Sequence[str] = ALL_POLICIES,
                gpus_per_node: int = ExperimentSpec.gpus_per_node, names: bool = True) -> None:
    """The pools :func:`deployment_for` builds for ``policies`` fit ``gpus`` and (``names``)
    are what their names say, else :class:`InvalidInput` naming ``--gpus`` and ``--degrees``
    (and the policies concerned). For a check before a sweep runs (its profile and its first
    run take seconds to minutes before the first pool is made); :func:`sweep` checks again.

    * the lattice itself (:class:`Lattice`);
    * the uniform pool of each policy that runs one, naming those policies (``homo_cp2``: all
      at the smallest degree; the peers and ``homo``: all at :data:`HOMO_DEGREE`, else the
      largest; ``vllm`` as TP workers);
    * every degree fits the pool (``degree <= gpus``): vertumnus and static could never form
      a worker of a larger one, yet κ would be measured on one (``sim.profiling.ramp_pools``)
      and the oracle would place requests on one (:func:`oracle_ttfts`);
    * ``homo_cp2`` only where the smallest degree is :data:`HOMO_CP2_DEGREE`: elsewhere its
      pool is not the all-CP2 one its name, the README and the tables promise (with
      --degrees 4,8 it was homo's all-CP4 pool again, reported as a second baseline). Left
      out with ``names`` False: a check of the GPU count alone (``profile --pool-gpus``:
      κ for the pools of that many GPUs, whichever policies run them)."""
    degs = sorted(degrees)
    where = f"--gpus {gpus} with --degrees {','.join(map(str, degs))}"
    try:
        lattice = Lattice(gpus, degs, gpus_per_node=gpus_per_node)
    except InvalidInput as exc:
        raise InvalidInput(f"{where} ({gpus_per_node} GPUs a node): {exc}") from None
    by_degree: dict[int, list[str]] = {}
    for p in dict.fromkeys(policies):
        d = _fixed_pool_degree(p, degs)
        if d is not None:
            by_degree.setdefault(d, []).append(p)
    for c, pols in sorted(by_degree.items()):
        try:
            Composition.uniform(lattice, c)
        except InvalidInput as exc:
            tp = " (vllm as TP workers)" if "vllm" in pols else ""
            raise InvalidInput(
                f"{where} ({gpus_per_node} GPUs a node): {', '.join(pols)} run every worker at "
                f"degree {c}{tp}, a pool these GPUs cannot form: {exc}; leave "
                f"{'it' if len(pols) == 1 else 'them'} out of --policies or give --gpus a "
                f"multiple of {c}") from None
    big = [c for c in degs if c > gpus]
    if big:
        raise InvalidInput(
            f"{where}: {gpus} GPUs cannot form a worker of degree "
            f"{', '.join(map(str, big))}, so no pool would ever have one (the profile's κ and "
            f"the oracle would assume one); drop {'it' if len(big) == 1 else 'them'} from "
            f"--degrees or give --gpus at least {max(big)}")
    if names and "homo_cp2" in policies and degs[0] != HOMO_CP2_DEGREE:
        same = _homo_degree(degs) == degs[0]
        raise InvalidInput(
            f"--policies homo_cp2 with --degrees {','.join(map(str, degs))}: homo_cp2 is the "
            f"all-CP{HOMO_CP2_DEGREE} pool (every worker at the smallest degree, "
            f"{HOMO_CP2_DEGREE} in the paper's {{2, 4}}), but the smallest degree here is "
            f"{degs[0]}, so it would run all-CP{degs[0]}"
            + (" -- homo's pool again" if same else "")
            + "; leave homo_cp2 out of --policies (the default list holds it)")


def deployment_for(
    policy: str,
    lattice: Lattice,
    initial: Composition,
    spec: ExperimentSpec,
) -> Deployment:
    """The pool and settings ``policy``'s source would deploy (module table)."""
    degs = lattice.sorted_degrees
    fixed = _fixed_pool_degree(policy, degs)
    # Only the pool this policy runs (another's may not fit the lattice: check_pools).
    uniform = None if fixed is None else Composition.uniform(lattice, fixed)
    jparams: dict[str, Any] = {}
    if spec.beta is not None:
        jparams["beta"] = spec.beta
    if spec.lam is not None:
        jparams["lam"] = spec.lam
    if spec.beta_queue_scale is not None:
        jparams["beta_queue_scale"] = spec.beta_queue_scale
    if spec.beta_busy_power is not None:
        jparams["beta_busy_power"] = spec.beta_busy_power
    if policy == "vertumnus":
        ov = dict(spec.vertumnus_overrides)
        comp = ov.pop("composition", initial)
        adaptive = ov.pop("adaptive", True)
        cache_manager = ov.pop("cache_manager", True)
        params = {**calibration.policy_params(policy), **jparams, **ov}
        return Deployment(policy, "vertumnus", comp, adaptive=adaptive,
                          cache_manager=cache_manager, params=params)
    if policy == "static":
        return Deployment(policy, "static", initial)
    if uniform is None:
        raise InvalidInput(f"unknown policy {policy!r}; known: {', '.join(ALL_POLICIES)}")
    if policy in ("homo", "homo_cp2"):
        return Deployment(policy, policy, uniform,
                          params={**calibration.policy_params(policy), **jparams})
    if policy == "vllm":
        return Deployment(policy, "vllm", uniform, kind=WorkerKind.TP)
    if policy in ("sglang", "sglang_unbounded"):
        return Deployment(policy, "sglang", uniform,
                          params={"unbounded": policy == "sglang_unbounded"})
    # dynamo, llmd, round_robin
    return Deployment(policy, policy, uniform)


# --- oracle -----------------------------------------------------------------------------------
def oracle_ttfts(workload: Workload, truth: GroundTruth, degrees: Sequence[int], *,
                 tp_degrees: Sequence[int] = ()) -> np.ndarray:
    """Zero-queue oracle TTFT per request (s): alone on an idle worker of its best degree, with
    every earlier prefix cached (an infinite global cache in arrival order), no noise.

    The workers it may pick: a CP worker of each of ``degrees`` and a TP worker of each of
    ``tp_degrees`` (:func:`oracle_tp_degrees`: the vLLM baseline's, when a comparison runs
    it). The oracle must bound every pool it is compared with, and in the ground truth a TP-4
    worker is faster than every CP degree at every length (no CP fixed cost d_cp)."""
    out = np.empty(len(workload.requests))
    shapes: list[tuple[int, Kind]] = [(c, "cp") for c in degrees]
    shapes += [(t, "tp") for t in tp_degrees]
    for i, (r, p) in enumerate(zip(workload.requests, history_reuse(workload), strict=True)):
        out[i] = min(
            truth.prefill_time(r.input_len - p, p, c, kind=k)
            + truth.external_time(r.input_len, c)
            for c, k in shapes
        )
    return out


def oracle_tp_degrees(policies: Sequence[str], degrees: Sequence[int]) -> tuple[int, ...]:
    """The TP worker degrees the oracle of a comparison of ``policies`` must include: the
    ``vllm`` baseline's (:func:`deployment_for`: all at :data:`HOMO_DEGREE`, else the
    largest), or none when no policy runs TP workers."""
    return (_homo_degree(sorted(degrees)),) if "vllm" in policies else ()


# --- one run ----------------------------------------------------------------------------------
def run_deployment(
    workload: Workload,
    dep: Deployment,
    profile: Profile,
    spec: ExperimentSpec,
    truth: GroundTruth | None = None,
) -> SimResult:
    cfg = SimConfig(
        policy=dep.registry_name,
        policy_params=dict(dep.params),
        gpus=spec.gpus,
        degrees=spec.degrees if dep.kind is WorkerKind.CP else tuple(sorted(set(spec.degrees) | {
            g.degree for g in dep.composition.groups})),
        gpus_per_node=spec.gpus_per_node,
        worker_kind=dep.kind,
        adaptive=dep.adaptive,
        cache_manager=dep.cache_manager,
        cache_blocks_per_gpu=spec.cache_blocks_per_gpu,
        window_s=spec.window_s,
        scan_interval_s=spec.scan_interval_s,
        seed=spec.seed,
        scan_config=spec.scan,
        rehome=spec.rehome,
        pull=spec.pull,
        pull_credit_blocks=spec.pull_credit_blocks,
        pull_displace_block_s=spec.pull_displace_block_s,
        pull_wait=spec.pull_wait,
        pending_credit=spec.pending_credit,
        controller_config=spec.controller,
        kappa_scale=spec.kappa_scale,
    )
    sim = Simulator(cfg, profile, truth)
    # The cyclic collector stays paused until the trie is released, not only for the run
    # (Simulator.run pauses it itself and, nested in this pause, leaves it paused). Why: its
    # first pass after a pause takes every container the run allocated and kept, the
    # trie's ~55k nodes with their holder sets, child dicts and count lists included; that
    # pass, started by the release's first allocation, traversed them only for the release
    # to free them right after: 0.06-0.07 s after a 2.5 s run of the conversation trace x2.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        res = sim.run(workload, dep.composition)
        # The finished run's trie goes now, by reference counting (PrefixTrie.release: its
        # ~55k nodes would otherwise wait for a pass of the cyclic collector). Not on an
        # error or an interrupt: the trie is left to the collector then, and the exception
        # goes on at once.
        sim.trie.release()
    finally:
        if gc_was_enabled:
            gc.enable()
    return res


def summarize_run(
    res: SimResult,
    *,
    policy: str,
    rate_scale: float,
    slo: SloTable,
    oracle: np.ndarray,
    wall_s: float,
    warmup_s: float = 0.0,
) -> dict[str, Any]:
    """The results.json row of one (policy, rate_scale) run.

    ``warmup_s`` > 0: requests arriving in the first ``warmup_s`` seconds (from the run's first
    arrival) are left out of every per-request figure (counts, TTFT, SLO, hit rate, per degree,
    request rate; ``oracle`` must already be the measured requests' only); ``warmup_requests``
    says how many. GPU-seconds, reconfigurations and transfers cover the whole run.
    ``queue_s_mean`` + ``prefill_s_mean`` + ``handoff_s_mean`` = ``mean_ttft_s``: the completed
    requests' mean wait for their prefill to start, mean prefill, and mean rest (KV hand-off
    and first decode step).
    """
    recs = res.records
    warm = 0
    if warmup_s > 0 and recs:
        start = min(r.arrival_s for r in recs) + warmup_s
        measured = [r for r in recs if r.arrival_s >= start]
        warm = len(recs) - len(measured)
        recs = measured
    done = [r for r in recs if r.ttft_s >= 0]
    ttft = np.array([r.ttft_s for r in done]) if done else np.array([math.nan])
    # Where the mean TTFT goes (RequestRecord's split; sim/request_log.py has it per request):
    # queueing until the prefill starts, the prefill, and the rest (KV hand-off and first
    # decode step).
    queue = float(np.mean([r.queue_s for r in done])) if done else math.nan
    prefill = float(np.mean([r.prefill_s for r in done])) if done else math.nan
    lens_all = np.array([r.input_len for r in recs], dtype=float)
    # Token-weighted SLO counts every request; a failed one misses its deadline.
    ttft_all = np.array([r.ttft_s if r.ttft_s >= 0 else math.inf for r in recs])
    reused = sum(r.reused_tokens for r in done)
    tokens = sum(r.input_len for r in done)
    # The scheduler's profile is a CP fit: on TP workers (the vllm pool) predicted and actual
    # times describe different executions, so their gap is no error of the model (None).
    fitted_kind = res.config.worker_kind is WorkerKind.CP
    pred = np.array([r.predicted_s for r in done if r.actual_s > 0 and fitted_kind])
    act = np.array([r.actual_s for r in done if r.actual_s > 0 and fitted_kind])
    drains = [rc.drain_s for rc in res.reconfigurations if rc.exposed_s >= 0]
    switches = [rc.switch_s for rc in res.reconfigurations if rc.exposed_s >= 0]
    per_degree: dict[str, dict[str, float]] = {}
    for c in sorted({r.degree for r in done}):
        sub = [r for r in done if r.degree == c]
        tok = sum(r.input_len for r in sub)
        per_degree[str(c)] = {
            "requests": len(sub),
            "hit_rate": sum(r.reused_tokens for r in sub) / tok if tok else 0.0,
            "mean_ttft_s": float(np.mean([r.ttft_s for r in sub])),
        }
    first, last = res.composition_timeline[0][1], res.composition_timeline[-1][1]
    return {
        "policy": policy,
        "rate_scale": rate_scale,
        "workload": res.workload_name,
        "requests": len(recs),
        "warmup_requests": warm,
        "completed": len(done),
        "failed": len(recs) - len(done),
        # Why they failed (sim.metrics.failure_reason): the results table's line names them.
        "failed_by_reason": failures_by_reason(recs),
        "mean_ttft_s": float(np.mean(ttft)),
        "p50_ttft_s": float(np.percentile(ttft, 50)),
        "p90_ttft_s": float(np.percentile(ttft, 90)),
        "p99_ttft_s": float(np.percentile(ttft, 99)),
        "queue_s_mean": queue,
        "prefill_s_mean": prefill,
        "handoff_s_mean": float(np.mean(ttft)) - queue - prefill if done else math.nan,
        "slo_attainment": slo_attainment(lens_all, ttft_all, slo) if recs else math.nan,
        "hit_rate": reused / tokens if tokens else 0.0,
        "gpu_seconds": res.gpu_seconds,
        "reconfigurations": len(res.reconfigurations),
        "splits": sum(rc.kind == "split" for rc in res.reconfigurations),
        "merges": sum(rc.kind == "merge" for rc in res.reconfigurations),
        "drain_s_mean": float(np.mean(drains)) if drains else None,
        "drain_s_max": float(np.max(drains)) if drains else None,
        "switch_s_mean": float(np.mean(switches)) if switches else None,
        "replications": res.replications,
        "reclamations": res.reclamations,
        "pulls": res.pulls,
        "copy_waits": res.copy_waits,
        "copy_wait_s": res.copy_wait_s,
        "oracle_mean_ttft_s": float(np.mean(oracle)) if oracle.size else math.nan,
        "prediction_mape": float(np.mean(np.abs(pred - act) / act)) if act.size else None,
        "composition_start": {str(k): v for k, v in first.items()},
        "composition_end": {str(k): v for k, v in last.items()},
        "per_degree": per_degree,
        "request_rate": len(recs) / _span(recs) if recs else 0.0,
        "wall_s": wall_s,
        "sim_requests_per_wall_s": len(recs) / wall_s if wall_s > 0 else None,
    }


def _span(recs: Sequence[Any]) -> float:
    """Seconds from the first arrival of ``recs`` to the last (1.0 for a single instant)."""
    span = max(r.arrival_s for r in recs) - min(r.arrival_s for r in recs)
    return span if span > 0 else 1.0


# --- static threshold profiling ---------------------------------------------------------------
def profile_static_threshold(
    workload: Workload,
    lattice: Lattice,
    initial: Composition,
    profile: Profile,
    spec: ExperimentSpec,
    truth: GroundTruth | None = None,
    *,
    rate_scale: float = 1.0,
) -> tuple[int, dict[int, float]]:
    """Static's length threshold, profiled offline (peer-routing.md): the best of a few
    candidate lengths by mean TTFT on this composition at a rate below saturation."""
    wl = scale_rate(workload, rate_scale) if rate_scale != 1.0 else workload
    scores: dict[int, float] = {}
    for th in spec.static_thresholds:
        dep = Deployment("static", "static", initial, params={"threshold_tokens": th})
        res = run_deployment(wl, dep, profile, spec, truth)
        done = [r.ttft_s for r in res.records if r.ttft_s >= 0]
        scores[th] = float(np.mean(done)) if done else math.inf
    best = min(scores, key=lambda t: (scores[t], t))
    return best, scores


# --- the sweep --------------------------------------------------------------------------------
def sweep(
    workload: Workload,
    policies: Sequence[str],
    rate_scales: Sequence[float],
    profile: Profile,
    spec: ExperimentSpec,
    truth: GroundTruth | None = None,
    *,
    on_run: Callable[[str, float], None] | None = None,
    static_profile_rate: float | None = None,
    jobs: int = 1,
    request_log: Path | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run every (policy, rate_scale); returns result rows and a side dict (compositions,
    profiled static threshold, timelines) for the report.

    ``jobs`` > 1 runs the cells in that many worker processes; the rows (but for their
    ``wall_s`` and ``sim_requests_per_wall_s``) and their order are the same as with 1.
    ``on_run(policy, rate_scale)`` is called as each cell finishes. ``request_log``: a
    directory where each cell also writes its per-request log (:mod:`sim.request_log`; the
    row's variant's run). Raises :class:`InvalidInput` for ``jobs`` < 1, pools
    :func:`check_pools` refuses, or rate scales :func:`check_rate` refuses.
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise InvalidInput(f"jobs must be an integer >= 1, got {jobs!r}")
    check_pools(spec.gpus, spec.degrees, policies=policies, gpus_per_node=spec.gpus_per_node)
    check_rate(workload, rate_scales)
    truth = truth or GroundTruth()
    lattice = Lattice(spec.gpus, spec.degrees, gpus_per_node=spec.gpus_per_node)
    ctl_profile = controller_profile(profile, spec.kappa_scale)
    # The paper provisions each rate from its own history ("Static uses the same worker
    # composition as Vertumnus at each request rate"): the initial composition is chosen per
    # rate from the workload at that rate.
    initial_by_scale = {
        s: historical_composition(lattice, ctl_profile,
                                  scale_rate(workload, s) if s != 1.0 else workload,
                                  spec.window_s)
        for s in rate_scales
    }
    side: dict[str, Any] = {
        "initial_composition": {str(s): c.describe() for s, c in initial_by_scale.items()},
        "timelines": {},
    }
    # Static's threshold is profiled offline per composition, at a rate below saturation
    # (the sweep's lowest), and then held fixed.
    static_th: dict[str, int] = {}
    if "static" in policies:
        scores_by: dict[str, Any] = {}
        for comp in {c.describe(): c for c in initial_by_scale.values()}.values():
            th, scores = profile_static_threshold(
                workload, lattice, comp, profile, spec, truth,
                rate_scale=static_profile_rate or min(rate_scales),
            )
            static_th[comp.describe()] = th
            scores_by[comp.describe()] = {str(k): v for k, v in scores.items()}
        side["static_threshold_tokens"] = static_th
        side["static_threshold_scores"] = scores_by
    ctx = _SweepCells(workload, profile, spec, truth, lattice, initial_by_scale, static_th,
                      request_log, oracle_tp_degrees(policies, spec.degrees))
    cells = [(scale, pol) for scale in rate_scales for pol in policies]
    results: list[tuple[dict[str, Any], Any] | None] = [None] * len(cells)
    if jobs == 1:
        for i, (scale, pol) in enumerate(cells):
            results[i] = ctx.run(scale, pol)
            if on_run is not None:
                on_run(pol, scale)
    else:
        # Each cell is one independent deterministic run (its own simulator and noise stream
        # from the seed), so running cells in other processes changes no result.
        def done(i: int) -> None:
            if on_run is not None:
                on_run(cells[i][1], cells[i][0])

        results[:] = run_in_processes(_run_cell, cells, jobs, initializer=_init_cells,
                                      initargs=(ctx,), on_done=done)
    rows: list[dict[str, Any]] = []
    for (scale, _pol), res in zip(cells, results, strict=True):
        assert res is not None
        row, timeline = res
        rows.append(row)
        if timeline is not None:
            side["timelines"][str(scale)] = timeline
    return rows, side


def _stronger(row: Mapping[str, Any], best: Mapping[str, Any]) -> bool:
    """Whether the result row of a policy's variant ``row`` beats ``best``, the one kept so
    far (:meth:`_SweepCells.run`): a variant that completed requests beats one that
    completed none, whose mean TTFT is NaN (which no comparison beats); else the lower mean
    TTFT. A tie, or neither completing any, keeps ``best`` (the earlier variant)."""
    if (row["completed"] > 0) != (best["completed"] > 0):
        return row["completed"] > 0
    return row["mean_ttft_s"] < best["mean_ttft_s"]


@dataclass
class _SweepCells:
    """What every (rate, policy) cell of a sweep shares; runs one cell (:meth:`run`)."""

    workload: Workload
    profile: Profile
    spec: ExperimentSpec
    truth: GroundTruth
    lattice: Lattice
    initial_by_scale: Mapping[float, Composition]
    static_th: Mapping[str, int]
    request_log: Path | None = None  # where each cell writes its per-request log (None: not)
    tp_degrees: tuple[int, ...] = ()  # the oracle's TP workers (oracle_tp_degrees)
    # Per rate: the scaled workload and its oracle TTFTs (computed once per process).
    _by_scale: dict[float, tuple[Workload, np.ndarray]] = field(default_factory=dict)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_by_scale"] = {}  # recomputed in each process, not shipped
        return state

    def at(self, scale: float) -> tuple[Workload, np.ndarray]:
        got = self._by_scale.get(scale)
        if got is None:
            wl = scale_rate(self.workload, scale) if scale != 1.0 else self.workload
            oracle = oracle_ttfts(wl, self.truth, self.spec.degrees,
                                  tp_degrees=self.tp_degrees)
            if self.spec.warmup_s > 0 and wl.requests:
                # The oracle of the measured requests only (summarize_run leaves the same out).
                start = min(r.arrival_s for r in wl.requests) + self.spec.warmup_s
                oracle = oracle[np.array([r.arrival_s >= start for r in wl.requests])]
            got = self._by_scale[scale] = (wl, oracle)
        return got

    def run(self, scale: float, pol: str) -> tuple[dict[str, Any], Any]:
        """The cell's result row (the stronger variant's, for ``sglang``) and, for
        ``vertumnus``, its composition timeline (else None)."""
        wl, oracle = self.at(scale)
        initial = self.initial_by_scale[scale]
        variants = ("sglang", "sglang_unbounded") if pol == "sglang" else (pol,)
        best_row: dict[str, Any] | None = None
        best_res: SimResult | None = None
        timeline = None
        for var in variants:
            dep = deployment_for(var, self.lattice, initial, self.spec)
            if var == "static" and initial.describe() in self.static_th:
                dep = replace(dep, params={"threshold_tokens":
                                           self.static_th[initial.describe()]})
            t0 = time.perf_counter()
            res = run_deployment(wl, dep, self.profile, self.spec, self.truth)
            wall = time.perf_counter() - t0
            row = summarize_run(res, policy=pol, rate_scale=scale, slo=self.spec.slo,
                                oracle=oracle, wall_s=wall, warmup_s=self.spec.warmup_s)
            row["variant"] = var
            if best_row is None or _stronger(row, best_row):
                best_row, best_res = row, res
            if pol == "vertumnus":
                timeline = [[t, {str(k): v for k, v in c.items()}]
                            for t, c in res.composition_timeline]
                if res.end_s > timeline[-1][0]:  # the composition held until the run's end
                    timeline.append([res.end_s, dict(timeline[-1][1])])
        assert best_row is not None and best_res is not None
        if self.request_log is not None:
            write_request_log(self.request_log / log_name(pol, scale, self.spec.seed),
                              request_rows(best_res.records, self.spec.slo,
                                           self.spec.warmup_s))
        return best_row, timeline


_CELLS: _SweepCells | None = None
"""The sweep of a worker process (set once by :func:`_init_cells`)."""


def _init_cells(cells: _SweepCells) -> None:
    global _CELLS
    _CELLS = cells


def _run_cell(scale: float, pol: str) -> tuple[dict[str, Any], Any]:
    assert _CELLS is not None, "worker process not initialised"
    return _CELLS.run(scale, pol)


# --- calls in worker processes ---------------------------------------------------------------
_T = TypeVar("_T")

TERMINATED_EXIT: Final = 128 + signal.SIGTERM
"""The exit status after a SIGTERM that :func:`run_in_processes` handled (143: what a shell
shows for a process that SIGTERM ended, as a single-process ``simulate`` is)."""


class _Terminated(BaseException):
    """SIGTERM in the parent while its worker processes run (:func:`run_in_processes`)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated


def _start_worker(init_file: str) -> None:
    """A worker process's first act: SIGINT ignored for good, then the caller's initializer
    ``init(*initargs)``, pickled in ``init_file`` (:func:`run_in_processes`).

    A Ctrl-C reaches the whole process group; the parent decides what it means and stops the
    workers, which must not each print a KeyboardInterrupt traceback. SIGINT arrives blocked
    (:func:`run_in_processes` spawns with it blocked, so the interpreter's start-up and the
    imports before this ran are covered too); a signal pending since then is discarded here."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    with open(init_file, "rb") as f:
        init, initargs = pickle.load(f)
    if init is not None:
        init(*initargs)


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Cancel the calls not started and end the worker processes now (SIGTERM, then SIGKILL
    after 5 s), then wait for the pool's manager thread. ``shutdown`` alone (a ``with`` block's
    exit) waits for every call already queued: the whole rest of a sweep."""
    # NOTE: Python 3.11 has no public way to stop a pool's processes (3.14 adds
    # terminate_workers); shutdown() drops these references, so they are taken first.
    procs = list((pool._processes or {}).values())  # type: ignore[attr-defined]
    manager = pool._executor_manager_thread  # type: ignore[attr-defined]
    pool.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5.0)
        if p.is_alive():
            p.kill()
            p.join()
    if manager is not None:
        manager.join(timeout=5.0)  # it sees its workers gone and ends


def run_in_processes(
    fn: Callable[..., _T],
    calls: Sequence[tuple[Any, ...]],
    jobs: int,
    *,
    initializer: Callable[..., None] | None = None,
    initargs: tuple[Any, ...] = (),
    on_done: Callable[[int], None] | None = None,
) -> list[_T]:
    """``fn(*calls[i])`` for every ``i`` in ``min(jobs, len(calls))`` worker processes
    ("spawn": the caller may run threads, the progress bar, that a fork would copy); the
    results in ``calls`` order. ``initializer(*initargs)`` runs once in each worker (both
    picklable); ``on_done(i)`` in this process as each call finishes.

    Stopping (the sweeps of ``simulate``, ``tune`` and ``size --jobs N``): the workers ignore
    SIGINT from their start; a Ctrl-C (KeyboardInterrupt here) or an exception from a call
    cancels the calls not started, ends the workers (:func:`_stop_workers`) and propagates at
    once. SIGTERM, where its disposition is the default (this process would die of it and
    leave the workers running), does the same and then exits with :data:`TERMINATED_EXIT`;
    only in the main thread (the only one signal handlers can be set from), and restored
    after. No worker is left behind either way."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise InvalidInput(f"jobs must be an integer >= 1, got {jobs!r}")
    results: list[Any] = [None] * len(calls)
    if not calls:
        return results
    main = threading.current_thread() is threading.main_thread()
    catch_term = main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    # Started before SIGINT is blocked below: starting it unblocks SIGINT and SIGTERM in
    # this thread (multiprocessing.resource_tracker), which would undo the block.
    resource_tracker.ensure_running()
    pool: ProcessPoolExecutor | None = None
    # The initializer and its arguments (a sweep's: the workload, MBs) reach the workers in a
    # file, not in the spawn pipe: a write there waits until the new interpreter has started
    # and imported enough to read it, ~1 s a worker, all with SIGINT blocked below.
    with tempfile.TemporaryDirectory(prefix="vertumnus-workers-") as tmp:
        init_file = os.path.join(tmp, "init.pickle")
        with open(init_file, "wb") as f:
            pickle.dump((initializer, initargs), f, protocol=pickle.HIGHEST_PROTOCOL)
        if catch_term:
            signal.signal(signal.SIGTERM, _raise_terminated)
        try:
            # The workers are spawned with SIGINT blocked, which they inherit
            # (_start_worker); here it is blocked only while they are made (fork and exec),
            # and one arriving meanwhile is raised when the block ends.
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                pool = ProcessPoolExecutor(max_workers=min(jobs, len(calls)),
                                           mp_context=multiprocessing.get_context("spawn"),
                                           initializer=_start_worker, initargs=(init_file,))
                futures = {pool.submit(fn, *args): i for i, args in enumerate(calls)}
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
            for fut in as_completed(futures):
                i = futures[fut]
                results[i] = fut.result()
                if on_done is not None:
                    on_done(i)
        except BaseException as exc:
            # A further Ctrl-C or SIGTERM must not cut the stop short (and leave workers behind).
            # Ignored, not blocked: a handler is run by whichever thread takes the signal.
            old_int = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
            if catch_term:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            try:
                if pool is not None:
                    _stop_workers(pool)
            finally:
                if old_int is not None:  # None: not a handler Python set (left ignored)
                    signal.signal(signal.SIGINT, old_int)
                if catch_term:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if isinstance(exc, _Terminated):
                raise SystemExit(TERMINATED_EXIT) from None
            raise
        if catch_term:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert pool is not None
        pool.shutdown()
    return results


REPEAT_METRICS: tuple[str, ...] = (
    "mean_ttft_s", "p50_ttft_s", "p90_ttft_s", "p99_ttft_s", "slo_attainment", "hit_rate",
    "gpu_seconds", "reconfigurations", "completed", "failed",
)
"""The figures each seed's run keeps in a combined row's ``runs`` (the spread behind a mean)."""


_FIRST_SEED: Final = frozenset({"policy", "rate_scale", "workload", "variant",
                                 "composition_start", "composition_end"})
"""Fields a combined row takes from the first seed's run: names, and whole compositions (a mean
of compositions is none)."""


def _mean_of(vals: Sequence[Any], first: Any) -> Any:
    """The mean of one field over the seeds (``None`` = absent there, skipped); dicts per key;
    anything that is not a number (``bool`` included) is ``first``, as are mixed kinds."""
    if isinstance(first, Mapping):
        if not all(v is None or isinstance(v, Mapping) for v in vals):
            return first
        keys = list(dict.fromkeys(k for v in vals if v is not None for k in v))
        return {k: _mean_of([None if v is None else v.get(k) for v in vals],
                            next(v[k] for v in vals if v is not None and k in v))
                for k in keys}
    present = [v for v in vals if v is not None]
    if not present or not all(isinstance(v, int | float) and not isinstance(v, bool)
                              for v in present):
        return first
    if all(isinstance(v, int) for v in present) and len(set(present)) == 1:
        return present[0]  # a count equal in every run stays an int
    return float(np.mean(present))


def combine_repeats(rows_by_seed: Sequence[Sequence[Mapping[str, Any]]],
                    seeds: Sequence[int]) -> list[dict[str, Any]]:
    """One row per (policy, rate_scale) from the same sweep run once per seed (§9.1: "we
    repeat each experiment three times and report the average across these runs").

    A numeric field (``bool`` excepted) is the mean over the seeds, skipping seeds where it is
    ``None`` or absent; a count equal in every run stays an ``int``; a dict of figures
    (``per_degree``) is combined key by key. Names, the variant and the compositions
    (:data:`_FIRST_SEED`), and any other value, are the first seed's. Each row adds ``seeds`` and
    ``runs``: every seed's :data:`REPEAT_METRICS`, in seed order. Rows are matched by
    (policy, rate_scale) and keep the first seed's order. Raises :class:`InvalidInput` when
    the seeds' sweeps do not hold the same cells or the seeds are not as many as the sweeps.
    """
    if len(rows_by_seed) != len(seeds) or not seeds:
        raise InvalidInput(f"{len(rows_by_seed)} sweeps for {len(seeds)} seeds")
    keyed: list[dict[tuple[str, float], Mapping[str, Any]]] = []
    for rows in rows_by_seed:
        by = {(r["policy"], r["rate_scale"]): r for r in rows}
        if len(by) != len(rows):
            raise InvalidInput("a sweep repeats a (policy, rate_scale) cell")
        keyed.append(by)
    if any(by.keys() != keyed[0].keys() for by in keyed[1:]):
        raise InvalidInput("the seeds' sweeps do not hold the same (policy, rate_scale) cells")
    out: list[dict[str, Any]] = []
    for first in rows_by_seed[0]:
        key = (first["policy"], first["rate_scale"])
        runs = [by[key] for by in keyed]
        row = {k: v if k in _FIRST_SEED else _mean_of([r.get(k) for r in runs], v)
               for k, v in first.items()}
        why = [r.get("failed_by_reason") for r in runs]
        if all(isinstance(w, Mapping) for w in why):
            # A reason a seed's run lacks is no request failing so there (0), not a figure
            # that seed could not give: its mean counts the 0.
            row["failed_by_reason"] = {k: _mean_of([w.get(k, 0) for w in why], 0)
                                       for k in sorted({k for w in why for k in w})}
        row["seeds"] = [int(x) for x in seeds]
        row["runs"] = [{"seed": int(sd), "variant": r.get("variant"),
                        **{m: r.get(m) for m in REPEAT_METRICS}}
                       for sd, r in zip(seeds, runs, strict=True)]
        out.append(row)
    return out
