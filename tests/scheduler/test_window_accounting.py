"""The scheduler's window accounting: D(k) by preferred degree, as the simulator counts it.

The scheduler service's pure parts only (no server): placements made by its core are
counted in its windows and closed into WindowReports (version 2). The breakdown by
preferred degree (§6.1 rule 1 on the fitted profile, with the cached part the chosen worker
reuses in whole blocks) must equal what the controller core computes from the same
placements when the simulator feeds it (``ControllerCore.assigned`` with
``min(reused_blocks·B, L − 1)`` cached tokens) — one definition on both paths.
"""

from __future__ import annotations

import pytest

from services.cachemgr.events import Stored
from services.controller.core import ControllerCore
from services.controller.lattice import Composition, Lattice
from services.controller.planner import ControllerConfig
from services.scheduler.service import SchedulerService, SchedulerSettings
from services.scheduler.view import ClusterView, WorkerView
from shared.costmodel import DEFAULT_PROFILE
from shared.ids import BlockHash, WorkerId
from shared.schemas import WINDOW_REPORT_VERSION, IntakeRequest, WindowReport, from_json, to_json

B = 512
H = 20.0
T0 = 1000 * H  # on the Unix-epoch grid the scheduler aligns its windows to


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def scheduler(clock: Clock, **kw) -> SchedulerService:
    st = SchedulerSettings(nats_url="nats://127.0.0.1:1", subject_prefix="vtm",
                           instance_id="sched-t", degrees=[2, 4], block_size=B, window_s=H,
                           policy="vertumnus", **kw)
    svc = SchedulerService(st, profile=DEFAULT_PROFILE, clock=clock)
    workers = (WorkerView(WorkerId("w-cp2-g0"), 2), WorkerView(WorkerId("w-cp4-g4"), 4))
    svc.core.set_view(ClusterView(workers, block_size=B))
    for w in workers:
        svc.trie.add_worker(w.worker_id, w.degree, 10_000)
    return svc


def intake(rid: str, length: int, first_hash: int) -> IntakeRequest:
    n = length // B
    return IntakeRequest(request_id=rid, input_len=length, block_size=B, arrival_s=T0,
                         block_hashes=[first_hash + k for k in range(n)])


def test_window_report_splits_demand_by_preferred_degree_as_the_simulator_does() -> None:
    clock = Clock(T0 + 1.0)
    svc = scheduler(clock)
    # 15 of the 16 blocks of "hot" are cached on the CP2 worker: a request that reuses them
    # recomputes 512 tokens and prefers CP2, though its length alone prefers CP4.
    svc.trie.apply(Stored(WorkerId("w-cp2-g0"), 1, None,
                          tuple(BlockHash(1_000 + k) for k in range(15))))
    lengths = {"short": (600, 10), "long": (64_000, 100), "hot": (8_192, 1_000),
               "mid": (16_000, 5_000)}
    ctl = ControllerCore(Composition.uniform(Lattice(8, [2, 4]), 2), DEFAULT_PROFILE,
                         ControllerConfig(window_s=H, merge_speedup=1.15), start_s=T0)
    placed = []
    for rid, (length, first) in lengths.items():
        req = intake(rid, length, first)
        _, d = svc._place(req, clock())
        placed.append((rid, d))
        assert svc.account(clock(), length, d) == []  # the window is still open
        ctl.assigned(clock(), d.predicted_s, length, d.degree,
                     min(d.reused_blocks * B, length - 1))
        clock.t += 0.5
    decisions = dict(placed)
    assert decisions["hot"].worker == "w-cp2-g0" and decisions["hot"].reused_blocks == 15
    assert svc.preferred_degree(600, decisions["short"]) == 2
    assert svc.preferred_degree(64_000, decisions["long"]) == 4
    assert svc.preferred_degree(8_192, decisions["hot"]) == 2  # by what it recomputes

    clock.t = T0 + H + 0.1
    (summary,) = svc.windows.advance(clock())
    report = svc.window_report(summary)
    assert report.schema_version == WINDOW_REPORT_VERSION == 2
    assert report.requests == 4
    assert report.preferred_speedup == 1.15 and report.preferred_degrees == [2, 4]
    # Preferred degrees by hand (rule 1 at speedup 1.15 on the default profile): short 2
    # (Ê_2/Ê_4 = 1.03 at 600 tokens), long 4 (1.52), hot 2 (1.05 for its 512 recomputed
    # tokens behind 7,680 cached), mid 4 (1.25 at 16,000 tokens, nothing cached).
    assert decisions["mid"].reused_blocks == 0
    by_hand = {"short": 2, "long": 4, "hot": 2, "mid": 4}
    assert {rid: svc.preferred_degree(lengths[rid][0], d) for rid, d in placed} == by_hand
    want: dict[int, float] = {}
    for rid, d in placed:
        want[by_hand[rid]] = want.get(by_hand[rid], 0.0) + d.predicted_s
    assert report.demand_by_preferred == pytest.approx(want)
    assert sum(report.demand_by_preferred.values()) == pytest.approx(report.demand_s)
    # The simulator's path (the controller core fed each placement) gives the same split.
    (ctl_window,) = ctl.windows.advance(T0 + H)
    assert dict(ctl_window.demand_by_preferred) == pytest.approx(report.demand_by_preferred)
    assert ctl_window.demand_s == pytest.approx(report.demand_s)
    assert from_json(WindowReport, to_json(report)) == report


def test_no_breakdown_without_the_rule() -> None:
    clock = Clock(T0 + 1.0)
    svc = scheduler(clock, merge_speedup=None)
    _, d = svc._place(intake("r", 64_000, 1), clock())
    assert svc.preferred_degree(64_000, d) is None
    svc.account(clock(), 64_000, d)
    (summary,) = svc.windows.advance(T0 + H)
    report = svc.window_report(summary)
    assert report.requests == 1 and report.demand_s == pytest.approx(d.predicted_s)
    assert report.demand_by_preferred == {} and report.preferred_speedup is None
    assert report.preferred_degrees == []
