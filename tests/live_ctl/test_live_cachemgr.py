"""The live cache manager against a real nats-server, with fake workers as plain subscribers.

Events of two workers build the trie; a gap triggers a snapshot request whose reply is
applied; a scan with low thresholds sends a replicate command to the worker lacking a hot
prefix and the replica becomes visible only with that worker's own stored event; an epoch
change reconciles a split and a request routed to a child with pending pages sends a lazy
reconcile command; malformed input gets 400 / is dropped while the service keeps running.
"""

from __future__ import annotations

import json
import time
from typing import Any

from live_ctl_support import Collector, eventually, request
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.cachemgr.service import CacheMgrService, CacheMgrSettings, cachemgr_group
from shared.schemas import (
    CacheCommandResult,
    CacheSnapshot,
    CacheStored,
    EpochRecord,
    EpochWorker,
    WorkerState,
    encode,
    to_json,
)
from shared.service import epoch_kv, worker_state_kv
from shared.subjects import Subjects
from shared.worker import Lifecycle

A, B = "w-cp2-g0", "w-cp2-g2"


def settings(url: str, prefix: str, **kw: Any) -> CacheMgrSettings:
    base: dict[str, Any] = dict(
        nats_url=url,
        subject_prefix=prefix,
        degrees=[2, 4],
        scan_interval_s=3600.0,
        housekeeping_s=0.1,
        snapshot_timeout_s=2.0,
        command_timeout_s=2.0,
    )
    base.update(kw)
    return CacheMgrSettings(**base)


async def inspect(nc: Client, prefix: str, match: list[int] | None = None) -> dict[str, Any]:
    body = json.dumps({"match": match}).encode() if match is not None else b""
    msg = await request(nc, f"{cachemgr_group(Subjects(prefix))}.inspect", body)
    return json.loads(msg.data)


def epoch_record(epoch: int, groups: list[tuple[int, int]]) -> bytes:
    """An all-ACTIVE EpochRecord of (first GPU, degree) groups, as JSON."""
    return to_json(
        EpochRecord(
            epoch=epoch,
            committed_at_s=time.time(),
            workers=[
                EpochWorker(
                    worker_id=f"w-cp{d}-g{g}", first_gpu=g, degree=d, lifecycle=Lifecycle.ACTIVE
                )
                for g, d in groups
            ],
        )
    )


async def acking_worker(nc: Client, s: Subjects, worker: str) -> Collector:
    """A stand-in for ``worker``'s cache-command endpoint: collects each command and answers
    it ok. Subscribed and flushed when this returns."""
    cmds = Collector()

    async def on_command(msg: Msg) -> None:
        await cmds.cb(msg)
        cmd = json.loads(msg.data)
        await reply(
            nc, msg, CacheCommandResult(command_id=cmd["command_id"], worker_id=worker, ok=True)
        )

    await nc.subscribe(s.cache_cmd(worker), cb=on_command)
    await nc.flush()
    return cmds


async def stored(
    nc: Client, s: Subjects, worker: str, eid: int, parent: int | None, blocks: list[int]
) -> None:
    ev = CacheStored(worker=worker, event_id=eid, parent_hash=parent, block_hashes=blocks)
    data, headers = encode(ev)
    await nc.publish(s.cache_events(worker), data, headers=headers)


async def reply(nc: Client, msg: Msg, message: Any) -> None:
    data, headers = encode(message)
    await nc.publish(msg.reply, data, headers=headers)


def state(wid: str, gpus: list[int], blocks: int = 64) -> WorkerState:
    return WorkerState(
        worker_id=wid,
        degree=len(gpus),
        gpus=gpus,
        epoch=0,
        lifecycle=Lifecycle.ACTIVE,
        queue_len=0,
        outstanding_s=0.0,
        kv_free_blocks=blocks,
        kv_total_blocks=blocks,
        heartbeat_s=time.time(),
    )


