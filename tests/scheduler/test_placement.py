"""Vertumnus placement (§5.2–5.3, §7.1) on hand-derived examples.

Profile (conftest.ROUND): Ê_C(R, P) = 0.1 + 0.001·R + 0.0001·P + (0.002·R + 1e-6·W(R, P)) / C,
W(R, P) = R·P + R(R+1)/2; block size B = 100; β = 1.5, λ = 0.5.

Request L = 1000 (10 blocks). Worker "w2" (CP2) holds nothing; worker "w4" (CP4) holds 6 blocks.

* w2: P = 0,   R = 1000, W = 500,500:  s = 0.1 + 1.0 + 0 + (2.0 + 0.5005)/2     = 2.35025
* w4: P = 600, R = 400,  W = 240,000 + 80,200 = 320,200:
       s = 0.1 + 0.4 + 0.06 + (0.8 + 0.3202)/4                                   = 0.84005
       Ê_2(400, 600) = 0.56 + 1.1202/2                                           = 1.1201
       extra = 4·0.84005 − 2·1.1201 = 3.3602 − 2.2402                            = 1.12
* C_min = 2 (w2's extra is 0).
"""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sched_support import ROUND, loads_for, req, view

from services.scheduler import (
    ClusterView,
    Exclusion,
    NoEligibleWorker,
    RequestInfo,
    SchedulerCore,
    WorkerLoad,
    WorkerView,
    make_policy,
    place_j,
)
from services.scheduler.decision import CandidateColumns
from services.scheduler.placement import tie_rank
from shared.costmodel import Coefficients, Profile
from shared.ids import InvalidInput, RequestId, UnknownWorker, WorkerId
from shared.worker import Lifecycle

W = WorkerId
BETA, LAM = 1.5, 0.5
S_W2, S_W4, E2_W4, EXTRA_W4 = 2.35025, 0.84005, 1.1201, 1.12


def two_degree_view(**w4: object) -> ClusterView:
    return view(WorkerView(W("w2"), 2), WorkerView(W("w4"), 4, **w4))  # type: ignore[arg-type]


def test_worked_example_every_term() -> None:
    v = two_degree_view()
    loads = loads_for(v)
    # w4 is busy: a running request predicted 1.5 s started at t=0, and 0.5 s queued behind it.
    loads[W("w4")].reserve(RequestId("old"), 1.5)
    loads[W("w4")].start(RequestId("old"), 0.0)
    loads[W("w4")].reserve(RequestId("queued"), 0.5)
    now = 0.5  # running one has 1.0 s left -> q_w4 = 1.5
    d = place_j(req("r", 1000), v, {W("w4"): 6}, loads, now, profile=ROUND, beta=BETA, lam=LAM)
    c2, c4 = d.candidate(W("w2")), d.candidate(W("w4"))
    assert (c2.prefix_tokens, c2.uncached_tokens) == (0, 1000)
    assert (c4.prefix_tokens, c4.uncached_tokens) == (600, 400)
    assert c2.q == 0.0 and c4.q == pytest.approx(1.5)
    assert c2.s == pytest.approx(S_W2, rel=1e-12)
    assert c4.s == pytest.approx(S_W4, rel=1e-12)
    assert ROUND.predict(400, 600, 2) == pytest.approx(E2_W4, rel=1e-12)
    assert c2.extra_gpu == 0.0
    assert c4.extra_gpu == pytest.approx(EXTRA_W4, rel=1e-9)
    j2 = 0.0 + BETA * S_W2  # 3.525375
    j4 = 1.5 + BETA * S_W4 + LAM * EXTRA_W4  # 1.5 + 1.260075 + 0.56 = 3.320075
    assert c2.score == pytest.approx(j2, rel=1e-12)
    assert c4.score == pytest.approx(j4, rel=1e-9)
    assert d.worker == "w4" and d.degree == 4
    assert (d.prefix_tokens, d.uncached_tokens, d.reused_blocks) == (600, 400, 6)
    assert d.predicted_s == pytest.approx(S_W4, rel=1e-12)
    # preferred degree: argmin J − q = (3.525375, 1.820075) -> CP4
    assert (d.preferred_degree, d.preferred_worker) == (4, "w4")
    text = d.explain()
    assert "* w4" in text and "w2" in text and "J" in text


