"""The controller and the cache manager with real rank daemons (rankd, sim backend).

Wire compatibility end to end: rankd's cache events and snapshots build the cache manager's
trie, a scan's replicate command is executed by the destination rankd and becomes visible
through that rankd's own stored event; the controller's drain record is adopted by a real rank
daemon, which stops admitting, and its WorkerState (rankd has no queue endpoint) tells the
controller when its running request finished, so the split commits. (The split cannot be
exposed here: rankd runs one fixed worker id per process, so no daemon serves the targets.)
"""

from __future__ import annotations

import json
import time
from typing import Any

from gated_backend import GatedBackend
from live_ctl_support import Collector, FakeScheduler, eventually, request
from nats.aio.client import Client

from services.cachemgr.service import CacheMgrService, CacheMgrSettings, cachemgr_group
from services.controller.service import (
    ControllerService,
    ControllerSettings,
    drain_subject,
    reconf_subject,
)
from services.rankd.backend import SimBackend
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.schemas import Assignment, AssignmentAck, IntakeRequest
from shared.service import call
from shared.subjects import Subjects


def rankd(url: str, prefix: str, wid: str) -> RankdService:
    settings = RankdSettings(
        nats_url=url, subject_prefix=prefix, worker_id=wid, heartbeat_s=0.2, kv_total_blocks=64
    )
    return RankdService(settings, SimBackend(prefill_time=lambda r, p, c, kind="cp": 0.01))


def assignment(rid: str, wid: str, degree: int, hashes: list[int]) -> Assignment:
    now = time.time()
    n = 512 * len(hashes) + 10
    return Assignment(
        request=IntakeRequest(
            request_id=rid, input_len=n, block_hashes=hashes, arrival_s=now - 0.01
        ),
        worker_id=wid,
        epoch=0,
        degree=degree,
        prefix_tokens=0,
        recompute_tokens=n,
        predicted_s=0.01,
        dequeued_at_s=now,
        assigned_at_s=now,
    )


async def test_cachemgr_with_real_rank_daemons(nc: Client, nats_server, uniq: str, services):
    s = Subjects(uniq)
    a = await services(rankd(nats_server.url, uniq, "w-cp2-g0"))
    await services(rankd(nats_server.url, uniq, "w-cp2-g2"))
    await services(
        CacheMgrService(
            CacheMgrSettings(
                nats_url=nats_server.url,
                subject_prefix=uniq,
                degrees=[2, 4],
                scan_interval_s=0.2,
                theta_inter=1e9,
                theta_intra=0.5,
                theta_reclaim=0.1,
                decay=0.5,
            )
        )
    )
    await call(
        nc, s.worker_assign("w-cp2-g0"), assignment("r1", "w-cp2-g0", 2, [7, 8, 9]), AssignmentAck
    )

    async def trie(match: list[int]) -> dict[str, Any]:
        msg = await request(
            nc, f"{cachemgr_group(s)}.inspect", json.dumps({"match": match}).encode()
        )
        return json.loads(msg.data)

    async def a_holds() -> dict[str, Any] | None:
        body = await trie([7, 8, 9])
        return body if body["match"]["held"].get("w-cp2-g0") == 3 else None

    await eventually(a_holds, what="rankd's stored event in the trie")
    for i in range(3):
        stats = {
            "schema_version": 1,
            "request_id": f"s{i}",
            "reporter": "s1",
            "worker_id": "w-cp2-g0",
            "degree": 2,
            "input_len": 1546,
            "block_hashes": [7, 8, 9],
            "reused_blocks": 3,
            "prefix_tokens": 1536,
            "preferred_degree": 2,
            "preferred_worker": "w-cp2-g0",
            "predicted_s": 0.01,
            "policy": "vertumnus",
            "at_s": time.time(),
        }
        await nc.publish(f"{uniq}.cache.stats.s1", json.dumps(stats).encode())

    async def replicated() -> dict[str, Any] | None:
        body = await trie([7, 8, 9])
        ok = body["match"]["held"].get("w-cp2-g2", 0) >= 1 and body["counters"]["commands_ok"]
        return body if ok else None

    body = await eventually(replicated, what="a replica installed and confirmed by rankd")
    assert body["workers"]["w-cp2-g2"]["last_event_id"] >= 1  # visible through its own event
    assert a.core.worker_id == "w-cp2-g0"




