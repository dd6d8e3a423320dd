"""The schedule span's attributes fit the span attribute limit, whatever the pool's size.

A decision over 30 workers has ~200 candidate attributes; the OpenTelemetry SDK keeps 128 by
default and, past that, replaces the *oldest* ones (the choice itself). decision_attributes
budgets them: the choice and the full decision JSON always, then whole candidates, the chosen
worker first, then by score. Checked on a real SDK span with the SDK's default limits.
"""

from __future__ import annotations

import json

import pytest
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.scheduler import WorkerLoad, WorkerView, place_j
from services.scheduler.service import SCHEDULE_SPAN_RESERVED, decision_attributes
from shared.ids import WorkerId
from shared.telemetry import span_attribute_limit
from shared.worker import Lifecycle
from tests.scheduler.sched_support import ROUND, loads_for, req, view

W = WorkerId


def _big_decision(n: int = 30):  # type: ignore[no-untyped-def]
    ws = [WorkerView(W(f"w{i:02d}"), 2 if i % 2 else 4,
                     lifecycle=Lifecycle.DRAINING if i == 7 else Lifecycle.ACTIVE)
          for i in range(n)]
    v = view(*ws)
    loads = loads_for(v)
    for i, wid in enumerate(sorted(loads)):  # distinct queues: distinct scores
        ld: WorkerLoad = loads[wid]
        if i % 3:
            ld.reserve(f"x{i}", 0.05 * i, now=0.0)
    return place_j(req("r", 1000), v, {W("w05"): 4}, loads, 0.0, profile=ROUND, beta=1.0,
                   lam=0.1)


def test_unbounded_lists_every_candidate() -> None:
    d = _big_decision()
    attrs = decision_attributes(d)
    assert attrs["vtm.candidates_shown"] == 30 and attrs["vtm.candidates"] == 29
    assert attrs["vtm.candidate.w07.excluded"] == "draining"
    assert len(json.loads(attrs["vtm.decision"])["candidates"]) == 30


@pytest.mark.parametrize("limit", [30, 60, 120])
def test_bounded_keeps_the_choice_and_the_best_candidates(limit: int) -> None:
    d = _big_decision()
    attrs = decision_attributes(d, limit)
    assert len(attrs) <= limit
    assert attrs["vtm.worker_id"] == d.worker and attrs["vtm.policy"] == "vertumnus"
    shown = attrs["vtm.candidates_shown"]
    assert 0 < shown < 30
    assert f"vtm.candidate.{d.worker}.score" in attrs  # the chosen worker's terms first
    # The shown eligible candidates are the best-scored ones (J is minimised).
    scored = sorted((c for c in d.candidates if c.excluded is None), key=lambda c: c.score)
    listed = {c.worker for c in scored if f"vtm.candidate.{c.worker}.score" in attrs}
    assert listed == {c.worker for c in scored[:len(listed)]} | {d.worker}
    # Every candidate is still in the decision's JSON.
    assert len(json.loads(attrs["vtm.decision"])["candidates"]) == 30


def test_too_small_a_limit_still_keeps_the_choice() -> None:
    attrs = decision_attributes(_big_decision(), 5)
    assert attrs["vtm.candidates_shown"] == 0 and attrs["vtm.worker_id"]
    assert not any(k.startswith("vtm.candidate.") for k in attrs)


def test_a_real_span_drops_nothing_under_the_default_limit() -> None:
    limits = SpanLimits()
    assert limits.max_span_attributes == span_attribute_limit() == 128  # SDK default, no env
    exporter = InMemorySpanExporter()
    provider = TracerProvider(span_limits=limits)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    d = _big_decision()
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("schedule", attributes={
            "vtm.request_id": "r", "vtm.scheduler": "s", "vtm.delivery": 1}) as span:
        limit = span_attribute_limit()
        assert limit is not None
        span.set_attributes(decision_attributes(d, limit - SCHEDULE_SPAN_RESERVED))
        span.set_attribute("vtm.queue_position", 0)
    (done,) = exporter.get_finished_spans()
    assert done.dropped_attributes == 0
    assert done.attributes["vtm.request_id"] == "r" and done.attributes["vtm.worker_id"] == d.worker
    # Without the budget the SDK would have replaced the oldest attributes.
    with tracer.start_as_current_span("schedule") as span:
        span.set_attribute("vtm.request_id", "r")
        span.set_attributes(decision_attributes(d))
    assert exporter.get_finished_spans()[-1].dropped_attributes > 0
    provider.shutdown()


def test_the_limit_follows_the_sdk_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT", "300")
    import shared.telemetry as tel

    monkeypatch.setattr(tel, "_limits", None)  # as before any provider is installed
    assert span_attribute_limit() == 300