def test_heavier_queue_flips_choice_but_not_preferred_degree() -> None:
    v = two_degree_view()
    loads = loads_for(v)
    loads[W("w4")].reserve(RequestId("big"), 2.0)  # q_w4 = 2.0: J4 = 3.820075 > J2 = 3.525375
    d = place_j(req("r", 1000), v, {W("w4"): 6}, loads, 0.0, profile=ROUND, beta=BETA, lam=LAM)
    assert d.worker == "w2"
    assert d.candidate(W("w4")).score == pytest.approx(2.0 + 1.260075 + 0.56, rel=1e-9)
    assert (d.preferred_degree, d.preferred_worker) == (4, "w4")  # the load term is omitted


def test_full_prefix_hit_still_recomputes_last_token() -> None:
    v = two_degree_view()
    d = place_j(
        req("r", 1000), v, {W("w4"): 10}, loads_for(v), 0.0, profile=ROUND, beta=BETA, lam=LAM
    )
    c4 = d.candidate(W("w4"))
    assert (c4.prefix_tokens, c4.uncached_tokens) == (999, 1)
    # J_w4 = 1.5·0.20165 + 0.5·(4·0.20165 − 2·0.2024) = 0.5034 < J_w2 = 3.525375
    assert d.worker == "w4" and d.uncached_tokens == 1
    assert d.reused_blocks == 9  # 999 // 100: the 10th block is recomputed (R ≥ 1)


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({"lifecycle": Lifecycle.DRAINING}, Exclusion.DRAINING),
        ({"lifecycle": Lifecycle.SWITCHING}, Exclusion.SWITCHING),
        ({"lifecycle": Lifecycle.UNAVAILABLE}, Exclusion.UNAVAILABLE),
        ({"max_seq_len": 999}, Exclusion.TOO_LONG),
        ({"kv_capacity_tokens": 999}, Exclusion.NO_MEMORY),
    ],
)
def test_eligibility_exclusions(kw: dict, reason: Exclusion) -> None:
    v = two_degree_view(**kw)
    d = place_j(
        req("r", 1000), v, {W("w4"): 6}, loads_for(v), 0.0, profile=ROUND, beta=BETA, lam=LAM
    )
    assert d.worker == "w2"
    c4 = d.candidate(W("w4"))
    assert c4.excluded is reason and not c4.eligible and c4.score is None
    assert str(reason) in d.explain()
    # with w4 out, C_min is still 2 and w2's terms are unchanged
    assert d.candidate(W("w2")).score == pytest.approx(BETA * S_W2)


def test_limits_are_inclusive_and_cache_miss_never_excludes() -> None:
    v = two_degree_view(max_seq_len=1000, kv_capacity_tokens=1000)
    d = place_j(req("r", 1000), v, {}, loads_for(v), 0.0, profile=ROUND, beta=BETA, lam=LAM)
    assert all(c.eligible for c in d.candidates)


def test_cmin_is_among_eligible_only() -> None:
    """If the CP2 worker is draining, C_min = 4 and w4's extra-GPU term is 0."""
    v = view(WorkerView(W("w2"), 2, lifecycle=Lifecycle.DRAINING), WorkerView(W("w4"), 4))
    d = place_j(
        req("r", 1000), v, {W("w4"): 6}, loads_for(v), 0.0, profile=ROUND, beta=BETA, lam=LAM
    )
    assert d.candidate(W("w4")).extra_gpu == 0.0
    assert d.candidate(W("w4")).score == pytest.approx(BETA * S_W4)


def test_no_eligible_worker_names_each_reason() -> None:
    v = view(
        WorkerView(W("a"), 2, lifecycle=Lifecycle.DRAINING),
        WorkerView(W("b"), 4, max_seq_len=10),
    )
    with pytest.raises(NoEligibleWorker) as ei:
        place_j(req("r", 1000), v, {}, loads_for(v), 0.0, profile=ROUND, beta=BETA, lam=LAM)
    assert ei.value.reasons == {"a": "draining", "b": str(Exclusion.TOO_LONG)}
    assert "draining" in str(ei.value) and "max_seq_len" in str(ei.value)


def test_reservation_visible_to_next_concurrent_placement() -> None:
    """Two identical requests at the same instant: the second sees the first's reservation."""
    v = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4))
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND), v)
    d1 = core.place(req("r1", 1000), {}, 0.0)
    d2 = core.place(req("r2", 1000, first=100), {}, 0.0)  # no shared prefix
    other = W("b") if d1.worker == "a" else W("a")
    assert d2.worker == other  # the first one's reservation broke the tie
    assert d2.candidate(d1.worker).q == pytest.approx(d1.predicted_s)
    assert core.load(d1.worker).queue_delay(0.0) == pytest.approx(ROUND.predict(1000, 0, 4))


