"""The live controller's leases and re-admissions against a real nats-server (review findings).

* A worker created by a commit (a merge back to an id that existed earlier) was judged by its
  predecessor's last heartbeat: worker-state keys expire by TTL, which the state watch is never
  told, so the old state lingered and the new target was failed at once (§6.2: a target
  becomes schedulable once its ranks acknowledge; it never starts UNAVAILABLE).
* A controller (re)started on a record with an UNAVAILABLE worker made it ACTIVE: its κ counted,
  and after ``reconfig_drain_timeout_s`` it was re-admitted with no heartbeat. It must stay
  unavailable until it heartbeats again.
* With TP workers (``w-tp4-g0``; the protocol's name is ``w-cp4-g0``) every rank ack was
  ignored, so a recovered worker never became active; a TP worker left switching by a
  stopped controller was never re-admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from live_ctl_support import Collector, FakeRanks, FakeScheduler, eventually
from nats.aio.client import Client
from nats.js.kv import KeyValue
from test_live_controller import H, inspect, ranks_saw, settings, worker_state

from services.controller.service import ControllerService, composition_subject, reconf_subject
from shared.schemas import EpochRecord, EpochWorker, WorkerState, to_json
from shared.service import epoch_kv, worker_state_kv
from shared.subjects import Subjects
from shared.tasks import cancel_and_wait
from shared.worker import Lifecycle, WorkerKind

GROUPS: dict[str, list[int]] = {
    "w-cp2-g0": [0, 1], "w-cp2-g2": [2, 3], "w-cp4-g0": [0, 1, 2, 3], "w-cp4-g4": [4, 5, 6, 7],
    "w-tp4-g0": [0, 1, 2, 3], "w-tp4-g4": [4, 5, 6, 7],
}


def state_of(wid: str, **update: Any) -> WorkerState:
    """``wid``'s state (GPUs from its name), idle, heartbeat now, with ``update`` applied."""
    st = worker_state(wid, GROUPS[wid], queue=0, outstanding=0.0)
    return st.model_copy(update=update)


@contextlib.asynccontextmanager
async def heartbeats(
    states: KeyValue, workers: Sequence[str], **update: Any
) -> AsyncIterator[None]:
    """Fresh states of ``workers`` every 0.2 s while the block runs (live worker leases)."""

    async def beat() -> None:
        while True:
            for wid in workers:
                await states.put(wid, to_json(state_of(wid, heartbeat_s=time.time(), **update)))
            await asyncio.sleep(0.2)

    task = asyncio.create_task(beat())
    try:
        yield
    finally:
        # Not cancel-then-await: a cancel landing as a put's answer arrives is dropped inside
        # nats-py's wait_for (Python 3.11, shared/tasks.py), the loop beats on, and the await
        # waited for ever (the test hung until pytest-timeout ended the whole run).
        await cancel_and_wait([task])


def lifecycles(rec: EpochRecord) -> dict[str, str]:
    return {w.worker_id: w.lifecycle.value for w in rec.workers}


