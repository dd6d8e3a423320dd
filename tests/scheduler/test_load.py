"""WorkerLoad: q_w bookkeeping (§5.3), running-request progress, typed errors, invariants."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler import DuplicateRequest, IllegalTransition, UnknownRequest, WorkerLoad
from shared.ids import InvalidInput, RequestId, VertumnusError, WorkerId

R = RequestId
W = WorkerId


def test_reserve_start_finish_queue_delay() -> None:
    ld = WorkerLoad(WorkerId("w"))
    ld.reserve(R("a"), 2.0, tokens=1000, uncached_tokens=400, blocks=10)
    ld.reserve(R("b"), 1.0, tokens=500, uncached_tokens=500, blocks=5)
    assert ld.queue_delay(0.0) == pytest.approx(3.0)
    assert (ld.waiting, ld.running, ld.unfinished) == (2, 0, 2)
    assert (ld.inflight_tokens, ld.inflight_uncached_tokens, ld.inflight_blocks) == (1500, 900, 15)
    ld.start(R("a"), 10.0)
    # running request counts its prediction minus elapsed time
    assert ld.queue_delay(10.0) == pytest.approx(3.0)
    assert ld.queue_delay(10.5) == pytest.approx(1.5 + 1.0)
    assert ld.queue_delay(11.9) == pytest.approx(0.1 + 1.0)
    # overrun: not below the floor (0 by default)
    assert ld.queue_delay(20.0) == pytest.approx(1.0)
    assert (ld.waiting, ld.running) == (1, 1)
    ld.finish(R("a"))
    assert ld.queue_delay(20.0) == pytest.approx(1.0)
    ld.finish(R("b"))
    assert ld.queue_delay(20.0) == 0.0
    assert (ld.inflight_tokens, ld.inflight_uncached_tokens, ld.inflight_blocks) == (0, 0, 0)


def test_overrun_floor() -> None:
    ld = WorkerLoad(WorkerId("w"), overrun_floor_s=0.05)
    ld.reserve(R("a"), 1.0)
    ld.start(R("a"), 0.0)
    assert ld.queue_delay(0.5) == pytest.approx(0.5)
    assert ld.queue_delay(3.0) == pytest.approx(0.05)


def _state(ld: WorkerLoad) -> tuple:
    return (ld.waiting, ld.running, ld.queue_delay(5.0), ld.inflight_tokens, ld.queued())


def test_a_scaled_clock_counts_elapsed_time_in_predicted_seconds() -> None:
    """time_scale 0.1 (vertumnus up's default: wall = modelled × 0.1): 0.05 clock seconds of
    running are 0.5 predicted seconds; J's inlined copy agrees (placement.place_j)."""
    from services.scheduler import ClusterView, RequestInfo, WorkerView, place_j
    from tests.scheduler.sched_support import ROUND

    ld = WorkerLoad(W("w"), time_scale=0.1)
    ld.reserve(R("a"), 1.0, now=0.0)
    ld.start(R("a"), 0.0)
    ld.reserve(R("b"), 2.0, now=0.0)
    assert ld.queue_delay(0.05) == pytest.approx(2.5)
    assert ld.queue_delay(0.2) == pytest.approx(2.0)  # overran: the floor (0)
    assert WorkerLoad(W("v")).queue_delay(0.0) == 0.0
    v = ClusterView((WorkerView(W("w"), 2),), block_size=100)
    d = place_j(RequestInfo(R("c"), 100), v, {}, {W("w"): ld}, 0.05, profile=ROUND, beta=1.0,
                lam=0.0)
    assert d.candidate(W("w")).q == pytest.approx(2.5)
    with pytest.raises(InvalidInput, match="time_scale"):
        WorkerLoad(W("x"), time_scale=0)


def test_other_replicas_work_adds_to_q_and_runs_down_with_the_clock() -> None:
    """Foreign work (other scheduler replicas', as the worker reported it at a time) is part
    of q_w, less the predicted seconds run since, never below 0; a new report replaces it.
    J's inlined copy agrees (placement.place_j), with a scaled clock too."""
    from services.scheduler import ClusterView, RequestInfo, WorkerView, place_j
    from tests.scheduler.sched_support import ROUND

    ld = WorkerLoad(W("w"))
    ld.reserve(R("a"), 1.0, now=0.0)
    assert ld.foreign_s == 0.0 and ld.queue_delay(3.0) == pytest.approx(1.0)
    ld.set_foreign(2.0, 10.0)
    assert ld.foreign_s == 2.0
    assert ld.queue_delay(10.0) == pytest.approx(3.0)
    assert ld.queue_delay(11.5) == pytest.approx(1.5)
    assert ld.queue_delay(13.0) == pytest.approx(1.0)  # run down: only our own work left
    ld.set_foreign(0.5, 13.0)
    assert ld.queue_delay(13.0) == pytest.approx(1.5)
    ld.set_foreign(0.0, 14.0)
    assert ld.queue_delay(14.0) == pytest.approx(1.0)

    scaled = WorkerLoad(W("w"), time_scale=0.1)
    scaled.set_foreign(2.0, 0.0)
    assert scaled.queue_delay(0.05) == pytest.approx(1.5)  # 0.05 clock s = 0.5 predicted s
    v = ClusterView((WorkerView(W("w"), 2),), block_size=100)
    d = place_j(RequestInfo(R("c"), 100), v, {}, {W("w"): scaled}, 0.05, profile=ROUND,
                beta=1.0, lam=0.0)
    assert d.candidate(W("w")).q == scaled.queue_delay(0.05)
    for bad in (-1.0, float("nan"), float("inf"), True, "2"):
        with pytest.raises(InvalidInput):
            ld.set_foreign(bad, 1.0)  # type: ignore[arg-type]
    with pytest.raises(InvalidInput):
        ld.set_foreign(1.0, float("nan"))
    assert ld.foreign_s == 0.0  # nothing changed by the refusals
    # A peer's placement adds to what is left of the last figure; a report replaces the sum.
    ld.set_foreign(2.0, 20.0)
    ld.add_foreign(1.5, 21.0)
    assert ld.foreign_s == pytest.approx(2.5) and ld.queue_delay(21.0) == pytest.approx(3.5)
    ld.add_foreign(0.5, 30.0)  # the rest had run down
    assert ld.foreign_s == pytest.approx(0.5)
    ld.set_foreign(0.25, 30.0)
    assert ld.foreign_s == 0.25
    with pytest.raises(InvalidInput):
        ld.add_foreign(-1.0, 31.0)
    assert ld.foreign_s == 0.25
    # Absurd but finite placements of peers saturate: q_w stays a finite number (JSON).
    ld.add_foreign(1e308, 31.0)
    ld.add_foreign(1e308, 31.0)
    assert math.isfinite(ld.foreign_s) and math.isfinite(ld.queue_delay(31.0))


def test_duplicate_reserve_and_unknown_ops_change_nothing() -> None:
    ld = WorkerLoad(WorkerId("w"))
    ld.reserve(R("a"), 1.0, tokens=10)
    before = _state(ld)
    with pytest.raises(DuplicateRequest):
        ld.reserve(R("a"), 5.0, tokens=99)
    with pytest.raises(UnknownRequest):
        ld.finish(R("zz"))
    with pytest.raises(UnknownRequest):
        ld.start(R("zz"), 1.0)
    with pytest.raises(InvalidInput):
        ld.reserve(R("b"), -1.0)
    with pytest.raises(InvalidInput):
        ld.reserve(R("b"), float("nan"))
    with pytest.raises(InvalidInput):
        ld.reserve(R("b"), 1.0, tokens=-3)
    with pytest.raises(InvalidInput):
        ld.start(R("a"), float("inf"))
    assert _state(ld) == before
    ld.start(R("a"), 1.0)
    with pytest.raises(IllegalTransition):
        ld.start(R("a"), 2.0)
    with pytest.raises(IllegalTransition):
        ld.withdraw(R("a"))
    assert ld.running == 1
    # every error is in the typed family
    assert issubclass(DuplicateRequest, VertumnusError)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"predicted_s": float("inf")},
        {"predicted_s": -0.5},
        {"predicted_s": True},
        {"now": float("nan")},
        {"now": float("-inf")},
        {"tokens": True},
        {"tokens": 1.0},
        {"uncached_tokens": -1},
        {"blocks": -2},
        {"request_id": ""},
        {"request_id": 7},
    ],
)
def test_reserve_rejects_each_bad_argument(kwargs: dict) -> None:
    # reserve() checks exact float / int types first (speed) and falls back to the full
    # validation for anything else: every bad value must still raise, with nothing changed.
    args = {"request_id": R("b"), "predicted_s": 1.0, "tokens": 10, "uncached_tokens": 5,
            "blocks": 1, "now": 0.0} | kwargs
    ld = WorkerLoad(WorkerId("w"))
    ld.reserve(R("a"), 1.0)
    before = _state(ld)
    rid, pred = args.pop("request_id"), args.pop("predicted_s")
    with pytest.raises(InvalidInput):
        ld.reserve(rid, pred, **args)
    assert _state(ld) == before


