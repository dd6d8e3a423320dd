"""Every lattice CP group, created once at start-up, and the rank's active group.

A degree-C worker occupies the aligned ranks [kC, (k+1)C) (buddy lattice, design.md). All
groups for the configured degrees are created with ``dist.new_group`` at start-up: NOTE every
rank of the world must call ``new_group`` for every group, members or not, in the same order
(torch.distributed requirement), so creation is a collective of the whole world and happens
exactly once. Groups are then warmed (one tiny all-gather) so the first request does not pay
for connection set-up.

Switching (§6.2 split/merge): the rank keeps its model weights and process; at a step boundary
it adopts a new epoch whose degree selects another, already existing group, then parks on that
group's barrier so that every member switched before any collective of the new geometry runs
(the "common model-input boundary" of a merge). A switch during a step is refused.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from services.rankd.engine.errors import GroupError
from shared.ids import WorkerId, worker_name


@dataclass(frozen=True)
class CPGroup:
    """One worker's CP group as seen by a member rank.

    ``members``: global ranks, ascending; ``rank``: this rank's CP rank (index in members);
    ``pg``: the process group (None for degree 1, which needs no collective).
    """

    degree: int
    members: tuple[int, ...]
    rank: int
    pg: dist.ProcessGroup | None
    gpu_offset: int = 0

    @property
    def worker_id(self) -> WorkerId:
        return worker_name(self.degree, self.members[0] + self.gpu_offset)

    def all_gather(self, t: Tensor) -> list[Tensor]:
        """Every member's ``t`` (same shape and dtype on every member), in CP-rank order."""
        if self.degree == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.degree)]
        dist.all_gather(out, t.contiguous(), group=self.pg)
        return out

    def barrier(self) -> None:
        if self.degree > 1:
            dist.barrier(group=self.pg)


def local_group() -> CPGroup:
    """A degree-1 group for single-process use (no torch.distributed needed)."""
    return CPGroup(degree=1, members=(0,), rank=0, pg=None)


@dataclass(frozen=True)
class SwitchReport:
    epoch: int
    old_degree: int
    new_degree: int
    old_worker: WorkerId
    new_worker: WorkerId
    seconds: float  # from the switch call until every member of the new group parked


def collective_device() -> torch.device:
    """The device collectives of the default process group use: the current CUDA device for
    NCCL, the CPU otherwise (gloo)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class RankGroups:
    """All lattice groups of ``degrees`` over the world; the active one per epoch.

    Requires an initialised default process group. ``gpu_offset`` maps global rank r to GPU id
    r + gpu_offset in worker ids. ``timeout``: how long a collective of a lattice group may
    wait for its members before it fails (None: torch's default for the backend, 30 min for
    gloo -- not the default group's timeout; give the world's collective timeout here, so a
    member that never joins breaks the collective, and the world, in that time).
    """

    def __init__(
        self,
        degrees: Iterable[int] = (1, 2, 4),
        initial_degree: int = 1,
        gpu_offset: int = 0,
        warm: bool = True,
        device: torch.device | str | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise GroupError("torch.distributed is not initialised")
        # The warm-up tensor must live where the backend communicates: NCCL only moves CUDA
        # tensors (of the rank's current device), gloo CPU ones.
        self.device = torch.device(device) if device is not None else collective_device()
        self.world = dist.get_world_size()
        self.me = dist.get_rank()
        self.gpu_offset = gpu_offset
        self.degrees = tuple(sorted(set(degrees)))
        for d in self.degrees:
            if d < 1 or d & (d - 1) or self.world % d:
                raise GroupError(f"degree {d} must be a power of two dividing world {self.world}")
        self._groups: dict[int, CPGroup] = {}
        for d in self.degrees:  # same order on every rank (NOTE above)
            for start in range(0, self.world, d):
                members = tuple(range(start, start + d))
                # new_group does not inherit init_process_group's timeout: pass it explicitly.
                pg = dist.new_group(list(members), timeout=timeout) if d > 1 else None
                if self.me in members:
                    self._groups[d] = CPGroup(d, members, members.index(self.me), pg, gpu_offset)
        if warm:
            for d in self.degrees:
                g = self._groups[d]
                g.all_gather(torch.zeros(1, device=self.device))
        if initial_degree not in self._groups:
            raise GroupError(f"initial degree {initial_degree} not in {self.degrees}")
        self.active: CPGroup = self._groups[initial_degree]
        self.epoch = 0
        self._in_step = False

    def group(self, degree: int) -> CPGroup:
        try:
            return self._groups[degree]
        except KeyError:
            raise GroupError(f"no lattice group of degree {degree} (have {self.degrees})") from None

    # Step bracketing: the geometry is pinned for a whole step (§6.2).
    def begin_step(self) -> CPGroup:
        self._in_step = True
        return self.active

    def end_step(self) -> None:
        self._in_step = False

    def switch(self, epoch: int, degree: int) -> SwitchReport:
        """Adopt ``epoch`` with CP degree ``degree`` at a step boundary (no restart, no reload).

        Raises :class:`GroupError` (and changes nothing) inside a step, for an epoch not newer
        than the current one or for an unknown degree. Collective over the NEW group: every
        member must call it with the same epoch and degree.
        """
        if self._in_step:
            raise GroupError("cannot switch CP group inside a step")
        if epoch <= self.epoch:
            raise GroupError(f"epoch {epoch} is not newer than the current epoch {self.epoch}")
        new = self.group(degree)
        t0 = time.perf_counter()
        old = self.active
        self.active = new
        self.epoch = epoch
        new.barrier()  # park: no new-geometry collective before every member has switched
        return SwitchReport(
            epoch, old.degree, new.degree, old.worker_id, new.worker_id, time.perf_counter() - t0
        )