def test_running_request_progress_lowers_q() -> None:
    v = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4))
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND, lam=0.0), v)
    core.place(req("r1", 1000), {}, 0.0)  # on a; s = Ê_4(1000, 0)
    s = ROUND.predict(1000, 0, 4)
    core.start(RequestId("r1"), 0.0)
    d = core.place(req("r2", 1000, first=100), {}, s / 2)  # no shared prefix
    assert d.candidate(W("a")).q == pytest.approx(s / 2)
    core.finish(RequestId("r1"), s)
    assert core.load(W("a")).queue_delay(s) == 0.0


def test_columns_keep_the_decision_time_terms_after_the_reservation() -> None:
    """The candidate columns are computed on first read; they must show what the placement
    compared (q before its own reservation), however late they are read."""
    v = view(WorkerView(W("b2"), 2), WorkerView(W("a2"), 2), WorkerView(W("c4"), 4),
             WorkerView(W("d4"), 4, lifecycle=Lifecycle.DRAINING))
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND, beta=BETA, lam=LAM), v)
    d = core.place(req("r1", 1000), {W("c4"): 6}, 0.0)
    core.start(RequestId("r1"), 0.0)
    d2 = core.place(req("r2", 1000, first=100), {}, 0.5)
    core.finish(RequestId("r1"), 3.0)
    chosen = d.chosen
    assert chosen.q == 0.0 and chosen.s == d.predicted_s
    assert chosen.score == min(c.score for c in d.candidates if c.eligible)
    for c in d.candidates:
        if c.eligible:
            assert c.score == c.q + (BETA * c.s + LAM * c.extra_gpu)  # J, bit for bit
            assert c.prefix_tokens + c.uncached_tokens == 1000
        else:
            assert c.excluded is Exclusion.DRAINING and c.score is None and c.q is None
    assert (d.preferred_degree, d.preferred_worker) == (4, W("c4"))  # its 6-block hit
    # A miss everywhere: β·s + λ·extra is lower at CP2 (3.525 vs 3.69); the tie between the
    # two CP2 workers goes to the smaller id, whatever the view's order.
    assert (d2.preferred_degree, d2.preferred_worker) == (2, W("a2"))
    cols = d.columns
    eager = CandidateColumns(cols.workers, cols.degrees, cols.excluded, cols.q, cols.s,
                             cols.extra_gpu, cols.score, cols.prefix_tokens,
                             cols.uncached_tokens)
    assert eager == cols and hash(eager) == hash(cols) and repr(eager) == repr(cols)
    assert pickle.loads(pickle.dumps(d2)) == d2 and copy.deepcopy(d2) == d2


def test_tie_break_is_lower_degree_then_a_per_request_rank_whatever_the_order() -> None:
    # Degree-independent model (c = alpha = 0) and λ = 0: every J is equal.
    flat = Profile(coefficients=Coefficients(d=0.1, a=0.001, b=0.0, c=0.0, alpha=0.0))
    ws = [
        WorkerView(W("z4"), 4),
        WorkerView(W("b2"), 2),
        WorkerView(W("a4"), 4),
        WorkerView(W("c2"), 2),
    ]
    for rid in ("r", "s", "t", "u"):
        chosen = set()
        for order in (ws, ws[::-1], ws[1:] + ws[:1]):
            v = view(*order)
            d = place_j(req(rid, 1000), v, {}, loads_for(v), 0.0, profile=flat, beta=1.0,
                        lam=0.0)
            assert d.degree == 2  # smaller degree first
            assert d.worker == tie_rank_min(rid, ["b2", "c2"])
            assert d.preferred_worker == "b2"  # PreferDegree's tie-break: degree, worker id
            chosen.add(d.worker)
        assert len(chosen) == 1  # same worker whatever the view's order


def tie_rank_min(rid: str, workers: list[str]) -> str:
    return min(workers, key=lambda w: (tie_rank(rid, W(w)), w))


def test_a_large_tie_goes_to_the_lowest_rank_for_every_request() -> None:
    """place_j inlines the rank arithmetic: it must pick what tie_rank says, over many
    requests and a tie group of twelve (every idle worker of the smaller degree)."""
    flat = Profile(coefficients=Coefficients(d=0.1, a=0.001, b=0.0, c=0.0, alpha=0.0))
    names = [f"w-cp2-g{2 * k}" for k in range(12)]
    v = view(*(WorkerView(W(n), 2) for n in names), WorkerView(W("w-cp4-g24"), 4))
    loads = loads_for(v)
    picked = set()
    for k in range(200):
        rid = f"req-{k}"
        d = place_j(req(rid, 1000), v, {}, loads, 0.0, profile=flat, beta=1.0, lam=0.0)
        assert d.worker == tie_rank_min(rid, names)
        picked.add(d.worker)
    assert picked == set(names)  # and the ranks spread the ties over the whole group


