"""The controller adapter's ``_done_unconfirmed`` (results of a draining source seen before it
showed it stopped admitting, by (reconfiguration, source)) goes with what it belongs to: the
source's wait for its stop, settled by its queue asked again *or* by an empty state under the
drain record, and the reconfiguration, committed or aborted. Before, only a queue asked again
took an entry out: a source settled by its empty state, or an operation aborted, left its
entries until some later confirmed drain swept them.

No NATS server: the bookkeeping is driven through the adapter's own methods on a real
ControllerCore; nothing here publishes (no commit is reached, no abort is written)."""

from __future__ import annotations

import time

from services.controller.core import ControllerCore
from services.controller.lattice import Composition, LatticeOp, OpKind
from services.controller.service import STOP_MARKER, ControllerService, ControllerSettings
from shared.ids import RequestId, WorkerId
from shared.schemas import WorkerState
from shared.worker import GpuGroup, Lifecycle

W0, W2 = WorkerId("w-cp2-g0"), WorkerId("w-cp2-g2")
STOP = RequestId(STOP_MARKER)


def draining_service() -> tuple[ControllerService, int]:
    """A controller whose core drains w-cp2-g0 (one request in flight) and w-cp2-g2 (idle)
    into w-cp4-g0, with the adapter's books as its tick leaves them (drain record epoch 1)."""
    svc = ControllerService(ControllerSettings(
        nats_url="nats://127.0.0.1:9", num_gpus=4, degrees=[2, 4], initial_composition="2CP2",
        kappa={2: 1.0, 4: 1.0}))
    comp = Composition.parse(svc.lattice, "2CP2")
    svc.core = ControllerCore(comp, svc.profile, svc.config, start_s=0.0, epoch=0,
                              acknowledged=True)
    op = LatticeOp(OpKind.MERGE, (GpuGroup(0, 2), GpuGroup(2, 2)), (GpuGroup(0, 4),))
    awaited = {W0: {RequestId("r1"), STOP}, W2: {STOP}}
    rid = svc.core.protocol.start(op, time.time(), in_flight=awaited).reconfiguration
    svc._awaiting[rid] = {w: set(a) for w, a in awaited.items()}
    svc._drain_epoch[rid] = 1
    return svc, rid


def empty_state(worker: str, gpus: list[int]) -> WorkerState:
    return WorkerState(worker_id=worker, degree=2, gpus=gpus, epoch=1,
                       lifecycle=Lifecycle.DRAINING, queue_len=0, outstanding_s=0.0,
                       kv_free_blocks=0, kv_total_blocks=0, heartbeat_s=time.time())


async def test_a_source_settled_by_its_empty_state_leaves_no_entry() -> None:
    svc, rid = draining_service()
    await svc._finished(W0, RequestId("r1"))  # its result, before it showed it stopped
    assert svc._done_unconfirmed == {(rid, W0): {RequestId("r1")}}
    await svc._state_drained(empty_state(W0, [0, 1]))
    assert svc._awaiting[rid] == {W0: set(), W2: {STOP}}  # W0 settled; W2 still drains
    assert svc._done_unconfirmed == {}


async def test_an_operation_that_ends_leaves_no_entry() -> None:
    svc, rid = draining_service()
    await svc._finished(W0, RequestId("r1"))
    await svc._finished(W2, RequestId("r9"))  # one that ran on W2 while it drained
    assert set(svc._done_unconfirmed) == {(rid, W0), (rid, W2)}
    svc._end_awaiting(rid)  # what its commit and every abort do
    assert rid not in svc._awaiting and svc._done_unconfirmed == {}
