"""Each baseline's rule on a small hand-checked example (peer-routing.md, §9.1)."""

from __future__ import annotations

import random

import pytest
from sched_support import ROUND, loads_for, req, view

from services.scheduler import RequestInfo, SchedulerCore, WorkerView, make_policy
from services.scheduler.policies.dynamo import dynamo_cost
from services.scheduler.policies.sglang import ApproxTrees
from shared.ids import BlockHash, InvalidInput, RequestId, WorkerId
from shared.worker import Lifecycle

W = WorkerId
Rq = RequestId


# --- homo ------------------------------------------------------------------------------------
def test_homo_is_q_plus_beta_s_within_one_degree() -> None:
    v = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4))
    loads = loads_for(v)
    loads[W("a")].reserve(Rq("x"), 0.3)
    pol = make_policy("homo", profile=ROUND)
    assert pol.pool_degree == 4 and make_policy("homo_cp2").pool_degree == 2  # type: ignore[attr-defined]
    d = pol.place(req("r", 1000), v, {W("a"): 6}, loads, 0.0)
    # a: 0.3 + 1.5·0.84005 = 1.560075 ; b: 1.5·Ê_4(1000, 0) = 1.5·(1.1 + 2.5005/4) = 2.5875...
    assert d.candidate(W("a")).score == pytest.approx(0.3 + 1.5 * 0.84005)
    assert d.candidate(W("b")).score == pytest.approx(1.5 * ROUND.predict(1000, 0, 4))
    assert d.candidate(W("a")).extra_gpu == 0.0
    assert d.worker == "a" and d.policy == "homo"


# --- static ----------------------------------------------------------------------------------
def test_static_threshold_picks_class_then_min_q_plus_s() -> None:
    v = view(
        WorkerView(W("s1"), 2),
        WorkerView(W("s2"), 2),
        WorkerView(W("l1"), 4),
        WorkerView(W("l2"), 4),
    )
    loads = loads_for(v)
    loads[W("s1")].reserve(Rq("x"), 1.0)
    pol = make_policy("static", profile=ROUND, threshold_tokens=800)
    d_short = pol.place(req("a", 800), v, {W("s1"): 7}, loads, 0.0)
    # short class {s1, s2}: s1: 1.0 + Ê_2(100, 700) ; s2: Ê_2(800, 0)
    s1 = 1.0 + ROUND.predict(100, 700, 2)
    s2 = ROUND.predict(800, 0, 2)
    assert d_short.candidate(W("s1")).score == pytest.approx(s1)
    assert d_short.candidate(W("s2")).score == pytest.approx(s2)
    assert d_short.candidate(W("l1")).score is None  # other class not scored
    assert d_short.worker == ("s1" if s1 < s2 else "s2")
    d_long = pol.place(req("b", 801), v, {W("l2"): 8}, loads, 0.0)
    assert d_long.degree == 4 and d_long.worker == "l2"  # cache hit within the class wins
    # long request when every CP4 worker is draining: the largest *eligible* class is CP2
    v2 = view(WorkerView(W("s1"), 2), WorkerView(W("l1"), 4, lifecycle=Lifecycle.DRAINING))
    assert pol.place(req("c", 5000), v2, {}, loads_for(v2), 0.0).worker == "s1"


def test_static_sees_the_prefix_of_a_request_in_flight_on_the_worker() -> None:
    """As J does (SchedulerCore's in-flight prefixes): a second request on the same document,
    placed while the first still runs, is priced with that document as its reusable prefix
    on the first's worker, and with nothing elsewhere."""
    v = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4))
    core = SchedulerCore(make_policy("static", profile=ROUND, threshold_tokens=800), v)
    first = core.place(req("doc", 2000), {}, 0.0)
    core.start(Rq("doc"), 0.0)
    other = "b" if first.worker == "a" else "a"
    d = core.place(req("q", 2050, nblocks=21), {}, 0.1)
    assert d.candidate(W(first.worker)).prefix_tokens == 2000
    assert d.candidate(W(other)).prefix_tokens == 0
    # Once the first finished (and its blocks were never reported cached), it is gone.
    core.finish(Rq("doc"), 1.0)
    core.finish(Rq("q"), 1.0)
    d = core.place(req("q2", 2050, nblocks=21), {}, 2.0)
    assert d.candidate(W(first.worker)).prefix_tokens == 0


