"""A request longer than every worker's ``max_seq_len`` is refused by the core, not held.

The core (:meth:`SchedulerCore.place`) raises :class:`SequenceTooLong` — a
:class:`NoEligibleWorker` that will not pass — only when the length exceeds the limit of
*every* worker of the view, whatever its lifecycle (a draining, switching or unavailable worker
may serve again). Everything transient stays a plain NoEligibleWorker: no worker in the view
yet, every fitting worker not ACTIVE, or the request's KV larger than every worker's capacity
(which differs by degree and changes with a split or merge).
"""

from __future__ import annotations

import random

import pytest
from sched_support import ROUND, req, view

from services.scheduler import (
    Exclusion,
    NoEligibleWorker,
    SchedulerCore,
    SequenceTooLong,
    WorkerView,
    make_policy,
    policy_names,
)
from services.scheduler.eligibility import exclusion, longest_max_seq_len, sequence_too_long
from services.scheduler.errors import UnknownRequest
from services.scheduler.service import worker_view
from services.scheduler.view import UNLIMITED, ClusterView
from shared.ids import RequestId, WorkerId
from shared.schemas import WorkerState
from shared.worker import Lifecycle

W = WorkerId


def core_for(*workers: WorkerView, policy: str = "vertumnus") -> SchedulerCore:
    return SchedulerCore(make_policy(policy, profile=ROUND, rng=random.Random(0)),
                         view(*workers))


@pytest.mark.parametrize("policy", sorted(policy_names()))
def test_longer_than_every_worker_is_refused_and_reserves_nothing(policy: str) -> None:
    core = core_for(
        WorkerView(W("a"), 2, max_seq_len=1000),
        WorkerView(W("b"), 4, max_seq_len=2000),
        WorkerView(W("c"), 4, max_seq_len=1500, lifecycle=Lifecycle.DRAINING),
        policy=policy,
    )
    with pytest.raises(SequenceTooLong) as ei:
        core.place(req("long", 2001), {}, 0.0)
    exc = ei.value
    assert isinstance(exc, NoEligibleWorker)  # callers that only know that one still work
    assert (exc.request_id, exc.length, exc.max_seq_len) == ("long", 2001, 2000)
    assert str(exc) == ("prompt of 2001 tokens is longer than every worker's max_seq_len "
                        "(2000 at most)")
    assert exc.reasons == {w: str(Exclusion.TOO_LONG) for w in ("a", "b", "c")}
    # Nothing reserved or remembered: the same id places once it fits.
    assert all(len(ld) == 0 for ld in core.loads.values())
    with pytest.raises(UnknownRequest):
        core.worker_of(RequestId("long"))
    # The limit is inclusive, and a request the largest limit admits is placed as before.
    d = core.place(req("long", 2000), {}, 0.0)
    assert d.worker == "b"


@pytest.mark.parametrize("lifecycle", [Lifecycle.DRAINING, Lifecycle.SWITCHING,
                                       Lifecycle.UNAVAILABLE])
def test_a_worker_that_may_come_back_keeps_the_request_transient(lifecycle: Lifecycle) -> None:
    """The one worker long enough is not ACTIVE now: no eligible worker, but not a refusal."""
    core = core_for(WorkerView(W("a"), 2, max_seq_len=1000),
                    WorkerView(W("b"), 4, lifecycle=lifecycle))
    with pytest.raises(NoEligibleWorker) as ei:
        core.place(req("r", 5000), {}, 0.0)
    assert not isinstance(ei.value, SequenceTooLong)
    assert ei.value.reasons == {"a": str(Exclusion.TOO_LONG), "b": str(lifecycle)}


def test_kv_capacity_is_never_a_refusal() -> None:
    """Every worker's KV is too small for the request: transient (a merge may make a bigger
    worker), so a plain NoEligibleWorker even though every limit is exceeded."""
    core = core_for(WorkerView(W("a"), 2, kv_capacity_tokens=800),
                    WorkerView(W("b"), 4, kv_capacity_tokens=1600))
    with pytest.raises(NoEligibleWorker) as ei:
        core.place(req("r", 2000), {}, 0.0)
    assert not isinstance(ei.value, SequenceTooLong)
    assert set(ei.value.reasons.values()) == {str(Exclusion.NO_MEMORY)}


def test_an_empty_view_refuses_nothing() -> None:
    """No worker known yet (a scheduler that just started): the workers to come may take it."""
    core = core_for()
    with pytest.raises(NoEligibleWorker) as ei:
        core.place(req("r", 10**9), {}, 0.0)
    assert not isinstance(ei.value, SequenceTooLong)
    assert ei.value.reasons == {}


