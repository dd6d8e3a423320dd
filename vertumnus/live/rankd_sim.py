"""Rank daemons on the ``sim`` backend, timed by the simulator's ground truth ("the hardware").

``python -m vertumnus.live.rankd_sim`` is ``python -m services.rankd.main`` with one change:
each worker's :class:`~services.rankd.backend.SimBackend` sleeps for the ground truth's
prefill time (``sim.groundtruth.NoisyGroundTruth.prefill_time``), KV handoff time
(``GroundTruth.kv_handoff_time``) and first decode step (``Surroundings.first_decode_s``; the
two sum to ``external_time``), scaled by ``VTM_TIME_SCALE``, instead of the scheduler's
prediction. The rank daemon reports each as its own TTFT stage (and span). Each worker's KV
cache holds what the modelled GPUs' HBM leaves for it at its degree
(``GroundTruth.kv_capacity_blocks``, as the simulator's workers), unless
``VTM_KV_TOTAL_BLOCKS`` says otherwise.
``services/`` never imports ``sim/``; this launcher is where the two meet. It is what
``vertumnus rankd`` runs (by default: a standalone rank daemon models the hardware, design.md
layer 3), and what ``vertumnus up --backend sim`` and docker-compose run. ``VTM_TRUTH=predicted``
gives back the service module's own timing (the assignment's prediction, no handoff time);
``VTM_BACKEND=torch`` runs ``services.rankd.main`` unchanged (real compute, no modelled time).

Honesty (design.md): only the *workers* see the ground truth; the scheduler still loads a
fitted profile and never this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import Field

from services.rankd import main as rankd_main
from services.rankd.backend import ExecutionBackend, HandoffTimeFn, SimBackend
from services.rankd.host import RankdHost
from services.rankd.main import run_rankd
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.ids import DEFAULT_BLOCK_SIZE
from shared.servicemain import parse_flags
from shared.worker import GpuGroup, WorkerKind


class SimRankdSettings(RankdSettings):
    """rankd settings plus the ground truth that times the sim backend."""

    truth: Literal["noisy", "exact", "predicted"] = Field(
        default="noisy",
        description="Time source of the sim backend: 'noisy' (the default: ground truth × "
        "seeded lognormal noise, like the simulator's workers), 'exact' (noise-free ground "
        "truth), 'predicted' (the assignment's predicted time and no KV handoff or first decode "
        "time, as python -m services.rankd.main does). Ignored by VTM_BACKEND=torch.",
    )
    truth_seed: int = Field(default=0, ge=0, description="Seed of the ground-truth noise.")
    truth_noise: float = Field(
        default=0.04, ge=0, description="Lognormal sigma of the ground-truth noise ('noisy')."
    )
    hardware_path: Path | None = Field(
        default=None,
        description="The modelled model and GPUs: a .json or .toml hardware file "
        "(sim/hardware.py), as `vertumnus simulate --hardware` reads it; None: the ground "
        "truth's default (Qwen3-30B-A3B on H20). The services that predict need a profile "
        "fitted on the same hardware (VTM_PROFILE_PATH; `vertumnus up --hardware` fits one).",
    )
    block_size: int = Field(
        default=DEFAULT_BLOCK_SIZE, ge=1,
        description="Tokens per cache block (the gateway's VTM_BLOCK_SIZE): sizes each "
        "worker's cache in blocks from the hardware's HBM budget.",
    )


def _constant(seconds: float) -> HandoffTimeFn:
    """One decode iteration takes the same time whatever the prompt (the ground truth's
    ``first_decode_s``)."""

    def first_decode(total_tokens: int, degree: int) -> float:
        return seconds

    return first_decode


def backend_factory(settings: SimRankdSettings):  # type: ignore[no-untyped-def]
    """A (worker id, kind) → SimBackend factory sharing one ground truth per process."""
    from sim.groundtruth import DEFAULT_GROUND_TRUTH, NoisyGroundTruth
    from sim.hardware import load_ground_truth

    prefill = handoff = first_decode = None
    exact = DEFAULT_GROUND_TRUTH if settings.hardware_path is None \
        else load_ground_truth(settings.hardware_path)
    capacity = exact.kv_capacity_blocks  # the HBM budget, whatever times the prefill
    if settings.truth != "predicted":
        if settings.truth == "noisy":
            noisy = NoisyGroundTruth(exact, seed=settings.truth_seed, sigma=settings.truth_noise)
            # Only the prefill is noisy; handoff and decode are the noise-free model either way.
            prefill, exact = noisy.prefill_time, noisy.truth
        else:
            prefill = exact.prefill_time
        handoff = exact.kv_handoff_time
        first_decode = _constant(exact.surroundings.first_decode_s)

    def make(wid: str, kind: WorkerKind) -> ExecutionBackend:
        # handoff_off_worker: the worker is free at its prefill's end, as in the simulator
        # (the handoff and first decode still count in TTFT).
        return SimBackend(kind=kind.value, prefill_time=prefill, handoff_time=handoff,
                          first_decode_time=first_decode, handoff_off_worker=True,
                          time_scale=settings.time_scale,
                          kv_capacity_blocks=capacity(GpuGroup.from_worker_id(wid).degree,
                                                      block_size=settings.block_size))

    return make


async def serve(settings: SimRankdSettings) -> None:
    """One worker (``VTM_WORKER_ID``) or a host (``VTM_HOST_GPUS``) until SIGINT/SIGTERM.

    A backend other than ``sim`` models nothing: ``services.rankd.main``'s own ``serve`` runs
    it (so ``vertumnus rankd`` serves ``VTM_BACKEND=torch`` as the service module does)."""
    if settings.backend != "sim":
        await rankd_main.serve(settings)
        return
    make = backend_factory(settings)
    gpus = settings.host_range
    if gpus is not None:
        await RankdHost(settings, gpus, make, initial=settings.initial_worker_ids).run()
        return
    await RankdService(settings, make(settings.worker_id, settings.kind)).run()


DESCRIPTION = (
    "vertumnus rank daemon on the sim backend timed by the simulator's ground truth "
    "(VTM_TRUTH; VTM_BACKEND=torch runs the real engine): one worker (VTM_WORKER_ID) or, with "
    "VTM_HOST_GPUS, every worker of a GPU range. Configured by VTM_* environment variables "
    "only: it takes no arguments but --help.")


def main(argv: Sequence[str] | None = None) -> None:
    """Run a rank daemon; ``argv`` (None: ``sys.argv[1:]``) may hold only ``--help``: any
    other argument, like a bad VTM_* value, exits 2 naming it before anything connects; a
    worker fault exits 75, as the real main does. Pass ``[]`` when calling it from a process
    whose own ``sys.argv`` is not the daemon's (a test)."""
    run_rankd(parse_flags(SimRankdSettings, (), argv, prog="vertumnus rankd",
                          description=DESCRIPTION), serve, prog="vertumnus rankd")


if __name__ == "__main__":
    main()
