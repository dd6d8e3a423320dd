"""The live controller's epoch records against a real nats-server (review findings).

* A drain record whose write failed (JetStream could not take it; not a lost
  compare-and-set) left the operation started in the protocol: idle sources were later
  committed with no drain record ever written (a switch the ranks never drained for, against
  §6.2), busy ones blocked the planner until the drain timeout. The operation is undone; the
  planner plans again; every commit follows a drain record.
* With no ``initial_composition`` the controller wrote "every worker of the largest degree",
  which some valid lattices do not have (6 GPUs, degrees 2 and 4): it failed to start.
"""

from __future__ import annotations

import pytest
from live_ctl_support import Collector, FakeRanks, FakeScheduler, eventually
from nats.aio.client import Client
from test_live_controller import DEMAND, H, inspect, ranks_saw, settings

from services.controller.lattice import Composition, Lattice
from services.controller.service import (
    ControllerService,
    default_composition,
    reconf_subject,
)
from shared.ids import InvalidInput
from shared.schemas import EpochRecord, decode, to_json
from shared.service import epoch_kv
from shared.subjects import Subjects


async def test_a_drain_record_that_cannot_be_written_undoes_its_operation(
    nc: Client, nats_server, uniq: str, services
):
    """The epoch bucket is gone when the controller writes its first drain record (idle
    sources: the operation is drained at once). The operation is aborted with nothing
    written; once the bucket is back (holding the record the controller last wrote), a
    later plan drains and commits, and the ranks see a drain record before every commit."""
    s = Subjects(uniq)
    js = nc.jetstream()
    reconfs = Collector()
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a",
                                                    ack_timeout_s=0.5)))
    initial = ctl.record
    assert initial is not None
    await js.delete_stream(f"KV_{s.epoch_bucket()}")
    sched = FakeScheduler(nc, s, H, lambda: DEMAND)  # above u·K of 2CP4: a split
    ranks = FakeRanks(nc, s)
    try:
        await sched.start()

        async def write_failed() -> bool:
            return ctl.counters["errors"] >= 1

        await eventually(write_failed, what="a drain record's write failed")
        # Its abort is published before the counter moves, but reaches this test's
        # subscription when it does: waited for, not read at once (a loaded machine).
        await reconfs.first(lambda r: r["phase"] == "aborted", what="the operation aborted")
        async with ctl._lock:  # no write of the controller between these two
            assert ctl.core is not None and not ctl.core.protocol.in_progress()
            assert ctl.counters["drains_abandoned"] >= 1 and ctl.record == initial
            kv = await epoch_kv(js, s)
            await kv.create(s.epoch_key(), to_json(initial))
        await ranks.start()
        exposed = await reconfs.first(lambda r: r["phase"] == "exposed",
                                      what="a later plan carried out")
        await ranks_saw(ranks, exposed["epoch"])
        reasons = [r.reason for r in ranks.records]
        commit = reasons.index(f"commit reconfiguration {exposed['reconfiguration']}")
        assert any(r.startswith("drain: ") for r in reasons[:commit]), reasons
        aborted = {r["reconfiguration"] for r in reconfs.items if r["phase"] == "aborted"}
        assert aborted and all(rid < exposed["reconfiguration"] for rid in aborted)
        assert not any(r["phase"] in ("committed", "exposed") and r["reconfiguration"] in aborted
                       for r in reconfs.items)
    finally:
        await sched.stop()
        await ranks.stop()


@pytest.mark.parametrize(
    ("gpus", "degrees", "expected"),
    [
        (8, [2, 4], "2CP4"),
        (6, [2, 4], "1CP2/1CP4"),
        (12, [2, 4, 8], "1CP4/1CP8"),
        (6, [2], "3CP2"),
        (2, [2, 4], "1CP2"),
    ],
)
def test_the_default_initial_composition_is_achievable(
    gpus: int, degrees: list[int], expected: str
) -> None:
    lat = Lattice(gpus, degrees, 8)
    comp = default_composition(lat)
    assert comp.describe() == expected
    try:
        uniform: Composition | None = Composition.uniform(lat, max(degrees))
    except InvalidInput:
        uniform = None
    if uniform is not None:  # where every worker can have the largest degree, it is that
        assert comp == uniform


async def test_a_controller_of_six_gpus_starts_without_an_initial_composition(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    cfg = settings(nats_server.url, uniq, "ctl-a", num_gpus=6, initial_composition=None)
    await services(ControllerService(cfg))
    kv = await epoch_kv(nc.jetstream(), s)
    rec = decode(EpochRecord, (await kv.get(s.epoch_key())).value)
    assert [(w.worker_id, w.degree) for w in rec.workers] == [("w-cp4-g0", 4), ("w-cp2-g4", 2)]
    body = await inspect(nc, uniq)
    assert body["composition"] == "1CP2/1CP4"


async def test_a_record_write_that_timed_out_but_landed_is_taken_as_written(
    nc: Client, nats_server, uniq: str, services
):
    """A write may time out after the server stored it: ``_landed`` reads the record back
    and, finding ours, takes it (revision and record) instead of undoing the operation; a
    record that is not ours is not taken."""
    s = Subjects(uniq)
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a")))
    kv = await epoch_kv(nc.jetstream(), s)
    async with ctl._lock:
        ours = ctl._next_record("drain: a write whose answer was lost")
        other = ours.model_copy(update={"reason": "another writer's"})
        assert not await ctl._landed(ours)  # nothing written yet
        revision = await kv.update(s.epoch_key(), to_json(ours), last=ctl.revision)
        assert not await ctl._landed(other)
        assert ctl.record != ours
        assert await ctl._landed(ours)
        assert ctl.record == ours and ctl.revision == revision
