"""One request end to end: HTTP → gateway → intake → scheduler → (fake) worker → result → HTTP,
with the schedule span a child of the gateway's root span; the replica trie follows cache
events (gaps → snapshot); baselines run live; failures reach the client."""

from __future__ import annotations

import asyncio
import json

import pytest
from live_sched_support import FakeWorker, Services, fake_token, http, wait_until
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared.blockhash import chain_hashes
from shared.schemas import CompletionRequest, FirstToken, WindowReport, decode
from shared.service import call
from shared.subjects import Subjects

B = 16  # small blocks keep prompts short
PROMPT = list(range(100, 100 + 3 * B + 5))  # 3 full blocks + a partial one


async def two_workers(fake_worker) -> tuple[FakeWorker, FakeWorker]:  # type: ignore[no-untyped-def]
    return await fake_worker("w-cp2-g0", 2, 0), await fake_worker("w-cp4-g4", 4, 4)


async def test_http_request_flows_end_to_end(
    live: Services, fake_worker, spans: InMemorySpanExporter  # type: ignore[no-untyped-def]
) -> None:
    a, b = await two_workers(fake_worker)
    sched = await live.scheduler(block_size=B)
    gw = await live.gateway(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 2, "both workers in the view")

    reply = await http(gw.http_port, "POST", "/v1/completions",
                       {"prompt": PROMPT, "max_tokens": 4, "model": "m"})
    assert reply.status == 200, reply.body
    out = reply.json()
    rid = out["vtm"]["request_id"]
    assert out["object"] == "text_completion" and out["model"] == "m"
    assert out["choices"][0]["token_ids"] == [fake_token(rid)]
    assert out["usage"]["prompt_tokens"] == len(PROMPT)
    vtm = out["vtm"]
    assert vtm["worker_id"] in ("w-cp2-g0", "w-cp4-g4") and vtm["duplicate"] is False
    stages = vtm["stages"]
    assert set(stages) == {"intake_wait_s", "schedule_s", "queue_wait_s", "prefill_s",
                           "kv_transfer_s", "first_decode_s", "total_s"}
    assert stages["total_s"] == vtm["ttft_s"] >= stages["prefill_s"] > 0

    # Exactly one dispatch, carrying the J terms and the prompt's full-block hashes.
    got = a.assignments + b.assignments
    assert len(got) == 1
    asg = got[0]
    assert asg.request.request_id == rid and asg.worker_id == vtm["worker_id"]
    assert asg.request.block_hashes == chain_hashes(PROMPT, B)
    assert asg.request.tokens == PROMPT
    assert asg.terms is not None and asg.terms.policy == "vertumnus"
    assert asg.terms.candidates == 2 and asg.prefix_tokens == 0
    assert asg.recompute_tokens == len(PROMPT)

    # The reservation is released by the worker's completion.
    await wait_until(lambda: sched.stats.finished == 1, "reservation released")
    assert all(len(ld) == 0 for ld in sched.core.loads.values())

    # Trace: schedule is a child of the gateway's root span, with every candidate's terms.
    await wait_until(
        lambda: {"request", "schedule"} <= {s.name for s in spans.get_finished_spans()},
        "root and schedule spans ended")
    finished = spans.get_finished_spans()
    root = next(s for s in finished if s.name == "request"
                and s.attributes.get("vtm.request_id") == rid)
    sched_span = next(s for s in finished if s.name == "schedule"
                      and s.attributes.get("vtm.request_id") == rid)
    assert root.parent is None
    assert sched_span.parent is not None
    assert sched_span.parent.span_id == root.context.span_id
    assert sched_span.context.trace_id == root.context.trace_id
    attrs = sched_span.attributes
    assert attrs["vtm.worker_id"] == vtm["worker_id"] and attrs["vtm.candidates"] == 2
    for wid in ("w-cp2-g0", "w-cp4-g4"):
        for term in ("q", "s", "score", "P", "R"):
            assert f"vtm.candidate.{wid}.{term}" in attrs
    assert json.loads(attrs["vtm.decision"])["worker"] == vtm["worker_id"]
    intake = next(s for s in finished if s.name == "intake_wait"
                  and s.attributes.get("vtm.request_id") == rid)
    assert intake.parent.span_id == root.context.span_id
    assert vtm["trace_id"] == format(root.context.trace_id, "032x")