async def test_controller_drains_real_rank_daemons(nc: Client, nats_server, uniq: str, services):
    s = Subjects(uniq)
    drains, reconfs = Collector(), Collector()
    await nc.subscribe(drain_subject(s), cb=drains.cb)
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    await nc.flush()
    ctl = await services(
        ControllerService(
            ControllerSettings(
                nats_url=nats_server.url,
                subject_prefix=uniq,
                instance_id="ctl-r",
                num_gpus=8,
                degrees=[2, 4],
                initial_composition="2CP4",
                kappa={2: 1.0, 4: 1.0},
                window_s=0.2,
                tick_s=0.05,
                report_grace_s=0.05,
                persistence=2,
                queue_query_timeout_s=0.3,
                # The one-operation planner with unscaled κ (this test's demand arithmetic).
                kappa_scale=1.0,
                upper=0.9,
                merge_headroom=0.8,
                max_ops=1,
                split_target=0.8,
                momentum=True,
            )
        )
    )
    backends = {w: GatedBackend() for w in ("w-cp4-g0", "w-cp4-g4")}
    for w, b in backends.items():
        await services(
            RankdService(
                RankdSettings(
                    nats_url=nats_server.url,
                    subject_prefix=uniq,
                    worker_id=w,
                    heartbeat_s=0.2,
                    kv_total_blocks=64,
                ),
                b,
            )
        )
    # w-cp4-g0 has much more outstanding work, so the planner splits w-cp4-g4 (drains sooner).
    for i, (w, pred) in enumerate([("w-cp4-g0", 5.0), ("w-cp4-g0", 5.0), ("w-cp4-g4", 0.5)]):
        a = assignment(f"r{i}", w, 4, [100 + i]).model_copy(update={"predicted_s": pred})
        await call(nc, s.worker_assign(w), a, AssignmentAck)

    async def states_known() -> bool:
        st = ctl._states
        return (
            "w-cp4-g4" in st
            and st["w-cp4-g4"].queue_len == 1
            and "w-cp4-g0" in st
            and st["w-cp4-g0"].outstanding_s > st["w-cp4-g4"].outstanding_s
        )

    await eventually(states_known, what="both workers' states at the controller")
    sched = FakeScheduler(nc, s, 0.2, lambda: 2.5)  # splits 2CP4 (K = 2) once, not 2CP2/1CP4
    await sched.start()
    try:
        drain = await drains.first(what="drain notice")
        assert drain["sources"] == ["w-cp4-g4"]
        # rankd has no queue endpoint: the controller judged it from its WorkerState.
        assert drain["in_flight"] == {"w-cp4-g4": 1} and drain["redirected"] == []

        async def draining() -> bool:
            return ctl._states["w-cp4-g4"].lifecycle.value == "draining"

        await eventually(draining, what="rankd adopted the drain record")
        assert not [r for r in reconfs.items if r["phase"] == "committed"]
        backends["w-cp4-g4"].gate.set()  # its running request finishes
        committed = await reconfs.first(
            lambda r: r["phase"] == "committed", what="commit after the real worker drained"
        )
        assert committed["sources"] == ["w-cp4-g4"]
        assert ctl.counters["finished"] == 1
        body = ctl.inspect()
        assert body["in_progress"][0]["phase"] == "committed"  # targets have no rank daemon
        assert body["record_epoch"] == 2
    finally:
        for b in backends.values():
            b.gate.set()
        await sched.stop()


