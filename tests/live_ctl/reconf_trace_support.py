"""A split carried out end to end with real rank daemons -- a controller, the two CP4 workers
(w-cp4-g4 is split) and the two CP2 targets, which acknowledge the commit so that the split
is exposed -- and a cache manager, which re-homes the parent's document (:data:`DOC`) onto
w-cp4-g0 when the split starts and reconciles the split at its commit, for the
reconfiguration tracing tests.

:func:`split_with_rank_daemons` runs it on the caller's connection and tracer provider (the
test session's, ratio 1). Run as a script (``python reconf_trace_support.py NATS_URL PREFIX``)
it runs it in a process of its own whose provider samples at ratio 0 -- a provider is set up
once per process, and the tests' is at 1 -- and prints what it recorded as one JSON line
(:func:`span_json`), after ``SPANS``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from live_ctl_support import Collector, FakeScheduler, eventually
from nats.aio.client import Client
from opentelemetry.sdk.trace import ReadableSpan

from services.cachemgr.service import CacheMgrService, CacheMgrSettings
from services.cachemgr.tracing import DRAIN_SPAN, EPOCH_SPAN
from services.controller.service import (
    EPOCH_ACK_SPAN,
    ControllerService,
    drain_subject,
    reconf_subject,
)
from services.controller.tracing import ReconfStage
from services.rankd.service import EPOCH_ADOPT_SPAN, RankdService
from services.rankd.settings import RankdSettings
from shared.ids import BlockHash
from shared.schemas import AssignmentAck
from shared.service import MicroService, call
from shared.subjects import Subjects
from shared.telemetry import inject, tracer

SOURCES = ("w-cp4-g0", "w-cp4-g4")
TARGETS = ("w-cp2-g4", "w-cp2-g6")
WORKERS = (*SOURCES, *TARGETS)
TARGET_GPUS = frozenset({4, 5, 6, 7})
"""The ranks of the split's targets, whose acks of the commit record expose them."""
DOC = [11, 12, 13, 14]
"""A document the split's parent (w-cp4-g4) holds when the split starts: long enough to be
re-homed (the cache manager's ``rehome_min_blocks`` is 3), so the drain notice makes the
cache manager copy it to w-cp4-g0, the CP4 worker that stays."""
COMMAND_SERVER_SPAN = "vtm-rankd.cache-cmd"
"""A rank daemon's server span of a cache command (shared/service.py micro handler)."""
SNAPSHOT_SERVER_SPAN = "vtm-rankd.cache-snapshot"
"""A rank daemon's server span of the cache manager's snapshot request."""


async def watched(nc: Client, s: Subjects) -> tuple[Collector, Collector]:
    """Collectors of the controller's drain notices and reconfiguration events, subscribed
    (and in place at the server) before anything starts."""
    drains, reconfs = Collector(), Collector()
    await nc.subscribe(drain_subject(s), cb=drains.cb)
    await nc.subscribe(reconf_subject(s), cb=reconfs.cb)
    await nc.flush()
    return drains, reconfs


@dataclass(frozen=True)
class SplitRun:
    """What :func:`split_with_rank_daemons` saw: the split's reconfiguration id, the trace
    ids (32 hex) of the requests it assigned, each in a trace of its own, and how many
    records the controller re-announced (``ack_timeout_s`` passed with rank acks missing)."""

    reconfiguration: int
    request_traces: list[str]
    reannounced: int = 0


def awaited_epochs(commit: int, exposed: int) -> range:
    """The records whose acks count for a split's targets: its commit record and every one
    written before its exposure -- a re-announcement (the controller's ``ack_timeout_s``
    passed with acks missing, e.g. a stall of the machine) shows the targets switching in
    the same geometry, and a target rank's ack of it counts as well (a rank acks each record
    it adopts, so a rank that acked the commit may be counted again for it)."""
    return range(commit, exposed)


async def until_w_cp4_g4_is_the_split_source(ctl: ControllerService) -> None:
    """Return once the controller knows both CP4 workers' states, w-cp4-g0's outstanding work
    the larger and w-cp4-g4 one queued request: else the planner may pick either source."""
    async def states_known() -> bool:
        st = ctl._states
        return ("w-cp4-g4" in st and st["w-cp4-g4"].queue_len == 1 and "w-cp4-g0" in st
                and st["w-cp4-g0"].outstanding_s > st["w-cp4-g4"].outstanding_s)

    await eventually(states_known, what="both workers' states at the controller")


def hex_trace(span: ReadableSpan) -> str:
    return format(span.context.trace_id, "032x")


