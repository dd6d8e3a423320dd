"""One rank of a CP prefill worker: model (loaded once), lattice groups, prefix cache.

:meth:`RankEngine.prefill` is one engine step: lookup of the longest cached prefix, zigzag CP
prefill of the uncached suffix, storing the new full blocks. The geometry is pinned for the
step (§6.2); :meth:`RankEngine.switch` changes it between steps without restarting the process
or reloading weights. After a switch the previous worker's cache is kept as *retired* (its
pages stay resident for reconciliation: export them to the new geometry, then drop it with
``retired.pop``); switching back to that worker revives it. Every cache of the rank shares
one page pool (allocated once); when the active cache needs a slot a retired cache holds, the
retired cache goes (:meth:`RankEngine._reclaim`).

Every method is an SPMD call over the active group: all members call it with the same
arguments in the same order.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from services.rankd.engine.attention import Backend
from services.rankd.engine.cp_prefill import PrefillResult, cp_prefill
from services.rankd.engine.groups import CPGroup, RankGroups, SwitchReport
from services.rankd.engine.kvcache import Event, Page, PagePool, RankKVCache
from services.rankd.engine.model import Qwen3ForCausalLM
from shared.ids import BlockHash, WorkerId


@dataclass(frozen=True)
class StepOutput:
    """One prefill step: the CP result, the prefix length reused, the blocks newly cached,
    the step's wall time on this rank (seconds) and the blocks evicted to make room."""

    result: PrefillResult
    prefix_len: int
    stored: list[BlockHash]
    seconds: float
    evicted: list[BlockHash] = field(default_factory=list)

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
        cfg = model.config
        # One allocation of KV pages for the rank's lifetime, whatever the switches (PagePool).
        self.pool = PagePool(pages_per_rank, cfg.num_hidden_layers, block_size,
                             cfg.num_key_value_heads, cfg.head_dim, model.dtype, model.device)
        self.pool.reclaim = self._reclaim
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
            pool=self.pool,
        )

    def _reclaim(self) -> bool:
        """Make room in the rank's page pool for the active cache: drop the retired cache
        retired longest ago among those holding a page the active cache does not (the pool
        calls again while no slot is free: a page two retired caches hold frees when both
        went); False if none does. Retired caches are donors (export, copies after a split
        or merge), so losing one costs only copies, which then find less; it is why a
        revival is agreed (switch)."""
        for worker, cache in self.retired.items():
            if cache.pages_outside(self.cache):
                del self.retired[worker]
                cache.clear()
                return True
        return False

    @property
    def group(self) -> CPGroup:
        return self.groups.active

    @property
    def worker_id(self) -> WorkerId:
        return self.group.worker_id

    def prefill(
        self,
        token_ids: Tensor | list[int],
        *,
        chain: list[BlockHash] | None = None,
        max_prefix: int | None = None,
    ) -> StepOutput:
        """Prefill a whole request (all its tokens); reuses its longest cached prefix.

        ``chain`` / ``max_prefix``: the request's block hashes as cache keys and a cap on the
        reused prefix (see :meth:`RankKVCache.lookup`); rankd passes its own so that this cache
        follows rankd's BlockCache. Input errors are raised before any collective.
        """
        t0 = time.perf_counter()
        # Before touching the cache, and on the ids as given: check_request range-checks a
        # list before converting it (an id >= 2**63 would overflow torch.as_tensor).
        ids = self.model.check_request(token_ids)
        grp = self.groups.begin_step()
        try:
            look = self.cache.lookup(ids, chain=chain, max_prefix=max_prefix)
            p = look.match.prefix_len
            res = cp_prefill(
                self.model, grp, ids[p:], look.local_kv, p, self.block_size, self.backend
            )
            stored = self.cache.store(look, res.new_kv)
        finally:
            self.groups.end_step()
        return StepOutput(res, p, stored, time.perf_counter() - t0, self.cache.last_evicted)

    def cache_of(self, worker: str) -> RankKVCache | None:
        """This rank's cache of ``worker``: the active one, a retired one (its pages stay
        resident after a split / merge for reconciliation), or None."""
        if worker == self.cache.worker:
            return self.cache
        return self.retired.get(WorkerId(worker))

    def export_prefix(
        self, worker: str, hashes: list[BlockHash]
    ) -> tuple[list[tuple[BlockHash, BlockHash | None]], list[Page]]:
        """The longest leading part of the chain ``hashes`` that ``worker``'s cache on this
        rank holds: its (hash, parent) metadata and this rank's pages of it (copies). Empty
        when this rank has no cache of ``worker``. No collective."""
        cache = self.cache_of(worker)
        if cache is None:
            return [], []
        held: list[BlockHash] = []
        parent = None
        for h in hashes:
            if h not in cache.index or cache.index.parent_of(h) != parent:
                break
            held.append(h)
            parent = h
        # On the CPU for transport: pipes and other processes need no CUDA context.
        pages = [replace(pg, kv=pg.kv.cpu()) for pg in cache.export_pages(held)]
        return cache.chain_of(held), pages

    def import_prefix(
        self,
        chain: list[tuple[BlockHash, BlockHash | None]],
        pages: list[Page],
        protect: list[BlockHash] | tuple[BlockHash, ...] = (),
        *,
        payload_shape: tuple[int, ...] | None = None,
    ) -> tuple[list[BlockHash], list[BlockHash]]:
        """Install a chain and its pages into the active cache (keeping this rank's pages),
        never evicting a block of ``protect`` to make room (what does not fit is not stored);
        returns (stored, evicted). ``pages`` may be only this rank's share of the chain's
        pages, ``payload_shape`` then the shape of every page of the whole payload
        (:meth:`RankKVCache.import_prefix`). Validates first: KVFormatError changes nothing."""
        stored = self.cache.import_prefix(
            chain, pages, frozenset(protect), payload_shape=payload_shape
        )
        return stored, self.cache.last_evicted

    def resident_prefix(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of the chain the active cache could install from pages
        this rank already holds (:meth:`RankKVCache.resident_prefix`); no collective."""
        return self.cache.resident_prefix(list(hashes))

    def remove(self, hashes: list[BlockHash]) -> list[BlockHash]:
        """Drop blocks (and their cached descendants) from the active cache; no collective."""
        return self.cache.remove(list(hashes))

    def cached_blocks(self) -> frozenset[BlockHash]:
        """The block hashes the active cache holds (identical on every member)."""
        return self.cache.blocks()

    def switch(self, epoch: int, degree: int) -> SwitchReport:
        """Adopt ``epoch`` at CP degree ``degree`` (split or merge) at this step boundary.

        Collective over the new group: every member calls it, including a member already in
        that group (one that never adopted an intermediate split: it keeps its active cache
        if the others can revive theirs). Afterwards the members' active caches hold the same
        index: the new worker's cache, kept or revived, if every member still has it; else a
        fresh, empty one on every member (:meth:`cached_blocks` tells which)."""
        old = self.cache
        report = self.groups.switch(epoch, degree)
        if report.new_worker != old.worker:
            self.retired[old.worker] = old
            # Returning to a worker this rank retired (e.g. split then merge back): its pages
            # are still laid out for that geometry, so it is revived as is -- if every member
            # still has it: a rank that dropped its copy for room (_reclaim) would leave the
            # members' indices different, and every step relies on their being identical.
            keep = self.retired.pop(report.new_worker, None)
        else:
            # Already this worker (it never switched away): its active cache is its copy.
            keep = old
        # The collective on every member, whether its worker changed or not: a member that
        # skipped it would leave the others blocked in the all-gather.
        if not self._every_member(keep is not None) and keep is not None:
            keep.clear()  # some member lacks it: no member keeps it
            keep = None
        self.cache = keep if keep is not None else self._new_cache(self.group)
        return report

    def _every_member(self, flag: bool) -> bool:
        """True iff ``flag`` holds on every member of the active group (a collective)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.groups.device)
        return all(bool(x.item()) for x in self.group.all_gather(t))

    def take_events(self) -> list[Event]:
        return self.cache.take_events()
