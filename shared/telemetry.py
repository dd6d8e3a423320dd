"""OpenTelemetry tracing: one tracer provider per process, W3C context in NATS headers.

Contract:

* :func:`setup_tracing` installs the process's tracer provider once (OpenTelemetry refuses to
  replace a global provider); later calls return the installed one. Tests pass their own
  ``span_processor`` (e.g. ``SimpleSpanProcessor(InMemorySpanExporter())``) on the first call,
  or :func:`add_span_processor` later.
* :func:`inject` writes ``traceparent`` / ``tracestate`` into a headers dict; :func:`extract`
  reads them back, matching keys case-insensitively (nats-py header keys are case-sensitive
  and some clients send ``Traceparent``). Works for core, request-reply, queue groups and
  JetStream (headers are stored with the message).
* :func:`traceparent_of` (and :func:`is_sampled`, :func:`trace_id_of`) accept exactly the
  ``traceparent`` headers from which :func:`extract` gets a valid span context: the W3C rules
  as OpenTelemetry's propagator applies them. A malformed ``tracestate`` is dropped silently
  (the ``traceparent`` is kept): OpenTelemetry would log a warning for each one, which lets any
  client flood the logs; a well-formed one travels on unchanged.
* :func:`stage_span` opens a child span of an extracted context for one TTFT stage; stage
  names are the :class:`Stage` values so every service names them alike. The parent of every
  stage is the request's root span (conventions.md: one root per request at the gateway, one
  child per TTFT stage), whichever service records it: services pass the root's carrier (the
  IntakeRequest's ``trace_context``), never their own handler's span.
* Sampling (:func:`sampler`, what :func:`setup_tracing` installs): a new trace is kept with
  the settings' ratio (``VTM_TELEMETRY__SAMPLING_RATIO``), except one whose root span is
  created with :data:`ALWAYS_SAMPLE` set true (a reconfiguration's, services/controller/
  tracing.py: rare, planned once per controller window at most, and the traces an operator
  needs most), which is always kept; every other span follows its parent's decision, local or
  carried in a ``traceparent`` (parent-based), so the rank daemons' spans of a
  reconfiguration are kept with it and a request's stages follow the gateway's decision.
* :func:`shutdown_tracing` (a process's exit) flushes within the time it is given and stops
  the exporter when that runs out, the spans still queued lost: an unreachable collector
  must not keep a stopping service alive past its stop deadline (shared/servicemain.py).
"""

from __future__ import annotations

import atexit
import contextlib
import math
import os
import re
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import contextmanager
from enum import StrEnum
from typing import Any, Final

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID, SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanLimits, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

from shared.settings import TelemetrySettings

TRACER_NAME = "vertumnus"

# W3C trace context only: what the gateway, every service and Jaeger agree on.
_PROPAGATOR = TraceContextTextMapPropagator()
_lock = threading.Lock()
_provider: TracerProvider | None = None
_exporters: list[SpanExporter] = []  # those setup_tracing made (shutdown_tracing stops them)
_limits: SpanLimits | None = None  # the installed provider's (read from the OTEL_* limits)


class Stage(StrEnum):
    """Span names of the TTFT stages (design.md "Metrics"): each a direct child of
    ``REQUEST``, except ``PREFILL_RANK``, a rank's part of ``PREFILL`` and its child."""

    REQUEST = "request"  # root, at the gateway
    INTAKE_WAIT = "intake_wait"
    SCHEDULE = "schedule"
    QUEUE_WAIT = "queue_wait"
    PREFILL = "prefill"
    PREFILL_RANK = "prefill_rank"
    KV_TRANSFER = "kv_transfer"
    FIRST_DECODE = "first_decode"


ALWAYS_SAMPLE: Final[str] = "vtm.sampling.always"
"""Span attribute: set true on a root span *when it is created* (the sampler sees only the
attributes given then), its trace is sampled whatever the ratio (:func:`sampler`). Code sets
it, never a client: a request's root keeps to the ratio."""


