"""Making room in the paged prefix cache when the ranks of a worker need pages unevenly.

The C ranks of a worker are emulated in one process (every cache method is an SPMD call, so C
objects fed the same calls are exactly a worker; test_engine_kvcache_world.py runs the same
situations on a real gloo world). Two properties:

* the ranks never disagree on what is cached, even when one rank cannot get room and the
  others can (each rank keeps the whole worker's index, including every rank's page use);
* a rank gives up pages only for pages that are stored: when another rank's lack of room cuts
  the chain, the evictions planned for the part that is not stored do not happen.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_engine_kvcache import B, fake_kv, gathered, prefill, worker

from services.rankd.engine.cp_prefill import stack_kv
from services.rankd.engine.errors import KVFormatError
from services.rankd.engine.kvcache import RankKVCache
from shared.blockhash import chain_hashes


def source(ids: list[int], seed: int = 5) -> tuple[list, list, list]:
    """A degree-1 worker holding ``ids``'s full blocks: (chain, pages, the kv used)."""
    src = worker(1, pages=64, name="src")
    _, kv = prefill(src, ids, fake_kv(len(ids), seed=seed))
    hashes = chain_hashes(ids, B)
    return src[0].chain_of(hashes), src[0].export_pages(hashes), kv


def import_all(ranks: list[RankKVCache], chain, pages, protect=frozenset()):
    """import_prefix on every rank with the same arguments; returns each rank's
    (stored, evicted)."""
    return [(c.import_prefix(chain, pages, protect), c.last_evicted) for c in ranks]


def assert_ranks_agree(ranks: list[RankKVCache]) -> None:
    """One worker-level index on every rank, and each rank's pool holds exactly the cached
    blocks it owns (page p on rank p mod C)."""
    idx = ranks[0].index
    deg = len(ranks)
    for r, c in enumerate(ranks):
        assert c.index.snapshot() == idx.snapshot()
        assert [c.index.used(q) for q in range(deg)] == [idx.used(q) for q in range(deg)]
        owned = {h for h, n in idx._nodes.items() if n.page % deg == r}
        assert set(c.pool._slot) == owned
        assert idx.used(r) == len(owned) <= idx.pages_per_rank


def test_a_rank_without_room_costs_the_others_nothing() -> None:
    """Rank 0's pages are all protected, rank 1 has an evictable leaf: the import cannot
    store its first page (rank 0), so it stores nothing -- and must evict nothing. The old
    code evicted y's tail on every rank for the chain's page 1, which was never stored."""
    ranks = worker(2, pages=2)
    x, y = list(range(0, 9)), list(range(100, 109))  # 2 blocks each: page 0 r0, page 1 r1
    prefill(ranks, x)
    prefill(ranks, y)
    hx, hy = chain_hashes(x, B), chain_hashes(y, B)
    for c in ranks:
        c.take_events()
    chain, pages, _ = source(list(range(200, 209)))
    results = import_all(ranks, chain, pages, protect=frozenset({hx[0], hx[1], hy[0]}))
    assert results == [([], [])] * 2
    assert all(c.take_events() == [] for c in ranks)  # no "removed" event either
    assert all(c.lookup(y + [1]).match.prefix_len == 8 for c in ranks)  # y kept whole
    assert_ranks_agree(ranks)


def test_a_cut_chain_evicts_only_for_the_pages_it_stores() -> None:
    """A 4-page import where rank 0 can free one page only: pages 0-1 are stored, page 2
    (rank 0) is not, so rank 1 must free one page (for page 1), not two. The old code
    freed two on rank 1 (its whole need, pages 1 and 3) and lost branch s for nothing."""
    ranks = worker(2, pages=2)
    p = list(range(0, 9))  # P0 (r0, protected), Q1 (r1)
    s = p[:B] + list(range(50, 55))  # S1: a second child of P0 (r1)
    a = list(range(70, 75))  # A0: a one-block chain (r0)
    for ids in (p, s, a):
        prefill(ranks, ids)
    hp, hs, ha = chain_hashes(p, B), chain_hashes(s, B), chain_hashes(a, B)
    z = list(range(300, 317))  # 4 blocks
    chain, pages, kv = source(z)
    results = import_all(ranks, chain, pages, protect=frozenset({hp[0]}))
    hz = chain_hashes(z, B)
    # LRU: Q1 is the older leaf of rank 1, A0 the only one of rank 0.
    assert results == [(hz[:2], [hp[1], ha[0]])] * 2
    assert all(c.lookup(s + [1]).match.prefix_len == 8 for c in ranks)  # S1 survives
    looks = [c.lookup(z[:8] + [1]) for c in ranks]
    assert looks[0].match.prefix_len == 8
    assert torch.equal(gathered(ranks, looks), stack_kv([(k[:8], v[:8]) for k, v in kv]))
    assert hs[1] in ranks[0].blocks()
    assert_ranks_agree(ranks)


def test_room_reached_through_another_rank_is_still_made() -> None:
    """Rank 0's only evictable page is A0, an inner block: it becomes a leaf once its child
    A1 (rank 1) goes. Rank 1 has a free page, enough for the 2 pages that can be stored
    (page 2, rank 0, cannot), so a plan for those 2 pages alone would skip A1 and store
    nothing; the eviction of A1 is the price of rank 0's room and is kept (as before)."""
    ranks = worker(2, pages=2)
    kept = list(range(0, 5))  # K0 (r0), protected
    a = list(range(100, 109))  # A0 (r0), A1 (r1)
    prefill(ranks, kept)
    prefill(ranks, a)
    hk, ha = chain_hashes(kept, B), chain_hashes(a, B)
    z = list(range(300, 317))  # 4 blocks: pages 0, 2 on rank 0; 1, 3 on rank 1
    chain, pages, kv = source(z)
    results = import_all(ranks, chain, pages, protect=frozenset(hk))
    hz = chain_hashes(z, B)
    assert results == [(hz[:2], [ha[1], ha[0]])] * 2
    assert_ranks_agree(ranks)
    looks = [c.lookup(z[:8] + [1]) for c in ranks]
    assert torch.equal(gathered(ranks, looks), stack_kv([(k[:8], v[:8]) for k, v in kv]))


