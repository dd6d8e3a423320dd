"""The prefix-cache manager inside the simulator (§7): replication, reclamation, visibility.

A replica becomes usable only when its transfer completes (ground-truth.md): with transfers
that never complete during the run, every reuse a request gets on a worker must come from a
prefix that worker computed itself earlier; with ordinary transfers, some reuse comes from
replicas. With the cache manager off nothing is replicated or reclaimed.
"""

from __future__ import annotations

import pytest
from simeng_support import B, by_id, check_records, run

from services.cachemgr.pull import PullConfig
from services.cachemgr.reconcile import RehomeConfig
from services.cachemgr.scan import ScanConfig
from services.controller.lattice import Composition, Lattice
from services.scheduler.core import SchedulerCore
from services.scheduler.placement import PullCredit
from shared.ids import InvalidInput
from shared.worker import GpuGroup
from sim.groundtruth import GroundTruth, Surroundings
from sim.simulator import SimConfig, SimResult, Simulator
from sim.workloads import Workload

# Low thresholds and a short scan period so a 200 s workload sees many cache actions.
EAGER = ScanConfig(
    theta_inter=0.05, theta_intra=0.5, theta_reclaim=0.2, decay=0.5, max_actions_per_list=2
)
NEVER_S = 1e5  # a transfer latency longer than the whole run
# 128 blocks per GPU: a CP2 worker (256 blocks = 131K tokens) still fits the longest request,
# so no placement fails whatever the controller does.
SMALL = dict(
    gpus=16, degrees=(2, 4), cache_blocks_per_gpu=128, scan_interval_s=5.0, scan_config=EAGER
)


def _comp() -> Composition:
    return Composition.parse(Lattice(16, (2, 4)), "4CP2/2CP4")


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def reuse_not_computed_locally(res: SimResult, wl: Workload) -> list[str]:
    """Requests whose reused prefix no earlier request on the same worker had computed."""
    reqs = by_id(wl)
    recs = sorted(res.records, key=lambda r: r.start_s)
    out = []
    for i, r in enumerate(recs):
        if r.reused_tokens == 0:
            continue
        mine = reqs[r.request_id].block_hashes
        need = r.reused_tokens // B if r.reused_tokens % B == 0 else len(mine)
        if not any(
            o.worker == r.worker
            and o.finish_s <= r.start_s
            and _common(reqs[o.request_id].block_hashes, mine) >= need
            for o in recs[:i]
        ):
            out.append(r.request_id)
    return out


@pytest.fixture(scope="module")
def cached_run(profile, phased_workload) -> SimResult:
    return run(phased_workload, profile, composition=_comp(), cache_manager=True, **SMALL)


def test_cache_manager_on_with_small_caches_completes(cached_run, phased_workload) -> None:
    res = cached_run
    check_records(res, phased_workload, gpus=16)
    assert res.replications > 0 and res.reclamations > 0
    assert res.reconcile_transfers == 0  # no split / merge without the controller


def test_replicas_are_used_once_installed(cached_run, phased_workload) -> None:
    """Non-vacuity of the next test: with ordinary transfer times some requests reuse a
    prefix their worker never computed — it arrived by replication."""
    assert reuse_not_computed_locally(cached_run, phased_workload)


def test_replicas_are_invisible_until_the_transfer_completes(profile, phased_workload) -> None:
    slow = GroundTruth(surroundings=Surroundings(transfer_latency_s=NEVER_S))
    res = run(
        phased_workload, profile, composition=_comp(), cache_manager=True, truth=slow, **SMALL
    )
    check_records(res, phased_workload, gpus=16, truth=slow)
    assert reuse_not_computed_locally(res, phased_workload) == []
    # Replications are counted when they complete: after the (huge) transfer latency.
    assert res.replications > 0
    assert res.end_s >= NEVER_S
    assert max(r.finish_s for r in res.records) < NEVER_S


