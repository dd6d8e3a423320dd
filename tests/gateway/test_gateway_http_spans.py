"""Every answered HTTP request is recorded as a span whose trace is the answer's ``X-Trace-Id``
(services/gateway/httpspan.py): a request the completion logic takes, by its ``request`` span
(unchanged); any other -- a refusal of the server (malformed head, body over the limit ...),
of the routes (401, 404, 405), of a completion before its span opens, ``/health`` -- by one
server span of its answer, a child of the client's span where it sent a ``traceparent``.

Found by an observability review: such answers named a trace id (``X-Trace-Id``,
``error.trace_id``) that no span recorded, so a user who pasted it into a tracing UI found
nothing. And the ids the server minted were UUIDs, whose fixed variant bits sit where the
ratio sampler reads its randomness."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from service_support import service_running
from structlog.testing import capture_logs

import services.gateway.httpspan as httpspan
from services.gateway.adapter import GatewayService
from services.gateway.httpserver import HttpRequest, HttpResponse, HttpServer
from services.gateway.httpspan import HTTP_TRACER_NAME
from services.gateway.settings import GatewaySettings
from shared.natsserver import EmbeddedNats
from shared.telemetry import Stage

WAIT_S = 30.0  # hang guard for reads, never a speed check
HEX32 = re.compile(r"[0-9a-f]{32}")
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SAMPLED = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
NOT_SAMPLED = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"
KEY = "k-spans-123"


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def trace_id(self) -> str:
        return self.headers["x-trace-id"]

    def error(self) -> dict[str, Any]:
        err: dict[str, Any] = json.loads(self.body)["error"]
        # The body names the same trace as the header.
        assert err["trace_id"] == self.trace_id, (err, self.headers)
        return err


async def send(port: int, raw: bytes) -> Reply:
    """``raw`` on a fresh connection; the one answer read to the connection's close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return Reply(int(lines[0].split(" ")[1]), headers, body)


def request(method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
    """A request closing its connection; ``headers`` with ``_`` for ``-``."""
    hdrs = {"Host": "localhost", "Connection": "close", "Content-Length": str(len(body)),
            **{k.replace("_", "-"): v for k, v in headers.items()}}
    return (f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in hdrs.items())
            + "\r\n").encode() + body


def http_spans(spans: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans()
            if s.instrumentation_scope is not None
            and s.instrumentation_scope.name == HTTP_TRACER_NAME]


def only_span_of(spans: InMemorySpanExporter, reply: Reply) -> ReadableSpan:
    """The one span recorded in the answer's trace: the server's span of the answer."""
    assert HEX32.fullmatch(reply.trace_id), reply.headers
    got = [s for s in spans.get_finished_spans()
           if format(s.context.trace_id, "032x") == reply.trace_id]
    assert len(got) == 1, [(s.name, dict(s.attributes or {})) for s in got]
    (span,) = got
    assert span.kind is trace.SpanKind.SERVER
    assert span.instrumentation_scope is not None
    assert span.instrumentation_scope.name == HTTP_TRACER_NAME
    assert span.start_time is not None and span.end_time is not None
    assert span.start_time <= span.end_time
    return span


async def echo(req: HttpRequest) -> HttpResponse:
    return HttpResponse.json(200, {"path": req.path})


@pytest.fixture
async def server() -> AsyncIterator[HttpServer]:
    srv = HttpServer(echo, max_body_bytes=64, max_header_bytes=1024)
    await srv.start()
    try:
        yield srv
    finally:
        await srv.close()


# -- refusals of the server itself ------------------------------------------------------------