def test_reserve_accepts_ints_and_float_subclasses() -> None:
    class Seconds(float):
        pass

    ld = WorkerLoad(WorkerId("w"))
    ld.reserve(R("a"), 2, tokens=3, now=1)
    ld.reserve(R("b"), Seconds(0.5), now=Seconds(2.0))
    assert ld.queued_work_s == 2.5
    assert ld.assignment(R("b")).reserved_at == 2.0


def test_withdraw_queued_for_redirect() -> None:
    ld = WorkerLoad(WorkerId("w"))
    for i, s in enumerate([1.0, 2.0, 3.0]):
        ld.reserve(R(f"r{i}"), s)
    ld.start(R("r0"), 0.0)
    out = ld.withdraw_queued()
    assert [a.request_id for a in out] == ["r1", "r2"]
    assert (ld.waiting, ld.running) == (0, 1)
    assert ld.queue_delay(0.25) == pytest.approx(0.75)


ops = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "start", "finish", "withdraw"]),
        st.integers(0, 5),
        st.floats(0.0, 3.0, allow_nan=False),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops)
def test_queue_delay_matches_definition(seq: list[tuple[str, int, float]]) -> None:
    """q(now) = Σ waiting predictions + Σ running max(pred − elapsed, 0), whatever the history;
    each operation is accepted or refused (with its own error) exactly as the model says."""
    ld = WorkerLoad(WorkerId("w"))
    model: dict[str, list] = {}  # rid -> [pred, started_at]
    t = 0.0
    for op, k, x in seq:
        rid = R(f"r{k}")
        t += 0.1
        known = rid in model
        started = known and model[rid][1] is not None
        # The refusal the model expects (None: the operation must be accepted).
        err: type[VertumnusError] | None
        if op == "reserve":
            err = DuplicateRequest if known else None
        elif not known:
            err = UnknownRequest
        elif op == "start" and started or op == "withdraw" and started:
            err = IllegalTransition
        else:
            err = None
        if err is not None:
            with pytest.raises(err):
                getattr(ld, op)(rid, *((x,) if op == "reserve" else (t,) if op == "start" else ()))
        elif op == "reserve":
            ld.reserve(rid, x)
            model[rid] = [x, None]
        elif op == "start":
            ld.start(rid, t)
            model[rid][1] = t
        elif op == "finish":
            ld.finish(rid)
            del model[rid]
        else:
            ld.withdraw(rid)
            del model[rid]
        expect = sum(p if s is None else max(p - (t - s), 0.0) for p, s in model.values())
        assert ld.queue_delay(t) == pytest.approx(expect, abs=1e-9)
        assert ld.unfinished == len(model)
        assert ld.running == sum(1 for _, s in model.values() if s is not None)
