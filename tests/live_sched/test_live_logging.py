"""What an operator reads about a scheduler: log lines carry the request's ids (conventions.md:
request id and trace id bound per message) -- what the scheduler logs while it handles an
intake delivery names the request and the trace the gateway started for it, with no id passed
by hand -- and its micro metadata names the epoch its workers run under."""

from __future__ import annotations

import json

from live_sched_support import Services, http, wait_until
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from structlog.contextvars import merge_contextvars
from structlog.testing import capture_logs

from shared.telemetry import Stage

B = 16
PROMPT = list(range(700, 700 + 2 * B + 3))


async def test_the_schedulers_lines_for_a_delivery_name_its_request_and_trace(
        live: Services, spans: InMemorySpanExporter) -> None:
    await live.scheduler(block_size=B, max_deliver=2, retry_delay_s=0.05)
    gw = await live.gateway(block_size=B)
    with capture_logs(processors=[merge_contextvars]) as logs:
        reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT})
    assert reply.status == 503  # no worker: the scheduler retries, then fails the request
    (root,) = [s for s in spans.get_finished_spans() if s.name == str(Stage.REQUEST)]
    lines = [e for e in logs if e["event"] in ("intake retry", "request failed")]
    assert {e["event"] for e in lines} == {"intake retry", "request failed"}
    assert {e["request_id"] for e in lines} == {root.attributes["vtm.request_id"]}
    assert {e["trace_id"] for e in lines} == {format(root.context.trace_id, "032x")}


async def test_the_schedulers_metadata_names_its_workers_epoch(  # type: ignore[no-untyped-def]
        live: Services, fake_worker, nc) -> None:
    sched = await live.scheduler(block_size=B)
    w = await fake_worker("w-cp2-g0", 2, 0)
    await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")
    w.epoch = 4
    await w.publish_state()
    await wait_until(lambda: sched.core.view.workers[0].epoch == 4, "the new epoch in the view")
    info = json.loads((await nc.request(f"$SRV.INFO.vtm-scheduler.{sched.service.id}",
                                             b"", timeout=10)).data)
    assert info["metadata"]["epoch"] == "4" and info["metadata"]["workers"] == "1"