def test_ties_spread_over_workers_instead_of_piling_on_the_lowest_id() -> None:
    """Idle, cache-missing workers tie on J; over many requests each gets a fair share
    (a worker-id tie-break sent every one of them to the same worker)."""
    ws = [WorkerView(W(f"w{k:02d}"), 4) for k in range(10)]
    v = view(*ws)
    counts = dict.fromkeys((w.worker_id for w in ws), 0)
    n = 2000
    for k in range(n):
        d = place_j(req(f"req-{k}", 1000), v, {}, loads_for(v), 0.0, profile=ROUND, beta=BETA,
                    lam=LAM)
        counts[d.worker] += 1
    # Binomial(2000, 0.1): mean 200, sd 13.4; 140..260 is beyond 4 sd on either side.
    assert all(140 <= c <= 260 for c in counts.values()), counts


def test_a_cache_hit_still_beats_a_tie() -> None:
    ws = [WorkerView(W(f"w{k}"), 4) for k in range(6)]
    v = view(*ws)
    for k in range(50):
        d = place_j(req(f"q{k}", 1000), v, {W("w5"): 6}, loads_for(v), 0.0, profile=ROUND,
                    beta=BETA, lam=LAM)
        assert d.worker == "w5"


def test_bad_inputs_raise_typed_errors_and_change_nothing() -> None:
    with pytest.raises(InvalidInput):
        RequestInfo(RequestId("r"), -5)
    with pytest.raises(InvalidInput):
        RequestInfo(RequestId("r"), 0)
    # Every block hash an exact int: a list (unhashable) or a string failed only deep in the
    # core, after the request's work was reserved on a worker that then never released it.
    for hashes in ([[1], [2]], ("a", None), (1, True), (1, 2.0)):
        with pytest.raises(InvalidInput, match="block_hashes must be a sequence of ints"):
            RequestInfo(RequestId("r"), 1000, hashes)  # type: ignore[arg-type]
    assert RequestInfo(RequestId("r"), 1000, [1, -2, 2**63]).block_hashes == (1, -2, 2**63)
    v = two_degree_view()
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND), v)
    core.place(req("r0", 1000), {}, 0.0)
    before = {w: (ld.unfinished, ld.queue_delay(0.0)) for w, ld in core.loads.items()}
    with pytest.raises(InvalidInput):
        core.place(req("r1", 1000), {W("w4"): -1}, 0.0)
    with pytest.raises(InvalidInput):
        core.place(req("r1", 1000), {}, float("nan"))
    with pytest.raises(InvalidInput):  # duplicate placement
        core.place(req("r0", 1000), {}, 0.0)
    with pytest.raises(UnknownWorker):
        core.load(W("nope"))
    with pytest.raises(InvalidInput):
        core.finish(RequestId("never"), 1.0)
    after = {w: (ld.unfinished, ld.queue_delay(0.0)) for w, ld in core.loads.items()}
    assert after == before
    # a worker of the view without a load tracker
    loads = loads_for(v)
    del loads[W("w2")]
    with pytest.raises(UnknownWorker):
        place_j(req("r", 1000), v, {}, loads, 0.0, profile=ROUND, beta=BETA, lam=LAM)
    # held blocks for a worker outside the view are ignored (the cache index may lag)
    d = place_j(
        req("r", 1000), v, {W("gone"): 3}, loads_for(v), 0.0, profile=ROUND, beta=BETA, lam=LAM
    )
    assert d.worker in ("w2", "w4")
    with pytest.raises(InvalidInput):
        make_policy("vertumnus", beta=0.5)  # β ≥ 1
    with pytest.raises(InvalidInput):
        make_policy("vertumnus", lam=-1.0)


def test_decision_to_dict_is_json_ready() -> None:
    import json

    v = two_degree_view()
    d = place_j(
        req("r", 1000), v, {W("w4"): 6}, loads_for(v), 0.0, profile=ROUND, beta=BETA, lam=LAM
    )
    data = json.loads(json.dumps(d.to_dict()))
    assert data["worker"] == "w4" and len(data["candidates"]) == 2


workers_st = st.lists(
    st.tuples(st.sampled_from([1, 2, 4, 8]), st.integers(0, 12), st.floats(0, 5), st.booleans()),
    min_size=1,
    max_size=8,
)


