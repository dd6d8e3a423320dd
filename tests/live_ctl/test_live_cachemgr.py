"""The live cache manager against a real nats-server, with fake workers as plain subscribers.

Events of two workers build the trie; a gap triggers a snapshot request whose reply is
applied; a scan with low thresholds sends a replicate command to the worker lacking a hot
prefix and the replica becomes visible only with that worker's own stored event; an epoch
change reconciles a split and a request routed to a child with pending pages sends a lazy
reconcile command; malformed input gets 400 / is dropped while the service keeps running; a
worker whose WorkerState shows a new incarnation (started again under its id) is tracked
afresh, while a re-published or empty incarnation, or a reconfiguration that registers the
worker again, leaves its view alone.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import nats.errors
import pytest
from live_ctl_support import Collector, eventually, request
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.micro.request import Request
from structlog.testing import capture_logs

from services.cachemgr.reconcile import index_pages, reconciled_index
from services.cachemgr.service import CacheMgrService, CacheMgrSettings, cachemgr_group
from shared.schemas import (
    MAX_TOKENS,
    CacheCommandResult,
    CacheSnapshot,
    CacheStored,
    EpochRecord,
    EpochWorker,
    WorkerState,
    encode,
    to_json,
)
from shared.service import epoch_kv, respond_in_parts, worker_state_kv
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


async def counted(nc: Client, prefix: str, counter: str, n: int, what: str) -> dict[str, Any]:
    """The inspect body once the manager's ``counter`` reached ``n``."""

    async def reached() -> dict[str, Any] | None:
        body = await inspect(nc, prefix)
        return body if body["counters"][counter] == n else None

    return await eventually(reached, what=what)


async def holding(nc: Client, prefix: str, worker: str, blocks: int) -> None:
    """Wait until the manager's view of ``worker`` has ``blocks`` blocks."""

    async def holds() -> bool:
        w = (await inspect(nc, prefix))["workers"]
        return w.get(worker, {}).get("blocks") == blocks

    await eventually(holds, what=f"{worker}'s events applied")


def epoch_record(epoch: int, groups: list[tuple[int, int]], *,
                 unavailable: tuple[str, ...] = ()) -> bytes:
    """An EpochRecord of (first GPU, degree) groups, as JSON: every worker ACTIVE but those
    named in ``unavailable``."""
    return to_json(
        EpochRecord(
            epoch=epoch,
            committed_at_s=time.time(),
            workers=[
                EpochWorker(
                    worker_id=f"w-cp{d}-g{g}", first_gpu=g, degree=d,
                    lifecycle=(Lifecycle.UNAVAILABLE if f"w-cp{d}-g{g}" in unavailable
                               else Lifecycle.ACTIVE)
                )
                for g, d in groups
            ],
        )
    )


async def acking_worker(nc: Client, s: Subjects, worker: str, *, short: int = 0) -> Collector:
    """A stand-in for ``worker``'s cache-command endpoint: collects each command and answers
    it ok, having done all of its blocks but the last ``short`` (a full destination takes
    the leading part of a copy's path). Subscribed and flushed when this returns."""
    cmds = Collector()

    async def on_command(msg: Msg) -> None:
        await cmds.cb(msg)
        cmd = json.loads(msg.data)
        await reply(nc, msg, CacheCommandResult(
            command_id=cmd["command_id"], worker_id=worker, ok=True,
            blocks_done=max(0, len(cmd["blocks"]) - short)))

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


