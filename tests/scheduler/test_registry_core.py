"""Registry lookups and the SchedulerCore bookkeeping (drain/redirect, view changes)."""

from __future__ import annotations

import random

import pytest
from sched_support import ROUND, req, view

from services.scheduler import (
    DuplicateRequest,
    NoEligibleWorker,
    Policy,
    SchedulerCore,
    UnknownPolicy,
    WorkerView,
    make_policy,
    policy_names,
    register_policy,
)
from services.scheduler.policies.vertumnus import JPolicy
from services.scheduler.registry import unregister_policy
from shared.ids import InvalidInput, RequestId, WorkerId
from shared.worker import Lifecycle

W = WorkerId

BASELINES = {
    "vertumnus",
    "homo",
    "homo_cp2",
    "static",
    "vllm",
    "sglang",
    "dynamo",
    "llmd",
    "round_robin",
}


def test_registry_has_every_policy_and_builds_them() -> None:
    assert BASELINES <= set(policy_names())
    for name in BASELINES:
        pol = make_policy(name, profile=ROUND, rng=random.Random(0))
        assert isinstance(pol, Policy)
        assert pol.name == name


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(UnknownPolicy) as ei:
        make_policy("least_work")
    msg = str(ei.value)
    assert "least_work" in msg and "vertumnus" in msg and "sglang" in msg
    assert isinstance(ei.value, InvalidInput)


def test_bad_params_are_typed_errors() -> None:
    with pytest.raises(InvalidInput, match="no parameter"):
        make_policy("vllm", beta=2.0)
    with pytest.raises(InvalidInput):
        make_policy("sglang", cache_threshold=1.5)
    with pytest.raises(InvalidInput):
        make_policy("vertumnus", profile="not a profile")  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        make_policy("dynamo", rng=42)  # type: ignore[arg-type]


def test_params_reach_the_policy() -> None:
    pol = make_policy("vertumnus", beta=2.0, lam=0.25)
    assert isinstance(pol, JPolicy) and (pol.beta, pol.lam) == (2.0, 0.25)
    assert make_policy("static", threshold_tokens=4096).threshold_tokens == 4096  # type: ignore[attr-defined]


def test_register_a_custom_policy() -> None:
    @register_policy("test_only_first")
    class First:
        def __init__(self, *, profile=ROUND, rng=None) -> None:
            self._inner = JPolicy(profile=profile, name="test_only_first")

        @property
        def name(self) -> str:
            return "test_only_first"

        def place(self, request, view, held_blocks, loads, now):
            return self._inner.place(request, view, held_blocks, loads, now)

        def on_finish(self, request_id, worker, now) -> None:
            return None

    try:
        assert "test_only_first" in policy_names()
        assert make_policy("test_only_first").name == "test_only_first"
        with pytest.raises(InvalidInput):
            register_policy("test_only_first")(JPolicy)  # a different factory under a taken name
    finally:
        unregister_policy("test_only_first")
    assert "test_only_first" not in policy_names()
    with pytest.raises(UnknownPolicy):
        unregister_policy("test_only_first")
    with pytest.raises(InvalidInput):
        register_policy("bad name!")


def test_drain_redirects_queued_requests_and_keeps_running_one() -> None:
    v = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4))
    core = SchedulerCore(make_policy("round_robin", profile=ROUND), v)
    for k in range(4):
        core.place(req(f"r{k}", 500), {}, 0.0)  # a, b, a, b
    core.start(RequestId("r0"), 0.0)
    queued = core.drain(W("a"))
    assert [r.request_id for r in queued] == ["r2"]
    assert core.load(W("a")).unfinished == 1  # r0 keeps running
    core.set_view(view(WorkerView(W("a"), 4, lifecycle=Lifecycle.DRAINING), WorkerView(W("b"), 4)))
    for r in queued:
        assert core.place(r, {}, 0.1).worker == "b"
    # split: a leaves the view while r0 still runs; its tracker stays until r0 finishes
    core.set_view(view(WorkerView(W("b"), 4), WorkerView(W("c"), 2), WorkerView(W("d"), 2)))
    assert W("a") in core.loads
    core.finish(RequestId("r0"), 1.0)
    assert W("a") not in core.loads
    assert set(core.loads) == {"b", "c", "d"}


