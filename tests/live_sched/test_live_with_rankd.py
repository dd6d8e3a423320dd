"""The gateway and scheduler with real rank daemons (sim backend), not fakes: the contracts
they share (worker-state KV, the assign endpoint, FirstToken results) hold end to end."""

from __future__ import annotations

import asyncio

from live_sched_support import Services, http, wait_until
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.rankd.backend import PrefillResult, SimBackend
from services.rankd.service import RankdService
from services.rankd.settings import RankdSettings
from shared.schemas import Assignment, FirstToken, decode

B = 16


async def test_requests_through_real_rankd(live: Services,
                                           spans: InMemorySpanExporter) -> None:
    for wid in ("w-cp2-g0", "w-cp4-g4"):
        settings = RankdSettings(nats_url=live.url, subject_prefix=live.prefix, worker_id=wid,
                                 heartbeat_s=0.2)
        await live._run(RankdService(settings, SimBackend(prefill_time=lambda r, p, c,
                                                                kind="cp": 0.01)))
    sched = await live.scheduler(block_size=B)
    gw = await live.gateway(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 2, "both rank daemons in the view")

    prompts = [list(range(i, i + 40 + 10 * i)) for i in range(6)]
    replies = await asyncio.gather(*(
        http(gw.http_port, "POST", "/v1/completions", {"prompt": p}) for p in prompts))
    assert [r.status for r in replies] == [200] * 6, [r.body for r in replies]
    for p, r in zip(prompts, replies, strict=True):
        vtm = r.json()["vtm"]
        assert vtm["worker_id"] in ("w-cp2-g0", "w-cp4-g4")
        assert r.json()["usage"]["prompt_tokens"] == len(p)
        st = vtm["stages"]
        assert st["prefill_s"] > 0 and st["total_s"] >= st["prefill_s"]
    await wait_until(lambda: sched.stats.finished == 6, "every reservation released")
    assert all(len(ld) == 0 for ld in sched.core.loads.values())

    # The worker's spans join the same trace: request → schedule, request → prefill.
    await wait_until(lambda: sum(s.name == "prefill" for s in spans.get_finished_spans()) == 6,
                     "prefill spans")
    finished = spans.get_finished_spans()
    roots = {s.context.trace_id: s for s in finished if s.name == "request"}
    assert len(roots) == 6
    for name in ("schedule", "prefill"):
        for s in (x for x in finished if x.name == name):
            assert s.context.trace_id in roots

    # /v1/workers reads what the rank daemons publish.
    workers = (await http(gw.http_port, "GET", "/v1/workers")).json()["workers"]
    assert {w["worker_id"] for w in workers} == {"w-cp2-g0", "w-cp4-g4"}


async def test_the_answer_says_the_workers_time_scale(live: Services) -> None:
    """A worker at time scale 0.1 (``vertumnus up``'s default) sleeps the scheduler's
    prediction × 0.1: the answer's stages are wall seconds, ``predicted_prefill_s`` modelled
    seconds, and ``time_scale`` converts one to the other."""
    scale = 0.1
    settings = RankdSettings(nats_url=live.url, subject_prefix=live.prefix,
                             worker_id="w-cp2-g0", heartbeat_s=0.2)
    # No prefill_time: the sim backend takes the assignment's predicted_s (modelled).
    await live._run(RankdService(settings, SimBackend(time_scale=scale)))
    sched = await live.scheduler(block_size=B)
    gw = await live.gateway(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 1, "the rank daemon in the view")
    reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": list(range(400))})
    assert reply.status == 200, reply.body
    vtm = reply.json()["vtm"]
    assert vtm["time_scale"] == scale and vtm["predicted_prefill_s"] > 0
    # Wall prefill ≥ the scaled prediction (no upper bound: a busy machine sleeps longer).
    assert vtm["stages"]["prefill_s"] >= 0.9 * vtm["predicted_prefill_s"] * scale



async def test_handoff_off_worker_frees_the_worker_at_prefill_end(live: Services,
                                                                  nc: Client) -> None:
    """With ``handoff_off_worker`` (what ``vertumnus up`` runs, as the simulator models it)
    the worker starts its next prefill while the previous request's KV handoff is still
    under way, and each first token still comes after its own handoff; the scheduler infers
    the queued request's start from the first result.

    The first prefill is held until the second request is queued at the worker, so the
    second one is there to start the moment the first prefill ends (not only if it happened
    to reach the worker within the first one's handoff)."""
    wid = "w-cp2-g0"
    settings = RankdSettings(nats_url=live.url, subject_prefix=live.prefix, worker_id=wid,
                             heartbeat_s=0.2)
    holder: list[RankdService] = []
    held: list[str] = []

    class HeldSimBackend(SimBackend):
        async def prefill(self, assignment: Assignment) -> PrefillResult:
            if not held:  # the first prefill: wait (bounded) until another job is queued
                held.append(assignment.request.request_id)
                await wait_until(lambda: len(holder[0].core.queued) >= 1,
                                 "the second request queued behind the first")
            return await super().prefill(assignment)

    backend = HeldSimBackend(prefill_time=lambda r, p, c, kind="cp": 0.1,
                             handoff_time=lambda n, c: 0.5, first_decode_time=lambda n, c: 0.1,
                             handoff_off_worker=True)
    holder.append(RankdService(settings, backend))
    await live._run(holder[0])
    results: dict[str, FirstToken] = {}

    async def on_result(msg: Msg) -> None:
        r = decode(FirstToken, msg.data, msg.headers)
        results[r.request_id] = r

    sub = await nc.subscribe(live.subjects.result_all(), cb=on_result)
    try:
        sched = await live.scheduler(block_size=B)
        gw = await live.gateway(block_size=B)
        await wait_until(lambda: len(sched.core.view) == 1, "the rank daemon in the view")
        bodies = [{"prompt": list(range(i * 100, i * 100 + 40)), "request_id": f"ho-{i}"}
                  for i in (1, 2)]
        replies = await asyncio.gather(*(http(gw.http_port, "POST", "/v1/completions", b)
                                         for b in bodies))
        assert [r.status for r in replies] == [200, 200], [r.body for r in replies]
        await wait_until(lambda: len(results) == 2, "both first tokens on the wire")
    finally:
        await sub.unsubscribe()
    a, b = sorted(results.values(), key=lambda r: r.finished_at_s)
    assert held == [a.request_id]  # the held prefill is the first one to finish

    def prefill_span(r: FirstToken) -> tuple[float, float]:
        end = r.finished_at_s - r.stages.first_decode_s - r.stages.kv_transfer_s
        return end - r.stages.prefill_s, end

    for r in (a, b):  # the handoff and the first decode are still in TTFT, after the prefill
        assert r.stages.kv_transfer_s >= 0.5 and r.stages.first_decode_s >= 0.1
    (_, a_end), (b_start, _) = prefill_span(a), prefill_span(b)
    # One FIFO worker: b's prefill began after a's ended, and before a's first token existed
    # (a blocking backend would have held the worker through a's 0.6 s handoff).
    assert a_end - 1e-6 <= b_start < a.finished_at_s
    await wait_until(lambda: sched.stats.finished == 2, "both reservations released")
    # b was queued behind a (AssignmentAck position 1): its start was inferred from a's result.
    assert sched.stats.starts_inferred >= 1