def state(wid: str, gpus: list[int], blocks: int = 64, incarnation: str = "",
          queue_len: int = 0) -> WorkerState:
    return WorkerState(
        worker_id=wid,
        incarnation=incarnation,
        degree=len(gpus),
        gpus=gpus,
        epoch=0,
        lifecycle=Lifecycle.ACTIVE,
        queue_len=queue_len,
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


async def test_a_full_worker_s_snapshot_comes_in_parts_and_is_applied(
    nc: Client, nats_server, uniq: str, services
):
    """A worker's whole index of 40,000 blocks (about 1.7 MB of JSON, over the server's
    1 MiB max_payload) is answered in parts, as a rank daemon does, and the manager applies it
    whole. Before, the reply was a single message the rank daemon could not send (500), and
    a stale view of a full worker was never repaired."""
    s = Subjects(uniq)
    chain = [(1 << 63) + 12_345_678_901 * i for i in range(40_000)]
    blocks = list(zip(chain, [None, *chain[:-1]], strict=True))
    states = await worker_state_kv(nc.jetstream(), s)
    await states.put(B, to_json(state(B, [2, 3], blocks=65_536)))

    async def b_snapshot(msg: Msg) -> None:
        data, headers = encode(CacheSnapshot(worker=B, last_event_id=0, blocks=blocks))
        assert await respond_in_parts(nc, Request(msg), data, headers) > 1

    await nc.subscribe(s.cache_snapshot(B), cb=b_snapshot)
    await nc.flush()
    await services(CacheMgrService(settings(nats_server.url, uniq)))

    async def learnt() -> dict[str, Any] | None:
        body = await inspect(nc, uniq, match=chain[:3])
        return body if body["counters"]["snapshots_applied"] else None

    body = await eventually(learnt, what="the snapshot in parts applied")
    assert body["workers"][B]["blocks"] == len(chain) and body["match"]["held"] == {B: 3}
    assert body["counters"]["snapshots_failed"] == 0


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
        return body if body["match"]["held"].get(B, 0) == n else None

    body = await eventually(visible, what="replica visible after B's stored event")
    assert body["match"]["held"][A] == 3


@pytest.mark.parametrize("pull", [True, False])
async def test_a_placement_away_from_the_prefix_pulls_it_to_the_routed_worker(
    nc: Client, nats_server, uniq: str, services, pull: bool
):
    """The scheduler routed a request to B while A holds its prefix: the route-time pull
    (services/cachemgr/pull.py) sends B a replicate command for the prefix from A at once,
    no scan needed (the scan is an hour away here); with ``pull`` off, nothing is sent."""
    s = Subjects(uniq)
    b_cmds = await acking_worker(nc, s, B)
    a_cmds = await acking_worker(nc, s, A)
    svc = await services(CacheMgrService(settings(nats_server.url, uniq, pull=pull)))
    await stored(nc, s, A, 1, None, [11, 12, 13, 14])
    await stored(nc, s, B, 1, None, [11])  # B has the first block only

    async def both_known() -> bool:
        w = (await inspect(nc, uniq))["workers"]
        return w.get(A, {}).get("blocks") == 4 and w.get(B, {}).get("blocks") == 1

    await eventually(both_known, what="both workers' events applied")
    await nc.publish(s.prefix + ".cache.stats.s1", stats(B, 2, [11, 12, 13, 14, 15], 1, "r1"))

    body = await counted(nc, uniq, "stats_recorded", 1, "the placement recorded")
    if not pull:
        # The copy would have been recorded in flight with the stats, before any command.
        assert body["counters"]["pulls"] == 0 and svc.trie.inflight() == ()
        assert body["counters"]["commands_sent"] == 0
        return
    assert body["counters"]["pulls"] == 1
    cmd = await b_cmds.first(lambda c: c.get("op") == "replicate", what="the pull")
    # The whole root->node path; B copies only what it lacks (12-14).
    assert (cmd["source_worker"], cmd["blocks"]) == (A, [11, 12, 13, 14])

    async def settled() -> bool:
        return svc.counters["commands_ok"] == 1 and svc.trie.inflight() == ()

    await eventually(settled, what="the pull settled as done")
    # No copy was asked of the holder; its only command is the demote that follows the pull
    # (``pull_demote``, on by default: the tests below).
    assert all(c.get("op") == "demote" for c in a_cmds.items)
    # Its counters are the micro stats' data too (what `vertumnus up` reports the pulls from).
    stats_answer = json.loads((await nc.request(f"$SRV.STATS.vtm-cachemgr.{svc.service.id}",
                                                b"", timeout=10)).data)
    data = stats_answer["endpoints"][0]["data"]
    assert (data["pulls"], data["commands_ok"]) == (1, 1)


# -- a pull as a move (pull_demote): the source's copy is demoted once the pull is answered ok


async def holder_a_and_b(nc: Client, nats_server, uniq: str, services,
                         **kw: Any) -> CacheMgrService:
    """The manager (settings ``kw``) once A's events show it holding [11..14] and B's [11].
    The workers' command responders are the caller's, subscribed before."""
    s = Subjects(uniq)
    svc = await services(CacheMgrService(settings(nats_server.url, uniq, **kw)))
    await stored(nc, s, A, 1, None, [11, 12, 13, 14])
    await stored(nc, s, B, 1, None, [11])
    await holding(nc, uniq, A, 4)
    await holding(nc, uniq, B, 1)
    return svc


async def route_to_b(nc: Client, uniq: str) -> None:
    """A request for [11..15] routed to B: the route-time pull copies [12, 13, 14] from A."""
    await nc.publish(Subjects(uniq).prefix + ".cache.stats.s1",
                     stats(B, 2, [11, 12, 13, 14, 15], 1, "r1"))


async def held(nc: Client, uniq: str) -> dict[str, int]:
    """Who holds how much of [11..14], as the manager's trie says."""
    return (await inspect(nc, uniq, match=[11, 12, 13, 14]))["match"]["held"]


@pytest.mark.parametrize("demote", [True, False], ids=["demote", "no-demote"])
async def test_a_pull_answered_ok_demotes_the_copy_at_its_source(
    nc: Client, nats_server, uniq: str, services, demote: bool
):
    """Once B answers the pull's replicate ok, A (the source) gets a DemoteCommand of exactly
    the copied blocks, root first, at the replicate's epoch; with ``pull_demote`` off it gets
    none. The demote is counted apart from the copies (``commands_*``) and moves no holder."""
    s = Subjects(uniq)
    b_cmds = await acking_worker(nc, s, B)
    a_cmds = await acking_worker(nc, s, A)
    svc = await holder_a_and_b(nc, nats_server, uniq, services, pull_demote=demote)
    await route_to_b(nc, uniq)
    rep = await b_cmds.first(lambda c: c.get("op") == "replicate", what="the pull")
    if demote:
        dem = await a_cmds.first(lambda c: c.get("op") == "demote", what="the demote")
        assert (dem["worker_id"], dem["blocks"], dem["epoch"]) == (A, [12, 13, 14], rep["epoch"])
        assert "source_worker" not in dem and dem["command_id"] != rep["command_id"]
        body = await counted(nc, uniq, "demotes_ok", 1, "the demote answered ok")
    else:
        body = await counted(nc, uniq, "commands_ok", 1, "the pull settled as done")
    c = body["counters"]
    # Sent in the same task right after the copy settled: by now, or never.
    assert (c["demotes_sent"], c["demotes_ok"], c["demotes_failed"]) == (int(demote),) * 2 + (0,)
    assert (c["commands_sent"], c["commands_ok"], c["commands_failed"]) == (1, 1, 0)
    assert [x["op"] for x in a_cmds.items] == (["demote"] if demote else [])
    assert [x["op"] for x in b_cmds.items] == ["replicate"]
    assert body["in_flight"] == [] and svc.trie.inflight() == ()
    assert await held(nc, uniq) == {A: 4, B: 1}  # a demote moves no holder


@pytest.mark.parametrize(("short", "demoted"), [(1, [12, 13]), (3, None)],
                         ids=["took-part", "took-none-of-the-copy"])
async def test_only_what_the_destination_took_is_demoted(
    nc: Client, nats_server, uniq: str, services, short: int, demoted: list[int] | None
):
    """B's reply says it holds only the leading part of the copied path (it ran short of
    room): A gets a demote of just the copied blocks B took, and none when B took none of
    them (its reply counts only the block it already had) -- A's copy is still the only one."""
    s = Subjects(uniq)
    await acking_worker(nc, s, B, short=short)
    a_cmds = await acking_worker(nc, s, A)
    await holder_a_and_b(nc, nats_server, uniq, services, pull_demote=True)
    await route_to_b(nc, uniq)
    body = await counted(nc, uniq, "commands_ok", 1, "the pull settled as done")
    if demoted is None:
        assert body["counters"]["demotes_sent"] == 0 and a_cmds.items == []
    else:
        dem = await a_cmds.first(lambda c: c.get("op") == "demote", what="the demote")
        assert dem["blocks"] == demoted


async def test_no_demote_goes_to_a_source_that_left_the_pool(
    nc: Client, nats_server, uniq: str, services
):
    """A (the pull's source) becomes UNAVAILABLE while B is still copying: the manager stops
    tracking it, and B's ok reply is followed by no demote -- there is nothing to demote at a
    worker that is gone. The copy itself settles as done."""
    s = Subjects(uniq)
    b_cmds = Collector()
    release = asyncio.Event()

    async def b_answers_later(msg: Msg) -> None:
        await b_cmds.cb(msg)
        await release.wait()
        cmd = json.loads(msg.data)
        await reply(nc, msg, CacheCommandResult(command_id=cmd["command_id"], worker_id=B,
                                                ok=True, blocks_done=len(cmd["blocks"])))

    await nc.subscribe(s.cache_cmd(B), cb=b_answers_later)
    a_cmds = await acking_worker(nc, s, A)
    await holder_a_and_b(nc, nats_server, uniq, services, pull_demote=True)
    await route_to_b(nc, uniq)
    await b_cmds.first(lambda c: c.get("op") == "replicate", what="the pull")
    epochs = await epoch_kv(nc.jetstream(), s)
    await epochs.put(s.epoch_key(), epoch_record(1, [(0, 2), (2, 2)], unavailable=(A,)))

    async def a_untracked() -> bool:
        return A not in (await inspect(nc, uniq))["workers"]

    await eventually(a_untracked, what="A untracked")
    with capture_logs() as logs:
        release.set()
        body = await counted(nc, uniq, "commands_ok", 1, "the pull settled as done")
    assert body["counters"]["demotes_sent"] == 0 and a_cmds.items == []
    assert any(e["event"] == "demote skipped: worker no longer tracked" for e in logs)


async def test_a_worker_the_record_calls_unavailable_is_not_tracked_again_by_its_events(
    nc: Client, nats_server, uniq: str, services
):
    """A's lease lapsed (the record calls it UNAVAILABLE) but it still runs: its late cache
    event and its heartbeat do not track it again. Tracked, it would have asked for its
    snapshot and become a holder again, and the scan could reclaim B's copy, the pool's last
    usable one. Only a record that shows A again tracks it."""
    s = Subjects(uniq)
    svc = await holder_a_and_b(nc, nats_server, uniq, services)
    epochs = await epoch_kv(nc.jetstream(), s)
    await epochs.put(s.epoch_key(), epoch_record(1, [(0, 2), (2, 2)], unavailable=(A,)))

    async def a_untracked() -> bool:
        return A not in (await inspect(nc, uniq))["workers"]

    await eventually(a_untracked, what="A untracked")
    await stored(nc, s, A, 2, 14, [15])
    body = await counted(nc, uniq, "rejected", 1, "A's late event rejected")
    assert A not in body["workers"] and svc.trie.holders(11) == {B}
    svc.on_state(state(A, [0, 1], incarnation="i1"))  # its heartbeat
    assert A not in svc.trie.workers()
    await epochs.put(s.epoch_key(), epoch_record(2, [(0, 2), (2, 2)]))

    async def a_tracked() -> bool:
        return A in (await inspect(nc, uniq))["workers"]

    await eventually(a_tracked, what="A tracked again by the record")


async def test_a_refused_pull_sends_no_demote(nc: Client, nats_server, uniq: str, services):
    """B refuses the copy: the pull is settled as failed and A's copy, the only one, is not
    demoted."""
    s = Subjects(uniq)
    b_cmds = Collector()

    async def b_refuses(msg: Msg) -> None:
        await b_cmds.cb(msg)
        cmd = json.loads(msg.data)
        await reply(nc, msg, CacheCommandResult(command_id=cmd["command_id"], worker_id=B,
                                                ok=False, error="no room"))

    await nc.subscribe(s.cache_cmd(B), cb=b_refuses)
    a_cmds = await acking_worker(nc, s, A)
    svc = await holder_a_and_b(nc, nats_server, uniq, services, pull_demote=True)
    await route_to_b(nc, uniq)
    body = await counted(nc, uniq, "commands_failed", 1, "the refused pull settled")
    assert body["counters"]["demotes_sent"] == 0 and not a_cmds.items
    assert [x["op"] for x in b_cmds.items] == ["replicate"]
    assert body["in_flight"] == [] and svc.trie.inflight() == ()


@pytest.mark.parametrize("fault", ["refused", "timeout", "no-responder", "unexpected"])
async def test_a_failed_demote_is_only_counted_and_logged(
    nc: Client, nats_server, uniq: str, services, fault: str
):
    """Whatever becomes of the demote -- refused, unanswered, no worker listening, an
    exception on the way -- the copy stays settled as done, the trie is untouched, the
    failure is counted and logged, and the manager keeps applying events."""
    s = Subjects(uniq)
    await acking_worker(nc, s, B)
    a_cmds = Collector()

    async def a_answers(msg: Msg) -> None:
        await a_cmds.cb(msg)
        if fault == "refused":
            cmd = json.loads(msg.data)
            await reply(nc, msg, CacheCommandResult(command_id=cmd["command_id"], worker_id=A,
                                                    ok=False, error="not now"))
        # timeout: heard, never answered

    if fault != "no-responder":
        await nc.subscribe(s.cache_cmd(A), cb=a_answers)
        await nc.flush()
    # The short wait only makes the unanswered demote fail sooner (B answers at once).
    svc = await holder_a_and_b(nc, nats_server, uniq, services, pull_demote=True,
                               **({"command_timeout_s": 0.5} if fault == "timeout" else {}))
    if fault == "unexpected":
        async def broken(*_: Any) -> str | None:
            raise RuntimeError("injected fault")

        svc._send_demote = broken  # type: ignore[method-assign]
    with capture_logs() as logs:
        await route_to_b(nc, uniq)
        body = await counted(nc, uniq, "demotes_failed", 1, "the demote failed")
    c = body["counters"]
    assert (c["demotes_ok"], c["commands_ok"], c["commands_failed"]) == (0, 1, 0)
    assert c["demotes_sent"] == (0 if fault == "unexpected" else 1)
    assert body["in_flight"] == [] and svc.trie.inflight() == ()
    assert await held(nc, uniq) == {A: 4, B: 1}
    if fault in ("refused", "timeout"):
        assert [x["op"] for x in a_cmds.items] == ["demote"]
    failed = [e for e in logs if e["event"].startswith("demote failed")]
    assert len(failed) == 1
    assert failed[0]["log_level"] == ("error" if fault == "unexpected" else "warning")
    if fault == "refused":
        assert failed[0]["error"] == "not now"
    # Still running: B's confirmation of the copy is applied as usual.
    await stored(nc, s, B, 2, 11, [12, 13, 14])
    await holding(nc, uniq, B, 4)
    assert await held(nc, uniq) == {A: 4, B: 4}


async def test_split_reconciles_and_reuse_sends_a_lazy_reconcile(
    nc: Client, nats_server, uniq: str, services
):
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)

    await kv.put(s.epoch_key(), epoch_record(0, [(0, 4), (4, 4)]))
    left_cmds = await acking_worker(nc, s, "w-cp2-g0")
    notices = Collector()
    await nc.subscribe(s.cache_pending_all(), cb=notices.cb)
    svc = CacheMgrService(settings(nats_server.url, uniq))
    await services(svc)
    await stored(nc, s, "w-cp4-g0", 1, None, [11, 12, 13, 14])
    await holding(nc, uniq, "w-cp4-g0", 4)
    await kv.put(s.epoch_key(), epoch_record(1, [(0, 2), (2, 2), (4, 4)]))
    body = await counted(nc, uniq, "splits", 1, "split reconciled")
    # Each child's reconcile goes to the schedulers' tries (ReconciledNotice): the left child
    # has pages 2-3 pending from the right child's donor pages, listed under the chain above.
    left_notice = await notices.first(lambda n: n["worker"] == "w-cp2-g0", what="left notice")
    right_notice = await notices.first(lambda n: n["worker"] == "w-cp2-g2", what="right notice")
    assert left_notice["epoch"] == 1 and left_notice["degree"] == 2
    assert left_notice["blocks"] == [[11, None, "path", None], [12, 11, "path", None],
                                     [13, 12, "pending", "w-cp2-g2"],
                                     [14, 13, "pending", "w-cp2-g2"]]
    assert right_notice["blocks"] == [[11, None, "path", None], [12, 11, "path", None],
                                      [13, 12, "donor", None], [14, 13, "donor", None]]
    assert [m.subject for m in notices.msgs] == [s.cache_pending("w-cp2-g0"),
                                                 s.cache_pending("w-cp2-g2")]
    assert body["counters"]["reconciled_notices"] == 2
    assert "w-cp4-g0" not in body["workers"]
    # The micro metadata names the epoch reconciled to (conventions.md: metadata has the epoch).
    info = json.loads((await nc.request(f"$SRV.INFO.vtm-cachemgr.{svc.service.id}", b"",
                                        timeout=10)).data)
    assert info["metadata"]["epoch"] == "1"
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