@pytest.mark.parametrize(("raw", "status", "name", "path"), [
    (b"NOT A REQUEST LINE AT ALL\r\n\r\n", 400, "HTTP", None),
    (b"GET /x HTTP/1.1\r\nno colon here\r\n\r\n", 400, "GET", "/x"),
    (b"GET /x HTTP/2.0\r\n\r\n", 505, "GET", "/x"),
    (b"GET /x HTTP/1.1\r\nX-Big: " + b"y" * 2048 + b"\r\n\r\n", 431, "HTTP", None),
    (request("POST", "/v1/completions", Content_Length="65"), 413, "POST", "/v1/completions"),
    (request("POST", "/up", Transfer_Encoding="chunked")
     .replace(b"Content-Length: 0\r\n", b""), 411, "POST", "/up"),
    (request("BREW", "/pot", Expect="tea"), 417, "HTTP", "/pot"),
])
async def test_a_refusal_of_the_server_is_a_span_in_the_trace_it_names(
        server: HttpServer, spans: InMemorySpanExporter, raw: bytes, status: int, name: str,
        path: str | None) -> None:
    reply = await send(server.port, raw)
    assert reply.status == status, reply.body
    err = reply.error()
    span = only_span_of(spans, reply)
    assert span.parent is None  # no traceparent: a root, with the trace id the answer names
    assert span.name == name
    attrs = dict(span.attributes or {})
    assert attrs["http.response.status_code"] == status
    assert attrs["vtm.error_code"] == status
    assert (attrs["vtm.error_type"], attrs["vtm.error_message"]) == (err["type"],
                                                                       err["message"])
    assert attrs["vtm.request_id"] == reply.headers["x-request-id"] == err["request_id"]
    assert attrs["url.scheme"] == "http" and attrs["vtm.entry"] == "http"
    assert attrs.get("url.path") == path
    assert attrs["http.request.method"] == ("_OTHER" if name == "HTTP" else name)
    if name == "HTTP" and path is not None:
        assert attrs["http.request.method_original"] == "BREW"
    # A 4xx is the client's error: the server span's status stays unset (5xx: ERROR).
    if status >= 500:
        assert span.status.status_code is trace.StatusCode.ERROR
        assert attrs["error.type"] == str(status)
    else:
        assert span.status.status_code is trace.StatusCode.UNSET
        assert "error.type" not in attrs


async def test_a_refusal_with_a_traceparent_is_a_child_of_the_clients_span(
        server: HttpServer, spans: InMemorySpanExporter) -> None:
    reply = await send(server.port, request("POST", "/x", traceparent=SAMPLED,
                                            Content_Length="65"))
    assert reply.status == 413 and reply.trace_id == CLIENT_TRACE
    span = only_span_of(spans, reply)
    assert span.parent is not None and span.parent.is_remote
    assert format(span.parent.span_id, "016x") == CLIENT_SPAN


async def test_the_clients_sampling_decision_is_kept(
        server: HttpServer, spans: InMemorySpanExporter) -> None:
    """ParentBased: a client's trace it samples is recorded here, one it does not sample is
    not; either answer names the client's trace."""
    other = "5b8efff798038103d269b633813fc60c"
    dropped = await send(server.port, request("POST", "/x", traceparent=NOT_SAMPLED,
                                              Content_Length="65"))
    kept = await send(server.port, request(
        "POST", "/x", traceparent=SAMPLED.replace(CLIENT_TRACE, other), Content_Length="65"))
    assert (dropped.status, kept.status) == (413, 413)
    assert (dropped.trace_id, kept.trace_id) == (CLIENT_TRACE, other)
    assert [format(s.context.trace_id, "032x") for s in http_spans(spans)] == [other]


async def test_a_handler_failure_is_an_error_span(spans: InMemorySpanExporter) -> None:
    async def broken(req: HttpRequest) -> HttpResponse:
        raise RuntimeError("boom")

    srv = HttpServer(broken)
    await srv.start()
    try:
        reply = await send(srv.port, request("GET", "/x"))
    finally:
        await srv.close()
    assert reply.status == 500
    span = only_span_of(spans, reply)
    assert span.status.status_code is trace.StatusCode.ERROR
    assert span.status.description == "internal error"
    assert (span.attributes or {})["error.type"] == "500"


