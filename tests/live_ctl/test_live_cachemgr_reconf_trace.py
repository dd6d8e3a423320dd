"""The cache manager's part in a reconfiguration joins the reconfiguration's trace, on a real
server with fake workers (plain subscribers): its handling of a DrainNotice is a
``cachemgr_drain`` span, a child of the context the notice's headers carry, and the
re-homing copy it sends is that span's child (the command's headers carry the copy's span);
its handling of a newer epoch record is a ``cachemgr_epoch`` span, a child of the record's
``traceparent``, and the snapshot requests of the split's children it sends carry it.

A notice or record without a context, or with a malformed one, is acted on all the same: the
span is a root (a malformed context is logged as a warning).

Before, the notice's headers were ignored and the record's ``traceparent`` unread: the copy
was a root of its own and the reconcile in no span (test_live_reconfig_tracing.py runs the
whole split with the controller and real rank daemons).
"""

from __future__ import annotations

import time

import pytest
from live_ctl_support import Collector, eventually
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from structlog.testing import capture_logs
from test_live_cachemgr import acking_worker, counted, holding, settings, stored

from services.cachemgr.service import CacheMgrService
from services.cachemgr.tracing import DRAIN_SPAN, EPOCH_SPAN
from services.controller.service import drain_subject
from shared.schemas import (
    DrainNotice,
    EpochRecord,
    EpochWorker,
    PendingQuery,
    PendingReply,
    encode,
    to_json,
)
from shared.service import call, epoch_kv
from shared.subjects import Subjects
from shared.telemetry import traceparent_of, tracer
from shared.worker import Lifecycle

PHASE_TRACE, PHASE_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{PHASE_TRACE}-{PHASE_SPAN}-01"
"""The controller's phase span (drain, commit) as the notice's headers or the record carry it."""
MALFORMED = "00-not-a-trace-context-01"
PARENT, PEER = "w-cp4-g0", "w-cp4-g4"
DOC = [11, 12, 13, 14]

# (what the notice or record carries, whether the span is the phase's child, warned)
CONTEXTS = [
    pytest.param(TRACEPARENT, True, False, id="carried"),
    pytest.param(MALFORMED, False, True, id="malformed"),
    pytest.param(None, False, False, id="none"),
]


def record(epoch: int, groups: list[tuple[int, int]], traceparent: str | None) -> bytes:
    """An EpochRecord of (first GPU, degree) groups, every worker ACTIVE, carrying
    ``traceparent`` (None: none)."""
    return to_json(EpochRecord(
        epoch=epoch, committed_at_s=time.time(), traceparent=traceparent or "",
        workers=[EpochWorker(worker_id=f"w-cp{d}-g{g}", first_gpu=g, degree=d,
                             lifecycle=Lifecycle.ACTIVE) for g, d in groups]))


def hexid(n: int, width: int) -> str:
    return format(n, f"0{width}x")


def checked_parent(span: ReadableSpan, carried: bool) -> None:
    """``span`` is the phase's child when the context was carried, else a root."""
    if carried:
        assert span.parent is not None
        assert (hexid(span.parent.trace_id, 32), hexid(span.parent.span_id, 16)) == (
            PHASE_TRACE, PHASE_SPAN)
        assert span.parent.is_remote
    else:
        assert span.parent is None
        assert hexid(span.context.trace_id, 32) != PHASE_TRACE


async def one_span(spans: InMemorySpanExporter, name: str, **attrs: object) -> ReadableSpan:
    """The one finished span ``name`` with ``attrs``, once it has ended."""

    async def probe() -> list[ReadableSpan]:
        return [x for x in spans.get_finished_spans() if x.name == name
                and all(x.attributes.get(k) == v for k, v in attrs.items())]

    (x,) = await eventually(probe, what=f"span {name} {attrs}")
    return x


def warned(logs: list[dict[str, object]], what: str) -> list[dict[str, object]]:
    return [e for e in logs if e["event"] == f"{what}'s trace context malformed; handled "
            "without a parent"]


