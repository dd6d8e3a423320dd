"""``vertumnus profile``, ``simulate`` and ``report``: evaluate policies before deploying."""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer

from shared.ids import InvalidInput
from vertumnus.cliargs import (
    SLO_HELP,
    beta_busy_option,
    beta_queue_option,
    check_seed,
    comma_list,
    degrees_option,
    input_file,
    j_weight,
    out_option,
    path_option,
    profile_file,
    slo_table,
    text_path_option,
    vtm_environment,
    writing_into,
)
from vertumnus.cliargs import fail as _fail

_DEFAULT_POLICIES = "vertumnus,static,homo,homo_cp2,sglang,vllm,dynamo,llmd"
# The default spelled with spaces: as one word it cannot wrap, and an 80-column help cut it.
# In parentheses: the help is rich markup, where "[default: ...]" is a tag and vanishes.
_POLICIES_HELP = ("Comma-separated policy names (default: "
                  + ", ".join(_DEFAULT_POLICIES.split(",")) + ")")


def _floats(text: str, name: str) -> list[float]:
    return list(comma_list(text, name, float, "numbers",
                           valid=lambda v: math.isfinite(v) and v > 0,
                           need="finite numbers > 0", unique=True))


def _weights(text: str, name: str) -> list[float]:
    """``tune``'s ``--beta`` / ``--lam`` grid: values J takes (:func:`j_weight`), each once
    (a repeated pair would be run twice and reported once)."""
    vals = comma_list(text, name, float, "numbers", unique=True)
    return [j_weight(v, name) for v in vals]


def _default_policies_for(policies: list[str], degrees: Sequence[int], given: bool
                          ) -> list[str]:
    """``policies`` as the run takes them: when ``--policies`` was not given (the default
    list) and the smallest of ``degrees`` is not 2, without ``homo_cp2`` (the all-CP2 pool,
    which such a lattice cannot run: :func:`sim.experiments.check_pools`), with a note on
    stderr; a list the user gave is left to that check (refused, naming the option)."""
    if given or "homo_cp2" not in policies or min(degrees) == 2:
        return policies
    typer.echo(f"note: homo_cp2 (the all-CP2 pool) left out of the default --policies: "
               f"--degrees {','.join(map(str, sorted(degrees)))} has no degree 2 as its "
               f"smallest", err=True)
    return [p for p in policies if p != "homo_cp2"]


def _names(text: str, name: str) -> list[str]:
    """Comma-separated names (``--policies``), each once: a repeated policy would repeat
    its rows."""
    return list(comma_list(text, name, str, "names", unique=True))


def _check(fn: Callable[..., object], *args: Any, **kwargs: Any) -> None:
    """Run a :mod:`sim.runner` check; its InvalidInput exits 2 with its message."""
    try:
        fn(*args, **kwargs)
    except InvalidInput as exc:
        _fail(str(exc))


def _keep_only_this_runs_logs(out: Path, summary: Mapping[str, Any], written: bool) -> None:
    """``DIR/requests/`` as a finished ``simulate`` leaves it: this run's per-request logs
    only (``written``: it was given ``--requests``). An earlier run's logs in a reused
    ``--out`` (another policy, rate or seed, or any at all when this run wrote none) would
    pass for this run's beside its results.json: they are removed, and the directory with
    them when nothing else is left in it. Only our logs (``<policy>_x<rate>_seed<seed>.csv``,
    :func:`sim.request_log.log_name`) go; other files stay."""
    from sim.request_log import log_name

    d = out / "requests"
    if not d.is_dir():
        return
    keep: set[str] = set()
    if written:
        meta = summary.get("meta") or {}
        seeds = meta.get("seeds") or [meta.get("seed", 0)]
        keep = {log_name(r["policy"], r["rate_scale"], sd)
                for r in summary.get("rows") or () for sd in seeds}
    for f in d.glob("*_x*_seed*.csv"):
        if f.name not in keep and f.is_file():
            f.unlink()
    if not written:
        with contextlib.suppress(OSError):
            d.rmdir()  # only when empty: a file of the user's keeps it


def _check_run_numbers(*, rate: float, max_requests: int) -> None:
    """``--rate`` (0: the default) and ``--max-requests`` (0: all) take no negative value."""
    if not (math.isfinite(rate) and rate >= 0):
        _fail(f"--rate must be a finite number of requests/s >= 0 (0: the default), got {rate}")
    if max_requests < 0:
        _fail(f"--max-requests must be an integer >= 0 (0: all), got {max_requests}")


def _check_per_degree(per_degree: bool, profile_path: Path | None) -> None:
    """``--per-degree`` shapes the profile a run measures, so it goes without ``--profile``
    (a file given is used as it is): refused together, exit 2."""
    if per_degree and profile_path is not None:
        _fail("--per-degree shapes the profile measured here; --profile gives one")


def _given(ctx: typer.Context, names: Iterable[str]) -> list[str]:
    """The options among ``names`` (parameter names) given explicitly, as their flags
    (``--rate-scale``), in ``names`` order."""
    flags = {p.name: p.opts[0] for p in ctx.command.params}
    # By the source's name: typer ships its own copy of click, whose ParameterSource enum is
    # not click's. A value equal to the default but typed out still counts as given.
    return [flags[n] for n in names
            if (src := ctx.get_parameter_source(n)) is not None
            and src.name not in ("DEFAULT", "DEFAULT_MAP")]


# What a preset fixes itself (sim/runner.py PRESETS, sim/presets.py): given with --preset,
# these would be ignored, so they are refused. --out, --seed, --jobs, --hardware,
# --per-degree, --slo (and, for the trace presets, --policies, --repeats, --warmup) apply;
# so do those of runner.PRESET_CHOICES (the ablation's workload, rates and cache size).
_PRESET_FIXES = ("trace", "format", "rate", "rate_scale", "gpus", "degrees", "profile_path",
                 "max_requests", "cache_blocks_per_gpu", "beta", "lam", "beta_queue_scale",
                 "beta_busy_power", "pull_min_blocks", "pull_credit_blocks", "pull_demote",
                 "pull_wait", "fixed", "profile_mismatch_ok")

# What each preset's refusal says it fixes (the trace presets: the default).
_PRESET_FIXED_WHAT = {"ablation": "its cluster and profile",
                      "reconfig": "its workload, GPUs and profile"}


_PER_DEGREE_HELP = ("Fit one cost-model coefficient set per CP degree, not one for all "
                    "(other hardware, e.g. H200: docs/evaluation.md)")
_HARDWARE_HELP = ("Simulated model and GPUs: a .json or .toml file (sim/hardware.py; "
                  "default: Qwen3-30B-A3B on H20)")


# Options that simulate and tune share (typer reads the Annotated aliases).
_Trace = Annotated[str, typer.Option(
    parser=text_path_option("--trace"), metavar="<str>",
    help="'synthetic', a trace file, or a .toml file of the synthetic generator's parameters "
         "(`vertumnus synthetic` prints one)")]
