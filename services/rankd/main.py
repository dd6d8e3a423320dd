"""Entry point of one rank daemon process: ``python -m services.rankd.main``.

Reads :class:`~services.rankd.settings.RankdSettings` from the environment, sets up logging
and tracing, builds the backend and runs until SIGINT/SIGTERM: one worker
(``VTM_WORKER_ID=w-cp4-g0``), or with ``VTM_HOST_GPUS=0-7`` every worker of that GPU range,
following the epoch record (:mod:`services.rankd.host`).

Timing of the ``sim`` backend started this way: the assignment's ``predicted_s`` (the
scheduler's own estimate) × ``VTM_TIME_SCALE``, with 0 s of KV transfer and first decode — no
ground truth, and this is deliberate, not a fallback: nothing under ``services/`` imports
``sim/``, where the ground truth lives (design.md: services are thin adapters; enforced by
tests/sim_engine/test_sim_honesty.py), so the service cannot time itself by it. The process logs
a warning saying so at start. Use it where the caller sets the time through ``predicted_s``
(tests, harnesses). A rank daemon that models the hardware — design.md's ``sim`` backend,
"sleeps for the ground-truth time" — is :mod:`vertumnus.live.rankd_sim`: what ``vertumnus
rankd`` runs by default, and ``vertumnus up`` and docker-compose run (``VTM_TRUTH`` chooses
noisy / exact ground truth, or ``predicted`` for this module's timing). The torch backend
computes for real and is the same here and there.

Exit status: 0 after SIGINT/SIGTERM (during the start-up too); :data:`WORKER_FAULT_EXIT` after
a worker fault (a rank process died: the requests were handed back to intake first, see
:mod:`services.rankd.service`), and after a start-up (the rank host's or a single worker's)
that lost its NATS server
(:class:`~shared.service.StartUpLost`: logged as an error, what had started stopped), so a
supervisor (docker compose ``restart:``, systemd, k8s) starts the process again; 2 for
settings that cannot work together, the torch backend's ``VTM_TORCH_*`` included (checked
before any rank process is spawned: :func:`check_torch_settings`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Final, TypeVar

import structlog

from services.rankd.backend import BACKENDS, ExecutionBackend
from services.rankd.host import RankdHost
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.ids import WorkerFault
from shared.service import StartUpLost
from shared.servicemain import parse_flags, run_service
from shared.worker import WorkerKind

S = TypeVar("S", bound=RankdSettings)

WORKER_FAULT_EXIT: Final[int] = 75
"""Exit status after a worker fault, or a rank host's start-up that lost its NATS server:
EX_TEMPFAIL ("try again"), the process should be restarted. Any non-zero status makes
``restart: on-failure`` act; this one says why."""


PREDICTED_TIME_WARNING: Final[str] = (
    "sim backend timed by each assignment's predicted_s (the scheduler's estimate), with no KV "
    "transfer or first decode time: no ground truth (services never import sim/); "
    "`vertumnus rankd` or `python -m vertumnus.live.rankd_sim` times it by the ground truth"
)


def make_backend(settings: RankdSettings) -> ExecutionBackend:
    """One worker's backend named in settings (:data:`~services.rankd.backend.BACKENDS`):
    ``sim`` timed by the prediction, or ``torch`` (imported lazily: torch is an extra)."""
    factory = BACKENDS.get(settings.backend)
    if factory is None:  # pragma: no cover - the settings' Literal admits only registered names
        raise ValueError(f"unknown backend {settings.backend!r}")
    return factory(settings)


async def serve(settings: RankdSettings, backend: ExecutionBackend | None = None) -> None:
    """Run one rank daemon (or, with ``host_gpus``, a host of them) until signalled.

    ``backend`` (one worker only): run on it instead of :func:`make_backend`'s."""
    if backend is None and settings.backend == "sim":
        # Said once per process, where an operator looks: a sim pool on this entry point
        # reports TTFTs that merely echo the scheduler's predictions.
        structlog.get_logger("vertumnus.rankd").warning(PREDICTED_TIME_WARNING)
    gpus = settings.host_range
    if gpus is not None and settings.backend == "torch":
        from services.rankd.torch_backend import serve_torch_host

        await serve_torch_host(settings)
        return
    if gpus is not None:

        def factory(wid: str, kind: WorkerKind) -> ExecutionBackend:
            return make_backend(settings.model_copy(update={"worker_id": wid, "kind": kind}))

        host = RankdHost(settings, gpus, factory, initial=settings.initial_worker_ids)
        await host.run()
        return
    service = RankdService(settings, backend or make_backend(settings))
    await service.run()


