"""Reconfigurations are traced (observability review): one trace per split or merge from the
controller -- a ``reconfiguration`` root with the operation's kind, workers, degrees, epochs
and planner rule, and a child span per phase in order (queue query, drain, epoch commit,
switch, expose) --, its context carried by the controller's requests to the rank daemons
(whose ``queue`` handler joins the trace), its trace id on the controller's log lines about it,
and an aborted or undone one marked ERROR with the reason.

Before, the controller made no span at all; drains showed only in its logs (without a trace
id), the drain and switch metrics, and as strings in request spans.
"""

from __future__ import annotations

import time
from itertools import pairwise
from typing import Any

from live_ctl_support import Collector, FakeRanks, FakeScheduler, eventually
from nats.aio.client import Client
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from structlog.contextvars import merge_contextvars
from structlog.testing import capture_logs
from test_live_controller import DEMAND, H, settings, worker_state
from test_live_ctl_with_rankd import GatedBackend, assignment

from services.controller.service import (
    ControllerService,
    QueueReport,
    drain_subject,
    reconf_subject,
    worker_queue_subject,
)
from services.controller.tracing import ReconfStage
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.schemas import AssignmentAck, FirstToken, TtftStages, encode, to_json
from shared.service import call, worker_state_kv
from shared.subjects import Subjects
from shared.telemetry import inject, tracer

PHASES = [str(s) for s in (ReconfStage.QUEUE_QUERY, ReconfStage.DRAIN, ReconfStage.EPOCH_COMMIT,
                           ReconfStage.SWITCH, ReconfStage.EXPOSE)]


def hex_trace(span: ReadableSpan) -> str:
    return format(span.context.trace_id, "032x")


def roots(spans: InMemorySpanExporter, rid: int | None = None) -> list[ReadableSpan]:
    """The finished reconfiguration roots (of reconfiguration ``rid``)."""
    return [s for s in spans.get_finished_spans()
            if s.name == str(ReconfStage.RECONFIGURATION)
            and (rid is None or s.attributes.get("vtm.reconfiguration.id") == rid)]


def children(spans: InMemorySpanExporter, root_span_id: int) -> list[ReadableSpan]:
    """The finished children of the span ``root_span_id``, by start time."""
    return sorted((s for s in spans.get_finished_spans()
                   if s.parent is not None and s.parent.span_id == root_span_id),
                  key=lambda s: s.start_time)


async def split_set_up(nc: Client, s: Subjects, *, in_flight: str = "r-running") -> None:
    """Two CP4 workers (w-cp4-g4 drains sooner, so it is split) and w-cp4-g4's queue
    answered with ``in_flight`` running, as test_live_controller's split does."""
    states = await worker_state_kv(nc.jetstream(), s)
    await states.put("w-cp4-g0", to_json(worker_state("w-cp4-g0", [0, 1, 2, 3], queue=3,
                                                      outstanding=5.0)))
    await states.put("w-cp4-g4", to_json(worker_state("w-cp4-g4", [4, 5, 6, 7], queue=2,
                                                      outstanding=1.0)))

    async def queue_of_g4(msg: Any) -> None:
        rep = QueueReport(worker_id="w-cp4-g4", queued=["r-queued"], in_flight=[in_flight])
        data, headers = encode(rep)
        await nc.publish(msg.reply, data, headers=headers)

    await nc.subscribe(worker_queue_subject(s, "w-cp4-g4"), cb=queue_of_g4)


