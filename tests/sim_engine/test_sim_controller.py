"""The controller inside the simulator (§6, §9.3): splits and merges with drain and switch.

On a calm-then-heavy synthetic workload a 16-GPU {2,4} pool reconfigures; every
reconfiguration drains its sources (in-flight prefills finish, queued ones are redirected,
nothing new starts on them), switches within the ground truth's switch range, and the
composition always tiles all GPUs. No request is lost.
"""

from __future__ import annotations

import math

import pytest
from simeng_support import (
    PHASED_GPUS,
    PHASED_WINDOW_S,
    degree_counts_cover,
    phased_adaptive_run,
    worker_geometry,
    worker_gpus,
)

from services.controller.lattice import Composition, Lattice
from sim.groundtruth import GroundTruth
from sim.simulator import SimResult

GPUS = PHASED_GPUS
WINDOW = PHASED_WINDOW_S


@pytest.fixture(scope="module", params=["4CP4", "8CP2"])
def adaptive_run(request, profile, phased_workload) -> SimResult:
    return phased_adaptive_run(phased_workload, profile, request.param)


def test_controller_reconfigures_and_every_reconfiguration_completes(adaptive_run) -> None:
    res = adaptive_run
    assert res.reconfigurations, "no split or merge on a calm-then-heavy workload"
    assert {rc.kind for rc in res.reconfigurations} <= {"split", "merge"}
    sw = GroundTruth().surroundings
    prev_exposed = -math.inf
    for rc in res.reconfigurations:
        assert rc.exposed_s >= 0 and rc.drained_s >= 0, f"{rc} never completed"
        assert rc.drain_s >= 0
        assert sw.switch_min_s - 1e-9 <= rc.switch_s <= sw.switch_max_s + 1e-9
        # Decided at a window boundary; one reconfiguration at a time.
        assert rc.decided_s / WINDOW == pytest.approx(round(rc.decided_s / WINDOW), abs=1e-9)
        assert rc.decided_s >= prev_exposed
        prev_exposed = rc.exposed_s
        assert rc.reason