class _RatioUnlessAlways(Sampler):
    """The root sampler of :func:`sampler`: :data:`ALWAYS_SAMPLE` roots are recorded and
    sampled, every other root is left to ``TraceIdRatioBased(ratio)``."""

    def __init__(self, ratio: float) -> None:
        self._ratio = TraceIdRatioBased(ratio)

    def should_sample(
        self,
        parent_context: otel_context.Context | None,
        trace_id: int,
        name: str,
        kind: trace.SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[trace.Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        if attributes and attributes.get(ALWAYS_SAMPLE) is True:
            parent = trace.get_current_span(parent_context).get_span_context()
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes,
                                  parent.trace_state if parent.is_valid else None)
        return self._ratio.should_sample(parent_context, trace_id, name, kind, attributes,
                                         links, trace_state)

    def get_description(self) -> str:
        return f"AlwaysIf({ALWAYS_SAMPLE})Else{{{self._ratio.get_description()}}}"


def sampler(ratio: float) -> Sampler:
    """The sampler a service's provider uses (``ratio`` in [0, 1]: the settings'
    ``sampling_ratio``): parent-based -- a span with a parent, in the process or carried in a
    ``traceparent``, is sampled exactly when its parent was --; a root is sampled when it is
    created with :data:`ALWAYS_SAMPLE` true, else with probability ``ratio`` (by trace id,
    as ``TraceIdRatioBased``).

    Why: reconfigurations are rare (planned once per controller window at most) and their
    traces are the ones an operator needs; at a ratio of 0.01 the ratio alone lost 99 of 100
    of them.
    Requests, the bulk, stay on the ratio."""
    return ParentBased(_RatioUnlessAlways(ratio))


def _exporter(settings: TelemetrySettings) -> SpanExporter | None:
    if settings.exporter == "none":
        return None
    if settings.exporter == "console":
        return ConsoleSpanExporter()
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
            OTLPSpanExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=settings.endpoint, insecure=True)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    return HttpExporter(endpoint=settings.endpoint)


def service_resource(service_name: str, instance_id: str | None = None) -> Resource:
    """The OTel resource of a service process: ``service.name`` and ``service.instance.id``
    (``instance_id``, the settings' replica id; None: ``host:pid``). Without the instance id,
    replicas of one service (``docker compose up --scale scheduler=2``) export the same
    metric series, whose counters then overwrite each other, and their spans cannot be told
    apart."""
    iid = instance_id or f"{socket.gethostname()}:{os.getpid()}"
    return Resource.create({SERVICE_NAME: service_name, SERVICE_INSTANCE_ID: iid})


def setup_tracing(
    service_name: str,
    settings: TelemetrySettings | None = None,
    *,
    span_processor: SpanProcessor | None = None,
    instance_id: str | None = None,
) -> TracerProvider:
    """Install (once per process) and return the tracer provider.

    ``settings`` choose the exporter and sampling ratio (:func:`sampler`); ``span_processor``
    is added as well (tests). ``instance_id``: the resource's ``service.instance.id``
    (:func:`service_resource`). A second call does not replace the provider; it only adds
    ``span_processor``.
    """
    global _provider
    settings = settings or TelemetrySettings()
    with _lock:
        if _provider is None:
            global _limits
            # Built here (it reads OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT / OTEL_ATTRIBUTE_COUNT_LIMIT)
            # so that span_attribute_limit() reports exactly what the provider enforces.
            _limits = SpanLimits()
            provider = TracerProvider(
                resource=service_resource(service_name, instance_id),
                sampler=sampler(settings.sampling_ratio),
                span_limits=_limits,
            )
            exporter = _exporter(settings)
            if exporter is not None:
                provider.add_span_processor(BatchSpanProcessor(
                    exporter,
                    schedule_delay_millis=settings.export_delay_s * 1000.0))
                _exporters.append(exporter)
            trace.set_tracer_provider(provider)
            _provider = provider
            _tracers.clear()  # a tracer fetched before now was the no-op proxy's
        if span_processor is not None:
            _provider.add_span_processor(span_processor)
        return _provider


def span_attribute_limit() -> int | None:
    """How many attributes one span keeps (None: no limit).

    The installed provider's limit, else what one would get now: the OpenTelemetry SDK's
    ``OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT`` / ``OTEL_ATTRIBUTE_COUNT_LIMIT``, default 128. Past it
    the SDK silently replaces the *oldest* attributes (logging a warning for each), so a
    producer with more to say than the limit must choose what to leave out itself.
    """
    limits = _limits if _limits is not None else SpanLimits()
    return limits.max_span_attributes