async def test_a_split_is_one_trace_with_its_phases_in_order(
        nc: Client, nats_server, uniq: str, services, spans: InMemorySpanExporter) -> None:
    s = Subjects(uniq)
    await split_set_up(nc, s)
    drains, reconfs = Collector(), Collector()
    await nc.subscribe(drain_subject(s), cb=drains.cb)
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    await nc.flush()
    ranks = FakeRanks(nc, s)
    await ranks.start()
    sched = FakeScheduler(nc, s, H, lambda: DEMAND)
    with capture_logs(processors=[merge_contextvars]) as logs:
        await services(ControllerService(settings(nats_server.url, uniq, "ctl-a")))
        try:
            await sched.start()
            drain = await drains.first(what="a drain notice")

            # The result comes once the source stopped admitting (its ack of the drain record),
            # so that the drain waits on r-running. Sent at the drain notice, it raced that ack
            # and could come first: then nothing was left in flight to wait on.
            async def confirmed() -> bool:
                return any(e["event"] == "drain source stopped admitting" for e in logs)

            await eventually(confirmed, what="the source stopped admitting")
            # The in-flight request's result carries the request's trace context (W3C
            # headers): the drain links to the request it waited on.
            data, headers = encode(FirstToken(
                request_id="r-running", token=7, worker_id="w-cp4-g4", epoch=0,
                stages=TtftStages(), finished_at_s=time.time()))
            with tracer().start_as_current_span("request") as request_span:
                inject(headers)
            await nc.publish(s.result("r-running"), data, headers=headers)
            await reconfs.first(lambda r: r["phase"] == "exposed", what="exposure")

            async def ended() -> list[ReadableSpan]:
                return roots(spans, drain["reconfiguration"])

            (root,) = await eventually(ended, what="the reconfiguration's trace ended")
        finally:
            await sched.stop()
            await ranks.stop()

    assert root.parent is None and root.status.status_code is StatusCode.OK
    a = root.attributes
    assert a["vtm.reconfiguration.kind"] == "split"
    assert list(a["vtm.reconfiguration.sources"]) == ["w-cp4-g4"]
    assert list(a["vtm.reconfiguration.source_degrees"]) == [4]
    assert list(a["vtm.reconfiguration.targets"]) == ["w-cp2-g4", "w-cp2-g6"]
    assert list(a["vtm.reconfiguration.target_degrees"]) == [2, 2]
    # Record epochs: 0 before, 1 the drain record, 2 the commit (the targets'), 3 exposure.
    assert (a["vtm.epoch.before"], a["vtm.epoch.drain"], a["vtm.epoch.after"],
            a["vtm.epoch.exposed"]) == (0, 1, 2, 3)
    assert a["vtm.planner.rule"] == "capacity" and a["vtm.planner.reason"] == drain["reason"]
    assert a["vtm.reconfiguration.outcome"] == "exposed"

    phases = children(spans, root.context.span_id)
    assert [p.name for p in phases] == PHASES
    assert all(hex_trace(p) == hex_trace(root) for p in phases)
    assert all(x.end_time <= y.start_time for x, y in pairwise(phases))  # one after another
    by_name = {p.name: p for p in phases}
    drain_span = by_name["drain"]
    events = {e.name: e.attributes for e in drain_span.events}
    assert list(events["source stopped admitting"]["vtm.in_flight"]) == ["r-running"]
    assert events["request done"]["vtm.request_id"] == "r-running"
    (link,) = drain_span.links
    assert link.context.trace_id == request_span.get_span_context().trace_id
    assert link.context.span_id == request_span.get_span_context().span_id
    assert link.attributes["vtm.request_id"] == "r-running"
    acks = [e for e in by_name["switch"].events if e.name == "rank acknowledged"]
    assert sorted(e.attributes["vtm.gpu"] for e in acks) == [4, 5, 6, 7]

    # The controller's lines about the reconfiguration name it and its trace.
    about = {"reconfiguration started", "drain source stopped admitting", "epoch committed",
             "reconfiguration exposed"}
    lines = [e for e in logs if e["event"] in about]
    assert {e["event"] for e in lines} == about
    assert {e.get("trace_id") for e in lines} == {hex_trace(root)}
    assert {e.get("reconfiguration") for e in lines} == {drain["reconfiguration"]}


