"""Metrics end to end: a request through gateway, scheduler and a (fake) worker is counted by
the gateway with its status, TTFT, stages and tokens (a refused one with its status) and by the
scheduler with its placement; a request no worker can take is counted as unplaced, and its
prompt tokens count in the SLO attainment's denominator as a miss."""

from __future__ import annotations

from live_sched_support import Services, http, wait_until
from metricsread import total
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

B = 16
PROMPT = list(range(500, 500 + 3 * B + 5))


async def test_a_request_is_measured_at_the_gateway(
        live: Services, fake_worker, metric_reader: InMemoryMetricReader) -> None:  # type: ignore[no-untyped-def]
    await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=B)
    gw = await live.gateway(block_size=B)
    await wait_until(lambda: len(sched.core.view) == 1, "the worker in the view")

    def snap() -> dict[str, float]:
        return {
            "ok": total(metric_reader, "vtm.gateway.completions", status="200", entry="http"),
            "bad": total(metric_reader, "vtm.gateway.completions", status="400", entry="http"),
            "ttft": total(metric_reader, "vtm.request.ttft", degree="2"),
            "prefill": total(metric_reader, "vtm.request.stage", stage="prefill"),
            "tokens": total(metric_reader, "vtm.request.input_tokens", degree="2",
                            status="200"),
            # The 400 (stream=true) is refused before its prompt is tokenized: no tokens.
            "all_tokens": total(metric_reader, "vtm.request.input_tokens"),
            "slo": total(metric_reader, "vtm.request.slo_tokens", degree="2"),
            "placed": total(metric_reader, "vtm.scheduler.placements", policy="vertumnus",
                            degree="2"),
        }

    before = snap()
    reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT})
    assert reply.status == 200, reply.body
    bad = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT, "stream": True})
    assert bad.status == 400
    after = snap()
    delta = {k: after[k] - before[k] for k in before}
    # The fake worker answers at once: well within the 1 s deadline of a short prompt.
    assert delta == {"ok": 1, "bad": 1, "ttft": 1, "prefill": 1, "tokens": len(PROMPT),
                     "all_tokens": len(PROMPT), "slo": len(PROMPT), "placed": 1}


async def test_a_request_no_worker_takes_is_counted_unplaced(
        live: Services, metric_reader: InMemoryMetricReader) -> None:
    await live.scheduler(block_size=B, max_deliver=2, retry_delay_s=0.05)
    gw = await live.gateway(block_size=B)
    before = total(metric_reader, "vtm.scheduler.unplaced")
    refused = total(metric_reader, "vtm.gateway.completions", status="503")
    tokens = total(metric_reader, "vtm.request.input_tokens")
    slo = total(metric_reader, "vtm.request.slo_tokens")
    reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": PROMPT})
    assert reply.status == 503
    assert total(metric_reader, "vtm.scheduler.unplaced") - before == 2  # both deliveries
    assert total(metric_reader, "vtm.gateway.completions", status="503") - refused == 1
    # A miss in the README's attainment (slo / input tokens, every status): its tokens are in
    # the denominator, under its status and no worker's degree, and not in the numerator.
    assert total(metric_reader, "vtm.request.input_tokens") - tokens == len(PROMPT)
    assert total(metric_reader, "vtm.request.input_tokens", status="503", degree="?") \
        >= len(PROMPT)
    assert total(metric_reader, "vtm.request.slo_tokens") == slo
