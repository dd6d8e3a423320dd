"""J's pull credit (services/scheduler/placement.py "Pull credit"): a worker whose queue covers
the route-time pull's copy is priced as holding the longest prefix any worker holds.

Two CP4 workers (no λ term between them): "a" holds 8 of the request's 10 blocks and is busy,
"b" holds nothing. Without the credit J keeps the request on "a" (recomputing 800 tokens on
"b" costs more than "a"'s extra queue); with it "b" is priced with the 800 cached tokens the
copy will have brought, and wins."""

from __future__ import annotations

import pytest
from sched_support import ROUND, loads_for, req, view

from services.scheduler import (
    ClusterView,
    SchedulerCore,
    WorkerLoad,
    WorkerView,
    make_policy,
    place_j,
)
from services.scheduler.placement import PullCredit
from services.scheduler.policies.vertumnus import JPolicy
from services.scheduler.service import decision_attributes
from shared.ids import InvalidInput, RequestId, WorkerId
from shared.worker import Lifecycle

W = WorkerId
BETA, LAM = 1.5, 0.5
CREDIT = PullCredit(min_blocks=2, max_blocks=64)


def pool() -> ClusterView:
    return view(WorkerView(W("a"), 4), WorkerView(W("b"), 4))


def busy(v: ClusterView, q_a: float = 2.0, q_b: float = 0.5) -> dict:
    loads = loads_for(v)
    loads[W("a")].reserve(RequestId("qa"), q_a)
    if q_b:
        loads[W("b")].reserve(RequestId("qb"), q_b)
    return loads


def place(held: dict, loads: dict, pull: PullCredit | None = CREDIT, holdings: dict | None = None,
          length: int = 1000):
    return place_j(req("r", length), pool(), held, loads, 0.0, profile=ROUND, beta=BETA, lam=LAM,
                   pull=pull, holdings=holdings)


def test_the_credit_prices_a_queued_worker_with_the_pulled_prefix() -> None:
    v = pool()
    without = place({W("a"): 8}, busy(v), pull=None)
    assert without.worker == "a"
    assert without.candidate(W("b")).prefix_tokens == 0
    assert without.pulled_blocks == 0 and "pull" not in without.explain()
    d = place({W("a"): 8}, busy(v))
    assert d.worker == "b"
    assert (d.prefix_tokens, d.uncached_tokens, d.reused_blocks) == (800, 200, 8)
    # The decision says which part J counts on the pull for (explain, JSON, span).
    assert d.pulled_blocks == 8 and d.to_dict()["pulled_blocks"] == 8
    assert "counts on a pull of 8 blocks" in d.explain()
    assert decision_attributes(d)["vtm.pulled_blocks"] == 8
    assert d.predicted_s == pytest.approx(ROUND.predict(200, 800, 4), rel=1e-12)
    # Both priced with the same prefix: only the queues differ.
    ca, cb = d.candidate(W("a")), d.candidate(W("b"))
    assert ca.prefix_tokens == cb.prefix_tokens == 800
    assert ca.score - cb.score == pytest.approx(2.0 - 0.5, rel=1e-9)


def test_the_credited_copy_pays_its_displacement_price() -> None:
    """δ·(copied blocks) is added to a credited worker's J, in the decision's columns too: the
    queue saved (1.5 s) must exceed it. b's copy is 8 blocks: δ 0.18 s a block (1.44 s)
    still moves the request, 0.19 s (1.52 s) keeps it on its holder."""
    v = pool()
    cheap = PullCredit(min_blocks=2, max_blocks=64, displace_block_s=0.18)
    d = place({W("a"): 8}, busy(v), pull=cheap)
    assert d.worker == "b" and d.pulled_blocks == 8
    free = place({W("a"): 8}, busy(v))
    assert d.candidate(W("b")).score == pytest.approx(free.candidate(W("b")).score + 8 * 0.18,
                                                      rel=1e-12)
    assert d.candidate(W("a")).score == free.candidate(W("a")).score  # the holder copies nothing
    dear = place({W("a"): 8}, busy(v), pull=PullCredit(2, 64, displace_block_s=0.19))
    assert dear.worker == "a" and dear.pulled_blocks == 0
    for bad in (-0.1, float("inf"), True):
        with pytest.raises(InvalidInput, match="displace_block_s"):
            PullCredit(2, 64, displace_block_s=bad)  # type: ignore[arg-type]


