"""The gateway's ``first_token_trip`` span: the first token's trip from its worker
(``finished_at_s``) to the gateway's receipt, under the current span; a worker clock ahead of
the gateway's gives an empty span at the receipt, with the skew stated."""

from __future__ import annotations

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.gateway.adapter import FIRST_TOKEN_TRIP_SPAN, record_first_token_trip
from shared.schemas import FirstToken, TtftStages
from shared.telemetry import tracer


def first_token(finished_at_s: float) -> FirstToken:
    return FirstToken(request_id="r-1", token=7, worker_id="w-cp2-g0", stages=TtftStages(
        intake_wait_s=0, schedule_s=0, queue_wait_s=0, prefill_s=0, kv_transfer_s=0,
        first_decode_s=0, total_s=0), finished_at_s=finished_at_s)


def test_the_trip_runs_from_the_workers_finish_to_the_receipt_under_the_current_span(
        spans: InMemorySpanExporter) -> None:
    with tracer().start_as_current_span("request") as root:
        record_first_token_trip(first_token(1_000.25), 1_000.5)
    (trip,) = [s for s in spans.get_finished_spans() if s.name == FIRST_TOKEN_TRIP_SPAN]
    assert trip.parent.span_id == root.get_span_context().span_id
    assert (trip.start_time, trip.end_time) == (1_000_250_000_000, 1_000_500_000_000)
    assert trip.attributes["vtm.request_id"] == "r-1"
    assert trip.attributes["vtm.worker_id"] == "w-cp2-g0"
    assert "vtm.clock_skew_s" not in trip.attributes


def test_a_worker_clock_ahead_gives_an_empty_span_at_the_receipt_with_the_skew(
        spans: InMemorySpanExporter) -> None:
    with tracer().start_as_current_span("request"):
        record_first_token_trip(first_token(1_000.75), 1_000.5)
    (trip,) = [s for s in spans.get_finished_spans() if s.name == FIRST_TOKEN_TRIP_SPAN]
    assert trip.start_time == trip.end_time == 1_000_500_000_000
    assert trip.attributes["vtm.clock_skew_s"] == 0.25