def check_torch_settings(settings: RankdSettings, prog: str) -> None:
    """Exit 2 when the ``torch`` backend could not start on ``settings`` and the
    ``VTM_TORCH_*`` environment (:func:`services.rankd.torch_spec.torch_problems`): prints
    ``{prog}: invalid settings:`` and one line per problem, naming the variable, its value and
    what it may be, as :func:`shared.servicemain.check_settings` does. A ``sim`` daemon
    passes whatever ``VTM_TORCH_*`` holds: it reads none. Before, every value failed only
    once the daemon ran: as a traceback of the pool's start (exit status 1;
    ``VTM_TORCH_HANDOFF`` included), or inside each spawned rank (a broken world, exit
    status 75, for a restart that fails the same way)."""
    from services.rankd.torch_spec import torch_problems

    problems = torch_problems(settings)
    if problems:
        lines = "\n".join(f"  {p}" for p in problems)
        print(f"{prog}: invalid settings:\n{lines}", file=sys.stderr)
        raise SystemExit(2)


def run_rankd(settings: S, serve_fn: Callable[[S], Coroutine[Any, Any, None]],
              prog: str | None = None) -> None:
    """:func:`shared.servicemain.run_service` for a rank daemon (this main's, or a launcher's
    with its own ``serve``), once :func:`check_torch_settings` passed (``prog``: the command
    its message names; None: ``settings.service_name``) -- here, where every entry point of a
    rank daemon passes, before logging, tracing or the event loop start: a :class:`WorkerFault`
    ends the process with :data:`WORKER_FAULT_EXIT`, not a traceback; so does a rank host's
    start-up that lost its NATS server (:class:`~shared.service.StartUpLost`), as a single
    worker's does."""
    check_torch_settings(settings, prog or settings.service_name)
    try:
        run_service(settings, serve_fn)
    except (WorkerFault, StartUpLost):
        # The cause was logged as an error when it was met; no traceback on top of it.
        structlog.get_logger("vertumnus.rankd").info("exiting for a restart",
                                                     exit_status=WORKER_FAULT_EXIT)
        raise SystemExit(WORKER_FAULT_EXIT) from None


PROG: Final[str] = "python -m services.rankd.main"
DESCRIPTION: Final[str] = (
    "vertumnus rank daemon: one prefill worker (VTM_WORKER_ID) or, with VTM_HOST_GPUS, every "
    "worker of a GPU range. Configured by VTM_* environment variables only: it takes no "
    "arguments but --help.")


def parse_settings(argv: Sequence[str] | None = None) -> RankdSettings:
    """Settings from the environment, checked before anything connects. ``argv`` (None:
    ``sys.argv[1:]``) may hold only ``--help`` (usage and every ``VTM_*`` variable, exit 0):
    any other argument exits 2 naming it, as does a bad setting (e.g. a NATS URL without
    scheme) -- a rank daemon that ignored them would wait for NATS forever."""
    return parse_flags(RankdSettings, (), argv, prog=PROG, description=DESCRIPTION)


def main(argv: Sequence[str] | None = None) -> None:
    """Run a rank daemon; ``argv`` as :func:`parse_settings` (pass ``[]`` when calling it from
    a process whose own ``sys.argv`` is not the daemon's, e.g. a test)."""
    run_rankd(parse_settings(argv), serve, prog=PROG)


if __name__ == "__main__":
    main()