def test_no_credit_where_the_copy_would_land_after_the_request_starts() -> None:
    # Estimated copy of 8 blocks: 0.1 + 0.05·8 = 0.5 s.
    slow = PullCredit(min_blocks=2, max_blocks=64, copy_base_s=0.1, copy_block_s=0.05)
    v = pool()
    assert place({W("a"): 8}, busy(v, q_b=0.5), pull=slow).candidate(W("b")).prefix_tokens == 800
    assert place({W("a"): 8}, busy(v, q_b=0.49), pull=slow).candidate(W("b")).prefix_tokens == 0
    # An idle worker starts the request at once: the copy cannot be there.
    d = place({W("a"): 8}, busy(v, q_b=0.0))
    assert d.candidate(W("b")).prefix_tokens == 0


@pytest.mark.parametrize(("held_b", "credit", "expect"), [
    (7, PullCredit(2, 64), 700),   # gap 1 < min_blocks: no copy is sent, its own 7 blocks
    (6, PullCredit(2, 64), 800),   # gap 2 = min_blocks
    (0, PullCredit(2, 8), 800),    # gap 8 = max_blocks
    (0, PullCredit(2, 7), 0),      # gap 8 > max_blocks: a copy J does not count on
])
def test_the_gap_must_lie_between_min_and_max_blocks(held_b: int, credit: PullCredit,
                                                     expect: int) -> None:
    held = {W("a"): 8, W("b"): held_b}
    d = place(held, busy(pool()), pull=credit)
    assert d.candidate(W("b")).prefix_tokens == expect
    assert d.candidate(W("a")).prefix_tokens == 800  # the holder keeps its own prefix
    if d.worker == "b":
        assert d.pulled_blocks == (8 - held_b if expect == 800 else 0)
    else:
        assert d.pulled_blocks == 0  # the holder needs no copy


def test_only_what_the_trie_holds_is_pulled_not_an_inflight_prefix() -> None:
    # held_blocks says "a" will have 8 blocks (an unfinished request's prefix); the trie says
    # nobody holds them yet, so there is nothing to copy.
    d = place({W("a"): 8}, busy(pool()), holdings={})
    assert d.candidate(W("b")).prefix_tokens == 0
    assert d.candidate(W("a")).prefix_tokens == 800
    # A holder of fewer blocks than held_blocks claims: the credit is for what it holds.
    d = place({W("a"): 8}, busy(pool()), holdings={W("a"): 5})
    assert d.candidate(W("b")).prefix_tokens == 500


def test_no_credit_from_a_holder_that_is_no_copy_source() -> None:
    """A holder outside the view, or UNAVAILABLE in it, is no source the cache manager copies
    from: J counts on no pull from it (it cut the reserved work to a fraction and told the
    worker to wait for a copy that never came)."""
    loads = {W(w): WorkerLoad(W(w)) for w in ("a", "b", "gone")}
    wait = PullCredit(min_blocks=2, max_blocks=64, wait=True)
    unavailable = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4),
                       WorkerView(W("gone"), 4, lifecycle=Lifecycle.UNAVAILABLE))
    for v in (pool(), unavailable):
        d = place_j(req("r", 1000), v, {W("gone"): 8}, loads, 0.0, profile=ROUND, beta=BETA,
                    lam=LAM, pull=wait)
        assert (d.pulled_blocks, d.prefix_tokens, d.pull_wait_s) == (0, 0, 0.0)
    # A DRAINING holder still holds its cache: a source, as before.
    draining = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4),
                    WorkerView(W("gone"), 4, lifecycle=Lifecycle.DRAINING))
    d = place_j(req("r", 1000), draining, {W("gone"): 8}, loads, 0.0, profile=ROUND, beta=BETA,
                lam=LAM, pull=wait)
    assert d.pulled_blocks == 8 and d.prefix_tokens == 800


def test_the_credit_crosses_degrees_and_still_charges_the_extra_gpus() -> None:
    v = view(WorkerView(W("w2"), 2), WorkerView(W("w4"), 4))
    loads = loads_for(v)
    loads[W("w4")].reserve(RequestId("qa"), 2.0)
    loads[W("w2")].reserve(RequestId("qb"), 0.5)
    d = place_j(req("r", 1000), v, {W("w4"): 8}, loads, 0.0, profile=ROUND, beta=BETA, lam=LAM,
                pull=CREDIT)
    c2 = d.candidate(W("w2"))
    assert c2.prefix_tokens == 800
    assert c2.s == pytest.approx(ROUND.predict(200, 800, 2), rel=1e-12)
    assert d.candidate(W("w4")).extra_gpu == pytest.approx(
        4 * ROUND.predict(200, 800, 4) - 2 * ROUND.predict(200, 800, 2), rel=1e-9)