@pytest.mark.parametrize("adaptive", [False, True])
def test_cache_manager_off_replicates_and_reclaims_nothing(
    profile, phased_workload, adaptive
) -> None:
    res = run(
        phased_workload,
        profile,
        composition=_comp(),
        cache_manager=False,
        adaptive=adaptive,
        **SMALL,
    )
    check_records(res, phased_workload, gpus=16)
    assert (res.replications, res.reclamations, res.reconcile_transfers) == (0, 0, 0)
    foreign = reuse_not_computed_locally(res, phased_workload)
    if not adaptive:
        assert foreign == []
    else:
        assert res.reconfigurations
        # Without the manager a reuse that no earlier request on the same worker computed can
        # only be KV that stayed on the GPUs across a split or merge: on a worker the
        # reconfiguration made, from a request computed earlier on some of its GPUs.
        made = {t for rc in res.reconfigurations for t in rc.targets}
        recs = {r.request_id: r for r in res.records}
        reqs = by_id(phased_workload)
        for rid in foreign:
            r = recs[rid]
            assert r.worker in made
            gpus = set(GpuGroup.from_worker_id(r.worker).gpus)
            mine = reqs[rid].block_hashes
            assert any(
                o.finish_s <= r.start_s
                and gpus & set(GpuGroup.from_worker_id(o.worker).gpus)
                and _common(reqs[o.request_id].block_hashes, mine) > 0
                for o in res.records
            ), rid


def test_split_and_merge_keep_prefixes_with_cache_manager(profile, phased_workload) -> None:
    """With the controller and the cache manager on, retained prefixes survive a split or
    merge (§6.2 reconciliation): some request reuses, on a worker created by a
    reconfiguration, a prefix that worker never computed itself."""
    res = run(
        phased_workload, profile, composition=_comp(), cache_manager=True, adaptive=True, **SMALL
    )
    check_records(res, phased_workload, gpus=16)
    assert res.reconfigurations
    created = {w for rc in res.reconfigurations for w in rc.targets}
    inherited = set(reuse_not_computed_locally(res, phased_workload))
    recs = {r.request_id: r for r in res.records}
    assert any(recs[i].worker in created for i in inherited)


def test_split_rehomes_long_prefixes_to_same_degree_peers(profile, phased_workload) -> None:
    """With re-homing on, a split copies the parent's retained prefixes to the other workers of
    its degree (reconcile.py ``rehome_on_split``); the scan is set never to replicate, so every
    replication here is one of those copies, and without re-homing there are none. Caches of
    2048 blocks per GPU leave the peers room (at 128 they are full by the first split)."""
    quiet = ScanConfig(theta_inter=1e9, theta_intra=1e9, theta_reclaim=0.2, decay=0.5)
    base = dict(SMALL, scan_config=quiet, cache_blocks_per_gpu=2048)
    off = run(phased_workload, profile, composition=_comp(), cache_manager=True,
              adaptive=True, **base)
    on = run(phased_workload, profile, composition=_comp(), cache_manager=True,
             adaptive=True, rehome=RehomeConfig(min_blocks=1, fill=1.0), **base)
    check_records(on, phased_workload, gpus=16)
    assert off.replications == 0
    splits = [rc for rc in on.reconfigurations if rc.kind == "split"]
    assert splits  # the calm-then-heavy workload makes the controller split
    # Each copy is confirmed on a peer of the parent's degree, so some replications happen.
    assert on.replications > 0


def test_split_into_full_peers_rehomes_only_with_displacement(profile, phased_workload) -> None:
    """At 128 blocks per GPU the peers are full by the first split: under the fill bound a
    split re-homes nothing; with ``displace`` the parent's reused prefixes are copied over the
    peers' colder blocks, which are demoted first (reconcile.py ``rehome_on_split``). The scan
    never replicates, so every replication is a re-homing copy (merges re-home as well)."""
    quiet = ScanConfig(theta_inter=1e9, theta_intra=1e9, theta_reclaim=0.2, decay=0.5)
    base = dict(SMALL, scan_config=quiet)
    bound = run(phased_workload, profile, composition=_comp(), cache_manager=True,
                adaptive=True, rehome=RehomeConfig(min_blocks=1, fill=1.0), **base)
    displace = run(phased_workload, profile, composition=_comp(), cache_manager=True,
                   adaptive=True, rehome=RehomeConfig(min_blocks=1, fill=1.0, displace=True),
                   **base)
    check_records(displace, phased_workload, gpus=16)
    assert "split" in [rc.kind for rc in bound.reconfigurations]
    assert bound.rehome_demoted == 0
    # Merges re-home onto the merged worker in both runs; only the splits' copies displace.
    assert displace.rehome_demoted > 0
    assert displace.replications > bound.replications