def stats(worker: str, degree: int, hashes: list[int], reused: int, rid: str) -> bytes:
    return json.dumps(
        {
            "schema_version": 1,
            "request_id": rid,
            "reporter": "s1",
            "worker_id": worker,
            "degree": degree,
            "input_len": 512 * len(hashes) + 100,
            "block_hashes": hashes,
            "reused_blocks": reused,
            "prefix_tokens": 512 * reused,
            "preferred_degree": degree,
            "preferred_worker": worker,
            "predicted_s": 0.5,
            "policy": "vertumnus",
            "at_s": time.time(),
        }
    ).encode()


async def test_events_build_the_trie_and_a_gap_brings_a_snapshot(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    snapshot_requests: list[str] = []

    async def snapshot_of_a(msg: Msg) -> None:
        snapshot_requests.append(msg.subject)
        await reply(
            nc,
            msg,
            CacheSnapshot(
                worker=A,
                last_event_id=3,
                blocks=[(11, None), (12, 11), (13, 12), (14, 13), (15, 14)],
            ),
        )

    await nc.subscribe(s.cache_snapshot(A), cb=snapshot_of_a)
    await nc.flush()
    await services(CacheMgrService(settings(nats_server.url, uniq)))

    await stored(nc, s, A, 1, None, [11, 12, 13])
    await stored(nc, s, B, 1, None, [11, 21])

    async def built() -> dict[str, Any] | None:
        body = await inspect(nc, uniq, match=[11, 12, 13])
        return body if body["counters"]["events_applied"] == 2 else None

    body = await eventually(built, what="two workers' events applied")
    assert body["nodes"] == 4  # 11, 12, 13, 21
    assert body["workers"][A]["blocks"] == 3 and body["workers"][B]["blocks"] == 2
    assert body["match"] == {"matched_blocks": 3, "held": {A: 3, B: 1}}
    assert not snapshot_requests and body["stale_workers"] == []

    # Event 2 of A is lost: event 3 shows a gap; the snapshot replaces A's view.
    await stored(nc, s, A, 3, 13, [14])

    async def healed() -> dict[str, Any] | None:
        body = await inspect(nc, uniq, match=[11, 12, 13, 14, 15])
        ok = body["counters"]["snapshots_applied"] >= 1 and not body["workers"][A]["stale"]
        return body if ok else None

    body = await eventually(healed, what="snapshot applied after the gap")
    assert snapshot_requests and body["counters"]["gaps"] == 1
    assert body["workers"][A]["blocks"] == 5 and body["workers"][A]["last_event_id"] == 3
    assert body["match"]["held"] == {A: 5, B: 1}
    # Later events continue from the snapshot's id; a replay of an old one is a duplicate.
    await stored(nc, s, A, 4, 15, [16])
    await stored(nc, s, A, 2, 11, [99])

    async def continued() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        c = body["counters"]
        return body if c["events_applied"] == 3 and c["duplicates"] == 1 else None

    body = await eventually(continued, what="events after the snapshot")
    assert body["workers"][A]["blocks"] == 6 and body["counters"]["gaps"] == 1


async def test_an_unanswered_snapshot_is_asked_again(
    nc: Client, nats_server, uniq: str, services
):
    """A worker tracked from its state whose snapshot endpoint is not up yet: the manager
    asks again (housekeeping) and learns the blocks it holds, with no cache event."""
    s = Subjects(uniq)
    states = await worker_state_kv(nc.jetstream(), s)
    await states.put(B, to_json(state(B, [2, 3])))
    await services(CacheMgrService(settings(nats_server.url, uniq)))

    async def unanswered() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        return body if B in body["workers"] and body["counters"]["snapshots_failed"] else None

    body = await eventually(unanswered, what="B tracked, its snapshot unanswered")
    assert body["workers"][B]["blocks"] == 0

    async def b_snapshot(msg: Msg) -> None:
        await reply(nc, msg, CacheSnapshot(worker=B, last_event_id=0,
                                           blocks=[(31, None), (32, 31)]))

    await nc.subscribe(s.cache_snapshot(B), cb=b_snapshot)

    async def learnt() -> dict[str, Any] | None:
        body = await inspect(nc, uniq, match=[31, 32])
        return body if body["counters"]["snapshots_applied"] else None

    body = await eventually(learnt, what="the snapshot asked again and applied")
    assert body["workers"][B]["blocks"] == 2 and body["match"]["held"] == {B: 2}


async def test_scan_replicates_to_the_right_worker_visible_only_after_its_event(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    states = await worker_state_kv(nc.jetstream(), s)
    commands = Collector()

    async def b_snapshot(msg: Msg) -> None:
        await reply(nc, msg, CacheSnapshot(worker=B, last_event_id=0, blocks=[]))

    async def b_command(msg: Msg) -> None:
        await commands.cb(msg)
        cmd = json.loads(msg.data)
        await reply(
            nc,
            msg,
            CacheCommandResult(
                command_id=cmd["command_id"], worker_id=B, ok=True, blocks_done=len(cmd["blocks"])
            ),
        )

    await nc.subscribe(s.cache_snapshot(B), cb=b_snapshot)
    await nc.subscribe(s.cache_cmd(B), cb=b_command)
    a_commands = Collector()
    await nc.subscribe(s.cache_cmd(A), cb=a_commands.cb)  # the holder must not be asked
    await nc.flush()
    await states.put(B, to_json(state(B, [2, 3])))
    await services(
        CacheMgrService(
            settings(
                nats_server.url,
                uniq,
                scan_interval_s=0.2,
                theta_inter=1e9,
                theta_intra=0.5,
                theta_reclaim=0.1,
                decay=0.5,
            )
        )
    )
    await stored(nc, s, A, 1, None, [11, 12, 13])

    async def both_known() -> bool:
        w = (await inspect(nc, uniq))["workers"]
        return A in w and B in w and not w[B]["stale"]

    await eventually(both_known, what="both workers tracked")
    for i in range(3):  # the prefix is hot at A (degree 2)
        await nc.publish(s.prefix + ".cache.stats.s1", stats(A, 2, [11, 12, 13], 3, f"r{i}"))

    cmd = await commands.first(lambda c: c.get("op") == "replicate", what="replicate command")
    assert cmd["worker_id"] == B and cmd["source_worker"] == A
    # The whole root->node path of the chosen node (the scan prefers the smallest copy among
    # near-tied candidates, so the node may be any of the hot path's).
    n = len(cmd["blocks"])
    assert n >= 1 and cmd["blocks"] == [11, 12, 13][:n]
    assert not a_commands.items  # nothing was asked of the holder

    body = await inspect(nc, uniq, match=[11, 12, 13])
    assert body["counters"]["stats_recorded"] == 3
    assert body["match"]["held"] == {A: 3}  # the replica is not visible yet
    assert body["workers"][B]["blocks"] == 0
    assert body["last_scan"] is not None

    await stored(nc, s, B, 1, None, cmd["blocks"])  # B confirms the installation

    async def visible() -> dict[str, Any] | None:
        body = await inspect(nc, uniq, match=[11, 12, 13])
        return body if body["match"]["held"].get(B, 0) >= n else None

    body = await eventually(visible, what="replica visible after B's stored event")
    assert body["match"]["held"][A] == 3


async def test_split_reconciles_and_reuse_sends_a_lazy_reconcile(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)

    await kv.put(s.epoch_key(), epoch_record(0, [(0, 4), (4, 4)]))
    left_cmds = await acking_worker(nc, s, "w-cp2-g0")
    await services(CacheMgrService(settings(nats_server.url, uniq)))
    await stored(nc, s, "w-cp4-g0", 1, None, [11, 12, 13, 14])

    async def parent_holds() -> bool:
        w = (await inspect(nc, uniq))["workers"]
        return w.get("w-cp4-g0", {}).get("blocks") == 4

    await eventually(parent_holds, what="parent's events applied")
    await kv.put(s.epoch_key(), epoch_record(1, [(0, 2), (2, 2), (4, 4)]))

    async def split() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        return body if body["counters"]["splits"] == 1 else None

    body = await eventually(split, what="split reconciled")
    assert "w-cp4-g0" not in body["workers"]
    left, right = body["workers"]["w-cp2-g0"], body["workers"]["w-cp2-g2"]
    # Pages 0, 1 of the prefix sit on the left child's ranks, 2, 3 on the right's: the prefix
    # goes to one child, whose missing pages are pending (nothing copied yet).
    assert left["pending"] + right["pending"] == 2
    owner = "w-cp2-g0" if left["pending"] else "w-cp2-g2"
    assert owner == "w-cp2-g0"  # tie → left
    await nc.publish(s.prefix + ".cache.stats.s1", stats(owner, 2, [11, 12, 13, 14], 2, "r-reuse"))
    cmd = await left_cmds.first(lambda c: c.get("op") == "reconcile", what="reconcile command")
    assert cmd["source_worker"] == "w-cp2-g2" and cmd["blocks"] == [11, 12, 13, 14]
    assert cmd["epoch"] == 1


async def test_merge_rehomes_the_degrees_long_prefixes_onto_the_merged_worker(
    nc: Client, nats_server, uniq: str, services
):
    """When the epoch record shows a merge, the cache manager reconciles it and copies the
    long prefixes the merged worker's degree holds to it (rehome_on_merge, as the simulator
    does at the switch); the short ones stay where they are."""
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    await kv.put(s.epoch_key(), epoch_record(0, [(0, 2), (2, 2), (4, 4)]))
    cmds = await acking_worker(nc, s, "w-cp4-g0")
    svc = await services(CacheMgrService(settings(nats_server.url, uniq, rehome_min_blocks=3)))
    await stored(nc, s, "w-cp4-g4", 1, None, [11, 12, 13, 14])  # a document
    await stored(nc, s, "w-cp4-g4", 2, None, [21, 22])  # a short prompt
    await stored(nc, s, "w-cp2-g0", 1, None, [31, 32])  # the children's short prompts

    async def peer_holds() -> bool:
        w = (await inspect(nc, uniq))["workers"]
        return w.get("w-cp4-g4", {}).get("blocks") == 6 and w.get("w-cp2-g0", {}).get(
            "blocks") == 2

    await eventually(peer_holds, what="the peer's and the child's events applied")
    assert svc.counters["rehomed"] == 0
    await kv.put(s.epoch_key(), epoch_record(1, [(0, 4), (4, 4)]))
    cmd = await cmds.first(lambda c: c.get("op") == "replicate", what="re-homing copy")
    assert cmd["source_worker"] == "w-cp4-g4" and cmd["blocks"] == [11, 12, 13, 14]
    assert svc.counters["merges"] == 1 and svc.counters["rehomed"] == 1


async def test_malformed_input_gets_400_and_cachemgr_keeps_running(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    svc = await services(CacheMgrService(settings(nats_server.url, uniq)))
    group = cachemgr_group(s)
    for bad in (b"{nope", b'{"match": "x"}', b'{"extra": true}'):
        msg = await request(nc, f"{group}.inspect", bad)
        assert msg.headers and msg.headers.get("Nats-Service-Error-Code") == "400", bad
    await nc.publish(s.cache_events(A), b"not json")
    await nc.publish(s.cache_events(A), b'{"type": "stored", "worker": "w-cp2-g0"}')
    await nc.publish(s.prefix + ".cache.stats.s1", b'{"request_id": 3}')
    await stored(nc, s, A, 1, None, [1, 2])

    async def counted() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        c = body["counters"]
        return body if c["malformed"] >= 3 and c["events_applied"] == 1 else None

    body = await eventually(counted, what="malformed input counted, good input applied")
    assert body["workers"][A]["blocks"] == 2
    assert svc.counters["malformed"] == 3