def test_without_credit_the_decision_is_unchanged() -> None:
    v = pool()
    a = place({W("a"): 8}, busy(v), pull=None)
    b = place_j(req("r", 1000), v, {W("a"): 8}, busy(v), 0.0, profile=ROUND, beta=BETA, lam=LAM)
    assert a.to_dict() == b.to_dict()
    # Nobody holds min_blocks: the credit has nothing to count on.
    c = place({W("a"): 1}, busy(v))
    assert c.candidate(W("b")).prefix_tokens == 0


def test_bad_credit_and_holdings_are_refused() -> None:
    for kw in ({"min_blocks": 0, "max_blocks": 4}, {"min_blocks": 2, "max_blocks": 1},
               {"min_blocks": True, "max_blocks": 4}, {"min_blocks": 2, "max_blocks": 4.0},
               {"min_blocks": 2, "max_blocks": 4, "copy_base_s": -1.0},
               {"min_blocks": 2, "max_blocks": 4, "copy_block_s": float("nan")}):
        with pytest.raises(InvalidInput):
            PullCredit(**kw)  # type: ignore[arg-type]
    v = pool()
    with pytest.raises(InvalidInput, match="PullCredit"):
        place({W("a"): 8}, busy(v), pull="yes")  # type: ignore[arg-type]
    for bad in (-1, 2.0, True):
        with pytest.raises(InvalidInput, match="holdings"):
            place({W("a"): 8}, busy(v), holdings={W("a"): bad})


def test_the_policy_carries_the_credit_and_the_core_hands_it_the_trie_holdings() -> None:
    base = make_policy("vertumnus", profile=ROUND, beta=BETA, lam=LAM)
    assert isinstance(base, JPolicy) and base.pull is None
    with pytest.raises(InvalidInput, match="PullCredit"):
        JPolicy(profile=ROUND, pull=2)  # type: ignore[arg-type]
    pol = base.with_pull(CREDIT)
    assert pol.pull == CREDIT and base.pull is None
    assert (pol.name, pol.beta, pol.lam, pol.beta_busy_power) == (
        base.name, base.beta, base.lam, base.beta_busy_power)
    assert pol.with_pull(None).pull is None
    core = SchedulerCore(pol, pool())
    core.place(req("long-a", 5000, nblocks=0), {}, 0.0)  # a: busy with no prefix
    core.place(req("long-b", 2000, nblocks=0), {}, 0.0)  # b: less busy
    # r1 goes where J says; its prefix is then in flight there, not held anywhere.
    d1 = core.place(req("r1", 1000), {}, 0.0)
    other = W("a") if d1.worker == "b" else W("b")
    d2 = core.place(req("r2", 1000), {}, 0.0)
    assert d2.candidate(W(d1.worker)).prefix_tokens == 999  # in flight on r1's worker
    assert d2.candidate(other).prefix_tokens == 0  # nothing held to pull
    # Once the trie says r1's worker holds 8 blocks, the other (queued) worker gets the credit.
    d3 = core.place(req("r3", 1000), {W(d1.worker): 8}, 0.0)
    assert d3.candidate(W(d1.worker)).prefix_tokens == 999
    assert d3.candidate(other).prefix_tokens == 800


# -- the credit with its wait (PullCredit.wait) ---------------------------------------------
SLOW = dict(min_blocks=2, max_blocks=64, copy_base_s=0.1, copy_block_s=0.05)  # 8 blocks: 0.5 s


def test_with_the_wait_a_worker_whose_queue_is_short_waits_for_the_copy() -> None:
    """b's queue (0.2 s) is shorter than the 0.5 s copy: without the wait it gets no credit;
    with it b is priced as starting when the copy lands (q = 0.5 s) with the pulled prefix,
    and the decision says how much longer than its queue the request waits."""
    v = pool()
    plain = place({W("a"): 8}, busy(v, q_b=0.2), pull=PullCredit(**SLOW))
    assert plain.candidate(W("b")).prefix_tokens == 0 and plain.pull_wait_s == 0.0
    d = place({W("a"): 8}, busy(v, q_b=0.2), pull=PullCredit(**SLOW, wait=True))
    assert d.worker == "b" and d.pulled_blocks == 8
    assert d.pull_wait_s == pytest.approx(0.5 - 0.2, rel=1e-12)
    cb = d.candidate(W("b"))
    assert cb.prefix_tokens == 800 and cb.q == pytest.approx(0.5, rel=1e-12)
    # J = the copy's time + β·s + λ·extra, as the columns say (equal degrees: no extra GPUs).
    assert cb.score == pytest.approx(0.5 + BETA * ROUND.predict(200, 800, 4), rel=1e-12)
    assert d.to_dict()["pull_wait_s"] == d.pull_wait_s
    assert "waiting 0.3000s for it" in d.explain()
    assert decision_attributes(d)["vtm.pull_wait_s"] == d.pull_wait_s


