"""The server span of an HTTP answer that no handler recorded (:mod:`services.gateway.httpserver`).

A request the completion logic takes is recorded by that logic's root span (``request``,
:meth:`GatewayService.complete`), whose trace the answer names. Every other answer -- a
refusal of the server (400, 411, 413, 417, 431, 501, 505), of the routes (401, 404, 405), of
a completion before its span opens (a malformed body, 415, a prompt over a limit), the
answers of ``/v1/workers`` (and of ``/health``, but for a successful probe without a
``traceparent``: :data:`UNTRACED_PROBES`), a handler's 500, the 503 of a stop -- gets one
span here (:func:`record_http_span`), so that the ``X-Trace-Id`` it names (and its
``error.trace_id``) can be found in a tracing UI.

The span follows OpenTelemetry's HTTP semantic conventions for a server span:

* name ``{method} {route}`` where the path matched a route of the app (``http.route``), else
  ``{method}``; ``HTTP`` for a method outside the standard ones; kind SERVER; from the
  request's first line to its answer;
* attributes ``http.request.method`` (``_OTHER`` for a method outside the standard ones, the
  method then in ``http.request.method_original``), ``url.scheme``, ``url.path`` (as the
  access line has it: cut at 256 characters, no query), ``http.route`` (where known),
  ``http.response.status_code``, ``error.type`` (the status, for a 5xx); and the gateway's
  own: ``vtm.entry`` (``http``), ``vtm.request_id`` and, for an error, ``vtm.error_code``
  (the status, as the ``request`` span names it), ``vtm.error_type`` and
  ``vtm.error_message`` (the error body's ``type`` and ``message``, the message cut at
  :data:`MAX_MESSAGE_CHARS`); ``vtm.sent`` false where the answer could not be written;
* status ERROR (with the message) for a 5xx, unset otherwise: a 4xx is the client's error,
  not the server's (the conventions' rule for server spans).

Its trace is the answer's: a child of the client's span where the request carried a valid
``traceparent`` (the answer names that trace), else a root whose trace id is the one the
server minted for the answer (:func:`new_trace_id`). The installed sampler decides as for
any span (``ParentBased``: the client's *sampled* flag, else the ratio on that trace id), so
under a flood of bad requests there is one span per answer, built only where sampled, and
export is bounded by the sampler and the batch processor's queue.

NOTE: the OpenTelemetry SDK takes a root span's trace id from its tracer's id generator and
from nowhere else, while the answer's trace id must be known before the span exists (a
refusal's body names it, and is made before it is sent). So this module's tracer (scope
:data:`HTTP_TRACER_NAME`, used by nothing else) has its id generator wrapped
(:class:`_PresetTraceIds`): a root span started here gets the trace id preset for it, in a
context variable, for the one synchronous ``start_span`` call; every other id comes from the
provider's own generator.

Recording never raises: a failure of tracing is logged (at most one line a minute, with the
count of those left out) and changes nothing of the answer.
"""

from __future__ import annotations

import contextvars
import random
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace import Tracer as SdkTracer
from opentelemetry.sdk.trace.id_generator import IdGenerator

from shared.telemetry import extract, trace_id_of, tracer

if TYPE_CHECKING:
    from services.gateway.httpserver import Exchange, LineBudget

log = structlog.get_logger("vertumnus.http")

HTTP_TRACER_NAME: Final[str] = "vertumnus.http"
"""Instrumentation scope of the spans recorded here (its tracer's id generator is wrapped:
module docstring)."""
KNOWN_METHODS: Final[frozenset[str]] = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"})
"""The methods ``http.request.method`` names as they are (RFC 9110 and PATCH); any other is
``_OTHER``, as the conventions ask, so a client cannot make the attribute's values (or the
span names) unbounded."""
MAX_MESSAGE_CHARS: Final[int] = 256
"""``vtm.error_message`` is cut here: a message may quote what the client sent (a path of up
to the head's limit)."""
FAILURE_LINES_PER_S: Final[float] = 1 / 60
"""Budget of log lines for tracing failures (one a minute; the next says how many were
left out): a broken exporter or processor must not turn every answer into a log line."""

UNTRACED_PROBES: Final[frozenset[str]] = frozenset({"/health"})
"""Routes whose successful answers get no span unless the client sent a ``traceparent``
(PROBE NOTE: an orchestrator's liveness probe every few seconds, at the default ratio of 1,
would fill the tracing UI with one span a probe; its failures, 4xx and 5xx, are recorded)."""

_PRESET: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "vtm_http_trace_id", default=None)