@settings(max_examples=80, deadline=None)
@given(workers_st, st.integers(1, 1200), st.floats(1.0, 3.0), st.floats(0.0, 2.0))
def test_choice_is_argmin_of_j_by_the_formula(spec, length, beta, lam) -> None:
    ws = [
        WorkerView(W(f"w{k}"), c, lifecycle=Lifecycle.ACTIVE if act else Lifecycle.DRAINING)
        for k, (c, _, _, act) in enumerate(spec)
    ]
    v = view(*ws)
    loads = {w.worker_id: WorkerLoad(w.worker_id) for w in ws}
    held = {}
    for k, (_, h, q, _) in enumerate(spec):
        if q > 0:
            loads[W(f"w{k}")].reserve(RequestId("x"), q)
        held[W(f"w{k}")] = h
    r = RequestInfo(RequestId("r"), length)
    eligible = [(k, w) for k, w in enumerate(ws) if w.lifecycle is Lifecycle.ACTIVE]
    if not eligible:
        with pytest.raises(NoEligibleWorker):
            place_j(r, v, held, loads, 0.0, profile=ROUND, beta=beta, lam=lam)
        return
    d = place_j(r, v, held, loads, 0.0, profile=ROUND, beta=beta, lam=lam)
    cmin = min(w.degree for _, w in eligible)
    js = {}
    for k, w in eligible:
        p = min(spec[k][1] * 100, length - 1)
        rr = length - p
        s = ROUND.predict(rr, p, w.degree)
        extra = w.degree * s - cmin * ROUND.predict(rr, p, cmin)
        js[w.worker_id] = loads[w.worker_id].queue_delay(0.0) + beta * s + lam * extra
        assert d.candidate(w.worker_id).score == pytest.approx(js[w.worker_id], rel=1e-9, abs=1e-12)
    assert js[d.worker] == pytest.approx(min(js.values()), rel=1e-9, abs=1e-12)
    assert d.uncached_tokens >= 1


@settings(max_examples=40, deadline=None)
@given(workers_st, st.integers(1, 1200), st.randoms(use_true_random=False))
def test_choice_does_not_depend_on_view_order(spec, length, rnd) -> None:
    ws = [WorkerView(W(f"w{k}"), c, epoch=k) for k, (c, _, _, _) in enumerate(spec)]
    held = {W(f"w{k}"): h for k, (_, h, _, _) in enumerate(spec)}
    r = RequestInfo(RequestId("r"), length)
    picks = set()
    for _ in range(3):
        order = list(ws)
        rnd.shuffle(order)
        v = view(*order)
        loads = loads_for(v)
        for k, (_, _, q, _) in enumerate(spec):
            if q > 0:
                loads[W(f"w{k}")].reserve(RequestId("x"), q)
        d = place_j(r, v, held, loads, 0.0, profile=ROUND, beta=BETA, lam=LAM)
        assert d.epoch == v.worker(d.worker).epoch
        picks.add((d.worker, d.preferred_worker))
    assert len(picks) == 1


def test_preferred_degree_at_a_common_prefix() -> None:
    from services.scheduler.placement import preferred_degree_at

    # P = 600 for both degrees: CP2 β·1.1201 = 1.68015 ; CP4 β·0.84005 + λ·1.12 = 1.820075 -> 2
    assert preferred_degree_at(1000, 600, [2, 4], profile=ROUND, beta=BETA, lam=LAM) == 2
    # with λ = 0 only latency counts -> CP4
    assert preferred_degree_at(1000, 600, [4, 2], profile=ROUND, beta=BETA, lam=0.0) == 4
    with pytest.raises(InvalidInput):
        preferred_degree_at(0, 0, [2], profile=ROUND, beta=BETA, lam=LAM)
    with pytest.raises(InvalidInput):
        preferred_degree_at(10, 0, [], profile=ROUND, beta=BETA, lam=LAM)


def test_inflight_prefix_counts_as_reusable_on_its_worker() -> None:
    from sched_support import B

    """A request sharing the prefix of one still queued on a worker reuses it there (the FIFO
    worker caches it first); once that request finishes the in-flight credit is gone."""
    v = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4))
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND, lam=0.0), v)
    d1 = core.place(req("r1", 8 * B), {}, 0.0)
    assert d1.worker == "a"
    d2 = core.place(req("r2", 8 * B + 10, nblocks=8), {}, 0.0)
    assert d2.worker == "a"
    assert d2.reused_blocks == 8 and d2.prefix_tokens == 8 * B
    assert d2.candidate(W("b")).prefix_tokens == 0
    core.finish(RequestId("r1"), 1.0)
    core.finish(RequestId("r2"), 2.0)
    d3 = core.place(req("r3", 8 * B + 10, nblocks=8), {}, 3.0)
    assert d3.reused_blocks == 0  # nothing in flight and the cache view says nothing