def test_a_rehoming_copy_that_outlasts_the_switch_still_lands(
    profile, phased_workload, monkeypatch
) -> None:
    """A split's re-homing copies start with the drain; with 5 s a copy they are still running
    when the parent's switch (under a second) retires it. They land all the same: the pages
    stay resident on the parent's GPUs and the source pins them for the transfer (§6.2, §8;
    sim/simulator.py ``_transfer_done``). Each one that lands after its source is gone (at a
    destination still there) is held whole by that destination in the trie -- which is what
    the next long phase finds."""
    import sim.simulator as simulator
    from services.cachemgr.actions import Replicate

    slow = GroundTruth(surroundings=Surroundings(transfer_latency_s=5.0))
    rehomed: dict[int, Replicate] = {}  # by id(), the action kept alive so no id is reused
    rehome = simulator.rehome_on_split

    def spy(*args: object, **kwargs: object) -> tuple[object, ...]:
        acts = rehome(*args, **kwargs)  # type: ignore[arg-type]
        rehomed.update((id(a), a) for a in acts if isinstance(a, Replicate))
        return acts

    after_switch: list[bool] = []
    done = Simulator._transfer_done

    def on_done(self: Simulator, act: Replicate, now: float) -> None:
        # Only a copy whose destination is still there can land (one reconfigured meanwhile
        # fails: its reserved pages are gone).
        outlasted = act.source not in self.workers and act.dest in self.workers
        done(self, act, now)
        if id(act) in rehomed and outlasted:
            after_switch.append(all(act.dest in self.trie.holders(h) for h in act.blocks))

    monkeypatch.setattr(simulator, "rehome_on_split", spy)
    monkeypatch.setattr(Simulator, "_transfer_done", on_done)
    base = dict(SMALL, scan_config=QUIET, cache_blocks_per_gpu=2048)
    res = run(phased_workload, profile, composition=_comp(), cache_manager=True, adaptive=True,
              truth=slow, rehome=RehomeConfig(min_blocks=1, fill=1.0), **base)
    check_records(res, phased_workload, gpus=16, truth=slow)
    assert "split" in [rc.kind for rc in res.reconfigurations] and rehomed
    assert after_switch and all(after_switch)


def test_merge_rehomes_its_degrees_long_prefixes_onto_the_merged_worker(
    profile, phased_workload
) -> None:
    """With re-homing on, a merge's new worker gets copies of the long prefixes the other
    workers of its degree hold (reconcile.py ``rehome_on_merge``), as it is exposed. From
    8CP2, the calm first 120 s only merge (the first has no CP4 peer to copy from, the later
    ones do); the scan never replicates, so every replication is such a copy."""
    quiet = ScanConfig(theta_inter=1e9, theta_intra=1e9, theta_reclaim=0.2, decay=0.5)
    base = dict(SMALL, scan_config=quiet, cache_blocks_per_gpu=2048)
    calm = Workload("calm", tuple(r for r in phased_workload.requests if r.arrival_s < 120.0),
                    phased_workload.block_size)
    comp = Composition.parse(Lattice(16, (2, 4)), "8CP2")
    off = run(calm, profile, composition=comp, cache_manager=True, adaptive=True, **base)
    on = run(calm, profile, composition=comp, cache_manager=True, adaptive=True,
             rehome=RehomeConfig(min_blocks=1, fill=1.0), **base)
    check_records(on, calm, gpus=16)
    kinds = [rc.kind for rc in on.reconfigurations]
    assert kinds.count("merge") >= 2 and "split" not in kinds
    assert off.replications == 0
    assert on.replications > 0


# The scan never replicates: every copy below is a route-time pull.
QUIET = ScanConfig(theta_inter=1e9, theta_intra=1e9, theta_reclaim=0.2, decay=0.5)