async def test_workers_a_reconfiguration_makes_are_planned_with_their_hardware_s_capacity(
    nc: Client, nats_server, uniq: str, services
):
    """Before a split's children publish a state, the manager plans them with the capacity
    per GPU its known workers show (here 2 blocks per GPU: a CP4 holds 8), not the setting's
    default. The split then cuts the parent's 8-block prefix as the rank host seeding the
    children does with their real capacity of 4 (``reconciled_index``): no child has room for
    it, so the left child keeps its whole prefix of 2 blocks and nothing is pending -- with
    the default (4096) the trie would assign the prefix to the left child with 6 blocks
    pending that the worker never gets. Merging back, the merged worker is planned with 8."""
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    states = await worker_state_kv(nc.jetstream(), s)
    parent, other = "w-cp4-g0", "w-cp4-g4"

    async def empty_snapshot(msg: Msg) -> None:
        worker = msg.subject.rsplit(".", 1)[-1]
        await reply(nc, msg, CacheSnapshot(worker=worker, last_event_id=0, blocks=[]))

    for w in (parent, other):
        await nc.subscribe(s.cache_snapshot(w), cb=empty_snapshot)
    await nc.flush()
    await kv.put(s.epoch_key(), epoch_record(0, [(0, 4), (4, 4)]))
    await states.put(parent, to_json(state(parent, [0, 1, 2, 3], blocks=8, incarnation="p")))
    await states.put(other, to_json(state(other, [4, 5, 6, 7], blocks=8, incarnation="o")))
    await services(CacheMgrService(settings(nats_server.url, uniq, default_capacity_blocks=4096)))
    await seen_state_of(nc, uniq, other, "o")
    chain = list(range(101, 109))
    await stored(nc, s, parent, 1, None, chain)
    await holding(nc, uniq, parent, 8)
    await kv.put(s.epoch_key(), epoch_record(1, [(0, 2), (2, 2), (4, 4)]))
    body = await counted(nc, uniq, "splits", 1, "split reconciled")
    left, right = body["workers"]["w-cp2-g0"], body["workers"]["w-cp2-g2"]
    assert (left["capacity_blocks"], right["capacity_blocks"]) == (4, 4)
    seeded = reconciled_index(
        (index_pages({h: (h - 1 if h > chain[0] else None) for h in chain}),),
        child_degree=2, new="left", capacity_blocks=4)
    assert [h for h, _ in seeded] == chain[:2]
    assert (left["blocks"], left["pending"]) == (len(seeded), 0)
    assert (right["blocks"], right["pending"]) == (0, 0)

    await states.delete(parent)  # the merged worker's own figure is not known either
    await kv.put(s.epoch_key(), epoch_record(2, [(0, 4), (4, 4)]))

    body = await counted(nc, uniq, "merges", 1, "merge reconciled")
    assert body["workers"][parent]["capacity_blocks"] == 8


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


