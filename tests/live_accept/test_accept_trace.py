"""Acceptance (d): one request's trace has every TTFT stage span, correctly parented.

The services run in-process (gateway with its HTTP API, scheduler, one rank daemon on the sim
backend with modelled prefill, KV handoff and first decode times) on a real ``nats-server``,
so every span reaches this process' in-memory exporter;
the context travels exactly as between processes (W3C ``traceparent`` in NATS headers and in
the intake message and the assignment). Expected tree (conventions.md: one root per request
at the gateway, one child per TTFT stage; names are :class:`shared.telemetry.Stage`)::

    request (root, gateway)
    ├── intake_wait                (scheduler: gateway arrival → placement's dequeue)
    ├── schedule                   (scheduler: J terms, chosen worker; ends at assigned_at_s)
    │   └── dispatch               (scheduler: the assignment's request-reply, a client span)
    │       └── vtm-rankd.assign   (rank daemon's server span of the assignment: admission)
    ├── queue_wait                 (rank daemon: assigned → prefill starts)
    ├── prefill                    (predicted and modelled time on it)
    │   └── prefill_rank × C       (one per rank: rank, GPU, its zigzag share of R)
    ├── kv_transfer                (KV handoff to decode)
    ├── first_decode               (first decode iteration → first token)
    └── first_token_trip           (gateway: the first token's trip from the worker to it)

Every stage span is a direct child of the root, whichever service records it (the root's
context travels in ``Assignment.request.trace_context``); ``prefill_rank`` details the prefill
stage per rank, so it stays under ``prefill`` (the root's children then add up to the TTFT
without counting a prefill C times).

The second test checks the ``kv_transfer`` and ``first_decode`` spans against the TTFT
breakdown the gateway returns (the same measured durations), and that the breakdown adds up.
The third checks the per-rank prefill spans of a degree-4 worker (count, parent, rank, GPU,
share of the new tokens).
"""

from __future__ import annotations

import os

from live_accept_support import InProcess, prompt_tokens, wait_until
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.rankd.backend import SimBackend
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.telemetry import Stage
from vertumnus.live.http import request

B = 16


async def one_traced_request(nats_server: EmbeddedNats, spans: InMemorySpanExporter,
                             worker_id: str = "w-cp2-g0"
                             ) -> tuple[dict, dict[str, list]]:  # type: ignore[type-arg]
    """(the HTTP answer's ``vtm`` object, the request's finished spans by name)."""
    import json
    import random

    live = InProcess(nats_server.url, "t" + os.urandom(5).hex())
    try:
        await live.run(RankdService(
            RankdSettings(nats_url=live.url, subject_prefix=live.prefix, worker_id=worker_id,
                          heartbeat_s=0.2),
            SimBackend(prefill_time=lambda r, p, c, kind="cp": 0.02,
                       handoff_time=lambda n, c: 0.005, first_decode_time=lambda n, c: 0.003)))
        sched = await live.scheduler(block_size=B)
        gw = await live.gateway(block_size=B)
        await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
        rid = "trace-1"
        body = json.dumps({"prompt": prompt_tokens(rid, random.Random(0), prefix_len=64,
                                                   min_tail=30, max_tail=60),
                           "request_id": rid}).encode()
        r = await request(f"http://127.0.0.1:{gw.http_port}/v1/completions", "POST", body,
                          timeout_s=60)
        assert r.status == 200, r.body
        vtm = r.json()["vtm"]
        trace_id = vtm["trace_id"]

        def of_trace() -> dict[str, list]:  # type: ignore[type-arg]
            out: dict[str, list] = {}  # type: ignore[type-arg]
            for s in spans.get_finished_spans():
                if format(s.context.trace_id, "032x") == trace_id:
                    out.setdefault(s.name, []).append(s)
            return out

        # (prefill_rank spans, if any, end before kv_transfer: recorded in the same step.)
        # The scheduler's dispatch span ends only after the worker's ack and the record's
        # store acknowledgement reach it, while the worker runs the request meanwhile: the
        # answer (and the root span) can come first.
        await wait_until(lambda: {"request", "schedule", "dispatch", "prefill", "queue_wait",
                                  "kv_transfer", "first_decode"} <= set(of_trace()),
                         "the request's spans to end")
        return vtm, of_trace()
    finally:
        await live.close()