def test_another_replicas_request_is_an_inflight_prefix_until_forgotten() -> None:
    """A request another scheduler replica placed on "b" (noted from its statistics) makes a
    request sharing its prefix reuse it on "b" -- no load is reserved for it (the worker's
    report carries that) -- until its result makes this core forget it."""
    from sched_support import B

    v = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4))
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND, lam=0.0), v)
    assert core.note_foreign(req("p1", 8 * B), W("b"), 5.0)
    assert core.foreign_requests == 1 and core.load(W("b")).unfinished == 0
    d = core.place(req("r1", 8 * B + 10, nblocks=8), {}, 6.0)
    assert (d.worker, d.reused_blocks) == ("b", 8)
    core.finish(RequestId("r1"), 7.0)
    assert core.forget_foreign(RequestId("p1")) and not core.forget_foreign(RequestId("p1"))
    d = core.place(req("r2", 8 * B + 10, nblocks=8), {}, 8.0)
    assert d.reused_blocks == 0 and core.foreign_requests == 0
    # Our own request is never foreign; a noted one that comes to us to place is ours.
    assert not core.note_foreign(req("r2", 8 * B + 10, nblocks=8), W("a"), 9.0)
    assert core.note_foreign(req("p2", 8 * B), W("a"), 9.0)
    core.place(req("p2", 8 * B), {}, 10.0)
    assert core.foreign_requests == 0
    # Re-noted elsewhere (re-placed by a peer after a hand-back): it moves.
    core.note_foreign(req("p3", 4 * B, first=100), W("a"), 11.0)
    core.note_foreign(req("p3", 4 * B, first=100), W("b"), 12.0)
    d = core.place(req("r3", 4 * B + 10, nblocks=4, first=100), {}, 12.0)
    assert d.worker == "b" and core.foreign_requests == 1
    # A result that never came: expired by age, the oldest first.
    core.note_foreign(req("p4", 4 * B, first=200), W("a"), 20.0)
    assert core.expire_foreign(15.0) == 1 and core.foreign_requests == 1
    for bad in ((object(), W("a"), 1.0), (req("x", 10), "", 1.0),
                (req("x", 10), W("a"), float("nan"))):
        with pytest.raises(InvalidInput):
            core.note_foreign(*bad)  # type: ignore[arg-type]
    assert core.foreign_requests == 1


def test_baselines_do_not_get_inflight_prefixes() -> None:
    from sched_support import B

    v = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4))
    core = SchedulerCore(make_policy("dynamo", profile=ROUND), v)
    core.place(req("r1", 8 * B), {}, 0.0)
    d2 = core.place(req("r2", 8 * B + 10, nblocks=8), {}, 0.0)
    assert d2.reused_blocks == 0


def _busy_w4(v: ClusterView) -> dict[WorkerId, WorkerLoad]:
    """The worked example's loads: q_w2 = 0, q_w4 = 1.5 at t = 0.5 (mean queue 0.75 s)."""
    loads = loads_for(v)
    loads[W("w4")].reserve(RequestId("old"), 1.5)
    loads[W("w4")].start(RequestId("old"), 0.0)
    loads[W("w4")].reserve(RequestId("queued"), 0.5)
    return loads


@pytest.mark.parametrize(
    ("tau", "beta_used", "worker"),
    [
        (0.0, BETA, "w4"),  # off: the paper's fixed β (the worked example)
        (0.75, BETA, "w4"),  # mean queue 0.75 s = τ: the full β
        (0.25, BETA, "w4"),  # queues beyond τ: still the full β, never more
        (3.0, 1.0 + (BETA - 1.0) * 0.25, "w2"),  # a quarter of the way: 1.125
        (750.0, 1.0 + (BETA - 1.0) * 0.001, "w2"),  # an idle-looking pool: earliest finish
    ],
)
def test_a_load_following_beta_rises_from_one_with_the_mean_queue(
        tau: float, beta_used: float, worker: str) -> None:
    # β = 1.5 sends the request to w4's cached prefix behind its 1.5 s queue (J 3.32 against
    # 3.53); with β near 1 the idle w2 finishes first (J 2.35 against 2.90).
    v = two_degree_view()
    d = place_j(req("r", 1000), v, {W("w4"): 6}, _busy_w4(v), 0.5, profile=ROUND, beta=BETA,
                lam=LAM, beta_queue_scale=tau)
    assert d.worker == worker
    # Every J term of the decision is the one compared, with the β used.
    assert d.candidate(W("w2")).score == pytest.approx(beta_used * S_W2, rel=1e-9)
    assert d.candidate(W("w4")).score == pytest.approx(1.5 + beta_used * S_W4 + LAM * EXTRA_W4,
                                                       rel=1e-9)


