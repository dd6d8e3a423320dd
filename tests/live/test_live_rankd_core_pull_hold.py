"""The rankd core (pure): the bound of :meth:`WorkerCore.pull_hold` -- counted from the job's
admission on the worker's own clock, and capped whatever the copy estimate says."""

from __future__ import annotations

import math

import pytest

from services.rankd.core import PULL_HOLD_MAX_COPY_S, WorkerCore
from shared.ids import InvalidInput
from shared.schemas import Assignment, IntakeRequest, ReplicateCommand

WID = "w-cp4-g4"


def pulled(rid: str, *, pull_copy_s: float, assigned_at_s: float = 11.0) -> Assignment:
    """An assignment priced with a route-time pull of its first three blocks (P = 768 of 1000
    tokens, blocks of 256) that has not landed: the cache has none of them."""
    return Assignment(
        request=IntakeRequest(request_id=rid, input_len=1000, arrival_s=10.0, block_size=256,
                              block_hashes=[1, 2, 3, 4]),
        worker_id=WID, epoch=0, degree=4, prefix_tokens=768, recompute_tokens=232,
        predicted_s=1.0, assigned_at_s=assigned_at_s, pull_copy_s=pull_copy_s,
    )


@pytest.mark.parametrize("skew_s", [30.0, -30.0])
def test_the_hold_counts_from_the_workers_admission_not_the_schedulers_clock(
        skew_s: float) -> None:
    """The scheduler's clock 30 s ahead of the worker's (or behind it): the head of the FIFO
    is held slack·pull_copy_s + grace from its admission here, as with clocks in step. Before,
    the hold ran from ``assigned_at_s``: 30 s ahead held the FIFO 30.5 s, 30 s behind not at
    all."""
    core = WorkerCore(WID, kv_total_blocks=8, pull_hold_grace_s=0.1)  # slack 2, time scale 1
    core.admit(pulled("a", pull_copy_s=0.25, assigned_at_s=100.0 + skew_s), 100.0)
    core.admit(pulled("b", pull_copy_s=0.0), 100.0)
    assert core.pull_hold(100.0) == pytest.approx(0.6)
    assert core.pull_hold(100.4) == pytest.approx(0.2)
    assert core.pull_hold(100.6) == 0.0
    job = core.start_next(100.6)
    assert job is not None and job.request_id == "a"


def test_a_huge_copy_estimate_holds_the_fifo_only_so_long() -> None:
    """``pull_copy_s`` = 1e12 (the schema takes any finite one): the head of the FIFO waits
    at most time_scale·slack·PULL_HOLD_MAX_COPY_S + grace, then starts (recomputing what did
    not come) and the request behind it follows. Before, the worker held it for ever while
    it stayed ACTIVE."""
    core = WorkerCore(WID, kv_total_blocks=8, time_scale=0.5, pull_hold_grace_s=0.05)
    core.admit(pulled("a", pull_copy_s=1e12), 11.0)
    core.admit(pulled("b", pull_copy_s=0.0), 11.0)
    bound = 0.5 * 2.0 * PULL_HOLD_MAX_COPY_S + 0.05
    assert core.pull_hold(11.0) == pytest.approx(bound)
    assert core.pull_hold(11.0 + bound) == 0.0
    first = core.start_next(11.0 + bound)
    assert first is not None and first.request_id == "a"
    assert first.executed is not None and first.executed.prefix_tokens == 0
    core.finish("a")
    assert core.pull_hold(11.0 + bound) == 0.0
    second = core.start_next(11.0 + bound)
    assert second is not None and second.request_id == "b"


def test_the_cap_is_the_workers_own_and_a_copy_below_it_is_waited_for_in_full() -> None:
    """``pull_hold_max_copy_s`` caps the estimate honoured; an estimate below the cap counts
    in full; a copy being executed still holds the request past the bound (``math.inf``), and
    its landing releases it."""
    core = WorkerCore(WID, kv_total_blocks=8, pull_hold_grace_s=0.0, pull_hold_max_copy_s=0.1)
    core.admit(pulled("a", pull_copy_s=5.0), 11.0)
    assert core.pull_hold(11.0) == pytest.approx(0.2)
    assert core.pull_hold(11.2, incoming={1}) == math.inf  # a copy of block 1 is arriving
    core.apply_command(ReplicateCommand(command_id="c1", worker_id=WID, epoch=0,
                                        blocks=[1, 2, 3], source_worker="w-cp4-g0"))
    assert core.pull_hold(11.2) == 0.0
    job = core.start_next(11.2)
    assert job is not None and job.executed is not None and job.executed.prefix_tokens == 768
    core.finish("a")
    wide = WorkerCore(WID, kv_total_blocks=8, pull_hold_grace_s=0.0)
    wide.admit(pulled("c", pull_copy_s=0.75), 11.0)
    assert wide.pull_hold(11.0) == pytest.approx(1.5)  # below the default cap: in full


def test_a_clock_stepped_back_does_not_lengthen_the_hold() -> None:
    """The worker's clock reads earlier than at the admission (stepped back): the hold is
    still at most its bound from now."""
    core = WorkerCore(WID, kv_total_blocks=8, pull_hold_grace_s=0.0)
    core.admit(pulled("a", pull_copy_s=0.25), 11.0)
    assert core.pull_hold(5.0) == pytest.approx(0.5)


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_a_bad_cap_is_refused(bad: float) -> None:
    with pytest.raises(InvalidInput, match="pull_hold_max_copy_s"):
        WorkerCore(WID, pull_hold_max_copy_s=bad)