def test_duplicate_placement_rejected() -> None:
    v = view(WorkerView(W("a"), 4))
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND), v)
    core.place(req("r", 500), {}, 0.0)
    with pytest.raises(DuplicateRequest):
        core.place(req("r", 500), {}, 0.0)
    assert core.load(W("a")).unfinished == 1


def test_policy_durations_are_the_periods_in_seconds() -> None:
    from services.scheduler.errors import UnknownPolicy
    from services.scheduler.registry import policy_durations

    assert policy_durations("vllm") == {"refresh_period_s": 0.1}
    assert policy_durations("sglang") == {"eviction_interval_s": 30.0}
    assert policy_durations("vertumnus") == {} and policy_durations("round_robin") == {}
    with pytest.raises(UnknownPolicy):
        policy_durations("nope")


def test_adopt_reserves_a_request_placed_by_an_earlier_process() -> None:
    v = view(WorkerView(W("a"), 4), WorkerView(W("b"), 4))
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND), v)
    assert core.adopt(req("x", 500), W("a"), 2.0, 10.0) is True
    assert core.worker_of(RequestId("x")) == "a"
    assert core.load(W("a")).queue_delay(10.0) == pytest.approx(2.0)
    assert core.load(W("a")).unfinished == 1
    # the adopted work is load: a new request goes to the idle worker
    assert core.place(req("y", 500, first=100), {}, 10.0).worker == "b"
    assert core.adopt(req("x", 500), W("b"), 2.0, 10.0) is False  # placed here already
    assert core.worker_of(RequestId("x")) == "a"
    core.finish(RequestId("x"), 11.0)
    assert core.load(W("a")).unfinished == 0


def test_adopt_a_running_request_and_refusals() -> None:
    v = view(WorkerView(W("a"), 4))
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND), v)
    assert core.adopt(req("x", 500), W("a"), 2.0, 10.0, running=True)
    # running since the adoption: what is left of its predicted time
    assert core.load(W("a")).queue_delay(11.0) == pytest.approx(1.0)
    from shared.ids import UnknownWorker
    with pytest.raises(UnknownWorker):
        core.adopt(req("z", 500), W("nope"), 1.0, 10.0)
    with pytest.raises(InvalidInput):
        core.adopt(req("z", 500), W("a"), -1.0, 10.0)
    with pytest.raises(InvalidInput):
        core.adopt("z", W("a"), 1.0, 10.0)  # type: ignore[arg-type]
    assert core.load(W("a")).unfinished == 1  # the refusals changed nothing


# --- fixed cases found by tests/scheduler/test_core_state_machine.py ----------------------


def test_place_rejects_a_non_request_while_requests_are_in_flight() -> None:
    """InvalidInput, as with nothing in flight (it was an AttributeError from the foreign /
    in-flight steps, which read the request before the policy checked it)."""
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND), view(WorkerView(W("a"), 4)))
    core.place(req("r", 500), {}, 0.0)
    with pytest.raises(InvalidInput):
        core.place("x", {}, 0.0)  # type: ignore[arg-type]
    core.note_foreign(req("f", 500, first=50), W("a"), 0.0)
    with pytest.raises(InvalidInput):
        core.place(None, {}, 0.0)  # type: ignore[arg-type]
    assert core.load(W("a")).unfinished == 1 and core.foreign_requests == 1


