"""The simulator merges arrivals with its event heap (speed) in exactly the order one heap of
every event would give: a reference simulator that pushes every arrival on the heap, as the
simulator once did, must produce the same run -- also with arrivals tied with each other and
with window and scan times."""

from __future__ import annotations

import dataclasses
import heapq

import pytest
from simeng_support import CALM_THEN_HEAVY, result_signature, uniform

from sim.simulator import (
    _ARRIVE,
    _FINISH,
    _SCAN,
    _SWITCHED,
    _WINDOW,
    _XFER,
    ControllerConfig,
    ControllerCore,
    SimConfig,
    SimResult,
    Simulator,
    controller_profile,
)
from sim.workloads import Workload
from sim.workloads.synthetic import generate


class _Logged(Simulator):
    """Logs every event the loop hands on, in order (kind, simulated time, subject)."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.log: list[tuple[str, float, object]] = []

    def _arrive(self, req, now):  # type: ignore[override]
        self.log.append(("arrive", now, req.request_id))
        super()._arrive(req, now)

    def _finish(self, w, job, now):  # type: ignore[override]
        self.log.append(("finish", now, job.req.request_id))
        super()._finish(w, job, now)

    def _window(self, now):  # type: ignore[override]
        self.log.append(("window", now, None))
        super()._window(now)

    def _scan(self, now):  # type: ignore[override]
        self.log.append(("scan", now, None))
        super()._scan(now)

    def _transfer_done(self, act, now):  # type: ignore[override]
        self.log.append(("xfer", now, act.node_hash))
        super()._transfer_done(act, now)

    def _switched(self, rid, now):  # type: ignore[override]
        self.log.append(("switched", now, rid))
        super()._switched(rid, now)


class _OneHeapSimulator(_Logged):
    """The reference: every arrival is a heap event ordered by (time, push sequence)."""

    def _run(self, workload, composition, progress):  # type: ignore[override]
        for g in composition.groups:
            self._new_worker(g)
        self._rebuild_view()
        self._record_composition(0.0)
        if self.cfg.adaptive:
            cc = self.cfg.controller_config or ControllerConfig(window_s=self.cfg.window_s)
            self.ctl = ControllerCore(composition, controller_profile(self.profile,
                                                                     self.cfg.kappa_scale), cc)
            self._push(cc.window_s, _WINDOW)
        for req in workload.requests:
            self._push(req.arrival_s, _ARRIVE, req)
        if self.cfg.cache_manager:
            self._push(self.cfg.scan_interval_s, _SCAN)
        remaining = len(workload.requests)
        now = 0.0
        while self._heap:
            now, _, kind, a, b = heapq.heappop(self._heap)
            if kind == _FINISH:
                self._finish(a, b, now)
                remaining -= 1
            elif kind == _ARRIVE:
                self._arrive(a, now)
            elif kind == _WINDOW:
                if remaining > self._lost:
                    self._window(now)
                    assert self.ctl is not None
                    self._push(now + self.ctl.config.window_s, _WINDOW)
            elif kind == _SCAN:
                if remaining > self._lost:
                    self._scan(now)
                    self._push(now + self.cfg.scan_interval_s, _SCAN)
            elif kind == _XFER:
                self._transfer_done(a, now)
            elif kind == _SWITCHED:
                self._switched(a, now)
        return SimResult(self.cfg, workload.name, self.records, self.reconfigs, self.timeline,
                         self.gpu_seconds, self.replications, self.reclamations,
                         self.reconcile_transfers, now)


def _gridded(wl: Workload, step: float) -> Workload:
    """Arrivals rounded down to multiples of ``step``: many exact ties, some at window and
    scan boundaries (multiples of 20 s)."""
    reqs = tuple(dataclasses.replace(r, arrival_s=(r.arrival_s // step) * step)
                 for r in wl.requests)
    return Workload(wl.name, reqs, wl.block_size)


@pytest.mark.parametrize("step", [0.0, 2.5, 10.0])
@pytest.mark.parametrize("adaptive,cache_manager", [(True, True), (False, True), (True, False)])
def test_merged_arrivals_run_like_one_heap(profile, step, adaptive, cache_manager) -> None:
    wl = generate(CALM_THEN_HEAVY, seed=3)
    if step:
        wl = _gridded(wl, step)
    cfg = SimConfig(gpus=16, degrees=(2, 4), adaptive=adaptive, cache_manager=cache_manager,
                    seed=1, cache_blocks_per_gpu=64)
    comp = uniform(16, (2, 4), 2)
    ref_sim, sim = _OneHeapSimulator(cfg, profile), _Logged(cfg, profile)
    ref = ref_sim.run(wl, comp)
    got = sim.run(wl, comp)
    assert sim.log == ref_sim.log
    assert result_signature(got) == result_signature(ref)
    assert len(got.records) == len(wl.requests)


def test_requests_handled_in_arrival_order_with_ties(profile) -> None:
    wl = _gridded(generate(CALM_THEN_HEAVY, seed=4), 5.0)
    res = Simulator(SimConfig(gpus=16, degrees=(2, 4)), profile).run(wl, uniform(16, (2, 4), 4))
    # Records are appended as requests arrive: ties keep the workload's order.
    assert [r.request_id for r in res.records] == [r.request_id for r in wl.requests]
