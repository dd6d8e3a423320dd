"""The telemetry flush at a service's exit is bounded by its stop deadline (shared/servicemain.py
``flush_telemetry``, shared/telemetry.py ``shutdown_tracer_provider``, shared/metrics.py
``shutdown_meter_provider``): real service processes, real OTLP exporters, real sockets as the
collector -- one that answers, one that never does (a listening socket nobody accepts on: the
kernel completes the connection, no byte ever comes back) and one that refuses.

Nothing here asserts on speed. A bounded call is observed to return (hang guards of a minute,
where the unbounded call blocks for the exporter's own timeout, set to ten minutes); a service
process is observed to exit by itself with status 0, where the unbounded flush gets it killed
by the stop deadline's fault handler (status 1)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
    OTLPSpanExporter as GrpcSpanExporter,
)
from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
    OTLPMetricExporter as HttpMetricExporter,
)
from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
    OTLPSpanExporter as HttpSpanExporter,
)
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from shared.metrics import shutdown_meter_provider
from shared.servicemain import TELEMETRY_FLUSH_MIN_S, telemetry_flush_s
from shared.settings import TelemetrySettings
from shared.stopping import HARD_GRACE_S
from shared.telemetry import shutdown_tracer_provider

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 60.0  # hang guard only; nothing asserts on speed
EXPORT_TIMEOUT_S = 600.0  # the exporters' own timeout: an unbounded flush outlasts every guard


@pytest.fixture
def silent_collector() -> Iterator[str]:
    """``host:port`` of a collector that never answers: connections complete (the kernel's
    backlog), requests are never read."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"127.0.0.1:{server.getsockname()[1]}"


@pytest.fixture
def refusing_collector() -> str:
    """``host:port`` where nothing listens (connections are refused)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    return f"127.0.0.1:{port}"


class _Collector(ThreadingHTTPServer):
    """An OTLP/HTTP receiver that takes every export (200) and keeps the paths posted to."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _CollectorHandler)
        self.posted: list[tuple[str, int]] = []  # (path, body length)


class _CollectorHandler(BaseHTTPRequestHandler):
    server: _Collector

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.server.posted.append((self.path, len(body)))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass


@pytest.fixture
def collector() -> Iterator[_Collector]:
    server = _Collector()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _bounded(call: Callable[[], bool]) -> bool:
    """``call()``'s result, run in a thread; fails the test should it not return within the
    hang guard (the unbounded shutdown waits for the exporter's ten-minute timeout)."""
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(call()), daemon=True)
    thread.start()
    thread.join(WAIT_S)
    assert not thread.is_alive(), "the bounded shutdown did not return"
    return result[0]


def _tracer_provider(exporter: Any) -> TracerProvider:
    provider = TracerProvider(shutdown_on_exit=False)
    # A batch that is only ever exported by the shutdown's flush.
    provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=3_600_000))
    provider.get_tracer("test").start_span("work").end()
    return provider


def _meter_provider(exporter: Any) -> MeterProvider:
    provider = MeterProvider(
        metric_readers=[PeriodicExportingMetricReader(
            exporter, export_interval_millis=3_600_000)],  # only the shutdown's last export
        shutdown_on_exit=False)
    provider.get_meter("test").create_counter("vtm.test.flushed").add(1)
    return provider


def test_tracing_flush_delivers_to_a_collector_that_answers(collector: _Collector) -> None:
    url = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    provider = _tracer_provider(HttpSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S))
    assert _bounded(lambda: shutdown_tracer_provider(provider, WAIT_S)) is True
    assert [path for path, size in collector.posted if size > 0] == ["/v1/traces"]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_tracing_flush_to_a_silent_collector_is_cut_short_and_stopped(
        silent_collector: str, protocol: str) -> None:
    exporter: Any = (GrpcSpanExporter(endpoint=f"http://{silent_collector}", insecure=True,
                                      timeout=EXPORT_TIMEOUT_S) if protocol == "grpc"
                     else HttpSpanExporter(endpoint=f"http://{silent_collector}/v1/traces",
                                           timeout=EXPORT_TIMEOUT_S))
    provider = _tracer_provider(exporter)
    assert _bounded(lambda: shutdown_tracer_provider(provider, 0.5, [exporter])) is False
    if protocol == "grpc":
        # The exporter was stopped, not left to its ten-minute export: closing the channel
        # cancels the call, so the abandoned shutdown ends too. (An HTTP request already
        # sent is not interrupted by closing its session; it is left to the process's end.)
        left = [t for t in threading.enumerate() if t.name == "vtm-tracing-shutdown"]
        for thread in left:
            thread.join(WAIT_S)
        assert not any(t.is_alive() for t in left)


def test_metrics_flush_delivers_to_a_collector_that_answers(collector: _Collector) -> None:
    url = f"http://127.0.0.1:{collector.server_address[1]}/v1/metrics"
    provider = _meter_provider(HttpMetricExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S))
    assert _bounded(lambda: shutdown_meter_provider(provider, WAIT_S)) is True
    assert [path for path, size in collector.posted if size > 0] == ["/v1/metrics"]


def test_metrics_flush_to_a_silent_collector_is_cut_short(silent_collector: str) -> None:
    provider = _meter_provider(HttpMetricExporter(
        endpoint=f"http://{silent_collector}/v1/metrics", timeout=EXPORT_TIMEOUT_S))
    assert _bounded(lambda: shutdown_meter_provider(provider, 0.5)) is False


def test_bounded_shutdowns_refuse_an_unusable_timeout() -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        shutdown_tracer_provider(TracerProvider(shutdown_on_exit=False), float("nan"))
    with pytest.raises(ValueError, match="timeout_s"):
        shutdown_meter_provider(MeterProvider(shutdown_on_exit=False), -1.0)


