"""The paged prefix KV cache, with the C ranks of a worker emulated in one process (every
cache method is an SPMD call, so C objects fed the same calls are exactly a worker)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from services.rankd.engine.config import Qwen3Config
from services.rankd.engine.cp_prefill import page_positions, stack_kv
from services.rankd.engine.decode import BlobReassembler, encode_chunks
from services.rankd.engine.errors import KVFormatError
from services.rankd.engine.kvcache import RankKVCache, pages_from_bytes, pages_to_bytes
from services.rankd.engine.model import Qwen3ForCausalLM
from shared.blockhash import chain_hashes
from shared.ids import InvalidInput, WorkerId

CFG = Qwen3Config(max_position_embeddings=128)
B = 4


def worker(degree: int, pages: int = 16, name: str = "w") -> list[RankKVCache]:
    return [
        RankKVCache(
            WorkerId(name),
            degree,
            r,
            B,
            pages,
            CFG.num_hidden_layers,
            CFG.num_key_value_heads,
            CFG.head_dim,
            torch.float64,
        )
        for r in range(degree)
    ]


def fake_kv(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, CFG.num_key_value_heads, CFG.head_dim)
    return [
        (
            torch.randn(shape, generator=g, dtype=torch.float64),
            torch.randn(shape, generator=g, dtype=torch.float64),
        )
        for _ in range(CFG.num_hidden_layers)
    ]


def prefill(ranks: list[RankKVCache], ids: list[int], kv_full=None):
    """Lookup + store on every rank as the engine does; returns (lookups, full kv used)."""
    looks = [c.lookup(ids) for c in ranks]
    p = looks[0].match.prefix_len
    kv_full = kv_full or fake_kv(len(ids), seed=len(ids))
    new = [(k[p:], v[p:]) for k, v in kv_full]
    for c, lk in zip(ranks, looks, strict=True):
        c.store(lk, new)
    return looks, kv_full


def gathered(ranks: list[RankKVCache], looks) -> torch.Tensor:
    p = looks[0].match.prefix_len
    full = torch.zeros(
        CFG.num_hidden_layers, 2, p, CFG.num_key_value_heads, CFG.head_dim, dtype=torch.float64
    )
    for r, lk in enumerate(looks):
        full[:, :, page_positions(p, B, len(ranks), r)] = lk.local_kv
    return full


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_store_then_lookup_returns_the_stored_pages(degree: int) -> None:
    ranks = worker(degree)
    ids = list(range(10, 33))  # 23 tokens: 5 full blocks
    _, kv = prefill(ranks, ids)
    looks = [c.lookup(ids + [7, 8]) for c in ranks]
    assert looks[0].match.prefix_len == 20
    assert torch.equal(gathered(ranks, looks), stack_kv([(k[:20], v[:20]) for k, v in kv]))
    assert all(len(c.pool) == len(range(r, 5, degree)) for r, c in enumerate(ranks))
    # R >= 1: a request equal to a cached prefix still recomputes its last token; its last
    # page is reused partially (P = n - 1, rankd BlockCache's rule min(hit·B, n − 1)).
    looks = [c.lookup(ids[:20]) for c in ranks]
    assert looks[0].match.prefix_len == 19 and len(looks[0].match.block_hashes) == 5
    assert torch.equal(gathered(ranks, looks), stack_kv([(k[:19], v[:19]) for k, v in kv]))
    # A cap (rankd's decided P) limits the reuse, also mid-page.
    assert [c.lookup(ids + [7], max_prefix=9).match.prefix_len for c in ranks] == [9] * degree
    assert ranks[0].lookup(ids + [7], max_prefix=0).match.prefix_len == 0


def test_explicit_chain_keys_the_cache() -> None:
    """rankd's hash chain names the blocks: stored under it, found by it, never by the ids'
    own hashes; a chain longer than the full blocks is refused."""
    ranks = worker(2)
    ids = list(range(10, 30))  # 20 tokens: 5 full blocks
    chain = [101, 102, 103]  # only the first 3 blocks are named: only they are cached
    looks = [c.lookup(ids, chain=chain) for c in ranks]
    kv = fake_kv(len(ids))
    for c, lk in zip(ranks, looks, strict=True):
        c.store(lk, kv)
    assert ranks[0].blocks() == ranks[1].blocks() == frozenset(chain)
    assert ranks[0].lookup(ids + [1]).match.prefix_len == 0  # own hashes: a miss
    again = [c.lookup(ids + [1], chain=chain) for c in ranks]
    assert again[0].match.prefix_len == 12
    assert torch.equal(gathered(ranks, again), stack_kv([(k[:12], v[:12]) for k, v in kv]))
    with pytest.raises(InvalidInput, match="6 block hashes for 20 tokens"):
        ranks[0].lookup(ids, chain=[1, 2, 3, 4, 5, 6])
    with pytest.raises(InvalidInput, match="max_prefix"):
        ranks[0].lookup(ids, max_prefix=-1)


def test_events_and_indexes_agree_across_ranks() -> None:
    ranks = worker(2)
    ids = list(range(12))
    prefill(ranks, ids)
    prefill(ranks, ids + list(range(50, 58)))
    evs = [c.take_events() for c in ranks]
    assert evs[0] == evs[1]
    h = chain_hashes(ids + list(range(50, 58)), B)
    assert evs[0] == [
        {
            "type": "stored",
            "worker": "w",
            "event_id": 1,
            "parent_hash": None,
            "block_hashes": h[:3],
        },
        {
            "type": "stored",
            "worker": "w",
            "event_id": 2,
            "parent_hash": h[2],
            "block_hashes": h[3:5],
        },
    ]
    assert ranks[0].take_events() == []
    ranks[0].clear()
    assert ranks[0].take_events() == [{"type": "cleared", "worker": "w", "event_id": 3}]
    assert ranks[1].index.snapshot()["blocks"] == [
        [x, p] for x, p in zip(h, [None] + h[:4], strict=True)
    ]


def test_lru_evicts_leaves_of_the_least_recent_prefix() -> None:
    ranks = worker(1, pages=6)
    a, b, c = list(range(0, 9)), list(range(100, 109)), list(range(200, 209))
    prefill(ranks, a)  # 2 blocks each
    prefill(ranks, b)
    prefill(ranks, c)
    ranks[0].take_events()
    ranks[0].lookup(a + [1])  # a becomes most recent
    d = list(range(300, 313))  # 3 blocks: needs 3 pages, only 0 free
    prefill(ranks, d)
    ev = ranks[0].take_events()
    hb, hc = chain_hashes(b, B), chain_hashes(c, B)
    assert ev[0]["type"] == "removed"
    # b (LRU) goes leaf first, then its root; then c's leaf; a survives intact
    assert ev[0]["block_hashes"] == [hb[1], hb[0], hc[1]]
    assert ranks[0].lookup(a + [1]).match.prefix_len == 8
    assert ranks[0].lookup(c + [1]).match.prefix_len == 4
    assert ranks[0].lookup(b + [1]).match.prefix_len == 0


def test_per_rank_capacity_is_respected() -> None:
    # one-block prefixes all land on rank 0 (page 0): rank 0 fills while rank 1 stays empty
    ranks = worker(2, pages=2)
    for s in range(3):
        prefill(ranks, [s * 10 + i for i in range(5)])
    assert ranks[0].index.used(0) == 2 and ranks[0].index.used(1) == 0
    assert len(ranks[0].pool) == 2 and len(ranks[1].pool) == 0
    assert ranks[0].lookup([i for i in range(5)]).match.prefix_len == 0  # first one evicted


def test_reshard_2_to_4_and_to_1() -> None:
    src = worker(2, name="w-cp2")
    ids = list(range(40, 63))
    _, kv = prefill(src, ids)
    hashes = chain_hashes(ids, B)
    chain = src[0].chain_of(hashes)
    pages = [pg for c in src for pg in c.export_pages(hashes)]
    assert sorted(pg.page for pg in pages) == list(range(5))
    # through the serialised path a message transport would carry (chunks <= 4 KiB here)
    asm = BlobReassembler()
    done = [
        d
        for c in encode_chunks("rep-1", pages_to_bytes(chain, pages), 4096)
        if (d := asm.add(c)) is not None
    ]
    chain, pages = pages_from_bytes(done[0][1])
    for deg in (4, 1):
        dst = worker(deg, name=f"w-cp{deg}")
        for c in dst:
            c.import_prefix(chain, pages)
        evs = [c.take_events() for c in dst]
        assert evs[0] == evs[-1] and evs[0][0]["block_hashes"] == hashes
        looks = [c.lookup(ids + [1]) for c in dst]
        assert looks[0].match.prefix_len == 20
        assert torch.equal(gathered(dst, looks), stack_kv([(k[:20], v[:20]) for k, v in kv]))


def test_reshard_with_each_member_given_only_its_own_pages() -> None:
    """A destination member given only the pages it keeps (page i -> CP rank i mod C') plus
    the whole chain installs what it installs from the whole payload: the same index and
    events on every member, the same gathered KV. A declared payload shape other than the
    cache's is refused by every member alike -- also one given no page -- changing nothing."""
    src = worker(2, name="w-cp2")
    ids = list(range(40, 63))  # 5 full blocks
    _, kv = prefill(src, ids)
    hashes = chain_hashes(ids, B)
    chain = src[0].chain_of(hashes)
    pages = sorted((pg for c in src for pg in c.export_pages(hashes)), key=lambda pg: pg.page)
    shape = tuple(pages[0].kv.shape)
    for deg in (4, 8):
        dst = worker(deg, name=f"w-cp{deg}")
        bad = tuple(n + (i == 2) for i, n in enumerate(shape))
        for c in dst:
            with pytest.raises(KVFormatError, match="shape"):
                c.import_prefix(chain, pages[c.rank :: deg], payload_shape=bad)
            assert len(c.index) == 0 and c.take_events() == [] and len(c.pool) == 0
        for c in dst:
            assert c.import_prefix(chain, pages[c.rank :: deg], payload_shape=shape) == hashes
        evs = [c.take_events() for c in dst]
        assert all(e == evs[0] for e in evs) and evs[0][0]["block_hashes"] == hashes
        assert [len(c.pool) for c in dst] == [len(range(r, 5, deg)) for r in range(deg)]
        looks = [c.lookup(ids + [1]) for c in dst]
        assert looks[0].match.prefix_len == 20
        assert torch.equal(gathered(dst, looks), stack_kv([(k[:20], v[:20]) for k, v in kv]))


def test_import_validates_before_changing_anything() -> None:
    src = worker(1)
    ids = list(range(9))
    prefill(src, ids)
    hashes = chain_hashes(ids, B)
    chain, pages = src[0].chain_of(hashes), src[0].export_pages(hashes)
    dst = worker(2)
    with pytest.raises(KVFormatError, match="missing"):
        dst[1].import_prefix(chain, pages[:1])
    with pytest.raises(KVFormatError, match="chain broken"):
        dst[0].import_prefix(chain[::-1], pages)
    assert len(dst[0].index) == 0 and dst[0].take_events() == []


def test_import_never_evicts_protected_blocks_and_stores_what_fits() -> None:
    src = worker(1, name="src")
    doc = list(range(100, 113))  # 3 blocks
    prefill(src, doc)
    hashes = chain_hashes(doc, B)
    chain, pages = src[0].chain_of(hashes), src[0].export_pages(hashes)
    ids = list(range(9))  # 2 blocks: 2 of the destination's 3 pages
    held = chain_hashes(ids, B)

    dst = worker(1, pages=3)
    prefill(dst, ids)
    kept = {h: dst[0].pool.get(h).clone() for h in held}
    # Protected (rankd still holds them): only the free page is used, nothing is evicted.
    assert dst[0].import_prefix(chain, pages, protect=frozenset(held)) == hashes[:1]
    assert dst[0].last_evicted == []
    assert all(torch.equal(dst[0].pool.get(h), kv) for h, kv in kept.items())
    assert dst[0].lookup(ids + [1]).match.prefix_len == 8

    plain = worker(1, pages=3)
    prefill(plain, ids)
    # Unprotected, the same import takes their pages (LRU leaves, tail first).
    assert plain[0].import_prefix(chain, pages) == hashes
    assert plain[0].last_evicted == held[::-1]


def test_reclaim_removes_descendants() -> None:
    ranks = worker(1)
    ids = list(range(16))
    prefill(ranks, ids)
    h = chain_hashes(ids, B)
    ranks[0].take_events()
    assert ranks[0].remove([h[1]]) == [h[3], h[2], h[1]]
    assert ranks[0].lookup(ids).match.prefix_len == 4
    assert ranks[0].take_events()[0]["block_hashes"] == [h[3], h[2], h[1]]


def test_cache_holds_real_model_kv_for_multi_turn() -> None:
    m = Qwen3ForCausalLM.random(CFG, seed=4, dtype=torch.float64)
    ranks = worker(2)
    turn1 = list(range(1, 15))
    out1 = m.reference_forward(torch.tensor(turn1))
    prefill(ranks, turn1, out1.new_kv)
    turn2 = turn1 + [out1.next_token, 9, 8, 7]
    looks = [c.lookup(turn2) for c in ranks]
    p = looks[0].match.prefix_len
    pre = gathered(ranks, looks)
    out2 = m.reference_forward(torch.tensor(turn2[p:]), [(pre[i, 0], pre[i, 1]) for i in range(2)])
    full = m.reference_forward(torch.tensor(turn2))
    assert p == 12 and out2.next_token == full.next_token
    assert float((out2.hidden - full.hidden[p:]).abs().max()) < 1e-12


@settings(max_examples=40, deadline=None)
@given(
    ops=st.lists(st.tuples(st.integers(0, 5), st.integers(1, 20)), min_size=1, max_size=25),
    degree=st.sampled_from([1, 2, 4]),
)
def test_index_invariants_under_random_traffic(ops, degree) -> None:
    ranks = worker(degree, pages=3)
    for base, n in ops:
        ids = [base] * 3 + list(range(n))  # shared heads make trees
        prefill(ranks, ids)
        idx = ranks[0].index
        nodes = idx._nodes
        for h, node in nodes.items():
            assert node.parent is None or node.parent in nodes
            assert node.children == sum(1 for x in nodes.values() if x.parent == h)
        for r, c in enumerate(ranks):
            owned = {h for h, x in nodes.items() if x.page % degree == r}
            assert idx.used(r) == len(owned) <= 3
            assert set(c.pool._slot) == owned
            assert c.index.snapshot() == idx.snapshot()


def test_malformed_page_payload() -> None:
    with pytest.raises(KVFormatError):
        pages_from_bytes(b"\x08" + b"\x00" * 7 + b"{}")


def test_reassembly_is_per_transfer_and_bounded() -> None:
    """Chunks are assembled per (key, tag): a stray chunk naming the same key under another
    tag (another reply inbox) does not mix in, a contradicting count drops only its own set,
    and open sets are bounded by age and number (a sender that died mid-transfer, or bad
    input claiming any count, cannot grow the decode role without end)."""
    now = [0.0]
    asm = BlobReassembler(max_pending=2, stale_s=10.0, clock=lambda: now[0])
    real = encode_chunks("r-1", b"a" * 100, 64)
    assert len(real) > 2
    stray = encode_chunks("r-1", b"x" * 500, 64)  # same key, another chunk count
    assert asm.add(real[0], "inbox-1") is None
    assert asm.add(stray[0], "other") is None  # its own set, not a contradiction of ours
    with pytest.raises(KVFormatError, match="inconsistent"):
        asm.add(stray[0], "inbox-1")  # contradicts inbox-1's count: that set is dropped
    assert asm.pending == 1 and asm.dropped == 1
    done = [d for c in real if (d := asm.add(c, "inbox-2")) is not None]
    assert done == [("r-1", b"a" * 100)]  # a new attempt assembles cleanly
    # Bounded by number: a third open set pushes out the least recently fed.
    asm.add(encode_chunks("r-2", b"b" * 100, 64)[0], "t")
    asm.add(encode_chunks("r-3", b"c" * 100, 64)[0], "t")
    assert asm.pending == 2 and asm.dropped == 2
    # Bounded by age: nothing fed for stale_s, and the next chunk drops them.
    now[0] = 11.0
    assert asm.add(encode_chunks("r-4", b"d" * 100, 64)[0], "t") is None
    assert asm.pending == 1 and asm.dropped == 4
    with pytest.raises(InvalidInput):
        BlobReassembler(max_pending=0)


def _assert_index_sound(ranks: list[RankKVCache]) -> None:
    idx = ranks[0].index
    nodes = idx._nodes
    for h, node in nodes.items():
        assert node.parent != h and (node.parent is None or node.parent in nodes)
        assert node.page == (0 if node.parent is None else nodes[node.parent].page + 1)
        assert node.children == sum(1 for x in nodes.values() if x.parent == h)
    for r, c in enumerate(ranks):
        owned = {h for h, x in nodes.items() if x.page % len(ranks) == r}
        assert idx.used(r) == len(owned)
        assert set(c.pool._slot) == owned


@pytest.mark.parametrize(
    "bad", [[5, 5], [8, 9], [9, 10], [7, 10, 9]],
    ids=["repeated", "reparented", "cached-head-elsewhere", "reparented-after-hit"],
)
def test_a_chain_contradicting_the_cache_stores_only_its_sound_head(bad: list[int]) -> None:
    """rankd passes the request's hashes as the chain (bad input or a collision may repeat a
    block or put a cached block under another parent): the index is never corrupted (no
    self-parent, no leaked page or child count), and dropping what it stored frees it all."""
    ranks = worker(2, pages=8)
    ids = list(range(10, 10 + 2 * B))
    looks = [c.lookup(ids, chain=[7, 9]) for c in ranks]
    for c, lk in zip(ranks, looks, strict=True):
        c.store(lk, fake_kv(len(ids)))
    ids = list(range(40, 40 + len(bad) * B))
    looks = [c.lookup(ids, chain=bad) for c in ranks]
    for c, lk in zip(ranks, looks, strict=True):
        c.store(lk, fake_kv(len(ids), seed=1))
    _assert_index_sound(ranks)
    assert ranks[0].index.parent_of(9) == 7  # the cached chain is untouched
    for c in ranks:  # rankd drops what it did not cache (its BlockCache refused the chain)
        c.remove([h for h in c.blocks() if h not in (7, 9)])
    _assert_index_sound(ranks)
    assert ranks[0].blocks() == frozenset({7, 9})
    assert [ranks[0].index.used(r) for r in (0, 1)] == [1, 1]
