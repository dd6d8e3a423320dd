"""One rank's page pool shared by several caches (services/rankd/engine/kvcache.py PagePool).

An engine rank keeps one cache per worker it has been a member of (the active one and the
retired ones); all of them live in the rank's single pool. A page is keyed by its block hash
and shared by the caches holding it; a slot is freed when its last holder lets go; a cache
that needs a slot when none is free gets one from ``reclaim``. Degree-1 caches here: one rank.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_kvcache import CFG, B, fake_kv, prefill

from services.rankd.engine.errors import KVFormatError
from services.rankd.engine.kvcache import PagePool, RankKVCache
from services.rankd.engine.rank import RankEngine
from shared.blockhash import chain_hashes
from shared.ids import InvalidInput, WorkerId


def pool(pages: int) -> PagePool:
    return PagePool(pages, CFG.num_hidden_layers, B, CFG.num_key_value_heads, CFG.head_dim,
                    torch.float64)


def cache(name: str, p: PagePool, pages_per_rank: int = 4) -> RankKVCache:
    return RankKVCache(WorkerId(name), 1, 0, B, pages_per_rank, CFG.num_hidden_layers,
                       CFG.num_key_value_heads, CFG.head_dim, torch.float64, pool=p)


def ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


def test_a_page_another_cache_holds_is_shared_not_copied() -> None:
    p = pool(4)
    old, new = cache("old", p), cache("new", p)
    doc = ids(13, 1)  # 3 full blocks
    prefill([old], doc)
    hashes = chain_hashes(doc, B)
    assert len(p) == 3 and p.free == 1
    before = [old.pool.get(h).clone() for h in hashes]
    stored = new.import_prefix(old.chain_of(hashes), old.export_pages(hashes))
    assert stored == hashes
    assert len(p) == 3 and [p.holders(h) for h in hashes] == [2, 2, 2]
    assert old.pages_outside(new) == new.pages_outside(old) == 0
    # Dropping one holder keeps the page for the other, intact.
    old.clear()
    assert len(p) == 3 and [p.holders(h) for h in hashes] == [1, 1, 1]
    assert all(torch.equal(new.pool.get(h), b) for h, b in zip(hashes, before, strict=True))
    assert [pg.hash for pg in new.export_pages(hashes)] == hashes
    assert old.export_pages(hashes) == []  # it holds nothing any more
    new.remove(hashes[:1])  # a block and its descendants
    assert len(p) == 0 and p.free == 4


def test_a_full_pool_reclaims_for_the_cache_that_needs_room() -> None:
    p = pool(4)
    retired, active = cache("retired", p), cache("active", p)
    prefill([retired], ids(17, 2))  # 4 full blocks: every slot
    assert p.free == 0 and retired.pages_outside(active) == 4
    with pytest.raises(RuntimeError, match="nothing to reclaim"):
        prefill([active], ids(9, 3))  # no reclaim hook: a bug, said as one

    calls = []

    def drop_retired() -> bool:
        calls.append(retired.pages_outside(active))
        if not retired.pages_outside(active):
            return False
        retired.clear()
        return True

    p.reclaim = drop_retired
    # The failed store above left the active cache's index without the blocks it could not
    # page in; start it afresh.
    active = cache("active2", p)
    doc = ids(9, 3)
    prefill([active], doc)
    assert calls == [4] and len(retired.blocks()) == 0
    assert active.blocks() == frozenset(chain_hashes(doc, B)) and len(p) == 2
    assert [pg.hash for pg in active.export_pages(chain_hashes(doc, B))] == chain_hashes(doc, B)


def test_a_pool_that_does_not_fit_the_cache_is_refused() -> None:
    with pytest.raises(InvalidInput, match="page pool of 2 pages for a cache of 4"):
        cache("w", pool(2))
    other = PagePool(4, CFG.num_hidden_layers, B + 1, CFG.num_key_value_heads, CFG.head_dim,
                     torch.float64)
    with pytest.raises(InvalidInput, match="page pool of"):
        cache("w", other)
    with pytest.raises(InvalidInput, match=">= 1 page"):
        pool(0)


def test_stored_kv_reads_back_from_a_shared_pool() -> None:
    p = pool(8)
    a, b = cache("a", p), cache("b", p)
    doc = ids(12, 4)
    kv = fake_kv(len(doc), seed=9)
    prefill([a], doc, kv)
    prefill([b], ids(8, 5))
    look = a.lookup(doc + ids(2, 6))
    assert look.match.prefix_len == 12 and look.local_kv is not None
    want = torch.stack([torch.stack([k[:12], v[:12]]) for k, v in kv])
    assert torch.equal(look.local_kv, want)


def test_pages_only_retired_caches_share_are_reclaimed_too() -> None:
    """Two retired caches holding the same pages: neither alone frees a slot, so the engine's
    reclaim drops one, then the other (found by the state machine: it used to give up)."""
    p = pool(2)
    engine = object.__new__(RankEngine)  # its reclaim rule, without a process group
    engine.pool, engine.retired = p, {}
    p.reclaim = engine._reclaim
    a, b = cache("a", p, 2), cache("b", p, 2)
    doc = ids(9, 7)  # 2 full blocks: both slots
    prefill([a], doc)
    hashes = chain_hashes(doc, B)
    b.import_prefix(a.chain_of(hashes), a.export_pages(hashes))
    assert p.free == 0 and [p.holders(h) for h in hashes] == [2, 2]
    engine.retired = {WorkerId("a"): a, WorkerId("b"): b}
    engine.cache = cache("c", p, 2)
    other = ids(5, 8)
    prefill([engine.cache], other)
    assert engine.retired == {} and engine.cache.blocks() == frozenset(chain_hashes(other, B))
    assert len(p) == 1 and p.free == 1


def test_a_new_worker_installs_the_pages_its_rank_holds_in_place() -> None:
    """After a merge (a degree-1 cache retired, a degree-2 cache active on CP rank 0), the
    active cache installs a chain with no page given: the pages it owns at degree 2 (0 and 2)
    are in the rank's pool already, so the slots are shared; a chain whose owned page is not
    resident goes only as far as :meth:`resident_prefix` says, and past that is refused."""
    p = pool(8)
    old = cache("old", p)
    new = RankKVCache(WorkerId("new"), 2, 0, B, 4, CFG.num_hidden_layers,
                      CFG.num_key_value_heads, CFG.head_dim, torch.float64, pool=p)
    doc = ids(13, 9)  # 3 full blocks
    prefill([old], doc)
    hashes = chain_hashes(doc, B)
    chain = old.chain_of(hashes)
    assert new.resident_prefix(hashes) == 3
    assert new.import_prefix(chain, []) == hashes
    assert len(p) == 3 and [p.holders(h) for h in hashes] == [2, 1, 2]  # page 1: rank 1's
    look = new.lookup(doc + [1])
    assert look.match.prefix_len == 12 and look.local_kv is not None

    other = ids(13, 10)
    prefill([old], other[:8])  # 2 blocks resident: pages 0 and 1 of `other`
    ho = chain_hashes(other, B)
    assert new.resident_prefix(ho) == 2  # page 2 (this rank's) is not resident
    with pytest.raises(KVFormatError, match="page 2 .* is missing"):
        new.import_prefix([(h, p_) for h, p_ in zip(ho, [None, *ho[:-1]], strict=True)], [])
    assert new.blocks() == frozenset(hashes)  # the refused import changed nothing