def test_the_flush_gets_what_is_left_of_the_stop_deadline_with_a_floor() -> None:
    assert telemetry_flush_s(45.0, 30.5) == 30.5
    assert telemetry_flush_s(45.0, None) == 45.0  # serve returned without a stop signal
    assert telemetry_flush_s(45.0, 0.2) == TELEMETRY_FLUSH_MIN_S
    assert telemetry_flush_s(45.0, -3.0) == TELEMETRY_FLUSH_MIN_S  # the deadline has passed
    # A flush given its floor at the deadline ends before the fault handler would end it.
    assert TELEMETRY_FLUSH_MIN_S < HARD_GRACE_S


# A service process in miniature: run_service (as every service main) around a serve
# coroutine that records a span and a metric, then waits for the stop signal.
SERVICE = """
import asyncio
from contextlib import AsyncExitStack
from shared.metrics import meter
from shared.servicemain import run_service
from shared.settings import ServiceSettings
from shared.stopping import handle_stop_signals
from shared.telemetry import tracer

async def serve(settings):
    stop = asyncio.Event()
    async with AsyncExitStack() as stack:
        handle_stop_signals(stack, stop)
        with tracer().start_as_current_span("work"):
            meter().create_counter("vtm.test.work").add(1)
        print("ready", flush=True)
        await stop.wait()
    print("stopped", flush=True)

run_service(ServiceSettings(), serve)
"""
STOP_TIMEOUT_S = 3.0


@pytest.mark.parametrize("unreachable", ["silent_collector", "refusing_collector"])
def test_a_service_with_an_unreachable_collector_exits_by_its_stop_deadline(
        unreachable: str, request: pytest.FixtureRequest) -> None:
    # Why this cannot flake either way: the fault handler ends the process HARD_GRACE_S (5 s)
    # after the stop deadline (3 s after SIGTERM). The unbounded flush lasts at least the
    # exporters' retries (7 s, refused: 1 + 2 + 4 s of backoff) or their timeout (set to
    # ten minutes, silent), so it is always killed mid-flush: status 1, a stack dump. The
    # bounded one ends at the deadline (the graceful stop before it takes milliseconds),
    # leaving the process those 5 s to exit.
    address = request.getfixturevalue(unreachable)
    env = {**os.environ, "VTM_LOG__FORMAT": "json", "VTM_STOP_TIMEOUT_S": str(STOP_TIMEOUT_S),
           "VTM_TELEMETRY__EXPORTER": "otlp", "VTM_TELEMETRY__PROTOCOL": "grpc",
           "VTM_TELEMETRY__ENDPOINT": f"http://{address}",
           "VTM_TELEMETRY__METRICS_EXPORTER": "otlp",
           "VTM_TELEMETRY__METRICS_ENDPOINT": f"http://{address}/api/v1/otlp/v1/metrics",
           "OTEL_EXPORTER_OTLP_TIMEOUT": str(EXPORT_TIMEOUT_S)}
    proc = subprocess.Popen([sys.executable, "-c", SERVICE], cwd=REPO, text=True, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready", proc.communicate(timeout=WAIT_S)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, err
    assert "stopped" in out
    assert "Timeout (" not in err  # no fault handler's dump
    events = [json.loads(line) for line in err.splitlines() if line.startswith("{")]
    cut = [e for e in events if e["event"].startswith("telemetry flush cut short")]
    assert len(cut) == 1, err
    assert cut[0]["level"] == "warning"
    assert cut[0]["cut_short"] == ["tracing", "metrics"]
    # Bounded by what was left of the deadline when the flush began (the floor below it).
    assert TELEMETRY_FLUSH_MIN_S <= cut[0]["flush_timeout_s"] <= STOP_TIMEOUT_S


_EXPORT_WHILE_ALIVE = """
import sys, time
from shared.settings import TelemetrySettings
from shared.telemetry import setup_tracing, tracer
setup_tracing("vtm-test", TelemetrySettings(
    exporter="otlp", protocol="http", endpoint=sys.argv[1], export_delay_s=0.2))
tracer().start_span("work").end()
print("ended", flush=True)
time.sleep(3600)  # killed by the test: no shutdown, no flush at exit
"""


def test_spans_are_exported_while_the_process_lives_by_the_export_delay(
        collector: _Collector) -> None:
    """A crash loses what the batch has not exported, so a service exports every
    ``export_delay_s`` (1 s by default), whatever ``OTEL_BSP_SCHEDULE_DELAY`` says: here it
    says ten minutes, and the span still reaches the collector while the process runs (it is
    then killed, so no exit flush can have sent it)."""
    assert TelemetrySettings().export_delay_s == 1.0
    url = f"http://127.0.0.1:{collector.server_address[1]}/v1/traces"
    env = {**os.environ, "OTEL_BSP_SCHEDULE_DELAY": "600000", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", _EXPORT_WHILE_ALIVE, url], env=env,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ended"
        received = threading.Event()
        deadline = threading.Timer(WAIT_S, received.set)  # hang guard only
        deadline.start()
        while not received.wait(0.05):
            if any(path == "/v1/traces" and size > 0 for path, size in collector.posted):
                break
        deadline.cancel()
        assert proc.poll() is None, "the process ended before its span was exported"
        assert any(path == "/v1/traces" and size > 0 for path, size in collector.posted)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("bad", [0.0, -1.0, 61.0, float("nan")])
def test_an_unusable_export_delay_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="export_delay_s"):
        TelemetrySettings(export_delay_s=bad)