async def test_a_clients_traceparent_makes_the_request_part_of_its_trace(
    live: Services, fake_worker, spans: InMemorySpanExporter  # type: ignore[no-untyped-def]
) -> None:
    """W3C trace context over HTTP: the gateway's root span becomes a child of the client's
    span, so the client's trace holds every TTFT stage; a malformed header starts a new trace."""
    await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=B)
    gw = await live.gateway(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
    tid, parent = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    ids = []
    for tp in (f"00-{tid}-{parent}-01", "00-not-a-traceparent-01"):
        reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT},
                           headers={"traceparent": tp})
        assert reply.status == 200, reply.body
        ids.append(reply.json()["vtm"]["request_id"])
    await wait_until(lambda: sum(s.name == "schedule" for s in spans.get_finished_spans()) == 2,
                     "both schedule spans ended")
    finished = spans.get_finished_spans()
    joined, fresh = (next(s for s in finished if s.name == "request"
                          and s.attributes.get("vtm.request_id") == rid) for rid in ids)
    assert format(joined.context.trace_id, "032x") == tid
    assert joined.parent is not None and format(joined.parent.span_id, "016x") == parent
    sched_span = next(s for s in finished if s.name == "schedule"
                      and s.attributes.get("vtm.request_id") == ids[0])
    assert sched_span.context.trace_id == joined.context.trace_id
    assert fresh.parent is None and format(fresh.context.trace_id, "032x") != tid


async def test_nats_completion_subject(live: Services, fake_worker, nc: Client,  # type: ignore[no-untyped-def]
                                       uniq: str) -> None:
    w = await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=B)
    await live.gateway(block_size=B, http_port=None)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    res = await call(nc, Subjects(uniq).gateway_completions(),
                     CompletionRequest(prompt_tokens=PROMPT, request_id="abc-1"), FirstToken,
                     timeout_s=20)
    assert res.request_id == "abc-1" and res.token == fake_token("abc-1")
    assert res.worker_id == "w-cp2-g0" and res.stages.total_s > 0
    assert len(w.assignments) == 1


async def test_trie_follows_events_and_snapshots(live: Services, fake_worker,  # type: ignore[no-untyped-def]
                                                 spans: InMemorySpanExporter) -> None:
    a, b = await two_workers(fake_worker)
    hashes = chain_hashes(PROMPT, B)
    # Held before the scheduler starts: only a snapshot can tell it.
    await a.store(None, hashes[:2], publish=False)
    sched = await live.scheduler(block_size=B)
    gw = await live.gateway(block_size=B)
    await wait_until(lambda: sched.stats.snapshots_applied >= 2, "initial snapshots")
    assert sched.trie.match(hashes).held_blocks == {"w-cp2-g0": 2}

    # An in-order event is applied directly.
    await a.store(hashes[1], hashes[2:3])
    await wait_until(lambda: sched.stats.events_applied == 1, "stored event applied")
    assert sched.trie.match(hashes).held("w-cp2-g0") == 3

    # A gap (lost event ids) marks b stale and brings b's snapshot, which is applied.
    await b.store(None, hashes[:1], skip_ids=2)
    await wait_until(lambda: sched.stats.gaps == 1, "gap detected")
    await wait_until(lambda: sched.trie.match(hashes).held("w-cp4-g4") == 1, "b's snapshot")
    assert not sched.trie.is_stale("w-cp4-g4") and b.snapshot_requests >= 2

    reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT})
    assert reply.status == 200, reply.body
    rid = reply.json()["vtm"]["request_id"]
    await wait_until(lambda: any(s.name == "schedule" for s in spans.get_finished_spans()),
                     "schedule span ended")
    span = next(s for s in spans.get_finished_spans()
                if s.name == "schedule" and s.attributes.get("vtm.request_id") == rid)
    assert span.attributes["vtm.candidate.w-cp2-g0.P"] == 3 * B
    assert span.attributes["vtm.candidate.w-cp4-g4.P"] == B


async def test_a_full_worker_s_snapshot_comes_in_parts_and_is_applied(  # type: ignore[no-untyped-def]
        live: Services, fake_worker) -> None:
    """40,000 cached blocks of 64-bit hashes: the snapshot (about 1.7 MB of JSON) is over
    the server's 1 MiB max_payload and comes in parts. Before, a rank daemon answered it 500
    and the stale replica of a full worker was never repaired."""
    a = await fake_worker("w-cp2-g0", 2, 0)
    chain = [(1 << 63) + 12_345_678_901 * i for i in range(40_000)]
    await a.store(None, chain, publish=False)
    sched = await live.scheduler(block_size=B)
    await wait_until(lambda: sched.stats.snapshots_applied >= 1, "the snapshot in parts")
    assert sched.trie.match(chain).held("w-cp2-g0") == len(chain)
    assert not sched.trie.is_stale("w-cp2-g0")


