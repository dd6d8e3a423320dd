"""rankd settings (environment ``VTM_*``; see shared/settings.py for the common ones)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from shared.service import WORKER_LEASE_S
from shared.settings import ServiceSettings
from shared.worker import GpuGroup, WorkerKind


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
    backend: Literal["sim"] = Field(
        default="sim", description="Execution backend ('sim' now; 'torch' later)."
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
        default=65_536, ge=0, description="KV cache capacity of the worker, in cache blocks."
    )
    max_queue: int = Field(
        default=4096, ge=1, description="Assignments queued beyond this are refused (409)."
    )

    @field_validator("worker_id")
    @classmethod
    def _lattice_id(cls, v: str) -> str:
        GpuGroup.from_worker_id(v)
        return v