async def test_split_drain_notice_rehomes_the_parents_long_prefix(
    nc: Client, nats_server, uniq: str, services
):
    """The controller's DrainNotice of a split makes the cache manager copy the parent's long
    prefixes to the other worker of its degree (rehome_on_split, as the simulator does at the
    split's start); a merge's notice copies nothing."""
    from shared.schemas import DrainNotice, encode

    s = Subjects(uniq)
    await services(rankd(nats_server.url, uniq, "w-cp4-g0"))
    await services(rankd(nats_server.url, uniq, "w-cp4-g4"))
    cm = await services(
        CacheMgrService(
            CacheMgrSettings(
                nats_url=nats_server.url, subject_prefix=uniq, degrees=[2, 4],
                scan_interval_s=3600.0,  # no scan: every copy here is a re-homing
                rehome_min_blocks=3,
            )
        )
    )
    doc = [11, 12, 13, 14]  # a 4-block "document" (>= rehome_min_blocks)
    await call(nc, s.worker_assign("w-cp4-g0"), assignment("d1", "w-cp4-g0", 4, doc),
               AssignmentAck)

    async def held() -> dict[str, int]:
        msg = await request(nc, f"{cachemgr_group(s)}.inspect",
                            json.dumps({"match": doc}).encode())
        return json.loads(msg.data)["match"]["held"]

    async def parent_holds() -> bool:
        return (await held()).get("w-cp4-g0") == 4 and "w-cp4-g4" in cm.trie.workers()

    await eventually(parent_holds, what="the parent's document in the trie")

    async def notice(kind: str, sources: list[str], targets: list[str]) -> None:
        data, headers = encode(DrainNotice(reconfiguration=1, kind=kind, epoch=1,
                                           sources=sources, targets=targets,
                                           issued_at_s=time.time()))
        await nc.publish(drain_subject(s), data, headers=headers)

    await notice("merge", ["w-cp4-g0"], ["w-cp8-g0"])  # not a split: nothing moves
    await notice("split", ["w-cp4-g0"], ["w-cp2-g0", "w-cp2-g2"])

    async def rehomed() -> bool:
        return (await held()).get("w-cp4-g4") == 4

    await eventually(rehomed, what="the document copied to the other CP4 worker")
    assert cm.counters["rehomed"] == 1  # one copy, from the split's notice only


async def test_a_pull_between_real_rank_daemons_demotes_the_sources_copy(
    nc: Client, nats_server, uniq: str, services
):
    """End to end with two real rank daemons of six blocks each: a request for [7, 8, 9, 10]
    routed to g2 pulls [7, 8, 9] from g0, g2's reply counts the path it now holds, and the
    manager demotes the copied blocks at g0 (pull.py ``demotion``). g0 then needs room for
    two new blocks: the one it evicts is 9, the demoted chain's leaf -- not 2, the leaf of
    the older request [1, 2], which plain LRU would take."""
    s = Subjects(uniq)

    def small(wid: str) -> RankdService:
        return RankdService(
            RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, worker_id=wid,
                          heartbeat_s=0.2, kv_total_blocks=6),
            SimBackend(prefill_time=lambda r, p, c, kind="cp": 0.01))

    await services(small("w-cp2-g0"))
    await services(small("w-cp2-g2"))
    await services(CacheMgrService(CacheMgrSettings(
        nats_url=nats_server.url, subject_prefix=uniq, degrees=[2, 4], scan_interval_s=0.2,
        theta_inter=1e9, theta_intra=1e9, theta_reclaim=0.0, decay=0.5,
        pull=True, pull_min_blocks=1, pull_demote=True)))

    async def trie(match: list[int]) -> dict[str, Any]:
        msg = await request(
            nc, f"{cachemgr_group(s)}.inspect", json.dumps({"match": match}).encode()
        )
        return json.loads(msg.data)

    def holds(match: list[int], wid: str, n: int, what: str) -> Any:
        async def check() -> dict[str, Any] | None:
            body = await trie(match)
            return body if body["match"]["held"].get(wid, 0) == n else None
        return eventually(check, what=what)

    for rid, hashes in (("r0", [1, 2]), ("r1", [7, 8, 9])):
        await call(nc, s.worker_assign("w-cp2-g0"), assignment(rid, "w-cp2-g0", 2, hashes),
                   AssignmentAck)
        await holds(hashes, "w-cp2-g0", len(hashes), f"{rid}'s blocks cached at g0")
    stats = {
        "schema_version": 1, "request_id": "r2", "reporter": "s1", "worker_id": "w-cp2-g2",
        "degree": 2, "input_len": 2058, "block_hashes": [7, 8, 9, 10], "reused_blocks": 0,
        "prefix_tokens": 0, "preferred_degree": 2, "preferred_worker": "w-cp2-g2",
        "predicted_s": 0.01, "policy": "vertumnus", "at_s": time.time(),
    }
    await nc.publish(f"{uniq}.cache.stats.s1", json.dumps(stats).encode())

    async def demoted() -> dict[str, Any] | None:
        body = await trie([7, 8, 9])
        return body if body["counters"]["demotes_ok"] == 1 else None

    body = await eventually(demoted, what="the pull landed and its source demoted")
    assert body["match"]["held"] == {"w-cp2-g0": 3, "w-cp2-g2": 3}
    assert (body["counters"]["pulls"], body["counters"]["commands_ok"]) == (1, 1)
    await call(nc, s.worker_assign("w-cp2-g0"), assignment("r3", "w-cp2-g0", 2, [20, 21]),
               AssignmentAck)
    await holds([20, 21], "w-cp2-g0", 2, "r3's blocks cached at g0")
    await holds([7, 8, 9], "w-cp2-g0", 2, "g0's eviction seen by the trie")
    assert (await trie([1, 2]))["match"]["held"]["w-cp2-g0"] == 2