def test_with_the_wait_an_idle_worker_is_credited_and_a_queue_that_covers_it_waits_nothing(
        ) -> None:
    v = pool()
    idle = place({W("a"): 8}, busy(v, q_b=0.0), pull=PullCredit(**SLOW, wait=True))
    assert idle.worker == "b" and idle.pull_wait_s == pytest.approx(0.5, rel=1e-12)
    covered = place({W("a"): 8}, busy(v, q_b=0.6), pull=PullCredit(**SLOW, wait=True))
    assert covered.worker == "b" and covered.pulled_blocks == 8 and covered.pull_wait_s == 0.0
    assert covered.candidate(W("b")).q == pytest.approx(0.6, rel=1e-12)
    assert "waiting" not in covered.explain()
    # The holder needs no copy: its q is its own queue, wait or not.
    assert idle.candidate(W("a")).q == pytest.approx(2.0, rel=1e-12)


def test_the_wait_is_not_worth_a_copy_slower_than_recomputing() -> None:
    """A copy slower than b's whole recompute keeps the request's prefix cost as it was: with
    a 10 s copy b's J (10 s + β·s) loses to recomputing the 800 tokens at once."""
    v = pool()
    slow = PullCredit(min_blocks=2, max_blocks=64, copy_base_s=10.0, wait=True)
    d = place({W("a"): 8}, busy(v, q_a=30.0, q_b=0.0), pull=slow)
    assert d.worker == "b" and d.pulled_blocks == 0 and d.pull_wait_s == 0.0


def test_pull_copy_s_is_what_the_worker_waits_for_at_most() -> None:
    from services.scheduler.placement import pull_copy_s
    assert pull_copy_s(PullCredit(**SLOW, wait=True), 8) == pytest.approx(0.5, rel=1e-12)
    assert pull_copy_s(PullCredit(**SLOW), 8) == 0.0  # no wait: nothing is held
    assert pull_copy_s(PullCredit(**SLOW, wait=True), 0) == 0.0
    assert pull_copy_s(None, 8) == 0.0


