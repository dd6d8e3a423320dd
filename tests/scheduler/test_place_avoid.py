"""SchedulerCore.place's ``avoid``: the workers a request may not go to on this call (they
refused it, or handed it back: the scheduler service's retry steering).

An avoided worker is excluded from the candidates only. It still holds its cache and the cache
manager still copies from it (only an UNAVAILABLE holder is no copy source, placement.py
"Pull credit"), so J's pull credit must still count on a copy from it. Before, ``avoid`` made
the worker UNAVAILABLE in the policy's view, which also removed it as a copy source: a request
refused by (or handed back from) the worker holding its prefix -- its affinity worker, the
usual case -- was priced on every other worker as a full recompute, with no pull counted on,
although the route-time pull copies that prefix from the avoided worker all the same."""

from __future__ import annotations

import pytest
from sched_support import ROUND, req, view

from services.scheduler import SchedulerCore, WorkerView, make_policy
from services.scheduler.errors import NoEligibleWorker
from services.scheduler.placement import PullCredit
from shared.ids import WorkerId
from shared.worker import Lifecycle

W = WorkerId
CREDIT = PullCredit(min_blocks=2, max_blocks=64, wait=True)  # an idle worker is credited


def core() -> SchedulerCore:
    pol = make_policy("vertumnus", profile=ROUND, beta=1.5, lam=0.5).with_pull(CREDIT)
    return SchedulerCore(pol, view(WorkerView(W("a"), 4), WorkerView(W("b"), 4)))


def test_an_avoided_holder_is_still_the_source_of_the_pull_credit() -> None:
    c = core()
    d = c.place(req("r", 1000), {W("a"): 8}, 0.0, avoid={W("a")})
    assert d.worker == "b"
    # b is priced with the 8 blocks the route-time pull copies from a, as it would be were a
    # draining (no candidate, still a source).
    assert (d.pulled_blocks, d.prefix_tokens) == (8, 800), d.explain()
    draining = SchedulerCore(
        make_policy("vertumnus", profile=ROUND, beta=1.5, lam=0.5).with_pull(CREDIT),
        view(WorkerView(W("a"), 4, lifecycle=Lifecycle.DRAINING), WorkerView(W("b"), 4)))
    same = draining.place(req("r", 1000), {W("a"): 8}, 0.0)
    assert d.predicted_s == pytest.approx(same.predicted_s, rel=1e-12)
    # What was reserved on b is the credited prediction, not a full recompute.
    assert c.load(W("b")).snapshot(0.0).queue_delay_s == pytest.approx(same.predicted_s, rel=1e-12)


def test_avoid_excludes_the_worker_and_refuses_when_no_other_is_eligible() -> None:
    c = core()
    with pytest.raises(NoEligibleWorker):
        c.place(req("r", 1000), {}, 0.0, avoid={W("a"), W("b")})
    assert not c._where  # a refused call reserves nothing
    d = c.place(req("r", 1000), {W("a"): 8}, 0.0, avoid={W("a")})
    assert d.worker == "b" and d.candidate(W("a")).excluded is not None
