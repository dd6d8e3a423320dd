"""A refusal carries its exclusions as data: :class:`NoEligibleWorker` has ``exclusions`` (the
distinct :class:`Exclusion` members, in the enum's order) and ``no_workers``;
:class:`SequenceTooLong` says ``too_long``. Its message stays word for word what it was (people
and logs read it), but no caller has to parse it: ``sim.metrics.failure_reason`` did, and a
reworded message turned into "other".
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
from shared.ids import RequestId, WorkerId
from shared.worker import Lifecycle

W = WorkerId


def core_for(*workers: WorkerView, policy: str) -> SchedulerCore:
    return SchedulerCore(make_policy(policy, profile=ROUND, rng=random.Random(0)),
                         view(*workers))


@pytest.mark.parametrize("policy", sorted(policy_names()))
def test_every_policy_refuses_with_its_exclusions_in_the_schedulers_order(policy: str) -> None:
    core = core_for(
        WorkerView(W("a"), 4, kv_capacity_tokens=800),
        WorkerView(W("b"), 2, max_seq_len=1000),
        WorkerView(W("c"), 4, lifecycle=Lifecycle.DRAINING),
        WorkerView(W("d"), 4, kv_capacity_tokens=900),
        policy=policy,
    )
    with pytest.raises(NoEligibleWorker) as ei:
        core.place(req("r", 2000), {}, 0.0)
    exc = ei.value
    assert not isinstance(exc, SequenceTooLong)
    assert exc.exclusions == (Exclusion.DRAINING, Exclusion.TOO_LONG, Exclusion.NO_MEMORY)
    assert exc.no_workers is False
    # The message and the text mapping are what they were.
    assert str(exc) == (
        "no eligible worker for request 'r' (a: request KV does not fit in worker's KV "
        "capacity; b: sequence longer than worker's max_seq_len; c: draining; d: request KV "
        "does not fit in worker's KV capacity)")
    assert exc.reasons == {"a": str(Exclusion.NO_MEMORY), "b": str(Exclusion.TOO_LONG),
                           "c": "draining", "d": str(Exclusion.NO_MEMORY)}
    assert all(type(r) is str for r in exc.reasons.values())  # plain text, as serialised


def test_an_empty_view_says_no_workers() -> None:
    core = core_for(policy="vertumnus")
    with pytest.raises(NoEligibleWorker) as ei:
        core.place(req("r", 100), {}, 0.0)
    assert (ei.value.no_workers, ei.value.exclusions) == (True, ())
    assert str(ei.value) == "no eligible worker for request 'r' (the cluster view has no workers)"


def test_a_request_too_long_for_every_worker_says_too_long() -> None:
    core = core_for(WorkerView(W("a"), 2, max_seq_len=1000),
                    WorkerView(W("b"), 4, max_seq_len=1500, lifecycle=Lifecycle.SWITCHING),
                    policy="vertumnus")
    with pytest.raises(SequenceTooLong) as ei:
        core.place(req("r", 2000), {}, 0.0)
    exc = ei.value
    assert (exc.exclusions, exc.no_workers) == ((Exclusion.TOO_LONG,), False)
    assert str(exc) == ("prompt of 2000 tokens is longer than every worker's max_seq_len "
                        "(1500 at most)")
    # Built by hand without workers (no caller does): still too long, not "no workers".
    bare = SequenceTooLong(RequestId("r"), 2000, 1500, {})
    assert (bare.exclusions, bare.no_workers) == ((Exclusion.TOO_LONG,), False)


def test_an_exclusions_text_is_the_exclusion_and_other_text_is_refused() -> None:
    """The reasons may be given as the members or their text (what callers passed before);
    a text that names no exclusion would be a reason no one can count, so it is an error."""
    by_text = NoEligibleWorker(RequestId("r"), {W("b"): "switching", W("a"): "unavailable"})
    by_member = NoEligibleWorker(RequestId("r"), {W("b"): Exclusion.SWITCHING,
                                                  W("a"): Exclusion.UNAVAILABLE})
    for exc in (by_text, by_member):
        assert exc.exclusions == (Exclusion.UNAVAILABLE, Exclusion.SWITCHING)
        assert str(exc) == "no eligible worker for request 'r' (a: unavailable; b: switching)"
    with pytest.raises(ValueError):
        NoEligibleWorker(RequestId("r"), {W("a"): "on fire"})
