"""The live controller against a real nats-server, with fake workers, ranks and scheduler.

Demand above the capacity for ``persistence`` windows → a split: drain record (CAS) and
DrainNotice, commit record after the in-flight request finished, rank acks, exposure record
and CompositionNotice. Two controllers racing on one epoch: exactly one compare-and-set wins.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import pytest
from live_ctl_support import Collector, FakeRanks, FakeScheduler, eventually, request
from nats.aio.client import Client

from services.controller.service import (
    ControllerService,
    ControllerSettings,
    QueueReport,
    composition_subject,
    controller_group,
    drain_subject,
    reconf_subject,
    worker_queue_subject,
)
from shared.schemas import (
    EpochRecord,
    FirstToken,
    SchemaError,
    TtftStages,
    WindowReport,
    WorkerState,
    decode,
    encode,
    to_json,
)
from shared.service import RemoteError, call, epoch_kv, worker_state_kv
from shared.subjects import Subjects
from shared.tasks import cancel_and_wait
from shared.worker import Lifecycle

H = 0.2
# κ = 1 s per worker, unscaled: 2CP4 has K = 2 (split above u·K = 1.8); after one split,
# 2CP2/1CP4 has K = 3 and D = 2.5 sits inside [l·K, u·K] = [1.5, 2.7]: a steady demand splits
# exactly once. These tests pin the one-operation planner of the paper (max_ops 1, the
# pre-calibration thresholds); test_live_multi_op.py runs the calibrated defaults.
DEMAND = 2.5
ONE_OP: dict[str, Any] = dict(
    kappa_scale=1.0,
    upper=0.9,
    merge_headroom=0.8,
    max_ops=1,
    split_target=0.8,
    momentum=True,
    merge_speedup=None,
)


def settings(url: str, prefix: str, instance: str, **kw: Any) -> ControllerSettings:
    base: dict[str, Any] = dict(
        nats_url=url,
        subject_prefix=prefix,
        instance_id=instance,
        num_gpus=8,
        degrees=[2, 4],
        initial_composition="2CP4",
        kappa={2: 1.0, 4: 1.0},
        window_s=H,
        tick_s=0.05,
        report_grace_s=0.05,
        persistence=2,
        queue_query_timeout_s=0.5,
        **ONE_OP,
    )
    base.update(kw)
    return ControllerSettings(**base)


async def inspect(nc: Client, prefix: str, body: bytes = b"") -> dict[str, Any]:
    msg = await request(nc, f"{controller_group(Subjects(prefix))}.inspect", body)
    return json.loads(msg.data)


async def ranks_saw(ranks: FakeRanks, epoch: int) -> None:
    """Until the fake ranks have the record of ``epoch``. A composition notice names a record
    the controller wrote just before; the ranks' watch of the record key is another delivery
    (the server's consumer), which may reach this client after the notice."""

    async def seen() -> bool:
        return any(r.epoch == epoch for r in ranks.records)

    await eventually(seen, what=f"the ranks' copy of record {epoch}")


def worker_state(wid: str, gpus: list[int], *, queue: int, outstanding: float) -> WorkerState:
    return WorkerState(
        worker_id=wid,
        degree=len(gpus),
        gpus=gpus,
        epoch=0,
        lifecycle=Lifecycle.ACTIVE,
        queue_len=queue,
        outstanding_s=outstanding,
        kv_free_blocks=10,
        kv_total_blocks=10,
        heartbeat_s=time.time(),
    )


async def test_sustained_demand_splits_a_worker(nc: Client, nats_server, uniq: str, services):
    s = Subjects(uniq)
    js = nc.jetstream()
    states = await worker_state_kv(js, s)
    # w-cp4-g4 drains faster (less outstanding work), so the planner picks it.
    await states.put(
        "w-cp4-g0", to_json(worker_state("w-cp4-g0", [0, 1, 2, 3], queue=3, outstanding=5.0))
    )
    await states.put(
        "w-cp4-g4", to_json(worker_state("w-cp4-g4", [4, 5, 6, 7], queue=2, outstanding=1.0))
    )

    async def queue_of_g4(msg) -> None:
        rep = QueueReport(worker_id="w-cp4-g4", queued=["r-queued"], in_flight=["r-running"])
        data, headers = encode(rep)
        await nc.publish(msg.reply, data, headers=headers)

    await nc.subscribe(worker_queue_subject(s, "w-cp4-g4"), cb=queue_of_g4)
    drains, reconfs, comps = Collector(), Collector(), Collector()
    await nc.subscribe(drain_subject(s), cb=drains.cb)
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    await nc.subscribe(composition_subject(s), cb=comps.cb)
    await nc.flush()
    ranks = FakeRanks(nc, s)
    await ranks.start()
    sched = FakeScheduler(nc, s, H, lambda: DEMAND)

    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a")))
    try:
        first = await inspect(nc, uniq)
        assert first["composition"] == "2CP4" and first["record_epoch"] == 0
        await sched.start()

        drain = await drains.first(what="a drain notice")
        assert drain["kind"] == "split"
        assert drain["sources"] == ["w-cp4-g4"]
        assert drain["targets"] == ["w-cp2-g4", "w-cp2-g6"]
        assert drain["redirected"] == [
            {"schema_version": 1, "worker_id": "w-cp4-g4", "request_id": "r-queued"}
        ]
        assert drain["in_flight"] == {"w-cp4-g4": 1}

        kv = await epoch_kv(js, s)
        entry = await kv.get(s.epoch_key())
        rec = decode(EpochRecord, entry.value)
        assert rec.epoch == drain["epoch"] == 1
        assert {w.worker_id: w.lifecycle for w in rec.workers} == {
            "w-cp4-g0": Lifecycle.ACTIVE,
            "w-cp4-g4": Lifecycle.DRAINING,
        }

        # Nothing commits while the in-flight request runs; its first token releases the drain.
        assert not [r for r in reconfs.items if r["phase"] == "committed"]
        done = FirstToken(
            request_id="r-running",
            token=7,
            worker_id="w-cp4-g4",
            epoch=0,
            stages=TtftStages(),
            finished_at_s=time.time(),
        )
        data, headers = encode(done)
        await nc.publish(s.result("r-running"), data, headers=headers)

        exposed = await reconfs.first(lambda r: r["phase"] == "exposed", what="exposure")
        assert exposed["sources"] == ["w-cp4-g4"]
        assert exposed["drain_s"] is not None and exposed["switch_s"] is not None
        assert exposed["epoch"] == 2  # the commit record; ranks acked it
        phases = [r["phase"] for r in reconfs.items if r["reconfiguration"] == 1]
        assert phases[:4] == ["draining", "drained", "committed", "ready"]

        comp = await comps.first(lambda c: c["epoch"] == 3, what="composition notice")
        assert comp["composition"] == "2CP2/1CP4"
        assert sorted(comp["schedulable"]) == ["w-cp2-g4", "w-cp2-g6", "w-cp4-g0"]
        await ranks_saw(ranks, 3)
        epochs = [
            (r.epoch, sorted((w.worker_id, w.lifecycle.value) for w in r.workers))
            for r in ranks.records
        ]
        assert epochs[2] == (
            2,
            [("w-cp2-g4", "switching"), ("w-cp2-g6", "switching"), ("w-cp4-g0", "active")],
        )
        assert epochs[3] == (
            3,
            [("w-cp2-g4", "active"), ("w-cp2-g6", "active"), ("w-cp4-g0", "active")],
        )

        body = await inspect(nc, uniq, b'{"decisions": 50}')
        assert body["composition"] == "2CP2/1CP4"
        assert body["record_epoch"] == 3 and body["counters"]["cas_lost"] == 0
        assert body["reconfigurations"][0]["phase"] == "exposed"
        assert any(d["plan"] for d in body["decisions"])
        assert ctl.counters["acks"] == 4  # GPUs 4..7 of the two targets
    finally:
        await sched.stop()
        await ranks.stop()


async def test_second_controller_loses_the_epoch_cas(nc: Client, nats_server, uniq: str, services):
    s = Subjects(uniq)
    reconfs, drains = Collector(), Collector()
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    await nc.subscribe(drain_subject(s), cb=drains.cb)
    ranks = FakeRanks(nc, s)
    await ranks.start()
    sched = FakeScheduler(nc, s, H, lambda: DEMAND)
    # No following: each controller re-reads the record only after a lost compare-and-set,
    # so both plan the same split on the same windows and race on the same revision.
    a = await services(
        ControllerService(settings(nats_server.url, uniq, "ctl-a", follow_record=False))
    )
    b = await services(
        ControllerService(settings(nats_server.url, uniq, "ctl-b", follow_record=False))
    )
    try:
        assert a.record == b.record  # b found a's initial record
        await sched.start()
        exposed = await reconfs.first(lambda r: r["phase"] == "exposed", what="exposure")

        async def someone_lost() -> bool:  # lost the compare-and-set and rebuilt its core
            return any(c.counters["cas_lost"] >= 1 and c.counters["rebuilt"] >= 1 for c in (a, b))

        await eventually(someone_lost, what="a lost compare-and-set")
        winner, loser = (a, b) if exposed["controller"] == "ctl-a" else (b, a)
        assert winner.counters["cas_lost"] == 0
        assert loser.counters["cas_lost"] >= 1 and loser.counters["rebuilt"] >= 1
        assert loser.counters["exposed"] == 0
        # Every phase event and the one drain notice came from the winner.
        assert {r["controller"] for r in reconfs.items} == {winner.instance}
        assert len(drains.items) == 1
        # The loser's core was rebuilt from the stored record: same epoch or behind it.
        kv = await epoch_kv(nc.jetstream(), s)
        stored = decode(EpochRecord, (await kv.get(s.epoch_key())).value)
        assert loser.record is not None and loser.record.epoch <= stored.epoch
        assert [r.epoch for r in ranks.records] == sorted({r.epoch for r in ranks.records})
    finally:
        await sched.stop()
        await ranks.stop()


async def test_malformed_input_gets_400_and_controller_keeps_running(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a")))
    group = controller_group(s)
    for bad in (b"{not json", b'{"decisions": -1}', b'{"unknown": 1}'):
        msg = await request(nc, f"{group}.inspect", bad)
        assert msg.headers and msg.headers.get("Nats-Service-Error-Code") == "400", bad
    # Malformed pub/sub inputs are counted and dropped.
    await nc.publish(s.window_demand("x"), b"garbage")
    await nc.publish(s.epoch_ack(3), b'{"gpu": "x"}')

    async def counted() -> bool:
        return ctl.counters["malformed"] >= 2

    await eventually(counted, what="malformed inputs counted")
    body = await inspect(nc, uniq)
    # Exactly the two pub/sub inputs (a 400 answer to inspect is no malformed input).
    assert body["composition"] == "2CP4" and body["counters"]["malformed"] == 2
    with pytest.raises(RemoteError) as err:
        await call(nc, f"{group}.inspect", b"[]", dict)
    assert err.value.code == 400


async def test_an_unreadable_epoch_record_is_written_over(
    nc: Client, nats_server, uniq: str, services
):
    """A value at the epoch key that is no record of the pool -- bytes that do not decode,
    then a record whose workers are no composition (epoch 50, no workers: ranks would adopt
    it) -- is written over with the controller's own composition at an epoch above it, and
    reconfiguration still works after (before: the value stayed, every compare-and-set on it
    failed, and no split ever happened)."""
    s = Subjects(uniq)
    reconfs = Collector()
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    ranks = FakeRanks(nc, s)
    await ranks.start()
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a")))
    kv = await epoch_kv(nc.jetstream(), s)

    async def stored() -> EpochRecord | None:
        try:
            return decode(EpochRecord, (await kv.get(s.epoch_key())).value)
        except SchemaError:
            return None

    async def repaired_above(epoch: int) -> EpochRecord | None:
        rec = await stored()
        return rec if rec is not None and rec.epoch > epoch else None

    async def counted(n: int) -> bool:
        # The controller counts a repair after its write returns: the record can be read
        # back before the count moves (seen once under load).
        return ctl.counters["records_repaired"] >= n

    sched = FakeScheduler(nc, s, H, lambda: DEMAND)
    try:
        await kv.put(s.epoch_key(), b"\x00 not a record")
        rec = await eventually(lambda: repaired_above(0), what="the garbage written over")
        assert [w.worker_id for w in rec.workers] == ["w-cp4-g0", "w-cp4-g4"]
        await eventually(lambda: counted(1), what="the first repair counted")
        assert ctl.counters["records_repaired"] == 1
        foreign = EpochRecord(epoch=50, workers=[], committed_at_s=time.time())
        await kv.put(s.epoch_key(), to_json(foreign))
        rec = await eventually(lambda: repaired_above(50), what="the foreign record written over")
        assert rec.epoch == 51 and len(rec.workers) == 2
        await eventually(lambda: counted(2), what="the second repair counted")
        assert ctl.counters["records_repaired"] == 2

        async def ranks_follow() -> bool:
            return bool(ranks.records) and ranks.records[-1].epoch == 51

        await eventually(ranks_follow, what="the ranks on the repaired record")
        await sched.start()
        await reconfs.first(lambda r: r["phase"] == "exposed", what="a split after the repairs")
    finally:
        await sched.stop()
        await ranks.stop()


async def test_a_write_that_finds_an_unreadable_epoch_record_writes_over_it(
    nc: Client, nats_server, uniq: str, services
):
    """Without following the key, the controller meets the garbage on its next write (the
    split's drain record): the compare-and-set fails, the value is no record, so it writes
    its own over it, rebuilds from that and plans the split again, which then completes."""
    s = Subjects(uniq)
    reconfs = Collector()
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    ranks = FakeRanks(nc, s)
    await ranks.start()
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a",
                                                    follow_record=False)))
    kv = await epoch_kv(nc.jetstream(), s)
    await kv.put(s.epoch_key(), b"not a record")
    sched = FakeScheduler(nc, s, H, lambda: DEMAND)
    try:
        await sched.start()
        await reconfs.first(lambda r: r["phase"] == "exposed", what="the split, after a repair")
        assert ctl.counters["records_repaired"] == 1 and ctl.counters["cas_lost"] == 1
        stored = decode(EpochRecord, (await kv.get(s.epoch_key())).value)
        assert stored == ctl.record and len(stored.workers) == 3  # 2CP2 + 1CP4
    finally:
        await sched.stop()
        await ranks.stop()


