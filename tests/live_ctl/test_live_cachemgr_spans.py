"""The cache manager's command spans on a real server: a span per command it sends
(``cache_pull``, ``cache_demote``, ...) saying what it was and how it ended, whose context
travels in the command's headers -- so a real rank daemon's ``vtm-rankd.cache-cmd`` span is
its child -- and, for a copy a placement triggered, the request's id and a link to the trace
context its RequestStats carried."""

from __future__ import annotations

import time
from collections.abc import Iterable

from live_ctl_support import Collector, eventually
from nats.aio.client import Client
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from service_support import service_running
from test_live_cachemgr import A, B, acking_worker, holding, settings, stats, stored

from services.cachemgr.service import CacheMgrService
from services.rankd.backend import SimBackend
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.schemas import (
    Assignment,
    AssignmentAck,
    CacheCommandResult,
    FirstToken,
    IntakeRequest,
    ReplicateCommand,
    decode,
)
from shared.service import call
from shared.subjects import Subjects
from shared.telemetry import traceparent_of

WAIT_S = 20.0  # hang guard only
ROOT_TRACE, ROOT_SPAN = "7bf92f3577b34da6a3ce929d0e0e4736", "20f067aa0ba902b7"
TRACEPARENT = f"00-{ROOT_TRACE}-{ROOT_SPAN}-01"


def hexid(n: int, width: int) -> str:
    return format(n, f"0{width}x")


async def finished(spans: InMemorySpanExporter, names: Iterable[str]) -> list[ReadableSpan]:
    """The finished spans once one of each of ``names`` has ended."""
    wanted = set(names)

    async def probe() -> list[ReadableSpan] | None:
        got = spans.get_finished_spans()
        return list(got) if wanted <= {x.name for x in got} else None

    return await eventually(probe, what=f"spans {sorted(wanted)}")


def one(got: list[ReadableSpan], name: str) -> ReadableSpan:
    (x,) = [s for s in got if s.name == name]
    return x


async def test_a_pull_and_its_demote_each_get_a_span_that_travels_with_the_command(
    nc: Client, nats_server, uniq: str, services, spans: InMemorySpanExporter
) -> None:
    """A placement away from the prefix (stats carrying the request's trace context): the
    pull's ``cache_pull`` span (CLIENT) names the request and links to its context, says
    what it copied from where to where and how it ended; the command's headers carry its
    context. The demote that follows gets a ``cache_demote`` span likewise, unlinked. Before,
    the cache manager sent its commands with no span: the worker's side was a root."""
    s = Subjects(uniq)
    b_cmds = await acking_worker(nc, s, B)
    a_cmds = await acking_worker(nc, s, A)
    await services(CacheMgrService(settings(nats_server.url, uniq, pull_demote=True)))
    await stored(nc, s, A, 1, None, [11, 12, 13, 14])
    await stored(nc, s, B, 1, None, [11])
    await holding(nc, uniq, A, 4)
    await holding(nc, uniq, B, 1)
    await nc.publish(s.prefix + ".cache.stats.s1", stats(B, 2, [11, 12, 13, 14, 15], 1, "r1"),
                     headers={"Content-Type": "application/json", "traceparent": TRACEPARENT})
    await a_cmds.first(lambda c: c.get("op") == "demote", what="the demote")
    got = await finished(spans, {"cache_pull", "cache_demote"})
    pull, demote = one(got, "cache_pull"), one(got, "cache_demote")

    assert pull.kind is SpanKind.CLIENT and pull.parent is None  # the pool's work, a root
    assert {k: pull.attributes[k] for k in (
        "vtm.cache_op", "vtm.copy_kind", "vtm.worker_id", "vtm.source_worker", "vtm.blocks",
        "vtm.copy_blocks", "vtm.request_id", "vtm.cache_ok", "vtm.blocks_done")} == {
        "vtm.cache_op": "replicate", "vtm.copy_kind": "route", "vtm.worker_id": B,
        "vtm.source_worker": A, "vtm.blocks": 4, "vtm.copy_blocks": 3, "vtm.request_id": "r1",
        "vtm.cache_ok": True, "vtm.blocks_done": 4}
    assert [(hexid(x.context.trace_id, 32), hexid(x.context.span_id, 16), dict(x.attributes))
            for x in pull.links] == [
        (ROOT_TRACE, ROOT_SPAN, {"vtm.link": "triggered_by", "vtm.request_id": "r1"})]
    (msg,) = b_cmds.msgs
    tp = traceparent_of(msg.headers)
    assert tp is not None
    assert (tp[3:35], tp[36:52]) == (hexid(pull.context.trace_id, 32),
                                     hexid(pull.context.span_id, 16))

    assert demote.kind is SpanKind.CLIENT and demote.links == ()
    assert {k: demote.attributes[k] for k in ("vtm.cache_op", "vtm.worker_id", "vtm.blocks",
                                              "vtm.cache_ok")} == {
        "vtm.cache_op": "demote", "vtm.worker_id": A, "vtm.blocks": 3, "vtm.cache_ok": True}
    assert "vtm.request_id" not in demote.attributes
    tp = traceparent_of(a_cmds.msgs[0].headers)
    assert tp is not None and tp[36:52] == hexid(demote.context.span_id, 16)


