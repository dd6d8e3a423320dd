"""OpenTelemetry metrics: one meter provider per process, exported by OTLP for dashboards.

Contract (the twin of :mod:`shared.telemetry` for traces):

* :func:`setup_metrics` installs the process's meter provider once (OpenTelemetry refuses to
  replace a global provider); later calls return the installed one. Tests pass their own
  ``reader`` (an ``InMemoryMetricReader``) on the first call.
* Instruments come from :func:`meter`. Made before :func:`setup_metrics` they record nothing
  until it runs (the API's proxy), so a module may create them at import.
* What each service records (names, units, attributes) is listed where it records it and in
  the README ("Metrics"); every name starts with ``vtm.``. Durations are in seconds.

With ``VTM_TELEMETRY__METRICS_EXPORTER=otlp`` the metrics are pushed every
``metrics_interval_s`` to ``metrics_endpoint``: Prometheus' own OTLP receiver
(``--web.enable-otlp-receiver``, docker-compose.yml) or any OpenTelemetry collector.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final

import structlog
from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    ConsoleMetricExporter,
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)

from shared.settings import TelemetrySettings
from shared.telemetry import service_resource

METER_NAME: Final[str] = "vertumnus"

DURATION_BUCKETS_S: Final[tuple[float, ...]] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0,
    20.0, 30.0, 60.0, 120.0,
)
"""Histogram bucket bounds of every duration (s): fine around the 1 s / 5 s / 10 s TTFT
deadlines of Table 2, so attainment can be read off the buckets (OpenTelemetry's default
bounds are for milliseconds)."""

log = structlog.get_logger("vertumnus.metrics")

_lock = threading.Lock()
_provider: MeterProvider | None = None


def _exporter(settings: TelemetrySettings) -> MetricExporter | None:
    if settings.metrics_exporter == "none":
        return None
    if settings.metrics_exporter == "console":
        return ConsoleMetricExporter()
    if settings.metrics_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=settings.metrics_endpoint, insecure=True)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpExporter,
    )

    return HttpExporter(endpoint=settings.metrics_endpoint)


def setup_metrics(service_name: str, settings: TelemetrySettings | None = None, *,
                  reader: MetricReader | None = None,
                  instance_id: str | None = None) -> MeterProvider:
    """Install (once per process) and return the meter provider.

    ``settings`` choose the exporter and its interval; ``reader`` is added as well (tests; a
    reader can only be given on the first call, OpenTelemetry fixes them at construction).
    ``instance_id``: the resource's ``service.instance.id``
    (:func:`shared.telemetry.service_resource`).
    """
    global _provider
    settings = settings or TelemetrySettings()
    with _lock:
        if _provider is None:
            readers: list[MetricReader] = []
            exporter = _exporter(settings)
            if exporter is not None:
                readers.append(PeriodicExportingMetricReader(
                    exporter, export_interval_millis=settings.metrics_interval_s * 1000.0))
            if reader is not None:
                readers.append(reader)
            provider = MeterProvider(
                metric_readers=readers,
                # service.instance.id too: replicas' series must not collide.
                resource=service_resource(service_name, instance_id))
            metrics.set_meter_provider(provider)
            _provider = provider
        return _provider


def meter() -> metrics.Meter:
    """The vertumnus meter (the API's proxy until :func:`setup_metrics` runs)."""
    return metrics.get_meter(METER_NAME)


def duration_histogram(name: str, description: str,
                       buckets: Sequence[float] = DURATION_BUCKETS_S) -> metrics.Histogram:
    """A histogram of seconds with :data:`DURATION_BUCKETS_S` as its bucket bounds."""
    return meter().create_histogram(name, unit="s", description=description,
                                    explicit_bucket_boundaries_advisory=list(buckets))


# Gauge name -> its sources (owner -> how to observe it), see observe_gauge.
_gauges: dict[str, weakref.WeakKeyDictionary[Any, Callable[[Any], Iterable[Observation]]]] = {}


def observe_gauge(name: str, unit: str, description: str, owner: Any,
                  observe: Callable[[Any], Iterable[Observation]]) -> None:
    """Report ``observe(owner)`` under the observable gauge ``name`` while ``owner`` lives.

    Why not ``create_observable_gauge`` per owner: OpenTelemetry hands a second instrument of
    the same name back as the first, dropping the new callbacks, so a second service object in
    one process (tests; a restart in place) would report nothing. Here the gauge is made once
    and asks every live owner. ``observe`` must not hold ``owner`` itself (pass an unbound
    method): the registry keeps owners weakly. It runs on the metric reader's thread.
    """
    with _lock:
        sources = _gauges.get(name)
        if sources is None:
            sources = _gauges[name] = weakref.WeakKeyDictionary()

            def collect(_options: CallbackOptions, _sources: Any = sources
                        ) -> Iterable[Observation]:
                return [o for own, fn in list(_sources.items()) for o in fn(own)]

            meter().create_observable_gauge(name, callbacks=[collect], unit=unit,
                                            description=description)
        sources[owner] = observe


def shutdown_meter_provider(provider: MeterProvider, timeout_s: float) -> bool:
    """Shut ``provider`` down -- each reader collects and exports a last time, then stops --
    taking at most about ``timeout_s`` seconds (finite, >= 0). Returns whether it finished
    in that time; False: what its last exports had not delivered by then is lost (or a
    reader failed to stop, logged).

    The SDK's own bound does it: ``MeterProvider.shutdown(timeout_millis)`` gives its readers
    what is left of it in turn; a ``PeriodicExportingMetricReader`` waits that long for its
    last export, then shuts its exporter down, which ends the exporter's retries (with a
    collector that refuses or does not answer, that export would otherwise go on for the
    exporter's own timeout, ``OTEL_EXPORTER_OTLP_TIMEOUT``, 10 s). Its thread, a daemon, is
    left to end with the process. Unlike the tracer provider's shutdown this one reports
    nothing, so running out of time is what tells a cut-short one (an export that failed
    in time is logged by the SDK, and counts as finished).
    """
    if not (timeout_s >= 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s must be >= 0 and finite, got {timeout_s!r}")
    deadline = time.monotonic() + timeout_s
    try:
        provider.shutdown(timeout_millis=timeout_s * 1000.0)
    except Exception as exc:  # noqa: BLE001 - the SDK's one exception for its readers' failures
        log.warning("metrics shutdown failed", error=str(exc))
        return False
    return time.monotonic() < deadline


def shutdown_metrics(timeout_s: float = 30.0) -> bool:
    """Export what is left and stop the readers, within about ``timeout_s`` seconds
    (:func:`shutdown_meter_provider`; call once, at process exit). Returns whether it
    finished in that time; False: metrics not yet exported are lost. True without a
    provider."""
    with _lock:
        provider = _provider
    if provider is None:
        return True
    return shutdown_meter_provider(provider, timeout_s)


__all__ = ["DURATION_BUCKETS_S", "METER_NAME", "duration_histogram", "meter", "observe_gauge",
           "setup_metrics", "shutdown_meter_provider", "shutdown_metrics"]