def test_split_and_merge_geometry(adaptive_run) -> None:
    # Both kinds happen from either start (measured): the geometry of each is checked.
    assert {rc.kind for rc in adaptive_run.reconfigurations} == {"split", "merge"}
    for rc in adaptive_run.reconfigurations:
        src = sorted(g for w in rc.sources for g in worker_gpus(w))
        dst = sorted(g for w in rc.targets for g in worker_gpus(w))
        assert src == dst == list(range(src[0], src[0] + len(src)))
        sd = {worker_geometry(w)[1] for w in rc.sources}
        td = {worker_geometry(w)[1] for w in rc.targets}
        if rc.kind == "split":
            assert (len(rc.sources), len(rc.targets)) == (1, 2) and td == {min(sd) // 2}
        else:
            assert (len(rc.sources), len(rc.targets)) == (2, 1) and td == {2 * max(sd)}


def test_composition_timeline_covers_all_gpus(adaptive_run) -> None:
    res = adaptive_run
    tl = res.composition_timeline
    assert tl[0][0] == 0.0
    for _, counts in tl:
        assert degree_counts_cover(counts) == GPUS
    # One entry per completed reconfiguration, at its exposure, changing counts as it says.
    done = [rc for rc in res.reconfigurations if rc.exposed_s >= 0]
    assert [t for t, _ in tl[1:]] == pytest.approx([rc.exposed_s for rc in done])
    for (_, before), (_, after), rc in zip(tl, tl[1:], done, strict=False):
        delta = {d: after.get(d, 0) - before.get(d, 0) for d in set(before) | set(after)}
        delta = {d: v for d, v in delta.items() if v}
        big = max(worker_geometry(w)[1] for w in rc.sources + rc.targets)
        if rc.kind == "split":
            assert delta == {big: -1, big // 2: 2}
        else:
            assert delta == {big: 1, big // 2: -2}
    assert len(tl) > 1


def test_no_request_starts_on_a_draining_or_switching_worker(adaptive_run) -> None:
    res = adaptive_run
    recs = res.records
    rcs = res.reconfigurations
    assert rcs, "no reconfiguration: nothing drained or switched to check"
    for i, rc in enumerate(rcs):
        for src in rc.sources:
            # The id may come back later as the target of another reconfiguration.
            back = [o.exposed_s for o in rcs[i + 1 :] if src in o.targets]
            until = back[0] if back else math.inf
            bad = [
                r.request_id for r in recs if r.worker == src and rc.decided_s < r.start_s < until
            ]
            assert not bad, f"{bad} started on {src} after it began draining at {rc.decided_s}"
        for dst in rc.targets:
            bad = [
                r.request_id
                for r in recs
                if r.worker == dst and rc.decided_s <= r.start_s < rc.exposed_s
            ]
            assert not bad, f"{bad} started on {dst} before it was exposed at {rc.exposed_s}"


def test_drain_is_the_in_flight_prefills(adaptive_run) -> None:
    """Drain ends exactly when the last prefill in flight on a source at the decision ends."""
    res = adaptive_run
    for rc in res.reconfigurations:
        in_flight = [
            r.finish_s
            for r in res.records
            if r.worker in rc.sources and r.start_s <= rc.decided_s < r.finish_s
        ]
        assert rc.drained_s == pytest.approx(max(in_flight, default=rc.decided_s), abs=1e-9)
    assert any(rc.drain_s > 0 for rc in res.reconfigurations)


def test_gpus_never_run_two_workers_at_once(adaptive_run) -> None:
    """Executions on overlapping GPU groups never overlap in time (old and new geometry)."""
    spans = sorted((r.start_s, r.finish_s, r.worker) for r in adaptive_run.records)
    active: list[tuple[float, str]] = []
    for s, f, w in spans:
        active = [(f0, w0) for f0, w0 in active if f0 > s + 1e-9]
        mine = set(worker_gpus(w))
        for _, w0 in active:
            assert not mine & set(worker_gpus(w0)), f"{w} and {w0} ran at once on shared GPUs"
        active.append((f, w))


def test_no_request_is_lost(adaptive_run, phased_workload) -> None:
    res = adaptive_run
    assert len(res.records) == len(phased_workload)
    assert all(r.ttft_s >= 0 and not r.failed for r in res.records)
    assert {r.request_id for r in res.records} == {r.request_id for r in phased_workload}


def test_redirected_requests_were_queued_at_a_decision(adaptive_run) -> None:
    """Queued requests of a draining worker are redirected (counted once per move): each was
    waiting when some reconfiguration was decided, and still completed."""
    res = adaptive_run
    moved = [r for r in res.records if r.redirected]
    assert moved, "no redirection happened; the workload no longer exercises it"
    decisions = [rc.decided_s for rc in res.reconfigurations]
    for r in moved:
        assert r.redirected <= len(decisions)
        assert any(r.arrival_s <= t <= r.start_s for t in decisions), r
        assert r.ttft_s >= 0


def test_the_controller_judges_kappa_per_window_of_its_own_length(profile) -> None:
    """κ is per window of the profile's length (20 s); a controller file may set another H,
    and the simulator hands the controller κ per window of that H (Profile.for_window): with
    10 s windows half of it. Unscaled, D(k) of a 10 s window would be judged against a 20 s
    κ, and a loaded pool would look half as busy."""
    from simeng_support import unique_prefix_workload

    from services.controller.planner import ControllerConfig
    from sim.simulator import SimConfig, Simulator

    judged = {}
    for h in (20.0, 10.0):
        conf = SimConfig(gpus=GPUS, degrees=(2, 4), adaptive=True, window_s=h, seed=0,
                         controller_config=ControllerConfig(window_s=h))
        sim = Simulator(conf, profile)
        sim.run(unique_prefix_workload([2_000, 3_000], 1.0),
                Composition.parse(Lattice(GPUS, (2, 4)), "4CP4"))
        assert sim.ctl is not None
        judged[h] = sim.ctl.planner.profile
    assert profile.window_s == 20.0 and judged[10.0].window_s == 10.0
    for c in (2, 4):
        assert judged[10.0].kappa_for(c) == pytest.approx(judged[20.0].kappa_for(c) / 2)


def test_an_adaptive_tp_pool_is_refused_up_front() -> None:
    """The controller's plans name CP workers; a TP pool let adaptive failed at its first
    split with a KeyError deep in the run. It is bad input now, named at construction."""
    from shared.ids import InvalidInput
    from shared.worker import WorkerKind
    from sim.simulator import SimConfig

    with pytest.raises(InvalidInput, match="adaptive needs CP workers"):
        SimConfig(adaptive=True, worker_kind=WorkerKind.TP)
    assert SimConfig(adaptive=False, worker_kind=WorkerKind.TP).worker_kind is WorkerKind.TP