def test_a_refused_placement_of_a_handed_back_request_keeps_its_foreign_entry() -> None:
    """Another replica's request comes back and cannot be placed now (nothing eligible, or a
    bad cache match): the call changes nothing, so its prefix still counts in flight on the
    worker it was noted on (it was forgotten before the policy refused)."""
    a, b = WorkerView(W("a"), 4), WorkerView(W("b"), 4)
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND), view(a, b))
    core.note_foreign(req("f", 500), W("a"), 0.0)
    core.set_view(view(WorkerView(W("a"), 4, lifecycle=Lifecycle.DRAINING),
                       WorkerView(W("b"), 4, lifecycle=Lifecycle.DRAINING)))
    with pytest.raises(NoEligibleWorker):
        core.place(req("f", 500), {}, 1.0)
    core.set_view(view(a, b))
    with pytest.raises(InvalidInput):
        core.place(req("f", 500), {W("b"): -1}, 1.0)
    assert core.foreign_requests == 1
    d = core.place(req("g", 500), {}, 1.0)  # shares f's five blocks: P = L - 1 on a
    assert d.candidate(W("a")).prefix_tokens == 499
    assert d.candidate(W("b")).prefix_tokens == 0


def test_a_bad_cache_match_is_refused_even_where_a_prefix_is_in_flight() -> None:
    """A count that is not an integer >= 0 is InvalidInput (policy.py); a longer in-flight
    prefix on the same worker replaced it before the policy saw it (accepted), and a
    non-number failed the comparison with a TypeError."""
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND), view(WorkerView(W("a"), 4)))
    core.place(req("r", 500), {}, 0.0)
    for bad in (-1, 1.5, "2", None):
        with pytest.raises(InvalidInput):
            core.place(req("s", 500), {W("a"): bad}, 0.0)  # type: ignore[dict-item]
    assert core.load(W("a")).unfinished == 1


def test_a_refused_adopt_keeps_the_foreign_entry() -> None:
    """adopt() with a bad argument is InvalidInput (None was a TypeError) and changes
    nothing: another replica's entry for the request stays (it was forgotten first)."""
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND), view(WorkerView(W("a"), 4)))
    core.note_foreign(req("f", 500), W("a"), 0.0)
    for kwargs in ({"predicted_s": -1.0}, {"predicted_s": None}, {"now": float("nan")},
                   {"uncached_tokens": -1}):
        args = {"predicted_s": 1.0, "now": 0.0} | kwargs
        with pytest.raises(InvalidInput):
            core.adopt(req("f", 500), W("a"), **args)  # type: ignore[arg-type]
        assert core.foreign_requests == 1
    assert core.load(W("a")).unfinished == 0
    assert core.adopt(req("f", 500), W("a"), 1, 0) is True  # ints are seconds too
    assert core.foreign_requests == 0 and core.load(W("a")).queue_delay(0.0) == 1.0


def test_draining_a_worker_that_left_the_view_drops_its_emptied_tracker() -> None:
    """A worker outside the view keeps its tracker only while it holds a request (set_view,
    finish); a drain that withdraws the last one ends it too (it stayed, empty)."""
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND), view(WorkerView(W("a"), 4)))
    core.place(req("r", 500), {}, 0.0)
    core.set_view(view(WorkerView(W("b"), 4)))
    assert W("a") in core.loads
    assert [r.request_id for r in core.drain(W("a"))] == ["r"]
    assert set(core.loads) == {"b"}


def test_a_view_with_another_block_size_is_refused_while_requests_are_in_flight() -> None:
    """In-flight prefixes are counted and released in blocks of the view's size: a view that
    changes it then is InvalidInput and changes nothing; with nothing in flight it is fine."""
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND), view(WorkerView(W("a"), 4)))
    core.place(req("r", 500), {}, 0.0)
    other = view(WorkerView(W("a"), 4), block_size=core.view.block_size * 2)
    with pytest.raises(InvalidInput):
        core.set_view(other)
    assert core.view.block_size != other.block_size
    core.finish("r", 1.0)
    core.set_view(other)
    assert core.view.block_size == other.block_size


def test_expire_foreign_refuses_a_time_that_is_not_a_number() -> None:
    core = SchedulerCore(make_policy("vertumnus", profile=ROUND), view(WorkerView(W("a"), 4)))
    core.note_foreign(req("f", 500), W("a"), 0.0)
    for bad in (None, "1", float("nan"), True):
        with pytest.raises(InvalidInput):
            core.expire_foreign(bad)  # type: ignore[arg-type]
    assert core.foreign_requests == 1
    assert core.expire_foreign(1.0) == 1 and core.foreign_requests == 0