def test_the_mean_queue_counts_active_workers_only() -> None:
    # w4 draining (excluded) with a long queue: the active pool (w2 alone) is idle, so β = 1.
    v = view(WorkerView(W("w2"), 2), WorkerView(W("w2b"), 2),
             WorkerView(W("w4"), 4, lifecycle=Lifecycle.DRAINING))
    loads = loads_for(v)
    loads[W("w4")].reserve(RequestId("big"), 100.0)
    loads[W("w2b")].reserve(RequestId("small"), 0.3)
    d = place_j(req("r", 1000), v, {W("w2b"): 6}, loads, 0.0, profile=ROUND, beta=2.0, lam=0.0,
                beta_queue_scale=1.0)
    # q̄ = (0 + 0.3) / 2 = 0.15 -> β = 1.15 (with w4 counted it would be the full 2).
    s_hit = ROUND.predict(400, 600, 2)
    assert d.candidate(W("w2b")).score == pytest.approx(0.3 + 1.15 * s_hit, rel=1e-9)


@pytest.mark.parametrize("tau", [-1.0, float("nan"), float("inf"), True, "2"])
def test_a_bad_beta_queue_scale_is_refused(tau: object) -> None:
    with pytest.raises(InvalidInput, match="beta_queue_scale"):
        make_policy("vertumnus", profile=ROUND, beta_queue_scale=tau)


def test_the_j_policies_take_the_beta_queue_scale() -> None:
    for name in ("vertumnus", "homo", "homo_cp2"):
        pol = make_policy(name, profile=ROUND, beta_queue_scale=2.0)
        assert pol.beta_queue_scale == 2.0  # type: ignore[attr-defined]
        assert "beta_queue_scale=2.0" in repr(pol)
    assert make_policy("vertumnus", profile=ROUND).beta_queue_scale == 0.0  # type: ignore


# --- the busy-share β (beta_busy_power) ---------------------------------------------------------
def _scores(beta_used: float) -> tuple[float, float]:
    """(J of w2, J of w4) of the worked example's terms with ``beta_used``."""
    return beta_used * S_W2, 1.5 + beta_used * S_W4 + LAM * EXTRA_W4


@pytest.mark.parametrize(
    ("k", "beta_used", "worker"),
    [
        (0.0, BETA, "w4"),  # off: the paper's fixed β (the worked example)
        # w4's 4 of the pool's 6 GPUs are busy: b = 2/3.
        (0.5, 1.0 + (BETA - 1.0) * (4 / 6) ** 0.5, "w4"),  # 1.408: still w4's cached prefix
        (1.0, 1.0 + (BETA - 1.0) * 4 / 6, "w2"),  # 1.333: the idle w2 finishes first
        (2.0, 1.0 + (BETA - 1.0) * (4 / 6) ** 2, "w2"),  # 1.222
    ],
)
def test_a_busy_share_beta_weighs_cached_work_by_the_busy_gpus(
        k: float, beta_used: float, worker: str) -> None:
    v = two_degree_view()
    d = place_j(req("r", 1000), v, {W("w4"): 6}, _busy_w4(v), 0.5, profile=ROUND, beta=BETA,
                lam=LAM, beta_busy_power=k)
    j2, j4 = _scores(beta_used)
    assert d.beta == pytest.approx(beta_used, rel=1e-12)  # reported with the decision
    assert f"(β {beta_used:.4g})" in d.explain()
    assert d.worker == (W("w2") if j2 < j4 else W("w4")) == W(worker)
    assert d.candidate(W("w2")).score == pytest.approx(j2, rel=1e-9)
    assert d.candidate(W("w4")).score == pytest.approx(j4, rel=1e-9)


def test_the_busy_share_beta_is_the_full_beta_on_a_busy_pool_and_one_on_an_idle_one() -> None:
    v = two_degree_view()
    busy = _busy_w4(v)
    busy[W("w2")].reserve(RequestId("w2-job"), 0.2)  # every GPU busy: b = 1 for any k
    d = place_j(req("r", 1000), v, {W("w4"): 6}, busy, 0.5, profile=ROUND, beta=BETA, lam=LAM,
                beta_busy_power=3.0)
    assert d.candidate(W("w2")).score == pytest.approx(0.2 + BETA * S_W2, rel=1e-9)
    idle = loads_for(v)  # b = 0: β_eff = 1, J = q + s + λ·extra, earliest finish
    d = place_j(req("r", 1000), v, {W("w4"): 6}, idle, 0.5, profile=ROUND, beta=BETA, lam=LAM,
                beta_busy_power=2.0)
    assert d.candidate(W("w2")).score == pytest.approx(S_W2, rel=1e-9)
    assert d.candidate(W("w4")).score == pytest.approx(S_W4 + LAM * EXTRA_W4, rel=1e-9)