# --- vLLM ------------------------------------------------------------------------------------
def test_vllm_score_and_stale_counts_until_refresh() -> None:
    v = view(WorkerView(W("e0"), 4), WorkerView(W("e1"), 4))
    loads = loads_for(v)
    pol = make_policy("vllm", profile=ROUND)
    d1 = pol.place(
        req("r1", 500), v, {}, loads, 0.0
    )  # snapshot (0,0),(0,0) -> e0, local e0.waiting=1
    assert d1.worker == "e0"
    assert pol.counts(W("e0")) == (1, 0)  # type: ignore[attr-defined]
    # The real e1 gets very busy, e0 goes idle; the balancer does not see it before 100 ms.
    for k in range(5):
        loads[W("e1")].reserve(Rq(f"x{k}"), 1.0)
    loads[W("e1")].start(Rq("x0"), 0.0)
    d2 = pol.place(req("r2", 500), v, {}, loads, 0.05)  # stale: e0 score 4, e1 score 0
    assert d2.worker == "e1"
    assert d2.candidate(W("e0")).score == 4.0 and d2.candidate(W("e1")).score == 0.0
    d3 = pol.place(req("r3", 500), v, {}, loads, 0.099)  # e0: 4, e1: 4 -> first (e0)
    assert d3.worker == "e0"
    d4 = pol.place(
        req("r4", 500), v, {}, loads, 0.1
    )  # refreshed: e0 (0,0) ; e1 waiting 4, running 1
    assert d4.candidate(W("e1")).score == 4 * 4 + 1
    assert d4.worker == "e0"
    # the prefix a TP engine reuses is its own cache: P from held_blocks of the chosen worker
    d5 = pol.place(req("r5", 500), v, {W("e0"): 3, W("e1"): 4}, loads, 0.15)
    assert d5.worker == "e0" and d5.prefix_tokens == 300


# --- SGLang ----------------------------------------------------------------------------------
def test_sglang_imbalance_branch_routes_to_least_loaded() -> None:
    v = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4), WorkerView(W("c"), 4))
    loads = loads_for(v)
    pol = make_policy("sglang", profile=ROUND)
    pol.trees.insert(W("a"), [BlockHash(k) for k in range(10)], 0.0)  # type: ignore[attr-defined]
    for k in range(40):
        loads[W("a")].reserve(Rq(f"a{k}"), 0.1)
    for k in range(7):
        loads[W("b")].reserve(Rq(f"b{k}"), 0.1)
    for k in range(5):
        loads[W("c")].reserve(Rq(f"c{k}"), 0.1)
    # 40 − 5 = 35 > 32 and 40 > 1.1·5: imbalanced -> least loaded (c), despite a's 100% match
    d = pol.place(req("r", 1000, first=500), v, {}, loads, 1.0)
    assert d.worker == "c" and "imbalanced" in d.note
    assert pol.trees.holds(W("c"), BlockHash(509))  # type: ignore[attr-defined]  inserted at routing
    # 36 − 5 = 31 ≤ 32: balanced -> cache branch -> a (match 1.0)
    for k in range(4):
        loads[W("a")].finish(Rq(f"a{k}"))
    d2 = pol.place(req("r2", 1000), v, {}, loads, 1.0)
    assert d2.worker == "a" and "best match" in d2.note


def test_sglang_cache_branch_threshold_and_smallest_tree() -> None:
    v = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4))
    loads = loads_for(v)
    pol = make_policy("sglang", profile=ROUND)
    d1 = pol.place(req("r1", 1000, first=0), v, {}, loads, 0.0)  # empty trees -> smallest (a)
    assert d1.worker == "a" and "smallest tree" in d1.note
    d2 = pol.place(req("r2", 1000, first=100), v, {}, loads, 0.0)  # miss; a has 10 blocks -> b
    assert d2.worker == "b"
    # 6 shared blocks of 10: match rate 0.6 > 0.5 -> best match (a)
    shared = RequestInfo(
        Rq("r3"), 1000, tuple(BlockHash(k) for k in range(6)) + (BlockHash(900),) * 4
    )
    d3 = pol.place(shared, v, {}, loads, 0.0)
    assert d3.worker == "a" and d3.candidate(W("a")).score == pytest.approx(0.6)
    # 5 of 10 = 0.5 is not > 0.5 -> smallest tree: a has 11 blocks now, b 10 -> b
    half = RequestInfo(
        Rq("r4"),
        1000,
        tuple(BlockHash(k) for k in range(5)) + tuple(BlockHash(950 + k) for k in range(5)),
    )
    d4 = pol.place(half, v, {}, loads, 0.0)
    assert d4.worker == "b" and "smallest tree" in d4.note