async def test_the_replica_drops_blocks_no_worker_holds(live: Services, fake_worker,  # type: ignore[no-untyped-def]
                                                       nc: Client) -> None:
    """Cached, then evicted by its worker: the block leaves the replica trie at the next
    housekeeping round (it keeps no statistics, so nothing else would remove it), while
    what a worker still holds stays."""
    a, _ = await two_workers(fake_worker)
    sched = await live.scheduler(block_size=B)
    await wait_until(lambda: sched.stats.snapshots_applied >= 2, "initial snapshots")
    hashes = chain_hashes(PROMPT, B)
    await a.store(None, hashes[:3])
    evicted = [7001, 7002, 7003]
    await a.store(None, evicted)
    a.event_id += 1
    removed = {"type": "removed", "worker": a.worker_id, "event_id": a.event_id,
               "block_hashes": evicted}
    await nc.publish(live.subjects.cache_events(a.worker_id), json.dumps(removed).encode())
    await wait_until(lambda: sched.stats.events_applied == 3, "events applied")
    await wait_until(lambda: sched.stats.nodes_collected == 3, "evicted blocks collected")
    assert set(sched.trie.node_hashes()) == set(hashes[:3])
    assert sched.trie.match(hashes).held("w-cp2-g0") == 3


async def test_an_unanswered_first_snapshot_is_asked_again(live: Services,  # type: ignore[no-untyped-def]
                                                          fake_worker) -> None:
    """A worker new to the scheduler may hold blocks already (a merged worker keeps its
    prefixes). Its snapshot endpoint not up yet when the scheduler first asks, the scheduler
    asks again later and learns them, with no cache event from the worker."""
    a = await fake_worker("w-cp2-g0", 2, 0)
    hashes = chain_hashes(PROMPT, B)
    await a.store(None, hashes[:2], publish=False)
    snap = a._subs.pop()  # no snapshot endpoint for now (FakeWorker.start subscribed it last)
    await snap.unsubscribe()
    sched = await live.scheduler(block_size=B)
    await wait_until(lambda: sched.stats.snapshots_unanswered >= 1, "first snapshot unanswered")
    assert sched.trie.match(hashes).held_blocks == {}
    a._subs.append(await a.nc.subscribe(a.subjects.cache_snapshot(a.worker_id),
                                        cb=a._on_snapshot))
    await wait_until(lambda: sched.trie.match(hashes).held_blocks == {"w-cp2-g0": 2},
                     "snapshot asked again and applied")
    assert a.snapshot_requests >= 1


async def test_a_worker_whose_lease_ran_out_is_not_asked_for_its_snapshot(
        live: Services, fake_worker) -> None:  # type: ignore[no-untyped-def]
    """A worker gone for good keeps its last state in the scheduler (the KV does not report
    TTL expiry). A gap in its events makes it stale; while its lease is out it is not asked
    for its snapshot (before: at the gap and then every housekeeping round, for ever, each
    unanswered). A fresh state brings it back, and it is asked then."""
    a = await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=B, lease_s=0.5)
    await wait_until(lambda: sched.stats.snapshots_applied >= 1, "first snapshot")
    await wait_until(lambda: str(sched.core.view.workers[0].lifecycle) == "unavailable",
                     "lease expiry")
    await a.stop()  # gone: nothing answers on its subjects
    await a.store(None, chain_hashes(PROMPT, B)[:1], skip_ids=3)  # event 4 after 0: a gap
    await wait_until(lambda: sched.stats.gaps == 1, "the gap")
    rounds = sched.stats.housekeeping_rounds
    await wait_until(lambda: sched.stats.housekeeping_rounds >= rounds + 3,
                     "three housekeeping rounds")
    assert sched.trie.is_stale("w-cp2-g0")
    assert sched.stats.snapshots_unanswered == 0
    await a.start()  # back: its endpoints up again and a fresh state
    await wait_until(lambda: not sched.trie.is_stale("w-cp2-g0"), "asked again and applied")
    assert sched.trie.match(chain_hashes(PROMPT, B)).held("w-cp2-g0") == 1


