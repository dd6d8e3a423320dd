"""The rankd core (pure): admission rules, FIFO, idempotence, epoch adoption, state."""

from __future__ import annotations

import pytest

from services.rankd.core import EpochAhead, NotAccepting, QueueFull, WorkerCore
from shared.ids import InvalidInput, UnknownWorker
from shared.schemas import (
    Assignment,
    EpochRecord,
    EpochWorker,
    IntakeRequest,
    ReclaimCommand,
    ReconcileCommand,
    ReplicateCommand,
)
from shared.worker import Lifecycle

WID = "w-cp4-g4"


def assignment(
    rid: str,
    *,
    worker: str = WID,
    epoch: int = 0,
    degree: int = 4,
    predicted: float = 1.0,
    length: int = 1000,
    prefix: int = 0,
    hashes: tuple[int, ...] = (),
) -> Assignment:
    return Assignment(
        request=IntakeRequest(
            request_id=rid,
            input_len=length,
            arrival_s=10.0,
            block_size=256,
            block_hashes=list(hashes),
        ),
        worker_id=worker,
        epoch=epoch,
        degree=degree,
        prefix_tokens=prefix,
        recompute_tokens=length - prefix,
        predicted_s=predicted,
        assigned_at_s=11.0,
    )


def record(epoch: int, lifecycle: Lifecycle | None) -> EpochRecord:
    workers = [EpochWorker(worker_id="w-cp4-g0", first_gpu=0, degree=4, lifecycle=Lifecycle.ACTIVE)]
    if lifecycle is not None:
        workers.append(EpochWorker(worker_id=WID, first_gpu=4, degree=4, lifecycle=lifecycle))
    return EpochRecord(epoch=epoch, workers=workers, committed_at_s=1.0)


def test_fifo_positions_and_idempotent_readmission() -> None:
    core = WorkerCore(WID, max_queue=3)
    assert [core.admit(assignment(r), 0.0) for r in ("a", "b", "c")] == [0, 1, 2]
    assert core.admit(assignment("b"), 0.0) == 1  # redelivery: same place, no duplicate
    with pytest.raises(QueueFull):
        core.admit(assignment("d"), 0.0)
    first = core.start_next(1.0)
    assert first is not None and first.request_id == "a"
    assert core.start_next(1.0) is None  # one at a time
    assert core.admit(assignment("a"), 2.0) == 0  # running: position 0
    assert core.admit(assignment("c"), 2.0) == 2
    core.finish("a")
    assert [core.start_next(3.0).request_id for _ in range(1)] == ["b"]  # type: ignore[union-attr]
    with pytest.raises(InvalidInput):
        core.finish("c")  # not running
    assert len(core) == 2


def test_refusals_change_nothing() -> None:
    core = WorkerCore(WID, epoch=3)
    with pytest.raises(UnknownWorker):
        core.admit(assignment("x", worker="w-cp4-g0"), 0.0)
    with pytest.raises(InvalidInput):
        core.admit(assignment("x", degree=2), 0.0)
    with pytest.raises(EpochAhead):
        core.admit(assignment("x", epoch=4), 0.0)
    assert core.admit(assignment("x", epoch=2), 0.0) == 0  # lagging scheduler view is fine
    core.set_lifecycle(Lifecycle.DRAINING)
    with pytest.raises(NotAccepting):
        core.admit(assignment("y", epoch=3), 0.0)
    assert len(core) == 0  # leaving ACTIVE handed "x" back


def test_epoch_adoption_and_redirects() -> None:
    core = WorkerCore(WID)
    for r in ("a", "b", "c"):
        core.admit(assignment(r), 0.0)
    core.start_next(0.0)
    adoption = core.adopt(record(1, Lifecycle.ACTIVE))
    assert adoption.adopted and adoption.member and adoption.redirected == ()
    assert not core.adopt(record(1, Lifecycle.DRAINING)).adopted  # not newer: ignored
    assert core.lifecycle is Lifecycle.ACTIVE
    adoption = core.adopt(record(2, Lifecycle.DRAINING))
    assert [j.request_id for j in adoption.redirected] == ["b", "c"]
    assert core.running is not None and core.running.request_id == "a"  # finishes in place
    gone = core.adopt(record(3, None))
    assert not gone.member and gone.lifecycle is Lifecycle.UNAVAILABLE and core.epoch == 3


def test_first_record_adopted_even_at_same_epoch() -> None:
    core = WorkerCore(WID, epoch=5)
    assert core.adopt(record(5, Lifecycle.SWITCHING)).adopted
    assert core.lifecycle is Lifecycle.SWITCHING


