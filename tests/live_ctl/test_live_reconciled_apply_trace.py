"""A scheduler replica's adoption of the cache manager's reconcile is in the reconfiguration's
trace (real nats-server, a real cache manager and a real scheduler replica; the split's records
are put in the epoch bucket by hand, carrying the controller's phase context as it writes
them, and the workers' states as their rank daemons publish them).

The cache manager reconciles the split of w-cp4-g0 under its ``cachemgr_epoch`` span (a child
of the record's ``traceparent``) and publishes the children's ReconciledNotices with that
span's context in their headers; the replica's marking of each in its trie is a
``reconciled_apply`` span (CONSUMER: worker, epoch, part, entries, and whether it waited for
the worker's state) under it -- whether the notice waited for the child's state or came
again because the replica, started late, asked the manager's ``pending`` endpoint. A
record whose context is not sampled records neither span, and the notices are applied all
the same.

Before, the notices carried no headers and the replicas recorded nothing: a tracing UI showed
the manager's reconcile but not the schedulers' adoption of it.
"""

from __future__ import annotations

import time

import pytest
from live_ctl_support import eventually
from nats.aio.client import Client
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from test_live_cachemgr import holding, settings, state, stored

from services.cachemgr.service import CacheMgrService
from services.cachemgr.tracing import EPOCH_SPAN
from services.scheduler.service import (
    RECONCILED_APPLY_SPAN,
    SchedulerService,
    SchedulerSettings,
)
from shared.schemas import EpochRecord, EpochWorker, to_json
from shared.service import epoch_kv, worker_state_kv
from shared.subjects import Subjects
from shared.worker import Lifecycle

PHASE_TRACE, PHASE_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
SAMPLED = f"00-{PHASE_TRACE}-{PHASE_SPAN}-01"
"""The controller's commit phase as the split's record carries it."""
UNSAMPLED = f"00-{PHASE_TRACE}-{PHASE_SPAN}-00"
PARENT = "w-cp4-g0"
CHILDREN = {"w-cp2-g0": [0, 1], "w-cp2-g2": [2, 3]}
DOC = [11, 12, 13, 14]


def record(epoch: int, groups: list[tuple[int, int]], traceparent: str = "") -> bytes:
    """An EpochRecord of (first GPU, degree) groups, every worker ACTIVE."""
    return to_json(EpochRecord(
        epoch=epoch, committed_at_s=time.time(), traceparent=traceparent,
        workers=[EpochWorker(worker_id=f"w-cp{d}-g{g}", first_gpu=g, degree=d,
                             lifecycle=Lifecycle.ACTIVE) for g, d in groups]))


def scheduler(url: str, prefix: str) -> SchedulerService:
    return SchedulerService(SchedulerSettings(
        nats_url=url, subject_prefix=prefix, degrees=[2, 4], instance_id="s-trace",
        snapshot_timeout_s=0.5))


async def split_reconciled(nc: Client, url: str, prefix: str, services,
                           traceparent: str) -> CacheMgrService:
    """A cache manager that reconciled the split of ``PARENT`` (holding ``DOC``) into
    ``CHILDREN`` at record 1, which carries ``traceparent``."""
    s = Subjects(prefix)
    kv = await epoch_kv(nc.jetstream(), s)
    await kv.put(s.epoch_key(), record(0, [(0, 4), (4, 4)]))
    cm = await services(CacheMgrService(settings(url, prefix, snapshot_timeout_s=0.5)))
    assert isinstance(cm, CacheMgrService)
    await stored(nc, s, PARENT, 1, None, DOC)
    await holding(nc, prefix, PARENT, 4)
    await kv.put(s.epoch_key(), record(1, [(0, 2), (2, 2), (4, 4)], traceparent))

    async def reconciled() -> bool:
        return cm.counters["splits"] == 1

    await eventually(reconciled, what="the split reconciled")
    return cm


async def children_run(nc: Client, prefix: str) -> None:
    """The children's rank daemons publish their states: the replica registers them."""
    states = await worker_state_kv(nc.jetstream(), Subjects(prefix))
    for wid, gpus in CHILDREN.items():
        await states.put(wid, to_json(state(wid, gpus)))