async def test_a_worker_merged_back_is_not_judged_by_its_predecessors_heartbeat(
    nc: Client, nats_server, uniq: str, services
):
    """2CP2/1CP4 whose w-cp4-g0 was split a minute ago (its last state still held): a merge
    back creates w-cp4-g0 again. The new worker is exposed once its ranks ack, not failed by
    the old state; a late copy of the old state (a stopping predecessor, a watch replay) is
    ignored too."""
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    split = EpochRecord(
        epoch=3,
        committed_at_s=time.time() - 1,
        reason="expose reconfiguration 1",
        workers=[
            EpochWorker(worker_id=w, first_gpu=GROUPS[w][0], degree=len(GROUPS[w]),
                        lifecycle=Lifecycle.ACTIVE)
            for w in ("w-cp2-g0", "w-cp2-g2", "w-cp4-g4")
        ],
    )
    await kv.put(s.epoch_key(), to_json(split))
    states = await worker_state_kv(nc.jetstream(), s)
    await states.put("w-cp4-g0", to_json(state_of("w-cp4-g0", heartbeat_s=time.time() - 60)))
    reconfs = Collector()
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    ranks = FakeRanks(nc, s)
    await ranks.start()
    sched = FakeScheduler(nc, s, H, lambda: 0.1)  # K = 3: merge below 1.5
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a")))
    try:
        async with heartbeats(states, ["w-cp2-g0", "w-cp2-g2", "w-cp4-g4"]):
            await sched.start()
            exposed = await reconfs.first(lambda r: r["phase"] == "exposed",
                                          what="the merge exposed")
            assert exposed["targets"] == ["w-cp4-g0"]
            body = await inspect(nc, uniq)
            assert body["reconfigurations"][0]["failed_targets"] == []
            assert "w-cp4-g0" in body["schedulable"]
            assert ctl.counters["failed"] == 0
            # The predecessor's state arrives again (epoch 0, before the merge's commit).
            await states.put("w-cp4-g0",
                             to_json(state_of("w-cp4-g0", heartbeat_s=time.time() - 60)))

            async def ignored() -> bool:
                return ctl.counters["stale_states"] >= 1

            await eventually(ignored, what="the predecessor's state seen")
            await ctl.tick()  # leases judged after it
            assert ctl.counters["failed"] == 0
            assert ctl.core is not None
            assert ctl.core.protocol.state("w-cp4-g0") is Lifecycle.ACTIVE
    finally:
        await sched.stop()
        await ranks.stop()


async def test_a_restarted_controller_keeps_an_unavailable_worker_unavailable(
    nc: Client, nats_server, uniq: str, services
):
    """The stored record shows w-cp4-g4 UNAVAILABLE (its lease ran out, its ranks are gone).
    A controller started on it keeps it unavailable -- not schedulable, no capacity, not
    re-admitted as a leftover of a stopped controller, no record written -- until it
    heartbeats again: then it is re-admitted and exposed once its ranks acknowledge."""
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    stored = EpochRecord(
        epoch=7,
        committed_at_s=time.time() - 60,  # older than reconfig_drain_timeout_s
        reason="lease expired: w-cp4-g4",
        workers=[
            EpochWorker(worker_id="w-cp4-g0", first_gpu=0, degree=4, lifecycle=Lifecycle.ACTIVE),
            EpochWorker(worker_id="w-cp4-g4", first_gpu=4, degree=4,
                        lifecycle=Lifecycle.UNAVAILABLE),
        ],
    )
    await kv.put(s.epoch_key(), to_json(stored))
    states = await worker_state_kv(nc.jetstream(), s)
    comps = Collector()
    await nc.subscribe(composition_subject(s), cb=comps.cb)
    ranks = FakeRanks(nc, s)
    await ranks.start()
    sched = FakeScheduler(nc, s, H, lambda: 0.5)  # under upper·κ of one CP4: no split
    ctl = await services(ControllerService(
        settings(nats_server.url, uniq, "ctl-b", reconfig_drain_timeout_s=0.5)))
    try:
        async with heartbeats(states, ["w-cp4-g0"], epoch=7):
            await sched.start()

            async def decided() -> bool:
                body = await inspect(nc, uniq, b'{"decisions": 50}')
                return len([d for d in body["decisions"] if d["demand_s"] > 0]) >= 3

            await eventually(decided, what="three loaded windows decided")
            body = await inspect(nc, uniq, b'{"decisions": 50}')
            workers = {w["worker_id"]: w["state"] for w in body["workers"]}
            assert workers == {"w-cp4-g0": "active", "w-cp4-g4": "unavailable"}
            assert body["schedulable"] == ["w-cp4-g0"]
            assert all(d["capacity_s"] == pytest.approx(1.0)
                       for d in body["decisions"] if d["demand_s"] > 0)
            assert ctl.counters["readmitted"] == 0 and ctl.counters["recovered"] == 0
            assert ctl.record == stored and ctl.counters["records_written"] == 0

            async with heartbeats(states, ["w-cp4-g4"], epoch=7):  # it comes back
                comp = await comps.first(lambda c: "w-cp4-g4" in c["schedulable"],
                                         what="w-cp4-g4 schedulable again")
                await ranks_saw(ranks, comp["epoch"])
            seq = [lifecycles(r)["w-cp4-g4"] for r in ranks.records]
            assert seq[:3] == ["unavailable", "switching", "active"]
            assert ctl.counters["recovered"] == 1 and ctl.counters["readmitted"] == 0
    finally:
        await sched.stop()
        await ranks.stop()


