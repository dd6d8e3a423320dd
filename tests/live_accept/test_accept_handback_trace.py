"""A request a worker hands back itself reads whole in its trace (real nats-server, the
scheduler and two rank daemons in-process on the sim backend, spans from the in-memory
exporter).

x is placed on W, queued behind a long request; a reconfiguration drains W, which hands x
back to intake; the scheduler places the hand-back on W2, which answers. x's trace has a
``handed_back`` span (rankd's: ``vtm.worker_id`` W, ``vtm.cause`` ``draining``) from x's
acceptance on W (inside W's ``vtm-rankd.assign`` span) to the hand-back's stamp, and the
hand-back delivery's ``intake_wait`` starts exactly there (the stamp travels in the
``Vtm-Handed-Back-At`` header), saying who handed it back and why. Before, the time on W was
in no span and that intake wait started at the stream's stored stamp, its cause ``worker``.
(A scheduler that hands the same request back for W once W is gone publishes a duplicate and
records no second span: tests/live_accept/test_accept_dispatch_unknown.py.)
"""

from __future__ import annotations

import os
import time

import nats
from live_accept_support import ActingController, InProcess, ResultTap, wait_until
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared.natsserver import EmbeddedNats
from shared.schemas import IntakeRequest, encode
from shared.service import epoch_kv
from shared.worker import Lifecycle

W, W2 = "w-cp2-g0", "w-cp2-g2"
TRACE = "7af7651916cd43dd8448eb211c80319c"
ROOT_SPAN = "b7ad6b7169203331"


def of_trace(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return sorted((s for s in spans.get_finished_spans()
                   if s.name == name and format(s.context.trace_id, "032x") == TRACE),
                  key=lambda s: s.start_time)


async def test_a_drained_workers_hand_back_is_traced_up_to_its_next_intake_wait(
        nats_server: EmbeddedNats, spans: InMemorySpanExporter) -> None:
    live = InProcess(nats_server.url, "t" + os.urandom(5).hex())
    nc = await nats.connect(nats_server.url, connect_timeout=5)
    tap = await ResultTap(nc, live.subjects).start()
    try:
        w = await live.blocked_rankd(W)
        await live.occupy(nc, w)
        sched = await live.scheduler(block_size=16)
        await wait_until(lambda: len(sched.core.view) == 1, "W in the view")
        x = IntakeRequest(request_id="x", input_len=40, block_size=16, arrival_s=time.time())
        data, headers = encode(x)
        headers["traceparent"] = f"00-{TRACE}-{ROOT_SPAN}-01"
        headers["Nats-Msg-Id"] = "x"
        await nc.jetstream().publish(live.subjects.intake_requests(), data, headers=headers)
        await wait_until(lambda: any(j.request_id == "x" for j in w.core.queued),
                         "x queued on W")
        await live.blocked_rankd(W2)
        # The hand-back avoids W only while another worker is eligible (scheduler
        # _avoid_hander): W2 must be in the view by then, else it goes back to W (refused,
        # 409 draining) and a third dispatch span precedes the one on W2.
        await wait_until(lambda: len(sched.core.view) == 2, "W2 in the view")
        kv = await epoch_kv(nc.jetstream(), live.subjects)
        rec = ActingController._make(1, {W: Lifecycle.DRAINING, W2: Lifecycle.ACTIVE},
                                     "drain W")
        await kv.put(live.subjects.epoch_key(), rec.model_dump_json().encode())
        await wait_until(lambda: "x" in tap.ok_ids(), "x's first token")
        await wait_until(lambda: len(of_trace(spans, "dispatch")) == 2,
                         "both placements' spans ended")
    finally:
        await live.close()
        await tap.stop()
        await nc.drain()
    assert [(r.worker_id, r.error) for r in tap.results if r.request_id == "x"] == [(W2, None)]
    (back,) = of_trace(spans, "handed_back")
    assert format(back.parent.span_id, "016x") == ROOT_SPAN
    assert {k: back.attributes[k] for k in ("vtm.request_id", "vtm.worker_id", "vtm.cause")} \
        == {"vtm.request_id": "x", "vtm.worker_id": W, "vtm.cause": "draining"}
    # From x's assignment to W (where its first schedule span ends) ...
    scheds = of_trace(spans, "schedule")
    assert back.start_time == scheds[0].end_time
    # ... to the hand-back, where its next intake wait starts.
    first, again = of_trace(spans, "intake_wait")
    assert first.start_time == int(x.arrival_s * 1e9)
    assert again.start_time == back.end_time > first.end_time
    assert {k: again.attributes[k] for k in ("vtm.handed_back", "vtm.handed_back_by",
                                             "vtm.handback_cause")} \
        == {"vtm.handed_back": True, "vtm.handed_back_by": W, "vtm.handback_cause": "draining"}
    assert again.end_time == scheds[1].start_time