def named(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [x for x in spans.get_finished_spans() if x.name == name]


@pytest.mark.parametrize("late", [False, True], ids=["buffered", "asked"])
async def test_a_replica_applies_the_reconcile_in_the_reconciles_trace(
        nc: Client, nats_server, uniq: str, services, spans: InMemorySpanExporter,
        late: bool) -> None:
    """``buffered``: the replica runs before the split; each child's notice waits for the
    child's state and is applied then. ``asked``: the replica starts after the split (it
    never heard the notices); registering the children it asks the manager, which publishes
    their reconcile again. Either way each applied notice is a ``reconciled_apply`` span, a
    child of the manager's ``cachemgr_epoch`` span of the split's record."""
    sched = None if late else await services(scheduler(nats_server.url, uniq))
    cm = await split_reconciled(nc, nats_server.url, uniq, services, SAMPLED)
    notices = {w: cm.reconciled_notices(w, 1) for w in CHILDREN}
    assert all(len(n) == 1 and n[0].blocks for n in notices.values())  # one part, not empty
    if sched is None:
        sched = await services(scheduler(nats_server.url, uniq))
    else:
        async def kept() -> bool:
            return sched.stats.reconciled_buffered == len(CHILDREN)

        await eventually(kept, what="the notices kept for the children")
    assert isinstance(sched, SchedulerService)
    await children_run(nc, uniq)

    async def applied() -> list[ReadableSpan]:
        got = named(spans, RECONCILED_APPLY_SPAN)
        return got if {x.attributes["vtm.worker_id"] for x in got} == set(CHILDREN) else []

    got = await eventually(applied, what="both children's notices applied")
    (reconcile,) = [x for x in named(spans, EPOCH_SPAN) if x.attributes["vtm.epoch"] == 1]
    assert format(reconcile.context.trace_id, "032x") == PHASE_TRACE
    assert sched.trie.pending_blocks("w-cp2-g0") == {13, 14}
    for x in got:
        wid = x.attributes["vtm.worker_id"]
        assert x.kind is SpanKind.CONSUMER
        assert x.parent is not None and x.parent.is_remote
        assert x.parent.span_id == reconcile.context.span_id
        assert x.context.trace_id == reconcile.context.trace_id
        assert (x.attributes["vtm.epoch"], x.attributes["vtm.part"],
                x.attributes["vtm.entries"], x.attributes["vtm.buffered"]) == (
            1, 0, len(notices[wid][0].blocks), not late)
    # What was marked: the left child's pending pages, the right child's donor pages.
    assert sum(x.attributes["vtm.pending"] + x.attributes["vtm.donors"] for x in got) > 0
    assert sched.stats.reconciled_applied == len(got)  # each applied once


async def test_an_unsampled_reconcile_is_applied_untraced(
        nc: Client, nats_server, uniq: str, services, spans: InMemorySpanExporter) -> None:
    """The split's record carries a context that is not sampled: the manager's reconcile
    records no span, its notices carry the unsampled context, and the replica applies them
    without recording one either (parent-based sampling: nothing of that trace is kept)."""
    sched = await services(scheduler(nats_server.url, uniq))
    assert isinstance(sched, SchedulerService)
    await split_reconciled(nc, nats_server.url, uniq, services, UNSAMPLED)
    await children_run(nc, uniq)

    async def applied() -> bool:
        return sched.stats.reconciled_applied == len(CHILDREN)

    await eventually(applied, what="both children's notices applied")
    assert sched.trie.pending_blocks("w-cp2-g0") == {13, 14}
    assert not named(spans, RECONCILED_APPLY_SPAN)
    # (The first record's handling, with no context, is a root of its own: sampled.)
    assert not [x for x in named(spans, EPOCH_SPAN) if x.attributes["vtm.epoch"] == 1]
    assert not [x for x in spans.get_finished_spans()
                if format(x.context.trace_id, "032x") == PHASE_TRACE]
