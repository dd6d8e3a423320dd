"""Every answer of the gateway can be found again: it names its request id (``X-Request-Id``)
and trace id (``X-Trace-Id``; an error's JSON body names both too), and the gateway writes
one access-log line per answered request with the same ids.

Found by an observability review: error responses (400, 413 seen live) carried neither id,
and the gateway logged no line per request, so an error a client reported could not be
matched with anything the gateway recorded."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from live_sched_support import Services, http, wait_until
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from structlog.contextvars import merge_contextvars
from structlog.testing import capture_logs

from services.gateway.httpserver import (
    ACCESS_EVENT,
    HttpRequest,
    HttpResponse,
    HttpServer,
    LineBudget,
)
from shared.telemetry import Stage

HEX32 = re.compile(r"[0-9a-f]{32}")
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CLIENT_TRACE}-00f067aa0ba902b7-01"


def access_lines(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["event"] == ACCESS_EVENT]


def ids_of_error(reply: Any) -> tuple[str, str]:
    """The error's ids, checked to be the same in its headers and its JSON body."""
    rid, tid = reply.headers["x-request-id"], reply.headers["x-trace-id"]
    err = reply.json()["error"]
    assert (err["request_id"], err["trace_id"]) == (rid, tid), reply.body
    assert rid and HEX32.fullmatch(tid), (rid, tid)
    return rid, tid


@pytest.mark.parametrize(
    ("method", "path", "kw", "status"),
    [
        ("POST", "/v1/completions", {"raw": b"{not json"}, 400),  # refused by the app
        ("POST", "/v1/completions", {"raw": b"x" * 4096}, 413),  # by the server (Content-Length)
        ("POST", "/v1/completions", {"body": {"prompt": list(range(100))}}, 413),  # by limits
        ("GET", "/no/such/route", {}, 404),
    ],
)
async def test_an_error_names_its_request_and_trace(live: Services, method: str, path: str,
                                                    kw: dict[str, Any], status: int) -> None:
    gw = await live.gateway(max_body_bytes=2048, max_prompt_tokens=64)
    with capture_logs(processors=[merge_contextvars]) as logs:
        reply = await http(gw.http_port, method, path, **kw)
        # A client's trace context: the error belongs to the client's trace.
        traced = await http(gw.http_port, method, path, **kw,
                            headers={"traceparent": TRACEPARENT})
    assert reply.status == traced.status == status, reply.body
    rid, tid = ids_of_error(reply)
    rid2, tid2 = ids_of_error(traced)
    assert rid != rid2 and tid != tid2
    assert tid2 == CLIENT_TRACE
    lines = access_lines(logs)
    assert [(e["request_id"], e["trace_id"], e["status"]) for e in lines] == [
        (rid, tid, status), (rid2, tid2, status)]
    for e in lines:
        assert (e["method"], e["path"], e["log_level"]) == (method, path, "info")
        assert e["duration_s"] >= 0 and "ttft_s" not in e


async def test_an_error_names_the_clients_request_id(live: Services) -> None:
    gw = await live.gateway()
    reply = await http(gw.http_port, "POST", "/v1/completions",
                       {"prompt": [1, 2], "stream": True, "request_id": "client-7"})
    assert reply.status == 400, reply.body
    assert ids_of_error(reply)[0] == "client-7"


