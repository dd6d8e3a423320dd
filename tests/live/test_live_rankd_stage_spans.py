"""rankd's queue-wait spans on a real server (sim backend): what a request waited for before
its prefill shows in its trace where the stage breakdown counts it -- a lazy epoch switch the
backend made first (``epoch_switch``, and the ``prefill`` span starting after it) and the
hold for a route-time pull (``vtm.pull_hold_s``, ``cache_pull_wait``, linked both ways to the
copy's ``cache-cmd`` span, whose attributes say what the command was)."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.aio.client import Client
from nats.aio.subscription import Subscription
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from rankd_support import stage_spans
from service_support import service_running

from services.rankd.backend import PrefillResult, SimBackend
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.natsserver import EmbeddedNats
from shared.schemas import (
    Assignment,
    AssignmentAck,
    CacheCommandResult,
    FirstToken,
    IntakeRequest,
    ReconcileCommand,
    ReplicateCommand,
    decode,
)
from shared.service import call
from shared.subjects import Subjects
from shared.telemetry import tracer

WID = "w-cp2-g2"
WAIT_S = 20.0  # hang guard only; nothing asserts on speed
SWITCH_S = 0.05
ROOT_SPAN = "10f067aa0ba902b7"


def root_trace(n: int) -> str:
    return f"{n:032x}"


def assignment(rid: str, trace_id: str, **update: object) -> Assignment:
    """A request of 2 full blocks ([1, 2], blocks of 512) whose trace root is ``trace_id``,
    assigned now to ``WID`` with P = 512 claimed."""
    now = time.time()
    a = Assignment(
        request=IntakeRequest(request_id=rid, input_len=1024, block_hashes=[1, 2],
                              arrival_s=now - 0.01,
                              trace_context={"traceparent": f"00-{trace_id}-{ROOT_SPAN}-01"}),
        worker_id=WID, epoch=0, degree=2, prefix_tokens=512, recompute_tokens=512,
        predicted_s=0.01, dequeued_at_s=now - 0.005, assigned_at_s=now,
    )
    return a.model_copy(update=update)


class SwitchingSim(SimBackend):
    """A sim backend whose every prefill first spends ``SWITCH_S`` bringing its ranks into
    the assignment's geometry, as the torch backend's lazy epoch switch does: the prefill
    starts after it (``started_at_s``) and the result says how long it took (``switch_s``)."""

    async def prefill(self, assignment: Assignment) -> PrefillResult:
        entered = time.time()
        await asyncio.sleep(SWITCH_S)
        switched = time.time()
        res = await super().prefill(assignment)
        return PrefillResult(
            request_id=res.request_id, token=res.token, started_at_s=res.started_at_s,
            prefill_s=res.prefill_s, kv_transfer_s=res.kv_transfer_s,
            first_decode_s=res.first_decode_s, finished_at_s=res.finished_at_s,
            modelled_prefill_s=res.modelled_prefill_s,
            modelled_handoff_s=res.modelled_handoff_s, switch_s=switched - entered,
        )


class SlowCopies(SimBackend):
    """A sim backend whose copies take until the test releases them."""

    def __init__(self) -> None:
        super().__init__(time_scale=1.0)
        self.copying = asyncio.Event()
        self.release = asyncio.Event()

    async def prepare_cache_command(self, cmd: object) -> object:
        self.copying.set()
        await self.release.wait()
        return cmd


def service(url: str, prefix: str, backend: SimBackend, **kw: object) -> RankdService:
    return RankdService(RankdSettings(nats_url=url, subject_prefix=prefix, worker_id=WID,
                                      heartbeat_s=0.2, **kw), backend)  # type: ignore[arg-type]


async def first_token(nc: Client, s: Subjects, a: Assignment) -> FirstToken:
    sub = await nc.subscribe(s.result(a.request.request_id))
    await call(nc, s.worker_assign(WID), a, AssignmentAck, timeout_s=WAIT_S)
    ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
    await sub.unsubscribe()
    return ft



def seconds(ns: int) -> float:
    return ns / 1e9


async def test_an_epoch_switch_before_the_prefill_is_queue_wait_in_the_trace_too(
    nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    """The backend switched its ranks' geometry before the prefill (the torch backend's lazy
    split or merge): the breakdown counts that in ``queue_wait_s``, and so does the trace --
    ``queue_wait`` ends where ``prefill`` starts, at the backend's ``started_at_s``, with an
    ``epoch_switch`` child span (and ``vtm.epoch_switch_s``) just before. Before, the prefill
    span began at the job's start and the switch showed inside it."""
    s = Subjects(uniq)
    tid = root_trace(0x51)
    async with service_running(service(nats_server.url, uniq, SwitchingSim()),
                               timeout_s=WAIT_S):
        ft = await first_token(nc, s, assignment("sw-1", tid))
    assert ft.error is None and ft.stages is not None
    got = await stage_spans(spans, tid, {"queue_wait", "epoch_switch", "prefill"})
    wait, switch, prefill = got["queue_wait"], got["epoch_switch"], got["prefill"]
    assert switch.parent is not None and switch.parent.span_id == wait.context.span_id
    assert format(wait.parent.span_id, "016x") == ROOT_SPAN
    assert format(prefill.parent.span_id, "016x") == ROOT_SPAN
    # The switch ends where the prefill starts, and so does the queue wait.
    assert switch.end_time == prefill.start_time == wait.end_time
    assert wait.start_time <= switch.start_time
    assert switch.attributes["vtm.epoch"] == 0 and switch.attributes["vtm.degree"] == 2
    assert wait.attributes["vtm.epoch_switch_s"] >= SWITCH_S
    assert seconds(switch.end_time - switch.start_time) >= SWITCH_S * (1 - 1e-6)
    # The trace and the FirstToken's breakdown place the switch alike.
    assert seconds(wait.end_time - wait.start_time) == \
        pytest.approx(ft.stages.queue_wait_s, abs=1e-6)
    assert seconds(prefill.end_time - prefill.start_time) == \
        pytest.approx(ft.stages.prefill_s, abs=1e-6)
    assert wait.attributes["vtm.pull_hold_s"] == 0.0
    assert "cache_pull_wait" not in got