def test_sglang_eviction_keeps_prefix_closed_and_unbounded_variant() -> None:
    t = ApproxTrees()
    t.insert(W("a"), [BlockHash(k) for k in range(6)], 1.0)  # path 0..5
    t.insert(W("a"), [BlockHash(0), BlockHash(10), BlockHash(11)], 2.0)  # branch 0,10,11
    assert t.size(W("a")) == 8
    assert t.evict(W("a"), 4) == 4
    # LRU leaves first: 5,4,3,2 (time 1.0) go; 0 (time 2.0), 1, 10, 11 remain -> still prefix-closed
    assert {k for k in (0, 1, 2, 3, 4, 5, 10, 11) if t.holds(W("a"), BlockHash(k))} == {
        0,
        1,
        10,
        11,
    }
    assert t.match([BlockHash(0), BlockHash(1), BlockHash(2)], [W("a")]) == {W("a"): 2}

    v = view(WorkerView(W("a"), 4))
    for unbounded, expect in ((False, 5), (True, 20)):
        pol = make_policy("sglang", profile=ROUND, max_tree_blocks=5, unbounded=unbounded)
        pol.place(req("r1", 2000), v, {}, loads_for(v), 0.0)  # 20 blocks
        pol.place(req("r2", 100, first=500), v, {}, loads_for(v), 29.0)  # before 30 s: no eviction
        assert pol.trees.size(W("a")) == 21  # type: ignore[attr-defined]
        pol.place(req("r3", 100, first=600), v, {}, loads_for(v), 30.0)  # evict, then insert 1
        assert pol.trees.size(W("a")) == expect + (1 if not unbounded else 2)  # type: ignore[attr-defined]
    # SGLang's default bound is tokens (10,000 nodes of 16): in blocks of the view's size.
    pol = make_policy("sglang")
    assert pol.tree_budget_blocks(512) == 312  # type: ignore[attr-defined]
    assert pol.tree_budget_blocks(16) == 10_000  # type: ignore[attr-defined]
    assert pol.tree_budget_blocks(1 << 20) == 1  # type: ignore[attr-defined]
    assert make_policy("sglang", max_tree_blocks=7).tree_budget_blocks(16) == 7  # type: ignore[attr-defined]
    # A view of 64-token blocks keeps 160K tokens of a document, not 312 blocks of it.
    v64 = view(WorkerView(W("a"), 4), block_size=64)
    pol.place(req("d", 40_000, nblocks=625), v64, {}, loads_for(v64), 0.0)
    pol.place(req("e", 64, nblocks=1, first=10_000), v64, {}, loads_for(v64), 30.0)  # evicts
    assert pol.trees.size(W("a")) == 626  # type: ignore[attr-defined]  # was 313


# --- Dynamo ----------------------------------------------------------------------------------
def test_dynamo_cost_arithmetic_and_choice() -> None:
    # worker A: 500 uncached tokens in flight, 7 active blocks, holds 6 of the request's blocks
    a = dynamo_cost(
        active_prefill_tokens=500, active_blocks=7, length=1000, overlap_blocks=6, block_size=100
    )
    # raw = 5 + 10 = 15; adjusted = 15 − 6 = 9; decode = 7 + 10 = 17 -> 26
    assert a == pytest.approx(26.0)
    b = dynamo_cost(
        active_prefill_tokens=0, active_blocks=0, length=1000, overlap_blocks=0, block_size=100
    )
    assert b == pytest.approx(20.0)
    assert dynamo_cost(
        active_prefill_tokens=0, active_blocks=0, length=1000, overlap_blocks=30, block_size=100
    ) == pytest.approx(10.0)  # adjusted clamps at 0
    v = view(WorkerView(W("A"), 4), WorkerView(W("B"), 4))
    loads = loads_for(v)
    loads[W("A")].reserve(Rq("x"), 0.5, tokens=700, uncached_tokens=500, blocks=7)
    d = make_policy("dynamo", profile=ROUND).place(req("r", 1000), v, {W("A"): 6}, loads, 0.0)
    assert d.candidate(W("A")).score == pytest.approx(26.0)
    assert d.candidate(W("B")).score == pytest.approx(20.0)
    assert d.worker == "B"
    # overlap_credit 2: A = (15 − 12) + 17 = 20 = B -> tie drawn by the seeded rng
    picks = {
        make_policy("dynamo", profile=ROUND, rng=random.Random(s), overlap_credit=2.0)
        .place(req("r", 1000), v, {W("A"): 6}, loads, 0.0)
        .worker
        for s in range(20)
    }
    assert picks == {"A", "B"}


