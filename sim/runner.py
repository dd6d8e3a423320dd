"""What ``vertumnus simulate`` / ``report`` do: load, profile, sweep, write, plot, print.

Outputs in the run directory:

* ``results.json`` — a list, one object per (policy, rate_scale) (see
  :func:`sim.experiments.summarize_run` for the keys);
* ``results.csv`` — the same rows, flat;
* ``comparison.json`` / ``comparison.csv`` — vertumnus against the strongest baseline at each
  rate (mean, P90, SLO attainment, the distance from the oracle; :mod:`sim.comparison`), the
  issue's acceptance figures (the ablation: the full cache manager against the variant
  without); an empty list where the run has no vertumnus row or no baseline;
* ``meta.json`` — workload statistics, the cluster, the profile used, the initial composition,
  the profiled static threshold, and the composition timelines of ``vertumnus``;
* ``profile/`` — only when no ``--profile`` is given: the Ê fit (as ``vertumnus profile``
  writes it), κ measured on this trace (``kappa_<key>.json``, reused by a later sweep of the
  same trace and settings into the same directory) and ``profile.json`` with that κ;
* ``ttft_mean.png``, ``ttft_p90.png``, ``slo.png`` (against request rate, one line per policy,
  like the paper's Figures 10–12) and ``composition.png`` (workers per degree over time, like
  Figure 13).
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import IO, Any

from services.cachemgr.pull import PullConfig
from services.controller.config_file import config_to_mapping
from services.controller.planner import ControllerConfig
from shared.costmodel import Profile
from shared.files import CONFIG_SUFFIXES, NotJson, parse_json, path_kind, write_text_atomic
from shared.ids import InvalidInput
from sim import calibration
from sim.comparison import COMPARISON_KEYS, compare_sizes, compare_with_baselines
from sim.experiments import (
    ALL_POLICIES,
    ExperimentSpec,
    check_pools,
    check_rate,
    check_warmup_s,
    combine_repeats,
    oracle_tp_degrees,
    oracle_ttfts,
    sweep,
)
from sim.groundtruth import GroundTruth
from sim.hardware import ground_truth_to_mapping
from sim.metrics import (
    QWEN3_SLO,
    SloTable,
    failure_reasons,
    format_failed_by_reason,
    slo_attainment,
    slo_to_dict,
)
from sim.workloads import (
    detect_format,
    generate,
    generate_from_file,
    load_workload,
    public_trace,
    read_azure,
    read_leval,
    read_mooncake,
    workload_stats,
)
from sim.workloads.errors import TraceFormatError
from sim.workloads.parsing import MAX_SPAN_S
from sim.workloads.synthetic import SyntheticConfig
from sim.workloads.workload import Workload, scale_to_rate, truncate

RESULT_KEYS = (
    "policy", "rate_scale", "request_rate", "requests", "warmup_requests", "completed", "failed",
    "failed_by_reason", "mean_ttft_s", "p50_ttft_s", "p90_ttft_s", "p99_ttft_s", "queue_s_mean",
    "prefill_s_mean", "handoff_s_mean", "slo_attainment", "hit_rate",
    "gpu_seconds", "reconfigurations", "splits", "merges", "drain_s_mean", "switch_s_mean",
    "replications", "reclamations", "pulls", "copy_waits", "copy_wait_s", "oracle_mean_ttft_s",
    "prediction_mape", "variant",
    "wall_s", "sim_requests_per_wall_s",
)


# --- inputs ----------------------------------------------------------------------------------
TRACE_FORMATS: tuple[str, ...] = ("auto", "mooncake", "azure", "leval", "synthetic")
"""What ``--format`` takes: a trace file's reader, ``auto`` (detected) or ``synthetic`` (the
generator: ``--trace synthetic`` for its defaults, or a ``.toml`` / ``.json`` file of its
parameters, :mod:`sim.workloads.synthetic_file`)."""


def check_trace_format(trace: str, fmt: str) -> None:
    """Raise :class:`InvalidInput` for a format that is not one of :data:`TRACE_FORMATS`, or
    one that contradicts the trace: a file format needs a file, not ``--trace synthetic``;
    ``synthetic`` with a file reads the generator's parameters, from a ``.toml`` or ``.json``
    file only (a trace file with it is a mix-up, said before anything is read)."""
    if fmt not in TRACE_FORMATS:
        raise InvalidInput(f"unknown --format {fmt!r}; use {'|'.join(TRACE_FORMATS)}")
    if fmt == "synthetic" and trace != "synthetic" \
            and Path(trace).suffix.lower() not in CONFIG_SUFFIXES:
        raise InvalidInput(f"--format synthetic reads the generator's parameters from a .toml or "
                           f".json file (`vertumnus synthetic` prints one); --trace {trace} is "
                           f"neither: for a trace file leave --format auto or name its format")
    if trace == "synthetic" and fmt not in ("auto", "synthetic"):
        raise InvalidInput(f"--format {fmt} reads a trace file, but --trace is 'synthetic'; "
                           "give the file with --trace")


def load_trace(trace: str, fmt: str, *, seed: int, rate: float | None,
               max_requests: int | None) -> Workload:
    """Read ``trace`` ('synthetic' or a file) with the named or detected format; raises
    :class:`InvalidInput` for a format that contradicts it (:func:`check_trace_format`).

    ``rate`` (req/s): the base rate of L-Eval and the synthetic workloads; a Mooncake or
    Azure trace's arrivals are rescaled to it, named or detected alike, after the cut to
    ``max_requests`` (so that the requests simulated arrive at that mean rate: a mean
    inter-arrival gap of 1/``rate``, :func:`~sim.workloads.workload.scale_to_rate`)."""
    check_trace_format(trace, fmt)
    timed = False  # a trace with its own arrival times (Mooncake, Azure): rescaled to `rate`
    if trace == "synthetic":
        cfg = SyntheticConfig(rate=rate) if rate else SyntheticConfig()
        wl = generate(cfg, seed=seed)
    else:
        path = Path(trace)
        kind = path_kind(path, "trace")
        if kind == "dir":
            raise InvalidInput(f"trace {trace} is a directory, not a file")
        if kind == "other":
            raise InvalidInput(f"trace {trace} is not a regular file (a device, pipe or "
                               "socket)")
        if kind != "file":
            raise InvalidInput(f"trace file not found: {trace}")
        if fmt == "auto":
            # detect_format is load_workload's own test, so the two never disagree; L-Eval is
            # read here because it needs a rate, which the CLI defaults to 1 req/s.
            detected = detect_format(path)
            if detected == "leval":
                wl = read_leval(path, rate=rate or 1.0, seed=seed)
            elif detected == "synthetic":
                wl = generate_from_file(path, seed=seed, rate=rate if rate else None)
            else:
                timed = True
                try:
                    wl = load_workload(path, seed=seed)
                except TraceFormatError as exc:
                    if path.suffix.lower() != ".json" or exc.line != 1:
                        raise
                    # A .json file read as JSON lines: most likely a parameter file.
                    raise InvalidInput(f"{exc} (read as a Mooncake trace; a synthetic "
                                       f"workload file in JSON needs --format synthetic)"
                                       ) from None
        elif fmt == "synthetic":
            wl = generate_from_file(path, seed=seed, rate=rate if rate else None)
        elif fmt == "mooncake":
            wl, timed = read_mooncake(path, seed=seed), True
        elif fmt == "azure":
            wl, timed = read_azure(path), True
        else:  # "leval": check_trace_format let nothing else through
            wl = read_leval(path, rate=rate or 1.0, seed=seed)
    if max_requests:
        wl = truncate(wl, max_requests=max_requests)
    if timed and rate:
        wl = scale_to_rate(wl, rate)
    if not wl.requests:
        raise InvalidInput(f"workload {trace!r} has no requests")
    return wl


def obtain_trace_profile(out: Path, degrees: Sequence[int], seed: int, workload: Workload,
                         truth: GroundTruth | None = None, *, per_degree: bool = False,
                         slo: SloTable = QWEN3_SLO, gpus: int | None = None
                         ) -> tuple[Profile, dict[str, Any]]:
    """The profile a sweep uses when no profile file is given: Ê fitted on the sim backend
    (``out/profile``, as ``vertumnus profile`` writes it) and κ_C measured on ``workload``'s own
    traffic (:func:`sim.profiling.trace_kappa`: a routed pool replaying the trace, its requests
    in order at their arrival gaps, each with the prefix reuse its history showed), cached as
    ``out/profile/kappa_<key>.json``. ``out/profile/profile.json``
    is rewritten with that κ. Returns the profile and the κ report.

    Why per trace: §6.1 profiles κ on the operator's own traffic. The default profile's κ is
    measured on the embedded synthetic mix (mean 7.6K tokens), which says little about the
    Azure code trace (mean 2K tokens, arrivals in bursts); see sim/profiling.py
    ``TRACE_KAPPA_RAMP``. κ measured this way is a pooled capacity, so it is used with
    ``kappa_scale`` 1.0 (:func:`run_simulate`). ``slo``: the TTFT deadlines κ must keep
    (the ramp's attainment target is measured against them). ``gpus``: the pool κ is for
    (a pool too small for the ramp's 8 workers of a degree is measured with as many as it
    holds: :func:`sim.profiling.ramp_pools`).
    """
    from sim.profiling import PROFILE_FILE, TRACE_KAPPA_RAMP, cached_trace_kappa, run_profile

    degs = sorted(set(degrees))
    truth = truth or GroundTruth()
    # Ê and κ on the same hardware (κ's ramp replays the trace on `truth`'s machine).
    fitted, _ = run_profile(out / "profile", degrees=sorted(set(degrees) | {1}), seed=seed,
                            measure_kappas=False, truth=truth, per_degree=per_degree)
    prof, report = cached_trace_kappa(fitted, workload, out / "profile", degrees=degs, seed=seed,
                                      ramp=replace(TRACE_KAPPA_RAMP, slo=slo), pool_gpus=gpus,
                                      truth=truth)
    prof.save(out / "profile" / PROFILE_FILE)
    return prof, report


PROFILE_MISMATCH_OPTION = "--profile-mismatch-ok"
"""The CLI flag that lets a run use a profile fitted on other hardware (:func:`load_profile`)."""


def check_profile_hardware(prof: Profile, truth: GroundTruth, source: str | Path, *,
                           mismatch_ok: bool = False) -> None:
    """Raise :class:`InvalidInput` when profile ``prof`` (read from ``source``) was fitted on
    other hardware than the simulated ``truth``, naming what differs and how to proceed;
    nothing when ``mismatch_ok`` (a study of the model's error on other hardware).

    Two checks: the names (the file's ``model`` / ``hardware`` against ``truth``'s
    ``model.name`` / ``gpu.name``; a name the file does not record, ``"unknown"``, is not
    compared), then, names agreeing, the tables' figures: a profile that records the
    fingerprint of the table it was fitted on (:attr:`Profile.hardware_fingerprint`, what
    ``vertumnus profile --backend sim`` and a sweep write since session 65) must have
    ``truth``'s (:func:`sim.profiling.hardware_fingerprint`). A ``--hardware`` file that edits
    the default H20 table's figures but keeps its names passes the first and fails the second.
    A file without a fingerprint (written before, or a real engine's) gets the names' check
    alone.

    Why refuse: Ê and κ fitted on one machine mispredict every prefill on another (a profile
    fitted on H200 run on the default H20: prediction MAPE 0.49 against ~0.07), and the run's
    figures would silently measure that instead of the policies."""
    if mismatch_ok:
        return
    gpu = prof.hardware.removesuffix(" TP")  # a TP-kind profile's hardware is "<GPU> TP"
    diff = [f"{what} {mine!r} (the run's: {theirs!r})"
            for what, mine, theirs in (("model", prof.model, truth.model.name),
                                       ("GPU", gpu, truth.gpu.name))
            if mine != "unknown" and mine != theirs]
    if not diff and prof.hardware_fingerprint is not None:
        from sim.profiling import hardware_fingerprint

        theirs = hardware_fingerprint(truth)
        if prof.hardware_fingerprint != theirs:
            diff = [f"a hardware table with the same names (model {truth.model.name!r}, GPU "
                    f"{truth.gpu.name!r}) but other figures (its fingerprint "
                    f"{prof.hardware_fingerprint}, the run's {theirs})"]
    if diff:
        raise InvalidInput(
            f"--profile {source} was fitted on other hardware: {', '.join(diff)}; its "
            f"prefill-time model would mispredict every request. Give the run that hardware "
            f"(--hardware FILE), measure a profile of this one (leave --profile out, or "
            f"`vertumnus profile --backend sim` with the same --hardware), or pass "
            f"{PROFILE_MISMATCH_OPTION} to use it anyway (to study the model's error)")


def load_profile(profile_path: Path, degrees: Sequence[int], truth: GroundTruth | None = None,
                 *, mismatch_ok: bool = False) -> Profile:
    """``--profile``'s file, with κ for every degree in ``degrees``
    (:meth:`~shared.costmodel.Profile.load`), checked against the simulated hardware
    (:func:`check_profile_hardware`; ``truth`` None: the default hardware)."""
    prof = Profile.load(profile_path, degrees=degrees)
    check_profile_hardware(prof, truth or GroundTruth(), profile_path, mismatch_ok=mismatch_ok)
    return prof


def obtain_profile(profile_path: Path | None, out: Path, degrees: Sequence[int], seed: int,
                   truth: GroundTruth | None = None, *, per_degree: bool = False,
                   slo: SloTable = QWEN3_SLO, mismatch_ok: bool = False) -> Profile:
    """The fitted profile the policies use: a given file (refused when it records other
    hardware than ``truth``'s, unless ``mismatch_ok``: :func:`load_profile`), or one measured
    now on the sim backend of ``truth``'s hardware (written to ``out/profile``; κ under
    ``slo``). Never the ground truth itself."""
    if profile_path is not None:
        return load_profile(profile_path, degrees, truth, mismatch_ok=mismatch_ok)
    from sim.profiling import KappaRamp, run_profile

    degs = sorted(set(degrees) | {1})
    prof, _ = run_profile(out / "profile", degrees=degs, seed=seed,
                          truth=truth or GroundTruth(), per_degree=per_degree,
                          ramp=KappaRamp(slo=slo))
    return prof


def sweep_profile(profile_path: Path | None, out: Path, degrees: Sequence[int], seed: int,
                  workload: Workload, truth: GroundTruth, *, per_degree: bool = False,
                  slo: SloTable = QWEN3_SLO, gpus: int | None = None,
                  mismatch_ok: bool = False) -> tuple[Profile, dict[str, Any]]:
    """The profile a sweep uses and where its κ came from: the file given (its κ judged with
    ``KAPPA_SCALE`` unless the file says it is pooled: ``Profile.capacity_scale``; refused
    when it records other hardware than ``truth``'s, unless ``mismatch_ok``:
    :func:`load_profile`), else :func:`obtain_trace_profile` (κ measured on ``workload`` with
    a routed pool: a pooled capacity, so the sweep's ``kappa_scale`` is 1.0).
    """
    if profile_path is not None:
        return obtain_profile(profile_path, out, degrees, seed, truth,
                              mismatch_ok=mismatch_ok), {"source": str(profile_path)}
    prof, krep = obtain_trace_profile(out, degrees, seed, workload, truth, per_degree=per_degree,
                                      slo=slo, gpus=gpus)
    return prof, {"source": "trace", "cache_key": krep.get("key"), "cached": krep.get("cached"),
                  "replay_arrivals": krep["replay_arrivals"], "ramp": krep["ramp"],
                  "pool_workers": krep.get("pool_workers")}


# --- the run ---------------------------------------------------------------------------------
def pull_option(min_blocks: int, demote: bool | None = None) -> PullConfig | None:
    """The route-time pull for ``--pull-min-blocks`` and ``--pull-demote/--no-pull-demote``
    (None: the calibrated ``calibration.PULL.demote_source``): None for 0 (off); InvalidInput
    naming the option for anything but an integer >= 0 (or a demote that is not a bool)."""
    if isinstance(min_blocks, bool) or not isinstance(min_blocks, int) or min_blocks < 0:
        raise InvalidInput(f"--pull-min-blocks must be an integer >= 0 (0: no pull), "
                           f"got {min_blocks!r}")
    if demote is not None and not isinstance(demote, bool):
        raise InvalidInput(f"--pull-demote must be on or off, got {demote!r}")
    if not min_blocks:
        return None
    return PullConfig(min_blocks, calibration.PULL.demote_source if demote is None else demote)


def pull_credit_option(max_blocks: int) -> int:
    """J's pull credit for ``--pull-credit-blocks``: the longest copy J counts on (0: off);
    InvalidInput naming the option for anything but an integer >= 0."""
    if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 0:
        raise InvalidInput(f"--pull-credit-blocks must be an integer >= 0 (0: J counts only "
                           f"what is held), got {max_blocks!r}")
    return max_blocks


def check_pull_credit(pull_min_blocks: int | None, pull_credit_blocks: int | None) -> None:
    """The credit's longest copy may not be below the pull's shortest (None: the calibrated
    value; a pull that is off makes the credit moot). InvalidInput naming both options."""
    lo = calibration.PULL.min_blocks if pull_min_blocks is None else pull_min_blocks
    hi = calibration.PULL_CREDIT_BLOCKS if pull_credit_blocks is None else pull_credit_blocks
    if lo and hi and hi < lo:
        raise InvalidInput(f"--pull-credit-blocks ({hi}) must be 0 or at least "
                           f"--pull-min-blocks ({lo})")


def run_simulate(
    *,
    trace: str,
    fmt: str = "auto",
    policies: Sequence[str],
    rate_scales: Sequence[float],
    rate: float | None = None,
    gpus: int = 40,
    degrees: Sequence[int] = (2, 4),
    seed: int = 0,
    out: Path,
    profile_path: Path | None = None,
    max_requests: int | None = None,
    cache_blocks_per_gpu: int | None = None,
    beta: float | None = None,
    lam: float | None = None,
    beta_queue_scale: float | None = None,
    beta_busy_power: float | None = None,
    progress: bool = False,
    spec_overrides: Mapping[str, Any] | None = None,
    workload: Workload | None = None,
    jobs: int = 1,
    truth: GroundTruth | None = None,
    per_degree: bool = False,
    repeats: int = 1,
    warmup_s: float = 0.0,
    slo: SloTable = QWEN3_SLO,
    controller: ControllerConfig | None = None,
    pull_min_blocks: int | None = None,
    pull_credit_blocks: int | None = None,
    pull_demote: bool | None = None,
    pull_wait: bool | None = None,
    request_log: bool = False,
    pending_credit: bool | None = None,
    profile_mismatch_ok: bool = False,
) -> dict[str, Any]:
    """Run the sweep and write every output; returns ``{"rows": [...], "meta": {...}}``.

    ``request_log``: each cell also writes its per-request log into ``out/requests/``
    (:mod:`sim.request_log`: one CSV per policy, rate and seed; meta.json's ``request_log``).

    ``pull_min_blocks``: vertumnus's route-time pull (services/cachemgr/pull.py) with this
    ``min_blocks``, 0 for none, None for the calibrated one (``calibration.PULL``).
    ``pull_credit_blocks``: J counts on that pull for copies of up to this many blocks
    (services/scheduler/placement.py ``PullCredit``), 0 for never, None for the calibrated
    ``calibration.PULL_CREDIT_BLOCKS``; it must not be below the pull's ``min_blocks``.
    ``pull_demote``: whether a landed pull demotes the source's copy (None: the calibrated
    ``calibration.PULL.demote_source``; moot without a pull). ``pull_wait``: the credit also
    where the request waits for the copy (``PullCredit.wait``; None: the calibrated
    ``calibration.PULL_WAIT``). ``pending_credit``: the credit also counts a prefix pending
    after a split or merge (``SimConfig.pending_credit``; None: the calibrated
    ``calibration.PENDING_CREDIT``, on).

    ``slo``: the TTFT deadlines by prompt length that SLO attainment counts, and that κ is
    measured to keep when the profile is measured here (default: paper Table 2, Qwen3).

    ``repeats`` N > 1 runs the whole sweep once per seed ``seed`` … ``seed + N − 1`` and reports
    the mean of each figure (:func:`sim.experiments.combine_repeats`; each row's ``runs`` lists
    every seed's), as §9.1 does with three runs. A seed draws the trace's arrivals where the
    format leaves them to chance (ticks spread within their tick, L-Eval's Poisson process, the
    synthetic generator) and the ground truth's noise; the profile is measured once, on the
    first seed's trace (it is offline work). ``workload`` given: every seed runs it as it is.
    ``warmup_s``: see :attr:`sim.experiments.ExperimentSpec.warmup_s`. ``controller``: the
    thresholds of every adaptive pool (default: the calibrated ones; a ``--controller`` file,
    :mod:`services.controller.config_file`); meta.json records the setting used.

    ``jobs``: worker processes for the sweep's cells (same results; see ``sweep``).
    ``truth``: the simulated hardware (default: the note's Qwen3-30B-A3B on H20;
    :mod:`sim.hardware` reads one from a file); the profile measured here is fitted on it,
    and meta.json records it. ``per_degree``: that profile fits one coefficient set per
    degree (:func:`sim.profiling.run_profile`).

    The profile: ``profile_path`` as given (its κ judged with ``calibration.KAPPA_SCALE`` when it
    is a single worker's, as ``vertumnus profile`` measures it; as it is when the file says it
    is pooled, as a sweep's own ``DIR/profile/profile.json``), else one measured now with κ on
    this trace (:func:`obtain_trace_profile`, κ pooled: ``kappa_scale`` 1.0). ``spec_overrides``
    may still set ``kappa_scale``. meta.json records the κ source. A file that records another
    model or GPU than ``truth``'s is refused (:class:`InvalidInput`) unless
    ``profile_mismatch_ok`` (:func:`check_profile_hardware`).
    """
    check_counts(jobs=jobs, repeats=repeats)
    check_gpus(gpus)
    check_cache_blocks(cache_blocks_per_gpu)
    check_pools(gpus, degrees, policies=policies, gpus_per_node=(spec_overrides or {}).get(
        "gpus_per_node", ExperimentSpec.gpus_per_node))
    check_seed(seed)
    check_warmup_s(warmup_s)
    check_policies(policies)
    # The pull as asked for (checked now, used below); absent: the spec's calibrated one.
    set_pull = pull_min_blocks is not None or pull_demote is not None
    pull = pull_option(calibration.PULL.min_blocks if pull_min_blocks is None
                       else pull_min_blocks, pull_demote) if set_pull else None
    if pull_credit_blocks is not None:
        pull_credit_option(pull_credit_blocks)
    if pull_wait is not None and not isinstance(pull_wait, bool):
        raise InvalidInput(f"--pull-wait must be on or off, got {pull_wait!r}")
    check_pending_credit(pending_credit)
    if not isinstance(request_log, bool):
        raise InvalidInput(f"--requests must be on or off, got {request_log!r}")
    check_pull_credit(pull_min_blocks, pull_credit_blocks)
    ctl = controller_overrides(controller)
    truth = truth or GroundTruth()
    wl = workload or load_trace(trace, fmt, seed=seed, rate=rate, max_requests=max_requests)
    seeds = [seed + k for k in range(repeats)]
    # Every seed's trace, checked before anything runs or is written (the profile is the
    # first seed's).
    wls = [wl] + [wl if workload is not None else load_trace(
        trace, fmt, seed=sd, rate=rate, max_requests=max_requests) for sd in seeds[1:]]
    for w in wls:
        check_span(w, rate_scales)
        check_rate(w, rate_scales, rate=rate)  # a one-request trace has none
        _check_warmup(w, rate_scales, warmup_s)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prof, kappa_info = sweep_profile(profile_path, out, degrees, seed, wl, truth,
                                     per_degree=per_degree, slo=slo, gpus=gpus,
                                     mismatch_ok=profile_mismatch_ok)
    overrides = {**ctl, **(spec_overrides or {})}
    if set_pull:
        overrides["pull"] = pull
    if pull_credit_blocks is not None:
        overrides["pull_credit_blocks"] = pull_credit_blocks
    if pull_wait is not None:
        overrides["pull_wait"] = pull_wait
    if pending_credit is not None:
        overrides["pending_credit"] = pending_credit
    overrides.setdefault("kappa_scale", prof.capacity_scale(calibration.KAPPA_SCALE))
    spec = ExperimentSpec(gpus=gpus, degrees=tuple(sorted(degrees)), seed=seed,
                          cache_blocks_per_gpu=cache_blocks_per_gpu, beta=beta, lam=lam,
                          beta_queue_scale=beta_queue_scale,
                          beta_busy_power=beta_busy_power, warmup_s=warmup_s, slo=slo,
                          **overrides)
    kappa_info["kappa_scale"] = spec.kappa_scale
    log_dir = out / "requests" if request_log else None
    t0 = time.perf_counter()

    def run_all(cb: Callable[[str, float], None]) -> tuple[list[dict[str, Any]], Any]:
        runs = [sweep(w, policies, rate_scales, prof, replace(spec, seed=sd), truth,
                      on_run=cb, jobs=jobs, request_log=log_dir)
                for sd, w in zip(seeds, wls, strict=True)]
        if len(runs) == 1:
            return runs[0]
        side = dict(runs[0][1])  # the first seed's compositions and timelines
        if "static_threshold_tokens" in side:
            side["static_threshold_tokens_by_seed"] = {
                str(sd): r[1]["static_threshold_tokens"] for sd, r in zip(seeds, runs,
                                                                          strict=True)}
        return combine_repeats([r[0] for r in runs], seeds), side

    rows, side = _with_progress(progress, len(policies) * len(rate_scales) * repeats, run_all)
    meta = {
        "workload": wl.name,
        "workload_stats": _jsonable(workload_stats(wl)),
        # A generated workload's parameters: a workload file (`--format synthetic`) as it is.
        "synthetic": _jsonable(wl.metadata.get("config")),
        "gpus": gpus,
        "degrees": list(spec.degrees),
        "seed": seed,
        "seeds": seeds,
        "warmup_s": spec.warmup_s,
        "slo": slo_to_dict(slo),
        "cache_blocks_per_gpu": cache_blocks_per_gpu,
        "profile": prof.to_dict(),
        "kappa": kappa_info,
        "controller": config_to_mapping(spec.controller),
        "pull_min_blocks": spec.pull.min_blocks if spec.pull is not None else 0,
        "pull_credit_blocks": spec.pull_credit_blocks if spec.pull is not None else 0,
        "pull_demote": spec.pull.demote_source if spec.pull is not None else False,
        "pull_wait": spec.pull_wait if spec.pull is not None else False,
        "pending_credit": spec.pending_credit if spec.pull is not None else False,
        "hardware": ground_truth_to_mapping(truth),
        "request_log": "requests" if request_log else None,
        "wall_s": time.perf_counter() - t0,
        **_jsonable(side),
    }
    comparison = write_outputs(out, rows, meta)
    return {"rows": rows, "meta": meta, "comparison": comparison}


def controller_overrides(controller: ControllerConfig | None) -> dict[str, Any]:
    """ExperimentSpec fields for a controller setting (``--controller FILE``): the config, and
    its window H as the spec's (the §6.1 starting composition counts windows of H too); none
    for None (the calibrated setting)."""
    if controller is None:
        return {}
    if not isinstance(controller, ControllerConfig):
        raise InvalidInput(f"controller must be a ControllerConfig, got {controller!r}")
    return {"controller": controller, "window_s": controller.window_s}


def check_cache_blocks(cache_blocks_per_gpu: int | None) -> None:
    """``--cache-blocks-per-gpu``: None (the HBM budget) or an integer >= 1."""
    if cache_blocks_per_gpu is not None and (
            isinstance(cache_blocks_per_gpu, bool) or not isinstance(cache_blocks_per_gpu, int)
            or cache_blocks_per_gpu < 1):
        raise InvalidInput(f"--cache-blocks-per-gpu must be an integer >= 1 (0: the HBM "
                           f"budget), got {cache_blocks_per_gpu!r}")


def check_policies(policies: Sequence[str]) -> None:
    """Raise :class:`InvalidInput` for no policies, an unknown one or one named twice (its
    rows would repeat)."""
    twice = sorted({p for i, p in enumerate(policies) if p in policies[:i]})
    if twice:
        raise InvalidInput(f"policies repeat: {', '.join(twice)}")
    unknown = [p for p in policies if p not in ALL_POLICIES]
    if unknown:
        raise InvalidInput(f"unknown policies {unknown}; known: {', '.join(ALL_POLICIES)}")
    if not policies:
        raise InvalidInput("no policies given")


def check_counts(**counts: object) -> None:
    """Each ``--name`` is an integer >= 1 (else :class:`InvalidInput`)."""
    for name, v in counts.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InvalidInput(f"--{name} must be an integer >= 1, got {v!r}")


MAX_GPUS = 16384
"""Largest pool a run takes: 16,384 GPUs build in seconds; far larger ones take minutes and
gigabytes before the first request (a mistyped --gpus)."""


def check_gpus(gpus: object, name: str = "gpus") -> None:
    """``--gpus`` is an integer in [1, :data:`MAX_GPUS`] (else :class:`InvalidInput`)."""
    if isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= MAX_GPUS:
        raise InvalidInput(f"--{name} must be an integer in [1, {MAX_GPUS}], got {gpus!r}")


def check_seed(seed: object) -> None:
    """A seed is an integer >= 0, what numpy's generators take (else :class:`InvalidInput`,
    before anything runs rather than numpy's error deep in a run)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InvalidInput(f"--seed must be an integer >= 0, got {seed!r}")


def check_span(wl: Workload, rate_scales: Sequence[float]) -> None:
    """Every rate's arrivals must span at most :data:`~sim.workloads.parsing.MAX_SPAN_S`
    (scaling the rate by s divides the span by s): the simulator steps through every window
    of it, so a tiny ``--rate-scale`` or ``--rate`` would run for hours or exhaust memory."""
    for s in rate_scales:
        span = wl.duration_s / s
        if not span <= MAX_SPAN_S:
            raise InvalidInput(
                f"at rate ×{s:g} the trace's arrivals would span {span / 86400:.3g} days; the "
                f"simulator takes at most {MAX_SPAN_S / 86400:.0f} (raise --rate-scale or "
                f"--rate)")


def _check_warmup(wl: Workload, rate_scales: Sequence[float], warmup_s: float) -> None:
    """Every rate must leave requests after the warm-up (arrival times shrink by the scale)."""
    if warmup_s <= 0 or not wl.requests:
        return
    arr = [r.arrival_s for r in wl.requests]
    span = max(arr) - min(arr)
    for s in rate_scales:
        if not span / s >= warmup_s:
            raise InvalidInput(
                f"--warmup {warmup_s:g} s leaves no request at rate ×{s:g}: the trace's arrivals "
                f"span {span / s:.1f} s there")


def run_tune(
    *,
    trace: str,
    fmt: str = "auto",
    rate_scales: Sequence[float],
    betas: Sequence[float],
    lams: Sequence[float],
    rate: float | None = None,
    gpus: int = 40,
    degrees: Sequence[int] = (2, 4),
    seed: int = 0,
    out: Path,
    profile_path: Path | None = None,
    max_requests: int | None = None,
    progress: bool = False,
    jobs: int = 1,
    truth: GroundTruth | None = None,
    per_degree: bool = False,
    repeats: int = 1,
    slo: SloTable = QWEN3_SLO,
    beta_busy_power: float | None = None,
    controller: ControllerConfig | None = None,
    controllers: Sequence[tuple[str, ControllerConfig]] = (),
    profile_mismatch_ok: bool = False,
) -> dict[str, Any]:
    """``vertumnus tune``: :func:`sim.tuning.tune_weights` on a trace, with the profile a
    sweep would use (:func:`run_simulate`: the file given, else fitted on ``truth`` with κ
    measured on the trace); writes ``out/tune.json`` (rows, pairs best first, the best, the
    run's settings) and ``out/tune.csv`` (the rows). Returns what tune.json holds.
    ``repeats`` N > 1: every cell is the mean over seeds ``seed`` … ``seed + N − 1`` (as
    :func:`run_simulate`'s). ``beta_busy_power``: k of the busy-share β for every pair (None:
    the calibrated default; 0: the paper's constant β). ``controller``: the controller's
    thresholds for every cell (default: the calibrated ones); ``controllers``: (label, setting)
    pairs, a third axis of the grid (:func:`sim.tuning.tune_weights`), instead of one.
    ``profile_mismatch_ok``: as :func:`run_simulate`'s."""
    from services.scheduler.placement import check_beta_busy, check_weights
    from sim.tuning import ROW_KEYS, tune_weights

    check_counts(jobs=jobs, repeats=repeats)
    check_gpus(gpus)
    check_pools(gpus, degrees, policies=("vertumnus",))
    check_seed(seed)
    # J's weights now, not after the profile is measured (tune_weights checks them again).
    for b in betas:
        check_weights(b, 0.0)
    for lam in lams:
        check_weights(1.0, lam)
    if beta_busy_power is not None:
        check_beta_busy(beta_busy_power)
    ctl = controller_overrides(controller)
    if controller is not None and controllers:
        raise InvalidInput("give one controller setting or a list of them, not both")
    for _, c in controllers:
        controller_overrides(c)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    truth = truth or GroundTruth()
    wl = load_trace(trace, fmt, seed=seed, rate=rate, max_requests=max_requests)
    check_span(wl, rate_scales)
    check_rate(wl, rate_scales, rate=rate)
    prof, _ = sweep_profile(profile_path, out, degrees, seed, wl, truth, per_degree=per_degree,
                            slo=slo, gpus=gpus, mismatch_ok=profile_mismatch_ok)
    spec = ExperimentSpec(gpus=gpus, degrees=tuple(sorted(degrees)), seed=seed, slo=slo,
                          kappa_scale=prof.capacity_scale(calibration.KAPPA_SCALE),
                          beta_busy_power=beta_busy_power, **ctl)
    more = [(seed + k, load_trace(trace, fmt, seed=seed + k, rate=rate,
                                  max_requests=max_requests)) for k in range(1, repeats)]
    n = len(set(betas)) * len(set(lams)) * len(rate_scales) * repeats * max(1, len(controllers))
    result = _with_progress(progress, n, lambda cb: tune_weights(
        wl, rate_scales, betas, lams, prof, spec, truth, jobs=jobs, on_run=cb,
        more_seeds=more, controllers=controllers))
    result["meta"] = {"workload": wl.name, "gpus": gpus, "degrees": list(spec.degrees),
                      "seed": seed, "seeds": [seed + k for k in range(repeats)],
                      "rate_scales": list(rate_scales), "slo": slo_to_dict(slo),
                      "beta_busy_power": calibration.BETA_BUSY_POWER
                      if beta_busy_power is None else beta_busy_power,
                      **({"controllers": {lab: config_to_mapping(c) for lab, c in controllers}}
                         if controllers else {"controller": config_to_mapping(spec.controller)}),
                      "profile": prof.to_dict(), "hardware": ground_truth_to_mapping(truth)}
    write_text_atomic(out / "tune.json", json.dumps(_jsonable(result), indent=1) + "\n")
    keys = list(ROW_KEYS)
    if controllers:
        keys.insert(keys.index("lam") + 1, "controller")
    with (out / "tune.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
        w.writeheader()
        w.writerows(result["rows"])
    return result


def run_size(
    *,
    trace: str,
    fmt: str = "auto",
    policies: Sequence[str],
    rate_scale: float,
    target: float = 0.9,
    gpus_min: int | None = None,
    gpus_max: int = 80,
    step: int | None = None,
    rate: float | None = None,
    degrees: Sequence[int] = (2, 4),
    seed: int = 0,
    out: Path,
    profile_path: Path | None = None,
    max_requests: int | None = None,
    progress: bool = False,
    jobs: int = 1,
    truth: GroundTruth | None = None,
    per_degree: bool = False,
    slo: SloTable = QWEN3_SLO,
    warmup_s: float = 0.0,
    controller: ControllerConfig | None = None,
    on_warning: Callable[[str], None] | None = None,
    profile_mismatch_ok: bool = False,
) -> dict[str, Any]:
    """``vertumnus size``: the smallest pool (GPUs) with which each policy keeps token-weighted
    SLO attainment >= ``target`` on the trace at ``rate_scale`` (:mod:`sim.sizing`), with the
    profile a sweep would use (:func:`run_simulate`). Writes ``out/size.json`` (per policy: the
    answer and every evaluated size), ``out/size.csv`` (the evaluated sizes) and
    ``out/size.png`` (attainment against GPUs). ``controller``: the adaptive pools' thresholds
    (default: the calibrated ones). Everything is checked before anything runs.

    A ``target`` above the zero-queue oracle's attainment by more than
    :data:`ORACLE_NOISE_MARGIN` is refused (:class:`InvalidInput`: no pool can reach it); one
    above it by less is searched anyway (noise lets a run beat the oracle), told to
    ``on_warning`` before the search and recorded as size.json's ``meta.above_oracle``.
    ``profile_mismatch_ok``: as :func:`load_profile`'s ``mismatch_ok``."""
    from sim.sizing import size_pools

    sizes = check_size(policies=policies, rate_scale=rate_scale, target=target, jobs=jobs,
                       seed=seed, warmup_s=warmup_s, degrees=degrees, gpus_min=gpus_min,
                       gpus_max=gpus_max, step=step)
    ctl = controller_overrides(controller)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    truth = truth or GroundTruth()
    wl = load_trace(trace, fmt, seed=seed, rate=rate, max_requests=max_requests)
    check_span(wl, [rate_scale])
    check_rate(wl, [rate_scale], rate=rate)
    _check_warmup(wl, [rate_scale], warmup_s)
    # No pool beats the zero-queue oracle (each request alone on its best degree, every
    # earlier prefix cached): a target above its attainment cannot be met by any size.
    ceiling = oracle_attainment(wl, truth, degrees, slo, warmup_s,
                                tp_degrees=oracle_tp_degrees(policies, degrees))
    above = None
    if target > ceiling + ORACLE_NOISE_MARGIN:
        raise InvalidInput(
            f"--target {target:g} is above what any pool can reach on this trace: even the "
            f"zero-queue oracle (each request alone on an idle worker of its best degree, "
            f"every earlier prefix cached) meets the SLO for {ceiling:.1%} of tokens")
    if target > ceiling:
        # Within the noise: the oracle is noise-free, and a noisy run can beat it by a few
        # tenths of a point, so the search may still find a size.
        above = (f"--target {target:.1%} is above the zero-queue oracle's {ceiling:.1%}; "
                 f"searched anyway (a run's noise can beat the noise-free oracle by a few "
                 f"tenths of a point), but a pool may meet it by luck or not at all")
        if on_warning is not None:
            on_warning(above)
    if profile_path is not None:
        prof = load_profile(profile_path, degrees, truth, mismatch_ok=profile_mismatch_ok)
        profiles, kappa_info = {g: prof for g in sizes}, {"source": str(profile_path)}
    else:
        profiles, kappa_info = trace_profiles_by_size(out, degrees, seed, wl, truth, sizes,
                                                      per_degree=per_degree, slo=slo)
        prof = profiles[sizes[-1]]
    spec = ExperimentSpec(gpus=sizes[-1], degrees=tuple(sorted(degrees)), seed=seed, slo=slo,
                          warmup_s=warmup_s,
                          kappa_scale=prof.capacity_scale(calibration.KAPPA_SCALE), **ctl)
    t0 = time.perf_counter()
    results = _with_progress(progress, len(policies), lambda cb: size_pools(
        wl, policies, rate_scale, profiles, spec, truth, target=target, sizes=sizes, jobs=jobs,
        on_done=lambda pol: cb(pol, rate_scale)))
    summary = {
        "policies": results,
        "meta": {"workload": wl.name, "rate_scale": rate_scale, "target": target,
                 "sizes": sizes, "degrees": list(spec.degrees), "seed": seed,
                 "slo": slo_to_dict(slo), "warmup_s": warmup_s, "kappa": kappa_info,
                 "oracle_slo_attainment": ceiling, "above_oracle": above,
                 "controller": config_to_mapping(spec.controller),
                 "profile": prof.to_dict(), "hardware": ground_truth_to_mapping(truth),
                 "wall_s": time.perf_counter() - t0},
    }
    write_text_atomic(out / "size.json", json.dumps(_jsonable(summary), indent=1) + "\n")
    write_size_outputs(out, summary)
    return summary


ORACLE_NOISE_MARGIN = 0.01
"""How far (a fraction: 1 point) ``size --target`` may lie above the zero-queue oracle's SLO
attainment and still be searched: the oracle is noise-free, and noisy runs beat it by a few
tenths of a point where prompts sit at their deadline (89.5% oracle, 90.2% reached on the
Mooncake trace ×2; docs/evaluation.md)."""


def check_size(*, policies: Sequence[str], rate_scale: float, target: float, jobs: int,
               seed: int, warmup_s: float, degrees: Sequence[int], gpus_min: int | None,
               gpus_max: int, step: int | None) -> list[int]:
    """:func:`run_size`'s arguments checked as they are given (nothing read or run): raises
    :class:`InvalidInput` for a bad one, or for pools the search's sweeps would refuse
    (:func:`sim.experiments.check_pools`: ``homo_cp2`` where the smallest degree is not 2);
    returns the pool sizes the search tries (:func:`sim.sizing.pool_sizes`)."""
    from sim.sizing import pool_sizes

    check_policies(policies)
    if isinstance(target, bool) or not isinstance(target, int | float) or not 0 < target <= 1:
        raise InvalidInput(f"--target must be an SLO attainment in (0, 1], got {target!r}")
    if not (rate_scale > 0 and math.isfinite(rate_scale)):
        raise InvalidInput(f"--rate-scale must be a finite number > 0, got {rate_scale!r}")
    check_counts(jobs=jobs)
    check_gpus(gpus_max, "gpus-max")
    check_seed(seed)
    check_warmup_s(warmup_s)
    sizes = pool_sizes(degrees, gpus_min, gpus_max, step)
    # What each size's sweep would refuse, refused before the profiles are measured (homo_cp2
    # without a smallest degree of 2 was refused only at the first sweep). Every size is a
    # multiple of the largest degree, so the pools that fit the smallest fit them all; the
    # smallest is also the cheapest lattice to build.
    try:
        check_pools(sizes[0], degrees, policies=policies)
    except InvalidInput as exc:
        if not str(exc).startswith("--gpus"):
            raise  # a rule of the names and degrees alone (homo_cp2's), whatever the size
        # size has no --gpus: say which pool the count is.
        raise InvalidInput(f"the pool of {sizes[0]} GPUs (the smallest size tried): {exc}"
                           ) from None
    return sizes


def write_size_outputs(out: Path, summary: Mapping[str, Any]) -> None:
    """size.csv (every evaluated pool size of every policy) and size.png from a size summary
    (what size.json holds)."""
    from sim.sizing import POINT_KEYS

    target = summary["meta"]["target"]
    with (out / "size.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["policy", *POINT_KEYS, "meets"])
        w.writeheader()
        for r in summary["policies"]:
            for pt in r["points"]:
                att = pt["slo_attainment"]
                why = pt.get("failed_by_reason")
                w.writerow({"policy": r["policy"], **_jsonable(pt),
                            "failed_by_reason": format_failed_by_reason(why)
                            if isinstance(why, Mapping) else None,
                            "meets": att is not None and att >= target})
    _plot_size(out, summary)


def print_size_table(summary: Mapping[str, Any], file: IO[str]) -> None:
    """Each policy's answer, its figures there and the sizes tried."""
    from rich.console import Console
    from rich.table import Table

    meta = summary["meta"]
    slo = meta.get("slo") or {}
    oracle = meta.get("oracle_slo_attainment")
    t = Table(title=f"{meta['workload']} ×{meta['rate_scale']:g}: fewest GPUs for "
              f"{100 * meta['target']:g}% SLO attainment ({slo.get('name', '?')}"
              + (f"; the zero-queue oracle reaches {100 * oracle:.1f}%)"
                 if oracle is not None else ")"))
    for col in ("policy", "GPUs", "SLO % there", "mean TTFT there (s)", "tried"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in summary["policies"]:
        at = next((p for p in r["points"] if p["gpus"] == r["gpus"]), None)
        t.add_row(r["policy"], str(r["gpus"]) if r["gpus"] else f"> {meta['sizes'][-1]}",
                  f"{100 * at['slo_attainment']:.1f}" if at else "-",
                  f"{at['mean_ttft_s']:.3f}" if at else "-",
                  ", ".join(str(p["gpus"]) for p in r["points"]))
    console = Console(file=file, width=140)
    console.print(t)
    c = compare_sizes(summary["policies"])
    baselines = sum(r["policy"] != c["subject"] for r in summary["policies"]) if c else 0
    line = _size_line(c, meta["sizes"][-1], baselines=baselines)
    if line:
        console.print(line)
    lost = _size_failed_line(summary["policies"])
    if lost:
        console.print(lost)
    ceiling_note = meta.get("above_oracle")
    if ceiling_note:
        console.print(f"note: {ceiling_note}")


def _reasons_cell(counts: Any, legend: Mapping[str, str], named: dict[str, str]) -> str:
    """`` (no_memory 3, too_long 1)`` for a ``failed_by_reason`` mapping ('' for none, or
    for what a file written before it holds); each reason of ``legend`` it names (a key
    such as ``too_long+no_memory`` names two) is added to ``named`` for the line's legend."""
    if not isinstance(counts, Mapping) or not counts:
        return ""
    for key in counts:
        for part in str(key).split("+"):
            if part in legend:
                named.setdefault(part, legend[part])
    return " (" + ", ".join(f"{k} {_count(v)}" for k, v in sorted(counts.items())) + ")"


def _size_failed_line(policies: Sequence[Mapping[str, Any]]) -> str:
    """The line under the size table when a size tried lost requests ('' when none did): each
    policy's sizes with failed requests, how many and why (a point's ``failed_by_reason``,
    absent in a size.json written before it), each reason explained once. A failed request
    misses its SLO: a size that loses many is not met because of it."""
    legend = failure_reasons()
    named: dict[str, str] = {}
    parts = []
    for r in policies:
        for pt in r["points"]:
            n = pt.get("failed")
            if not isinstance(n, int | float) or isinstance(n, bool) or n <= 0:
                continue
            why = _reasons_cell(pt.get("failed_by_reason"), legend, named)
            parts.append(f"{r['policy']} with {pt['gpus']} GPUs {_count(n)}{why}")
    if not parts:
        return ""
    reasons = ("; ".join(f"{k}: {v}" for k, v in named.items()) + ". ") if named else ""
    return ("failed requests: " + "; ".join(parts) + ". " + reasons
            + "They count as SLO misses")


def _size_line(c: Mapping[str, Any] | None, largest: int, *, baselines: int = 1) -> str:
    """One sentence on :func:`sim.comparison.compare_sizes`' answer ('' without vertumnus).
    ``baselines``: how many baseline policies the search ran (0: nothing is said of them,
    since none was evaluated)."""
    if c is None:
        return ""
    if c["gpus"] is None:
        return (f"{c['subject']} does not meet the target with {largest} GPUs"
                + ("" if not baselines else f"; {c['best_baseline']} does with {c['best_gpus']}"
                   if c["best_baseline"] else "; no baseline does either"))
    if c["best_baseline"] is None:
        return (f"{c['subject']} needs {c['gpus']} GPUs"
                + (f"; no baseline meets the target with {largest}" if baselines else
                   " (no baseline was run: add them to --policies to compare)"))
    d = c["saved_gpus"]
    how = (f"{d} fewer than" if d > 0 else f"{-d} more than" if d < 0 else "as many as")
    return (f"{c['subject']} needs {c['gpus']} GPUs, {how} the best baseline, "
            f"{c['best_baseline']} ({c['best_gpus']}"
            + (f"; {100 * c['saved_share']:.1f}% of its pool saved)" if d > 0 else ")"))


def trace_profiles_by_size(out: Path, degrees: Sequence[int], seed: int, workload: Workload,
                           truth: GroundTruth, sizes: Sequence[int], *,
                           per_degree: bool = False, slo: SloTable = QWEN3_SLO
                           ) -> tuple[dict[int, Profile], dict[str, Any]]:
    """The profile of each pool size: Ê fitted once, κ measured on the trace for each distinct
    set of ramp pools the sizes give (:func:`sim.profiling.ramp_pools`; sizes of 8 or more
    workers per degree share one). Returns the profiles by size and what κ each size took."""
    from sim.profiling import TRACE_KAPPA_RAMP, cached_trace_kappa, ramp_pools, run_profile

    degs = sorted(set(degrees))
    ramp = replace(TRACE_KAPPA_RAMP, slo=slo)
    fitted, _ = run_profile(out / "profile", degrees=sorted(set(degrees) | {1}), seed=seed,
                            measure_kappas=False, truth=truth, per_degree=per_degree)
    by_pools: dict[tuple[tuple[int, int], ...], Profile] = {}
    profiles: dict[int, Profile] = {}
    info: dict[str, Any] = {"source": "trace", "by_size": {}}
    for g in sizes:
        pools = tuple(sorted(ramp_pools(ramp, degs, g).items()))
        if pools not in by_pools:
            by_pools[pools], _ = cached_trace_kappa(fitted, workload, out / "profile",
                                                    degrees=degs, seed=seed, ramp=ramp,
                                                    pool_gpus=g, truth=truth)
        profiles[g] = by_pools[pools]
        info["by_size"][str(g)] = {"pool_workers": {str(c): n for c, n in pools},
                                   "kappa": {str(c): k for c, k in profiles[g].kappa.items()}}
    return profiles, info


def oracle_attainment(wl: Workload, truth: GroundTruth, degrees: Sequence[int], slo: SloTable,
                      warmup_s: float = 0.0, *, tp_degrees: Sequence[int] = ()) -> float:
    """Token-weighted SLO attainment of the zero-queue oracle (:func:`oracle_ttfts`) over the
    requests arriving after ``warmup_s``: an upper bound for any pool on this trace, up to the
    ground truth's noise (the oracle has none; a noisy run can beat it by a few tenths of a
    point where prompts sit at their deadline)."""
    ttft = oracle_ttfts(wl, truth, degrees, tp_degrees=tp_degrees)
    t0 = min(r.arrival_s for r in wl.requests)
    keep = [i for i, r in enumerate(wl.requests) if r.arrival_s >= t0 + warmup_s]
    return slo_attainment([wl.requests[i].input_len for i in keep], ttft[keep], slo)


def _plot_size(out: Path, summary: Mapping[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = summary["meta"]
    fig, ax = plt.subplots(figsize=(6, 4))
    for r in summary["policies"]:
        pts = [(p["gpus"], p["slo_attainment"]) for p in r["points"]
               if p["slo_attainment"] is not None]
        if pts:
            ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o",
                    label=f"{r['policy']}: {r['gpus'] or '>' + str(meta['sizes'][-1])} GPUs",
                    linewidth=2.5 if r["policy"] == "vertumnus" else 1.2)
    ax.axhline(100 * meta["target"], color="k", linestyle=":", label="target")
    ax.set_xlabel("Prefill-pool GPUs")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_title(f"{meta['workload']} ×{meta['rate_scale']:g}: GPUs to meet the SLO")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "size.png", dpi=110)
    plt.close(fig)


def _with_progress(enabled: bool, total: int, fn: Callable[[Callable[[str, float], None]], Any]
                   ) -> Any:
    if not enabled:
        return fn(lambda p, s: None)
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    # On stderr (conventions.md): stdout carries the tables, which a user may pipe or redirect.
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), transient=False,
                  console=Console(stderr=True)) as bar:
        task = bar.add_task("simulating", total=total)

        def cb(policy: str, scale: float) -> None:
            bar.update(task, advance=1, description=f"{policy} ×{scale:g}")

        return fn(cb)


def _jsonable(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if hasattr(x, "item"):
        return x.item()
    return x


# --- outputs ---------------------------------------------------------------------------------
def write_outputs(out: Path, rows: list[dict[str, Any]], meta: Mapping[str, Any],
                  comparison: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Write results.json / .csv, meta.json, comparison.json / .csv and the plots into ``out``;
    returns the comparison with the strongest baseline (``comparison``, when the caller has
    computed it from these rows already, else :func:`compare_with_baselines` of them), which
    :func:`print_table` shows when the summary carries it."""
    write_text_atomic(out / "results.json", json.dumps(_jsonable(rows), indent=1) + "\n")
    write_text_atomic(out / "meta.json", json.dumps(_jsonable(meta), indent=1) + "\n")
    with (out / "results.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(RESULT_KEYS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            why = r.get("failed_by_reason")
            # One cell (no_memory=139): a dict would be written as Python's repr.
            w.writerow({**r, "failed_by_reason": format_failed_by_reason(why)}
                       if isinstance(why, Mapping) else r)
    if comparison is None:
        comparison = compare_with_baselines(rows)
    (out / "comparison.json").write_text(json.dumps(_jsonable(comparison), indent=1) + "\n")
    with (out / "comparison.csv").open("w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(COMPARISON_KEYS))
        w.writeheader()
        for c in comparison:
            w.writerow(c)
    plot(out, rows, meta)
    if not meta.get("phase_mean_ttft_s"):
        # Not the reconfiguration preset (which writes these after this): an earlier reconfig
        # run's files in the same --out would pass for this run's.
        for stale in ("reconfig.json", "reconfig.png"):
            (out / stale).unlink(missing_ok=True)
    return comparison


def plot(out: Path, rows: Sequence[Mapping[str, Any]], meta: Mapping[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = list(dict.fromkeys(r["policy"] for r in rows))
    for key, label, fname, scale in (
        ("mean_ttft_s", "Mean TTFT (s)", "ttft_mean.png", 1.0),
        ("p90_ttft_s", "P90 TTFT (s)", "ttft_p90.png", 1.0),
        ("slo_attainment", "SLO attainment (%)", "slo.png", 100.0),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for pol in policies:
            mine = sorted((r for r in rows if r["policy"] == pol and r.get(key) is not None),
                          key=lambda r: r["request_rate"])
            if not mine:
                continue
            xs = [r["request_rate"] for r in mine]
            ys = [r[key] * scale for r in mine]
            line = ax.plot(xs, ys, marker="o", label=pol,
                           linewidth=2.5 if pol == "vertumnus" else 1.2)
            spread = _spread(mine, key, scale)
            if spread is not None:  # repeated runs: the seeds' range around the mean
                ax.errorbar(xs, ys, yerr=spread, fmt="none", capsize=2,
                            ecolor=line[0].get_color(), linewidth=0.8)
        if key == "mean_ttft_s":
            pts = sorted({(r["request_rate"], r["oracle_mean_ttft_s"]) for r in rows
                          if r.get("oracle_mean_ttft_s") is not None})
            # A marker too: with one rate the line is a single point, which a dotted line
            # alone does not draw.
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "k:", marker="x",
                    label="oracle (zero queue)")
        ax.set_xlabel("Request rate (req/s)")
        ax.set_ylabel(label)
        ax.set_title(f"{meta.get('workload', '')}: {meta.get('gpus')} GPUs, "
                     f"degrees {meta.get('degrees')}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
    timelines = meta.get("timelines") or {}
    if timelines:
        _plot_composition(out, timelines)
    else:  # no adaptive run here: an earlier run's plot in the same --out would pass for ours
        (out / "composition.png").unlink(missing_ok=True)


def _composition_steps(tl: Sequence[Any], degree: str) -> tuple[list[float], list[int]]:
    """The step line of ``degree``'s worker count in timeline ``tl`` ([time, {degree: n}]
    points: the start, each change, and, as sweeps and the reconfiguration preset write it
    since 2026-12-07, the run's end)."""
    xs: list[float] = []
    ys: list[int] = []
    for t, c in tl:
        if ys:
            xs.append(float(t))
            ys.append(ys[-1])
        xs.append(float(t))
        ys.append(int(c.get(degree, 0)))
    return xs, ys


def _plot_composition(out: Path, timelines: Mapping[str, Any]) -> None:
    """composition.png: vertumnus's workers of each degree over the run, one panel per degree
    (so that a rate's lines are told apart by colour alone), one colour per rate from a
    qualitative palette (a sequential one past 10 rates: the default cycle repeats its colours
    after 10), a marker at the start and at each change. A run without a reconfiguration
    draws its constant composition from the start to the run's end."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    scales = sorted(timelines, key=lambda k: float(k))
    degs = sorted({str(d) for tl in timelines.values() for _, c in tl for d in c}, key=int)
    cmap = plt.get_cmap("tab10" if len(scales) <= 10 else "viridis")
    colours = {s: cmap(i if len(scales) <= 10 else i / max(1, len(scales) - 1))
               for i, s in enumerate(scales)}
    fig, axes = plt.subplots(len(degs), 1, figsize=(8, 1.2 + 1.8 * len(degs)), sharex=True,
                             squeeze=False)
    for ax, d in zip(axes[:, 0], degs, strict=True):
        for i, scale in enumerate(scales):
            tl = timelines[scale]
            xs, ys = _composition_steps(tl, d)
            # Lower rates drawn wider, so that a later rate's line on the same count leaves
            # them visible at its sides.
            width = 1.2 + 2.0 * (len(scales) - 1 - i) / max(1, len(scales) - 1)
            # Markers at the start and at each change (every second point is a step's
            # corner); the last point is the run's end, no change.
            marks = [i for i in range(len(xs)) if i == 0 or (i < len(xs) - 1 and xs[i] == xs[
                i - 1] and ys[i] != ys[i - 1])]
            ax.plot(xs, ys, color=colours[scale], marker="o", markersize=3, markevery=marks,
                    linewidth=width, label=f"×{float(scale):g}")
        ax.set_ylabel(f"CP{d} workers")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of workers
        ax.grid(alpha=0.3)
    axes[0, 0].set_title("Vertumnus composition over time (by request-rate multiplier)")
    axes[-1, 0].set_xlabel("Time (s)")
    # Beside the panels, where it hides no line.
    axes[0, 0].legend(fontsize=7, ncol=1 if len(scales) <= 12 else 2, loc="upper left",
                      bbox_to_anchor=(1.01, 1.0), title="rate", title_fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "composition.png", dpi=110)
    plt.close(fig)


def _spread(rows: Sequence[Mapping[str, Any]], key: str, scale: float
            ) -> list[list[float]] | None:
    """Error bars (below, above the mean) spanning the seeds' values, when every row holds
    ``runs`` (``--repeats``) with ``key``; else None."""
    lo: list[float] = []
    hi: list[float] = []
    for r in rows:
        vals = [x[key] for x in r.get("runs") or () if isinstance(x, Mapping)
                and isinstance(x.get(key), int | float)]
        if len(vals) < 2:
            return None
        lo.append(max(0.0, (r[key] - min(vals)) * scale))
        hi.append(max(0.0, (max(vals) - r[key]) * scale))
    return [lo, hi]


REPORT_KEYS: tuple[str, ...] = (
    "policy", "rate_scale", "request_rate", "mean_ttft_s", "p50_ttft_s", "p90_ttft_s",
    "p99_ttft_s", "slo_attainment", "hit_rate", "reconfigurations", "oracle_mean_ttft_s",
)
"""The fields of a results.json row that ``vertumnus report`` reads (table and plots)."""


def _read_json(path: Path) -> Any:
    """The JSON in ``path``; :class:`InvalidInput` naming the file when it is a directory, is
    unreadable, is not UTF-8 or not JSON (a missing file is the caller's to check)."""
    if path_kind(path, "file") == "dir":
        raise InvalidInput(f"{path} is a directory, not a JSON file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidInput(f"{path} is not UTF-8 text (byte {exc.start}: {exc.reason})") from exc
    except OSError as exc:
        raise InvalidInput(f"cannot read {path}: {exc.strerror or exc}") from exc
    try:
        return parse_json(text)
    except NotJson as exc:
        raise InvalidInput(f"{path} is not valid JSON: {exc}") from None


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _check_rows(rows: Any, path: Path) -> list[dict[str, Any]]:
    """results.json's rows as :func:`redraw` needs them: a non-empty list of objects with
    every :data:`REPORT_KEYS` field (a figure may be null: a non-finite one is written so),
    and the optional fields the table shows (``failed``, ``requests``,
    ``failed_by_reason``, ``runs``) of their kind where present."""
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise InvalidInput(f"{path} is not a list of result rows")
    if not rows:
        raise InvalidInput(f"{path} has no result rows (an empty list)")
    for i, r in enumerate(rows):
        missing = [k for k in REPORT_KEYS if k not in r]
        if missing:
            raise InvalidInput(f"{path}: row {i} ({r.get('policy', '?')}) lacks "
                               f"{', '.join(missing)}")
        if not isinstance(r["policy"], str):
            raise InvalidInput(f"{path}: row {i}: policy is {r['policy']!r}, not a name")
        for k in REPORT_KEYS[1:]:
            v = r[k]
            # The rate is each plot's x: a row without one cannot be drawn.
            if not (_is_number(v) or (v is None and k not in ("rate_scale", "request_rate"))):
                raise InvalidInput(f"{path}: row {i} ({r['policy']}): {k} is {v!r}, "
                                   "not a number")
        if not r["rate_scale"] > 0 or not math.isfinite(r["rate_scale"]):
            raise InvalidInput(f"{path}: row {i} ({r['policy']}): rate_scale is "
                               f"{r['rate_scale']!r}, not a rate multiplier > 0")
        for k in ("failed", "requests"):  # the table's failed column, the line under it
            v = r.get(k)  # absent in rows written before failures were counted
            if not (v is None or _is_number(v)):
                raise InvalidInput(f"{path}: row {i} ({r['policy']}): {k} is {v!r}, "
                                   "not a number")
        why = r.get("failed_by_reason")  # the table's line under it names them
        if why is not None and not (isinstance(why, dict) and all(
                isinstance(k, str) and _is_number(v) and v >= 0 for k, v in why.items())):
            raise InvalidInput(f"{path}: row {i} ({r['policy']}): failed_by_reason is "
                               f"{why!r}, not counts of failed requests by reason")
        runs = r.get("runs")  # --repeats: each seed's figures (the plots' error bars)
        if runs is not None and not (isinstance(runs, list)
                                     and all(isinstance(x, dict) for x in runs)):
            raise InvalidInput(f"{path}: row {i} ({r['policy']}): runs is {runs!r}, not a "
                               "list of each seed's figures")
    return rows


_META_TYPES: dict[str, tuple[type, ...]] = {
    "workload": (str,), "gpus": (int,), "degrees": (list,), "seeds": (list,),
    "warmup_s": (int, float), "timelines": (dict,),
}


def _check_meta(meta: Any, path: Path) -> dict[str, Any]:
    """meta.json as :func:`redraw` reads it: an object whose fields it uses have their
    types (any may be absent or null)."""
    if not isinstance(meta, dict):
        raise InvalidInput(f"{path} is not a JSON object")
    for k, types in _META_TYPES.items():
        v = meta.get(k)
        if v is not None and (not isinstance(v, types) or isinstance(v, bool)):
            raise InvalidInput(f"{path}: {k} is {v!r}, not a {types[0].__name__}")
    return meta


def redraw(directory: Path) -> dict[str, Any]:
    """``vertumnus report DIR``: rebuild CSV and plots from results.json / meta.json, or a
    ``vertumnus size`` directory's from its size.json (the summary gets ``"kind": "size"``).

    Raises :class:`InvalidInput` naming the file at fault, before anything is written, for a
    directory that is missing or is a file, or that holds both a results.json and a
    size.json (two runs in one ``--out``), a results.json / meta.json / size.json that
    cannot be read (a directory, not UTF-8, not JSON) or does not hold what a run writes (no
    rows, a row without a field the table or plots need), and for outputs that cannot be
    written into ``directory``."""
    d = Path(directory)
    if not d.exists():
        raise InvalidInput(f"{d}: no such directory")
    if not d.is_dir():
        raise InvalidInput(f"{d} is not a directory (give the directory a simulate or size "
                           "run wrote)")
    results, meta_path, size_path = d / "results.json", d / "meta.json", d / "size.json"
    if results.exists() and size_path.exists():
        # Two runs written into one --out (simulate and size): redrawing either would show
        # it as the directory's run, whichever came last.
        raise InvalidInput(f"{d} holds both a simulate run ({results.name}) and a size run "
                           f"({size_path.name}), written into one --out: report redraws one "
                           "run's directory; move the other run's files out of it")
    try:
        if not results.exists() and size_path.exists():
            summary = _read_json(size_path)
            if not isinstance(summary, dict):
                raise InvalidInput(f"{size_path} is not a size summary (not a JSON object)")
            try:
                # The table first (it writes nothing): what `report` prints must be there
                # before the CSV and plot are written (a point without mean_ttft_s, say).
                print_size_table(summary, file=io.StringIO())
                with _all_or_nothing(d) as staged:
                    write_size_outputs(staged, summary)
            except (KeyError, TypeError, AttributeError, ValueError, IndexError,
                    OverflowError) as exc:
                raise InvalidInput(f"{size_path} is not a size summary: {exc!r}") from exc
            return {**summary, "kind": "size"}
        if not results.exists():
            raise InvalidInput(f"{d} has no results.json (run vertumnus simulate first)")
        rows = _check_rows(_read_json(results), results)
        meta = _check_meta(_read_json(meta_path), meta_path) if meta_path.exists() else {}
        try:  # what write_outputs writes and print_table shows
            comparison = compare_with_baselines(rows)
        except InvalidInput as exc:
            raise InvalidInput(f"{results}: {exc}") from exc
        if meta.get("phase_mean_ttft_s") is not None:
            try:  # what print_table will show of a reconfig run's phases
                _phase_table(meta)
            except (KeyError, TypeError, AttributeError, ValueError, IndexError) as exc:
                raise InvalidInput(f"{meta_path}: phase_mean_ttft_s / phase_bounds are not "
                                   f"a reconfiguration run's: {exc!r}") from exc
        try:
            with _all_or_nothing(d) as staged:
                write_outputs(staged, rows, meta, comparison)
                if meta.get("phase_mean_ttft_s") and meta.get("all_timelines"):
                    from sim.presets import _plot_phases

                    # The reconfiguration preset's own plot, from what its meta.json holds.
                    _plot_phases(staged, [tuple(b) for b in meta["phase_bounds"]],
                                 meta["phase_mean_ttft_s"], meta["all_timelines"])
        except (KeyError, TypeError, AttributeError, ValueError, OverflowError) as exc:
            # The rows are checked above: what is left to fail is meta.json's content.
            raise InvalidInput(f"{meta_path} is not a simulate run's meta: {exc!r}") from exc
    except OSError as exc:
        raise InvalidInput(f"cannot write the report into {d}: {exc.strerror or exc}") from exc
    return {"rows": rows, "meta": meta, "comparison": comparison}


@contextlib.contextmanager
def _all_or_nothing(directory: Path) -> Iterator[Path]:
    """A scratch directory inside ``directory`` to write a report into; once the block ends
    without an error its files replace ``directory``'s (each by a rename), else nothing of
    ``directory`` changed. `report` redraws from the run's own files, so a failure half-way
    must not leave them half rewritten (a size.csv cut to its header, plots of another run)."""
    with tempfile.TemporaryDirectory(dir=directory, prefix=".report-") as tmp:
        staged = Path(tmp)
        yield staged
        for f in sorted(staged.rglob("*")):
            target = directory / f.relative_to(staged)
            if f.is_dir():
                target.mkdir(exist_ok=True)
            else:
                os.replace(f, target)


def _fmt(v: Any, spec: str, scale: float = 1.0) -> str:
    """A table cell: ``v`` (× ``scale``) formatted with ``spec``; '-' for a figure a run
    could not give (null in results.json)."""
    return "-" if v is None else format(v * scale, spec)


def _count(v: Any) -> str:
    """A count cell: the integer, or a mean over --repeats seeds to two decimals (3.33, not
    3.3333333333333335); '-' for null."""
    if v is None:
        return "-"
    if isinstance(v, int):  # exact, however large (float() would overflow past 1e308)
        return str(v)
    return str(int(v)) if float(v).is_integer() else f"{v:.2f}"


def print_table(summary: Mapping[str, Any], file: IO[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = summary["rows"]
    meta = summary["meta"]
    how = []
    if len(meta.get("seeds") or ()) > 1:
        how.append(f"mean of seeds {', '.join(str(x) for x in meta['seeds'])}")
    if meta.get("warmup_s"):
        how.append(f"after a {meta['warmup_s']:g} s warm-up")
    t = Table(title=f"{meta.get('workload', '')} — TTFT by policy and rate"
              + (f" ({'; '.join(how)})" if how else ""))
    for col in ("policy", "rate ×", "req/s", "failed", "mean s", "P50 s", "P90 s", "P99 s",
                "SLO %", "hit %", "reconf", "oracle s"):
        t.add_column(col, justify="right" if col != "policy" else "left")
    for r in rows:
        t.add_row(r["policy"], f"{r['rate_scale']:g}", f"{r['request_rate']:.2f}",
                  _count(r.get("failed")),
                  *(_fmt(r[k], ".3f") for k in ("mean_ttft_s", "p50_ttft_s", "p90_ttft_s",
                                                "p99_ttft_s")),
                  _fmt(r["slo_attainment"], ".1f", 100), _fmt(r["hit_rate"], ".1f", 100),
                  _count(r["reconfigurations"]),
                  _fmt(r["oracle_mean_ttft_s"], ".3f"))
    t.caption = _failed_caption(rows)
    t.caption_justify = "left"
    console = Console(file=file, width=140)
    console.print(t)
    comparison = summary.get("comparison")
    if comparison is None:  # a summary from elsewhere (a test's, an older caller's)
        comparison = compare_with_baselines(rows)
    if comparison:
        from rich.measure import Measurement

        ct = _comparison_table(comparison)
        # Its cells must not be cut: wider than the console where long policy names need it.
        need = Measurement.get(console, console.options.update_width(400), ct).maximum
        Console(file=file, width=max(console.width, need)).print(ct)
    if meta.get("phase_mean_ttft_s"):
        console.print(_phase_table(meta))


def _failed_caption(rows: Sequence[Mapping[str, Any]]) -> str | None:
    """The line under the results table when a row has failed requests (None when none has):
    which policy and rate lost how many and why (the row's ``failed_by_reason``, when it has
    one: :func:`sim.metrics.failures_by_reason`; each reason named is explained once), and
    what the figures beside them cover. A failed request misses its SLO
    (``slo_attainment`` counts it); the TTFT figures are over the completed requests only,
    while ``oracle_mean_ttft_s`` is over every measured request, failed ones included, so a
    mean below the oracle's is no contradiction there."""
    failing = [r for r in rows if isinstance(r.get("failed"), int | float) and r["failed"] > 0]
    if not failing:
        return None
    legend = failure_reasons()
    named: dict[str, str] = {}

    lost = "; ".join(f"{r['policy']} ×{r['rate_scale']:g} {_count(r['failed'])} of "
                     f"{_count(r.get('requests'))}"
                     f"{_reasons_cell(r.get('failed_by_reason'), legend, named)}"
                     for r in failing)
    reasons = ("; ".join(f"{k}: {v}" for k, v in named.items()) + ". ") if named else ""
    return ("failed requests: " + lost + ". " + reasons
            + "They count as SLO misses; the TTFT columns are over the completed requests, the "
            "oracle over all measured requests (failed ones included)")


def _pct(v: float | None) -> str:
    """A signed percentage cell for a fraction (−0.2 -> '-20.0%'); '-' for None."""
    return "-" if v is None else f"{v * 100:+.1f}%"


def _comparison_table(comparison: Sequence[Mapping[str, Any]]) -> Any:
    """Vertumnus (the ablation: the full cache manager) against the strongest baseline at each
    rate (:mod:`sim.comparison`): the baseline with the lowest mean and the change of the
    subject's mean against it, the same for P90 and SLO attainment against the baseline best
    on each, and the subject's mean over the zero-queue oracle's."""
    from rich.table import Table

    t = Table(title=f"{comparison[0]['subject']} against the strongest baseline (the lowest "
              "mean; P90 and SLO: the baseline best on each)")
    for col in ("rate ×", "mean s", "strongest", "its mean s", "Δ mean", "P90 s", "best P90",
                "Δ P90", "SLO %", "best SLO", "Δ SLO pts", "mean / oracle"):
        t.add_column(col, justify="left" if col.startswith(("strongest", "best")) else "right",
                     no_wrap=True)
    for c in comparison:
        t.add_row(f"{c['rate_scale']:g}", _fmt(c["mean_ttft_s"], ".3f"),
                  c["strongest_baseline"] or "-", _fmt(c["strongest_mean_ttft_s"], ".3f"),
                  _pct(c["mean_change"]), _fmt(c["p90_ttft_s"], ".3f"),
                  c["best_p90_baseline"] or "-", _pct(c["p90_change"]),
                  _fmt(c["slo_attainment"], ".1f", 100), c["best_slo_baseline"] or "-",
                  _fmt(c["slo_points"], "+.1f"), _fmt(c["mean_over_oracle"], ".2f"))
    failing = [c for c in comparison
               if any(c.get(k) for k in ("failed", "strongest_failed", "best_p90_failed"))]
    if failing:
        # Means and percentiles are over completed requests: say where the sides differ.
        t.caption = "failed requests (mean and P90 are over the completed ones): " + "; ".join(
            f"×{c['rate_scale']:g} {c['subject']} {_count(c.get('failed') or 0)}, "
            f"{c['strongest_baseline']} {_count(c.get('strongest_failed') or 0)}"
            + (f", {c['best_p90_baseline']} {_count(c.get('best_p90_failed') or 0)}"
               if c.get("best_p90_baseline") not in (None, c["strongest_baseline"]) else "")
            for c in failing)
    return t


def _phase_table(meta: Mapping[str, Any]) -> Any:
    """The reconfiguration preset's phases: each policy's mean TTFT per phase, vertumnus
    against the better fixed composition in each, and the windows from each phase change to
    the first reconfiguration and to following the phase (sim/presets.py
    ``windows_to_follow``)."""
    from rich.table import Table

    per: Mapping[str, Sequence[float]] = meta["phase_mean_ttft_s"]
    n = len(meta["phase_bounds"])
    t = Table(title="mean TTFT (s) by phase")
    t.add_column("", justify="left")
    for i, (a, b) in enumerate(meta["phase_bounds"]):
        t.add_column(f"S{i + 1} {a:g}-{b:g} s", justify="right")
    for label, vals in per.items():
        t.add_row(label, *(_fmt(v, ".3f") for v in vals))
    fixed = [v for k, v in per.items() if k != "vertumnus"]
    if "vertumnus" in per and fixed:
        cells = []
        for i in range(n):
            v = per["vertumnus"][i]
            known = [f[i] for f in fixed if f[i] is not None]
            b = min(known) if known else None
            # null: a phase without a completed request (written as null for NaN).
            ok = v is not None and b is not None and b > 0 and math.isfinite(v / b)
            cells.append(f"{(v / b - 1) * 100:+.1f}%" if ok else "-")
        t.add_row("vertumnus vs better fixed", *cells)

    def windows(key: str) -> list[str]:
        return ["-", *("none" if x is None else str(x) for x in meta.get(key, ()))]

    if "windows_to_first_reaction" in meta:
        t.add_row("windows to first reconfiguration", *windows("windows_to_first_reaction"))
    if "windows_to_follow" in meta:
        t.add_row("windows to follow the phase", *windows("windows_to_follow"))
    return t


# --- presets (§9) ----------------------------------------------------------------------------
# A trace preset names its public trace by its path under the traces directory (``trace_file``),
# found when the preset runs (sim.workloads.public_trace): $VERTUMNUS_TRACES set after this
# module was imported counts, and a missing file is refused naming that variable.
PRESETS: dict[str, dict[str, Any]] = {
    "conversation": dict(
        desc="Qwen3-30B-A3B, 40 GPUs, {2,4}: Mooncake conversation trace, all policies, "
        "rising rate",
        trace_file="mooncake/conversation_trace.jsonl", fmt="mooncake",
        # The strongest baseline's SLO attainment runs from ~93% (×1) to ~50% (×4.8, all-CP2
        # homo_cp2 at 54% with the busy-share β; ×4.9 is 37%): the cliff is steep, hence the
        # fine steps at the top.
        rate_scales=[1.0, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 4.6, 4.7, 4.8],
    ),
    "leval": dict(
        desc="Qwen3-30B-A3B, 40 GPUs, {2,4}: L-Eval (Poisson arrivals), all policies",
        trace_file="leval/leval_llama3_mooncake.jsonl", fmt="leval", rate=2.0,
        rate_scales=[1.0, 1.5, 2.0, 2.5, 3.0],
    ),
    "azure-code": dict(
        desc="Qwen3-30B-A3B, 40 GPUs, {2,4}: Azure 2023 code trace (no prefix info)",
        trace_file="azure2023/AzureLLMInferenceTrace_code.csv", fmt="azure",
        rate_scales=[4.0, 8.0, 12.0, 16.0],
    ),
}


def preset_descriptions() -> dict[str, str]:
    from sim import presets

    out = {k: v["desc"] for k, v in PRESETS.items()}
    out.update(presets.descriptions())
    return out


PRESET_CHOICES: dict[str, tuple[str, ...]] = {
    "ablation": ("trace", "format", "rate", "rate_scale", "max_requests", "cache_blocks_per_gpu"),
    "reconfig": ("degrees", "fixed", "rate"),
}
"""The ``simulate`` options (parameter names) a preset leaves to the user; every other preset
fixes its trace, rates, cluster and profile. The ablation's workload is open because the
paper's (Mooncake's Tool-Agent trace) is not shipped (its default is a synthetic stand-in for
the trace's shape): a user who has it runs ``--preset ablation --trace
toolagent_trace.jsonl``. The reconfiguration preset's degrees and fixed compositions are open
because the paper's §9.3 runs degrees {4, 8} (DeepSeek, no ground truth here), the issue names
{2, 4} or {2, 4, 8}, and an operator compares against the pool they run today; its base
rate with them (sim/presets.py ``reconfig_base_rate``)."""


def check_pending_credit(pending_credit: object) -> None:
    """``--pending-credit`` is on, off or not given (None); else :class:`InvalidInput`."""
    if pending_credit is not None and not isinstance(pending_credit, bool):
        raise InvalidInput(f"--pending-credit must be on or off, got {pending_credit!r}")


def preset_choices(name: str) -> tuple[str, ...]:
    """:data:`PRESET_CHOICES` of ``name`` (none for an unknown name)."""
    return PRESET_CHOICES.get(name, ())


def check_preset(name: str, *, policies: Sequence[str] | None = None, repeats: int = 1,
                 warmup_s: float = 0.0) -> None:
    """Raise :class:`InvalidInput` for a name that is no preset (the empty name included), or
    ``policies`` / ``repeats`` / ``warmup_s`` given to a preset of fixed deployments (they
    apply to the trace presets, :data:`PRESETS`)."""
    known = preset_descriptions()
    if name not in known:
        raise InvalidInput(f"unknown preset {name!r}; known: {', '.join(known)}")
    if name in PRESETS:
        return
    if policies is not None:
        raise InvalidInput(f"preset {name!r} runs fixed deployments; --policies does not apply")
    if repeats != 1 or warmup_s:
        raise InvalidInput(f"preset {name!r} reports its phases as they run; --repeats and "
                           f"--warmup apply to the trace presets ({', '.join(PRESETS)})")


def run_preset(name: str, *, out: Path, seed: int = 0, progress: bool = False,
               policies: Sequence[str] | None = None, jobs: int = 1,
               truth: GroundTruth | None = None, per_degree: bool = False, repeats: int = 1,
               warmup_s: float = 0.0, slo: SloTable = QWEN3_SLO, trace: str | None = None,
               fmt: str = "auto", rate: float | None = None,
               rate_scales: Sequence[float] | None = None, max_requests: int | None = None,
               cache_blocks_per_gpu: int | None = None,
               controller: ControllerConfig | None = None,
               request_log: bool = False,
               pending_credit: bool | None = None,
               degrees: Sequence[int] | None = None,
               fixed: Sequence[str] | None = None) -> dict[str, Any]:
    """Run a named experiment. ``policies`` (the trace presets only; default: all eight
    compared policies), ``jobs`` (worker processes for a trace preset's sweep), ``truth``
    (the simulated hardware; default: the note's), ``per_degree`` (the profile's fit),
    ``repeats`` and ``warmup_s`` (the trace presets only; see :func:`run_simulate`) and
    ``slo`` (the TTFT deadlines). ``trace``, ``fmt``, ``rate``, ``rate_scales``,
    ``max_requests``, ``cache_blocks_per_gpu``, ``degrees`` and ``fixed`` (None / "auto":
    the preset's own) only where :data:`PRESET_CHOICES` allows them: the ablation's workload
    (a trace file or ``synthetic``, read as :func:`load_trace` reads it; ``max_requests`` or
    ``rate`` alone apply to its default workload), rates and cache size; the reconfiguration
    preset's degrees, its two fixed compositions (sim/presets.py ``reconfig_fixed``) and
    its base rate (``rate``, req/s before the phases' multipliers). ``controller``: the
    adaptive pools' thresholds (default: the calibrated ones); the ablation holds its
    composition fixed, so it takes none. ``request_log``: the trace presets' per-request
    logs (:func:`run_simulate`). ``pending_credit`` (the trace presets and ``reconfig``;
    None: the calibrated setting): J's credit of a pending prefix (:func:`run_simulate`);
    the ablation never reconfigures.
    Raises :class:`InvalidInput` as :func:`check_preset` does, for a choice the preset does
    not leave open, or for a rate a trace cannot take (:func:`check_rate`, as
    :func:`run_simulate`), before anything runs."""
    check_preset(name, policies=policies, repeats=repeats, warmup_s=warmup_s)
    check_seed(seed)
    if controller is not None and name == "ablation":
        raise InvalidInput("preset 'ablation' holds its composition fixed: a controller "
                           "setting does not apply to it")
    controller_overrides(controller)
    check_pending_credit(pending_credit)
    if pending_credit is not None and name == "ablation":
        raise InvalidInput("preset 'ablation' holds its composition fixed: nothing is ever "
                           "pending, so --pending-credit does not apply to it")
    if request_log and name not in PRESETS:
        raise InvalidInput(f"--requests: preset {name!r} writes no per-request log (the trace "
                           "presets do)")
    chosen = {"trace": trace, "format": None if fmt == "auto" else fmt, "rate": rate,
              "rate_scale": rate_scales, "max_requests": max_requests,
              "cache_blocks_per_gpu": cache_blocks_per_gpu, "degrees": degrees, "fixed": fixed}
    extra = [k for k, v in chosen.items() if v is not None and k not in preset_choices(name)]
    if extra:
        raise InvalidInput(f"preset {name!r} fixes {', '.join(extra)}")
    if name == "reconfig":
        from sim import presets

        # Checked before anything runs (the degrees, each composition on that lattice, the
        # rate); its workload is its phases, not a trace.
        degs, pair = presets.reconfig_fixed((2, 4) if degrees is None else degrees, fixed)
        base = presets.reconfig_base_rate(degs, rate)
        return presets.run(name, out=out, seed=seed, progress=progress, truth=truth,
                           per_degree=per_degree, slo=slo, controller=controller,
                           pending_credit=pending_credit, degrees=degs, fixed=pair,
                           base_rate=base)
    check_cache_blocks(cache_blocks_per_gpu)
    if rate_scales is not None and not (rate_scales and all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0
            for x in rate_scales)):
        raise InvalidInput(f"rate scales must be finite numbers > 0, got {list(rate_scales)!r}")
    workload = None
    if trace is not None or rate or max_requests or rate_scales is not None:
        if trace is not None:
            workload = load_trace(trace, fmt, seed=seed, rate=rate, max_requests=max_requests)
        else:  # the ablation's own workload, at the rate / length given
            from sim.presets import ablation_workload

            workload = ablation_workload(seed=seed, rate=rate, max_requests=max_requests)
        if rate_scales is not None:
            check_span(workload, rate_scales)
        # As run_simulate: a trace whose arrivals span no time has no rate to set or scale.
        check_rate(workload, (1.0,) if rate_scales is None else rate_scales, rate=rate)
    if name in PRESETS:
        p = dict(PRESETS[name])
        p.pop("desc")
        p["trace"] = str(public_trace(p.pop("trace_file"), needed_by=f"preset {name!r}"))
        pols = list(ALL_POLICIES[:8]) if policies is None else list(policies)
        return run_simulate(policies=pols, out=out, seed=seed, gpus=40,
                            degrees=(2, 4), progress=progress, jobs=jobs, truth=truth,
                            per_degree=per_degree, repeats=repeats, warmup_s=warmup_s,
                            slo=slo, controller=controller, request_log=request_log,
                            pending_credit=pending_credit, **p)
    from sim import presets

    return presets.run(name, out=out, seed=seed, progress=progress, truth=truth,
                       per_degree=per_degree, slo=slo, controller=controller,
                       pending_credit=pending_credit,
                       workload=workload,
                       rate_scales=None if rate_scales is None else tuple(rate_scales),
                       cache_blocks_per_gpu=cache_blocks_per_gpu)