async def test_a_request_without_a_switch_or_hold_has_no_such_spans(
    nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    """Nothing before the prefill: ``queue_wait`` still ends where ``prefill`` starts, says
    0 s of pull hold and of switch, and has no child span."""
    s = Subjects(uniq)
    tid = root_trace(0x52)
    async with service_running(service(nats_server.url, uniq, SimBackend()), timeout_s=WAIT_S):
        ft = await first_token(nc, s, assignment("plain-1", tid))
    assert ft.error is None
    got = await stage_spans(spans, tid, {"queue_wait", "prefill", "first_decode"})
    wait, prefill = got["queue_wait"], got["prefill"]
    assert wait.end_time == prefill.start_time
    assert (wait.attributes["vtm.pull_hold_s"], wait.attributes["vtm.epoch_switch_s"]) == (0, 0)
    assert not {"cache_pull_wait", "epoch_switch"} & set(got)


async def held_for_a_pull(nc: Client, svc: RankdService, s: Subjects, rid: str,
                          tid: str) -> Subscription:
    """Assign ``rid`` (trace ``tid``) priced with a route-time pull whose hold is capped far
    off, so it waits for the copy; return the subscription to its result once the worker
    holds it at the head of its FIFO."""
    sub = await nc.subscribe(s.result(rid))
    held = assignment(rid, tid, pull_copy_s=60.0)
    await call(nc, s.worker_assign(WID), held, AssignmentAck, timeout_s=WAIT_S)
    async with asyncio.timeout(WAIT_S):
        while svc._holding is None:
            await asyncio.sleep(0.01)
    return sub


async def test_a_pull_hold_is_on_the_queue_wait_and_linked_to_the_copy(
    nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    """A request priced with a route-time pull waits at the head of the FIFO until the copy
    lands: its ``queue_wait`` says how long (``vtm.pull_hold_s``) and holds a
    ``cache_pull_wait`` span over the hold, linked to the copy's ``cache-cmd`` span; that
    span -- a child of the sender's (the cache manager's) span, through the command's
    headers -- says what the command was and links to the held request's root."""
    s = Subjects(uniq)
    tid = root_trace(0x53)
    svc = service(nats_server.url, uniq, SimBackend())
    async with service_running(svc, timeout_s=WAIT_S):
        sub = await held_for_a_pull(nc, svc, s, "held-1", tid)
        rep = ReplicateCommand(command_id="c-1", worker_id=WID, epoch=0, blocks=[1],
                               source_worker="w-cp2-g0")
        with tracer().start_as_current_span("cachemgr-side") as sender:
            done = await call(nc, s.cache_cmd(WID), rep, CacheCommandResult, timeout_s=WAIT_S)
        assert done.ok
        ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
    assert ft.error is None and ft.prefix_tokens == 512
    got = await stage_spans(spans, tid, {"queue_wait", "cache_pull_wait", "prefill"})
    wait, pull, prefill = got["queue_wait"], got["cache_pull_wait"], got["prefill"]
    (cmd,) = [x for x in spans.get_finished_spans() if x.name.endswith(".cache-cmd")]
    # The copy's span: the sender's child, saying what it executed.
    assert cmd.kind is SpanKind.SERVER
    assert cmd.parent is not None and cmd.parent.span_id == sender.get_span_context().span_id
    assert {k: cmd.attributes[k] for k in ("vtm.cache_op", "vtm.command_id", "vtm.worker_id",
                                           "vtm.source_worker", "vtm.blocks", "vtm.cache_ok",
                                           "vtm.blocks_done")} == {
        "vtm.cache_op": "replicate", "vtm.command_id": "c-1", "vtm.worker_id": WID,
        "vtm.source_worker": "w-cp2-g0", "vtm.blocks": 1, "vtm.cache_ok": True,
        "vtm.blocks_done": 1}
    # ... linked to the request it released, and the request's hold to it.
    assert [(format(x.context.trace_id, "032x"), format(x.context.span_id, "016x"),
             x.attributes["vtm.link"]) for x in cmd.links] == [(tid, ROOT_SPAN, "pull_hold")]
    assert [(x.context.trace_id, x.context.span_id) for x in pull.links] == \
        [(cmd.context.trace_id, cmd.context.span_id)]
    # The hold, inside the queue wait, ends where the job started.
    assert pull.parent is not None and pull.parent.span_id == wait.context.span_id
    assert wait.start_time <= pull.start_time <= pull.end_time <= wait.end_time
    assert wait.end_time == prefill.start_time
    hold_s = wait.attributes["vtm.pull_hold_s"]
    assert hold_s > 0
    assert seconds(pull.end_time - pull.start_time) == pytest.approx(hold_s,
                                                                                  abs=1e-6)
    assert pull.attributes["vtm.pull_landed"] is True
    assert pull.attributes["vtm.pull_copies"] == 1
    assert pull.attributes["vtm.assigned_prefix_tokens"] == 512


async def test_a_copy_already_arriving_when_the_hold_begins_is_linked_too(
    nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    """The copy started before the request was assigned (its command came first): the hold
    finds it among the copies arriving and links to it all the same."""
    s = Subjects(uniq)
    tid = root_trace(0x54)
    backend = SlowCopies()
    svc = service(nats_server.url, uniq, backend, pull_hold_grace_s=0.0)
    async with service_running(svc, timeout_s=WAIT_S):
        try:
            sub = await nc.subscribe(s.result("held-2"))
            rep = ReplicateCommand(command_id="c-2", worker_id=WID, epoch=0, blocks=[1],
                                   source_worker="w-cp2-g0")
            copy = asyncio.create_task(call(nc, s.cache_cmd(WID), rep, CacheCommandResult,
                                            timeout_s=WAIT_S))
            await asyncio.wait_for(backend.copying.wait(), timeout=WAIT_S)
            held = assignment("held-2", tid, pull_copy_s=1e-6)  # bound ≈ now: the copy holds it
            await call(nc, s.worker_assign(WID), held, AssignmentAck, timeout_s=WAIT_S)
            async with asyncio.timeout(WAIT_S):  # held, the copy still arriving
                while svc._holding is None:
                    await asyncio.sleep(0.01)
            backend.release.set()
            assert (await copy).ok
            ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
        finally:
            backend.release.set()
    assert ft.error is None and ft.prefix_tokens == 512
    got = await stage_spans(spans, tid, {"queue_wait", "cache_pull_wait", "prefill"})
    (cmd,) = [x for x in spans.get_finished_spans() if x.name.endswith(".cache-cmd")]
    assert cmd.attributes["vtm.command_id"] == "c-2"
    assert [x.context.span_id for x in got["cache_pull_wait"].links] == [cmd.context.span_id]
    assert [format(x.context.trace_id, "032x") for x in cmd.links] == [tid]
    assert got["queue_wait"].attributes["vtm.pull_hold_s"] > 0


async def test_a_reconcile_copy_during_the_hold_is_linked_both_ways(
    nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    """The held request's blocks arrive by a ``reconcile`` command with a source (a split's or
    merge's pending prefix, copied on its first reuse) rather than a replicate: its
    ``cache_pull_wait`` links to that command's ``cache-cmd`` span, which links back to the
    request's root, as for a replicate copy. Before, only replicate copies were linked: a
    hold a reconcile copy released had no link."""
    s = Subjects(uniq)
    tid = root_trace(0x56)
    svc = service(nats_server.url, uniq, SimBackend())
    async with service_running(svc, timeout_s=WAIT_S):
        sub = await held_for_a_pull(nc, svc, s, "held-rc", tid)
        rc = ReconcileCommand(command_id="rc-1", worker_id=WID, epoch=0, blocks=[1],
                              source_worker="w-cp2-g0")
        done = await call(nc, s.cache_cmd(WID), rc, CacheCommandResult, timeout_s=WAIT_S)
        assert done.ok and done.blocks_done == 1
        ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
    assert ft.error is None and ft.prefix_tokens == 512
    got = await stage_spans(spans, tid, {"queue_wait", "cache_pull_wait", "prefill"})
    pull = got["cache_pull_wait"]
    (cmd,) = [x for x in spans.get_finished_spans() if x.name.endswith(".cache-cmd")]
    assert (cmd.attributes["vtm.cache_op"], cmd.attributes["vtm.command_id"]) == \
        ("reconcile", "rc-1")
    assert [(format(x.context.trace_id, "032x"), format(x.context.span_id, "016x"),
             x.attributes["vtm.link"]) for x in cmd.links] == [(tid, ROOT_SPAN, "pull_hold")]
    assert [(x.context.trace_id, x.context.span_id) for x in pull.links] == \
        [(cmd.context.trace_id, cmd.context.span_id)]
    assert pull.attributes["vtm.pull_copies"] == 1
    assert pull.attributes["vtm.pull_landed"] is True


async def test_a_reconcile_copy_arriving_holds_past_the_bound_and_is_linked(
    nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    """A reconcile copy of the held request's blocks still running when the hold's bound
    passes holds the request until it lands, as a replicate copy does (WorkerCore.pull_hold's
    ``incoming``; the simulator's request waits for it too): the request reuses the copied
    block, its ``cache_pull_wait`` links to the reconcile copy (already arriving when the hold
    began), and the copy's span to the request. Before, it started at the bound and
    recomputed the block while the copy was still arriving."""
    s = Subjects(uniq)
    tid = root_trace(0x57)
    backend = SlowCopies()
    svc = service(nats_server.url, uniq, backend, pull_hold_slack=1.0, pull_hold_grace_s=0.0)
    async with service_running(svc, timeout_s=WAIT_S):
        try:
            sub = await nc.subscribe(s.result("held-rc2"))
            rc = ReconcileCommand(command_id="rc-2", worker_id=WID, epoch=0, blocks=[1],
                                  source_worker="w-cp2-g0")
            copy = asyncio.create_task(call(nc, s.cache_cmd(WID), rc, CacheCommandResult,
                                            timeout_s=WAIT_S))
            await asyncio.wait_for(backend.copying.wait(), timeout=WAIT_S)
            held = assignment("held-rc2", tid, pull_copy_s=1e-6)  # bound: passed at once
            await call(nc, s.worker_assign(WID), held, AssignmentAck, timeout_s=WAIT_S)
            for _ in range(10):  # past the bound, still queued (ordering, not timing)
                await asyncio.sleep(0.02)
                assert svc.core.running is None and len(svc.core.queued) == 1
            backend.release.set()
            assert (await copy).ok
            ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
        finally:
            backend.release.set()
    assert ft.error is None and ft.prefix_tokens == 512  # reused: the copy had landed
    got = await stage_spans(spans, tid, {"queue_wait", "cache_pull_wait", "prefill"})
    pull = got["cache_pull_wait"]
    assert pull.attributes["vtm.pull_landed"] is True
    (cmd,) = [x for x in spans.get_finished_spans() if x.name.endswith(".cache-cmd")]
    assert cmd.attributes["vtm.command_id"] == "rc-2"
    assert [x.context.span_id for x in pull.links] == [cmd.context.span_id]
    assert [format(x.context.trace_id, "032x") for x in cmd.links] == [tid]


async def test_a_result_carries_its_request_trace_context(
    nats_server: EmbeddedNats, nc: Client, uniq: str, spans: InMemorySpanExporter
) -> None:
    """A FirstToken, a token or an error, carries its request's root context in its headers:
    whoever waits on results (the controller, draining a worker) links to the request's
    trace from it. Before, a result carried whatever context was current when it was sent
    (none)."""
    s = Subjects(uniq)
    tid = root_trace(0x55)

    class Failing(SimBackend):
        async def prefill(self, assignment: Assignment) -> PrefillResult:
            if assignment.request.request_id == "ctx-bad":
                raise RuntimeError("broken on purpose")
            return await super().prefill(assignment)

    async with service_running(service(nats_server.url, uniq, Failing()), timeout_s=WAIT_S):
        seen = []
        for rid in ("ctx-ok", "ctx-bad"):
            sub = await nc.subscribe(s.result(rid))
            await call(nc, s.worker_assign(WID), assignment(rid, tid), AssignmentAck,
                       timeout_s=WAIT_S)
            msg = await sub.next_msg(timeout=WAIT_S)
            await sub.unsubscribe()
            ft = decode(FirstToken, msg.data)
            seen.append((rid, ft.error is None, (msg.headers or {}).get("traceparent")))
    assert seen == [("ctx-ok", True, f"00-{tid}-{ROOT_SPAN}-01"),
                    ("ctx-bad", False, f"00-{tid}-{ROOT_SPAN}-01")]