# -- restarted workers (WorkerState incarnation) -------------------------------------------------


async def worker_a_with_blocks(
    nc: Client, nats_server, uniq: str, services, incarnation: str
) -> tuple[CacheMgrService, list[str]]:
    """The manager with A registered from its state (``incarnation``), its (empty) snapshot
    applied, then events 1-2 of A (blocks 11-14) and event 1 of B (11, 12) applied.
    Returns the service and the snapshot requests A has answered (its subjects)."""
    s = Subjects(uniq)
    states = await worker_state_kv(nc.jetstream(), s)
    snapshot_requests: list[str] = []

    async def a_snapshot(msg: Msg) -> None:  # every process of A starts with an empty cache
        snapshot_requests.append(msg.subject)
        await reply(nc, msg, CacheSnapshot(worker=A, last_event_id=0, blocks=[]))

    await nc.subscribe(s.cache_snapshot(A), cb=a_snapshot)
    await nc.flush()
    await states.put(A, to_json(state(A, [0, 1], incarnation=incarnation)))
    svc = await services(CacheMgrService(settings(nats_server.url, uniq)))

    async def registered() -> bool:
        body = await inspect(nc, uniq)
        w = body["workers"].get(A)
        return bool(w and w["incarnation"] == incarnation
                    and body["counters"]["snapshots_applied"] >= 1)

    await eventually(registered, what="A registered from its state, its snapshot applied",
                     timeout=10)
    await stored(nc, s, A, 1, None, [11, 12, 13])
    await stored(nc, s, A, 2, 13, [14])
    await stored(nc, s, B, 1, None, [11, 12])

    async def built() -> dict[str, Any] | None:
        body = await inspect(nc, uniq, match=[11, 12, 13, 14])
        return body if body["counters"]["events_applied"] == 3 else None

    body = await eventually(built, what="A's and B's events applied", timeout=10)
    assert body["match"]["held"] == {A: 4, B: 2}
    assert body["workers"][A]["last_event_id"] == 2
    return svc, snapshot_requests