async def test_trace_has_every_emitted_stage_correctly_parented(
        nats_server: EmbeddedNats, spans: InMemorySpanExporter) -> None:
    _, by_name = await one_traced_request(nats_server, spans)
    one = {name: ss[0] for name, ss in by_name.items()}
    for name in (Stage.REQUEST, Stage.INTAKE_WAIT, Stage.SCHEDULE, Stage.QUEUE_WAIT,
                 Stage.PREFILL):
        assert len(by_name.get(str(name), [])) == 1, (name, sorted(by_name))
    root = one["request"]
    assert root.parent is None
    assert root.attributes["vtm.request_id"] == "trace-1"
    assert one["intake_wait"].parent.span_id == root.context.span_id
    sched = one["schedule"]
    assert sched.attributes["vtm.worker_id"] == "w-cp2-g0"
    # One child of the root per TTFT stage, whichever service recorded it.
    stages = (Stage.INTAKE_WAIT, Stage.SCHEDULE, Stage.QUEUE_WAIT, Stage.PREFILL,
              Stage.KV_TRANSFER, Stage.FIRST_DECODE)
    for stage in stages:
        (span,) = by_name[str(stage)]
        assert span.parent is not None, stage
        assert span.parent.span_id == root.context.span_id, (stage, span.parent)
        assert span.context.trace_id == root.context.trace_id, stage
    for stage in ("queue_wait", "prefill"):
        span = one[stage]
        assert span.attributes["vtm.request_id"] == "trace-1"
        assert span.attributes["vtm.worker_id"] == "w-cp2-g0"
    # The rank daemon's server span of the assignment is the dispatch's child, and the
    # dispatch the schedule span's (the assignment was sent from inside it); parent of no stage.
    (dispatch,) = by_name["dispatch"]
    assert dispatch.parent.span_id == sched.context.span_id
    (server,) = [s for ss in by_name.values() for s in ss if s.name.endswith(".assign")]
    assert server.parent.span_id == dispatch.context.span_id
    assert not [s.name for ss in by_name.values() for s in ss
                if s.parent is not None and s.parent.span_id == server.context.span_id]
    assert dispatch.attributes["vtm.queue_position"] == 0
    # The intake wait ends where the schedule span starts (the placement's dequeue stamp),
    # and the schedule span ends where the breakdown's schedule stage does (assigned_at_s):
    # where the dispatch and the worker's queue wait start. Before, it ran on through the
    # dispatch and overlapped the queue wait.
    assert one["intake_wait"].end_time == sched.start_time
    (assigned,) = [e for e in sched.events if e.name == "assigned"]
    assert assigned.timestamp == sched.end_time == dispatch.start_time
    assert sched.end_time == one["queue_wait"].start_time
    pre = one["prefill"].attributes
    assert pre["vtm.predicted_s"] > 0 and pre["vtm.modelled_prefill_s"] > 0
    # Stages are ordered in time: dequeue before schedule ends, queue wait before prefill.
    assert one["intake_wait"].end_time <= sched.end_time
    assert one["queue_wait"].end_time <= one["prefill"].start_time + 1_000_000  # 1 ms slack
    assert root.start_time <= one["intake_wait"].start_time
    assert one["prefill"].end_time <= root.end_time