def test_ranks_agree_when_their_page_needs_differ() -> None:
    """Question (a): a 5-block chain at degree 4 needs 2 pages on rank 0 and 1 on each other
    rank; rank 0 has one free page and its other one is protected, ranks 1-3 are full.
    Every rank computes every rank's need and use on its own copy of the index, so all of
    them store pages 0-3, evict the same blocks (w's tail, exposing its parents in turn;
    never the protected W0 nor the more recent branch u) and then serve the stored prefix
    with the right KV."""
    ranks = worker(4, pages=2)
    w = list(range(0, 17))  # W0..W3 on ranks 0..3
    u = w[:B] + list(range(600, 613))  # U1..U3 under W0, on ranks 1..3
    prefill(ranks, w)
    prefill(ranks, u)
    hw, hu = chain_hashes(w, B), chain_hashes(u, B)
    z = list(range(400, 421))  # 5 blocks: pages 0..4, rank 0 owns pages 0 and 4
    chain, pages, kv = source(z)
    results = import_all(ranks, chain, pages, protect=frozenset({hw[0]}))
    hz = chain_hashes(z, B)
    assert results == [(hz[:4], [hw[3], hw[2], hw[1]])] * 4
    assert_ranks_agree(ranks)
    assert all(c.lookup(u + [1]).match.prefix_len == 16 and hu[0] == hw[0] for c in ranks)
    looks = [c.lookup(z + [1]) for c in ranks]
    assert [lk.match.prefix_len for lk in looks] == [16] * 4  # page 4 was not stored
    assert torch.equal(gathered(ranks, looks), stack_kv([(k[:16], v[:16]) for k, v in kv]))


@settings(max_examples=60, deadline=None)
@given(
    degree=st.sampled_from([2, 3, 4]),
    pages=st.integers(1, 4),
    ops=st.lists(
        st.tuples(
            st.booleans(),  # import (True) or prefill-and-store (False)
            st.integers(0, 3),  # shared head
            st.integers(1, 22),  # tokens after it
            st.integers(0, 2**16),  # which cached blocks the import protects
        ),
        min_size=1,
        max_size=14,
    ),
)
def test_ranks_agree_and_nothing_is_evicted_for_nothing(degree, pages, ops) -> None:
    """Random stores and protected imports: after every call the ranks agree (index, use,
    pools), their (stored, evicted) answers are equal, and a call that stores nothing evicts
    nothing. A call that stores all of its new blocks evicts no more than each rank's
    shortfall (the old code's all-or-nothing plan already did; checked for regressions)."""
    ranks = worker(degree, pages=pages)
    for imp, head, n, mask in ops:
        ids = [head * 1000 + 1] * 5 + [head * 1000 + 2 + i for i in range(n)]
        idx = ranks[0].index
        free = [pages - idx.used(r) for r in range(degree)]
        owner = {h: nd.page % degree for h, nd in idx._nodes.items()}
        before = idx.blocks()
        if imp:
            chain, pg, _ = source(ids, seed=n)
            cached = sorted(before)
            protect = frozenset(h for i, h in enumerate(cached) if mask >> (i % 16) & 1)
            results = import_all(ranks, chain, pg, protect)
            wanted = [h for h, _ in chain if h not in before]
        else:
            looks = [c.lookup(ids) for c in ranks]
            p = looks[0].match.prefix_len
            new = [(k[p:], v[p:]) for k, v in fake_kv(len(ids), seed=n)]
            results = [
                (c.store(lk, new), c.last_evicted) for c, lk in zip(ranks, looks, strict=True)
            ]
            wanted = [h for h in looks[0].chain if h not in before]
        assert all(res == results[0] for res in results)
        assert_ranks_agree(ranks)
        stored, evicted = results[0]
        if not stored:
            assert evicted == []
        if stored and stored == wanted:
            need = [0] * degree
            for h in stored:
                need[idx._nodes[h].page % degree] += 1
            for r in range(degree):
                lost = sum(1 for h in evicted if owner[h] == r)
                assert lost <= max(0, need[r] - free[r]), (r, lost, need, free)


def test_a_bad_page_is_refused_by_every_rank() -> None:
    """Every member gets the whole chain; page 1 (rank 1's) has the wrong shape. Rank 0 must
    refuse too: before, it installed the chain while rank 1 refused, and the worker's two
    index copies differed -- the next prefill reusing it would enter the CP collectives with
    different prefix lengths (gloo aborts on the size mismatch, or a rank hangs); rankd's
    leader saw the mixed answers and marked the whole world broken."""
    ranks = worker(2)
    chain, pages, _ = source(list(range(200, 209)))
    bad = [dataclasses.replace(pg, kv=pg.kv[:, :, :1]) if pg.page == 1 else pg for pg in pages]
    for c in ranks:
        with pytest.raises(KVFormatError, match="page 1 has shape"):
            c.import_prefix(chain, bad)
    assert all(len(c.index) == 0 and c.take_events() == [] for c in ranks)
    # Giving each rank only its own pages stays legal.
    results = [c.import_prefix(chain, [pg for pg in pages if pg.page % 2 == c.rank]) for c in ranks]
    assert results[0] == results[1] == [h for h, _ in chain]
    assert_ranks_agree(ranks)