def test_a_wait_that_is_not_a_bool_is_refused() -> None:
    for bad in (1, "yes", None):
        with pytest.raises(InvalidInput, match="wait"):
            PullCredit(2, 64, wait=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("wait", [True, False])
def test_the_scheduler_tells_the_worker_to_wait_for_the_pull_it_counted_on(wait: bool) -> None:
    """The scheduler service's assignment carries ``pull_copy_s`` (what the worker holds the
    request for, services/rankd/core.py ``pull_hold``) when J counted on a pull with the
    wait: the holder of 15 of the request's 16 blocks is busy for 30 s, the idle CP4 worker
    is credited with the copy and waits for it. Without the wait it gets no credit (its queue
    does not cover the copy) and nothing is held."""
    from services.cachemgr.events import Stored
    from services.scheduler.placement import pull_copy_s
    from services.scheduler.service import SchedulerService, SchedulerSettings
    from shared.costmodel import DEFAULT_PROFILE
    from shared.ids import BlockHash
    from shared.schemas import IntakeRequest

    st = SchedulerSettings(nats_url="nats://127.0.0.1:1", subject_prefix="vtm",
                           instance_id="sched-t", degrees=[2, 4], block_size=512,
                           policy="vertumnus", pull_wait=wait)
    svc = SchedulerService(st, profile=DEFAULT_PROFILE, clock=lambda: 1000.0)
    workers = (WorkerView(W("w-cp2-g0"), 2), WorkerView(W("w-cp4-g4"), 4))
    svc.core.set_view(ClusterView(workers, block_size=512))
    for w in workers:
        svc.trie.add_worker(w.worker_id, w.degree, 10_000)
    svc.trie.apply(Stored(W("w-cp2-g0"), 1, None, tuple(BlockHash(100 + k) for k in range(15))))
    svc.core.load(W("w-cp2-g0")).reserve(RequestId("busy"), 30.0)
    req = IntakeRequest(request_id="r", input_len=16 * 512, block_size=512, arrival_s=1000.0,
                        block_hashes=[100 + k for k in range(16)])
    a, d = svc._place(req, 1000.0)
    assert d.worker == a.worker_id == "w-cp4-g4"
    credit = svc.core.policy.pull  # type: ignore[attr-defined]
    if wait:
        assert d.pulled_blocks == 15 and a.prefix_tokens == 15 * 512
        assert a.pull_copy_s == pull_copy_s(credit, 15) == pytest.approx(0.002 + 0.0006 * 15)
    else:
        assert d.pulled_blocks == 0 and a.prefix_tokens == 0 and a.pull_copy_s == 0.0


# -- a pending prefix (placement.py "A pending prefix") --------------------------------------
def place_pending(held: dict, loads: dict, pending: dict | None, pull: PullCredit | None = CREDIT,
                  holdings: dict | None = None):
    return place_j(req("r", 1000), pool(), held, loads, 0.0, profile=ROUND, beta=BETA, lam=LAM,
                   pull=pull, holdings=holdings, pending=pending)


def test_a_pending_prefix_is_credited_to_its_worker_alone() -> None:
    """After a split "b" has 8 blocks of the request pending (its reconcile copies bring them
    on first reuse) and nobody holds them: without the pending credit both recompute and the
    less busy "b" wins at P = 0; with it "b" is priced with the 800 tokens and "a" is not (a
    pull cannot copy from pending blocks)."""
    v = pool()
    plain = place_pending({}, busy(v, q_a=0.5, q_b=2.0), None)
    assert plain.worker == "a" and plain.candidate(W("b")).prefix_tokens == 0
    d = place_pending({}, busy(v, q_a=0.5, q_b=2.0), {W("b"): 8})
    assert d.worker == "b" and d.pulled_blocks == 8
    assert d.candidate(W("b")).prefix_tokens == 800
    assert d.candidate(W("a")).prefix_tokens == 0
    # Without the credit (no pull) a pending count is ignored, as the docstring says.
    assert place_pending({}, busy(v, q_a=0.5, q_b=2.0), {W("b"): 8}, pull=None).worker == "a"
    # A pending reach no further than the worker's own prefix, or the holder's, adds nothing.
    same = place_pending({W("a"): 8}, busy(v), {W("b"): 8})
    assert same.candidate(W("b")).prefix_tokens == 800 and same.worker == "b"
    assert same.to_dict() == place_pending({W("a"): 8}, busy(v), None).to_dict()


def test_a_pending_copy_pays_no_displacement_price_and_waits_like_a_pull() -> None:
    v = pool()
    dear = PullCredit(min_blocks=2, max_blocks=64, displace_block_s=0.19)
    pulled = place_pending({W("a"): 8}, busy(v), None, pull=dear)
    assert pulled.worker == "a"  # the pull's δ keeps it on the holder (test above)
    own = place_pending({W("a"): 8}, busy(v), {W("b"): 8}, pull=dear)
    assert own.worker == "b" and own.pulled_blocks == 8  # the same 8 blocks, its own copy
    assert own.candidate(W("b")).score == pytest.approx(
        place_pending({W("a"): 8}, busy(v), None).candidate(W("b")).score, rel=1e-12)
    # It reaches further than the holder: 10 blocks (999 tokens, L − 1) against 8.
    far = place_pending({W("a"): 8}, busy(v), {W("b"): 10})
    assert far.worker == "b" and far.pulled_blocks == 10
    assert far.candidate(W("b")).prefix_tokens == 999
    # With the wait an idle worker waits for its reconcile copies as for a pull.
    idle = place_pending({}, busy(v, q_a=2.0, q_b=0.0), {W("b"): 8},
                         pull=PullCredit(**SLOW, wait=True))
    assert idle.worker == "b" and idle.pulled_blocks == 8
    assert idle.pull_wait_s == pytest.approx(0.5, rel=1e-12)
    # Bounds as for a pull: under min_blocks beyond its own prefix, nothing.
    assert place_pending({W("b"): 7}, busy(v), {W("b"): 8}).candidate(
        W("b")).prefix_tokens == 700


def test_bad_pending_counts_are_refused_and_the_core_hands_them_to_the_policy() -> None:
    for bad in ({W("b"): -1}, {W("b"): 2.5}, {W("b"): True}):
        with pytest.raises(InvalidInput, match="pending"):
            place_pending({}, busy(pool()), bad)
    pol = make_policy("vertumnus", profile=ROUND, beta=BETA, lam=LAM)
    assert isinstance(pol, JPolicy)
    for policy, expect in ((pol.with_pull(CREDIT), 800), (pol, 0)):
        core = SchedulerCore(policy, pool())
        busy_w = W(core.place(req("long", 5000, nblocks=0), {}, 0.0).worker)
        # The busy worker's queue covers the copy: credited where the policy has the credit.
        d = core.place(req("r1", 1000), {}, 0.0, pending={busy_w: 8})
        assert d.candidate(busy_w).prefix_tokens == expect
