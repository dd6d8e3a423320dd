"""DispatchLedger (services/scheduler/ledger.py): which dispatched requests a lost worker took."""

from __future__ import annotations

import json

import pytest

from services.scheduler.ledger import DispatchLedger, Loss, Sent
from shared.schemas import IntakeRequest, WorkerState
from shared.worker import Lifecycle

NOW = 1_000.0
LEASE = 10.0


def sent(rid: str, worker: str = "w-cp2-g0", inc: str = "a", seq: int = 1) -> Sent:
    req = IntakeRequest(request_id=rid, input_len=32, block_size=16, arrival_s=1.0)
    return Sent(rid, worker, inc, rid, seq, req, {})


def state(worker: str = "w-cp2-g0", inc: str = "a", age_s: float = 0.0) -> WorkerState:
    first = int(worker.rsplit("-g", 1)[1])
    return WorkerState(worker_id=worker, degree=2, gpus=[first, first + 1], epoch=0,
                       lifecycle=Lifecycle.ACTIVE, queue_len=0, outstanding_s=0.0,
                       kv_free_blocks=0, kv_total_blocks=0, incarnation=inc,
                       heartbeat_s=NOW - age_s)


def lost(ledger: DispatchLedger, states: dict[str, WorkerState], loaded: bool = True):
    return [(x.worker_id, x.loss, x.incarnation, [s.request_id for s in x.requests])
            for x in ledger.lost(states, now=NOW, lease_s=LEASE, loaded=loaded)]


def test_add_pop_and_replace() -> None:
    led = DispatchLedger()
    a = sent("x")
    led.add(a)
    assert "x" in led and led.get("x") is a and len(led) == 1
    b = sent("x", worker="w-cp2-g2")  # placed again elsewhere: replaces
    led.add(b)
    assert len(led) == 1 and led.get("x") is b
    assert lost(led, {}) == [("w-cp2-g2", Loss.SILENT, "", ["x"])]  # only the new worker
    assert led.pop("x") is b and led.pop("x") is None
    assert len(led) == 0 and lost(led, {}) == []


def test_a_message_other_than_the_dispatched_one_supersedes_it() -> None:
    led = DispatchLedger()
    led.add(sent("x", seq=4))
    assert led.supersede("x", 4) is None and "x" in led  # the same message: a redelivery
    assert led.supersede("x", 9) is not None and "x" not in led
    assert led.supersede("unknown", 1) is None


def test_the_oldest_is_forgotten_past_the_limit() -> None:
    led = DispatchLedger(limit=2)
    for rid in ("a", "b", "c"):
        led.add(sent(rid))
    assert [s.request_id for s in led] == ["b", "c"]
    with pytest.raises(ValueError):
        DispatchLedger(limit=0)


def test_a_live_worker_of_the_same_incarnation_loses_nothing() -> None:
    led = DispatchLedger()
    led.add(sent("x"))
    assert lost(led, {"w-cp2-g0": state(age_s=LEASE)}) == []  # exactly at the lease: alive


def test_a_restart_loses_only_what_the_retired_incarnation_admitted() -> None:
    led = DispatchLedger()
    led.add(sent("x", inc="a"))
    led.add(sent("y", inc="b"))  # admitted by the new one already
    led.add(sent("z", inc=""))  # an old rank daemon: cannot tell
    # A state naming another incarnation is not enough: "b"'s ack may come before its state.
    assert lost(led, {"w-cp2-g0": state(inc="a")}) == []
    led.retire("w-cp2-g0", "a")
    led.retire("w-cp2-g0", "")  # no incarnation: nothing to retire
    assert lost(led, {"w-cp2-g0": state(inc="b")}) == [
        ("w-cp2-g0", Loss.RESTARTED, "b", ["x"])]
    led.retire("w-cp2-g2", "a")  # another worker's "a" is not this one's
    assert lost(led, {"w-cp2-g0": state(inc="b")}) == [
        ("w-cp2-g0", Loss.RESTARTED, "b", ["x"])]
    led.adopted("x", "b")  # the new incarnation lists it (a re-send reached it)
    assert lost(led, {"w-cp2-g0": state(inc="b")}) == []


def test_a_silent_worker_lists_everything_it_holds() -> None:
    led = DispatchLedger()
    for rid, inc in (("y", "a"), ("x", "b"), ("z", "")):
        led.add(sent(rid, inc=inc))
    led.add(sent("q", worker="w-cp2-g2"))
    states = {"w-cp2-g0": state(age_s=LEASE + 0.1), "w-cp2-g2": state("w-cp2-g2")}
    assert lost(led, states) == [("w-cp2-g0", Loss.SILENT, "a", ["x", "y", "z"])]


def test_a_missing_state_counts_only_once_the_view_has_loaded() -> None:
    led = DispatchLedger()
    led.add(sent("x"))
    assert lost(led, {}, loaded=False) == []
    assert lost(led, {}, loaded=True) == [("w-cp2-g0", Loss.SILENT, "", ["x"])]


def test_a_queue_listing_names_the_attempts_a_worker_holds() -> None:
    """``listing_of`` / ``lists_attempt`` (the scheduler adapter's reading of a worker's
    queue report): an id listed with arrival stamps holds those attempts only; an id listed
    without (a worker that does not tell) holds every attempt; an id not listed, or no
    answer (None), holds none."""
    from services.scheduler.service import listing_of, lists_attempt
    from shared.schemas import QueueReport

    rep = QueueReport(worker_id="w-cp2-g0", in_flight=["a"], queued=["b", "c"],
                      arrivals=[[1.0, 1.5], [2.0], [3.0]])
    listing = listing_of(rep)
    assert listing == {"a": frozenset({1.0, 1.5}), "b": frozenset({2.0}), "c": frozenset({3.0})}
    assert lists_attempt(listing, "a", 1.5) and lists_attempt(listing, "b", 2.0)
    assert not lists_attempt(listing, "b", 2.5)  # another attempt of b: not held here
    assert not lists_attempt(listing, "d", 1.0) and not lists_attempt(None, "a", 1.0)
    # No stamps told (an empty list): each listed request holds every attempt.
    told_none = listing_of(QueueReport(worker_id="w-cp2-g0", in_flight=["a"], queued=["c"]))
    assert told_none == {"a": None, "c": None} and lists_attempt(told_none, "c", 99.0)


@pytest.mark.parametrize("arrivals", [[[1.0]], [[1.0], [2.0], [3.0]]])
def test_a_queue_report_whose_stamps_do_not_align_is_refused(arrivals: list) -> None:
    """``QueueReport.arrivals`` has one entry per listed request (in_flight then queued) or
    none; any other length is a SchemaError (a 400 at the endpoint, an unanswered report at
    the asker), not a listing that pairs stamps with the wrong ids."""
    from shared.schemas import QueueReport, SchemaError, decode, encode

    data, headers = encode(QueueReport(worker_id="w-cp2-g0", in_flight=["a"], queued=["b"]))
    body = json.loads(data) | {"arrivals": arrivals}
    with pytest.raises(SchemaError):
        decode(QueueReport, json.dumps(body).encode(), headers)
