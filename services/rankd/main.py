"""Entry point of one rank daemon process: ``python -m services.rankd.main``.

Reads :class:`~services.rankd.settings.RankdSettings` from the environment, sets up logging
and tracing, builds the backend and runs until SIGINT/SIGTERM: one worker
(``VTM_WORKER_ID=w-cp4-g0``), or with ``VTM_HOST_GPUS=0-7`` every worker of that GPU range,
following the epoch record (:mod:`services.rankd.host`).

The ``sim`` backend started this way uses the assignment's predicted time (no ground truth);
a launcher that wants the simulator's ground truth builds ``SimBackend(prefill_time=...)``
itself and calls :func:`serve` (``services/`` never imports ``sim/``).

Exit status: 0 after SIGINT/SIGTERM; :data:`WORKER_FAULT_EXIT` after a worker fault (a rank
process died: the requests were handed back to intake first, see
:mod:`services.rankd.service`), so a supervisor (docker compose ``restart:``, systemd, k8s)
starts the process again; 2 for settings that cannot work together.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any, Final, TypeVar

import structlog

from services.rankd.backend import ExecutionBackend, SimBackend
from services.rankd.host import RankdHost
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.ids import WorkerFault
from shared.servicemain import load_settings, run_service
from shared.worker import WorkerKind

S = TypeVar("S", bound=RankdSettings)

WORKER_FAULT_EXIT: Final[int] = 75
"""Exit status after a worker fault: EX_TEMPFAIL ("try again"), the process should be
restarted. Any non-zero status makes ``restart: on-failure`` act; this one says why."""


def make_backend(settings: RankdSettings) -> ExecutionBackend:
    """The backend named in settings: ``sim`` or ``torch`` (imported lazily: torch is an extra)."""
    if settings.backend == "sim":
        return SimBackend(kind=settings.kind.value, time_scale=settings.time_scale)
    if settings.backend == "torch":
        from services.rankd.torch_backend import single_worker_backend

        return single_worker_backend(settings)
    raise ValueError(f"unknown backend {settings.backend!r}")  # pragma: no cover


async def serve(settings: RankdSettings, backend: ExecutionBackend | None = None) -> None:
    """Run one rank daemon (or, with ``host_gpus``, a host of them) until signalled."""
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


def run_rankd(settings: S, serve_fn: Callable[[S], Coroutine[Any, Any, None]]) -> None:
    """:func:`shared.servicemain.run_service` for a rank daemon (this main's, or a launcher's
    with its own ``serve``): a :class:`WorkerFault` ends the process with
    :data:`WORKER_FAULT_EXIT`, not a traceback."""
    try:
        run_service(settings, serve_fn)
    except WorkerFault:
        # The cause was logged as an error when it was met; no traceback on top of it.
        structlog.get_logger("vertumnus.rankd").info("exiting for a restart",
                                                     exit_status=WORKER_FAULT_EXIT)
        raise SystemExit(WORKER_FAULT_EXIT) from None


def main() -> None:
    run_rankd(load_settings(RankdSettings, "vertumnus rankd"), serve)


if __name__ == "__main__":
    main()