async def split_with_rank_daemons(
        nc: Client, url: str, prefix: str,
        start: Callable[[MicroService], Awaitable[MicroService]],
        finished: Callable[[], Sequence[ReadableSpan]], *,
        ack_timeout_s: float | None = None, targets_late: bool = False) -> SplitRun:
    """Carry out the split of w-cp4-g4 (test_live_ctl_with_rankd's drain, its targets' rank
    daemons added) and return once its trace ended and every worker's adoption of its
    exposure record, the cache manager's part and the controller's handling of the targets'
    acks (of the commit record, or of a re-announcement of it: :func:`awaited_epochs`) are
    among the ``finished`` spans. ``start`` starts a service (stopped by the caller);
    ``ack_timeout_s``: the controller's (None: its default, 10 s). ``targets_late``: the
    targets' rank daemons start only once the controller re-announced the commit record
    (their acks missing for ``ack_timeout_s``), so they adopt and acknowledge a
    re-announcement, not the commit: the case a stalled machine makes."""
    # Imported here, not at the top: test modules, whose helpers this borrows.
    from gated_backend import GatedBackend
    from test_live_controller import DEMAND, H, settings
    from test_live_ctl_with_rankd import assignment

    s = Subjects(prefix)
    drains, reconfs = await watched(nc, s)
    more = {} if ack_timeout_s is None else {"ack_timeout_s": ack_timeout_s}
    ctl = await start(ControllerService(settings(url, prefix, "ctl-r",
                                                 queue_query_timeout_s=2.0, **more)))
    assert isinstance(ctl, ControllerService)
    # Before the rank daemons: it sees their first cache events. No scan: every copy it sends
    # is the split's re-homing.
    cm = await start(CacheMgrService(CacheMgrSettings(
        nats_url=url, subject_prefix=prefix, degrees=[2, 4], scan_interval_s=3600.0,
        rehome_min_blocks=3)))
    assert isinstance(cm, CacheMgrService)
    backends = {w: GatedBackend() for w in WORKERS}

    async def start_rankd(w: str) -> None:
        await start(RankdService(RankdSettings(nats_url=url, subject_prefix=prefix, worker_id=w,
                                               heartbeat_s=0.2, kv_total_blocks=64),
                                 backends[w]))

    for w in WORKERS:
        if not (targets_late and w in TARGETS):
            await start_rankd(w)
    request_traces: list[str] = []
    # The parent's document: prefilled (its gate open for it alone) and in the cache
    # manager's trie before the split is planned.
    parent = backends["w-cp4-g4"]
    parent.gate.set()
    with tracer().start_as_current_span("request") as root:
        a = assignment("doc", "w-cp4-g4", 4, DOC)
        a = a.model_copy(update={"request": a.request.model_copy(
            update={"trace_context": inject({})})})
        await call(nc, s.worker_assign("w-cp4-g4"), a, AssignmentAck)
    request_traces.append(format(root.get_span_context().trace_id, "032x"))

    async def doc_held() -> bool:
        return cm.trie.match([BlockHash(h) for h in DOC]).held_blocks.get("w-cp4-g4") == 4

    await eventually(doc_held, what="the parent's document in the cache manager's trie")
    parent.gate.clear()
    # w-cp4-g0 has much more outstanding work, so the planner splits w-cp4-g4. Each request
    # is a trace of its own, as the gateway's root makes it (sampled by the ratio).
    for i, (w, pred) in enumerate([("w-cp4-g0", 5.0), ("w-cp4-g0", 5.0), ("w-cp4-g4", 0.5)]):
        with tracer().start_as_current_span("request") as root:
            a = assignment(f"r{i}", w, 4, [100 + i])
            a = a.model_copy(update={"predicted_s": pred, "request": a.request.model_copy(
                update={"trace_context": inject({})})})
            await call(nc, s.worker_assign(w), a, AssignmentAck)
        request_traces.append(format(root.get_span_context().trace_id, "032x"))
    sched = FakeScheduler(nc, s, H, lambda: DEMAND)
    try:
        await until_w_cp4_g4_is_the_split_source(ctl)
        await sched.start()
        drain = await drains.first(what="drain notice")
        assert drain["sources"] == ["w-cp4-g4"], drain
        backends["w-cp4-g4"].gate.set()  # its running request finishes: the drain ends
        if targets_late:
            async def reannounced() -> bool:
                return ctl.counters["reannounced"] >= 1

            await eventually(reannounced, what="the commit record re-announced")
            for w in TARGETS:
                await start_rankd(w)
        await reconfs.first(lambda r: r["phase"] == "exposed", what="exposure")
        rid = drain["reconfiguration"]

        async def ended() -> bool:
            root = [x for x in finished() if x.name == str(ReconfStage.RECONFIGURATION)
                    and x.attributes.get("vtm.reconfiguration.id") == rid]
            if not root:
                return False
            exposed = root[0].attributes["vtm.epoch.exposed"]
            adopted = {x.attributes["vtm.worker_id"] for x in finished()
                       if x.name == EPOCH_ADOPT_SPAN and x.attributes["vtm.epoch"] == exposed}
            # The cache manager's part done: the re-homing copy settled, the split
            # reconciled, the exposure record adopted.
            return (adopted >= set(WORKERS) and cm.counters["commands_ok"] == 1
                    and cm.counters["splits"] == 1
                    and cm.record is not None and cm.record.epoch >= exposed)

        await eventually(ended, what="the trace ended and the exposure adopted everywhere")

        # A span ends after what it did was seen: the cache manager's spans of its part (one
        # per record of the split, the drain notice's) and the rank daemons' server spans of
        # the copy and of the split children's snapshots, which end after their replies (at
        # ratio 0 they are recorded only in the reconfiguration's trace).
        async def cache_manager_spans() -> bool:
            epochs = {x.attributes["vtm.epoch"] for x in finished() if x.name == EPOCH_SPAN}
            names = {x.name for x in finished()}
            snapshots = {x.attributes["messaging.destination.name"] for x in finished()
                         if x.name == SNAPSHOT_SERVER_SPAN}
            return (epochs >= set(range(1, exposed_epoch + 1))
                    and {DRAIN_SPAN, COMMAND_SERVER_SPAN} <= names
                    and {s.cache_snapshot(w) for w in TARGETS} <= snapshots)

        exposed_epoch = next(x for x in finished() if x.name == str(ReconfStage.RECONFIGURATION)
                       and x.attributes.get("vtm.reconfiguration.id") == rid
                       ).attributes["vtm.epoch.exposed"]
        await eventually(cache_manager_spans, what="the cache manager's spans of the split")
        commit_epoch = next(x for x in finished() if x.name == str(ReconfStage.RECONFIGURATION)
                            and x.attributes.get("vtm.reconfiguration.id") == rid
                            ).attributes["vtm.epoch.after"]

        # The controller's handling of the targets' acks of the commit record (or of its
        # re-announcement): the last one's span ends after the exposure it made.
        awaited = awaited_epochs(commit_epoch, exposed_epoch)

        async def acks_handled() -> bool:
            return {x.attributes["vtm.gpu"] for x in finished() if x.name == EPOCH_ACK_SPAN
                    and x.attributes["vtm.epoch"] in awaited
                    and x.attributes.get("vtm.ack.outcome") == "counted"} >= TARGET_GPUS

        await eventually(acks_handled, what="the controller's spans of the targets' acks")
    finally:
        for b in backends.values():
            b.gate.set()
        await sched.stop()
    return SplitRun(rid, request_traces, ctl.counters["reannounced"])