def add_span_processor(processor: SpanProcessor) -> None:
    """Add a processor to the installed provider (installing a default one if needed)."""
    setup_tracing(TRACER_NAME, span_processor=processor)


def shutdown_tracer_provider(provider: TracerProvider, timeout_s: float,
                             exporters: Iterable[SpanExporter] = ()) -> bool:
    """Shut ``provider`` down -- its span processors export the spans they hold, then stop --
    taking at most about ``timeout_s`` seconds (finite, >= 0). Returns whether it finished
    in that time.

    Cut short (False): the spans not exported by then are lost. Each of ``exporters`` (those
    behind the provider's processors) is shut down, which ends its retries and closes its
    connection, so the rest of the queue fails at once instead of being retried; the
    provider's exit hook is removed (it would run the same shutdown again at interpreter
    exit); the shutdown's thread, a daemon, is left to end with the process.

    Why a thread: ``TracerProvider.shutdown()`` takes no timeout, and a
    ``BatchSpanProcessor``'s waits for its worker to export every queued batch (up to 30 s in
    SDK 1.45), each retried with backoff for up to the exporter's own timeout
    (``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s): 7 s a batch for a collector that refuses the
    connection, 10 s for one that does not answer. Its ``force_flush(timeout_millis)`` does
    not honour the timeout either (SDK 1.45, opentelemetry-python#4568). The exporter's
    timeout needs no bounding here: a call still in it is abandoned with the thread.
    """
    if not (timeout_s >= 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be >= 0 and finite, got {timeout_s!r}")
    worker = threading.Thread(target=provider.shutdown, name="vtm-tracing-shutdown",
                              daemon=True)
    worker.start()
    worker.join(timeout_s)
    if not worker.is_alive():
        return True
    for exporter in exporters:
        with contextlib.suppress(Exception):  # one failing must not keep the others running
            exporter.shutdown()
    # NOTE: equal bound methods: this is the handler TracerProvider registered (if any).
    atexit.unregister(provider.shutdown)
    return False


def shutdown_tracing(timeout_s: float = 30.0) -> bool:
    """Export the spans still queued and stop the exporter, within about ``timeout_s``
    seconds (:func:`shutdown_tracer_provider`; call once, at process exit). Returns whether
    it finished in that time; False: spans not yet exported are lost. True without a
    provider."""
    with _lock:
        provider, exporters = _provider, tuple(_exporters)
    if provider is None:
        return True
    return shutdown_tracer_provider(provider, timeout_s, exporters)


_tracers: dict[str, trace.Tracer] = {}


def tracer(name: str = TRACER_NAME) -> trace.Tracer:
    """The tracer ``name`` of the installed provider, cached.

    NOTE: ``trace.get_tracer`` builds a new Tracer (and instrumentation scope) on every call,
    ~0.1 ms each; services call this several times per request.
    """
    t = _tracers.get(name)
    if t is None:
        t = _tracers[name] = trace.get_tracer(name)
    return t


def is_sampled(carrier: Mapping[str, str] | None) -> bool:
    """Whether a W3C carrier's ``traceparent`` has the *sampled* flag set.

    With the ``ParentBased`` sampler every descendant of an unsampled parent is dropped, so a
    hot path may skip building spans (and their attributes) when this is False — it must still
    pass the carrier on, so that the next hop keeps the decision instead of starting a root.
    A missing or malformed header counts as not sampled (no parent: the next span would be a
    root, sampled by ratio — callers that open a root span do not ask this).
    """
    tp = traceparent_of(carrier)
    return tp is not None and bool(int(tp[53:55], 16) & 1)


def _header(carrier: Mapping[str, str], name: str) -> str | None:
    """The value of header ``name`` (lowercase), its key matched case-insensitively."""
    value = carrier.get(name)
    if value is None:
        for k, v in carrier.items():
            if k.lower() == name:
                return v
    return value


# The traceparent grammar of OpenTelemetry's TraceContextTextMapPropagator (1.45), written for
# fullmatch: its regex ``^[ \t]*V-T-S-F(?:(-.*)|[ \t]*)$`` under re.search, where ``$`` also
# matches before one final newline and ``.`` never matches one. It is the W3C grammar (lowercase
# hex only) plus the blanks an HTTP field value may carry around it. NOTE: it must stay OTel's,
# not a stricter reading of the spec, or a context would be valid here and absent after
# extract (or the reverse); tests/shared/test_telemetry_traceparent.py compares the two.
_TRACEPARENT_RE: Final = re.compile(
    r"[ \t]*(?P<value>(?P<version>[0-9a-f]{2})-(?P<trace_id>[0-9a-f]{32})"
    r"-(?P<span_id>[0-9a-f]{16})-[0-9a-f]{2}(?P<rest>-[^\n]*?)?)[ \t]*\n?"
)  # ``rest`` is lazy so that the blanks after a future version's fields stay out of ``value``
# OTel refuses (with a warning) a longer header before matching it.
_TRACEPARENT_MAX_LENGTH: Final = 512
_ZERO_TRACE_ID: Final = "0" * 32
_ZERO_SPAN_ID: Final = "0" * 16


def traceparent_of(carrier: Mapping[str, str] | None) -> str | None:
    """The carrier's ``traceparent`` (key matched case-insensitively) if it is well formed,
    without the blanks around it; else None. A cheap stand-in for a full :func:`extract`
    where only validity or the flags matter: it is not None exactly when ``extract`` yields a
    valid span context.

    Well formed (W3C Trace Context, as OpenTelemetry applies it):
    ``version-traceid-parentid-flags``, lowercase hex of 2, 32, 16 and 2 digits, ids not all
    zero, version not ``ff``; version ``00`` ends after the flags (exactly 55 characters), a
    higher (future) version may carry more fields after a ``-``; at most 512 characters in
    all, blanks (space, tab) around the value allowed. In the value returned, ``[3:35]`` is the
    trace id and ``[53:55]`` the flags.
    """
    if not carrier:
        return None
    tp = _header(carrier, "traceparent")
    if not isinstance(tp, str) or len(tp) > _TRACEPARENT_MAX_LENGTH:
        return None
    m = _TRACEPARENT_RE.fullmatch(tp)
    if (m is None or m["version"] == "ff" or (m["version"] == "00" and m["rest"] is not None)
            or m["trace_id"] == _ZERO_TRACE_ID or m["span_id"] == _ZERO_SPAN_ID):
        return None
    return m["value"]


def trace_id_of(carrier: Mapping[str, str] | None) -> str | None:
    """The trace id (32 hex) of the carrier's well-formed ``traceparent``, else None: what a
    handler binds on its log lines before (or without) opening a span of its own."""
    tp = traceparent_of(carrier)
    return None if tp is None else tp[3:35]


# One tracestate list member as OpenTelemetry's TraceState parser (opentelemetry/trace/span.py,
# 1.45) accepts it: a W3C key (lowercase letter first, or ``tenant@vendor``) ``=`` a value of up
# to 256 printable ASCII characters without ``,`` or ``=``, not ending in a blank. NOTE: it must
# stay OTel's (tests/shared/test_telemetry_tracestate.py compares the two): what it lets through,
# OTel parses, and a member it refuses would make OTel log a warning.
_TRACESTATE_MEMBER_RE: Final = re.compile(
    r"(?P<key>[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
_TRACESTATE_MAX_MEMBERS: Final = 32
_TRACESTATE_MAX_LENGTH: Final = 8192


def _tracestate_well_formed(value: str) -> bool:
    """Whether OpenTelemetry turns the ``tracestate`` ``value`` into a TraceState without a
    warning and without discarding it: at most 8192 characters, ``,``-separated members
    (blanks around them and empty ones ignored), each ``key=value`` as
    :data:`_TRACESTATE_MEMBER_RE`, no key twice, at most 32 of them.

    OTel logs a warning for every other header (except a duplicate key, which it discards
    silently), then propagates an empty tracestate; dropping the header beforehand gives the
    same span context without the log line a client could otherwise make us write per request.
    """
    if not isinstance(value, str) or len(value) > _TRACESTATE_MAX_LENGTH:
        return False
    keys: set[str] = set()
    for member in value.split(","):
        member = member.strip(" \t")  # optional whitespace (RFC 9110 §5.6.3), as OTel strips it
        if not member:
            continue
        m = _TRACESTATE_MEMBER_RE.fullmatch(member)
        if m is None or m["key"] in keys or len(keys) == _TRACESTATE_MAX_MEMBERS:
            return False
        keys.add(m["key"])
    return True


class _CarrierGetter(Getter[Mapping[str, str]]):
    """Header lookup ignoring case (``traceparent`` == ``Traceparent``) that hides a malformed
    ``tracestate`` (:func:`_tracestate_well_formed`) from the propagator, so that it drops the
    header without logging about it."""

    def get(self, carrier: Mapping[str, str], key: str) -> list[str] | None:
        name = key.lower()
        value = _header(carrier, name)
        if value is None or (name == "tracestate" and not _tracestate_well_formed(value)):
            return None
        return [value]

    def keys(self, carrier: Mapping[str, str]) -> list[str]:
        return list(carrier.keys())


_GETTER = _CarrierGetter()


def inject(
    headers: MutableMapping[str, str] | None = None, context: otel_context.Context | None = None
) -> dict[str, str]:
    """Write the current (or given) span context into ``headers``; return them as a dict.

    A new dict is made if ``headers`` is None. Without a valid span nothing is written.
    """
    carrier: dict[str, str] = dict(headers) if headers is not None else {}
    _PROPAGATOR.inject(carrier, context=context)
    if headers is not None:
        headers.update(carrier)
    return carrier


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    """The context carried by ``headers`` (an empty context if none or malformed).

    Its span context is valid exactly when :func:`traceparent_of` accepts ``headers``; a
    malformed ``tracestate`` is dropped (an empty tracestate, as OpenTelemetry would make of
    it) and nothing is logged, whatever the headers hold.
    """
    if headers is None or traceparent_of(headers) is None:
        # OTel would refuse it too; asking it anyway would log a warning for an oversized
        # header (a client-made log line per request) and raise on a non-string value.
        return otel_context.Context()
    return _PROPAGATOR.extract(headers, getter=_GETTER)


def _as_context(parent: Mapping[str, str] | otel_context.Context | None
                ) -> otel_context.Context | None:
    """A parent given as carrier headers or as a Context. NOTE: Context is itself a dict
    subclass, so it must be recognised before the Mapping case."""
    if parent is None or isinstance(parent, otel_context.Context):
        return parent
    return extract(parent)


@contextmanager
def stage_span(
    stage: Stage | str,
    *,
    parent: Mapping[str, str] | otel_context.Context | None = None,
    attributes: Mapping[str, Any] | None = None,
    kind: trace.SpanKind = trace.SpanKind.INTERNAL,
    start_time_s: float | None = None,
) -> Iterator[trace.Span]:
    """A span for one stage, child of ``parent`` (headers or a context; None: current span).

    ``start_time_s`` (Unix seconds) back-dates the start, for stages whose beginning was
    observed elsewhere (e.g. queue wait starts when the assignment was accepted).
    """
    ctx = _as_context(parent)
    start_ns = int(start_time_s * 1e9) if start_time_s is not None else None
    with tracer().start_as_current_span(
        str(stage),
        context=ctx,
        kind=kind,
        attributes=dict(attributes) if attributes else None,
        start_time=start_ns,
    ) as span:
        yield span


def record_span(
    stage: Stage | str,
    *,
    start_s: float,
    end_s: float,
    parent: Mapping[str, str] | otel_context.Context | None = None,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """Record a finished stage whose start and end (Unix seconds) were measured already.

    Times whose nanoseconds are no finite number (a bogus stamp of a message, e.g. 1e300 s)
    record nothing: a trace must never fail the work it describes."""
    start_ns, end_ns = start_s * 1e9, max(end_s, start_s) * 1e9
    if not (math.isfinite(start_ns) and math.isfinite(end_ns)):
        return
    ctx = _as_context(parent)
    span = tracer().start_span(
        str(stage),
        context=ctx,
        attributes=dict(attributes) if attributes else None,
        start_time=int(start_ns),
    )
    span.end(end_time=int(end_ns))
