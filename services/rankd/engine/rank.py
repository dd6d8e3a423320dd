"""One rank of a CP prefill worker: model (loaded once), lattice groups, prefix cache.

:meth:`RankEngine.prefill` is one engine step: lookup of the longest cached prefix, zigzag CP
prefill of the uncached suffix, storing the new full blocks. The geometry is pinned for the
step (§6.2); :meth:`RankEngine.switch` changes it between steps without restarting the process
or reloading weights. After a switch the previous worker's cache is kept as *retired* (its
pages stay resident for reconciliation: export them to the new geometry, then drop it with
``retired.pop``); switching back to that worker revives it.

Every method is an SPMD call over the active group: all members call it with the same
arguments in the same order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch import Tensor

from services.rankd.engine.attention import Backend
from services.rankd.engine.cp_prefill import PrefillResult, cp_prefill
from services.rankd.engine.groups import CPGroup, RankGroups, SwitchReport
from services.rankd.engine.kvcache import Event, RankKVCache
from services.rankd.engine.model import Qwen3ForCausalLM
from shared.ids import BlockHash, WorkerId


@dataclass(frozen=True)
class StepOutput:
    """One prefill step: the CP result, the prefix length reused, the blocks newly cached,
    and the step's wall time on this rank (seconds)."""

    result: PrefillResult
    prefix_len: int
    stored: list[BlockHash]
    seconds: float

    @property
    def next_token(self) -> int:
        return self.result.next_token


class RankEngine:
    def __init__(
        self,
        model: Qwen3ForCausalLM,
        groups: RankGroups,
        block_size: int = 16,
        pages_per_rank: int = 256,
        backend: Backend | None = None,
    ) -> None:
        self.model = model
        self.groups = groups
        self.block_size = block_size
        self.pages_per_rank = pages_per_rank
        self.backend = backend
        self.cache = self._new_cache(groups.active)
        self.retired: dict[WorkerId, RankKVCache] = {}

    def _new_cache(self, g: CPGroup) -> RankKVCache:
        cfg = self.model.config
        return RankKVCache(
            g.worker_id,
            g.degree,
            g.rank,
            self.block_size,
            self.pages_per_rank,
            cfg.num_hidden_layers,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.model.dtype,
            self.model.device,
        )

    @property
    def group(self) -> CPGroup:
        return self.groups.active

    @property
    def worker_id(self) -> WorkerId:
        return self.group.worker_id

    def prefill(self, token_ids: Tensor | list[int]) -> StepOutput:
        """Prefill a whole request (all its tokens); reuses its longest cached prefix."""
        t0 = time.perf_counter()
        ids = self.model.check_request(torch.as_tensor(token_ids))  # before touching the cache
        grp = self.groups.begin_step()
        try:
            look = self.cache.lookup(ids)
            p = look.match.prefix_len
            res = cp_prefill(
                self.model, grp, ids[p:], look.local_kv, p, self.block_size, self.backend
            )
            stored = self.cache.store(look, res.new_kv)
        finally:
            self.groups.end_step()
        return StepOutput(res, p, stored, time.perf_counter() - t0)

    def switch(self, epoch: int, degree: int) -> SwitchReport:
        """Adopt ``epoch`` at CP degree ``degree`` (split or merge) at this step boundary."""
        old = self.cache
        report = self.groups.switch(epoch, degree)
        if report.new_worker != old.worker:
            self.retired[old.worker] = old
            # Returning to a worker this rank retired (e.g. split then merge back): its pages
            # are still laid out for that geometry on every member, so it is revived as is.
            revived = self.retired.pop(report.new_worker, None)
            self.cache = revived if revived is not None else self._new_cache(self.group)
        return report

    def take_events(self) -> list[Event]:
        return self.cache.take_events()