def span_json(span: ReadableSpan) -> dict[str, Any]:
    """A finished span as JSON: name, trace, span and parent ids (hex), attributes."""
    return {
        "name": span.name,
        "trace_id": hex_trace(span),
        "span_id": format(span.context.span_id, "016x"),
        "parent_id": format(span.parent.span_id, "016x") if span.parent is not None else None,
        "attributes": {k: list(v) if isinstance(v, tuple) else v
                       for k, v in (span.attributes or {}).items()},
    }


async def _main(url: str, prefix: str) -> None:
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from shared.natsclient import connect
    from shared.settings import TelemetrySettings
    from shared.telemetry import setup_tracing

    exporter = InMemorySpanExporter()
    setup_tracing("vtm-sampling-test", TelemetrySettings(sampling_ratio=0.0),
                  span_processor=SimpleSpanProcessor(exporter))
    nc = await connect(url, connect_timeout=5)
    try:
        async with AsyncExitStack() as stack:
            async def start(svc: MicroService) -> MicroService:
                await svc.start(stack)
                return svc

            run = await split_with_rank_daemons(nc, url, prefix, start,
                                                exporter.get_finished_spans)
    finally:
        await nc.drain()
    print("SPANS " + json.dumps({
        "reconfiguration": run.reconfiguration, "request_traces": run.request_traces,
        "spans": [span_json(x) for x in exporter.get_finished_spans()]}), flush=True)


if __name__ == "__main__":  # its folder is sys.path[0]: live_ctl_support and the tests import
    asyncio.run(_main(sys.argv[1], sys.argv[2]))
