"""Entry point of one rank daemon process: ``python -m services.rankd.main``.

Reads :class:`~services.rankd.settings.RankdSettings` from the environment, sets up logging
and tracing, builds the backend and runs the service until SIGINT/SIGTERM.

The ``sim`` backend started this way uses the assignment's predicted time (no ground truth);
a launcher that wants the simulator's ground truth builds ``SimBackend(prefill_time=...)``
itself and calls :func:`serve` (``services/`` never imports ``sim/``).
"""

from __future__ import annotations

import asyncio

from services.rankd.backend import ExecutionBackend, SimBackend
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.logging import configure_logging
from shared.telemetry import setup_tracing, shutdown_tracing


def make_backend(settings: RankdSettings) -> ExecutionBackend:
    """The backend named in settings (``sim`` only, for now)."""
    if settings.backend == "sim":
        return SimBackend(kind=settings.kind.value, time_scale=settings.time_scale)
    raise ValueError(f"unknown backend {settings.backend!r}")  # pragma: no cover


async def serve(settings: RankdSettings, backend: ExecutionBackend | None = None) -> None:
    """Run one rank daemon until signalled (one AsyncExitStack inside ``run``)."""
    service = RankdService(settings, backend or make_backend(settings))
    await service.run()


def main() -> None:
    settings = RankdSettings()
    configure_logging(settings.log.format, settings.log.level, service=settings.service_name)
    setup_tracing(settings.service_name, settings.telemetry)
    try:
        asyncio.run(serve(settings))
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    main()
