"""The controller's reconfiguration traces (services/controller/tracing.py) without NATS: the
span tree, ERROR endings with the reason, bounded events, links only to valid contexts, and
the log binding of the trace id."""

from __future__ import annotations

import structlog
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode
from structlog.contextvars import merge_contextvars
from structlog.testing import capture_logs

from services.controller.lattice import OpKind
from services.controller.planner import Plan
from services.controller.tracing import (
    MAX_EVENTS_PER_PHASE,
    ReconfStage,
    ReconfTraces,
    plan_attributes,
)
from shared.telemetry import inject, tracer
from shared.worker import GpuGroup

PLAN = Plan(OpKind.MERGE, (GpuGroup(0, 2), GpuGroup(2, 2)), (GpuGroup(0, 4),),
            "demand low", 0.5, 0.0)


def begin(traces: ReconfTraces, rid: int = 7):
    t = traces.begin(plan_attributes(PLAN, rule="capacity", epoch_before=3, instance="ctl"))
    traces.started(t, rid, {"vtm.reconfiguration.in_flight": 1})
    return t


def test_a_merge_traced_to_its_exposure(spans: InMemorySpanExporter) -> None:
    traces = ReconfTraces()
    begin(traces)
    for stage in (ReconfStage.EPOCH_COMMIT, ReconfStage.SWITCH, ReconfStage.EXPOSE):
        traces.phase(7, stage)
    traces.phase(7, ReconfStage.EXPOSE)  # a retry: the same span, an event
    traces.ended(7, **{"vtm.epoch.exposed": 6})
    assert 7 not in traces
    done = spans.get_finished_spans()
    (root,) = [s for s in done if s.name == "reconfiguration"]
    kids = sorted((s for s in done if s.parent and s.parent.span_id == root.context.span_id),
                  key=lambda s: s.start_time)
    assert [s.name for s in kids] == ["queue_query", "drain", "epoch_commit", "switch",
                                      "expose"]
    assert [e.name for e in kids[-1].events] == ["retried"]
    a = root.attributes
    assert a["vtm.reconfiguration.kind"] == "merge" and a["vtm.reconfiguration.id"] == 7
    assert list(a["vtm.reconfiguration.sources"]) == ["w-cp2-g0", "w-cp2-g2"]
    assert list(a["vtm.reconfiguration.source_degrees"]) == [2, 2]
    assert list(a["vtm.reconfiguration.targets"]) == ["w-cp4-g0"]
    assert list(a["vtm.reconfiguration.target_degrees"]) == [4]
    assert a["vtm.epoch.before"] == 3 and a["vtm.epoch.exposed"] == 6
    assert a["vtm.planner.rule"] == "capacity" and a["vtm.planner.reason"] == "demand low"
    assert root.status.status_code is StatusCode.OK


def test_a_failure_ends_the_open_phase_and_the_root_as_errors(
        spans: InMemorySpanExporter) -> None:
    traces = ReconfTraces()
    begin(traces, 1)
    begin(traces, 2)
    traces.failed(1, "drain timeout", outcome="aborted")
    traces.fail_all("controller stopped", outcome="interrupted")
    traces.failed(1, "again")  # unknown by now: nothing
    done = spans.get_finished_spans()
    roots = {s.attributes["vtm.reconfiguration.id"]: s for s in done
             if s.name == "reconfiguration"}
    assert roots[1].status.description == "drain timeout"
    assert roots[2].status.description == "controller stopped"
    assert roots[2].attributes["vtm.reconfiguration.outcome"] == "interrupted"
    drains = [s for s in done if s.name == "drain"]
    assert len(drains) == 2 and all(s.status.status_code is StatusCode.ERROR for s in drains)


def test_events_are_bounded_and_links_need_a_valid_context(
        spans: InMemorySpanExporter) -> None:
    traces = ReconfTraces()
    begin(traces)
    for i in range(MAX_EVENTS_PER_PHASE + 5):
        traces.event(7, "request done", **{"vtm.request_id": f"r{i}"})
    assert not traces.link(7, None) and not traces.link(7, {"traceparent": "garbage"})
    with tracer().start_as_current_span("request") as req:
        carrier = inject({})
    assert traces.link(7, {"Traceparent": carrier["traceparent"]}, **{"vtm.request_id": "r"})
    traces.phase(7, ReconfStage.EPOCH_COMMIT)
    assert not traces.link(7, carrier)  # only the drain links to what it waited on
    traces.ended(7)
    (drain,) = [s for s in spans.get_finished_spans() if s.name == "drain"]
    assert len(drain.events) == MAX_EVENTS_PER_PHASE
    assert drain.attributes["vtm.events_dropped"] == 5
    (link,) = drain.links
    assert link.context.span_id == req.get_span_context().span_id


def test_lines_logged_in_a_reconfiguration_carry_its_trace_id(
        spans: InMemorySpanExporter) -> None:
    traces = ReconfTraces()
    t = begin(traces)
    log = structlog.get_logger("test")
    with capture_logs(processors=[merge_contextvars]) as logs:
        with traces.current(7):
            log.info("inside")
        with traces.current(8):  # no such reconfiguration: nothing bound
            log.info("unknown")
        log.info("outside")
    by_event = {e["event"]: e for e in logs}
    assert by_event["inside"]["trace_id"] == t.trace_id
    assert by_event["inside"]["reconfiguration"] == 7
    assert "trace_id" not in by_event["unknown"] and "trace_id" not in by_event["outside"]
    traces.ended(7)