def test_state_and_outstanding() -> None:
    core = WorkerCore(WID, kv_total_blocks=100, time_scale=0.5)
    core.admit(assignment("a", predicted=2.0, prefix=512), 0.0)
    core.admit(assignment("b", predicted=3.0), 0.0)
    core.start_next(10.0)
    # a ran 0.5 wall s at scale 0.5 = 1 modelled s: 1 s of a left + 3 s of b
    assert core.outstanding_s(10.5) == pytest.approx(4.0)
    s1 = core.state(10.5)
    assert (s1.queue_len, s1.degree, s1.gpus, s1.kv_free_blocks) == (2, 4, [4, 5, 6, 7], 100)
    core.finish("a")
    s2 = core.state(11.0)
    assert s2.seq == s1.seq + 1 and s2.served == 1
    # the scheduler claimed P = 512 but this worker's cache was empty: P executed = 0
    assert (s2.hit_tokens, s2.input_tokens) == (0, 1000)


def test_bad_construction() -> None:
    with pytest.raises(InvalidInput):
        WorkerCore("worker-7")
    with pytest.raises(InvalidInput):
        WorkerCore(WID, max_queue=0)


def test_prefix_cache_decides_reuse_and_reports_events() -> None:
    core = WorkerCore(WID, kv_total_blocks=8)
    # 1000 tokens at B = 256: three full blocks (+ a partial one whose hash is ignored)
    core.admit(assignment("a", hashes=(1, 2, 3, 4), prefix=768), 0.0)
    job = core.start_next(0.0)
    assert job is not None and job.executed is not None
    assert (job.executed.prefix_tokens, job.executed.recompute_tokens) == (0, 1000)
    core.finish("a")
    (stored,) = core.take_cache_events()
    assert (stored.event_id, stored.parent_hash, stored.block_hashes) == (1, None, (1, 2, 3))

    core.admit(assignment("b", hashes=(1, 2, 9)), 1.0)
    job = core.start_next(1.0)
    assert job is not None and job.executed is not None
    assert (job.executed.prefix_tokens, job.executed.recompute_tokens) == (512, 488)
    assert core.state(1.0).kv_free_blocks == 6  # two blocks pinned while it runs
    core.finish("b")
    assert core.state(2.0).kv_free_blocks == 8
    (stored,) = core.take_cache_events()
    assert (stored.parent_hash, stored.block_hashes) == (2, (9,))
    assert core.hit_tokens == 512

    # a full-prefix hit still recomputes its last token
    core.admit(assignment("c", length=768, hashes=(1, 2, 3)), 3.0)
    job = core.start_next(3.0)
    assert job is not None and job.executed is not None
    assert (job.executed.prefix_tokens, job.executed.recompute_tokens) == (767, 1)
    core.finish("c", ok=False)
    assert core.take_cache_events() == []  # failed: nothing stored
    snap = core.cache_snapshot()
    assert sorted(snap.blocks) == [(1, None), (2, 1), (3, 2), (9, 2)]


def test_cache_commands() -> None:
    core = WorkerCore(WID, kv_total_blocks=8, epoch=2)
    rep = core.apply_command(
        ReplicateCommand(
            command_id="c1", worker_id=WID, epoch=2, blocks=[5, 6], source_worker="w-cp4-g0"
        )
    )
    assert rep.ok and rep.blocks_done == 2
    again = core.apply_command(
        ReplicateCommand(
            command_id="c2", worker_id=WID, epoch=1, blocks=[5, 6, 7], source_worker="w-cp4-g0"
        )
    )
    assert again.blocks_done == 3  # path length now cached; only 7 was new
    rec = core.apply_command(ReclaimCommand(command_id="c3", worker_id=WID, epoch=2, blocks=[6]))
    assert rec.blocks_done == 0  # 6 still has a retained child (7)
    rec = core.apply_command(ReclaimCommand(command_id="c4", worker_id=WID, epoch=2, blocks=[6, 7]))
    assert rec.blocks_done == 2
    dropped = core.apply_command(
        ReconcileCommand(command_id="c5", worker_id=WID, epoch=2, blocks=[8])
    )
    assert dropped.blocks_done == 0
    kinds = [type(e).__name__ for e in core.take_cache_events()]
    assert kinds == ["Stored", "Stored", "Removed"]
    with pytest.raises(EpochAhead):
        core.apply_command(ReclaimCommand(command_id="c6", worker_id=WID, epoch=3, blocks=[5]))
    with pytest.raises(UnknownWorker):
        core.apply_command(
            ReclaimCommand(command_id="c7", worker_id="w-cp4-g0", epoch=2, blocks=[5])
        )
    with pytest.raises(InvalidInput):  # 5 is cached at the root, not under 9
        core.apply_command(
            ReplicateCommand(
                command_id="c8", worker_id=WID, epoch=2, blocks=[9, 5], source_worker="w-cp4-g0"
            )
        )