def new_trace_id() -> str:
    """A trace id for an answer whose request brought none: 32 lowercase hex digits, all 128
    bits uniformly random and not all zero (what OpenTelemetry's own generator makes).

    NOTE: not ``uuid4().hex``: a UUID's variant bits are the top two of its lower 64 bits,
    the ones ``TraceIdRatioBased`` compares with its bound, so below a ratio of 1/2 no such
    trace id would ever be sampled, and at 3/4 all would."""
    while True:
        value = random.getrandbits(128)
        if value:
            return format(value, "032x")


class _PresetTraceIds(IdGenerator):
    """The provider's id generator, except that a root span started while :data:`_PRESET` is
    set gets that trace id (module docstring, NOTE)."""

    def __init__(self, inner: IdGenerator) -> None:
        self.inner = inner

    def generate_span_id(self) -> int:
        return self.inner.generate_span_id()

    def generate_trace_id(self) -> int:
        preset = _PRESET.get()
        return preset if preset is not None else self.inner.generate_trace_id()

    def is_trace_id_random(self) -> bool:
        # A preset id is random in all its bits (new_trace_id).
        return _PRESET.get() is not None or self.inner.is_trace_id_random()


def _http_tracer() -> SdkTracer | None:
    """This module's tracer, its id generator wrapped; None without an SDK tracer provider
    (nothing is recorded then, by any span)."""
    t = tracer(HTTP_TRACER_NAME)
    if not isinstance(t, SdkTracer):
        return None
    if not isinstance(t.id_generator, _PresetTraceIds):
        t.id_generator = _PresetTraceIds(t.id_generator)
    return t


def record_http_span(ex: Exchange, status: int, *, scheme: str,
                     error: Mapping[str, Any] | None = None, sent: bool = True,
                     failures: LineBudget | None = None) -> None:
    """Record the server span of the answer ``status`` to ``ex`` (module docstring), unless a
    handler recorded the request itself (:attr:`Exchange.traced`). ``error``: the answer's
    error object (``message``, ``type``), if it is one; ``sent``: whether it was written.
    ``failures``: the log budget for tracing failures. Never raises."""
    if ex.traced:
        return
    try:
        _record(ex, status, scheme, error, sent)
    except Exception:
        dropped = failures.take() if failures is not None else 0
        if dropped is not None:
            log.warning("HTTP span not recorded", exc_info=True, status=status,
                        request_id=ex.request_id, trace_id=ex.trace_id,
                        **({"suppressed": dropped} if dropped else {}))


def _record(ex: Exchange, status: int, scheme: str, error: Mapping[str, Any] | None,
            sent: bool) -> None:
    t = _http_tracer()
    if t is None:
        return
    method = ex.method if ex.method in KNOWN_METHODS else "_OTHER"
    name = "HTTP" if method == "_OTHER" else method
    if ex.route is not None:
        name = f"{name} {ex.route}"
    # The span's start: the request's first line, on the wall clock spans use.
    start_ns = time.time_ns() - int((time.monotonic() - ex.started) * 1e9)
    parent = ex.trace_carrier if trace_id_of(ex.trace_carrier) == ex.trace_id else None
    if parent is None and ex.route in UNTRACED_PROBES and status < 400:
        return  # a liveness probe's every few seconds would bury the traces (PROBE NOTE)
    if parent is not None:
        span = t.start_span(name, context=extract(parent), kind=trace.SpanKind.SERVER,
                            start_time=start_ns)
    else:
        preset = _PRESET.set(int(ex.trace_id, 16))
        try:
            # An empty context: a root, whatever span is current (the answer is this
            # request's, not the code's that sends it).
            span = t.start_span(name, context=extract(None), kind=trace.SpanKind.SERVER,
                                start_time=start_ns)
        finally:
            _PRESET.reset(preset)
    try:
        if not span.is_recording():
            return  # not sampled: nothing to build
        attrs: dict[str, Any] = {
            "http.request.method": method, "url.scheme": scheme,
            "http.response.status_code": status, "vtm.entry": "http",
            "vtm.request_id": ex.request_id,
        }
        if method == "_OTHER" and ex.method != "-":
            attrs["http.request.method_original"] = ex.method
        if ex.path != "-":
            attrs["url.path"] = ex.path
        if ex.route is not None:
            attrs["http.route"] = ex.route
        if status >= 400:
            attrs["vtm.error_code"] = status
        if error is not None:
            if isinstance(error.get("type"), str):
                attrs["vtm.error_type"] = error["type"]
            if isinstance(error.get("message"), str):
                attrs["vtm.error_message"] = error["message"][:MAX_MESSAGE_CHARS]
        if not sent:
            attrs["vtm.sent"] = False
        if status >= 500:
            attrs["error.type"] = str(status)
            message = attrs.get("vtm.error_message")
            span.set_status(trace.Status(trace.StatusCode.ERROR, message))
        span.set_attributes(attrs)
    finally:
        span.end()


__all__ = ["HTTP_TRACER_NAME", "KNOWN_METHODS", "new_trace_id", "record_http_span"]