@pytest.mark.parametrize(("carrier", "carried", "warns"), CONTEXTS)
async def test_a_split_s_drain_notice_re_homes_in_the_notice_s_trace(
        nc: Client, nats_server, uniq: str, services, spans: InMemorySpanExporter,
        carrier: str | None, carried: bool, warns: bool) -> None:
    """The split of w-cp4-g0, which holds a 4-block document: the notice's handling is a
    ``cachemgr_drain`` span (CONSUMER, naming the reconfiguration) under the carried context;
    the re-homing copy to w-cp4-g4 is a ``cache_replicate`` span under it, whose context the
    command carries. Without a valid context the copy is sent all the same, under a root."""
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    await kv.put(s.epoch_key(), record(0, [(0, 4), (4, 4)], None))
    peer_cmds = await acking_worker(nc, s, PEER)
    await services(CacheMgrService(settings(nats_server.url, uniq, rehome_min_blocks=3)))
    await stored(nc, s, PARENT, 1, None, DOC)
    await stored(nc, s, PEER, 1, None, [21])
    await holding(nc, uniq, PARENT, 4)
    await holding(nc, uniq, PEER, 1)
    data, headers = encode(DrainNotice(reconfiguration=7, kind="split", epoch=1,
                                       sources=[PARENT], targets=["w-cp2-g0", "w-cp2-g2"],
                                       issued_at_s=time.time()))
    if carrier is not None:
        headers["traceparent"] = carrier
    with capture_logs() as logs:
        await nc.publish(drain_subject(s), data, headers=headers)
        cmd = await peer_cmds.first(lambda c: c.get("op") == "replicate", what="re-homing")
        drain = await one_span(spans, DRAIN_SPAN, **{"vtm.reconfiguration.id": 7})
        copy = await one_span(spans, "cache_replicate")
    assert cmd["source_worker"] == PARENT and cmd["blocks"] == DOC
    assert drain.kind is SpanKind.CONSUMER
    a = drain.attributes
    assert (a["vtm.reconfiguration.kind"], list(a["vtm.reconfiguration.sources"]),
            a["vtm.epoch"], a["vtm.rehome_copies"], a["vtm.rehome_demotes"]) == (
        "split", [PARENT], 1, 1, 0)
    checked_parent(drain, carried)
    assert copy.parent is not None and copy.parent.span_id == drain.context.span_id
    assert copy.context.trace_id == drain.context.trace_id
    assert copy.attributes["vtm.copy_kind"] == "intra"
    tp = traceparent_of(peer_cmds.msgs[0].headers)
    assert tp is not None and tp[3:35] == hexid(copy.context.trace_id, 32)
    assert tp[36:52] == hexid(copy.context.span_id, 16)
    assert len(warned(logs, "drain notice")) == int(warns)


