"""One engine rank's caches and their shared page pool through random interleavings.

A hypothesis state machine plays rank 0 of a :class:`RankEngine` without a process group:
the active cache stores prompts, imports chains from retired caches (the copies after a
split or merge) or installs them in place from the pages its rank's pool holds, blocks are
removed, the rank switches to a new worker (the active cache is retired) or back to a retired
one (revived), and a full pool reclaims retired caches through the engine's own
``_reclaim``. After every step:

* the pool's slots in use are exactly the pages the caches hold, each counted once, with as
  many holders as caches that hold it, and ``free + in use == capacity``;
* every cache holds on this rank exactly the pages of its index this rank owns (page p on
  rank p mod C), within its ``pages_per_rank``;
* every page reads back the KV it was stored with (a block's KV is the same in every cache);
* retired caches all share the engine's pool.
"""

from __future__ import annotations

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from test_engine_kvcache import CFG, B

from services.rankd.engine.kvcache import Page, PagePool, RankKVCache
from services.rankd.engine.rank import RankEngine
from shared.blockhash import chain_hashes
from shared.ids import WorkerId

PAGES = 6
DOCS = tuple(tuple(range(100 * d, 100 * d + n)) for d, n in ((1, 21), (2, 9), (3, 13), (4, 25)))
"""Token ids of a few prompts; sharing comes from their prefixes (a prompt is a doc's head)."""


def token_kv(ids: list[int], start: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """KV of tokens ``ids`` at positions start.. as a function of (token, position) only, so
    a page's expected content is known whichever cache stored it."""
    shape = (CFG.num_key_value_heads, CFG.head_dim)
    out = []
    for layer in range(CFG.num_hidden_layers):
        k = torch.stack([torch.full(shape, float(t + 1000 * (start + i) + 7 * layer),
                                    dtype=torch.float64) for i, t in enumerate(ids)])
        out.append((k, -k))
    return out


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = PagePool(PAGES, CFG.num_hidden_layers, B, CFG.num_key_value_heads,
                             CFG.head_dim, torch.float64)
        # The engine's reclaim rule, run on this machine's caches (no process group needed).
        self.engine = object.__new__(RankEngine)
        self.engine.pool = self.pool
        self.engine.retired = {}
        self.pool.reclaim = self.engine._reclaim
        self.serial = 0
        self.engine.cache = self._new(2)  # the active cache
        self.expected: dict[int, torch.Tensor] = {}  # block hash -> the page's KV

    def _new(self, degree: int) -> RankKVCache:
        self.serial += 1
        return RankKVCache(WorkerId(f"w{self.serial}-cp{degree}"), degree, 0, B, PAGES,
                           CFG.num_hidden_layers, CFG.num_key_value_heads, CFG.head_dim,
                           torch.float64, pool=self.pool)

    def _caches(self) -> list[RankKVCache]:
        return [self.engine.cache, *self.engine.retired.values()]

    @rule(doc=st.sampled_from(DOCS), cut=st.integers(1, 25), tail=st.integers(0, 3))
    def store(self, doc: tuple[int, ...], cut: int, tail: int) -> None:
        ids = list(doc[:cut]) + [9] * tail
        look = self.engine.cache.lookup(ids)
        p = look.match.prefix_len
        stored = self.engine.cache.store(look, token_kv(ids[p:], p))
        hashes = chain_hashes(ids, B)
        for h in stored:
            i = hashes.index(h)
            kv = token_kv(ids[i * B:(i + 1) * B], i * B)
            self.expected.setdefault(h, torch.stack([torch.stack([k, v]) for k, v in kv]))

    @precondition(lambda self: self.engine.retired)
    @rule(data=st.data(), doc=st.sampled_from(DOCS))
    def import_from_retired(self, data: st.DataObject, doc: tuple[int, ...]) -> None:
        src = data.draw(st.sampled_from(sorted(self.engine.retired)))
        cache = self.engine.retired[src]
        hashes = chain_hashes(list(doc), B)
        held = []
        for h in hashes:  # the leading part the source holds (export_prefix's rule)
            if h not in cache.index:
                break
            held.append(h)
        pages = cache.export_pages(held)
        if any(i % cache.degree == 0 and h not in {pg.hash for pg in pages}
               for i, h in enumerate(held)):
            return
        # The pages other ranks own come from those ranks: here, from the expected KV (none
        # for a block only ever installed in place: its other ranks are not modelled).
        mine = {pg.hash for pg in pages}
        if any(h not in mine and h not in self.expected for h in held):
            return
        pages += [Page(h, cache.index.parent_of(h), i, self.expected[h])
                  for i, h in enumerate(held) if h not in mine]
        self.engine.cache.import_prefix(cache.chain_of(held), pages)

    @rule(doc=st.sampled_from(DOCS))
    def install_in_place(self, doc: tuple[int, ...]) -> None:
        """The adoption after a split or merge: as far as this rank's pool holds the pages
        the active cache owns, installed with no page given (shared)."""
        hashes = chain_hashes(list(doc), B)
        n = self.engine.cache.resident_prefix(hashes)
        chain = list(zip(hashes, [None, *hashes[:-1]], strict=True))[:n]
        if chain:
            self.engine.cache.import_prefix(chain, [])

    @precondition(lambda self: len(self.engine.cache.blocks()) > 0)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        self.engine.cache.remove([data.draw(st.sampled_from(sorted(self.engine.cache.blocks())))])

    @rule(degree=st.sampled_from((1, 2)))
    def switch_to_a_new_worker(self, degree: int) -> None:
        self.engine.retired[self.engine.cache.worker] = self.engine.cache
        self.engine.cache = self._new(degree)

    @precondition(lambda self: self.engine.retired)
    @rule(data=st.data())
    def switch_back(self, data: st.DataObject) -> None:
        w = data.draw(st.sampled_from(sorted(self.engine.retired)))
        self.engine.retired[self.engine.cache.worker] = self.engine.cache
        self.engine.cache = self.engine.retired.pop(w)

    @invariant()
    def slots_are_the_pages_held(self) -> None:
        holders: dict[int, int] = {}
        for c in self._caches():
            for h in c._mine:
                holders[h] = holders.get(h, 0) + 1
        assert len(self.pool) == len(holders)
        assert {h: self.pool.holders(h) for h in holders} == holders
        assert self.pool.free + len(self.pool) == self.pool.capacity == PAGES

    @invariant()
    def each_cache_holds_the_pages_its_index_owns_here(self) -> None:
        for c in self._caches():
            owned = {h for h in c.index._nodes if c.index._nodes[h].page % c.degree == 0}
            assert c._mine == owned, c.worker
            assert c.index.used(0) == len(owned) <= PAGES
            assert c.pool is self.pool

    @invariant()
    def pages_read_back_what_was_stored(self) -> None:
        for c in self._caches():
            for h in c._mine:
                assert torch.equal(self.pool.get(h), self.expected[h]), (c.worker, h)


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=30,
                                         deadline=None)
TestPoolMachine = PoolMachine.TestCase
