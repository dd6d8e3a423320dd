"""rankd settings (environment ``VTM_*``; see shared/settings.py for the common ones)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from services import calibration
from shared.service import WORKER_LEASE_S
from shared.settings import ServiceSettings
from shared.worker import GpuGroup, WorkerKind


def initial_workers_problem(worker_ids: Sequence[str], gpus: range | None) -> str | None:
    """What is wrong with a rank host's initial workers (ids already known to parse), or None:
    a worker whose GPUs are not all in ``gpus`` (None: no range to check), or two workers
    that share a GPU -- the host would start both, each taking the other's ranks. Pure."""
    taken: dict[int, str] = {}
    for wid in worker_ids:
        g = GpuGroup.from_worker_id(wid)
        if gpus is not None and (g.gpus.start < gpus.start or g.gpus.stop > gpus.stop):
            return (f"initial worker {wid} (GPUs {g.gpus.start}-{g.gpus.stop - 1}) is outside "
                    f"the host's GPUs {gpus.start}-{gpus.stop - 1}")
        for gpu in g.gpus:
            other = taken.setdefault(gpu, wid)
            if other != wid:
                return f"initial workers {other} and {wid} share GPU {gpu}"
    return None


class RankdSettings(ServiceSettings):
    """One rank daemon process serving one worker (its leader rank, for now)."""

    service_name: str = Field(default="vtm-rankd", description="Service name in logs/traces.")
    worker_id: str = Field(
        default="w-cp1-g0",
        description="Lattice id of the worker this process leads, 'w-cp{C}-g{first_gpu}' "
        "(degree C over GPUs [first_gpu, first_gpu + C)).",
    )
    kind: WorkerKind = Field(default=WorkerKind.CP, description="'cp' or 'tp' (baseline).")
    epoch: int = Field(
        default=0, ge=0, description="Epoch assumed when no epoch record exists yet (dev runs)."
    )
    backend: Literal["sim", "torch"] = Field(
        default="sim",
        description="'sim' (modelled time) or 'torch' (real CP engine; VTM_TORCH_* settings, "
        "services/rankd/torch_settings.py; needs the 'engine' extra)",
    )
    time_scale: float = Field(
        default=1.0,
        gt=0,
        description="sim backend: sleep = modelled time × time_scale (0.01 runs 100× faster).",
    )
    heartbeat_s: float = Field(
        default=1.0, gt=0, description="Worker-state republish period (liveness heartbeat)."
    )
    lease_s: float = Field(
        default=WORKER_LEASE_S,
        gt=0,
        description="Worker-state bucket TTL when this process creates the bucket; must exceed "
        "heartbeat_s several times.",
    )
    kv_total_blocks: int = Field(
        default=65_536, ge=0, description="KV cache capacity of the worker, in cache blocks. "
        "Unset, the backend sizes it when it knows its memory: the torch engine (degree × "
        "VTM_TORCH_PAGES_PER_RANK) and the sim rank daemons of vertumnus.live.rankd_sim (the "
        "modelled GPUs' HBM budget at the worker's degree); otherwise this default.",
    )
    max_queue: int = Field(
        default=4096, ge=1, description="Assignments queued beyond this are refused (409)."
    )
    pull_hold_slack: float = Field(
        default=calibration.PULL_HOLD_SLACK, ge=1.0, allow_inf_nan=False,
        description="A request the scheduler placed counting on a route-time pull "
        "(Assignment.pull_copy_s) waits at the head of the queue for the copy at most this "
        "many times the copy's estimated time (capped at PULL_HOLD_MAX_COPY_S, × time_scale) "
        "after the worker admitted it, plus pull_hold_grace_s.",
    )
    pull_hold_grace_s: float = Field(
        default=calibration.PULL_HOLD_GRACE_S, ge=0.0, allow_inf_nan=False,
        description="Wall seconds added to that bound (the cache manager's command and the "
        "copy's round trips over the bus).",
    )
    redirect_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Bound on handing one batch of queued requests back to intake (drain or "
        "stop): publishes are retried with the same Nats-Msg-Id until acknowledged or this "
        "passes; a stop waits for outstanding redirects at most this long.",
    )

    host_gpus: str | None = Field(
        default=None,
        description="Host mode: the GPU range 'first-last' (e.g. '0-7') whose workers this "
        "process runs, following the epoch record (services/rankd/host.py); unset: one worker "
        "(worker_id).",
    )
    initial_workers: str = Field(
        default="",
        description="Host mode: comma-separated worker ids to run when no epoch record exists.",
    )

    @property
    def host_range(self) -> range | None:
        """``host_gpus`` as a range, or None when not in host mode."""
        if self.host_gpus is None:
            return None
        first, _, last = self.host_gpus.partition("-")
        return range(int(first), int(last or first) + 1)

    @property
    def initial_worker_ids(self) -> list[str]:
        return [w.strip() for w in self.initial_workers.split(",") if w.strip()]

    @field_validator("host_gpus")
    @classmethod
    def _range(cls, v: str | None) -> str | None:
        if v is not None:
            first, _, last = v.partition("-")
            if not (first.isdigit() and (not last or last.isdigit())) or int(last or first) < int(
                first
            ):
                raise ValueError(f"host_gpus must look like '0-7', got {v!r}")
        return v

    @field_validator("initial_workers")
    @classmethod
    def _workers(cls, v: str, info: ValidationInfo) -> str:
        ids = [w.strip() for w in v.split(",") if w.strip()]
        for w in ids:
            GpuGroup.from_worker_id(w)
        # host_gpus is declared before this field, so it is validated and in info.data (absent
        # when it failed: that error is reported on its own).
        first, _, last = (info.data.get("host_gpus") or "").partition("-")
        gpus = range(int(first), int(last or first) + 1) if first else None
        problem = initial_workers_problem(ids, gpus)
        if problem is not None:
            raise ValueError(problem)
        return v

    @field_validator("worker_id")
    @classmethod
    def _lattice_id(cls, v: str) -> str:
        GpuGroup.from_worker_id(v)
        return v