def test_dynamo_counts_a_workers_distinct_active_blocks_and_only_the_new_ones() -> None:
    """Dynamo's ActiveSequences: the decode term is the worker's distinct active blocks plus
    the request's blocks not among them, so the worker already prefilling the request's
    document is charged less (B = 100; requests through SchedulerCore, which passes its
    in-flight index)."""
    v = view(WorkerView(W("A"), 4), WorkerView(W("B"), 4))
    core = SchedulerCore(make_policy("dynamo", profile=ROUND, rng=random.Random(0)), v)
    # A runs "doc" (20 full blocks 0..19); B runs "x" (20 other blocks): equal loads.
    core.adopt(req("doc", 2000), W("A"), 0.5, 0.0, uncached_tokens=2000, running=True)
    core.adopt(req("x", 2000, first=500), W("B"), 0.5, 0.0, uncached_tokens=2000,
               running=True)
    # The question: the document's 20 blocks and 50 more tokens (a partial block).
    d = core.place(req("q", 2050, nblocks=20), {}, 0.1)
    prefill = 2000 / 100 + 2050 / 100  # nothing cached yet: no overlap credit
    assert d.candidate(W("A")).score == pytest.approx(prefill + 20 + 21 - 20)
    assert d.candidate(W("B")).score == pytest.approx(prefill + 20 + 21)
    assert d.worker == "A"
    # A second question on A: A's distinct blocks are the document's 20 and q's partial one.
    d2 = core.place(req("q2", 2050, nblocks=20), {}, 0.2)
    assert d2.candidate(W("A")).score == pytest.approx((2000 + 2050 + 2050) / 100 + 21 + 1)
    # Called directly (no in-flight index), the decode term is Σ ⌈L_j/B⌉ + ⌈L/B⌉.
    d3 = core.policy.place(req("q3", 2050, nblocks=20), v, {}, core.loads, 0.3)
    for w in ("A", "B"):
        ld = core.load(W(w))
        assert d3.candidate(W(w)).score == pytest.approx(
            (ld.inflight_uncached_tokens + 2050) / 100 + ld.inflight_blocks + 21)
    with pytest.raises(InvalidInput, match="together"):
        core.policy.place(req("q4", 100), v, {}, core.loads, 0.3,  # type: ignore[call-arg]
                          inflight_blocks={})


def test_dynamo_softmax_sampling_is_seeded() -> None:
    v = view(WorkerView(W("A"), 4), WorkerView(W("B"), 4))
    loads = loads_for(v)
    loads[W("A")].reserve(Rq("x"), 0.5, tokens=700, uncached_tokens=500, blocks=7)

    def run(seed: int) -> list[str]:
        pol = make_policy("dynamo", profile=ROUND, rng=random.Random(seed), temperature=1.0)
        return [pol.place(req(f"r{k}", 1000), v, {}, loads, 0.0).worker for k in range(50)]

    assert run(3) == run(3)
    assert run(3) != run(4)  # the seed, not a fixed order, decides the draws
    seq = run(3)
    # costs A = 15 + 17 = 32, B = 20: normalised by range 12 -> p(B) = 1 / (1 + e^-1) ≈ 0.73
    assert 0.5 < seq.count("B") / 50 < 0.95