async def test_a_snapshot_asked_before_a_restart_is_not_applied_after_it(
        live: Services, fake_worker) -> None:  # type: ignore[no-untyped-def]
    """The old process answers the scheduler's snapshot request only after its successor's
    state (a new incarnation) arrived: that reply lists the old cache, so it is dropped and
    the snapshot asked again; the new process's empty cache is what the trie then holds."""
    a = await fake_worker("w-cp2-g0", 2, 0)
    a.incarnation = "old"
    await a.publish_state()
    hashes = chain_hashes(PROMPT, B)
    await a.store(None, hashes[:2], publish=False)
    snap = a._subs.pop()  # FakeWorker.start subscribed its snapshot endpoint last
    await snap.unsubscribe()
    release = asyncio.Event()
    asked: list[int] = []

    async def slow_then_empty(msg: Msg) -> None:
        asked.append(1)
        if len(asked) == 1:  # the old process, slow to answer, with its old blocks
            await release.wait()
            await a._on_snapshot(msg)
            return
        body = {"type": "snapshot", "worker": a.worker_id, "last_event_id": 0, "blocks": []}
        await msg.respond(json.dumps(body).encode())

    a._subs.append(await a.nc.subscribe(a.subjects.cache_snapshot(a.worker_id),
                                        cb=slow_then_empty))
    await a.nc.flush()
    sched = await live.scheduler(block_size=B)
    await wait_until(lambda: asked, "the first snapshot request")
    a.incarnation = "new"
    await a.publish_state()
    await wait_until(lambda: sched.stats.workers_restarted == 1, "the restart seen")
    release.set()
    await wait_until(lambda: len(asked) >= 2 and sched.stats.snapshots_applied >= 1,
                     "the snapshot asked again and applied")
    assert sched.trie.match(hashes).held_blocks == {}
    assert sched.trie.last_event_id("w-cp2-g0") == 0


@pytest.mark.parametrize("policy", ["vllm", "sglang", "round_robin", "static", "dynamo", "llmd"])
async def test_baselines_run_live(live: Services, fake_worker, policy: str) -> None:  # type: ignore[no-untyped-def]
    a, b = await two_workers(fake_worker)
    sched = await live.scheduler(block_size=B, policy=policy)
    gw = await live.gateway(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 2, "both workers in the view")
    for _ in range(3):
        reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT})
        assert reply.status == 200, reply.body
    got = a.assignments + b.assignments
    assert len(got) == 3
    # Every baseline scores with a queue and a service term: each placement carries its terms,
    # under the policy that made it (None would be a policy without terms: none is here).
    terms = [g.terms for g in got]
    assert all(t is not None for t in terms), terms
    assert {t.policy for t in terms if t is not None} == {policy}


async def test_no_eligible_worker_fails_after_max_deliver(live: Services, fake_worker) -> None:  # type: ignore[no-untyped-def]
    await live.scheduler(block_size=B, max_deliver=2, retry_delay_s=0.05)
    gw = await live.gateway(block_size=B)
    reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT})
    assert reply.status == 503
    assert "no eligible worker" in reply.json()["error"]["message"]