async def test_split_rehome_displaces_a_full_peers_colder_blocks(
    nc: Client, nats_server, uniq: str, services
):
    """A split's parent holds a document its requests reused; the other CP4 worker's cache
    (six blocks) is full: a hot prefix cached first, a never-reused one last. With
    ``rehome_displace`` the DrainNotice makes the cache manager demote the peer's three cold
    blocks, then copy the document there: the peer evicts the cold prefix and keeps the hot
    one, which its plain LRU order would have evicted first (reconcile.py ``rehome_on_split``)."""
    from shared.schemas import DrainNotice, encode

    s = Subjects(uniq)
    await services(rankd(nats_server.url, uniq, "w-cp4-g0"))
    await services(RankdService(
        RankdSettings(nats_url=nats_server.url, subject_prefix=uniq, worker_id="w-cp4-g4",
                      heartbeat_s=0.2, kv_total_blocks=6),
        SimBackend(prefill_time=lambda r, p, c, kind="cp": 0.01)))
    cm = await services(CacheMgrService(CacheMgrSettings(
        nats_url=nats_server.url, subject_prefix=uniq, degrees=[2, 4],
        scan_interval_s=3600.0,  # no scan: no decay, and every copy is a re-homing
        rehome_min_blocks=3, rehome_fill=1.0, rehome_displace=True)))
    doc, hot, cold = [11, 12, 13], [31, 32, 33], [21, 22, 23]
    for rid, wid, hashes in (("d", "w-cp4-g0", doc), ("h", "w-cp4-g4", hot),
                             ("c", "w-cp4-g4", cold)):
        await call(nc, s.worker_assign(wid), assignment(rid, wid, 4, hashes), AssignmentAck)

    async def held(match: list[int]) -> dict[str, int]:
        msg = await request(nc, f"{cachemgr_group(s)}.inspect",
                            json.dumps({"match": match}).encode())
        return json.loads(msg.data)["match"]["held"]

    async def cached() -> bool:
        return ((await held(doc)).get("w-cp4-g0") == 3 and (await held(hot)).get("w-cp4-g4") == 3
                and (await held(cold)).get("w-cp4-g4") == 3)

    await eventually(cached, what="the three prefixes in the trie")
    for h in doc:  # reused twice (the scan's statistics; no scan runs here to decay them)
        cm.trie.set_statistics(h, 4, access=2.0)
    for h in hot:
        cm.trie.set_statistics(h, 4, access=5.0)
    data, headers = encode(DrainNotice(reconfiguration=1, kind="split", epoch=1,
                                       sources=["w-cp4-g0"], targets=["w-cp2-g0", "w-cp2-g2"],
                                       issued_at_s=time.time()))
    await nc.publish(drain_subject(s), data, headers=headers)

    async def rehomed() -> bool:
        return (await held(doc)).get("w-cp4-g4") == 3 and "w-cp4-g4" not in await held(cold)

    await eventually(rehomed, what="the document copied over the peer's cold prefix")
    assert (await held(hot)).get("w-cp4-g4") == 3
    assert (cm.counters["rehomed"], cm.counters["demotes_ok"]) == (1, 1)