async def test_a_refused_command_s_span_says_so_and_stats_without_context_link_nothing(
    nc: Client, nats_server, uniq: str, services, spans: InMemorySpanExporter
) -> None:
    """Stats without a trace context (what the scheduler sends today): the pull's span still
    names the request, with no link. B refuses the copy: the span ends in error, saying
    why."""
    s = Subjects(uniq)
    b_cmds = Collector()

    async def refuse(msg) -> None:  # noqa: ANN001
        await b_cmds.cb(msg)
        data = CacheCommandResult(command_id="x", worker_id=B, ok=False, error="no room")
        await nc.publish(msg.reply, data.model_dump_json().encode(),
                         headers={"Content-Type": "application/json"})

    await nc.subscribe(s.cache_cmd(B), cb=refuse)
    await acking_worker(nc, s, A)
    await services(CacheMgrService(settings(nats_server.url, uniq)))
    await stored(nc, s, A, 1, None, [11, 12, 13, 14])
    await stored(nc, s, B, 1, None, [11])
    await holding(nc, uniq, A, 4)
    await holding(nc, uniq, B, 1)
    await nc.publish(s.prefix + ".cache.stats.s1", stats(B, 2, [11, 12, 13, 14, 15], 1, "r2"))
    pull = one(await finished(spans, {"cache_pull"}), "cache_pull")
    assert pull.links == () and pull.attributes["vtm.request_id"] == "r2"
    assert pull.attributes["vtm.cache_ok"] is False
    assert pull.attributes["vtm.cache_error"] == "no room"
    assert not pull.status.is_ok


async def test_a_pull_to_a_real_worker_links_the_request_it_holds(
    nc: Client, nats_server, uniq: str, services, spans: InMemorySpanExporter
) -> None:
    """End to end: B is a real rank daemon holding a request priced with the pull at the
    head of its FIFO. The cache manager's ``cache_pull`` span is the parent of B's
    ``vtm-rankd.cache-cmd`` span (which says what it executed and links to the held request's
    root); the request's ``cache_pull_wait`` links to that span, and ``cache_pull`` to the
    root the stats carried."""
    s = Subjects(uniq)
    await acking_worker(nc, s, A)
    rankd = RankdService(RankdSettings(nats_url=nats_server.url, subject_prefix=uniq,
                                       worker_id=B, heartbeat_s=0.2),
                         SimBackend(time_scale=1.0))
    async with service_running(rankd, timeout_s=WAIT_S):
        # B holds block 11 (a copy of its own), A the whole prefix 11-14.
        seed = ReplicateCommand(command_id="seed", worker_id=B, epoch=0, blocks=[11],
                                source_worker=A)
        assert (await call(nc, s.cache_cmd(B), seed, CacheCommandResult, timeout_s=WAIT_S)).ok
        await services(CacheMgrService(settings(nats_server.url, uniq)))
        await stored(nc, s, A, 1, None, [11, 12, 13, 14])
        await holding(nc, uniq, A, 4)
        await holding(nc, uniq, B, 1)
        now = time.time()
        a = Assignment(
            request=IntakeRequest(request_id="r3", input_len=512 * 5 + 100,
                                  block_hashes=[11, 12, 13, 14, 15], arrival_s=now - 0.01,
                                  trace_context={"traceparent": TRACEPARENT}),
            worker_id=B, epoch=0, degree=2, prefix_tokens=4 * 512, recompute_tokens=612,
            predicted_s=0.01, assigned_at_s=now, pull_copy_s=60.0,  # waits for the pull
        )
        sub = await nc.subscribe(s.result("r3"))
        await call(nc, s.worker_assign(B), a, AssignmentAck, timeout_s=WAIT_S)
        await nc.publish(s.prefix + ".cache.stats.s1",
                         stats(B, 2, [11, 12, 13, 14, 15], 1, "r3"),
                         headers={"Content-Type": "application/json",
                                  "traceparent": TRACEPARENT})
        ft = decode(FirstToken, (await sub.next_msg(timeout=WAIT_S)).data)
        assert ft.error is None and ft.prefix_tokens == 4 * 512  # the pull landed first
        got = await finished(spans, {"cache_pull", "cache_pull_wait", "prefill"})
    pull, wait = one(got, "cache_pull"), one(got, "cache_pull_wait")
    (cmd,) = [x for x in got if x.name.endswith(".cache-cmd")
              and x.attributes.get("vtm.command_id") != "seed"]
    assert cmd.parent is not None and cmd.parent.span_id == pull.context.span_id
    assert cmd.context.trace_id == pull.context.trace_id
    assert (cmd.attributes["vtm.cache_op"], cmd.attributes["vtm.source_worker"],
            cmd.attributes["vtm.worker_id"], cmd.attributes["vtm.blocks"]) == \
        ("replicate", A, B, 4)
    assert [hexid(x.context.span_id, 16) for x in cmd.links] == [ROOT_SPAN]
    assert [x.context.span_id for x in wait.links] == [cmd.context.span_id]
    assert [hexid(x.context.span_id, 16) for x in pull.links] == [ROOT_SPAN]
    assert hexid(wait.context.trace_id, 32) == ROOT_TRACE