async def test_a_recovered_tp_worker_becomes_active_on_its_ranks_acks(
    nc: Client, nats_server, uniq: str, services
):
    """A held TP pool: w-tp4-g0's lease runs out, it heartbeats again, is re-admitted
    (switching), and its ranks' acks -- naming it w-tp4-g0, as the record does -- make it
    active."""
    s = Subjects(uniq)
    states = await worker_state_kv(nc.jetstream(), s)
    tp = {"kind": WorkerKind.TP}
    await states.put("w-tp4-g0", to_json(state_of("w-tp4-g0", heartbeat_s=time.time() - 60,
                                                  **tp)))
    ranks = FakeRanks(nc, s)
    await ranks.start()
    ctl = await services(ControllerService(
        settings(nats_server.url, uniq, "ctl-a", adaptive=False, kind="tp", lease_s=2.0)))
    try:
        async with heartbeats(states, ["w-tp4-g4"], **tp):

            async def failed() -> bool:
                return any(lifecycles(r).get("w-tp4-g0") == "unavailable"
                           for r in ranks.records)

            await eventually(failed, what="a record with w-tp4-g0 unavailable")
            async with heartbeats(states, ["w-tp4-g0"], **tp):

                async def active_again() -> bool:
                    seq = [lifecycles(r).get("w-tp4-g0") for r in ranks.records]
                    return "active" in seq[seq.index("unavailable"):]

                await eventually(active_again, what="w-tp4-g0 active again")
        seq = [lifecycles(r)["w-tp4-g0"] for r in ranks.records]
        assert seq[:4] == ["active", "unavailable", "switching", "active"]
        assert all(w.kind is WorkerKind.TP for r in ranks.records for w in r.workers)
        assert ctl.counters["recovered"] == 1 and ctl.counters["acks"] >= 4
    finally:
        await ranks.stop()


async def test_a_restart_readmits_a_tp_worker_left_switching(
    nc: Client, nats_server, uniq: str, services
):
    """A stored TP record shows w-tp4-g4 switching (its controller stopped mid-way): once the
    record is older than reconfig_drain_timeout_s the worker is re-admitted and exposed on
    its ranks' acks, as a CP worker is."""
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    tp = WorkerKind.TP
    left = EpochRecord(
        epoch=5,
        committed_at_s=time.time() - 1,
        reason="re-admit w-cp4-g4 (controller died)",
        workers=[
            EpochWorker(worker_id="w-tp4-g0", kind=tp, first_gpu=0, degree=4,
                        lifecycle=Lifecycle.ACTIVE),
            EpochWorker(worker_id="w-tp4-g4", kind=tp, first_gpu=4, degree=4,
                        lifecycle=Lifecycle.SWITCHING),
        ],
    )
    await kv.put(s.epoch_key(), to_json(left))
    ranks = FakeRanks(nc, s)
    await ranks.start()
    await services(ControllerService(settings(
        nats_server.url, uniq, "ctl-b", adaptive=False, kind="tp", reconfig_drain_timeout_s=0.5)))
    try:

        async def both_active() -> bool:
            return any(r.epoch > 5 and set(lifecycles(r).values()) == {"active"}
                       for r in ranks.records)

        await eventually(both_active, what="w-tp4-g4 re-admitted and active")
        by_epoch = {r.epoch: lifecycles(r) for r in ranks.records}
        assert by_epoch[6] == {"w-tp4-g0": "active", "w-tp4-g4": "switching"}
        assert by_epoch[7] == {"w-tp4-g0": "active", "w-tp4-g4": "active"}
    finally:
        await ranks.stop()