def test_the_bound_follows_the_view() -> None:
    core = core_for()
    core.set_view(view(WorkerView(W("a"), 2, max_seq_len=1000)))
    with pytest.raises(SequenceTooLong):
        core.place(req("r", 1500), {}, 0.0)
    # A worker with a longer limit joins (any lifecycle counts): no longer a refusal.
    core.set_view(view(WorkerView(W("a"), 2, max_seq_len=1000),
                       WorkerView(W("b"), 4, max_seq_len=4000, lifecycle=Lifecycle.SWITCHING)))
    with pytest.raises(NoEligibleWorker) as ei:
        core.place(req("r", 1500), {}, 0.0)
    assert not isinstance(ei.value, SequenceTooLong)
    core.set_view(view(WorkerView(W("a"), 2, max_seq_len=1000),
                       WorkerView(W("b"), 4, max_seq_len=4000)))
    assert core.place(req("r", 1500), {}, 0.0).worker == "b"
    # It leaves again: the bound drops back (its tracker stays while "r" runs there).
    core.set_view(view(WorkerView(W("a"), 2, max_seq_len=1000)))
    with pytest.raises(SequenceTooLong):
        core.place(req("r2", 1500), {}, 0.0)


def test_pure_helpers() -> None:
    v = view(WorkerView(W("a"), 2, max_seq_len=1000),
             WorkerView(W("b"), 4, max_seq_len=3000, lifecycle=Lifecycle.UNAVAILABLE))
    assert longest_max_seq_len(v) == 3000
    assert longest_max_seq_len(view()) is None
    assert sequence_too_long(req("r", 3000), v) is None
    assert sequence_too_long(req("r", 10**6), view()) is None
    refused = sequence_too_long(req("r", 3001), v)
    assert isinstance(refused, SequenceTooLong) and refused.max_seq_len == 3000
    # A bound the caller kept is used as given (the core keeps one per view).
    kept = sequence_too_long(req("r", 1200), v, 1000)
    assert kept is not None and kept.max_seq_len == 1000


# -- the workers' own limits (WorkerState.max_seq_len) ----------------------------------------


def state(wid: str, degree: int, first_gpu: int, limit: int | None) -> WorkerState:
    return WorkerState(worker_id=wid, degree=degree,
                       gpus=list(range(first_gpu, first_gpu + degree)), epoch=0,
                       lifecycle=Lifecycle.ACTIVE, queue_len=0, outstanding_s=0.0,
                       kv_free_blocks=4096, kv_total_blocks=4096, max_seq_len=limit,
                       heartbeat_s=100.0)


def views(*states: WorkerState, setting: int = UNLIMITED) -> ClusterView:
    return view(*(worker_view(s, now=100.0, lease_s=10.0, block_size=16, max_seq_len=setting)
                  for s in states))


def test_worker_view_takes_the_smaller_of_the_setting_and_the_published_limit() -> None:
    """The scheduler's setting is a ceiling for the whole pool; a worker that publishes a
    lower limit (its engine's positions) gets that one; None (a worker that does not know,
    or an older rank daemon) keeps the setting."""
    def limit(published: int | None, setting: int) -> int:
        return views(state("w-cp2-g0", 2, 0, published), setting=setting).workers[0].max_seq_len

    assert limit(512, UNLIMITED) == 512
    assert limit(512, 1000) == 512
    assert limit(5000, 1000) == 1000
    assert limit(None, 1000) == 1000
    assert limit(None, UNLIMITED) == UNLIMITED


@pytest.mark.parametrize("policy", sorted(policy_names()))
def test_published_limits_route_refuse_and_bound(policy: str) -> None:
    """Workers with different published limits: a prompt that fits only the longer one goes
    there (the shorter is excluded as TOO_LONG), one longer than both is refused at once
    naming the largest published limit, though the scheduler's own setting is unlimited."""
    v = views(state("w-cp2-g0", 2, 0, 1000), state("w-cp4-g4", 4, 4, 3000))
    assert longest_max_seq_len(v) == 3000
    core = core_for(*v.workers, policy=policy)
    assert exclusion(v.workers[0], 2000) is Exclusion.TOO_LONG
    assert exclusion(v.workers[1], 2000) is None
    for i in range(5):  # every policy, whatever its tie-breaking or randomness
        assert core.place(req(f"fits-b-{i}", 2000), {}, 0.0).worker == "w-cp4-g4"
    with pytest.raises(SequenceTooLong) as ei:
        core.place(req("too-long", 3001), {}, 0.0)
    assert ei.value.max_seq_len == 3000