_Format = Annotated[
    str, typer.Option("--format", help="mooncake, azure, leval or synthetic (default: auto, "
                      "detected)")]
_Rate = Annotated[float, typer.Option(
    help="Base rate in req/s: L-Eval's and the synthetic workload's; a Mooncake or Azure "
         "trace's arrivals are rescaled to it, a mean gap of 1/RATE (after --max-requests; "
         "then --rate-scale multiplies it). 0: the default / the trace's own")]
# The on/off pairs' panel: their --no-... names take a column of their own, which in the one
# table of every option squeezed --cache-blocks-per-gpu to "--cache-blocks-per-…" at 80 columns.
_PULL_PANEL = "Vertumnus's route-time pull and J's credit for it"
# profile's own: it has no --max-requests or --rate-scale (its --workload is read whole).
_ProfileRate = Annotated[float, typer.Option(
    help="Base rate in req/s of --workload: L-Eval's and the synthetic workload's; a "
         "Mooncake or Azure trace's arrivals are rescaled to it, a mean gap of 1/RATE. 0: "
         "the default / the trace's own")]
_Out = Annotated[Path, typer.Option(parser=out_option, metavar="<path>",
                                    help="Output directory")]
_ProfileMismatchOk = Annotated[bool, typer.Option(
    "--profile-mismatch-ok",
    help="Use a --profile fitted on another model or GPU than the simulated one (refused "
    "otherwise; e.g. to study the cost model's error there)")]
_Gpus = Annotated[int, typer.Option(help="Prefill-pool GPUs")]
_Degrees = Annotated[str, typer.Option(help="CP degrees of the lattice")]
_ProfilePath = Annotated[
    Path | None, typer.Option("--profile", parser=path_option("--profile"), metavar="<path>",
                              help="Profile JSON (default: profile the sim)")]
_MaxRequests = Annotated[int, typer.Option(help="Truncate the trace (0: all)")]
_Hardware = Annotated[Path | None, typer.Option(parser=path_option("--hardware"),
                                                metavar="<path>", help=_HARDWARE_HELP)]
_Controller = Annotated[Path | None, typer.Option(
    "--controller", parser=path_option("--controller"), metavar="<path>",
    help="The adaptive pools' controller thresholds: a .toml or .json file "
    "(`vertumnus controller-config` prints the calibrated one; fields left out keep it)")]
_Slo = Annotated[str, typer.Option(help=SLO_HELP)]


def _controller(path: Path | None, *, option: bool = True) -> Any:
    """The controller setting of a ``--controller`` file (None: the calibrated one); raises
    InvalidInput naming the file and the bad key. ``option``: the path came from
    ``--controller`` (a path that is no readable file exits 2 naming the option)."""
    if path is None:
        return None
    from services.controller.config_file import load_controller_config

    if option:
        input_file(path, "controller")
    return load_controller_config(path)


def _changed(cfg: Any) -> list[str]:
    """The fields in which the controller setting ``cfg`` differs from the calibrated one."""
    from services.calibration import CONTROLLER
    from services.controller.config_file import config_to_mapping

    return [k for k, v in config_to_mapping(cfg).items() if v != getattr(CONTROLLER, k)]


def _say_controller(path: Path | None, cfg: Any) -> None:
    """One line after a run with ``--controller``: which thresholds the file changed."""
    if path is None or cfg is None:
        return
    changed = _changed(cfg)
    typer.echo(f"controller: {path} ("
               + (f"differs from the calibrated setting in {', '.join(changed)})" if changed
                  else "the calibrated setting)"))


def _truth(hardware: Path | None, *, option: bool = True) -> Any:
    """The ground truth of a ``--hardware`` file (None: the default); raises InvalidInput
    naming the file and the bad key. ``option``: the path came from ``--hardware`` (a path
    that is no readable file exits 2 naming the option)."""
    if hardware is None:
        return None
    from sim.hardware import load_ground_truth

    if option:
        input_file(hardware, "hardware")
    return load_ground_truth(hardware)


def _check_trace_blocks(trace: str, fmt: str, profile_path: Path | None) -> None:
    """The trace's cache blocks are the profile's, checked now: the simulator compares the
    two only when its first run starts, after the profile is measured and written into
    ``--out``. The profile's block size is 512 tokens for the one a run measures, ``--profile
    FILE``'s own otherwise; the trace's is a synthetic workload file's ``block_size`` (a
    ``--trace`` ``.toml``, or any file with ``--format synthetic``, read now), else 512 (every
    trace reader's and the built-in generator's). Exits 2 naming the synthetic file
    (:func:`sim.workloads.synthetic_file.check_block_size`) or the ``--profile``. A trace that
    is not a regular file is left to the run's own check, which names it."""
    from shared.costmodel import Profile
    from shared.ids import DEFAULT_BLOCK_SIZE
    from sim.workloads import detect_format
    from sim.workloads.synthetic_file import check_block_size, load_synthetic_config

    path = Path(trace)
    if trace != "synthetic" and not path.is_file():
        return
    try:
        if profile_path is None:
            want, whose = DEFAULT_BLOCK_SIZE, "the simulator's profile's"
        else:  # checked by profile_file: it loads
            want, whose = Profile.load(profile_path).block_size, f"--profile {profile_path}'s"
        if trace != "synthetic" and (fmt == "synthetic" or (
                fmt == "auto" and detect_format(path) == "synthetic")):
            cfg = load_synthetic_config(path)
            check_block_size(cfg.block_size, want, source=str(path), whose=whose)
        elif want != DEFAULT_BLOCK_SIZE:
            _fail(f"--profile {profile_path}: its cache blocks are {want} tokens (block_size), "
                  f"but the trace's are {DEFAULT_BLOCK_SIZE} (every trace reader's and the "
                  f"built-in synthetic workload's); give a profile of {DEFAULT_BLOCK_SIZE}-token "
                  "blocks, or a synthetic workload file of its block_size")
    except InvalidInput as exc:
        _fail(str(exc))


def _check_profile_hardware(profile_path: Path | None, degrees: Iterable[int], truth: Any,
                            mismatch_ok: bool) -> None:
    """A ``--profile`` fitted on another model or GPU than the simulated one (``truth``) is
    refused before anything runs or is written (InvalidInput: the caller exits 2), unless
    ``--profile-mismatch-ok`` (sim/runner.py ``check_profile_hardware``)."""
    if profile_path is None:
        return
    from sim import runner

    runner.load_profile(profile_path, list(degrees), truth, mismatch_ok=mismatch_ok)


