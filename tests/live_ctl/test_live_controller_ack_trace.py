"""The controller's handling of an EpochAck is an ``epoch_ack`` span, a child of the context
the ack's headers carry (the rank's ``epoch_adopt`` span of the record it acknowledges), with
the ack's GPU, epoch and worker and what it counted for -- on a real server with acks
published by hand, as a rank daemon sends them (test_live_reconfig_tracing.py shows the
targets' acks of a split's commit counted under their adoptions, with real rank daemons).

Sampling is respected: an ack whose context is not sampled records nothing, and neither does
one without a valid context (an older rank daemon: no root per ack). Every ack is handled alike
whatever it carries. Before, the controller read no headers of an ack.
"""

from __future__ import annotations

import time

import pytest
from live_ctl_support import eventually
from nats.aio.client import Client
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from test_live_controller import settings

from services.controller.service import EPOCH_ACK_SPAN, ControllerService
from shared.schemas import EpochAck, encode
from shared.subjects import Subjects

ADOPT_TRACE, ADOPT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def ack(gpu: int) -> EpochAck:
    """A rank of w-cp4-g0 (GPUs 0-3) acknowledging the initial record: ACTIVE, not a switching
    target, so the controller ignores it (every rank acknowledges every record it adopts)."""
    return EpochAck(gpu=gpu, epoch=0, degree=4, worker_id="w-cp4-g0", adopted_at_s=time.time())


@pytest.mark.parametrize(("traceparent", "recorded"), [
    pytest.param(f"00-{ADOPT_TRACE}-{ADOPT_SPAN}-01", True, id="sampled"),
    pytest.param(f"00-{ADOPT_TRACE}-{ADOPT_SPAN}-00", False, id="not-sampled"),
    pytest.param("00-not-a-trace-context-01", False, id="malformed"),
    pytest.param(None, False, id="none"),
])
async def test_an_ack_is_handled_under_the_adoption_it_acknowledges(
        nc: Client, nats_server, uniq: str, services, spans: InMemorySpanExporter,
        traceparent: str | None, recorded: bool) -> None:
    s = Subjects(uniq)
    ctl = await services(ControllerService(settings(nats_server.url, uniq, "ctl-a")))
    assert isinstance(ctl, ControllerService)

    async def ready() -> bool:
        return ctl.core is not None

    await eventually(ready, what="the controller's core")
    data, headers = encode(ack(1))
    if traceparent is not None:
        headers["traceparent"] = traceparent
    before = ctl.counters["acks_ignored"]
    await nc.publish(s.epoch_ack(1), data, headers=headers)

    async def handled() -> bool:
        return ctl.counters["acks_ignored"] == before + 1

    await eventually(handled, what="the ack handled")

    async def ended() -> list[ReadableSpan]:
        return [x for x in spans.get_finished_spans() if x.name == EPOCH_ACK_SPAN]

    if not recorded:
        # NOTE: a span would have ended by now: the handler ends it right after counting,
        # with no await between.
        assert await ended() == []
        return
    (span,) = await eventually(ended, what="the ack's span")
    assert span.kind is SpanKind.CONSUMER
    assert span.parent is not None and span.parent.is_remote
    assert (format(span.parent.trace_id, "032x"), format(span.parent.span_id, "016x")) == (
        ADOPT_TRACE, ADOPT_SPAN)
    assert dict(span.attributes) == {"vtm.gpu": 1, "vtm.epoch": 0, "vtm.worker_id": "w-cp4-g0",
                                     "vtm.ack.outcome": "ignored"}
