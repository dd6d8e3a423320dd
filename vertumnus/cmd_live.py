"""``vertumnus up``, ``replay``, ``tap`` and one command per live service.

* ``up`` — the whole live system on this machine (embedded nats-server, every service as a
  child process, rank daemons on the sim backend timed by the ground truth), a replay of the
  built-in phased synthetic workload through the gateway, the TTFT report; stops everything
  at the end or on Ctrl-C. ``--backend torch`` runs real CP prefill instead: one gloo rank
  process per GPU of ``--gpus`` on this CPU, the small random-weight Qwen3 (or
  ``--model-path``), and by default the short-prompt workload ``synthetic-short``.
  ``--kill-at S [--restart-after D] [--kill-service NAME]`` crashes a service (default the rank
  daemon) during the replay and starts it again (:mod:`vertumnus.live.faults`).
* ``replay`` — the same replay and report against a stack that is already running.
* ``tap`` — print the messages of a subject (default ``vtm.>``) decoded by Content-Type.
* ``status`` — one look at a running pool from NATS: the epoch record's composition, every
  worker state (stale past the lease) and the services answering ``$SRV.PING``.
* ``gateway | scheduler | controller | cachemgr | rankd`` — run that service's main with the
  remaining arguments (``vertumnus gateway --port 8080`` = ``python -m services.gateway
  --port 8080``); configuration by ``VTM_*`` environment variables as documented on each
  service's settings class. ``rankd`` runs :mod:`vertumnus.live.rankd_sim`, so that its
  ``sim`` backend sleeps for the simulator's ground truth as design.md's sim backend does
  (``services.rankd.main`` cannot import it; ``VTM_TRUTH=predicted`` asks for that module's
  prediction-timed sim); ``VTM_BACKEND=torch`` goes to ``services.rankd.main`` unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import runpy
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from shared.ids import InvalidInput
from shared.natsserver import NatsServerStartError

# degrees_option / profile_file: simulate's checks of --degrees and --profile; the live
# commands take the same options and refuse what simulate refuses, with the same words.
from vertumnus.cliargs import (
    SLO_HELP,
    check_seed,
    comma_list,
    degrees_option,
    nats_settings,
    nats_url_option,
    output_dir,
    output_file,
    path_option,
    profile_file,
    slo_table,
    text_path_option,
    vtm_environment,
)
from vertumnus.cliargs import fail as _fail

if TYPE_CHECKING:
    from shared.slo import SloTable
    from vertumnus.live.stack import UpConfig

_PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}


def _shown(url: str) -> str:
    """``url`` for a message, a password in it shown as *** (imported here: the services'
    module loads tracing, which the CLI's other commands do not need)."""
    from shared.servicemain import shown_url

    return shown_url(url)


def _times(text: str | None, name: str) -> tuple[float, ...] | None:
    """Comma-separated wall seconds (None: the option was not given)."""
    return None if text is None else comma_list(text, name, float, "seconds")


_MAX_REQUESTS_HELP = "Replay only the first N requests (0: all)"
_COST_PANEL = "Cost model"


def _check_replay_numbers(*, rate: float | None, duration: float, time_scale: float,
                          rate_scale: float, max_requests: int) -> None:
    """``replay``'s numbers, each named on refusal (exit 2) before the workload is built:
    ``--rate`` (None: the default) and ``--duration``, ``--time-scale``, ``--rate-scale``
    finite and > 0; ``--max-requests`` >= 0 (0: all)."""
    if rate is not None and not (rate > 0 and math.isfinite(rate)):
        _fail(f"--rate must be a finite number of requests/s > 0, got {rate:g}")
    for flag, v in (("--duration", duration), ("--time-scale", time_scale),
                    ("--rate-scale", rate_scale)):
        if not (v > 0 and math.isfinite(v)):
            _fail(f"{flag} must be a finite number > 0, got {v:g}")
    if max_requests < 0:
        _fail(f"--max-requests must be an integer >= 0 (0: all), got {max_requests}")


def _check_gateway_url(url: str) -> None:
    """``replay --gateway``: an ``http://`` or ``https://host[:port][/base]`` URL with a valid
    port, checked before the workload is loaded (exit 2 naming the option). Else the HTTP
    client's refusal to parse it was reported as a gateway that "is not reachable", which
    sends one looking for a server that was never asked."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 - urlsplit checks the port only when it is read
    except ValueError as exc:  # out of range, not a number
        _fail(f"--gateway {url!r} is not an http(s) URL ({exc}): give http://host:port or "
              "https://host:port")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        _fail(f"--gateway {url!r} is not an http(s) URL: give http://host:port or "
              "https://host:port")


def _check_gateway_ca(url: str) -> None:
    """``replay`` of an ``https://`` gateway, or ``up`` whose gateway serves HTTPS
    (``$VTM_HTTP_TLS_CERT``): ``$VTM_GATEWAY_CA`` a readable PEM bundle, checked before the
    workload is loaded or anything starts (exit 2 naming the variable, the path and what is
    wrong). Else replay's refusal came back as a gateway that "is not reachable", and up's
    only when its health wait ran out."""
    from vertumnus.live.http import GatewayCaError, client_tls

    try:
        client_tls(url)
    except GatewayCaError as exc:
        _fail(str(exc))


def _check_engine(model_path: Path | None) -> None:
    """``up --backend torch``'s engine, before anything starts (exit 2 naming the problem):
    the ``engine`` extra installed (else the profile, or with ``--profile`` the rank daemon
    once nats and every service had started, failed on its import), and ``--model-path`` a
    checkpoint directory with a Qwen3 ``config.json`` and safetensors files holding every
    tensor that config implies, of its shape and a float dtype (else each rank process of the
    profile failed loading it, after the rank daemons' start-up): the loader's own checks
    (``services.rankd.engine.checkpoint.check_tensors``) on the files' headers alone, no
    weight read (:func:`~services.rankd.engine.checkpoint.check_checkpoint`)."""
    from vertumnus.live.startup_profile import engine_extra_error, missing_engine_module

    missing = missing_engine_module()
    if missing is not None:
        _fail(engine_extra_error(missing))
    if model_path is None:
        return
    if not Path(model_path).is_dir():
        _fail(f"--model-path {model_path}: not a directory (a local HF-format Qwen3 "
              "checkpoint directory)")
    from services.rankd.engine.checkpoint import check_checkpoint, load_config
    from services.rankd.engine.errors import CheckpointError

    try:
        load_config(model_path)
    except CheckpointError as exc:
        _fail(f"--model-path: {exc}")
    if not any(Path(model_path).glob("*.safetensors")):
        _fail(f"--model-path {model_path}: no *.safetensors file (a local HF-format Qwen3 "
              "checkpoint directory)")
    try:
        check_checkpoint(model_path)
    except CheckpointError as exc:
        _fail(f"--model-path: {exc}")


def _check_torch_settings(cfg: UpConfig) -> None:
    """``up --backend torch``: the rank daemon's ``VTM_TORCH_*`` values -- this environment's
    under the stack's own (``LiveStack.service_env``) -- checked as the daemon checks them at
    its start (:func:`services.rankd.torch_spec.torch_problems`), before anything starts
    (exit 2, one line per problem naming the variable). Else a bad value was said by the rank
    daemon once nats, the services and the engine's profile (~20 s) had started."""
    import tempfile

    from services.rankd.settings import RankdSettings
    from services.rankd.torch_spec import torch_problems
    from shared.worker import WorkerKind
    from vertumnus.live.stack import LiveStack

    with tempfile.TemporaryDirectory(prefix="vtm-up-check-") as tmp:
        env = LiveStack(cfg, log_dir=Path(tmp)).service_env("rankd", "nats://127.0.0.1:4222")
    rankd = RankdSettings.model_construct(
        backend="torch", host_gpus=env["VTM_HOST_GPUS"],
        initial_workers=env["VTM_INITIAL_WORKERS"], kind=WorkerKind(env["VTM_KIND"]))
    torch_env = {k: v for k, v in env.items() if k.upper().startswith("VTM_TORCH_")}
    problems = torch_problems(rankd, torch_env)
    if problems:
        _fail("the rank daemon's torch settings: " + "; ".join(problems))


def _check_profile_hardware(cfg: UpConfig, *, mismatch_ok: bool) -> None:
    """``up --backend sim --profile P``: P fitted on the modelled hardware (``--hardware``,
    else the default), checked before anything starts as ``simulate``, ``tune`` and ``size``
    check theirs (:func:`sim.runner.check_profile_hardware`: exit 2 naming what differs),
    unless ``--profile-mismatch-ok``. Else the services would predict every prefill with a
    model of other hardware than the rank daemons time. The torch backend models no
    hardware (its engine runs here), so the flag is refused there, as ``--hardware`` is."""
    if cfg.backend != "sim":
        if mismatch_ok:
            _fail("--profile-mismatch-ok is the sim backend's (a --profile against its "
                  "modelled hardware); the torch engine runs on this machine")
        return
    if cfg.profile is None:
        return
    from sim.hardware import load_ground_truth
    from sim.runner import load_profile

    try:  # UpConfig read the hardware file already: it loads
        truth = None if cfg.hardware is None else load_ground_truth(cfg.hardware)
        load_profile(cfg.profile, cfg.degrees, truth, mismatch_ok=mismatch_ok)
    except InvalidInput as exc:
        _fail(str(exc))


def run_service_module(module: str, argv: list[str], prog: str) -> None:
    """Run ``python -m module`` in this process with ``argv`` (what the service mains read)."""
    from vertumnus.live.registry import module_runnable

    if not module_runnable(module):
        _fail(f"{prog}: module {module} is not available in this installation yet")
    old = sys.argv
    sys.argv = [prog, *argv]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = old


def _service_command(app: typer.Typer, name: str) -> None:
    from vertumnus.live.registry import SERVICES, SIM_RANKD

    # A standalone rank daemon models the hardware like every other sim rankd (up, compose):
    # the launcher that wires the ground truth in, not the service module that cannot.
    info = SIM_RANKD if name == "rankd" else SERVICES[name]
    help_text = (f"Run the {name} service ({info.doc}): `python -m {info.module}` with the "
                 "remaining arguments; settings from VTM_* variables.")
    if name == "rankd":
        help_text += (" VTM_TRUTH: noisy (default) or exact ground truth, or predicted (the "
                      f"scheduler's prediction, as {SERVICES['rankd'].module}); VTM_BACKEND="
                      "torch runs the real engine. --sim-truth (the default now) is accepted.")

    @app.command(name=name, help=help_text, context_settings=_PASS_THROUGH,
                 add_help_option=False)
    def _cmd(ctx: typer.Context) -> None:
        args = list(ctx.args)
        if name == "rankd" and "--sim-truth" in args:
            args.remove("--sim-truth")  # what it asked for is the default; scripts keep working
        run_service_module(info.module, args, f"vertumnus {name}")


def register(app: typer.Typer) -> None:
    @app.command()
    def up(
        gpus: Annotated[int, typer.Option(help="GPUs in the prefill pool (simulated)")] = 8,
        degrees: Annotated[str, typer.Option(help="CP degrees, comma-separated")] = "2,4",
        policy: Annotated[str, typer.Option(
            help="Scheduler policy (registry name). A baseline runs on the pool its source "
            "deploys, held, as in `simulate` (homo, sglang, dynamo, llmd, round_robin: all "
            "CP4; homo_cp2: the smallest degree; vllm: TP-4; static: the start composition)"
        )] = "vertumnus",
        workload: Annotated[str | None, typer.Option(
            parser=text_path_option("--workload"), metavar="<str>",
            help="'synthetic' (phased), 'synthetic-short' (phased, prompts of tens to a few "
                 "hundred tokens, 16-token blocks), a trace path or a .toml synthetic "
                 "workload file, replayed at its own rate (`vertumnus synthetic --for-up "
                 "GPUS` writes this command's default for GPUS GPUs; plain `vertumnus "
                 "synthetic` is simulate's 40-GPU one, 8 req/s); default: 'synthetic' with "
                 "--backend sim, 'synthetic-short' with --backend torch")] = None,
        rate: Annotated[float | None, typer.Option(
            help="Base request rate, req/s modelled (default 0.25 per GPU); a timed trace "
                 "keeps its own without it, with it the part replayed (see --duration) is "
                 "rescaled to a mean gap of 1/RATE")] = None,
        duration: Annotated[float, typer.Option(
            help="Workload length in modelled seconds (4 load phases); a trace is cut to its "
                 "first DURATION seconds, with --rate a timed trace to its first "
                 "⌈DURATION × RATE⌉ requests (at most --max-requests), replayed at RATE. "
                 "--rate-scale then compresses it: the replay lasts DURATION / RATE_SCALE "
                 "modelled s")] = 240.0,
        time_scale: Annotated[float, typer.Option(
            help="Wall seconds per modelled second (0.1 = 10× faster)")] = 0.1,
        rate_scale: Annotated[float, typer.Option(
            help="Multiply the arrival rate by compressing the workload's arrivals, as "
                 "`simulate` does: the same requests, replayed in --duration / RATE_SCALE "
                 "modelled s (time --kill-at by that)")] = 1.0,
        backend: Annotated[str, typer.Option(
            help="rankd backend: sim (modelled time) or torch (real CP prefill: one gloo rank "
                 "process per GPU on this CPU, a small random-weight Qwen3 unless "
                 "--model-path)")] = "sim",
        model_path: Annotated[Path | None, typer.Option(
            parser=path_option("--model-path", "directory"), metavar="<path>",
            help="--backend torch: local HF-format Qwen3 checkpoint directory")] = None,
        seed: Annotated[int, typer.Option()] = 0,
        max_requests: Annotated[int, typer.Option(help=_MAX_REQUESTS_HELP)] = 0,
        # The cost model's own panel: its table's columns are sized apart from the main one,
        # where --profile-mismatch-ok beside --no-profile-engine was cut at 80 columns.
        profile: Annotated[Path | None, typer.Option(
            parser=path_option("--profile"), metavar="<path>", rich_help_panel=_COST_PANEL,
            help="Fitted cost-model profile for the services (vertumnus profile); without "
                 "it, --backend sim fits Ê_C and measures κ_C on the modelled hardware first "
                 "(≈2 s, kept in LOG_DIR as hardware-profile)")] = None,
        profile_engine: Annotated[bool, typer.Option(
            help="--backend torch without --profile: fit the cost model on the engine first "
                 "(≈15 s; else the services predict the simulated H20's times)")] = True,
        hardware: Annotated[Path | None, typer.Option(
            parser=path_option("--hardware"), metavar="<path>", rich_help_panel=_COST_PANEL,
            help="--backend sim: the modelled model and GPUs, a .json or .toml file "
                 "(sim/hardware.py; default: Qwen3-30B-A3B on H20); without --profile the "
                 "cost model is fitted on it first (≈2 s)")] = None,
        per_degree: Annotated[bool, typer.Option(
            rich_help_panel=_COST_PANEL,
            help="--backend sim without --profile: fit the cost model on the modelled "
                 "hardware with one coefficient set per CP degree")] = False,
        profile_mismatch_ok: Annotated[bool, typer.Option(
            "--profile-mismatch-ok", rich_help_panel=_COST_PANEL,
            help="--backend sim: use a --profile fitted on another model or GPU than the "
                 "modelled one (refused otherwise, as by simulate; e.g. to study the cost "
                 "model's error there)")] = False,
        controller: Annotated[Path | None, typer.Option(
            "--controller", parser=path_option("--controller"), metavar="<path>",
            help="The controller's thresholds: a .toml or .json file (`vertumnus "
                 "controller-config`; the file `simulate --controller` evaluates)")] = None,
        slo: Annotated[str, typer.Option(
            help=SLO_HELP + "; the report's SLO attainment, and with --backend sim and no "
                 "--profile, the deadlines κ is profiled to keep")] = "qwen3-30b-a3b",
        prefix: Annotated[str, typer.Option(help="Subject prefix")] = "vtm",
        log_dir: Annotated[Path | None, typer.Option(
            parser=path_option("--log-dir", "directory"), metavar="<path>",
            help="Service logs and pids.json (default: a temporary directory)")] = None,
        json_out: Annotated[Path | None, typer.Option(
            "--json", parser=path_option("--json"), metavar="<path>",
            help="Write results JSON")] = None,
        stop_timeout: Annotated[float, typer.Option(
            help="Wall seconds the shutdown may take: the services stop in three stages, "
            "each SIGKILLed past its share, and each service is given a little less than "
            "its share as its own stop deadline: VTM_STOP_TIMEOUT_S")] = 10.0,
        health_timeout: Annotated[float, typer.Option(
            help="Wall seconds to wait for every service to be healthy")] = 90.0,
        progress: Annotated[bool, typer.Option(help="Show the progress bar")] = True,
        serve: Annotated[bool, typer.Option(
            help="No replay: keep the stack running until Ctrl-C (drive it with `replay`)")
        ] = False,
        nats_port: Annotated[int, typer.Option(help="nats-server port (-1: any free)")] = -1,
        nats_config: Annotated[Path | None, typer.Option(
            parser=path_option("--nats-config"), metavar="<path>",
            help="A nats-server configuration file for the embedded server (e.g. TLS and "
                 "users); up and every service connect with the VTM_NATS_* credentials and "
                 "TLS settings of this environment")] = None,
        http_port: Annotated[int, typer.Option(help="Gateway HTTP port (0: any free)")] = 0,
        schedulers: Annotated[int, typer.Option(
            help="Scheduler replicas (one process each, sharing the intake)")] = 1,
        kill_at: Annotated[str | None, typer.Option(
            help="Fault injection: SIGKILL the --kill-service child this many wall seconds "
                 "after the replay starts (comma-separated: one time per service)")] = None,
        restart_after: Annotated[str | None, typer.Option(
            help="Start the killed service again this many wall seconds after the kill "
                 "(default: never, and then the report lists it in services_killed and up "
                 "exits 1; comma-separated: one per service)")] = None,
        kill_service: Annotated[str, typer.Option(
            help="The service --kill-at crashes: gateway, scheduler, controller, cachemgr, "
                 "rankd (every worker; --backend sim), nats (the server; nats-empty: it comes back "
                 "with an empty store), or one scheduler "
                 "replica of --schedulers (scheduler-2, scheduler-3 and so on; 'scheduler' is the "
                 "first); several "
                 "comma-separated, e.g. scheduler,rankd with --kill-at 20,25")] = "rankd",
    ) -> None:
        """Start nats + every service, replay a workload through the gateway, report, stop.

        Every option is checked, the workload loaded, the output paths made ready, the
        --http-port / --nats-port tried and --nats-config tested by nats-server (-t) before
        anything starts (exit 2 naming the problem).
        --duration is the workload's length; --rate-scale compresses its arrivals as in
        `simulate`, so the replay lasts DURATION / RATE_SCALE modelled seconds (the first line
        says both; a --kill-at past the replay's last arrival is warned about). An interrupt
        (Ctrl-C, SIGTERM) during the start-up or the replay stops everything and reports what
        is known (the phase it came in, --json too). After the report: exit 130 when
        interrupted, 1 when a service exited for good (past 3 restarts, or killed by --kill-at
        and never started again) or no request completed, else 0."""
        from rich.console import Console

        from sim.workloads.synthetic_file import check_block_size
        from vertumnus.live.procs import ChildFailed
        from vertumnus.live.stack import (
            StackError,
            UpConfig,
            check_nats_server,
            check_ports,
            load_requests,
            nats_start_failure,
            run_up,
        )

        try:
            cfg = UpConfig(
                gpus=gpus, degrees=degrees_option(degrees), policy=policy, backend=backend,
                workload=workload or "", rate=rate, duration_s=duration, time_scale=time_scale,
                rate_scale=rate_scale, seed=seed, max_requests=max_requests or None,
                # A sim pool's controller judges capacity by κ: a profile must have it for
                # each degree (a torch profile has none: the engine fits Ê_C only).
                profile=profile_file(profile,
                                     degrees_option(degrees) if backend == "sim" else None),
                prefix=prefix, log_dir=log_dir, stop_timeout_wall_s=stop_timeout,
                health_timeout_wall_s=health_timeout, serve=serve, nats_port=nats_port,
                nats_config=nats_config,
                http_port=http_port, model_path=model_path, profile_engine=profile_engine,
                kill_at_wall_s=_times(kill_at, "kill-at"),
                restart_after_wall_s=_times(restart_after, "restart-after"),
                kill_service=kill_service, schedulers=schedulers, hardware=hardware,
                per_degree=per_degree, slo=slo_table(slo), controller=controller,
            )
        except ValueError as exc:
            _fail(str(exc))
        _check_profile_hardware(cfg, mismatch_ok=profile_mismatch_ok)
        # Any case: the services' settings read their variables case-insensitively.
        if any(v for k, v in os.environ.items() if k.upper() == "VTM_HTTP_TLS_CERT"):
            # The gateway serves HTTPS: up's own health checks and replay verify it against
            # $VTM_GATEWAY_CA; a bad one was found only when the health wait ran out.
            _check_gateway_ca("https://127.0.0.1")
        try:  # a fixed port in use: said now, not once nats and every service have started
            check_ports(cfg)
            # The server's binary and --nats-config, tested by nats-server itself: said now,
            # not after the start-up profiling (~15 s on the torch engine).
            check_nats_server(cfg)
        except ValueError as exc:
            _fail(str(exc))
        if cfg.backend == "torch":
            _check_engine(cfg.model_path)
            _check_torch_settings(cfg)
        try:  # before anything starts: a trace it cannot read must not cost a stack start
            wl, reqs = load_requests(cfg.workload, duration_s=cfg.duration_s, rate=cfg.rate,
                                     seed=cfg.seed, max_requests=cfg.max_requests,
                                     default_rate=cfg.base_rate)
            # The stack hashes prompts in its own blocks; a synthetic file of another block
            # size (the only workload that can have one) would be replayed in those,
            # silently unlike the prefixes it was drawn with.
            check_block_size(wl.block_size, cfg.block_size, source=cfg.workload,
                             whose="the stack's")
        except InvalidInput as exc:
            _fail(f"--workload: {exc}")
        # Last of the checks: they create the directories (a run must not lose its results
        # to a path it cannot write once it is over).
        if log_dir is not None:
            output_dir(log_dir, "log-dir")
        if json_out is not None:
            output_file(json_out, "json")
        try:
            summary = asyncio.run(run_up(cfg, console=Console(), err_console=Console(stderr=True),
                                         json_path=json_out, show_progress=progress,
                                         requests=reqs))
        except (StackError, ChildFailed) as exc:
            _fail(str(exc), 1)
        except NatsServerStartError as exc:  # a port taken meanwhile, a bad --nats-config
            # Its fatal line(s), not the server's whole start-up banner.
            _fail(nats_start_failure(str(exc), cfg), 1)
        except KeyboardInterrupt:  # a second Ctrl-C during shutdown
            raise typer.Exit(130) from None
        _end_of_run(summary, serving=cfg.serve)

    @app.command()
    def replay(
        gateway: Annotated[str, typer.Option(
            help="Gateway base URL, http://host:port or https://host:port (its certificate "
                 "verified against $VTM_GATEWAY_CA, else the system's CAs)")],
        trace: Annotated[str, typer.Option(
            parser=text_path_option("--trace"), metavar="<str>",
            help="'synthetic', 'synthetic-short', a trace file or a .toml synthetic "
                 "workload file")] = "synthetic",
        rate_scale: Annotated[float, typer.Option(help="Multiply the arrival rate")] = 1.0,
        time_scale: Annotated[float, typer.Option(
            help="The stack's time scale: arrivals × scale, TTFT ÷ scale")] = 1.0,
        rate: Annotated[float | None, typer.Option(
            help="Base rate req/s of a synthetic workload or an L-Eval file (default 2); a "
                 "timed trace's part replayed (see --duration) is rescaled to a mean gap of "
                 "1/RATE")] = None,
        duration: Annotated[float, typer.Option(
            help="Modelled seconds: a synthetic workload's length; a trace is cut to its "
                 "first DURATION seconds, with --rate a timed trace to its first "
                 "⌈DURATION × RATE⌉ requests (at most --max-requests), replayed at "
                 "RATE")] = 240.0,
        seed: Annotated[int, typer.Option()] = 0,
        max_requests: Annotated[int, typer.Option(help=_MAX_REQUESTS_HELP)] = 0,
        nats_url: Annotated[str | None, typer.Option(
            "--nats", help="NATS URL: adds hit rate and composition changes")] = None,
        prefix: Annotated[str, typer.Option(help="Subject prefix (with --nats)")] = "vtm",
        json_out: Annotated[Path | None, typer.Option(
            "--json", parser=path_option("--json"), metavar="<path>",
            help="Write results JSON")] = None,
        progress: Annotated[bool, typer.Option(help="Show the progress bar")] = True,
        retry: Annotated[float, typer.Option(
            help="Wall seconds to keep sending a request again whose connection was refused or "
                 "dropped (a gateway restarting; same request id); 0: never")] = 10.0,
        api_key: Annotated[str | None, typer.Option(
            envvar="VTM_API_KEY", show_envvar=True,
            help="Sent as 'Authorization: Bearer KEY' (a gateway with VTM_API_KEYS)")] = None,
        slo: Annotated[str, typer.Option(help=SLO_HELP + " (the report's SLO attainment)")
                       ] = "qwen3-30b-a3b",
    ) -> None:
        """Replay a trace (or the synthetic workload) through a running gateway; report.

        Every option is checked and the workload loaded before the first request is sent
        (exit 2 naming the problem). Ctrl-C or SIGTERM ends the replay early: the report
        (and --json) covers what finished, exit 130; further Ctrl-Cs only say so. Exit 0
        once at least one request completed (failures are counted in the report); exit 1,
        after the report and --json, when none did, with a line giving the most common
        error."""

        from shared.subjects import validate_subject
        from vertumnus.live.stack import load_requests

        vtm_environment()  # a misspelt VTM_API_KEY / VTM_GATEWAY_CA / VTM_NATS_* is refused
        _check_gateway_url(gateway)
        _check_gateway_ca(gateway)
        check_seed(seed)
        _check_replay_numbers(rate=rate, duration=duration, time_scale=time_scale,
                              rate_scale=rate_scale, max_requests=max_requests)
        try:
            validate_subject(prefix)
        except InvalidInput as exc:
            _fail(f"--prefix: {exc}")
        table = slo_table(slo)
        if nats_url is not None:
            nats_url_option(nats_url)
            nats_settings()
        try:
            wl, reqs = load_requests(trace, duration_s=duration, rate=rate, seed=seed,
                                     max_requests=max_requests, default_rate=2.0)
        except InvalidInput as exc:
            _fail(f"--trace: {exc}")
        if json_out is not None:  # now, not after the replay: its results must not be lost
            output_file(json_out, "json")
        try:
            summary = asyncio.run(_replay_main(
                gateway, reqs, time_scale=time_scale, rate_scale=rate_scale, nats_url=nats_url,
                prefix=prefix, progress=progress, block_size=wl.block_size, retry_s=retry,
                api_key=api_key, slo=table, json_path=json_out,
                meta={"workload": trace, "rate_scale": rate_scale, "seed": seed}))
        except ValueError as exc:
            _fail(str(exc))
        except KeyboardInterrupt:  # before the replay began (asyncio's own handling)
            raise typer.Exit(130) from None
        _end_of_run(summary)

    @app.command()
    def tap(
        subject: Annotated[str, typer.Argument(help="Subject filter")] = "vtm.>",
        nats_url: Annotated[str, typer.Option("--nats", help="NATS URL")] = "nats://127.0.0.1:4222",
        count: Annotated[int | None, typer.Option(
            help="Stop after N messages, N >= 1 (default: no limit)")] = None,
        timeout: Annotated[float | None, typer.Option(
            help="Stop after S seconds, S > 0 (default: no limit)")] = None,
        show_trace: Annotated[bool, typer.Option(help="Also print trace-context headers")] = False,
    ) -> None:
        """Print every message on SUBJECT decoded by its Content-Type (JSON, msgpack, binary).

        SUBJECT is any NATS filter (``*`` a whole token, ``>`` the last), the server's own
        subjects too (``$KV.VTM_WORKERS.>`` shows the worker-state bucket's writes); it, the
        limits and the --nats URL are checked before connecting (exit 2 naming the problem).
        A server that cannot be reached exits 1."""
        from shared.subjects import validate_filter
        from vertumnus.live.tap import tap as run_tap

        vtm_environment()  # a misspelt VTM_NATS_* name is refused, not silently ignored
        try:  # nats-py would raise its BadSubjectError only once connected
            validate_filter(subject)
        except InvalidInput as exc:
            _fail(f"SUBJECT: {exc}")
        if count is not None and count < 1:
            _fail(f"--count must be an integer >= 1 (leave it out for no limit), got {count}")
        if timeout is not None and not (timeout > 0 and math.isfinite(timeout)):
            # nan would never time out, and <= 0 would stop before listening.
            _fail(f"--timeout must be a finite number of seconds > 0 (leave it out for no "
                  f"limit), got {timeout:g}")
        nats_url_option(nats_url)
        nats_settings()

        def out(text: str) -> None:
            typer.echo(text)
            sys.stdout.flush()

        try:
            asyncio.run(run_tap(nats_url, subject, count=count, timeout_s=timeout,
                                show_trace=show_trace, out=out))
        except KeyboardInterrupt:
            raise typer.Exit(0) from None
        except BrokenPipeError:
            # The reader went away (tap | head): done, quietly. Its output goes to /dev/null
            # from here, so that the interpreter's last flush cannot complain either.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0) from None
        except OSError as exc:
            _fail(f"cannot reach NATS at {_shown(nats_url)}: {exc}", 1)

    @app.command()
    def status(
        nats_url: Annotated[str, typer.Option("--nats", help="NATS URL")] = "nats://127.0.0.1:4222",
        prefix: Annotated[str, typer.Option(help="Subject prefix of the deployment")] = "vtm",
        json_out: Annotated[bool, typer.Option(
            "--json", help="Print one JSON object instead of the tables")] = False,
        timeout: Annotated[float, typer.Option(
            help="Seconds to wait for the server, the KV reads and the $SRV.PING answers, "
                 "S > 0")] = 3.0,
    ) -> None:
        """Show a running pool once: the epoch's composition, every worker's state (load,
        cache, heartbeat age; STALE past the lease) and the services answering $SRV.PING.

        Read from NATS only, nothing written; credentials and TLS from the VTM_NATS_*
        variables, as for tap. Notices (a missing bucket or record, malformed or stale
        states, no services) go to stderr; exit 0 whatever they say, 2 if the server
        cannot be reached or the --nats URL is malformed."""
        import json

        from shared.subjects import Subjects
        from vertumnus.live.status import render, status_console
        from vertumnus.live.status import status as read_status

        vtm_environment()  # a misspelt VTM_NATS_* name is refused, not silently ignored
        try:  # Subjects checks what every builder needs (legal tokens, not too deep)
            Subjects(prefix)
        except InvalidInput as exc:
            _fail(f"--prefix: {exc}")
        if not (timeout > 0 and math.isfinite(timeout)):
            _fail(f"--timeout must be a finite number of seconds > 0, got {timeout:g}")
        nats_url_option(nats_url)
        nats_settings()
        try:
            summary = asyncio.run(read_status(nats_url, prefix, timeout_s=timeout))
        except KeyboardInterrupt:
            raise typer.Exit(130) from None
        except OSError as exc:
            # 2, not tap's 1: nothing was read, so this answer says nothing about the pool.
            _fail(f"cannot reach NATS at {_shown(nats_url)}: {exc}")
        for note in summary["notices"]:
            typer.echo(f"{note['level']}: {note['message']}", err=True)
        if json_out:
            typer.echo(json.dumps(summary, indent=2, sort_keys=True))
        else:
            # Not a terminal (a pipe, a file): every row whole, not cut to 80 columns.
            render(summary, status_console())

    for name in ("gateway", "scheduler", "controller", "cachemgr", "rankd"):
        _service_command(app, name)


def run_verdict(summary: dict[str, Any], *, serving: bool = False) -> tuple[int, str | None]:
    """The exit status of ``up`` or ``replay`` once its report is out, and the error line
    that goes with it (None: none). 130: interrupted (the run was cut short). 1: a service
    exited for good during the run (``up``: the run itself was not sound), or no request
    completed (the run measured nothing; :func:`_none_completed`) -- except for ``up
    --serve`` (``serving``), which replays nothing itself -- or a service killed by ``up
    --kill-at`` was never started again (``services_killed``: no ``--restart-after``, or the
    replay ended before it; the run went on without it, so it is no clean run either). 0
    otherwise: some request completed, whatever others failed (the report counts them)."""
    if summary.get("interrupted"):
        return 130, None
    if summary.get("services_down"):
        return 1, (f"{', '.join(summary['services_down'])} exited for good during the run "
                   "(see the report's faults and the service logs)")
    if summary.get("services_killed"):
        return 1, (f"{', '.join(summary['services_killed'])} killed by --kill-at and never "
                   "started again: the rest of the run went without it (give --restart-after "
                   "D to start it again)")
    if not serving and not summary.get("completed"):
        return 1, _none_completed(summary)
    return 0, None


def _end_of_run(summary: dict[str, Any], *, serving: bool = False) -> None:
    """Exit as :func:`run_verdict` says (returns for 0)."""
    code, line = run_verdict(summary, serving=serving)
    if line is not None:
        _fail(line, code)
    if code:
        raise typer.Exit(code)


def _none_completed(summary: dict[str, Any]) -> str:
    """``replay``'s line when no request completed: how many failed and the commonest
    error (the report's ``errors``, one message per kind)."""
    n = int(summary.get("requests") or 0)
    if not n:
        return "no request completed: the workload had no request to send"
    errors: dict[str, int] = summary.get("errors") or {}
    what = f"all {n} request{'s' if n != 1 else ''} failed"
    if len(errors) == 1:
        what += f" with: {' '.join(str(next(iter(errors))).split())}"
    elif errors:
        msg, k = max(errors.items(), key=lambda kv: kv[1])
        what += (f" ({len(errors)} kinds of error in the report; the commonest, {k}x: "
                 f"{' '.join(str(msg).split())})")
    return f"no request completed: {what}"


async def _replay_main(gateway: str, reqs: list[Any], *, time_scale: float, rate_scale: float,
                       nats_url: str | None, prefix: str, progress: bool,
                       meta: dict[str, Any], block_size: int = 512,
                       retry_s: float = 10.0, api_key: str | None = None,
                       slo: SloTable | None = None,
                       json_path: Path | None = None) -> dict[str, Any]:
    from rich.console import Console

    from shared.subjects import Subjects
    from vertumnus.live.http import HttpError, get_json
    from vertumnus.live.interrupt import InterruptGuard
    from vertumnus.live.observe import Observer
    from vertumnus.live.report import LiveReport
    from vertumnus.live.stack import replay_with_progress, write_json

    err = Console(stderr=True)
    if not (retry_s >= 0 and math.isfinite(retry_s)):
        raise ValueError(f"--retry must be finite and >= 0 wall seconds, got {retry_s}")
    try:
        status, body = await get_json(gateway.rstrip("/") + "/health")
    except (HttpError, ValueError) as exc:
        raise ValueError(f"gateway {gateway} is not reachable: {exc}") from None
    if status != 200:
        raise ValueError(f"gateway {gateway} is not healthy: {status} {body}")
    try:  # /health is open to probes; a key the gateway refuses fails here, not per request
        status, body = await get_json(gateway.rstrip("/") + "/v1/workers", api_key=api_key)
    except (HttpError, ValueError) as exc:
        raise ValueError(f"gateway {gateway} is not reachable: {exc}") from None
    if status == 401:
        raise ValueError(f"gateway {gateway} refused {'the' if api_key else 'a request without'}"
                         " API key (--api-key / VTM_API_KEY)")
    observer = None
    nc = None
    if nats_url:
        from vertumnus.live.tap import connect_cli

        try:
            nc = await connect_cli(nats_url, "vertumnus-replay")
        except OSError as exc:
            raise ValueError(f"cannot reach NATS at {_shown(nats_url)}: {exc}") from None
        observer = Observer(nc, Subjects(prefix))
        try:
            await observer.start()
        except BaseException:
            # Its error ends the replay here, before the try whose finally closes the
            # connection: closed now, with whatever the observer had started.
            with contextlib.suppress(Exception):
                await observer.stop()
            with contextlib.suppress(Exception):
                await nc.close()
            raise
    # The first Ctrl-C / SIGTERM ends the replay, the rest only say so: the report survives.
    guard = InterruptGuard(lambda: err.print("already stopping…"))
    guard.install()
    records: list[Any] = []
    interrupted = False
    try:
        # A fresh id prefix: the intake de-duplicates request ids for two minutes.
        records, interrupted = await replay_with_progress(
            gateway, reqs, time_scale, rate_scale, id_prefix=f"x{uuid.uuid4().hex[:6]}-",
            console=err, show_progress=progress, block_size=block_size, retry_s=retry_s,
            api_key=api_key, on_start=observer.mark_start if observer is not None else None)
        if observer is not None:
            await asyncio.sleep(0.5)
    except asyncio.CancelledError:  # in the wait for the last results: the records stand
        interrupted = True
    finally:
        guard.stopping(handled=interrupted)
        if observer is not None:
            await observer.stop()
        if nc is not None:
            with contextlib.suppress(Exception):
                await nc.drain()
    prefix_tokens = dict(observer.prefix_tokens) if observer is not None else {}
    report = LiveReport(records, time_scale, **({} if slo is None else {"slo": slo}),
                        changes=list(observer.changes) if observer else [],
                        followed_epochs=observer is not None, prefix_tokens=prefix_tokens,
                        followed_results=observer is not None,
                        meta={**meta, "interrupted": interrupted, "gateway": gateway,
                              **(observer.summary_counts() if observer is not None else {})})
    report.render(Console())
    summary = report.summary()
    if json_path is not None:
        write_json(json_path, summary)
        err.print(f"results written to {json_path}")
    guard.remove()  # only now: a Ctrl-C while the report is written must not lose it
    return summary
