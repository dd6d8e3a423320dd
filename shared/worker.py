"""What every core agrees a worker is: its kind, lifecycle and identity on the buddy lattice.

A degree-C worker occupies the aligned GPU group [first_gpu, first_gpu + C) (buddy lattice,
never crossing a node). The lifecycle values are those of §5.2/§6.2; the legal transitions
between them live in the controller's epoch state machine (services/controller/lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from shared.ids import GPUS_PER_NODE, InvalidInput, WorkerId, worker_name


class Lifecycle(StrEnum):
    ACTIVE = "active"  # schedulable
    DRAINING = "draining"  # finishing in-flight work; takes no new requests (§6.2)
    SWITCHING = "switching"  # ranks adopting a new epoch/geometry
    UNAVAILABLE = "unavailable"  # failed, lease expired, or not yet acknowledged


def worker_restarted(recorded: str | None, incarnation: str) -> bool:
    """Whether a worker state carrying ``incarnation`` (``WorkerState.incarnation``) shows a new
    start of the worker for which ``recorded`` was seen (None or "": none yet): only two
    non-empty, different tokens do. An empty ``incarnation`` (an older rank daemon) never does;
    the first one seen is only recorded. Pure."""
    return bool(recorded) and bool(incarnation) and incarnation != recorded


class WorkerKind(StrEnum):
    CP = "cp"  # context parallel: zigzag partition of the sequence over C ranks
    TP = "tp"  # tensor parallel (the vLLM-like baseline's workers)


@dataclass(frozen=True, slots=True, order=True)
class GpuGroup:
    """An aligned group of ``degree`` GPUs starting at ``first_gpu`` (a lattice node)."""

    first_gpu: int
    degree: int

    def __post_init__(self) -> None:
        if self.degree < 1 or self.degree & (self.degree - 1):
            raise InvalidInput(f"degree must be a power of two >= 1, got {self.degree}")
        if self.first_gpu < 0 or self.first_gpu % self.degree:
            raise InvalidInput(
                f"group of degree {self.degree} must start at a multiple of it, "
                f"got first_gpu={self.first_gpu}"
            )

    @property
    def gpus(self) -> range:
        return range(self.first_gpu, self.first_gpu + self.degree)

    @property
    def worker_id(self) -> WorkerId:
        return worker_name(self.degree, self.first_gpu)

    def within_node(self, gpus_per_node: int = GPUS_PER_NODE) -> bool:
        last = self.first_gpu + self.degree - 1
        return self.first_gpu // gpus_per_node == last // gpus_per_node

    @classmethod
    def from_worker_id(cls, wid: str) -> GpuGroup:
        """Parse ``w-cp{C}-g{first}`` back into its group."""
        try:
            _, cp, g = wid.split("-")
            if not (cp.startswith(("cp", "tp")) and g.startswith("g")):
                raise ValueError
            return cls(first_gpu=int(g[1:]), degree=int(cp[2:]))
        except ValueError as exc:
            raise InvalidInput(f"not a lattice worker id: {wid!r}") from exc