async def test_a_tracing_failure_changes_no_answer(
        server: HttpServer, spans: InMemorySpanExporter,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Tracing that raises is logged and the answer is the same; the server keeps
    serving."""
    def broken() -> None:
        raise RuntimeError("tracing broke")

    monkeypatch.setattr(httpspan, "_http_tracer", broken)
    with capture_logs() as logs:
        refused = await send(server.port, b"NOT A REQUEST LINE AT ALL\r\n\r\n")
        ok = await send(server.port, request("GET", "/still"))
    assert refused.status == 400 and refused.error()["code"] == 400
    assert ok.status == 200 and json.loads(ok.body) == {"path": "/still"}
    failures = [e for e in logs if e["event"] == "HTTP span not recorded"]
    # The first failure is logged; the next falls within the log budget's minute.
    assert len(failures) == 1 and failures[0]["log_level"] == "warning", failures
    assert http_spans(spans) == []


async def test_minted_trace_ids_are_random_where_the_ratio_sampler_looks(
        server: HttpServer) -> None:
    """``TraceIdRatioBased`` compares the lower 64 bits of a trace id with its bound. A UUID4
    has its variant bits ``10`` at the top of those, so at ratios below 1/2 none of its ids
    would be sampled. 32 answers: all with those bits ``10`` by chance has odds of 4^-32."""
    tops = set()
    for _ in range(32):
        reply = await send(server.port, request("GET", "/x"))
        tops.add((int(reply.trace_id, 16) >> 62) & 0b11)
    assert tops != {0b10}


# -- answers of the gateway's routes -----------------------------------------------------------


@pytest.fixture
async def gateway(nats_server: EmbeddedNats, uniq: str) -> AsyncIterator[GatewayService]:
    """A gateway with API keys, no scheduler (a completion that gets that far times out)."""
    gw = GatewayService(GatewaySettings(
        nats_url=nats_server.url, subject_prefix=uniq, http_port=0, api_keys=KEY,
        max_prompt_tokens=64, result_timeout_s=0.2))
    async with service_running(gw):
        yield gw


AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize(("raw", "status", "name", "route"), [
    (request("GET", "/v1/workers"), 401, "GET /v1/workers", "/v1/workers"),  # no key
    (request("GET", "/v1/nothing", **AUTH), 404, "GET", None),
    (request("GET", "/v1/completions", **AUTH), 405, "GET /v1/completions", "/v1/completions"),
    (request("POST", "/v1/completions", b"{not json", **AUTH), 400, "POST /v1/completions",
     "/v1/completions"),
    (request("POST", "/v1/completions", b"{}", Content_Type="text/plain", **AUTH), 415,
     "POST /v1/completions", "/v1/completions"),
    (request("POST", "/v1/completions", json.dumps({"prompt": list(range(100))}).encode(),
             **AUTH), 413, "POST /v1/completions", "/v1/completions"),  # over the limit
])
async def test_an_answer_of_a_route_is_a_span_in_the_trace_it_names(
        gateway: GatewayService, spans: InMemorySpanExporter, raw: bytes, status: int,
        name: str, route: str | None) -> None:
    reply = await send(gateway.http_port, raw)
    assert reply.status == status, reply.body
    span = only_span_of(spans, reply)
    assert span.parent is None and span.name == name
    attrs = dict(span.attributes or {})
    assert attrs.get("http.route") == route
    assert attrs["http.response.status_code"] == status
    assert attrs["vtm.request_id"] == reply.headers["x-request-id"]
    if status >= 400:
        err = reply.error()
        assert (attrs["vtm.error_code"], attrs["vtm.error_message"]) == (status,
                                                                          err["message"])
    else:
        assert "vtm.error_code" not in attrs
    assert span.status.status_code is trace.StatusCode.UNSET


@pytest.mark.parametrize("method", ["GET", "HEAD"])
async def test_a_plain_health_probe_records_no_span(
        gateway: GatewayService, spans: InMemorySpanExporter, method: str) -> None:
    """A liveness probe every few seconds would fill the tracing UI: a successful ``/health``
    answer to a request without a ``traceparent`` is not recorded (one with it is, above)."""
    reply = await send(gateway.http_port, request(method, "/health"))
    assert reply.status == 200
    # The next answers are recorded (the exporter is live, and has had the probe's turn).
    traced = await send(gateway.http_port, request(method, "/health", traceparent=SAMPLED))
    assert traced.status == 200 and traced.trace_id == CLIENT_TRACE
    span = only_span_of(spans, traced)
    assert span.name == f"{method} /health" and span.parent is not None
    assert dict(span.attributes or {})["http.route"] == "/health"
    other = await send(gateway.http_port, request("GET", "/nowhere"))
    assert only_span_of(spans, other).name == "GET"
    assert [s for s in spans.get_finished_spans()
            if format(s.context.trace_id, "032x") == reply.trace_id] == []


async def test_a_route_refusal_with_a_traceparent_joins_the_clients_trace(
        gateway: GatewayService, spans: InMemorySpanExporter) -> None:
    reply = await send(gateway.http_port, request("GET", "/nowhere", traceparent=SAMPLED))
    assert reply.status == 404 and reply.trace_id == CLIENT_TRACE
    span = only_span_of(spans, reply)
    assert span.parent is not None and format(span.parent.span_id, "016x") == CLIENT_SPAN


async def test_a_completion_is_recorded_by_its_request_span_alone(
        gateway: GatewayService, spans: InMemorySpanExporter) -> None:
    """A request the completion logic takes (504 here: no scheduler) names its ``request``
    span's trace, and the server adds no span of its own to it."""
    body = json.dumps({"prompt": [1, 2, 3], "request_id": "spans-1"}).encode()
    reply = await send(gateway.http_port, request("POST", "/v1/completions", body, **AUTH))
    assert reply.status == 504, reply.body
    (root,) = [s for s in spans.get_finished_spans() if s.name == str(Stage.REQUEST)]
    assert format(root.context.trace_id, "032x") == reply.trace_id == reply.error()["trace_id"]
    assert http_spans(spans) == []