async def seen_state_of(nc: Client, uniq: str, worker: str, incarnation: str) -> dict[str, Any]:
    """Wait until the manager recorded ``worker``'s ``incarnation``: every worker state put
    before that one (the watch is ordered) has been acted on by then."""

    async def seen() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        w = body["workers"].get(worker)
        return body if w and w["incarnation"] == incarnation else None

    return await eventually(seen, what=f"{worker}'s incarnation {incarnation!r}", timeout=10)


async def test_a_worker_with_a_new_incarnation_is_tracked_afresh(
    nc: Client, nats_server, uniq: str, services
):
    """A rank daemon killed and started again brings back its worker id with a new
    incarnation, an empty cache and event ids from 1: the manager drops the old view (the
    old process's blocks no longer count), applies the new process's event 1 and asks it for
    its snapshot."""
    s = Subjects(uniq)
    svc, snapshot_requests = await worker_a_with_blocks(nc, nats_server, uniq, services, "a")
    asked = len(snapshot_requests)
    states = await worker_state_kv(nc.jetstream(), s)
    await states.put(A, to_json(state(A, [0, 1], incarnation="b")))

    async def reset() -> dict[str, Any] | None:
        body = await inspect(nc, uniq, match=[11, 12, 13, 14])
        w = body["workers"][A]
        ok = body["counters"]["restarts"] == 1 and len(snapshot_requests) > asked
        return body if ok and w["blocks"] == 0 else None

    body = await eventually(reset, what="A's view reset, its snapshot asked for", timeout=10)
    w = body["workers"][A]
    assert w["last_event_id"] == 0 and w["incarnation"] == "b" and not w["stale"]
    assert w["degree"] == 2 and w["capacity_blocks"] == 64
    assert body["match"]["held"] == {B: 2}  # B's replica is the only one left

    await stored(nc, s, A, 1, None, [21, 22])  # the new process's first event

    async def applied() -> dict[str, Any] | None:
        body = await inspect(nc, uniq, match=[21, 22])
        return body if body["counters"]["events_applied"] == 4 else None

    body = await eventually(applied, what="event 1 of the new process applied", timeout=10)
    assert body["counters"]["duplicates"] == 0 and body["counters"]["gaps"] == 0
    assert body["match"] == {"matched_blocks": 2, "held": {A: 2}}
    assert body["workers"][A]["blocks"] == 2 and body["workers"][A]["last_event_id"] == 1
    assert svc.counters["restarts"] == 1


async def test_a_republished_incarnation_changes_nothing(
    nc: Client, nats_server, uniq: str, services
):
    """Heartbeats re-publish a worker's state with the same incarnation: its view stays; a
    later different one still resets it (the recorded incarnation is the first one)."""
    s = Subjects(uniq)
    svc, snapshot_requests = await worker_a_with_blocks(nc, nats_server, uniq, services, "a")
    asked = len(snapshot_requests)
    states = await worker_state_kv(nc.jetstream(), s)
    await states.put(A, to_json(state(A, [0, 1], incarnation="a", queue_len=3)))
    await states.put(A, to_json(state(A, [0, 1], incarnation="a")))
    await states.put(B, to_json(state(B, [2, 3], incarnation="b0")))  # a marker behind them
    body = await seen_state_of(nc, uniq, B, "b0")
    w = body["workers"][A]
    assert w["blocks"] == 4 and w["last_event_id"] == 2 and w["incarnation"] == "a"
    assert body["counters"]["restarts"] == 0 and len(snapshot_requests) == asked
    await stored(nc, s, A, 3, 14, [15])  # A's events go on

    async def continued() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        return body if body["workers"][A]["last_event_id"] == 3 else None

    body = await eventually(continued, what="A's event 3 applied", timeout=10)
    assert body["workers"][A]["blocks"] == 5

    await states.put(A, to_json(state(A, [0, 1], incarnation="a2")))
    body = await seen_state_of(nc, uniq, A, "a2")
    assert body["counters"]["restarts"] == 1 and body["workers"][A]["blocks"] == 0
    assert svc.counters["restarts"] == 1


async def test_a_worker_s_capacity_follows_its_state(
    nc: Client, nats_server, uniq: str, services
):
    """The capacity the manager plans copies against is the worker's own ``kv_total_blocks``:
    a state with another figure (the worker was registered on a guess) replaces it and keeps
    the holdings; a restarted process is registered with its new state's figure, not the old
    process's."""
    s = Subjects(uniq)
    await worker_a_with_blocks(nc, nats_server, uniq, services, "a")
    states = await worker_state_kv(nc.jetstream(), s)
    await states.put(A, to_json(state(A, [0, 1], blocks=96, incarnation="a")))
    await states.put(B, to_json(state(B, [2, 3], incarnation="b0")))  # a marker behind it
    body = await seen_state_of(nc, uniq, B, "b0")
    w = body["workers"][A]
    assert (w["capacity_blocks"], w["blocks"], w["last_event_id"]) == (96, 4, 2)
    assert body["counters"]["restarts"] == 0

    await states.put(A, to_json(state(A, [0, 1], blocks=200, incarnation="a2")))
    body = await seen_state_of(nc, uniq, A, "a2")
    w = body["workers"][A]
    assert body["counters"]["restarts"] == 1
    assert (w["capacity_blocks"], w["blocks"], w["last_event_id"]) == (200, 0, 0)