def _check_pool_gpus(pool_gpus: int, degrees: Iterable[int]) -> None:
    """``profile --pool-gpus N``: a pool ``simulate --gpus N --degrees D`` takes with its
    default policies (D: the degrees κ is measured for), by simulate's own checks
    (:func:`sim.runner.check_gpus`, :func:`sim.experiments.check_pools`): a pooled κ is for
    the runs of that pool, and one measured for a pool no run can have (7 GPUs, or 6 with
    degree 4, whose all-CP4 baselines do not fit) describes none. Exits 2 naming the
    option."""
    from sim import runner

    degs = sorted(degrees)
    _check(runner.check_gpus, pool_gpus, "pool-gpus")
    try:
        runner.check_pools(pool_gpus, degs, policies=_names(_DEFAULT_POLICIES, "policies"),
                           names=False)  # the GPU count's check; homo_cp2's name is a run's
    except InvalidInput as exc:
        _fail(f"--pool-gpus {pool_gpus}: a pool `simulate --gpus {pool_gpus} --degrees "
              f"{','.join(map(str, degs))}` refuses, so a κ measured for it is for no run "
              f"({exc})")


def _check_report_input(directory: Path) -> None:
    """``report DIR``: the rates of what the redraw reads are finite numbers: every
    results.json row's ``rate_scale`` and ``request_rate`` (each plot's x, each row's key),
    or, without a results.json, a size.json's ``meta.rate_scale``; and a size.json sizes at
    least one policy.

    Python's JSON reader takes NaN and Infinity, and the redraw writes a non-finite number
    back as null (as a run writes a figure it could not give): a row keyed by a NaN rate
    would come back keyed by null. So it is refused, naming the file, the row and the
    field, before anything is written. A size.json whose ``policies`` is empty is no run's
    (``size`` refuses an empty --policies): its table, CSV and plot would be drawn empty,
    so it is refused too. What is missing or not JSON is left to the redraw's own checks,
    which name it."""
    from shared.files import NotJson, parse_json

    results, size = Path(directory) / "results.json", Path(directory) / "size.json"
    path = results if results.exists() else size  # the file the redraw reads (runner.redraw)
    try:
        data = parse_json(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, NotJson):
        return

    def bad(v: Any) -> bool:
        return isinstance(v, float) and not math.isfinite(v)

    if path == results and isinstance(data, list):
        for i, row in enumerate(data):
            for k in ("rate_scale", "request_rate"):
                if isinstance(row, dict) and bad(row.get(k)):
                    _fail(f"{path}: row {i} ({row.get('policy', '?')}): {k} is {row[k]!r}, "
                          "not a finite number (a row's rate must be one)")
    elif path == size and isinstance(data, dict):
        if isinstance(data.get("meta"), dict) and bad(v := data["meta"].get("rate_scale")):
            _fail(f"{path}: meta.rate_scale is {v!r}, not a finite number")
        pols = data.get("policies")
        if isinstance(pols, list | dict | str) and not pols:
            _fail(f"{path}: 'policies' is empty: a size run's summary holds at least one "
                  "policy's answer")


SUMMARY_MAX_REQUESTS = 200_000
"""Largest workload (requests at the configured rate) `vertumnus synthetic` generates to
report its delivered rate: one of 200,000 takes a few seconds."""

RATE_GAP = 0.10
"""Relative gap between the delivered and the configured mean rate past which `vertumnus
synthetic` says why they differ."""


def _synthetic_summary(cfg: Any, segs: Sequence[Mapping[str, float]]) -> list[str]:
    """`vertumnus synthetic`'s summary of ``cfg`` (a ``SyntheticConfig``; ``segs``: its
    :func:`~sim.workloads.synthetic.phase_table`): the configured segments, rates and long
    shares, then the workload generated for seed 0 (as simulate's default --seed): its
    requests and their mean rate over their arrivals' span (simulate's req/s), and a line
    saying why that rate differs from the configured time-weighted mean when it does by more
    than :data:`RATE_GAP`. The configured rate is the steady state's: a workload starts with
    no session under way, so follow-up turns build up over the first think times, and turns
    past the end are dropped (rate 2 over 60 s delivers 1.1 req/s; over 600 s, 1.9).
    Nothing is generated past :data:`SUMMARY_MAX_REQUESTS` expected requests."""
    from sim.workloads.synthetic import generate

    lo, hi = min(p["rate"] for p in segs), max(p["rate"] for p in segs)
    mean = sum(p["rate"] * (p["end_s"] - p["start_s"]) for p in segs) / cfg.duration_s
    def span(lo: float, hi: float) -> str:
        return f"{lo:g}" if lo == hi else f"{lo:g}-{hi:g}"

    shares = [p["long_share"] for p in segs]
    lines = [f"{cfg.duration_s:g} s in {len(segs)} segment(s) at {span(lo, hi)} req/s, long "
             f"share {span(min(shares), max(shares))}; configured mean {mean:.3g} req/s"]
    expected = mean * cfg.duration_s
    if expected > SUMMARY_MAX_REQUESTS:
        lines.append(f"delivered rate not measured: about {expected:,.0f} requests are more "
                     f"than this summary generates ({SUMMARY_MAX_REQUESTS:,})")
        return lines
    wl = generate(cfg, seed=0)
    n, span = len(wl), wl.duration_s
    if n < 2 or span <= 0:
        lines.append(f"generated (seed 0): {n} request(s), no arrival rate")
        return lines
    got = n / span
    lines.append(f"generated (seed 0): {n:,} requests over {span:.4g} s, delivered mean "
                 f"{got:.3g} req/s (simulate's req/s)")
    if mean > 0 and abs(got - mean) > RATE_GAP * mean:
        if got < mean and cfg.session_share > 0:
            lines.append(
                f"delivered {(mean - got) / mean:.0%} below the configured mean, the steady "
                f"state's (follow-up turns included): sessions start with none under way, "
                f"their follow-ups come think_time_s ({cfg.think_time_s:g} s) apart and those "
                f"past duration_s are dropped; a longer duration_s comes closer")
        else:
            lines.append(
                f"delivered {abs(got - mean) / mean:.0%} {'below' if got < mean else 'above'} "
                f"the configured mean: arrivals are random (Poisson), and {n} requests are "
                f"few enough to stray; another seed or a longer duration_s comes closer")
    return lines