def test_route_time_pulls_bring_prefixes_to_the_routed_worker(profile, phased_workload) -> None:
    """With the pull on (services/cachemgr/pull.py), a request routed away from the worker
    holding its prefix has that prefix copied to its worker: pulls land, and requests reuse
    prefixes their worker never computed (the scan copies nothing here). Off, neither."""
    base = dict(SMALL, scan_config=QUIET, cache_blocks_per_gpu=2048)
    off = run(phased_workload, profile, composition=_comp(), cache_manager=True, **base)
    on = run(phased_workload, profile, composition=_comp(), cache_manager=True,
             pull=PullConfig(min_blocks=1), **base)
    check_records(on, phased_workload, gpus=16)
    assert (off.pulls, off.replications) == (0, 0)
    assert reuse_not_computed_locally(off, phased_workload) == []
    assert on.pulls > 0 and on.replications == 0
    assert reuse_not_computed_locally(on, phased_workload)


def test_a_pull_is_used_only_once_it_has_landed(profile, phased_workload) -> None:
    """Transfers that never complete during the run: no pull lands, and every reuse is the
    worker's own computation -- J does not count on a pull, and neither does the worker."""
    slow = GroundTruth(surroundings=Surroundings(transfer_latency_s=NEVER_S))
    base = dict(SMALL, scan_config=QUIET, cache_blocks_per_gpu=2048)
    res = run(phased_workload, profile, composition=_comp(), cache_manager=True, truth=slow,
              pull=PullConfig(min_blocks=1), **base)
    check_records(res, phased_workload, gpus=16, truth=slow)
    assert max(r.finish_s for r in res.records) < NEVER_S
    assert reuse_not_computed_locally(res, phased_workload) == []
    assert res.pulls > 0  # counted as they land, after the run's last request
    assert res.end_s >= NEVER_S


def test_the_pull_is_part_of_the_cache_manager(profile, phased_workload) -> None:
    """With the cache manager off (every baseline), a pull setting does nothing."""
    res = run(phased_workload, profile, composition=_comp(), cache_manager=False,
              pull=PullConfig(min_blocks=1), **SMALL)
    assert res.pulls == 0
    assert reuse_not_computed_locally(res, phased_workload) == []


def test_j_counts_on_the_pull_only_where_the_cache_manager_pulls(profile) -> None:
    """J's pull credit (services/scheduler/placement.py) is given to a J policy only when its
    deployment's cache manager runs the route-time pull, with the pull's min_blocks."""
    def credit(policy: str = "vertumnus", **kw: object) -> object:
        cfg = SimConfig(policy=policy, **{**SMALL, **kw})  # type: ignore[arg-type]
        return Simulator(cfg, profile).sched.policy.pull  # type: ignore[attr-defined]

    on = dict(cache_manager=True, pull=PullConfig(min_blocks=3), pull_credit_blocks=40)
    assert credit(**on) == PullCredit(min_blocks=3, max_blocks=40)
    assert credit("homo_cp2", **on) == PullCredit(min_blocks=3, max_blocks=40)
    assert credit(**{**on, "cache_manager": False}) is None
    assert credit(**{**on, "pull": None}) is None
    assert credit(**{**on, "pull_credit_blocks": 0}) is None
    assert credit(cache_manager=True, pull=PullConfig(min_blocks=3)) is None  # SimConfig: off
    cfg = SimConfig(policy="sglang", **{**SMALL, **on})  # type: ignore[arg-type]
    assert not hasattr(Simulator(cfg, profile).sched.policy, "pull")  # not a J policy
    with pytest.raises(InvalidInput, match="max_blocks"):
        credit(**{**on, "pull_credit_blocks": 2})
    for bad in (-1, 2.5, True):
        with pytest.raises(InvalidInput, match="pull_credit_blocks"):
            SimConfig(pull_credit_blocks=bad)  # type: ignore[arg-type]


def test_with_the_credit_queued_requests_go_where_the_pull_lands(profile, phased_workload) -> None:
    """With the credit, J sends queued requests away from a busy holder more often, and they
    reuse the pulled prefix: more requests reuse blocks their worker never computed than with
    the pull alone."""
    base = dict(SMALL, scan_config=QUIET, cache_blocks_per_gpu=2048, cache_manager=True,
                pull=PullConfig(min_blocks=1))
    alone = run(phased_workload, profile, composition=_comp(), **base)
    credited = run(phased_workload, profile, composition=_comp(), pull_credit_blocks=64, **base)
    check_records(credited, phased_workload, gpus=16)
    pulled_alone = reuse_not_computed_locally(alone, phased_workload)
    pulled = reuse_not_computed_locally(credited, phased_workload)
    assert len(pulled) > len(pulled_alone)


