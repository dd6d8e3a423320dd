"""Multi-operation plans carried out live, and the live defaults = the calibrated values.

With the calibrated defaults (``max_ops`` 64, ``split_target`` 1.0, ``merge_headroom`` 0.4,
κ × ``KAPPA_SCALE``) one window's plan may hold several disjoint operations. The controller
starts all of them under one drain record (every source stops admitting in the same record,
before any queue is handed back), then each operation commits its own epoch once its own
sources drained and is exposed once its own targets' ranks acknowledged (the epoch protocol's
concurrent disjoint reconfigurations, as the simulator runs them).

Demand arithmetic (κ_2 = κ_4 = 1 s, × 2.2 → 2.2 s per worker):

* splits: 2CP4 has K = 4.4; D = 7 > u·K = 4.4 → split; one split leaves K = 6.6 < D, two
  leave 4CP2 with K = 8.8 ≥ D and D/K = 0.8 inside [l, u]: one plan of exactly two splits.
* merges: 4CP2 has K = 8.8; D = 1 < l·K = 4.4 → merge; two merges leave 2CP4 (K = 4.4,
  D ≤ 0.4·K = 1.76): one plan of two merges, after which no merge is possible.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import nats
from live_ctl_support import Collector, FakeRanks, FakeScheduler, eventually
from nats.aio.client import Client

from services.controller.planner import ControllerConfig
from services.controller.service import (
    ControllerService,
    ControllerSettings,
    QueueReport,
    composition_subject,
    drain_subject,
    reconf_subject,
    worker_queue_subject,
)
from shared.costmodel import DEFAULT_PROFILE
from shared.schemas import EpochRecord, FirstToken, TtftStages, decode, encode
from shared.service import epoch_kv
from shared.subjects import Subjects
from sim.calibration import CONTROLLER, KAPPA_SCALE
from sim.simulator import controller_profile

H = 0.2
KAPPA = {2: 1.0, 4: 1.0}


def settings(url: str, prefix: str, initial: str, **kw: Any) -> ControllerSettings:
    """The calibrated planner (defaults untouched) on a fast clock."""
    base: dict[str, Any] = dict(
        nats_url=url,
        subject_prefix=prefix,
        instance_id="ctl-m",
        num_gpus=8,
        degrees=[2, 4],
        initial_composition=initial,
        kappa=KAPPA,
        window_s=H,
        tick_s=0.05,
        report_grace_s=0.05,
        queue_query_timeout_s=0.3,
    )
    base.update(kw)
    return ControllerSettings(**base)


def layout(rec: EpochRecord) -> dict[str, str]:
    return {w.worker_id: w.lifecycle.value for w in rec.workers}


def assert_partition(rec: EpochRecord, gpus: int) -> None:
    """Every GPU belongs to exactly one worker of the record: no two geometries overlap."""
    owned = sorted(g for w in rec.workers for g in w.group.gpus)
    assert owned == list(range(gpus)), (rec.epoch, layout(rec))


def test_live_defaults_are_the_calibrated_values(monkeypatch) -> None:
    for f in dataclasses.fields(ControllerConfig):
        monkeypatch.delenv(f"VTM_{f.name.upper()}", raising=False)
    monkeypatch.delenv("VTM_KAPPA_SCALE", raising=False)
    monkeypatch.delenv("VTM_DEMAND_INPUT", raising=False)
    st = ControllerSettings()
    for f in dataclasses.fields(ControllerConfig):
        assert getattr(st, f.name) == getattr(CONTROLLER, f.name), f.name
    assert st.kappa_scale == KAPPA_SCALE
    # Either demand input runs exactly the simulator's config (window reports carry the
    # demand by preferred degree the merge gate reads).
    assert ControllerSettings(demand_input="assignments").controller_config() == CONTROLLER
    assert st.controller_config() == CONTROLLER
    # κ is scaled as the simulator scales the controller's profile.
    prof = DEFAULT_PROFILE.with_kappa({2: 8.0, 4: 14.0})
    assert st.judging_profile(prof) == controller_profile(prof, KAPPA_SCALE)
    assert st.judging_profile(prof).kappa_for(4) == 14.0 * KAPPA_SCALE
    one = ControllerSettings(kappa_scale=1.0)
    assert one.judging_profile(prof) is prof


async def test_two_splits_in_one_plan_share_one_drain_record(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    # Each source has one queued and one running request.
    for wid in ("w-cp4-g0", "w-cp4-g4"):

        async def answer(msg, wid: str = wid) -> None:
            rep = QueueReport(worker_id=wid, queued=[f"q-{wid}"], in_flight=[f"f-{wid}"])
            data, headers = encode(rep)
            await nc.publish(msg.reply, data, headers=headers)

        await nc.subscribe(worker_queue_subject(s, wid), cb=answer)
    drains, reconfs, comps = Collector(), Collector(), Collector()
    await nc.subscribe(drain_subject(s), cb=drains.cb)
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    await nc.subscribe(composition_subject(s), cb=comps.cb)
    await nc.flush()
    ranks = FakeRanks(nc, s)
    await ranks.start()
    sched = FakeScheduler(nc, s, H, lambda: 7.0)
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "2CP4")))

    async def finish(wid: str) -> None:
        done = FirstToken(
            request_id=f"f-{wid}",
            token=1,
            worker_id=wid,
            epoch=0,
            stages=TtftStages(),
            finished_at_s=time.time(),
        )
        data, headers = encode(done)
        await nc.publish(s.result(f"f-{wid}"), data, headers=headers)

    try:
        await sched.start()

        async def two_notices() -> bool:
            return len(drains.items) >= 2

        await eventually(two_notices, what="a drain notice per operation")
        d1, d2 = sorted(drains.items[:2], key=lambda d: d["sources"])
        assert d1["kind"] == d2["kind"] == "split"
        assert d1["sources"] == ["w-cp4-g0"] and d2["sources"] == ["w-cp4-g4"]
        assert d1["targets"] == ["w-cp2-g0", "w-cp2-g2"]
        assert d2["targets"] == ["w-cp2-g4", "w-cp2-g6"]
        # One plan, one drain record: both sources stopped admitting in the same record.
        assert d1["epoch"] == d2["epoch"] == 1
        assert d1["plan"] == d2["plan"] == sorted([d1["reconfiguration"], d2["reconfiguration"]])
        assert [r["request_id"] for r in d1["redirected"]] == ["q-w-cp4-g0"]
        assert [r["request_id"] for r in d2["redirected"]] == ["q-w-cp4-g4"]
        kv = await epoch_kv(nc.jetstream(), s)
        stored = decode(EpochRecord, (await kv.get(s.epoch_key())).value)
        assert stored.epoch == 1
        assert layout(stored) == {"w-cp4-g0": "draining", "w-cp4-g4": "draining"}
        body = ctl.inspect()
        assert body["pending_plans"] == [] and len(body["in_progress"]) == 2

        # g4's running request finishes: its operation commits alone; g0 keeps its geometry
        # (still draining, its request still running) in every record until its own finishes.
        await finish("w-cp4-g4")
        c4 = await reconfs.first(
            lambda r: r["phase"] == "committed" and r["sources"] == ["w-cp4-g4"],
            what="the g4 split committed",
        )

        # ... and is exposed on its own acks while g0 still drains under its old geometry.
        async def g4_exposed_g0_draining() -> bool:
            return any(
                layout(r) == {"w-cp4-g0": "draining", "w-cp2-g4": "active", "w-cp2-g6": "active"}
                for r in ranks.records
            )

        await eventually(g4_exposed_g0_draining, what="g4's targets active beside draining g0")
        assert not [
            r for r in reconfs.items if r["phase"] == "committed" and r["sources"] == ["w-cp4-g0"]
        ]
        assert all("w-cp4-g0" in layout(r) for r in ranks.records)

        await finish("w-cp4-g0")

        async def both_exposed() -> bool:
            return ctl.counters["exposed"] == 2

        await eventually(both_exposed, what="both splits exposed")
        comp = await comps.first(
            lambda c: c["composition"] == "4CP2" and len(c["schedulable"]) == 4,
            what="4CP2 published, all schedulable",
        )
        assert sorted(comp["schedulable"]) == ["w-cp2-g0", "w-cp2-g2", "w-cp2-g4", "w-cp2-g6"]
        for rid in (d1["reconfiguration"], d2["reconfiguration"]):
            phases = [r["phase"] for r in reconfs.items if r["reconfiguration"] == rid]
            assert phases == ["draining", "drained", "committed", "ready", "exposed"], phases
        c0 = next(
            r for r in reconfs.items if r["phase"] == "committed" and r["sources"] == ["w-cp4-g0"]
        )
        assert c4["epoch"] != c0["epoch"]  # each operation committed under its own epoch

        # The notice names the record written just before it; the ranks' watch of the key is
        # another delivery, which may reach this client after the notice.
        async def ranks_have_it() -> bool:
            return any(r.epoch == comp["epoch"] for r in ranks.records)

        await eventually(ranks_have_it, what="the ranks' copy of the final record")
        # Every record partitions the GPUs; a retired source never reappears; the final
        # record is the whole new composition, all active.
        for r in ranks.records:
            assert_partition(r, 8)
        retired = [i for i, r in enumerate(ranks.records) if "w-cp4-g0" not in layout(r)]
        assert retired == list(range(retired[0], len(ranks.records)))
        stored = decode(EpochRecord, (await kv.get(s.epoch_key())).value)
        assert layout(stored) == {w: "active" for w in comp["schedulable"]}
        assert stored.epoch == comp["epoch"] == ranks.records[-1].epoch
        assert ctl.counters["acks"] == 8  # every rank of the four targets, once
        assert ctl.counters["plans"] == 1 and ctl.counters["finished"] == 2
        body = ctl.inspect()
        assert body["composition"] == "4CP2" and body["in_progress"] == []
        assert body["config"]["max_ops"] == CONTROLLER.max_ops
        assert body["kappa"] == {"2": 1.0 * KAPPA_SCALE, "4": 1.0 * KAPPA_SCALE}
    finally:
        await sched.stop()
        await ranks.stop()


@contextlib.asynccontextmanager
async def two_merges(nc: Client, url: str, uniq: str, services, *,
                     ranks_kw: dict[str, Any] | None = None,
                     prepare: Callable[[ControllerService], None] | None = None,
                     **settings_kw: Any) -> AsyncIterator[tuple[Any, ...]]:
    """4CP2 at a demand of one worker: one plan of two merges. No queue endpoint and no worker
    state, so nothing is known to run: the sources are drained at once and each merge commits
    straight away. ``prepare`` gets the controller before any window closes. Yields
    (controller, ranks, the first 2CP4 composition notice with both workers schedulable, drain
    notices, subjects)."""
    s = Subjects(uniq)
    drains, comps = Collector(), Collector()
    await nc.subscribe(drain_subject(s), cb=drains.cb)
    await nc.subscribe(composition_subject(s), cb=comps.cb)
    await nc.flush()
    ranks = FakeRanks(nc, s, **(ranks_kw or {}))
    await ranks.start()
    sched = FakeScheduler(nc, s, H, lambda: 1.0)
    ctl = await services(ControllerService(settings(url, uniq, "4CP2", **settings_kw)))
    if prepare is not None:
        prepare(ctl)
    try:
        await sched.start()
        comp = await comps.first(
            lambda c: c["composition"] == "2CP4" and len(c["schedulable"]) == 2,
            what="2CP4 exposed, both schedulable",
        )
        assert sorted(comp["schedulable"]) == ["w-cp4-g0", "w-cp4-g4"]
        yield ctl, ranks, comp, drains, s
    finally:
        await sched.stop()
        await ranks.stop()


async def stored_layout(nc: Client, s: Subjects) -> dict[str, str]:
    kv = await epoch_kv(nc.jetstream(), s)
    return layout(decode(EpochRecord, (await kv.get(s.epoch_key())).value))


async def test_two_merges_in_one_plan_of_unanswering_workers(
    nc: Client, nats_server, uniq: str, services
):
    async with two_merges(nc, nats_server.url, uniq, services) as (ctl, ranks, _, drains, s):
        assert len(drains.items) == 2
        assert {d["epoch"] for d in drains.items} == {1}
        assert sorted(tuple(d["sources"]) for d in drains.items) == [
            ("w-cp2-g0", "w-cp2-g2"),
            ("w-cp2-g4", "w-cp2-g6"),
        ]
        # One drain record stops all four sources. None is parked in it although none had
        # work when asked: a source may start a request until it adopts that very record
        # (test_live_drain_late_start.py); each is drained once it acknowledged it.
        drain_record = next(r for r in ranks.records if r.epoch == 1)
        assert layout(drain_record) == {f"w-cp2-g{g}": "draining" for g in (0, 2, 4, 6)}
        for r in ranks.records:
            assert_partition(r, 8)
        assert ctl.counters["plans"] == 1 and ctl.counters["exposed"] == 2
        assert ctl.counters["acks"] == 8
        assert await stored_layout(nc, s) == {"w-cp4-g0": "active", "w-cp4-g4": "active"}


async def test_merge_target_acking_a_later_record_is_exposed(
    nc: Client, nats_server, uniq: str, services
):
    """Both merges of one plan commit within milliseconds (nothing to drain). The ranks finish
    switching only after both commit records exist, so the first merge's target acknowledges
    the *second* commit record, never its own. That ack counts (every record from its commit
    on shows it switching in the same geometry): `vertumnus up` once kept such a target
    switching for the whole replay, half the pool idle."""
    async with two_merges(nc, nats_server.url, uniq, services,
                          ranks_kw={"coalesce_s": 0.3}) as (ctl, ranks, _, _, s):
        # Records 2 and 3 commit the two merges; the ranks skipped record 2.
        commits = [r.epoch for r in ranks.records
                   if {"w-cp4-g0", "w-cp4-g4"} & set(layout(r))
                   and "active" not in layout(r).values()]
        assert commits[:2] == [2, 3]
        assert 2 not in ranks.acked and 3 in ranks.acked
        assert ctl.counters["exposed"] == 2 and ctl.counters["acks"] == 8
        assert await stored_layout(nc, s) == {"w-cp4-g0": "active", "w-cp4-g4": "active"}


async def test_lost_acks_are_recovered_by_re_announcing_the_record(
    nc: Client, nats_server, uniq: str, services
):
    """Every ack of both merges' commit records (2 and 3) is lost. After ``ack_timeout_s``
    without a record the controller writes the same composition again; the ranks adopt it and
    ack, and both targets are exposed."""
    async with two_merges(nc, nats_server.url, uniq, services,
                          ranks_kw={"lose_epochs": frozenset({2, 3})},
                          ack_timeout_s=0.5) as (ctl, ranks, _, _, _):
        assert ctl.counters["reannounced"] >= 1 and ctl.counters["exposed"] == 2
        re = next(r for r in ranks.records if r.epoch == 4)
        # The re-announced record is the commit records' composition, both targets switching.
        assert layout(re) == {"w-cp4-g0": "switching", "w-cp4-g4": "switching"}
        assert {2, 3}.isdisjoint(ranks.acked) and 4 in ranks.acked


def fail_first_write(reason_prefix: str, failed: list[int]) -> Callable[[ControllerService], None]:
    """Fault injection: the controller's first record write whose reason starts with
    ``reason_prefix`` times out, as a JetStream KV update can (the record is not stored)."""

    def prepare(ctl: ControllerService) -> None:
        write = ctl._write

        async def flaky(record: EpochRecord) -> None:
            if record.reason.startswith(reason_prefix) and not failed:
                failed.append(record.epoch)
                raise nats.errors.TimeoutError
            await write(record)

        ctl._write = flaky  # type: ignore[method-assign]

    return prepare


async def test_a_commit_record_that_failed_to_write_is_recovered(
    nc: Client, nats_server, uniq: str, services
):
    """The first merge's commit record is never stored (after the protocol committed it): its
    target is re-announced and the plan's second merge, never committed behind the failed
    write, is committed; both end exposed."""
    failed: list[int] = []
    async with two_merges(nc, nats_server.url, uniq, services, ack_timeout_s=0.5,
                          prepare=fail_first_write("commit", failed)) as (ctl, _, _, _, s):
        assert len(failed) == 1
        assert ctl.counters["reannounced"] >= 1 and ctl.counters["exposed"] == 2
        assert await stored_layout(nc, s) == {"w-cp4-g0": "active", "w-cp4-g4": "active"}


async def test_an_exposure_record_that_failed_to_write_is_retried(
    nc: Client, nats_server, uniq: str, services
):
    failed: list[int] = []
    async with two_merges(nc, nats_server.url, uniq, services, ack_timeout_s=0.5,
                          prepare=fail_first_write("expose", failed)) as (ctl, _, _, _, s):
        assert len(failed) == 1 and ctl.counters["exposed"] == 2
        assert await stored_layout(nc, s) == {"w-cp4-g0": "active", "w-cp4-g4": "active"}
