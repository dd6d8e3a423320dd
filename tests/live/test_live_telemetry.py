"""W3C trace context crosses a real NATS request-reply: the responder's span is a child."""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared.telemetry import Stage, extract, inject, record_span, stage_span, tracer


async def test_child_span_in_responder_is_parented_to_requester(
    nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    subject = f"{uniq}.echo"
    seen_headers: list[dict[str, str]] = []

    async def responder(msg: Msg) -> None:
        seen_headers.append(dict(msg.headers or {}))
        with stage_span(Stage.PREFILL, parent=msg.headers, attributes={"vtm.predicted_s": 0.5}):
            await msg.respond(b"ok")

    sub = await nc.subscribe(subject, cb=responder)
    with tracer().start_as_current_span(Stage.REQUEST) as root:
        headers = inject({})
        reply = await nc.request(subject, b"hi", timeout=10, headers=headers)
    assert reply.data == b"ok"
    await sub.unsubscribe()

    assert "traceparent" in seen_headers[0]
    by_name = {s.name: s for s in spans.get_finished_spans()}
    child, parent = by_name["prefill"], by_name["request"]
    assert child.context.trace_id == parent.context.trace_id == root.get_span_context().trace_id
    assert child.parent is not None and child.parent.span_id == parent.context.span_id
    assert child.attributes["vtm.predicted_s"] == 0.5


async def test_capitalised_header_is_accepted(spans: InMemorySpanExporter) -> None:
    with tracer().start_as_current_span("root") as root:
        carrier = inject()
    capitalised = {"Traceparent": carrier["traceparent"]}
    ctx = trace.get_current_span(extract(capitalised)).get_span_context()
    assert ctx.trace_id == root.get_span_context().trace_id


def test_no_context_gives_a_new_root(spans: InMemorySpanExporter) -> None:
    assert inject() == {}
    with stage_span("orphan", parent={}) as span:
        assert span.get_span_context().is_valid
    (orphan,) = spans.get_finished_spans()
    assert orphan.parent is None


async def test_context_survives_jetstream(
    nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    js = nc.jetstream()
    await js.add_stream(name=uniq.upper(), subjects=[f"{uniq}.js"])
    with tracer().start_as_current_span("publish") as root:
        await js.publish(f"{uniq}.js", b"x", headers=inject({}))
    sub = await js.pull_subscribe(f"{uniq}.js", durable="d")
    (msg,) = await sub.fetch(1, timeout=10)
    await msg.ack()
    record_span(Stage.INTAKE_WAIT, start_s=1.0, end_s=2.0, parent=msg.headers)
    wait = next(s for s in spans.get_finished_spans() if s.name == "intake_wait")
    assert wait.parent.span_id == root.get_span_context().span_id
    assert wait.end_time - wait.start_time == 1_000_000_000
    # A bogus stamp (any finite float decodes as a WallTime) records nothing, raises nothing.
    record_span(Stage.INTAKE_WAIT, start_s=1e300, end_s=1e300, parent=msg.headers)
    record_span(Stage.INTAKE_WAIT, start_s=1.0, end_s=float("inf"), parent=msg.headers)
    assert sum(s.name == "intake_wait" for s in spans.get_finished_spans()) == 1
    await js.delete_stream(uniq.upper())
    await asyncio.sleep(0)