def test_the_busy_share_counts_active_gpus_and_other_replicas_work() -> None:
    from services.scheduler.placement import _static_rows, busy_share

    v = view(WorkerView(W("a"), 2), WorkerView(W("b"), 4), WorkerView(W("c"), 2),
             WorkerView(W("d"), 4, lifecycle=Lifecycle.DRAINING))
    rows = _static_rows(v)[2]
    loads = loads_for(v)
    assert busy_share(rows, loads, 0.0) == 0.0
    loads[W("d")].reserve(RequestId("x"), 9.0)  # a draining worker is not in the pool
    assert busy_share(rows, loads, 0.0) == 0.0
    loads[W("b")].reserve(RequestId("y"), 1.0)  # 4 of the active 8 GPUs, queued
    assert busy_share(rows, loads, 0.0) == 0.5
    # Another replica's work on c (2 GPUs): busy until the worker has run it off.
    loads[W("c")].set_foreign(2.0, 10.0)
    assert busy_share(rows, loads, 11.9) == 0.75
    assert busy_share(rows, loads, 12.0) == 0.5
    loads[W("b")].finish(RequestId("y"))
    assert busy_share(rows, loads, 12.0) == 0.0
    # No active worker at all: β as given.
    gone = view(WorkerView(W("d"), 4, lifecycle=Lifecycle.DRAINING))
    assert busy_share(_static_rows(gone)[2], loads_for(gone), 0.0) == 1.0


def test_the_busy_share_and_the_queue_scale_multiply() -> None:
    # b = 4/6, k = 1; q̄ = (0 + 1.5) / 2 = 0.75 at t = 0.5, τ = 3: f = 4/6 · 0.25.
    v = two_degree_view()
    d = place_j(req("r", 1000), v, {W("w4"): 6}, _busy_w4(v), 0.5, profile=ROUND, beta=BETA,
                lam=LAM, beta_busy_power=1.0, beta_queue_scale=3.0)
    beta_used = 1.0 + (BETA - 1.0) * (4 / 6) * 0.25
    assert d.candidate(W("w2")).score == pytest.approx(beta_used * S_W2, rel=1e-9)


@pytest.mark.parametrize("k", [-1.0, float("nan"), float("inf"), True, "2"])
def test_a_bad_beta_busy_power_is_refused(k: object) -> None:
    with pytest.raises(InvalidInput, match="beta_busy_power"):
        make_policy("vertumnus", profile=ROUND, beta_busy_power=k)


def test_the_j_policies_take_the_beta_busy_power() -> None:
    for name in ("vertumnus", "homo", "homo_cp2"):
        pol = make_policy(name, profile=ROUND, beta_busy_power=2.0)
        assert pol.beta_busy_power == 2.0  # type: ignore[attr-defined]
        assert "beta_busy_power=2.0" in repr(pol)
    # The factory's own default is the paper's fixed β; the calibrated one comes from
    # services/calibration.py (policy_params).
    assert make_policy("vertumnus", profile=ROUND).beta_busy_power == 0.0  # type: ignore


def test_the_placement_terms_carry_the_beta_the_score_used() -> None:
    from services.scheduler.service import placement_terms

    v = two_degree_view()
    pol = make_policy("vertumnus", profile=ROUND, beta=BETA, lam=LAM, beta_busy_power=2.0)
    d = pol.place(req("r", 1000), v, {W("w4"): 6}, _busy_w4(v), 0.5)
    terms = placement_terms(d, pol, 2)
    assert terms is not None and terms.beta == d.beta < BETA
    # J = q + β_eff·s + λ·extra with the β reported (the chosen worker is the idle w2).
    assert terms.j == pytest.approx(terms.q_s + terms.beta * terms.s_s + LAM * terms.gpu_cost_s)
    # ... and they are the chosen worker's terms, not another candidate's (w4's differ).
    assert d.worker == W("w2")
    c, other = d.chosen, d.candidate(W("w4"))
    assert (terms.q_s, terms.s_s, terms.gpu_cost_s, terms.j) == (c.q, c.s, c.extra_gpu, c.score)
    assert (other.q, other.s, other.score) != (c.q, c.s, c.score)