async def test_a_controller_starts_over_an_unreadable_epoch_record(
    nc: Client, nats_server, uniq: str, services
):
    """Garbage at the epoch key before any controller: one starts (before: its start failed
    on the value) and writes its initial composition over it."""
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    await kv.put(s.epoch_key(), b'{"epoch": "x"}')
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a")))
    rec = decode(EpochRecord, (await kv.get(s.epoch_key())).value)
    assert rec == ctl.record and rec.epoch == 0 and len(rec.workers) == 2
    assert ctl.counters["records_repaired"] == 1


async def test_lease_loss_fails_a_worker_and_its_heartbeat_readmits_it(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    states = await worker_state_kv(nc.jetstream(), s)
    stale = worker_state("w-cp4-g0", [0, 1, 2, 3], queue=0, outstanding=0.0).model_copy(
        update={"heartbeat_s": time.time() - 60}
    )
    await states.put("w-cp4-g0", to_json(stale))
    comps = Collector()
    await nc.subscribe(composition_subject(s), cb=comps.cb)
    ranks = FakeRanks(nc, s)
    await ranks.start()
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a", lease_s=2.0)))

    def lifecycle(rec: EpochRecord) -> str:
        return next(w.lifecycle.value for w in rec.workers if w.worker_id == "w-cp4-g0")

    async def failed() -> bool:
        return any(lifecycle(r) == "unavailable" for r in ranks.records)

    await eventually(failed, what="a record with the worker unavailable")
    assert ctl.counters["failed"] == 1
    body = await inspect(nc, uniq)
    assert "w-cp4-g0" not in body["schedulable"]

    async def heartbeat() -> None:
        while True:
            fresh = worker_state("w-cp4-g0", [0, 1, 2, 3], queue=0, outstanding=0.0)
            await states.put("w-cp4-g0", to_json(fresh))
            await asyncio.sleep(0.2)

    beat = asyncio.create_task(heartbeat())
    try:
        comp = await comps.first(
            lambda c: "w-cp4-g0" in c["schedulable"] and c["epoch"] > 0,
            what="the worker schedulable again",
        )
        await ranks_saw(ranks, comp["epoch"])
        seq = [lifecycle(r) for r in ranks.records]
        assert seq[:4] == ["active", "unavailable", "switching", "active"]
        assert comp["epoch"] == ranks.records[3].epoch
        assert ctl.counters["recovered"] == 1
    finally:
        await cancel_and_wait([beat])  # not beat.cancel(): a cancel a put drops (shared/tasks.py)
        await ranks.stop()


async def test_restart_readmits_workers_left_mid_reconfiguration(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    left = EpochRecord(
        epoch=5,
        committed_at_s=time.time() - 1,
        reason="drain (controller died)",
        workers=[
            {"worker_id": "w-cp4-g0", "first_gpu": 0, "degree": 4, "lifecycle": "active"},
            {"worker_id": "w-cp4-g4", "first_gpu": 4, "degree": 4, "lifecycle": "draining"},
        ],
    )
    await kv.put(s.epoch_key(), to_json(left))
    ranks = FakeRanks(nc, s)
    await ranks.start()
    comps = Collector()
    await nc.subscribe(composition_subject(s), cb=comps.cb)
    # The record is older than reconfig_drain_timeout_s: its writer is presumed gone.
    ctl = await services(
        ControllerService(settings(nats_server.url, uniq, "ctl-b", reconfig_drain_timeout_s=0.5))
    )
    comp = await comps.first(lambda c: len(c["schedulable"]) == 2, what="both schedulable")
    assert comp["epoch"] == 7 and comp["composition"] == "2CP4"
    try:
        await ranks_saw(ranks, 7)
        states = {
            r.epoch: {w.worker_id: w.lifecycle.value for w in r.workers} for r in ranks.records
        }
        assert states[6] == {"w-cp4-g0": "active", "w-cp4-g4": "switching"}
        assert states[7] == {"w-cp4-g0": "active", "w-cp4-g4": "active"}
        assert ctl.counters["readmitted"] == 1
    finally:
        await ranks.stop()


async def test_a_lost_window_report_is_recovered_from_its_copy(
    nc: Client, nats_server, uniq: str, services
):
    """A scheduler sends each window's report again just ahead of the next one. The copy of
    a lost report gives its window its demand (without it, the next report would close the
    window with D = 0); the copy of a report that arrived is ignored (counted once)."""
    s = Subjects(uniq)
    h = 0.5
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a", window_s=h)))
    k = math.floor(time.time() / h) + 1  # a window that opens after the controller started

    def report(i: int, demand: float) -> WindowReport:
        return WindowReport(reporter="sched-a", window_index=i, window_start_s=i * h,
                            window_s=h, epoch=0, demand_s=demand, requests=10, long_requests=0)

    async def send_at(t: float, copy: WindowReport, rep: WindowReport) -> None:
        """A copy of the previous window's report, then this window's, as a scheduler does."""
        await asyncio.sleep(max(0.0, t - time.time()))
        data, headers = encode(copy)
        await nc.publish(s.window_demand_again("sched-a"), data, headers=headers)
        data, headers = encode(rep)
        await nc.publish(s.window_demand("sched-a"), data, headers=headers)

    # Window k's own report (due at its end) is lost; its copy comes ahead of k+1's.
    await send_at((k + 2) * h + 0.01, report(k, 1.25), report(k + 1, 0.75))
    # The copies of k+1 and k+2 arrive although their reports did: duplicates (counted, they
    # would land in the window open then, as any late report does).
    await send_at((k + 3) * h + 0.01, report(k + 1, 0.75), report(k + 2, 0.5))
    await send_at((k + 4) * h + 0.01, report(k + 2, 0.5), report(k + 3, 0.25))

    async def decided() -> bool:
        body = await inspect(nc, uniq, b'{"decisions": 50}')
        starts = {round(d["window_start_s"] / h) for d in body["decisions"]}
        return {k, k + 1, k + 2} <= starts

    await eventually(decided, what="windows k to k+2 decided")
    body = await inspect(nc, uniq, b'{"decisions": 50}')
    demand = {round(d["window_start_s"] / h): d["demand_s"] for d in body["decisions"]}
    assert demand[k] == pytest.approx(1.25) and demand[k + 1] == pytest.approx(0.75)
    assert demand[k + 2] == pytest.approx(0.5)
    assert ctl.counters["duplicate_reports"] == 2 and ctl.counters["reports"] == 4


async def test_a_held_tp_pool_plans_nothing_and_its_leases_still_apply(
    nc: Client, nats_server, uniq: str, services
):
    """``adaptive=False, kind='tp'``: the vLLM-like baseline's fixed TP-4 pool as ``vertumnus
    up --policy vllm`` deploys it. Demand 5x the capacity gives no plan; the epoch record
    names TP workers; a TP worker's stale heartbeat still fails it (its state is matched to
    the protocol's worker by its GPU group)."""
    from services.controller.core import HELD_REASON
    from shared.worker import WorkerKind

    s = Subjects(uniq)
    states = await worker_state_kv(nc.jetstream(), s)
    tp = {"kind": WorkerKind.TP}
    await states.put("w-tp4-g4", to_json(worker_state(
        "w-tp4-g4", [4, 5, 6, 7], queue=0, outstanding=0.0).model_copy(update=tp)))
    await states.put("w-tp4-g0", to_json(worker_state(
        "w-tp4-g0", [0, 1, 2, 3], queue=0, outstanding=0.0).model_copy(
            update={**tp, "heartbeat_s": time.time() - 60})))
    drains = Collector()
    await nc.subscribe(drain_subject(s), cb=drains.cb)
    sched = FakeScheduler(nc, s, H, lambda: 10.0)  # K = 2: a free controller would split
    ctl = await services(ControllerService(
        settings(nats_server.url, uniq, "ctl-a", adaptive=False, kind="tp")))
    try:
        await sched.start()

        async def decided() -> bool:
            body = await inspect(nc, uniq, b'{"decisions": 50}')
            return len([d for d in body["decisions"] if d["demand_s"] > 0]) >= 3

        await eventually(decided, what="three loaded windows decided")
        body = await inspect(nc, uniq, b'{"decisions": 50}')
        assert all(d["plan"] is None and d["reason"] == HELD_REASON for d in body["decisions"])
        assert not drains.items and ctl.counters["plans"] == 0
        kv = await epoch_kv(nc.jetstream(), s)
        rec = decode(EpochRecord, (await kv.get(s.epoch_key())).value)
        assert {(w.worker_id, w.kind, w.lifecycle) for w in rec.workers} == {
            ("w-tp4-g0", WorkerKind.TP, Lifecycle.UNAVAILABLE),
            ("w-tp4-g4", WorkerKind.TP, Lifecycle.ACTIVE),
        }
        assert rec.epoch == 1 and ctl.counters["failed"] == 1
    finally:
        await sched.stop()


def test_tp_workers_need_a_held_composition() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="kind 'tp' needs adaptive false"):
        ControllerSettings(kind="tp")
    assert ControllerSettings(kind="tp", adaptive=False).kind == "tp"


def test_a_window_is_decided_with_the_queues_at_its_end() -> None:
    """``boundary_drain``: the queues recorded at a window boundary decide the window that
    ends there, however late the report grace lets it close; without a record at that
    boundary, or once the pool's workers changed, the queues as they are now."""
    from services.controller.service import boundary_drain

    comp = {"w-cp4-g0", "w-cp4-g4"}
    at_end = {"w-cp4-g0": 0.5, "w-cp4-g4": 0.4}
    now = {"w-cp4-g0": 9.0, "w-cp4-g4": 8.0}
    assert boundary_drain((100.0, at_end), 102.5, 10.0, now, comp) == at_end
    assert boundary_drain((100.0, at_end), 100.0, 10.0, now, comp) == at_end
    assert boundary_drain((90.0, at_end), 102.5, 10.0, now, comp) == now  # an older boundary
    assert boundary_drain((100.0, at_end), 99.0, 10.0, now, comp) == now  # not closing it
    assert boundary_drain(None, 102.5, 10.0, now, comp) == now
    merged = {"w-cp4-g0": 1.0, "w-cp2-g4": 0.0, "w-cp2-g6": 0.0}
    assert boundary_drain((100.0, at_end), 102.5, 10.0, merged,
                          {"w-cp4-g0", "w-cp2-g4", "w-cp2-g6"}) == merged


async def test_the_backlog_a_window_is_judged_by_is_the_one_at_its_end(
    nc: Client, nats_server, uniq: str, services
):
    """The controller closes a window ``report_grace_s`` after it ended. The workers'
    outstanding work it hands the planner (rule 14's backlog, the drain estimates) is the one
    its first tick after the boundary saw, as the simulator measures it at the boundary; a
    burst that queues during the grace counts in the next window. A window whose boundary no
    tick saw is judged by the queues of its closing tick. (Clock injected: the test moves it.)"""
    s = Subjects(uniq)
    states = await worker_state_kv(nc.jetstream(), s)
    h, grace = 10.0, 2.0
    clock = [1000 * h + 3.0]
    ctl = await services(ControllerService(
        settings(nats_server.url, uniq, "ctl-a", window_s=h, tick_s=0.05, report_grace_s=grace,
                 demand_input="assignments"), clock=lambda: clock[0]))

    async def outstanding(value: float) -> None:
        for wid, gpus in (("w-cp4-g0", [0, 1, 2, 3]), ("w-cp4-g4", [4, 5, 6, 7])):
            await states.put(wid, to_json(worker_state(wid, gpus, queue=1, outstanding=value)))

        async def seen() -> bool:
            return all(ctl._states.get(w) is not None and ctl._states[w].outstanding_s == value
                       for w in ("w-cp4-g0", "w-cp4-g4"))

        await eventually(seen, what=f"outstanding {value} seen", timeout=10)

    await outstanding(0.5)
    assert ctl.core is not None
    judged: list[tuple[float, dict[str, float]]] = []
    tick = ctl.core.tick

    def recording(now: float, **kw: Any) -> Any:
        out = tick(now, **kw)
        judged.extend((d.window.start_s, dict(kw["drain_s"])) for d in out)
        return out

    ctl.core.tick = recording  # type: ignore[method-assign]
    clock[0] = 1001 * h + 0.01  # just after the boundary: the queues there are recorded
    await ctl.tick()
    await outstanding(9.0)  # a burst queued during the grace
    clock[0] = 1001 * h + grace + 0.5  # the window [1000h, 1001h) closes now
    await ctl.tick()
    assert judged == [(1000 * h, {"w-cp4-g0": 0.5, "w-cp4-g4": 0.5})]
    clock[0] = 1002 * h + grace + 0.5  # no tick saw the boundary 1002h: the queues now
    await ctl.tick()
    assert judged[1:] == [(1001 * h, {"w-cp4-g0": 9.0, "w-cp4-g4": 9.0})]