def register(app: typer.Typer) -> None:
    @app.command()
    def profile(
        out: Annotated[Path, typer.Option(
            parser=out_option, metavar="<path>",
            help="Directory for profile.json, plot, report")
        ] = Path("runs/profile"),
        backend: Annotated[
            str, typer.Option(help="sim (ground truth) or torch (real engine)")
        ] = "sim",
        degrees: Annotated[str, typer.Option(help="CP degrees to profile")] = "1,2,4,8",
        seed: Annotated[int, typer.Option()] = 0,
        workload: Annotated[
            str, typer.Option(parser=text_path_option("--workload"), metavar="<str>",
                              help="Length mix for the κ ramp: 'synthetic' or a trace path")
        ] = "synthetic",
        format: _Format = "auto",
        rate: _ProfileRate = 0.0,
        pool_gpus: Annotated[
            int, typer.Option(help="Measure κ as `simulate` does on a trace: a routed pool for "
                              "this many GPUs replays the workload in order with its prefix "
                              "reuse; the profile is marked pooled (0: §6.1's single worker)")
        ] = 0,
        hardware: Annotated[
            Path | None, typer.Option(parser=path_option("--hardware"), metavar="<path>",
                                      help=_HARDWARE_HELP + " (sim backend)")
        ] = None,
        per_degree: Annotated[bool, typer.Option(help=_PER_DEGREE_HELP + " (sim backend)")
                              ] = False,
        slo: Annotated[str, typer.Option(help=SLO_HELP + "; κ_C is the demand that keeps it "
                                         "(sim backend)")] = "qwen3-30b-a3b",
        kappa_repeats: Annotated[
            int | None, typer.Option(
                help="Single-worker κ: the median of this many ramps per degree, each on "
                "streams of its own (one ramp's draw is 7-21% off; default 9; 1: one ramp per "
                "degree from shared streams, as figures before 2026-12-02 were measured)")
        ] = None,
        kappa_degrees: Annotated[
            str, typer.Option(
                help="Measure κ for these degrees only (each one of --degrees; default: all). "
                "With --pool-gpus N, '--degrees 1,D --kappa-degrees D' gives exactly the κ "
                "that 'simulate --trace T --gpus N --degrees D' measures")
        ] = "",
        model_path: Annotated[Path | None, typer.Option(
            parser=path_option("--model-path", "directory"), metavar="<path>",
            help="--backend torch: local HF-format Qwen3 checkpoint directory (default: "
            "rankd's, VTM_TORCH_MODEL_PATH, else its random model VTM_TORCH_MODEL_JSON)")
        ] = None,
        block_size: Annotated[int | None, typer.Option(
            help="--backend torch: the engine's cache block (page) size in tokens (default: "
            "rankd's, VTM_TORCH_BLOCK_SIZE, 16)")] = None,
        device: Annotated[str | None, typer.Option(
            help="--backend torch: cpu (gloo ranks) or cuda (NCCL, one rank per GPU) "
            "(default: rankd's, VTM_TORCH_DEVICE, cpu)")] = None,
        dtype: Annotated[str | None, typer.Option(
            help="--backend torch: float32, float64, bfloat16 or float16 (default: rankd's, "
            "VTM_TORCH_DTYPE, float32)")] = None,
    ) -> None:
        """Measure a (R, P, C) grid, fit Ê_C, report MAPE, measure κ_C, write the profile.

        --backend torch measures the engine rankd serves with: the model, block size,
        device, dtype and threads of its VTM_TORCH_* settings (the environment rankd reads),
        each of the first four overridden by its option here.

        With one degree the fit cannot tell a (per new token) from c (per new token, split
        over C): c is folded into a (c = 0), right at that degree only; the output says so.

        κ: by default §6.1's single worker on a Poisson stream of the workload's lengths,
        uncached (the controller multiplies it by the calibrated pool factor). With
        --pool-gpus N and a trace, the pooled κ of that trace, measured as 'simulate --trace
        T --gpus N' measures it (README), so an operator's profile of their own traffic needs
        no sweep.
        """
        if backend not in ("sim", "torch"):
            _fail(f"unknown backend {backend!r}; use 'sim' or 'torch'")
        if backend == "torch":  # reads rankd's VTM_TORCH_* (the sim backend reads no VTM_*)
            from services.rankd.torch_settings import TorchSettings

            vtm_environment(TorchSettings)
        check_seed(seed)
        degs = degrees_option(degrees)
        kdegs = degrees_option(kappa_degrees, "kappa-degrees") if kappa_degrees else None
        if kdegs is not None and not set(kdegs) <= set(degs):
            _fail(f"--kappa-degrees {kappa_degrees} must be among --degrees {degrees} "
                  f"(κ is measured with the Ê fitted on them)")
        table = slo_table(slo)
        _check_run_numbers(rate=rate, max_requests=0)
        if pool_gpus < 0:
            _fail(f"--pool-gpus must be an integer >= 0 (0: a single worker), got {pool_gpus}")
        if kappa_repeats is not None and kappa_repeats < 1:
            _fail(f"--kappa-repeats must be an integer >= 1, got {kappa_repeats}")
        if kappa_repeats is not None and pool_gpus:
            _fail("--kappa-repeats is for the single-worker κ; --pool-gpus measures κ on the "
                  "trace's own arrivals (one ramp)")
        if workload != "synthetic":
            input_file(Path(workload), "workload")
        if backend == "torch" and (hardware is not None or per_degree or table.bounds
                                   != slo_table("qwen3-30b-a3b").bounds or pool_gpus
                                   or workload != "synthetic" or kappa_repeats is not None
                                   or kdegs is not None):
            _fail("--hardware, --per-degree, --slo, --workload, --pool-gpus, "
                  "--kappa-repeats and --kappa-degrees are the sim backend's; the torch "
                  "backend measures the machine it runs on (no κ)")
        if backend == "sim" and (model_path is not None or block_size is not None
                                 or device is not None or dtype is not None):
            _fail("--model-path, --block-size, --device and --dtype are the torch backend's "
                  "(--backend torch: the engine it measures); the sim backend models its "
                  "hardware (--hardware)")
        if pool_gpus:
            _check_pool_gpus(pool_gpus, kdegs or degs)
        try:
            if backend == "sim":
                from sim.profiling import KAPPA_REPEATS, profile_command
                from sim.runner import load_trace

                truth = _truth(hardware)
                wl = load_trace(workload, format, seed=seed, rate=rate or None,
                                max_requests=None)
                with writing_into(out):
                    path = profile_command(out, backend="sim", degrees=degs, seed=seed,
                                           kappa_workload=wl, per_degree=per_degree,
                                           truth=truth, slo=table, pool_gpus=pool_gpus or None,
                                           kappa_repeats=kappa_repeats or KAPPA_REPEATS,
                                           kappa_degrees=kdegs)
            else:
                try:
                    from services.rankd.engine.profiling import rankd_engine, torch_profile_command
                except ModuleNotFoundError as exc:
                    _fail(f"the torch backend needs the 'engine' extra ({exc.name} missing)")
                # The engine rankd runs (VTM_TORCH_*), the options winning; checked before
                # anything is written or spawned.
                engine = rankd_engine(model_path=model_path, block_size=block_size,
                                      device=device, dtype=dtype)
                with writing_into(out):
                    path = torch_profile_command(out, degrees=degs, seed=seed, **engine)
        except InvalidInput as exc:
            _fail(str(exc))
        report = json.loads((Path(out) / "profile_report.json").read_text()) if (
            Path(out) / "profile_report.json").exists() else {}
        typer.echo(f"profile written to {path}")
        for k in ("coefficients", "fit_vs_measured", "fit_vs_truth", "kappa", "kappa_pooled"):
            if k in report:
                typer.echo(f"  {k}: {json.dumps(report[k])}")
        if len(degs) == 1:
            # shared.costmodel.fit_profile folds c into a when every sample has one degree
            # (R and R/C are then the same column): the fit is right at that degree, but
            # its c (and so any other degree's prediction) was never measured.
            typer.echo(f"warning: one degree profiled (--degrees {degs[0]}): c is not "
                       f"identifiable (R and R/C coincide), so it is folded into a (c = 0); "
                       f"the profile predicts degree {degs[0]} only. Profile two or more "
                       f"degrees to fit c.", err=True)

    @app.command()
    def simulate(
        ctx: typer.Context,
        trace: _Trace = "synthetic",
        format: _Format = "auto",
        policies: Annotated[
            str, typer.Option(help=_POLICIES_HELP, show_default=False)
        ] = _DEFAULT_POLICIES,
        rate_scale: Annotated[str, typer.Option(help="Arrival-rate multipliers")] = "1",
        rate: _Rate = 0.0,
        gpus: _Gpus = 40,
        degrees: _Degrees = "2,4",
        seed: Annotated[int, typer.Option()] = 0,
        out: _Out = Path("runs/simulate"),
        preset: Annotated[
            str | None, typer.Option(help="Named experiment of §9 (see --list-presets); it "
                                     "fixes the trace, rates, cluster and profile, so those "
                                     "options are refused with it (the ablation leaves its "
                                     "trace, rates and cache size open; reconfig its "
                                     "--degrees, --fixed and --rate)")
        ] = None,
        fixed: Annotated[str, typer.Option(
            help="--preset reconfig: its two fixed compositions, comma-separated, the one "
            "with more small workers first (the adaptive pool starts from it), e.g. "
            "6CP4/2CP8,4CP4/3CP8 with --degrees 4,8; default: the preset's pair for the "
            "degrees (2,4: 12CP2/4CP4, 4CP2/8CP4; 2,4,8: 12CP2/2CP4/1CP8, 4CP2/4CP4/2CP8; "
            "4,8: §9.3's 6CP4/2CP8, 4CP4/3CP8)")
        ] = "",
        list_presets: Annotated[bool, typer.Option("--list-presets")] = False,
        profile_path: _ProfilePath = None,
        profile_mismatch_ok: _ProfileMismatchOk = False,
        max_requests: _MaxRequests = 0,
        cache_blocks_per_gpu: Annotated[int, typer.Option(help="0: HBM budget")] = 0,
        beta: Annotated[float, typer.Option(help="β of J (0: calibrated default)")] = 0.0,
        lam: Annotated[float, typer.Option(help="λ of J (-1: calibrated default)")] = -1.0,
        beta_queue_scale: Annotated[float, typer.Option(
            help="τ of J's queue-following β, seconds of mean queueing delay: β's weight "
            "rises from 0 when the pool is idle to 1 at τ (0: off, the calibrated default)")
        ] = 0.0,
        beta_busy_power: Annotated[float, typer.Option(
            help="k of J's busy-share β: β_eff = 1 + (β − 1)·b^k, b the share of the pool's "
            "GPUs with work (0: β fixed, the paper's J; -1: the calibrated default)")
        ] = -1.0,
        pull_min_blocks: Annotated[int, typer.Option(
            rich_help_panel=_PULL_PANEL,
            help="vertumnus's route-time pull: copy a request's prefix to its worker from "
            "the worker holding the most of it when it lacks at least this many blocks "
            "(0: off; -1: the calibrated default)")
        ] = -1,
        pull_credit_blocks: Annotated[int, typer.Option(
            rich_help_panel=_PULL_PANEL,
            help="J counts on that pull (prices a worker whose queue covers the copy as "
            "holding the prefix) for copies of up to this many blocks (0: never; -1: the "
            "calibrated default)")
        ] = -1,
        pull_demote: Annotated[bool | None, typer.Option(
            "--pull-demote/--no-pull-demote", rich_help_panel=_PULL_PANEL,
            help="Once a pull has landed, demote the source's copy (evicted first: the pull "
            "is a move); default: the calibrated setting")
        ] = None,
        pull_wait: Annotated[bool | None, typer.Option(
            "--pull-wait/--no-pull-wait", rich_help_panel=_PULL_PANEL,
            help="J's pull credit also where the worker's queue is shorter than the copy: the "
            "request waits there for it to land; default: the calibrated setting")
        ] = None,
        pending_credit: Annotated[bool | None, typer.Option(
            "--pending-credit/--no-pending-credit", rich_help_panel=_PULL_PANEL,
            help="J's pull credit also counts a prefix pending at a worker after a split or "
            "merge (its reconcile copies; live: the scheduler's VTM_PENDING_CREDIT); "
            "default: the calibrated setting (on). Also with --preset reconfig and the "
            "trace presets")
        ] = None,
        jobs: Annotated[
            int, typer.Option(help="Worker processes for the sweep's (policy, rate) runs "
                              "(same results)")
        ] = 1,
        hardware: _Hardware = None,
        per_degree: Annotated[bool, typer.Option(
            help=_PER_DEGREE_HELP + " (the profile measured here, not a --profile file)")
        ] = False,
        repeats: Annotated[int, typer.Option(
            help="Run the sweep once per seed (--seed, --seed+1, ...) and report the mean of "
            "each figure, every seed's in each row's 'runs' (the paper averages 3 runs)")
        ] = 1,
        warmup: Annotated[float, typer.Option(
            help="Seconds (simulated, from each rate's first arrival) whose requests are run "
            "but not counted in TTFT, SLO or hit rate")
        ] = 0.0,
        slo: _Slo = "qwen3-30b-a3b",
        controller: _Controller = None,
        requests: Annotated[bool, typer.Option(
            "--requests",
            help="Also write each run's per-request log into DIR/requests/, one CSV per "
            "policy, rate and seed: queueing, prefill and hand-off time, reuse, deadline and "
            "worker of every request (the trace presets too). Logs an earlier run left in "
            "DIR/requests/ are removed either way: the directory holds this run's only")
        ] = False,
    ) -> None:
        """Compare policies on one trace over request rates; writes results.json, CSV, plots.

        Every option is checked before anything runs (exit 2 naming the problem).
        """
        from sim import runner

        if list_presets:
            for name, desc in runner.preset_descriptions().items():
                typer.echo(f"{name:24s} {desc}")
            return
        check_seed(seed)
        _check_per_degree(per_degree, profile_path)
        _check(runner.check_counts, jobs=jobs, repeats=repeats)
        _check(runner.check_warmup_s, warmup)
        table = slo_table(slo)
        if preset is not None:
            # --policies narrows a trace preset's policies only when given.
            chosen = _names(policies, "policies") if _given(ctx, ["policies"]) else None
            _check(runner.check_preset, preset, policies=chosen, repeats=repeats,
                   warmup_s=warmup)
            if requests and preset not in runner.PRESETS:
                _fail(f"--requests: preset {preset!r} writes no per-request log (the trace "
                      f"presets do: {', '.join(runner.PRESETS)})")
            open_ = runner.preset_choices(preset)
            refused = _given(ctx, [n for n in _PRESET_FIXES if n not in open_])
            if refused:
                what = _PRESET_FIXED_WHAT.get(preset, "its trace, rates, cluster and profile")
                _fail(f"--preset {preset!r} fixes {what}; leave out {', '.join(refused)} "
                      f"(or drop --preset)")
            if chosen is not None:
                _check(runner.check_policies, chosen)
            given = set(_given(ctx, open_))
            preset_args: dict[str, Any] = {}
            if "--trace" in given or "--format" in given:
                _check(runner.check_trace_format, trace, format)
                _check_trace_blocks(trace, format, None)  # the preset measures its profile
                preset_args.update(trace=trace, fmt=format)
            _check_run_numbers(rate=rate, max_requests=max_requests)
            if "--rate" in given:
                preset_args["rate"] = rate or None
            if "--max-requests" in given:
                preset_args["max_requests"] = max_requests or None
            if "--rate-scale" in given:
                preset_args["rate_scales"] = _floats(rate_scale, "rate-scale")
            if "--cache-blocks-per-gpu" in given:
                if cache_blocks_per_gpu < 1:
                    _fail(f"--preset {preset!r} sizes its caches to matter: "
                          f"--cache-blocks-per-gpu must be >= 1 (0, the HBM budget, is not "
                          f"offered), got {cache_blocks_per_gpu}")
                preset_args["cache_blocks_per_gpu"] = cache_blocks_per_gpu
            if "--degrees" in given:
                preset_args["degrees"] = degrees_option(degrees)
            if "--fixed" in given:
                preset_args["fixed"] = comma_list(fixed, "fixed", str, "compositions")
            if preset == "reconfig":
                from sim.presets import reconfig_fixed

                _check(reconfig_fixed, preset_args.get("degrees", (2, 4)),
                       preset_args.get("fixed"))
        else:
            if _given(ctx, ["fixed"]):
                _fail("--fixed names the fixed compositions of --preset reconfig; give it "
                      "with that preset (a sweep's pools are its --policies)")
            chosen = _names(policies, "policies")
            _check(runner.check_policies, chosen)
            _check(runner.check_trace_format, trace, format)
            _check(runner.check_gpus, gpus)
            _check_run_numbers(rate=rate, max_requests=max_requests)
            degs = degrees_option(degrees)
            chosen = _default_policies_for(chosen, degs, bool(_given(ctx, ["policies"])))
            _check(runner.check_pools, gpus, degs, policies=chosen)
            args: dict[str, Any] = dict(
                trace=trace, fmt=format, policies=chosen,
                rate_scales=_floats(rate_scale, "rate-scale"), rate=rate or None, gpus=gpus,
                degrees=degs, seed=seed, out=out,
                profile_path=profile_file(profile_path, degs),
                max_requests=max_requests or None,
                cache_blocks_per_gpu=cache_blocks_per_gpu or None,
                # 0 and -1 are the documented "calibrated default" of each weight.
                beta=j_weight(beta, "beta", default=0.0) or None,
                lam=None if j_weight(lam, "lam", default=-1.0) == -1.0 else lam,
                beta_queue_scale=beta_queue_option(beta_queue_scale) or None,
                beta_busy_power=beta_busy_option(beta_busy_power),
                jobs=jobs, per_degree=per_degree, repeats=repeats, warmup_s=warmup, slo=table,
                pull_min_blocks=None if pull_min_blocks == -1 else pull_min_blocks,
                pull_credit_blocks=None if pull_credit_blocks == -1 else pull_credit_blocks,
                pull_demote=pull_demote, pull_wait=pull_wait,
                profile_mismatch_ok=profile_mismatch_ok,
            )
            if pull_min_blocks != -1:
                _check(runner.pull_option, pull_min_blocks)
            if pull_credit_blocks != -1:
                _check(runner.pull_credit_option, pull_credit_blocks)
            _check(runner.check_pull_credit, args["pull_min_blocks"], args["pull_credit_blocks"])
            _check_trace_blocks(trace, format, profile_path)
        try:
            truth = _truth(hardware)
            if preset is None:
                _check_profile_hardware(args["profile_path"], degs, truth, profile_mismatch_ok)
            ctl = _controller(controller)
            with writing_into(out):
                if preset is not None:
                    summary = runner.run_preset(preset, out=out, seed=seed, progress=True,
                                                policies=chosen, jobs=jobs, truth=truth,
                                                per_degree=per_degree, repeats=repeats,
                                                warmup_s=warmup, slo=table, controller=ctl,
                                                request_log=requests,
                                                pending_credit=pending_credit, **preset_args)
                else:
                    summary = runner.run_simulate(**args, truth=truth, progress=True,
                                                  controller=ctl, request_log=requests,
                                                  pending_credit=pending_credit)
                _keep_only_this_runs_logs(out, summary, requests)
        except InvalidInput as exc:
            _fail(str(exc))
        runner.print_table(summary, file=sys.stdout)
        _say_controller(controller, ctl)
        typer.echo(f"results in {out}/results.json (plots: {out}/*.png)")
        if requests:
            typer.echo(f"per-request logs in {out}/requests/")

    @app.command()
    def tune(
        trace: _Trace = "synthetic",
        format: _Format = "auto",
        rate_scale: Annotated[str, typer.Option(help="Arrival-rate multipliers")] = "2,3.5",
        beta: Annotated[str, typer.Option(help="β values of J to try (>= 1)")] = "1,1.5,2,3",
        lam: Annotated[str, typer.Option(help="λ values of J to try (>= 0)")] = "0,0.25,0.5,1",
        rate: _Rate = 0.0,
        gpus: _Gpus = 40,
        degrees: _Degrees = "2,4",
        seed: Annotated[int, typer.Option()] = 0,
        out: _Out = Path("runs/tune"),
        profile_path: _ProfilePath = None,
        profile_mismatch_ok: _ProfileMismatchOk = False,
        max_requests: _MaxRequests = 0,
        jobs: Annotated[int, typer.Option(help="Worker processes for each pair's rates")] = 1,
        hardware: _Hardware = None,
        per_degree: Annotated[bool, typer.Option(help=_PER_DEGREE_HELP)] = False,
        repeats: Annotated[int, typer.Option(
            help="Judge each pair by the mean over this many seeds (--seed, --seed+1, ...)")
        ] = 1,
        slo: _Slo = "qwen3-30b-a3b",
        beta_busy_power: Annotated[float, typer.Option(
            help="k of J's busy-share β for every pair (0: β constant, the paper's J; -1: the "
            "calibrated default)")] = -1.0,
        controller: Annotated[str | None, typer.Option(
            "--controller", help="Controller file(s), .toml or .json (`vertumnus "
            "controller-config`); several, comma-separated ('calibrated': the calibrated "
            "setting), are a third axis: every pair runs with each")] = None,
    ) -> None:
        """Choose J's β and λ for a trace and hardware: vertumnus at every pair, over rates.

        With several --controller files, choose among them too."""
        from rich.console import Console
        from rich.table import Table

        from sim import runner

        check_seed(seed)
        _check_per_degree(per_degree, profile_path)
        _check(runner.check_counts, jobs=jobs, repeats=repeats)
        _check(runner.check_trace_format, trace, format)
        _check(runner.check_gpus, gpus)
        _check_run_numbers(rate=rate, max_requests=max_requests)
        degs = degrees_option(degrees)
        _check(runner.check_pools, gpus, degs, policies=("vertumnus",))  # tune runs only it
        args: dict[str, Any] = dict(
            trace=trace, fmt=format, rate_scales=_floats(rate_scale, "rate-scale"),
            betas=_weights(beta, "beta"), lams=_weights(lam, "lam"), rate=rate or None,
            gpus=gpus, degrees=degs, seed=seed, out=out,
            profile_path=profile_file(profile_path, degs), max_requests=max_requests or None,
            jobs=jobs, per_degree=per_degree, repeats=repeats, slo=slo_table(slo),
            beta_busy_power=beta_busy_option(beta_busy_power),
            profile_mismatch_ok=profile_mismatch_ok)
        _check_trace_blocks(trace, format, profile_path)
        files = [] if controller is None else _names(controller, "controller")
        try:
            truth = _truth(hardware)
            _check_profile_hardware(args["profile_path"], degs, truth, profile_mismatch_ok)
            # One file: every pair runs with it; several: a third axis, labelled as given.
            settings = [(f, None if f == "calibrated" else _controller(Path(f)))
                        for f in files]
            if len(settings) > 1:
                from services.calibration import CONTROLLER

                axis = {"controllers": [(f, c or CONTROLLER) for f, c in settings]}
            else:
                axis = {"controller": settings[0][1] if settings else None}
            with writing_into(out):
                result = runner.run_tune(**args, truth=truth, progress=True, **axis)
        except InvalidInput as exc:
            _fail(str(exc))
        scales = result["meta"]["rate_scales"]
        seeds = result["meta"]["seeds"]
        by_ctl = "controllers" in result["meta"]
        t = Table(title=f"{result['meta']['workload']}: vertumnus's mean TTFT (s) by β, λ"
                  + (", controller" if by_ctl else "")
                  + (f" (mean of seeds {', '.join(map(str, seeds))})" if len(seeds) > 1 else ""))
        for col in ("β", "λ", *(["controller"] if by_ctl else []), *(f"×{s:g}" for s in scales),
                    "mean", "P90"):
            t.add_column(col, justify="left" if col == "controller" else "right")
        for p in result["pairs"]:
            by = {r["rate_scale"]: r["mean_ttft_s"] for r in result["rows"]
                  if r["beta"] == p["beta"] and r["lam"] == p["lam"]
                  and r.get("controller") == p.get("controller")}
            t.add_row(f"{p['beta']:g}", f"{p['lam']:g}",
                      *([p["controller"]] if by_ctl else []), *(f"{by[s]:.3f}" for s in scales),
                      f"{p['mean_ttft_s']:.3f}", f"{p['p90_ttft_s']:.3f}")
        Console(file=sys.stdout).print(t)
        best = result["best"]
        chosen = ""
        if by_ctl:
            chosen = (", the calibrated controller" if best["controller"] == "calibrated" else
                      f", controller {best['controller']}")
        how = f"simulate --beta {best['beta']:g} --lam {best['lam']:g}" + (
            f" --controller {best['controller']}"
            if by_ctl and best["controller"] != "calibrated" else "")
        pairs = result["pairs"]
        tied = [p for p in pairs if (p["mean_ttft_s"], p["p90_ttft_s"])
                == (pairs[0]["mean_ttft_s"], pairs[0]["p90_ttft_s"])]
        rule = "the lowest β, then λ" + (", then the controller listed first" if by_ctl else "")
        if len(pairs) > 1 and len(tied) == len(pairs):
            # No pair is better: "best" would read as a finding; it is only the tie-break.
            typer.echo(f"all {len(pairs)} settings tie (the same mean and P90 TTFT: J's weights "
                       f"change nothing on this trace and pool); picked β {best['beta']:g}, "
                       f"λ {best['lam']:g}{chosen} by the tie-break, {rule} "
                       f"({how}, or the scheduler's VTM_POLICY_PARAMS; the calibrated default "
                       f"serves as well); {out}/tune.json")
            return
        tie = (f"; {len(tied)} settings tie, picked by {rule}"
               if len(tied) > 1 else "")
        typer.echo(f"best: β {best['beta']:g}, λ {best['lam']:g}{chosen} (lowest mean TTFT over "
                   f"the rates{tie}; {how}, or the scheduler's VTM_POLICY_PARAMS); "
                   f"{out}/tune.json")

    @app.command()
    def size(
        ctx: typer.Context,
        trace: _Trace = "synthetic",
        format: _Format = "auto",
        policies: Annotated[
            str, typer.Option(help=_POLICIES_HELP, show_default=False)
        ] = _DEFAULT_POLICIES,
        rate_scale: Annotated[float, typer.Option(help="Arrival-rate multiplier")] = 1.0,
        target: Annotated[float, typer.Option(
            help="Token-weighted SLO attainment to keep, in (0, 1]")] = 0.9,
        gpus_min: Annotated[int, typer.Option(help="Smallest pool tried (0: --step)")] = 0,
        gpus_max: Annotated[int, typer.Option(help="Largest pool tried")] = 80,
        step: Annotated[int, typer.Option(
            help="Pool sizes tried go up by this (a multiple of the largest degree; "
            "0: the largest degree)")] = 0,
        rate: _Rate = 0.0,
        degrees: _Degrees = "2,4",
        seed: Annotated[int, typer.Option()] = 0,
        out: _Out = Path("runs/size"),
        profile_path: _ProfilePath = None,
        profile_mismatch_ok: _ProfileMismatchOk = False,
        max_requests: _MaxRequests = 0,
        jobs: Annotated[int, typer.Option(help="Worker processes (one policy each)")] = 1,
        hardware: _Hardware = None,
        per_degree: Annotated[bool, typer.Option(
            help=_PER_DEGREE_HELP + " (the profile measured here, not a --profile file)")
        ] = False,
        slo: _Slo = "qwen3-30b-a3b",
        warmup: Annotated[float, typer.Option(
            help="Seconds (simulated) whose requests are run but not counted")] = 0.0,
        controller: _Controller = None,
    ) -> None:
        """Find the fewest GPUs with which each policy meets an SLO on a trace at a rate."""

        from sim import runner

        check_seed(seed)
        _check_per_degree(per_degree, profile_path)
        table = slo_table(slo)
        degs = degrees_option(degrees)
        chosen = _default_policies_for(_names(policies, "policies"), degs,
                                       bool(_given(ctx, ["policies"])))
        _check(runner.check_size, policies=chosen, rate_scale=rate_scale, target=target,
               jobs=jobs, seed=seed, warmup_s=warmup, degrees=degs,
               gpus_min=gpus_min or None, gpus_max=gpus_max, step=step or None)
        _check(runner.check_trace_format, trace, format)
        _check_run_numbers(rate=rate, max_requests=max_requests)
        args: dict[str, Any] = dict(
            trace=trace, fmt=format, policies=chosen, rate_scale=rate_scale, target=target,
            gpus_min=gpus_min or None, gpus_max=gpus_max, step=step or None,
            rate=rate or None, degrees=degs, seed=seed, out=out,
            profile_path=profile_file(profile_path, degs), max_requests=max_requests or None,
            jobs=jobs, per_degree=per_degree, slo=table, warmup_s=warmup,
            profile_mismatch_ok=profile_mismatch_ok)
        _check_trace_blocks(trace, format, profile_path)
        try:
            truth = _truth(hardware)
            _check_profile_hardware(args["profile_path"], degs, truth, profile_mismatch_ok)
            ctl = _controller(controller)
            with writing_into(out):
                summary = runner.run_size(**args, truth=truth, progress=True, controller=ctl,
                                          on_warning=lambda m: typer.echo(f"warning: {m}",
                                                                          err=True))
        except InvalidInput as exc:
            _fail(str(exc))
        runner.print_size_table(summary, file=sys.stdout)
        _say_controller(controller, ctl)
        typer.echo(f"results in {out}/size.json (plot: {out}/size.png)")

    @app.command()
    def hardware(
        file: Annotated[Path | None, typer.Argument(
            parser=path_option("FILE"),
            help="A hardware file to check (default: print the built-in hardware)")] = None,
    ) -> None:
        """Print the simulated hardware as JSON: the built-in one, or FILE checked and completed.

        Every field is printed: the built-in hardware is a template for --hardware; FILE is
        read, checked and completed with the defaults it leaves out.
        """
        from shared.ids import DEFAULT_BLOCK_SIZE
        from sim.groundtruth import GroundTruth
        from sim.hardware import ground_truth_to_mapping

        try:
            truth = _truth(file, option=False) or GroundTruth()
            blocks = truth.kv_capacity_blocks(1)
        except InvalidInput as exc:
            _fail(str(exc))
        typer.echo(json.dumps(ground_truth_to_mapping(truth), indent=2))
        # A summary on stderr, so that stdout stays a hardware file.
        times = ", ".join(f"CP{c} {truth.prefill_time(8192, 0, c):.3f} s" for c in (1, 2, 4, 8))
        typer.echo(f"{truth.model.name} on {truth.gpu.name} (KV memory of "
                   f"{truth.memory_gpu.name}: {blocks} blocks of {DEFAULT_BLOCK_SIZE} tokens per "
                   f"GPU); "
                   f"an 8K-token prefill: {times}", err=True)

    @app.command()
    def synthetic(
        file: Annotated[Path | None, typer.Argument(
            parser=path_option("FILE"),
            help="A synthetic workload file to check (default: print the built-in one)")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of TOML")] = False,
        for_up: Annotated[int | None, typer.Option(
            "--for-up", metavar="GPUS",
            help="Print instead the workload `vertumnus up --gpus GPUS` replays by default "
                 "(0.25 req/s per GPU, the load phases compressed into --duration), for up "
                 "--workload; the plain default is simulate's, 8 req/s for a 40-GPU pool, "
                 "and up replays a file at its own rate, never scaled to --gpus")] = None,
        duration: Annotated[float | None, typer.Option(
            help="With --for-up: the workload's length, modelled seconds (default 240, up's "
                 "--duration)")] = None,
    ) -> None:
        """Print the synthetic workload's parameters: the built-in default, or FILE checked and
        completed, or (--for-up GPUS) the one `vertumnus up --gpus GPUS` replays by default.

        The output is a workload file for --trace (TOML, with a comment on each field; JSON
        with --json, which needs --format synthetic): edit it to describe your traffic's shape
        (rate, load phases, long-document share, shared system prompts, sessions, lengths).
        """
        from sim.workloads.synthetic import SyntheticConfig, phase_table
        from sim.workloads.synthetic_file import (
            config_to_mapping,
            config_to_toml,
            load_synthetic_config,
        )

        if for_up is not None and file is not None:
            _fail("--for-up prints up's own default workload; FILE is one to check: give one")
        if duration is not None and for_up is None:
            _fail("--duration is the length of the --for-up workload; it needs --for-up GPUS "
                  "(edit duration_s in the file otherwise)")
        try:
            if for_up is not None:
                from vertumnus.live.stack import DEFAULT_DURATION_S, up_synthetic_config

                if for_up < 1:
                    raise InvalidInput(f"--for-up must be a number of GPUs >= 1, got {for_up}")
                if duration is not None and not (duration > 0 and math.isfinite(duration)):
                    raise InvalidInput(f"--duration must be a finite number of seconds > 0, "
                                       f"got {duration:g}")
                cfg = up_synthetic_config(for_up, DEFAULT_DURATION_S if duration is None
                                          else duration)
            else:
                cfg = load_synthetic_config(file) if file is not None else SyntheticConfig()
        except InvalidInput as exc:
            _fail(str(exc))
        if as_json:
            typer.echo(json.dumps(config_to_mapping(cfg), indent=2))
        else:
            typer.echo(config_to_toml(cfg), nl=False)
        # A summary on stderr, so that stdout stays a workload file.
        for line in _synthetic_summary(cfg, phase_table(cfg)):
            typer.echo(line, err=True)

    @app.command("controller-config")
    def controller_config(
        file: Annotated[Path | None, typer.Argument(
            parser=path_option("FILE"),
            help="A controller file to check (default: print the calibrated setting)")] = None,
        as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of TOML")] = False,
    ) -> None:
        """Print the controller's thresholds: the calibrated ones, or FILE checked and
        completed.

        The output is a file for --controller (simulate, tune, size, up; TOML with a comment on
        each field, JSON with --json): edit it to try other split and merge thresholds on a
        trace, then run them live (up --controller FILE, or VTM_CONTROLLER_FILE for the
        controller service).
        """
        from services.calibration import CONTROLLER
        from services.controller.config_file import config_to_mapping, config_to_toml
        from services.controller.service import ControllerSettings

        try:
            cfg = _controller(file, option=False) or CONTROLLER
        except InvalidInput as exc:
            _fail(str(exc))
        if as_json:
            typer.echo(json.dumps(config_to_mapping(cfg), indent=2))
        else:
            help_ = {k: f.description or "" for k, f in ControllerSettings.model_fields.items()}
            typer.echo(config_to_toml(cfg, help_), nl=False)
        changed = _changed(cfg)
        # A summary on stderr, so that stdout stays a controller file.
        typer.echo("the calibrated setting" if not changed else
                   f"differs from the calibrated setting in {', '.join(changed)}", err=True)

    @app.command()
    def report(
        directory: Annotated[Path, typer.Argument(
            parser=path_option("DIRECTORY", "directory"),
            help="A simulate or size output directory")],
    ) -> None:
        """Redraw the plots and CSV of a simulate (or size) run from its results (size) JSON."""
        from sim import runner

        _check_report_input(directory)
        try:
            summary = runner.redraw(directory)
        except InvalidInput as exc:
            _fail(str(exc))
        if summary.get("kind") == "size":
            runner.print_size_table(summary, file=sys.stdout)
        else:
            runner.print_table(summary, file=sys.stdout)