async def test_trace_has_kv_transfer_and_first_token_spans(
        nats_server: EmbeddedNats, spans: InMemorySpanExporter) -> None:
    vtm, by_name = await one_traced_request(nats_server, spans)
    prefill = by_name["prefill"][0]
    root = by_name["request"][0]
    got = {}
    for stage in (Stage.KV_TRANSFER, Stage.FIRST_DECODE):
        ss = by_name.get(str(stage), [])
        assert len(ss) == 1, f"no single {stage} span in the trace: {sorted(by_name)}"
        got[stage] = span = ss[0]
        # Siblings of prefill: children of the gateway's root span.
        assert span.parent.span_id == prefill.parent.span_id == root.context.span_id
        assert span.attributes["vtm.request_id"] == "trace-1"
        assert span.attributes["vtm.worker_id"] == "w-cp2-g0"
    kv, decode = got[Stage.KV_TRANSFER], got[Stage.FIRST_DECODE]
    # Consecutive: prefill → KV transfer → first decode → the gateway's first token.
    assert prefill.end_time == kv.start_time and kv.end_time == decode.start_time
    assert decode.end_time <= root.end_time
    assert kv.attributes["vtm.modelled_handoff_s"] > 0
    # The spans are the TTFT breakdown the client got: the same measured durations (up to the
    # float rounding of Unix-time nanoseconds). The prefill span opens just before the backend
    # reads its clock, so it may only be longer than the measured prefill.
    st = vtm["stages"]

    def seconds(span) -> float:  # type: ignore[no-untyped-def]
        return (span.end_time - span.start_time) / 1e9

    assert st["prefill_s"] > 0 and seconds(prefill) >= st["prefill_s"] - 2e-6, st
    for span, key in ((kv, "kv_transfer_s"), (decode, "first_decode_s")):
        assert st[key] > 0, (key, st)
        assert abs(seconds(span) - st[key]) < 2e-6, (key, seconds(span), st)
    # The scheduler's stage spans measure what the breakdown (vtm.request.stage) does: the
    # schedule span is not the dispatch's round trip too.
    for name, key in (("intake_wait", "intake_wait_s"), ("schedule", "schedule_s")):
        (span,) = by_name[name]
        assert abs(seconds(span) - st[key]) < 2e-6, (key, seconds(span), st)
    # ... and it adds up: what the stages leave of the TTFT is the system's own overhead.
    overhead = st["total_s"] - (st["intake_wait_s"] + st["queue_wait_s"] + st["prefill_s"]
                                + st["kv_transfer_s"] + st["first_decode_s"])
    assert 0 <= overhead < st["total_s"], st
    # The first token's trip to the gateway is the root's last child: from the first decode's
    # end (the worker's finished_at_s) to the gateway's receipt, where the TTFT measured
    # there ends (the root starts at the arrival). Before, no span covered it.
    (trip,) = by_name["first_token_trip"]
    assert trip.parent.span_id == root.context.span_id
    assert trip.attributes["vtm.worker_id"] == "w-cp2-g0"
    assert abs(trip.start_time - decode.end_time) < 2_000, (trip.start_time, decode.end_time)
    assert abs((trip.end_time - root.start_time) / 1e9 - vtm["ttft_s"]) < 2e-6
    assert trip.end_time <= root.end_time


async def test_trace_has_a_prefill_span_per_rank(
        nats_server: EmbeddedNats, spans: InMemorySpanExporter) -> None:
    from services.rankd.core import rank_shares

    _, by_name = await one_traced_request(nats_server, spans, worker_id="w-cp4-g4")
    prefill = by_name["prefill"][0]
    ranks = by_name.get(str(Stage.PREFILL_RANK), [])
    assert len(ranks) == 4, [s.attributes for s in ranks]  # one per rank of the degree-4 worker
    assert sorted(s.attributes["vtm.rank"] for s in ranks) == [0, 1, 2, 3]
    r = prefill.attributes["vtm.recompute_tokens"]
    assert r >= 2 * 4, r  # enough new tokens that every rank has a share
    shares = rank_shares(r, 4)
    for s in sorted(ranks, key=lambda s: s.attributes["vtm.rank"]):
        k = s.attributes["vtm.rank"]
        assert s.parent.span_id == prefill.context.span_id  # children of the worker's prefill
        assert s.context.trace_id == prefill.context.trace_id
        assert s.attributes["vtm.request_id"] == "trace-1"
        assert s.attributes["vtm.worker_id"] == "w-cp4-g4"
        assert s.attributes["vtm.gpu"] == 4 + k
        assert s.attributes["vtm.degree"] == 4
        assert s.attributes["vtm.rank_tokens"] == shares[k]
        assert s.attributes["vtm.rank_share"] == shares[k] / r
        assert s.attributes["vtm.recompute_tokens"] == r
        assert s.attributes["vtm.rank_measured"] is False  # sim: no rank processes to time
        # Lockstep ranks: each covers the worker's measured prefill (the prefill span opens
        # just before the backend reads its clock).
        assert prefill.start_time <= s.start_time < s.end_time == prefill.end_time
    assert sum(s.attributes["vtm.rank_tokens"] for s in ranks) == r