def test_a_landed_pull_demotes_the_sources_copy(profile, phased_workload, monkeypatch) -> None:
    """With ``demote_source`` a pull is a move (services/cachemgr/pull.py): each pull that lands
    demotes copied blocks at its source (here every copy is a private tail: the workload's
    shared prefixes are not pulled), and nothing else is demoted; without it no block is.
    Caches small enough that the eviction order changes what later requests reuse."""
    from services.rankd.blockcache import BlockCache

    calls: list[tuple[str, tuple[int, ...]]] = []
    demote = BlockCache.demote

    def recording(self: BlockCache, block_hashes: tuple[int, ...]) -> int:
        calls.append((self.worker, tuple(block_hashes)))
        return demote(self, block_hashes)

    monkeypatch.setattr(BlockCache, "demote", recording)
    base = dict(SMALL, scan_config=QUIET, cache_manager=True)
    off = run(phased_workload, profile, composition=_comp(),
              pull=PullConfig(min_blocks=1), **base)  # a copy: demote_source is off by default
    assert calls == [] and off.pulls > 0
    on = run(phased_workload, profile, composition=_comp(),
             pull=PullConfig(min_blocks=1, demote_source=True), **base)
    check_records(on, phased_workload, gpus=16)
    assert 0 < len(calls) <= on.pulls
    assert all(blocks for _, blocks in calls)
    assert [r.reused_tokens for r in on.records] != [r.reused_tokens for r in off.records]


def test_copies_through_one_worker_share_its_links(profile, phased_workload, monkeypatch) -> None:
    """A copy holds the links of both its workers' GPUs until it lands (sim/simulator.py
    ``_issue_transfer``): copies that share a GPU never overlap in time, none starts before it
    is issued, each takes exactly its ground-truth transfer time, and the waits the result
    reports are the gaps between issue and start. A slow link (1 s a copy) makes them queue."""
    slow = GroundTruth(surroundings=Surroundings(transfer_latency_s=1.0))
    # By id(), with the action kept alive so that no id is reused.
    issued: dict[int, tuple[float, tuple[int, ...], float, object]] = {}
    landed: dict[int, float] = {}
    issue, done = Simulator._issue_transfer, Simulator._transfer_done

    def on_issue(self: Simulator, act: object, now: float) -> None:
        src, dst = self.workers[act.source], self.workers[act.dest]  # type: ignore[attr-defined]
        same = src.group.first_gpu // 8 == dst.group.first_gpu // 8
        dt = slow.replication_time(len(act.blocks), same_node=same,  # type: ignore[attr-defined]
                                   links=min(src.degree, dst.degree), block_size=B)
        issued[id(act)] = (now, (*src.group.gpus, *dst.group.gpus), dt, act)
        issue(self, act, now)  # type: ignore[arg-type]

    def on_done(self: Simulator, act: object, now: float) -> None:
        landed[id(act)] = now
        done(self, act, now)  # type: ignore[arg-type]

    monkeypatch.setattr(Simulator, "_issue_transfer", on_issue)
    monkeypatch.setattr(Simulator, "_transfer_done", on_done)
    res = run(phased_workload, profile, composition=_comp(), cache_manager=True, truth=slow,
              pull=PullConfig(min_blocks=1), **dict(SMALL, cache_blocks_per_gpu=2048))
    check_records(res, phased_workload, gpus=16, truth=slow)
    assert set(landed) == set(issued)
    spans = {k: (landed[k] - issued[k][2], landed[k]) for k in landed}
    waits = [spans[k][0] - issued[k][0] for k in landed]
    assert min(waits) >= -1e-9
    assert res.copy_waits == sum(w > 1e-12 for w in waits) > 0
    assert res.copy_wait_s == pytest.approx(sum(waits))
    by_gpu: dict[int, list[tuple[float, float]]] = {}
    for k, (a, b) in spans.items():
        for g in issued[k][1]:
            by_gpu.setdefault(g, []).append((a, b))
    for ivs in by_gpu.values():
        ivs.sort()
        assert all(b1 <= a2 + 1e-9 for (_, b1), (a2, _) in zip(ivs, ivs[1:], strict=False))