async def test_window_demand_reaches_the_controller_subject(
    live: Services, fake_worker, nc: Client, uniq: str  # type: ignore[no-untyped-def]
) -> None:
    await fake_worker("w-cp2-g0", 2, 0)
    reports: list[WindowReport] = []

    async def on_report(msg: Msg) -> None:
        reports.append(decode(WindowReport, msg.data, msg.headers))

    copies: list[WindowReport] = []

    async def on_copy(msg: Msg) -> None:
        copies.append(decode(WindowReport, msg.data, msg.headers))

    sub = await nc.subscribe(Subjects(uniq).window_demand_all(), cb=on_report)
    sub3 = await nc.subscribe(Subjects(uniq).window_demand_again_all(), cb=on_copy)
    stats: list[dict] = []

    async def on_stats(msg: Msg) -> None:
        stats.append(json.loads(msg.data))

    sub2 = await nc.subscribe(f"{uniq}.cache.stats.*", cb=on_stats)
    # The report's long count uses the scheduler's cut (the controller's, kept equal).
    sched = await live.scheduler(block_size=B, window_s=0.5, long_threshold_tokens=len(PROMPT))
    gw = await live.gateway(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT})
    assert reply.status == 200
    rid = reply.json()["vtm"]["request_id"]
    await wait_until(lambda: sum(r.requests for r in reports) >= 1, "a window with the request")
    report = next(r for r in reports if r.requests)
    assert report.reporter == sched.reporter and report.demand_s > 0
    assert report.demand_by_degree.keys() == {2}
    assert report.long_requests == report.requests == 1
    await wait_until(lambda: len(stats) == 1, "request statistics")
    assert stats[0]["request_id"] == rid and stats[0]["worker_id"] == "w-cp2-g0"
    assert stats[0]["block_hashes"] == chain_hashes(PROMPT, B)
    # Every report goes out again just ahead of the next one (a lost one is covered), on a
    # subject of its own: the reports' subscribers see each window once.
    await wait_until(lambda: sched.stats.windows_reported >= 3, "three windows reported")
    await wait_until(lambda: len(copies) >= sched.stats.windows_reported - 1 >= 2,
                     "the copies received")
    assert sched.stats.windows_resent == sched.stats.windows_reported - 1
    starts = [r.window_start_s for r in reports]
    assert starts == sorted(set(starts))  # no window twice
    by_start = {r.window_start_s: r for r in reports}
    assert all(by_start[c.window_start_s] == c for c in copies)  # each copy is its original
    await sub.unsubscribe()
    await sub2.unsubscribe()
    await sub3.unsubscribe()


async def test_gateway_workers_endpoint(live: Services, fake_worker) -> None:  # type: ignore[no-untyped-def]
    await two_workers(fake_worker)
    gw = await live.gateway(block_size=B)
    reply = await http(gw.http_port, "GET", "/v1/workers")
    assert reply.status == 200
    ws = reply.json()["workers"]
    assert [(w["worker_id"], w["degree"], w["epoch"], w["queue_len"]) for w in ws] == [
        ("w-cp2-g0", 2, 0, 0), ("w-cp4-g4", 4, 0, 0)]
    assert ws[0]["hit_rate"] == 0.25 and ws[0]["lifecycle"] == "active"
    await asyncio.sleep(0)


async def test_expired_lease_makes_worker_ineligible(live: Services, fake_worker,  # type: ignore[no-untyped-def]
                                                     nc: Client, uniq: str) -> None:
    """A worker whose last heartbeat is older than the lease is UNAVAILABLE to the scheduler."""
    w = await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=B, lease_s=0.5, max_deliver=2, retry_delay_s=0.05)
    gw = await live.gateway(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    # No more heartbeats: housekeeping marks it unavailable once the lease runs out.
    await wait_until(lambda: str(sched.core.view.workers[0].lifecycle) == "unavailable",
                     "lease expiry")
    reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT})
    assert reply.status == 503 and "unavailable" in reply.json()["error"]["message"]
    assert w.assignments == []
    await w.publish_state()  # a fresh heartbeat brings it back
    await wait_until(lambda: str(sched.core.view.workers[0].lifecycle) == "active",
                     "heartbeat")
    reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT})
    assert reply.status == 200 and len(w.assignments) == 1


async def test_refused_assignment_is_released_and_reported(
    live: Services, nc: Client, uniq: str, fake_worker  # type: ignore[no-untyped-def]
) -> None:
    """A worker that refuses (micro error 409, as rankd does when not ACTIVE) gets nothing
    reserved; after max_deliver the client hears why."""
    s = Subjects(uniq)
    w = await fake_worker("w-cp2-g0", 2, 0)
    await w.stop()  # no assign subscriber of the fake; answer with an error instead
    refused: list[str] = []

    async def refuse(msg: Msg) -> None:
        refused.append(msg.subject)
        await nc.publish(msg.reply, b"", headers={"Nats-Service-Error": "w-cp2-g0 is draining",
                                                  "Nats-Service-Error-Code": "409"})

    sub = await nc.subscribe(s.worker_assign("w-cp2-g0"), cb=refuse)
    sched = await live.scheduler(block_size=B, max_deliver=2, retry_delay_s=0.05)
    gw = await live.gateway(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT})
    assert reply.status == 503
    msg = reply.json()["error"]["message"]
    assert "did not accept" in msg and "409" in msg and "draining" in msg
    assert len(refused) == 2  # one per delivery
    assert all(len(ld) == 0 for ld in sched.core.loads.values())
    assert sched.stats.failed == 1 and sched.stats.retried == 1
    await sub.unsubscribe()