async def test_a_success_names_its_request_and_trace(
        live: Services, fake_worker, spans: InMemorySpanExporter) -> None:  # type: ignore[no-untyped-def]
    await fake_worker("w-cp2-g0", 2, 0)
    sched = await live.scheduler(block_size=2)
    gw = await live.gateway(block_size=2)
    await wait_until(lambda: len(sched.core.view) == 1, "worker in the view")
    with capture_logs(processors=[merge_contextvars]) as logs:
        reply = await http(gw.http_port, "POST", "/v1/completions",
                           {"prompt": list(range(9)), "request_id": "ok-1"})
        health = await http(gw.http_port, "GET", "/health")
    assert reply.status == 200, reply.body
    vtm = reply.json()["vtm"]
    (root,) = [s for s in spans.get_finished_spans() if s.name == str(Stage.REQUEST)]
    trace_id = format(root.context.trace_id, "032x")
    assert reply.headers["x-request-id"] == vtm["request_id"] == "ok-1"
    assert reply.headers["x-trace-id"] == vtm["trace_id"] == trace_id
    assert health.status == 200 and health.headers["x-request-id"]
    assert HEX32.fullmatch(health.headers["x-trace-id"])
    done, probe = access_lines(logs)
    assert (done["method"], done["path"], done["status"], done["log_level"]) == (
        "POST", "/v1/completions", 200, "info")
    assert (done["request_id"], done["trace_id"]) == ("ok-1", trace_id)
    assert done["ttft_s"] == vtm["ttft_s"] and done["duration_s"] >= 0
    assert (probe["path"], probe["status"], probe["request_id"], probe["trace_id"]) == (
        "/health", 200, health.headers["x-request-id"], health.headers["x-trace-id"])


async def test_a_timeout_is_logged_as_a_warning_with_its_ids(
        live: Services, spans: InMemorySpanExporter) -> None:
    """No scheduler: no first token comes, 504. That line is a warning, and it names the
    trace the request's span recorded."""
    gw = await live.gateway(result_timeout_s=0.2)
    with capture_logs(processors=[merge_contextvars]) as logs:
        reply = await http(gw.http_port, "POST", "/v1/completions", {"prompt": [1, 2, 3]})
    assert reply.status == 504, reply.body
    rid, tid = ids_of_error(reply)
    (root,) = [s for s in spans.get_finished_spans() if s.name == str(Stage.REQUEST)]
    assert (rid, tid) == (root.attributes["vtm.request_id"],
                          format(root.context.trace_id, "032x"))
    (line,) = access_lines(logs)
    assert (line["status"], line["log_level"], line["request_id"], line["trace_id"]) == (
        504, "warning", rid, tid)


async def test_a_handler_failure_is_a_500_with_its_ids_and_a_warning() -> None:
    async def broken(req: HttpRequest) -> HttpResponse:
        raise RuntimeError("boom")

    server = HttpServer(broken)
    await server.start()
    try:
        with capture_logs(processors=[merge_contextvars]) as logs:
            reply = await http(server.port, "GET", "/x")
    finally:
        await server.close()
    assert reply.status == 500
    rid, tid = ids_of_error(reply)
    (line,) = access_lines(logs)
    assert (line["status"], line["log_level"], line["request_id"], line["trace_id"]) == (
        500, "warning", rid, tid)
    (failed,) = [e for e in logs if e["event"] == "HTTP handler failed"]
    assert (failed["request_id"], failed["trace_id"]) == (rid, tid)


async def test_a_flood_of_bad_requests_logs_a_bounded_number_of_lines() -> None:
    """Error lines beyond the budget are left out (and counted); successes are not."""
    async def handler(req: HttpRequest) -> HttpResponse:
        return HttpResponse.json(200 if req.path == "/ok" else 404, {})

    server = HttpServer(handler, error_lines_per_s=0.0, error_lines_burst=2)
    await server.start()
    try:
        with capture_logs(processors=[merge_contextvars]) as logs:
            replies = await asyncio.gather(*(http(server.port, "GET", "/bad")
                                             for _ in range(6)))
            ok = await http(server.port, "GET", "/ok")
    finally:
        await server.close()
    assert [r.status for r in replies] == [404] * 6 and ok.status == 200
    assert all(r.headers["x-request-id"] for r in replies)  # answered with ids all the same
    lines = access_lines(logs)
    assert [e["status"] for e in lines] == [404, 404, 200]


def test_a_line_budget_refills_and_counts_what_it_left_out() -> None:
    now = [0.0]
    budget = LineBudget(rate_per_s=1.0, burst=2, clock=lambda: now[0])
    assert [budget.take() for _ in range(5)] == [0, 0, None, None, None]
    now[0] += 1.0
    assert budget.take() == 3  # let through, naming the three left out before it
    assert budget.take() is None
    now[0] += 10.0  # refills up to the burst only
    assert [budget.take() for _ in range(3)] == [1, 0, None]