async def test_an_empty_incarnation_never_resets_a_worker(
    nc: Client, nats_server, uniq: str, services
):
    """Older rank daemons publish no incarnation: such states never reset anything, the first
    non-empty one is only recorded, and an empty one after it does not replace it."""
    s = Subjects(uniq)
    svc, _ = await worker_a_with_blocks(nc, nats_server, uniq, services, "")
    states = await worker_state_kv(nc.jetstream(), s)
    await states.put(A, to_json(state(A, [0, 1], queue_len=2)))
    await states.put(B, to_json(state(B, [2, 3], incarnation="b0")))  # a marker behind it
    body = await seen_state_of(nc, uniq, B, "b0")
    assert body["counters"]["restarts"] == 0 and body["workers"][A]["incarnation"] == ""
    assert body["workers"][A]["blocks"] == 4

    await states.put(A, to_json(state(A, [0, 1], incarnation="a")))  # first one: recorded
    body = await seen_state_of(nc, uniq, A, "a")
    assert body["counters"]["restarts"] == 0 and body["workers"][A]["blocks"] == 4
    await states.put(A, to_json(state(A, [0, 1])))  # empty again: still no reset
    await states.put("w-cp2-g4", to_json(state("w-cp2-g4", [4, 5], incarnation="m")))
    body = await seen_state_of(nc, uniq, "w-cp2-g4", "m")  # another marker
    assert body["counters"]["restarts"] == 0 and body["workers"][A]["blocks"] == 4
    assert body["workers"][A]["incarnation"] == "a"

    await states.put(A, to_json(state(A, [0, 1], incarnation="a2")))  # a restart after all
    body = await seen_state_of(nc, uniq, A, "a2")
    assert body["counters"]["restarts"] == 1 and body["workers"][A]["blocks"] == 0
    assert svc.counters["restarts"] == 1


async def test_a_reconfiguration_that_registers_a_worker_again_keeps_its_plans(
    nc: Client, nats_server, uniq: str, services
):
    """Two halves merged, then split again: the halves come back from the split with their
    reconcile plans and new processes (new incarnations). Their first states after the split
    are recorded, not taken as restarts (the merge forgot their old incarnations); a restart
    after that resets the view as usual."""
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    states = await worker_state_kv(nc.jetstream(), s)
    left, right, parent = "w-cp2-g0", "w-cp2-g2", "w-cp4-g0"
    await kv.put(s.epoch_key(), epoch_record(0, [(0, 2), (2, 2), (4, 4)]))
    await states.put(left, to_json(state(left, [0, 1], incarnation="l1")))
    await states.put(right, to_json(state(right, [2, 3], incarnation="r1")))
    svc = await services(CacheMgrService(settings(nats_server.url, uniq)))
    await seen_state_of(nc, uniq, left, "l1")
    await seen_state_of(nc, uniq, right, "r1")

    await kv.put(s.epoch_key(), epoch_record(1, [(0, 4), (4, 4)]))

    async def merged() -> bool:
        body = await inspect(nc, uniq)
        return body["counters"]["merges"] == 1

    await eventually(merged, what="merge reconciled", timeout=10)
    await stored(nc, s, parent, 1, None, [11, 12, 13, 14])

    async def parent_holds() -> bool:
        w = (await inspect(nc, uniq))["workers"]
        return w.get(parent, {}).get("blocks") == 4

    await eventually(parent_holds, what="merged worker's events applied", timeout=10)
    await kv.put(s.epoch_key(), epoch_record(2, [(0, 2), (2, 2), (4, 4)]))

    async def split() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        return body if body["counters"]["splits"] == 1 else None

    body = await eventually(split, what="split reconciled", timeout=10)
    plans = {x: body["workers"][x]["pending"] for x in (left, right)}
    assert sum(plans.values()) == 2 and plans[left] == 2  # as in the split test above
    held = {x: body["workers"][x]["blocks"] for x in (left, right)}

    await states.put(left, to_json(state(left, [0, 1], incarnation="l2")))
    await states.put(right, to_json(state(right, [2, 3], incarnation="r2")))
    await seen_state_of(nc, uniq, left, "l2")
    body = await seen_state_of(nc, uniq, right, "r2")
    assert body["counters"]["restarts"] == 0
    assert {x: body["workers"][x]["pending"] for x in (left, right)} == plans
    assert {x: body["workers"][x]["blocks"] for x in (left, right)} == held

    await states.put(left, to_json(state(left, [0, 1], incarnation="l3")))  # now a restart
    body = await seen_state_of(nc, uniq, left, "l3")
    assert body["counters"]["restarts"] == 1 and svc.counters["restarts"] == 1
    assert body["workers"][left]["pending"] == 0 and body["workers"][left]["blocks"] == 0
    assert body["workers"][right]["pending"] == plans[right]


async def test_a_snapshot_asked_before_a_restart_is_not_applied_after_it(
    nc: Client, nats_server, uniq: str, services
):
    """The old process answers a snapshot request only after its successor's state arrived:
    that snapshot may list the old cache, so it is dropped and the snapshot asked again."""
    s = Subjects(uniq)
    states = await worker_state_kv(nc.jetstream(), s)
    release = asyncio.Event()
    snapshot_requests: list[str] = []

    async def a_snapshot(msg: Msg) -> None:
        snapshot_requests.append(msg.subject)
        if len(snapshot_requests) == 1:  # the old process, slow to answer
            await release.wait()
            old = CacheSnapshot(worker=A, last_event_id=5, blocks=[(11, None), (12, 11)])
            await reply(nc, msg, old)
        else:
            await reply(nc, msg, CacheSnapshot(worker=A, last_event_id=0, blocks=[]))

    await nc.subscribe(s.cache_snapshot(A), cb=a_snapshot)
    await nc.flush()
    await states.put(A, to_json(state(A, [0, 1], incarnation="a")))
    svc = await services(CacheMgrService(settings(nats_server.url, uniq)))
    await seen_state_of(nc, uniq, A, "a")

    async def asked() -> bool:  # from a task the registration started: maybe after inspect
        return bool(snapshot_requests)

    await eventually(asked, what="A's snapshot asked for when it was registered", timeout=10)
    await states.put(A, to_json(state(A, [0, 1], incarnation="b")))
    await seen_state_of(nc, uniq, A, "b")
    release.set()

    async def asked_again() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        ok = len(snapshot_requests) >= 2 and body["counters"]["snapshots_applied"] >= 1
        return body if ok else None

    body = await eventually(asked_again, what="the snapshot asked again and applied", timeout=10)
    assert body["workers"][A]["blocks"] == 0 and body["workers"][A]["last_event_id"] == 0
    assert svc.counters["restarts"] == 1


# -- commands that fail in any way, and statistics out of bounds ---------------------------------


