"""A rank daemon's EpochAcks carry the context of its ``epoch_adopt`` span in their headers
(real nats-server, real RankdService, sim backend; the records put in the epoch bucket by
hand, carrying the writer's context as the controller writes them).

So the controller's handling of an ack (its ``epoch_ack`` span) is a child of the adoption it
acknowledges, in the reconfiguration's trace. An ack whose first publish fails is sent again
with the same context; an adoption whose record's context is not sampled sends that decision
on (its acks' ``traceparent`` is not sampled) and records nothing. Before, the acks carried no
trace headers.
"""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from service_support import service_running
from test_live_rankd_epoch_ack import fail_first_ack
from test_live_rankd_epoch_adopt_span import WID, adopted, rankd, record

from services.rankd.service import EPOCH_ADOPT_SPAN
from shared.natsserver import EmbeddedNats
from shared.schemas import EpochAck, decode
from shared.service import epoch_kv
from shared.subjects import Subjects
from shared.telemetry import inject, is_sampled, traceparent_of, tracer

WAIT_S = 20.0  # bound for correctness waits only; nothing asserts on speed
GPUS = (2, 3)  # WID's


class AckHeaders:
    """The headers of every EpochAck published under the prefix, by (gpu, epoch)."""

    def __init__(self) -> None:
        self.seen: dict[tuple[int, int], dict[str, str]] = {}
        self._new = asyncio.Event()

    async def on_msg(self, msg: Msg) -> None:
        ack = decode(EpochAck, msg.data, msg.headers)
        self.seen[(ack.gpu, ack.epoch)] = dict(msg.headers or {})
        self._new.set()

    async def wait_for(self, epoch: int) -> list[dict[str, str]]:
        """Each GPU's ack of ``epoch`` (in GPU order), once all are there."""
        async with asyncio.timeout(WAIT_S):
            while not all((g, epoch) in self.seen for g in GPUS):
                self._new.clear()
                await self._new.wait()
        return [self.seen[(g, epoch)] for g in GPUS]


def ids(span: ReadableSpan) -> tuple[str, str]:
    return format(span.context.trace_id, "032x"), format(span.context.span_id, "016x")


def carried(headers: dict[str, str]) -> tuple[str, str] | None:
    tp = traceparent_of(headers)
    return None if tp is None else (tp[3:35], tp[36:52])


@pytest.mark.parametrize("refused", [False, True], ids=["sent", "sent-again"])
async def test_the_acks_carry_the_adoption_s_context(
        nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter,
        monkeypatch: pytest.MonkeyPatch, refused: bool) -> None:
    """Each GPU's ack of a record written under a (sampled) phase span carries the context of
    the worker's ``epoch_adopt`` span of it -- the one sent again after its first publish
    failed (``sent-again``: GPU 2's) too."""
    s = Subjects(uniq)
    acks = AckHeaders()
    sub = await nc.subscribe(s.epoch_ack_all(), cb=acks.on_msg)
    svc = rankd(nats_server, uniq)
    try:
        async with service_running(svc, timeout_s=WAIT_S):
            refusals = (fail_first_ack(monkeypatch, svc.nc, s.epoch_ack(2), epoch=1)
                        if refused else [])
            epochs = await epoch_kv(nc.jetstream(), s)
            with tracer().start_as_current_span("epoch_commit"):  # the controller's phase
                traceparent = inject({})["traceparent"]
            await epochs.put(s.epoch_key(), record(1, traceparent=traceparent))
            headers = await acks.wait_for(1)
            span = await adopted(spans, 1)
    finally:
        await sub.unsubscribe()
    assert [(a.gpu, a.epoch) for a in refusals] == ([(2, 1)] if refused else [])
    assert span.context.trace_id == int(traceparent[3:35], 16)
    assert [carried(h) for h in headers] == [ids(span), ids(span)]


async def test_an_unsampled_adoption_sends_the_decision_on(
        nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter) -> None:
    """A record whose context is not sampled: nothing of its adoption is recorded, and the
    acks carry a context of the same trace that is not sampled either, so the controller
    records nothing of them."""
    s = Subjects(uniq)
    acks = AckHeaders()
    sub = await nc.subscribe(s.epoch_ack_all(), cb=acks.on_msg)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    try:
        async with service_running(rankd(nats_server, uniq), timeout_s=WAIT_S):
            epochs = await epoch_kv(nc.jetstream(), s)
            await epochs.put(s.epoch_key(),
                             record(1, traceparent=f"00-{trace_id}-00f067aa0ba902b7-00"))
            headers = await acks.wait_for(1)
    finally:
        await sub.unsubscribe()
    for h in headers:
        got = carried(h)
        assert got is not None and got[0] == trace_id and not is_sampled(h)
    assert not [x for x in spans.get_finished_spans() if x.name == EPOCH_ADOPT_SPAN
                and x.attributes.get("vtm.worker_id") == WID]


async def test_a_failed_adoption_is_recorded_with_its_error(
        nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Should what follows the core's adoption raise (here the metadata's republish, made to
    fail), the ``epoch_adopt`` span is still recorded, with status ERROR and the exception,
    and the watcher goes on to adopt the next record. Before, the span started for the acks'
    context was left open and never exported."""
    s = Subjects(uniq)
    svc = rankd(nats_server, uniq)
    calls = 0

    def fail_once() -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("metadata refused")

    async with service_running(svc, timeout_s=WAIT_S):
        monkeypatch.setattr(svc, "_update_metadata", fail_once)
        epochs = await epoch_kv(nc.jetstream(), s)
        with tracer().start_as_current_span("epoch_commit"):
            traceparent = inject({})["traceparent"]
        await epochs.put(s.epoch_key(), record(1, traceparent=traceparent))
        failed = await adopted(spans, 1)
        await epochs.put(s.epoch_key(), record(2, traceparent=traceparent))
        later = await adopted(spans, 2)
    assert failed.status.status_code.name == "ERROR"
    assert failed.status.description == "RuntimeError"
    assert [e.name for e in failed.events] == ["exception"]
    assert failed.context.trace_id == int(traceparent[3:35], 16)
    assert later.status.status_code.name == "UNSET"
