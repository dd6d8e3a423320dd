"""A rank daemon's adoption of an epoch record is an ``epoch_adopt`` span in the trace the
record's ``traceparent`` names (real nats-server, real RankdService, sim backend; the records
are put in the epoch bucket by hand, as the controller writes them).

A KV value has no headers, so before, an adoption was in no trace: a reconfiguration's trace
ended at the controller's record write. The record now carries the writer's span context; a
malformed one must not cost the adoption (it is adopted, the span a root, one warning)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from gated_backend import GatedBackend
from nats.aio.client import Client
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from rankd_support import assign, until
from service_support import service_running
from structlog.testing import capture_logs

from services.rankd.backend import SimBackend
from services.rankd.service import EPOCH_ADOPT_SPAN, RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import EpochRecord, EpochWorker, to_json
from shared.service import epoch_kv
from shared.subjects import Subjects
from shared.telemetry import inject, tracer
from shared.worker import GpuGroup, Lifecycle

WID = "w-cp2-g2"
MALFORMED_WARNING = "epoch record's traceparent malformed; its adoption is traced without a parent"


def record(epoch: int, lifecycle: Lifecycle = Lifecycle.ACTIVE, traceparent: str = "") -> bytes:
    """The record the controller would write: ``WID`` alone, in ``lifecycle``."""
    g = GpuGroup.from_worker_id(WID)
    return to_json(EpochRecord(
        epoch=epoch, committed_at_s=time.time(), traceparent=traceparent,
        workers=[EpochWorker(worker_id=WID, first_gpu=g.first_gpu, degree=g.degree,
                             lifecycle=lifecycle)]))


def rankd(nats_server: EmbeddedNats, uniq: str, backend: SimBackend | None = None
          ) -> RankdService:
    return RankdService(RankdSettings(nats_url=nats_server.url, subject_prefix=uniq,
                                      worker_id=WID, heartbeat_s=0.2),
                        backend or SimBackend(time_scale=1.0))


async def adopted(spans: InMemorySpanExporter, epoch: int) -> ReadableSpan:
    """The ``epoch_adopt`` span of ``epoch`` (waited for, bounded)."""
    found: list[ReadableSpan] = []

    def there() -> bool:
        found[:] = [x for x in spans.get_finished_spans() if x.name == EPOCH_ADOPT_SPAN
                    and x.attributes.get("vtm.epoch") == epoch]
        return bool(found)

    await until(there, f"the adoption span of epoch {epoch}")
    (span,) = found
    return span


def lifecycle_of(span: ReadableSpan) -> Any:
    return span.attributes["vtm.lifecycle"]


async def test_an_adoption_is_a_child_of_the_span_that_wrote_the_record(
        nats_server: EmbeddedNats, nc: Client, uniq: str,
        spans: InMemorySpanExporter) -> None:
    s = Subjects(uniq)
    epochs = await epoch_kv(nc.jetstream(), s)
    async with service_running(rankd(nats_server, uniq)):
        with tracer().start_as_current_span("epoch_commit") as writer:  # the controller's phase
            traceparent = inject({})["traceparent"]
        await epochs.put(s.epoch_key(), record(1, traceparent=traceparent))
        span = await adopted(spans, 1)
    assert span.parent is not None
    assert span.parent.span_id == writer.get_span_context().span_id
    assert span.context.trace_id == writer.get_span_context().trace_id
    assert dict(span.attributes) == {
        "vtm.epoch": 1, "vtm.worker_id": WID, "vtm.lifecycle": "active", "vtm.member": True,
        "vtm.redirected": False, "vtm.redirected_count": 0}


@pytest.mark.parametrize("bad", [
    "not-a-traceparent",
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # uppercase hex
])
async def test_a_malformed_traceparent_does_not_stop_the_adoption(
        nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter,
        bad: str) -> None:
    """The record is there before the worker starts: it is adopted at the start (read from
    the bucket) and seen again by the watcher (its initial value), yet warned about once; its
    adoption is traced as a root. A later record is adopted as usual."""
    s = Subjects(uniq)
    epochs = await epoch_kv(nc.jetstream(), s)
    await epochs.put(s.epoch_key(), record(3, Lifecycle.DRAINING, traceparent=bad))
    with capture_logs() as logs:
        async with service_running(rankd(nats_server, uniq)) as task:
            span = await adopted(spans, 3)
            assert lifecycle_of(span) == "draining"
            # The watcher goes on: the next record is adopted (after its initial value).
            await epochs.put(s.epoch_key(), record(4))
            later = await adopted(spans, 4)
            assert not task.done()
    assert span.parent is None
    assert later.parent is None and lifecycle_of(later) == "active"  # no traceparent: a root
    warnings = [e for e in logs if e["event"] == MALFORMED_WARNING]
    assert len(warnings) == 1 and warnings[0]["log_level"] == "warning"
    assert warnings[0]["epoch"] == 3




async def test_an_adoption_that_hands_requests_back_says_so(
        nats_server: EmbeddedNats, nc: Client, uniq: str,
        spans: InMemorySpanExporter) -> None:
    """A drain record reaches a worker with a request running and one queued: the queued one
    is handed back (redirected), and the adoption's span says so."""
    s = Subjects(uniq)
    backend = GatedBackend()
    svc = rankd(nats_server, uniq, backend)
    epochs = await epoch_kv(nc.jetstream(), s)
    try:
        async with service_running(svc):
            await assign(nc, s, "r-running", WID)
            await assign(nc, s, "r-queued", WID)
            await until(lambda: svc.core.running is not None, "the first request running")
            await epochs.put(s.epoch_key(), record(1, Lifecycle.DRAINING))
            span = await adopted(spans, 1)
            backend.gate.set()
    finally:
        backend.gate.set()
    assert lifecycle_of(span) == "draining"
    assert span.attributes["vtm.redirected"] is True
    assert span.attributes["vtm.redirected_count"] == 1