async def split_with_pending_pages(
    nc: Client, nats_server, uniq: str, services
) -> tuple[CacheMgrService, Collector]:
    """The manager after the split of a CP4 worker holding [11..14] into two CP2 halves: the
    left half (``w-cp2-g0``, an acking worker whose commands are returned) owns the prefix
    and has 2 pages pending, so each request routed to it with the prefix sends a lazy
    reconcile copy unless one is in flight."""
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    await kv.put(s.epoch_key(), epoch_record(0, [(0, 4), (4, 4)]))
    left_cmds = await acking_worker(nc, s, "w-cp2-g0")
    svc = await services(CacheMgrService(settings(nats_server.url, uniq)))
    await stored(nc, s, "w-cp4-g0", 1, None, [11, 12, 13, 14])

    async def parent_holds() -> bool:
        w = (await inspect(nc, uniq))["workers"]
        return w.get("w-cp4-g0", {}).get("blocks") == 4

    await eventually(parent_holds, what="parent's events applied", timeout=10)
    await kv.put(s.epoch_key(), epoch_record(1, [(0, 2), (2, 2), (4, 4)]))

    async def split() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        return body if body["counters"]["splits"] == 1 else None

    body = await eventually(split, what="split reconciled", timeout=10)
    assert body["workers"]["w-cp2-g0"]["pending"] == 2 and not body["in_flight"]
    return svc, left_cmds


@pytest.mark.parametrize(
    "fault",
    [
        # A long outage fills nats-py's outbound buffer: the request raises at once.
        lambda: nats.errors.OutboundBufferLimitError(),
        # Anything else (a bug on the way): the action is settled all the same.
        lambda: RuntimeError("injected fault"),
    ],
    ids=["outbound-buffer-full", "unexpected"],
)
async def test_a_command_that_raises_is_settled_and_sent_again(
    nc: Client, nats_server, uniq: str, services, monkeypatch: pytest.MonkeyPatch,
    fault: Callable[[], Exception],
):
    """A command whose request raises an error outside the usual replies (micro error,
    timeout, no responders) is settled as failed: it leaves the in-flight set (the core
    retires its plan), is logged with the error, and the next request routed there sends the
    copy again, which the worker gets."""
    s = Subjects(uniq)
    svc, left_cmds = await split_with_pending_pages(nc, nats_server, uniq, services)
    # The fault: the manager's own connection raises on its first command request; the
    # server, the manager and the worker stay real.
    real_request = svc.nc.request
    raised: list[Exception] = []

    async def request_once_failing(subject: str, *args: Any, **kwargs: Any) -> Msg:
        if subject == s.cache_cmd("w-cp2-g0") and not raised:
            raised.append(fault())
            raise raised[-1]
        return await real_request(subject, *args, **kwargs)

    monkeypatch.setattr(svc.nc, "request", request_once_failing)
    hashes = [11, 12, 13, 14]
    with capture_logs() as logs:
        await nc.publish(s.prefix + ".cache.stats.s1", stats("w-cp2-g0", 2, hashes, 2, "r-1"))

        async def settled() -> dict[str, Any] | None:
            body = await inspect(nc, uniq)
            c = body["counters"]
            ok = raised and c["commands_failed"] == 1 and not body["in_flight"]
            return body if ok else None

        body = await eventually(settled, what="the failed command settled", timeout=10)
    assert not left_cmds.items  # the worker never heard of it
    assert body["counters"]["commands_ok"] == 0
    failed = [e for e in logs if e["event"].startswith("cache command failed")]
    assert len(failed) == 1 and failed[0]["error"] == repr(raised[0])
    assert failed[0]["action"]["kind"] == "reconcile"
    unexpected = not isinstance(raised[0], nats.errors.Error)
    assert failed[0]["log_level"] == ("error" if unexpected else "warning")
    assert body["counters"]["commands_errored"] == int(unexpected)

    # The plan is open again: the next request routed to the left half sends the copy.
    await nc.publish(s.prefix + ".cache.stats.s1", stats("w-cp2-g0", 2, hashes, 2, "r-2"))
    cmd = await left_cmds.first(lambda c: c.get("op") == "reconcile", what="copy sent again")
    assert cmd["source_worker"] == "w-cp2-g2" and cmd["blocks"] == hashes

    async def done() -> dict[str, Any] | None:
        body = await inspect(nc, uniq)
        return body if body["counters"]["commands_ok"] == 1 and not body["in_flight"] else None

    body = await eventually(done, what="the copy sent again retired", timeout=10)
    assert body["counters"]["commands_failed"] == 1 and body["counters"]["stats_recorded"] == 2


async def test_request_stats_beyond_the_token_bound_are_malformed(
    nc: Client, nats_server, uniq: str, services
):
    """RequestStats with an ``input_len`` (Algorithm 1's L) or a reuse count above
    MAX_TOKENS are refused as malformed (a warning, no statistics recorded); the manager
    records the next valid one."""
    s = Subjects(uniq)
    svc = await services(CacheMgrService(settings(nats_server.url, uniq)))
    await stored(nc, s, A, 1, None, [11, 12, 13])

    async def tracked() -> bool:
        return A in (await inspect(nc, uniq))["workers"]

    await eventually(tracked, what="A tracked", timeout=10)
    good = json.loads(stats(A, 2, [11, 12, 13], 3, "r-0"))
    bad = [
        {**good, "request_id": "r-1", "input_len": MAX_TOKENS + 1},
        {**good, "request_id": "r-2", "input_len": 10**30},
        {**good, "request_id": "r-3", "reused_blocks": MAX_TOKENS + 1},
    ]
    with capture_logs() as logs:
        for b in bad:
            await nc.publish(s.prefix + ".cache.stats.s1", json.dumps(b).encode())
        await nc.publish(s.prefix + ".cache.stats.s1", json.dumps(good).encode())

        async def counted() -> dict[str, Any] | None:
            body = await inspect(nc, uniq)
            c = body["counters"]
            return body if c["malformed"] == len(bad) and c["stats_recorded"] == 1 else None

        body = await eventually(counted, what="bad stats refused, the good one recorded",
                                timeout=10)
    assert body["counters"]["stats_skipped"] == 0 and svc.counters["malformed"] == len(bad)
    rejected = [e for e in logs if e["event"] == "malformed request stats rejected"]
    assert len(rejected) == len(bad) and all(e["log_level"] == "warning" for e in rejected)
    assert all("RequestStats" in e["error"] for e in rejected)