async def test_a_drain_that_times_out_is_an_error_trace(
        nc: Client, nats_server, uniq: str, services, spans: InMemorySpanExporter) -> None:
    """The source's running request never finishes: the drain times out, the operation is
    aborted, and its trace says so (status ERROR with the reason, on the root and the drain)."""
    s = Subjects(uniq)
    await split_set_up(nc, s, in_flight="r-stuck")
    reconfs = Collector()
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    await nc.flush()
    sched = FakeScheduler(nc, s, H, lambda: DEMAND)
    with capture_logs(processors=[merge_contextvars]) as logs:
        await services(ControllerService(settings(nats_server.url, uniq, "ctl-a",
                                                  reconfig_drain_timeout_s=0.5)))
        try:
            await sched.start()
            aborted = await reconfs.first(lambda r: r["phase"] == "aborted", what="an abort")
            rid = aborted["reconfiguration"]

            async def ended() -> list[ReadableSpan]:
                return roots(spans, rid)

            (root,) = await eventually(ended, what="the aborted reconfiguration's trace")
        finally:
            await sched.stop()

    assert root.status.status_code is StatusCode.ERROR
    assert "drain timeout" in (root.status.description or "")
    assert root.attributes["vtm.reconfiguration.outcome"] == "aborted"
    phases = children(spans, root.context.span_id)
    assert [p.name for p in phases] == PHASES[:2]  # queue query, drain: no commit
    assert phases[1].status.status_code is StatusCode.ERROR
    (line,) = [e for e in logs if e["event"] == "reconfiguration aborted: drain timeout"
               and e.get("reconfiguration") == rid]
    assert line["trace_id"] == hex_trace(root)


async def test_an_undone_drain_is_an_error_trace(
        nc: Client, nats_server, uniq: str, services, spans: InMemorySpanExporter) -> None:
    """The drain record cannot be written (the epoch bucket is gone): the operation is undone
    and its trace ends with status ERROR naming that (test_live_controller_records' set-up)."""
    s = Subjects(uniq)
    reconfs = Collector()
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    await nc.flush()
    await services(ControllerService(settings(nats_server.url, uniq, "ctl-a")))
    await nc.jetstream().delete_stream(f"KV_{s.epoch_bucket()}")
    sched = FakeScheduler(nc, s, H, lambda: DEMAND)
    with capture_logs(processors=[merge_contextvars]) as logs:
        try:
            await sched.start()
            aborted = await reconfs.first(lambda r: r["phase"] == "aborted", what="undone")

            async def ended() -> list[ReadableSpan]:
                return roots(spans, aborted["reconfiguration"])

            (root,) = await eventually(ended, what="the undone reconfiguration's trace")
        finally:
            await sched.stop()
    assert root.status.status_code is StatusCode.ERROR
    assert (root.status.description or "").startswith("drain record not written")
    assert root.attributes["vtm.reconfiguration.outcome"] == "abandoned"
    lines = [e for e in logs if e["event"] == "drain record not written; operations undone"
             and e.get("reconfiguration") == aborted["reconfiguration"]]
    assert lines and {e["trace_id"] for e in lines} == {hex_trace(root)}