def test_with_the_wait_a_request_starts_once_the_pull_it_was_priced_with_has_landed(
        profile, phased_workload, monkeypatch) -> None:
    """``SimConfig.pull_wait`` (PullCredit.wait): J also credits workers whose queue is shorter
    than the copy, and such a request holds its worker until its copy has landed. Every
    request J counted a pull for starts its prefill no earlier than that copy lands; some
    reached the head of their queue first and waited (the result counts them and their
    seconds), and more requests reuse blocks their worker never computed than with the
    credit alone."""
    starts: list[tuple[float, float]] = []
    prefill = Simulator._prefill

    def recording(self: Simulator, w: object, job: object, now: float) -> None:
        starts.append((job.pull_end, now))  # type: ignore[attr-defined]
        prefill(self, w, job, now)  # type: ignore[arg-type]

    monkeypatch.setattr(Simulator, "_prefill", recording)
    base = dict(SMALL, scan_config=QUIET, cache_blocks_per_gpu=2048, cache_manager=True,
                pull=PullConfig(min_blocks=1), pull_credit_blocks=64)
    plain = run(phased_workload, profile, composition=_comp(), **base)
    assert plain.pull_waits == 0 and plain.pull_wait_s == 0.0
    assert all(end < 0 for end, _ in starts)
    starts.clear()
    waited = run(phased_workload, profile, composition=_comp(), pull_wait=True, **base)
    check_records(waited, phased_workload, gpus=16)
    counted = [(end, t) for end, t in starts if end >= 0]
    assert counted and all(t >= end for end, t in counted)
    assert waited.pull_waits > 0 and waited.pull_wait_s > 0
    assert waited.pull_waits <= len(counted)
    assert len(reuse_not_computed_locally(waited, phased_workload)) > len(
        reuse_not_computed_locally(plain, phased_workload))
    # A request J counted a pull for whose copy was already on its way (no new pull) waits
    # for that copy: _arriving finds when it lands.
    found: list[float] = []
    arriving = Simulator._arriving

    def recording_arrival(self: Simulator, worker: object, blocks: tuple[int, ...]) -> float:
        end = arriving(self, worker, blocks)  # type: ignore[arg-type]
        found.append(end)
        assert end < 0 or any(a.dest == worker and not set(blocks).isdisjoint(a.blocks)
                              and e == end for a, e in self._landing.values())
        return end

    monkeypatch.setattr(Simulator, "_arriving", recording_arrival)
    again = run(phased_workload, profile, composition=_comp(), pull_wait=True, **base)
    # Copies of 0.5 s: a session's next turn is often placed while its last pull is on its way.
    slow = GroundTruth(surroundings=Surroundings(transfer_latency_s=0.5))
    run(phased_workload, profile, composition=_comp(), truth=slow, pull_wait=True, **base)
    assert [(r.worker, r.start_s, r.ttft_s) for r in again.records] == [
        (r.worker, r.start_s, r.ttft_s) for r in waited.records]
    assert any(end >= 0 for end in found)
    with pytest.raises(InvalidInput, match="pull_wait"):
        SimConfig(pull_wait=1)  # type: ignore[arg-type]