async def test_a_scheduler_started_after_a_split_asks_for_the_reconcile(
    nc: Client, nats_server, uniq: str, services
):
    """The split's notices went out before this scheduler replica ran. When it registers the
    left child (its worker state), it asks the cache manager's ``pending`` endpoint, which
    publishes the child's reconcile again, and the replica trie marks the pending pages;
    asked for a worker with nothing pending, the manager publishes nothing. A malformed
    question gets a 400 and the manager goes on."""
    from services.scheduler.service import SchedulerService, SchedulerSettings
    from shared.schemas import PendingQuery, PendingReply
    from shared.service import RemoteError, call

    s = Subjects(uniq)
    await split_with_pending_pages(nc, nats_server, uniq, services)
    states = await worker_state_kv(nc.jetstream(), s)
    await states.put("w-cp2-g0", to_json(state("w-cp2-g0", [0, 1])))
    await states.put("w-cp4-g4", to_json(state("w-cp4-g4", [4, 5, 6, 7])))
    sched = SchedulerService(SchedulerSettings(
        nats_url=nats_server.url, subject_prefix=uniq, degrees=[2, 4], instance_id="s-late",
        snapshot_timeout_s=0.5))
    await services(sched)

    async def marked() -> bool:
        return sched.trie.pending_blocks("w-cp2-g0") == {13, 14} \
            and sched.stats.reconciled_asked == 2

    await eventually(marked, what="the left child's pending pages marked", timeout=10)
    body = await inspect(nc, uniq)
    assert body["counters"]["reconciled_asked"] == 1  # w-cp4-g4 has nothing pending
    assert sched.trie.pending_blocks("w-cp4-g4") == frozenset()
    reply = await call(nc, s.cache_pending_ask(), PendingQuery(worker_id="w-unknown"),
                       PendingReply)
    assert reply.parts == 0
    with pytest.raises(RemoteError) as err:
        await call(nc, s.cache_pending_ask(), b'{"worker_id": "Not An Id"}', PendingReply)
    assert err.value.code == 400
    assert (await inspect(nc, uniq))["counters"]["splits"] == 1  # still running


async def test_pending_is_sent_again_under_the_reconciles_epoch_and_only_to_its_life(
    nc: Client, nats_server, uniq: str, services
):
    """``pending`` publishes the reconcile under the epoch record that made it, not the
    record the manager is at when asked; asked about another incarnation of the worker than
    the one the manager knows (a restart it has not handled yet), it publishes nothing (the
    restarted process holds nothing pending); without an incarnation it answers as before.
    Once the manager handles the restart, the reconcile is gone for every asker."""
    from shared.schemas import PendingQuery, PendingReply
    from shared.service import call

    s = Subjects(uniq)
    await split_with_pending_pages(nc, nats_server, uniq, services)
    states = await worker_state_kv(nc.jetstream(), s)
    await states.put("w-cp2-g0", to_json(state("w-cp2-g0", [0, 1], incarnation="life-1")))

    async def adopted() -> bool:
        return (await inspect(nc, uniq))["workers"]["w-cp2-g0"]["incarnation"] == "life-1"

    await eventually(adopted, what="the left child's incarnation known", timeout=10)
    kv = await epoch_kv(nc.jetstream(), s)
    await kv.put(s.epoch_key(), epoch_record(2, [(0, 2), (2, 2), (4, 4)]))

    async def at_two() -> bool:
        return (await inspect(nc, uniq))["epoch"] == 2

    await eventually(at_two, what="the manager at epoch 2", timeout=10)
    notices = Collector()
    await nc.subscribe(s.cache_pending("w-cp2-g0"), cb=notices.cb)

    async def ask(incarnation: str) -> int:
        reply = await call(nc, s.cache_pending_ask(),
                           PendingQuery(worker_id="w-cp2-g0", incarnation=incarnation),
                           PendingReply)
        return reply.parts

    assert await ask("life-2") == 0  # a restart the manager has not seen
    assert await ask("life-1") == 1
    first = await notices.first(what="the reconcile sent again")
    assert first["epoch"] == 1 and [b[2] for b in first["blocks"]].count("pending") == 2
    assert await ask("") == 1

    async def two() -> bool:
        return len(notices.items) == 2

    await eventually(two, what="the reconcile sent a second time")
    assert notices.items[1]["epoch"] == 1
    # The restart handled: the new life starts empty, nothing pending under any incarnation.
    await states.put("w-cp2-g0", to_json(state("w-cp2-g0", [0, 1], incarnation="life-2")))

    async def restarted() -> bool:
        w = (await inspect(nc, uniq))["workers"]["w-cp2-g0"]
        return w["incarnation"] == "life-2" and w["pending"] == 0

    await eventually(restarted, what="the restart handled", timeout=10)
    assert await ask("life-2") == 0 and await ask("") == 0
    assert len(notices.items) == 2


def test_every_new_worker_gets_a_notice_and_large_ones_come_in_standalone_parts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``_publish_reconciled`` sends after a split (built, not sent): one empty notice
    for a child with nothing pending (it replaces an older notice of the same worker id a
    scheduler may still keep), and a large reconcile in parts that each repeat the links
    above their pages (reconcile.py ``reconciled_parts``)."""
    import services.cachemgr.service as svc_mod
    from services.cachemgr.events import Stored

    monkeypatch.setattr(svc_mod, "RECONCILED_PART_BLOCKS", 16)
    svc = CacheMgrService(settings("nats://127.0.0.1:1", "unused"))
    t = svc.trie
    t.add_worker("w-cp4-g0", 4, 10**6)
    for i in range(20):
        t.apply(Stored("w-cp4-g0", i + 1, None, tuple(range(10 * i + 100, 10 * i + 105))))
    t.reconcile_split("w-cp4-g0", ("w-cp2-g0", "w-cp2-g2"), {"w-cp2-g0": 10**6,
                                                            "w-cp2-g2": 10**6})
    t.add_worker("w-cp2-g4", 2, 100)  # a worker with nothing pending
    (empty,) = svc.reconciled_notices("w-cp2-g4", 3)
    assert (empty.part, empty.parts, empty.blocks, empty.epoch) == (0, 1, [], 3)
    parts = svc.reconciled_notices("w-cp2-g0", 3)
    assert len(parts) > 3 and all(n.parts == len(parts) for n in parts)
    assert [n.part for n in parts] == list(range(len(parts)))
    for n in parts:  # each stands alone: every parent is listed in the same part
        listed: set[int] = set()
        for h, p, _, _ in n.blocks:
            assert p is None or p in listed
            listed.add(h)