async def test_rank_daemons_handle_the_controllers_queries_in_its_trace(
        nc: Client, nats_server, uniq: str, services, spans: InMemorySpanExporter) -> None:
    """With real rank daemons (test_live_ctl_with_rankd's drain): the source's ``queue``
    handler runs in the reconfiguration's trace, asked under the queue query and, once the
    source stopped admitting, under the drain."""
    s = Subjects(uniq)
    drains, reconfs = Collector(), Collector()
    await nc.subscribe(drain_subject(s), cb=drains.cb)
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    await nc.flush()
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-r",
                                                    queue_query_timeout_s=2.0)))
    backends = {w: GatedBackend() for w in ("w-cp4-g0", "w-cp4-g4")}
    for w, b in backends.items():
        await services(RankdService(RankdSettings(
            nats_url=nats_server.url, subject_prefix=uniq, worker_id=w, heartbeat_s=0.2,
            kv_total_blocks=64), b))
    # w-cp4-g0 has much more outstanding work, so the planner splits w-cp4-g4.
    for i, (w, pred) in enumerate([("w-cp4-g0", 5.0), ("w-cp4-g0", 5.0), ("w-cp4-g4", 0.5)]):
        a = assignment(f"r{i}", w, 4, [100 + i]).model_copy(update={"predicted_s": pred})
        await call(nc, s.worker_assign(w), a, AssignmentAck)
    sched = FakeScheduler(nc, s, H, lambda: DEMAND)
    try:
        async def states_known() -> bool:  # else the planner may pick either source
            st = ctl._states
            return ("w-cp4-g4" in st and st["w-cp4-g4"].queue_len == 1 and "w-cp4-g0" in st
                    and st["w-cp4-g0"].outstanding_s > st["w-cp4-g4"].outstanding_s)

        await eventually(states_known, what="both workers' states at the controller")
        await sched.start()
        drain = await drains.first(what="drain notice")
        assert drain["sources"] == ["w-cp4-g4"]
        backends["w-cp4-g4"].gate.set()  # its running request finishes: the drain ends
        await reconfs.first(lambda r: r["phase"] == "committed", what="commit")

        def named(name: str) -> list[ReadableSpan]:
            return [x for x in spans.get_finished_spans() if x.name == name]

        async def phases_done() -> bool:
            return bool(named("epoch_commit"))

        await eventually(phases_done, what="the commit phase ended")
    finally:
        for b in backends.values():
            b.gate.set()
        await sched.stop()
    (qq,) = named("queue_query")
    (dr,) = named("drain")
    trace_id = qq.context.trace_id
    assert dr.context.trace_id == trace_id and qq.parent.span_id == dr.parent.span_id
    handled = [x for x in named("vtm-rankd.queue") if x.context.trace_id == trace_id]
    parents = {x.parent.span_id for x in handled}
    assert qq.context.span_id in parents  # step 1
    assert dr.context.span_id in parents  # asked again once the source stopped admitting


async def test_a_result_before_the_source_stopped_admitting_is_not_awaited_again(
        nc: Client, nats_server, uniq: str, services) -> None:
    """The in-flight request's result comes before the source has acknowledged the drain
    record (its ranks are busy for a second), and the source's queue, asked once it has,
    still lists the request (an answer older than the result: here the queue is always so
    answered). The drain is done all the same and the split exposed. Before, a result of a
    request the drain awaited was only taken off the awaited set, so the stale answer put it
    back and the drain waited for a result that had come, until its timeout aborted the
    split (a CI failure of the trace test above, whose result raced the acknowledgement)."""
    s = Subjects(uniq)
    await split_set_up(nc, s)
    drains, reconfs = Collector(), Collector()
    await nc.subscribe(drain_subject(s), cb=drains.cb)
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    await nc.flush()
    ranks = FakeRanks(nc, s, coalesce_s=1.0)  # the drain record acknowledged a second late
    await ranks.start()
    sched = FakeScheduler(nc, s, H, lambda: DEMAND)
    await services(ControllerService(settings(nats_server.url, uniq, "ctl-a")))
    try:
        await sched.start()
        await drains.first(what="a drain notice")
        assert not ranks.acked  # the source has not stopped admitting yet
        data, headers = encode(FirstToken(
            request_id="r-running", token=7, worker_id="w-cp4-g4", epoch=0,
            stages=TtftStages(), finished_at_s=time.time()))
        await nc.publish(s.result("r-running"), data, headers=headers)
        exposed = await reconfs.first(lambda r: r["phase"] == "exposed", what="exposure")
        assert exposed["sources"] == ["w-cp4-g4"]
        assert not [r for r in reconfs.items if r["phase"] == "aborted"]
    finally:
        await sched.stop()
        await ranks.stop()