# --- llm-d -----------------------------------------------------------------------------------
def test_llmd_affinity_filter_threshold_and_token_load() -> None:
    v = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4), WorkerView(W("c"), 4))
    loads = loads_for(v)
    loads[W("a")].reserve(Rq("x"), 0.5, uncached_tokens=5000)
    loads[W("b")].reserve(Rq("y"), 0.5, uncached_tokens=3000)
    pol = make_policy("llmd", profile=ROUND, explore_probability=0.0)
    # a holds 8/10 = 0.80 (sticky), b 7/10 = 0.70 (not), c nothing and idle
    d = pol.place(req("r", 1000), v, {W("a"): 8, W("b"): 7}, loads, 0.0)
    assert d.worker == "a" and "1 sticky" in d.note
    assert d.candidate(W("b")).score is None  # filtered out
    # token load: 1 − (5000 + 200) / 4,194,304
    assert d.candidate(W("a")).score == pytest.approx(1 - 5200 / 4_194_304)
    # without the sticky endpoint, the scorer picks the least token load incl. this request's R
    d2 = pol.place(req("r2", 1000), v, {W("a"): 7, W("b"): 7}, loads, 0.0)
    assert d2.worker == "c" and d2.candidate(W("c")).score == pytest.approx(1 - 1000 / 4_194_304)


def test_llmd_ttft_gate_breaks_stickiness_and_explore() -> None:
    v = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4))
    loads = loads_for(v)
    loads[W("a")].reserve(Rq("x"), 6.0, uncached_tokens=5000)  # q_a = 6 s
    pol = make_policy("llmd", profile=ROUND, explore_probability=0.0)
    # TTFT a = 6 + Ê_4(100, 900) = 6.3637625 ; b = Ê_4(1000, 0) = 1.725125 -> gap 4.64 s < 5 s
    assert ROUND.predict(100, 900, 4) == pytest.approx(0.3637625)
    assert ROUND.predict(1000, 0, 4) == pytest.approx(1.725125)
    d = pol.place(req("r", 1000), v, {W("a"): 9}, loads, 0.0)
    assert d.worker == "a"
    loads[W("a")].reserve(Rq("y"), 1.0, uncached_tokens=5000)  # q_a = 7 s -> gap 5.64 s > 5 s
    d2 = pol.place(req("r2", 1000), v, {W("a"): 9}, loads, 0.0)
    # all kept; token load: a 10,000 + 100, b 0 + 1000 -> b
    assert d2.worker == "b" and "broken" in d2.note
    assert pol.gate_breaks == 1  # type: ignore[attr-defined]
    explorer = make_policy("llmd", profile=ROUND, explore_probability=1.0)
    loads2 = loads_for(v)
    loads2[W("a")].reserve(Rq("x"), 0.1, uncached_tokens=5000)
    d3 = explorer.place(req("r3", 1000), v, {W("a"): 9}, loads2, 0.0)
    # filter skipped although a is sticky and fast; token load a 5100 > b 1000 -> b
    assert "explore" in d3.note and d3.worker == "b"


def test_round_robin_skips_ineligible() -> None:
    v = view(
        WorkerView(W("a"), 2),
        WorkerView(W("b"), 2, lifecycle=Lifecycle.DRAINING),
        WorkerView(W("c"), 4),
    )
    pol = make_policy("round_robin", profile=ROUND)
    got = [pol.place(req(f"r{k}", 100), v, {}, loads_for(v), 0.0).worker for k in range(4)]
    assert got == ["a", "c", "a", "c"]


@pytest.mark.parametrize(
    "name",
    ["vertumnus", "homo", "homo_cp2", "static", "vllm", "sglang", "dynamo", "llmd", "round_robin"],
)
def test_every_policy_through_the_core(name: str) -> None:
    v = view(
        WorkerView(W("a"), 2),
        WorkerView(W("b"), 4),
        WorkerView(W("c"), 4, lifecycle=Lifecycle.DRAINING),
    )
    core = SchedulerCore(make_policy(name, profile=ROUND, rng=random.Random(1)), v)
    for k in range(6):
        d = core.place(req(f"r{k}", 300 * (k + 1)), {W("b"): k}, float(k))
        assert d.worker in ("a", "b")
        assert core.load(d.worker).assignment(RequestId(f"r{k}")).predicted_s == d.predicted_s
    for k in range(6):
        core.start(RequestId(f"r{k}"), 10.0)
        core.finish(RequestId(f"r{k}"), 11.0)
    assert all(len(ld) == 0 for ld in core.loads.values())
    with pytest.raises(InvalidInput):
        core.place(req("bad", 100), {W("a"): -2}, 1.0)