def test_a_request_waits_for_every_copy_of_its_prefix_on_the_way(profile, phased_workload,
                                                                 monkeypatch) -> None:
    """With the wait, a request J counted a pull for starts only once every copy that was on
    its way to its worker with blocks of its prefix (when it was placed) has landed -- not only
    the copy with its first missing block: a split's re-homing sends one prefix in several
    copies (sim/simulator.py ``_arriving``; seed 104 of the reconfiguration preset started a
    document 38 ms early that way and recomputed 76K tokens). Slow links (0.3 s a copy) keep
    copies in flight long enough to overlap placements."""
    issued_at: dict[int, int] = {}  # id(action) -> its rank in issue order
    keep: list[object] = []  # the actions kept alive, so that no id() is reused
    placed: dict[str, tuple[int, frozenset[int]]] = {}
    early: list[str] = []
    counted: list[str] = []
    issue, place, prefill = Simulator._issue_transfer, Simulator._place, Simulator._prefill
    credited: dict[str, int] = {}  # request -> blocks of its prefix J priced it with
    decide = SchedulerCore.place

    def on_decide(self: SchedulerCore, info: object, *args: object, **kw: object) -> object:
        d = decide(self, info, *args, **kw)  # type: ignore[arg-type]
        credited[d.request_id] = d.reused_blocks
        return d

    def on_issue(self: Simulator, act: object, now: float) -> float:
        issued_at[id(act)] = len(keep)
        keep.append(act)
        return issue(self, act, now)  # type: ignore[arg-type]

    def on_place(self: Simulator, job: object, now: float) -> None:
        place(self, job, now)  # type: ignore[arg-type]
        req = job.req  # type: ignore[attr-defined]
        w = self.workers.get(job.rec.worker)  # type: ignore[attr-defined]
        if w is not None and job.pull_end >= 0:  # type: ignore[attr-defined]
            prefix = req.block_hashes[:credited[req.request_id]]
            missing = frozenset(h for h in prefix if h not in w.cache)
            placed[req.request_id] = (len(keep), missing)  # copies issued so far

    def on_prefill(self: Simulator, w: object, job: object, now: float) -> None:
        rid = job.req.request_id  # type: ignore[attr-defined]
        if rid in placed:
            counted.append(rid)
            at, missing = placed.pop(rid)
            if any(a.dest == w.wid and issued_at[id(a)] < at  # type: ignore[attr-defined]
                   and not missing.isdisjoint(a.blocks) for a, _ in self._landing.values()):
                early.append(rid)
        prefill(self, w, job, now)  # type: ignore[arg-type]

    monkeypatch.setattr(Simulator, "_issue_transfer", on_issue)
    monkeypatch.setattr(Simulator, "_place", on_place)
    monkeypatch.setattr(Simulator, "_prefill", on_prefill)
    monkeypatch.setattr(SchedulerCore, "place", on_decide)
    slow = GroundTruth(surroundings=Surroundings(transfer_latency_s=0.3))
    res = run(phased_workload, profile, composition=_comp(), truth=slow, cache_manager=True,
              adaptive=True, rehome=RehomeConfig(min_blocks=1, fill=1.0), pull_wait=True,
              pull=PullConfig(min_blocks=1), pull_credit_blocks=256,
              **dict(SMALL, cache_blocks_per_gpu=2048))
    check_records(res, phased_workload, gpus=16, truth=slow)
    assert res.reconcile_transfers > 0 and res.pull_waits > 0
    assert counted
    assert early == []


def test_with_the_pending_credit_a_request_reuses_its_pending_prefix_where_j_counted_it(
        profile, phased_workload, monkeypatch) -> None:
    """``SimConfig.pending_credit``: after a split or merge J is told how far each worker's
    pending prefix reaches (reconcile.py ``pending_reach``) and may count on it; a request it
    counted it for waits there for its reconcile copies, and then reuses the prefix. Off, J is
    never told (the paper's §6.2: a pending prefix is not reusable until reconciled)."""
    seen: list[tuple[dict, object]] = []
    decide = SchedulerCore.place

    def on_decide(self: SchedulerCore, info: object, *args: object, **kw: object) -> object:
        d = decide(self, info, *args, **kw)  # type: ignore[arg-type]
        seen.append((dict(kw.get("pending") or {}), d))  # type: ignore[call-overload]
        return d

    monkeypatch.setattr(SchedulerCore, "place", on_decide)
    base = dict(composition=_comp(), cache_manager=True, adaptive=True, pull_wait=True,
                pull=PullConfig(min_blocks=1), pull_credit_blocks=256,
                **dict(SMALL, cache_blocks_per_gpu=2048))
    off = run(phased_workload, profile, **base)
    assert off.reconfigurations and off.reconcile_transfers > 0
    assert all(not p for p, _ in seen)
    seen.clear()
    res = run(phased_workload, profile, pending_credit=True, **base)
    check_records(res, phased_workload, gpus=16)
    told = [(p, d) for p, d in seen if p]
    assert told, "no placement saw a pending prefix"
    # Credited from its own pending copy: it reaches at least as far as J counted.
    used = [d for p, d in told if d.pulled_blocks and p.get(d.worker, 0) >= d.reused_blocks]
    assert used
    recs = {r.request_id: r for r in res.records}
    for d in used:
        r = recs[d.request_id]
        if r.worker == d.worker:  # not redirected by a later reconfiguration
            assert r.reused_tokens >= d.prefix_tokens
    with pytest.raises(InvalidInput, match="pending_credit"):
        SimConfig(pending_credit=1)  # type: ignore[arg-type]
