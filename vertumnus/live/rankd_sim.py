"""Rank daemons on the ``sim`` backend, timed by the simulator's ground truth ("the hardware").

``python -m vertumnus.live.rankd_sim`` is ``python -m services.rankd.main`` with one change:
each worker's :class:`~services.rankd.backend.SimBackend` sleeps for the ground truth's
prefill time (``sim.groundtruth.NoisyGroundTruth.prefill_time``) and KV handoff + first decode
time (``external_time``), scaled by ``VTM_TIME_SCALE``, instead of the scheduler's prediction.
``services/`` never imports ``sim/``; this launcher is where the two meet.

Honesty (design.md): only the *workers* see the ground truth; the scheduler still loads a
fitted profile and never this module.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.rankd.backend import ExecutionBackend, SimBackend
from services.rankd.host import RankdHost
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.servicemain import run_service
from shared.worker import WorkerKind


class SimRankdSettings(RankdSettings):
    """rankd settings plus the ground truth that times the sim backend."""

    truth: Literal["noisy", "exact", "predicted"] = Field(
        default="noisy",
        description="Time source of the sim backend: 'noisy' (ground truth × seeded lognormal "
        "noise, like the simulator's workers), 'exact' (noise-free ground truth), 'predicted' "
        "(the assignment's predicted time, as services.rankd.main does).",
    )
    truth_seed: int = Field(default=0, ge=0, description="Seed of the ground-truth noise.")
    truth_noise: float = Field(
        default=0.04, ge=0, description="Lognormal sigma of the ground-truth noise ('noisy')."
    )


def backend_factory(settings: SimRankdSettings):  # type: ignore[no-untyped-def]
    """A (worker id, kind) → SimBackend factory sharing one ground truth per process."""
    prefill = handoff = None
    if settings.truth != "predicted":
        from sim.groundtruth import DEFAULT_GROUND_TRUTH, NoisyGroundTruth

        if settings.truth == "noisy":
            truth = NoisyGroundTruth(seed=settings.truth_seed, sigma=settings.truth_noise)
            prefill, handoff = truth.prefill_time, truth.external_time
        else:
            prefill, handoff = DEFAULT_GROUND_TRUTH.prefill_time, DEFAULT_GROUND_TRUTH.external_time

    def make(wid: str, kind: WorkerKind) -> ExecutionBackend:
        return SimBackend(kind=kind.value, prefill_time=prefill, handoff_time=handoff,
                          time_scale=settings.time_scale)

    return make


async def serve(settings: SimRankdSettings) -> None:
    """One worker (``VTM_WORKER_ID``) or a host (``VTM_HOST_GPUS``) until SIGINT/SIGTERM."""
    make = backend_factory(settings)
    gpus = settings.host_range
    if gpus is not None:
        await RankdHost(settings, gpus, make, initial=settings.initial_worker_ids).run()
        return
    await RankdService(settings, make(settings.worker_id, settings.kind)).run()


def main() -> None:
    run_service(SimRankdSettings(), serve)


if __name__ == "__main__":
    main()
