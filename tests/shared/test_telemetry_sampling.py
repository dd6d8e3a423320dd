"""The services' sampler (shared.telemetry.sampler): a root created with ``ALWAYS_SAMPLE``
(a reconfiguration's) is kept whatever the ratio, every other root by the ratio, and every
child -- in the process or in another one, through a ``traceparent`` -- by its parent.

Before, the sampler was ``ParentBased(TraceIdRatioBased(ratio))`` alone: at a ratio of 0 a
reconfiguration's trace was lost like any request's. Each test uses providers of its own (the
process's provider is the test session's, installed once)."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Tracer

from shared.telemetry import ALWAYS_SAMPLE, extract, inject, sampler


def provider(ratio: float) -> tuple[Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    p = TracerProvider(sampler=sampler(ratio), shutdown_on_exit=False)
    p.add_span_processor(SimpleSpanProcessor(exporter))
    return p.get_tracer("t"), exporter


def names(exporter: InMemorySpanExporter) -> list[str]:
    return sorted(s.name for s in exporter.get_finished_spans())


def test_at_ratio_zero_a_marked_root_and_its_children_are_kept_and_nothing_else() -> None:
    t, exported = provider(0.0)
    with t.start_as_current_span("reconfiguration", attributes={ALWAYS_SAMPLE: True}):
        with t.start_as_current_span("drain"):
            pass
    with t.start_as_current_span("request"):
        with t.start_as_current_span("schedule"):
            pass
    assert names(exported) == ["drain", "reconfiguration"]


def test_another_process_follows_the_marked_root_through_its_traceparent() -> None:
    """A rank daemon (a provider of its own, ratio 0) given the phase span's context."""
    controller, _ = provider(0.0)
    rank, exported = provider(0.0)
    with controller.start_as_current_span("reconfiguration", attributes={ALWAYS_SAMPLE: True}):
        marked = inject({})
    with controller.start_as_current_span("request"):
        plain = inject({})
    rank.start_span("epoch_adopt", context=extract(marked)).end()
    rank.start_span("assign", context=extract(plain)).end()
    assert names(exported) == ["epoch_adopt"]


@pytest.mark.parametrize("marker", [False, "true", 1])
def test_only_a_true_marker_overrides_the_ratio(marker: object) -> None:
    t, exported = provider(0.0)
    t.start_span("root", attributes={ALWAYS_SAMPLE: marker}).end()  # type: ignore[dict-item]
    assert names(exported) == []


def test_a_marker_set_after_creation_changes_nothing() -> None:
    """The sampler sees the attributes given at creation only (why the controller gives it
    there)."""
    t, exported = provider(0.0)
    span = t.start_span("root")
    span.set_attribute(ALWAYS_SAMPLE, True)
    span.end()
    assert names(exported) == []


def test_at_ratio_one_every_root_is_kept() -> None:
    t, exported = provider(1.0)
    t.start_span("request").end()
    t.start_span("reconfiguration", attributes={ALWAYS_SAMPLE: True}).end()
    assert names(exported) == ["reconfiguration", "request"]


def test_a_marked_span_under_an_unsampled_parent_follows_its_parent() -> None:
    """The marker makes a *root* sampled; a span with a parent follows the parent's decision
    (parent-based), so a trace is never half kept."""
    t, exported = provider(0.0)
    with t.start_as_current_span("request"):
        t.start_span("child", attributes={ALWAYS_SAMPLE: True}).end()
    assert names(exported) == []