@pytest.mark.parametrize(("carrier", "carried", "warns"), CONTEXTS)
async def test_a_split_s_record_is_reconciled_in_the_record_s_trace(
        nc: Client, nats_server, uniq: str, services, spans: InMemorySpanExporter,
        carrier: str | None, carried: bool, warns: bool) -> None:
    """The record showing the split of w-cp4-g0 (its commit record): the reconcile is a
    ``cachemgr_epoch`` span (CONSUMER, naming the split parent) under the record's
    ``traceparent``, and the snapshot requests it sends to the two children carry it. Without
    a valid context the split is reconciled all the same, under a root."""
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    await kv.put(s.epoch_key(), record(0, [(0, 4), (4, 4)], None))
    snapshots = Collector()  # asked, never answered (each is asked again: not ours to judge)
    await nc.subscribe(s.cache_snapshot("w-cp2-g0"), cb=snapshots.cb)
    await nc.subscribe(s.cache_snapshot("w-cp2-g2"), cb=snapshots.cb)
    await nc.flush()
    await services(CacheMgrService(settings(nats_server.url, uniq, snapshot_timeout_s=0.5)))
    await stored(nc, s, PARENT, 1, None, DOC)
    await holding(nc, uniq, PARENT, 4)
    with capture_logs() as logs:
        await kv.put(s.epoch_key(), record(1, [(0, 2), (2, 2), (4, 4)], carrier))
        await counted(nc, uniq, "splits", 1, "split reconciled")
        span = await one_span(spans, EPOCH_SPAN, **{"vtm.epoch": 1})

        async def both_asked() -> bool:
            return {m.subject for m in snapshots.msgs} == {s.cache_snapshot("w-cp2-g0"),
                                                           s.cache_snapshot("w-cp2-g2")}

        await eventually(both_asked, what="the children's snapshots asked")
    assert span.kind is SpanKind.CONSUMER
    assert list(span.attributes["vtm.splits"]) == [PARENT]
    assert list(span.attributes["vtm.merges"]) == []
    checked_parent(span, carried)
    # The first ask of each child is the reconcile's (later ones: the housekeeping's retries).
    first = {m.subject: m for m in reversed(snapshots.msgs)}
    for m in first.values():
        tp = traceparent_of(m.headers)
        assert tp is not None and tp[3:35] == hexid(span.context.trace_id, 32)
        assert tp[36:52] == hexid(span.context.span_id, 16)
    assert len(warned(logs, "epoch record")) == int(warns)


@pytest.mark.parametrize(("carrier", "carried", "warns"), CONTEXTS)
async def test_a_split_s_reconciled_notices_carry_its_reconcile_s_context(
        nc: Client, nats_server, uniq: str, services, spans: InMemorySpanExporter,
        carrier: str | None, carried: bool, warns: bool) -> None:
    """The split's ReconciledNotices (one per child) carry the context of the
    ``cachemgr_epoch`` span that reconciled it in their headers -- under the record's
    ``traceparent`` or a root of its own --, so a scheduler replica's span of applying one is
    in that trace; and so does the left child's reconcile when ``pending`` publishes it again
    for a replica that asks (not the context of that request). Before, they carried none."""
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    await kv.put(s.epoch_key(), record(0, [(0, 4), (4, 4)], None))
    notices = Collector()
    await nc.subscribe(s.cache_pending_all(), cb=notices.cb)
    await nc.flush()
    await services(CacheMgrService(settings(nats_server.url, uniq, snapshot_timeout_s=0.5)))
    await stored(nc, s, PARENT, 1, None, DOC)
    await holding(nc, uniq, PARENT, 4)
    await kv.put(s.epoch_key(), record(1, [(0, 2), (2, 2), (4, 4)], carrier))
    span = await one_span(spans, EPOCH_SPAN, **{"vtm.epoch": 1})
    checked_parent(span, carried)
    reconcile = (hexid(span.context.trace_id, 32), hexid(span.context.span_id, 16))

    def carried_ids(m: Msg) -> tuple[str, str] | None:
        tp = traceparent_of(m.headers)
        return None if tp is None else (tp[3:35], tp[36:52])

    async def both_sent() -> bool:
        return len(notices.msgs) == 2

    await eventually(both_sent, what="the children's notices")
    assert {m.subject for m in notices.msgs} == {s.cache_pending("w-cp2-g0"),
                                                 s.cache_pending("w-cp2-g2")}
    assert [carried_ids(m) for m in notices.msgs] == [reconcile, reconcile]
    # Asked again (a replica that registers the left child late): the same context.
    with tracer().start_as_current_span("asker") as asker:
        reply = await call(nc, s.cache_pending_ask(), PendingQuery(worker_id="w-cp2-g0"),
                           PendingReply)
    assert reply.parts == 1

    async def sent_again() -> bool:
        return len(notices.msgs) == 3

    await eventually(sent_again, what="the left child's notice sent again")
    again = notices.msgs[2]
    assert again.subject == s.cache_pending("w-cp2-g0")
    assert carried_ids(again) == reconcile
    assert hexid(asker.get_span_context().trace_id, 32) != reconcile[0]
