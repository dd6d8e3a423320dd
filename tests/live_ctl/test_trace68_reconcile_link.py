"""A lazy reconcile copy that a request triggers after a split is found from the
reconfiguration's trace too (real nats-server, a real cache manager, the epoch records put by
hand carrying the controller's phase context as it writes them, a stand-in worker endpoint).

The copy's ``cache_reconcile`` span is the pool's work (a root): it links to the request's
context (``triggered_by``) as before, and now also to the ``cachemgr_epoch`` span whose
reconcile of the split left the pages it copies pending (``reconciles``, with the epoch), and
it is kept whenever that trace is (``vtm.sampling.always``: at a ratio of 0.01 the ratio alone
dropped 99 of 100 such spans, links and all). Before, the copy was linked to the request's
trace only. A copy that is no reconcile (a route-time pull) gets neither.
"""

from __future__ import annotations

import time

from live_ctl_support import Collector, eventually
from nats.aio.client import Client
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_live_cachemgr import acking_worker, counted, holding, settings, stats, stored

from services.cachemgr.service import CacheMgrService
from services.cachemgr.tracing import EPOCH_SPAN, LINK_REASON
from shared.schemas import EpochRecord, EpochWorker, to_json
from shared.service import epoch_kv
from shared.subjects import Subjects
from shared.telemetry import ALWAYS_SAMPLE
from shared.worker import Lifecycle

PHASE_TRACE, PHASE_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
ROOT_TRACE, ROOT_SPAN = "7bf92f3577b34da6a3ce929d0e0e4736", "20f067aa0ba902b7"
LEFT, RIGHT, PARENT = "w-cp2-g0", "w-cp2-g2", "w-cp4-g0"


def record(epoch: int, groups: list[tuple[int, int]], traceparent: str = "") -> bytes:
    return to_json(EpochRecord(
        epoch=epoch, committed_at_s=time.time(), traceparent=traceparent,
        workers=[EpochWorker(worker_id=f"w-cp{d}-g{g}", first_gpu=g, degree=d,
                             lifecycle=Lifecycle.ACTIVE) for g, d in groups]))


def hexid(n: int, width: int) -> str:
    return format(n, f"0{width}x")


async def span_named(spans: InMemorySpanExporter, name: str,
                     trace: str | None = None) -> ReadableSpan:
    """The first finished span ``name`` (of trace ``trace`` if given)."""
    async def probe() -> ReadableSpan | None:
        got = [s for s in spans.get_finished_spans() if s.name == name
               and (trace is None or hexid(s.context.trace_id, 32) == trace)]
        return got[0] if got else None

    return await eventually(probe, what=f"a {name} span")


async def test_a_lazy_reconcile_copy_links_to_the_reconfiguration_that_left_it_pending(
        nc: Client, nats_server, uniq: str, services,  # type: ignore[no-untyped-def]
        spans: InMemorySpanExporter) -> None:
    s = Subjects(uniq)
    kv = await epoch_kv(nc.jetstream(), s)
    await kv.put(s.epoch_key(), record(0, [(0, 4), (4, 4)]))
    left_cmds: Collector = await acking_worker(nc, s, LEFT)
    await services(CacheMgrService(settings(nats_server.url, uniq)))
    await stored(nc, s, PARENT, 1, None, [11, 12, 13, 14])
    await holding(nc, uniq, PARENT, 4)
    # The split, written by the controller's commit phase (sampled: a reconfiguration's is).
    await kv.put(s.epoch_key(), record(1, [(0, 2), (2, 2), (4, 4)],
                                       f"00-{PHASE_TRACE}-{PHASE_SPAN}-01"))
    await counted(nc, uniq, "splits", 1, "split reconciled")
    # The split's (the record before it, written outside a reconfiguration, has its own).
    epoch_span = await span_named(spans, EPOCH_SPAN, PHASE_TRACE)
    # A request routed to the left child, which has pages 2-3 pending from the right child:
    # its placement triggers the lazy reconcile copy (its stats carry the request's context).
    await nc.publish(s.prefix + ".cache.stats.s1", stats(LEFT, 2, [11, 12, 13, 14], 2, "r1"),
                     headers={"Content-Type": "application/json",
                              "traceparent": f"00-{ROOT_TRACE}-{ROOT_SPAN}-01"})
    cmd = await left_cmds.first(lambda c: c.get("op") == "reconcile", what="reconcile command")
    assert cmd["source_worker"] == RIGHT
    copy = await span_named(spans, "cache_reconcile")
    assert copy.parent is None  # the pool's work, a root of its own
    assert copy.attributes is not None
    assert copy.attributes["vtm.copy_kind"] == "reconcile"
    assert copy.attributes["vtm.request_id"] == "r1"
    assert copy.attributes[ALWAYS_SAMPLE] is True
    links = {x.attributes[LINK_REASON]: x for x in copy.links if x.attributes}
    assert set(links) == {"triggered_by", "reconciles"}
    request, reconcile = links["triggered_by"], links["reconciles"]
    assert (hexid(request.context.trace_id, 32), hexid(request.context.span_id, 16)) == (
        ROOT_TRACE, ROOT_SPAN)
    # The reconfiguration's trace: the manager's own span that reconciled the split.
    assert (reconcile.context.trace_id, reconcile.context.span_id) == (
        epoch_span.context.trace_id, epoch_span.context.span_id)
    assert reconcile.attributes is not None and reconcile.attributes["vtm.epoch"] == 1


async def test_a_route_pull_has_no_reconfiguration_link(
        nc: Client, nats_server, uniq: str, services,  # type: ignore[no-untyped-def]
        spans: InMemorySpanExporter) -> None:
    """Not every copy a request triggers belongs to a reconcile: a route-time pull keeps its
    request link alone and the ratio's sampling."""
    s = Subjects(uniq)
    a, b = "w-cp2-g0", "w-cp2-g2"
    await acking_worker(nc, s, b)
    await acking_worker(nc, s, a)
    await services(CacheMgrService(settings(nats_server.url, uniq)))
    await stored(nc, s, a, 1, None, [11, 12, 13, 14])
    await stored(nc, s, b, 1, None, [11])
    await holding(nc, uniq, a, 4)
    await holding(nc, uniq, b, 1)
    await nc.publish(s.prefix + ".cache.stats.s1", stats(b, 2, [11, 12, 13, 14, 15], 1, "r2"),
                     headers={"Content-Type": "application/json",
                              "traceparent": f"00-{ROOT_TRACE}-{ROOT_SPAN}-01"})
    pull = await span_named(spans, "cache_pull")
    assert pull.attributes is not None and ALWAYS_SAMPLE not in pull.attributes
    assert [x.attributes[LINK_REASON] for x in pull.links if x.attributes] == ["triggered_by"]
