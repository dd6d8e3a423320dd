"""Multi-operation plans inside the simulator: one window's plan runs several splits or merges
concurrently, each with its own drain, switch and epoch, and the pool stays consistent.

Same calm-then-heavy workload and 16-GPU {2, 4} pool as test_sim_controller, with
``max_ops`` 8 (every CP4 of 4CP4 can split in one plan).
"""

from __future__ import annotations

import pytest
from simeng_support import (
    PHASED_GPUS,
    PHASED_WINDOW_S,
    check_records,
    degree_counts_cover,
    phased_adaptive_run,
    worker_gpus,
)

from services.controller.planner import ControllerConfig
from sim.groundtruth import GroundTruth
from sim.simulator import SimResult

GPUS = PHASED_GPUS
WINDOW = PHASED_WINDOW_S


@pytest.fixture(scope="module", params=["4CP4", "8CP2"])
def multi_run(request, profile, phased_workload) -> SimResult:
    return phased_adaptive_run(
        phased_workload, profile, request.param,
        # A low split target makes overload split everything at once.
        controller_config=ControllerConfig(window_s=WINDOW, max_ops=8, split_target=0.3),
    )


def test_some_plan_runs_several_operations_at_once(multi_run) -> None:
    by_decision: dict[float, int] = {}
    for rc in multi_run.reconfigurations:
        by_decision[rc.decided_s] = by_decision.get(rc.decided_s, 0) + 1
    assert max(by_decision.values()) >= 2, by_decision


def test_operations_of_a_plan_are_disjoint_and_plans_do_not_overlap(multi_run) -> None:
    rcs = multi_run.reconfigurations
    assert rcs, "no plan: nothing to check"
    sw = GroundTruth().surroundings
    decided = sorted({rc.decided_s for rc in rcs})
    for t in decided:
        batch = [rc for rc in rcs if rc.decided_s == t]
        gpus = [g for rc in batch for w in rc.sources for g in worker_gpus(w)]
        assert len(gpus) == len(set(gpus)), "two operations of one plan share a GPU"
        for rc in batch:
            assert rc.exposed_s >= 0 and rc.drained_s >= rc.decided_s
            assert sw.switch_min_s - 1e-9 <= rc.switch_s <= sw.switch_max_s + 1e-9
        # The next plan is decided only after every operation of this one was exposed.
        later = [u for u in decided if u > t]
        if later:
            assert later[0] >= max(rc.exposed_s for rc in batch)


def test_timeline_tiles_the_pool_after_every_exposure(multi_run) -> None:
    tl = multi_run.composition_timeline
    assert multi_run.reconfigurations, "no reconfiguration: the timeline never changes"
    assert len(tl) == 1 + sum(rc.exposed_s >= 0 for rc in multi_run.reconfigurations)
    for _, counts in tl:
        assert degree_counts_cover(counts) == GPUS


def test_no_request_starts_on_a_reconfiguring_worker_and_none_is_lost(
    multi_run, phased_workload
) -> None:
    check_records(multi_run, phased_workload, gpus=GPUS)
    assert multi_run.reconfigurations, "no reconfiguration: no worker was ever a source"
    for rec in multi_run.records:
        for rc in multi_run.reconfigurations:
            if rec.worker in rc.sources:
                # Nothing starts on a source between its plan's decision and its exposure.
                assert not (rc.decided_s < rec.start_s < rc.exposed_s), (rec, rc)
