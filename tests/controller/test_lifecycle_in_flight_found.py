"""EpochProtocol.in_flight_found: requests found on a draining source after its drain started.

The controller asks a source's queue before its drain record exists; a request the source
started in between is found only once the source stopped admitting, and must be awaited like
the ones given to ``start`` (services/controller/service.py, step 3 "Stopped")."""

from __future__ import annotations

import pytest

from services.controller.lattice import Composition, Lattice, LatticeOp, OpKind
from services.controller.lifecycle import EpochProtocol, IllegalTransition, Phase
from shared.ids import InvalidInput, RequestId, WorkerId
from shared.worker import GpuGroup, Lifecycle

LAT = Lattice(16, {2, 4})
SPLIT_G8 = LatticeOp(OpKind.SPLIT, (GpuGroup(8, 4),), (GpuGroup(8, 2), GpuGroup(10, 2)))
SRC = WorkerId("w-cp4-g8")
STOP = RequestId("~until-stopped")


def _snapshot(p: EpochProtocol) -> tuple:
    return (p.epoch, p.workers(), p.history(), p.control_record())


def test_a_request_found_after_the_start_is_awaited_before_the_source_drains() -> None:
    p = EpochProtocol(Composition.uniform(LAT, 4))
    rid = p.start(SPLIT_G8, 1.0, in_flight={SRC: [STOP]}).reconfiguration
    p.in_flight_found(SRC, [RequestId("late")], 2.0)
    p.in_flight_found(SRC, [RequestId("late")], 2.0)  # already awaited: nothing more
    assert p.reconfiguration(rid).in_flight == {SRC: 2}
    assert p.finished(SRC, STOP, 3.0).drained_reconfiguration is None
    assert p.state(SRC) is Lifecycle.DRAINING
    prog = p.finished(SRC, RequestId("late"), 4.0)
    assert prog.drained_reconfiguration == rid
    assert p.reconfiguration(rid).phase is Phase.DRAINED
    assert p.reconfiguration(rid).drain_s == 3.0


def test_nothing_is_found_on_a_source_that_is_not_draining_and_nothing_changes() -> None:
    p = EpochProtocol(Composition.uniform(LAT, 4))
    with pytest.raises(IllegalTransition):  # not a source at all
        p.in_flight_found(SRC, [RequestId("x")], 1.0)
    rid = p.start(SPLIT_G8, 1.0, in_flight={SRC: [STOP]}).reconfiguration
    for bad in ("abc", b"abc", 7):
        before = _snapshot(p)
        with pytest.raises(InvalidInput):
            p.in_flight_found(SRC, bad, 2.0)  # type: ignore[arg-type]
        assert _snapshot(p) == before
    before = _snapshot(p)
    with pytest.raises(InvalidInput):  # time travel
        p.in_flight_found(SRC, [RequestId("x")], 0.5)
    assert _snapshot(p) == before
    p.finished(SRC, STOP, 2.0)  # parked: drained
    before = _snapshot(p)
    with pytest.raises(IllegalTransition):
        p.in_flight_found(SRC, [RequestId("x")], 3.0)
    assert _snapshot(p) == before
    p.abort(rid, 3.0)
    with pytest.raises(IllegalTransition):
        p.in_flight_found(SRC, [RequestId("x")], 4.0)
